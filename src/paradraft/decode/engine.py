"""The speculative decoding engine: draft K, verify once, accept a prefix + one verifier token, roll back.

Verifier: `VerifierRunner` (ragged per-row KV cache, rollback by length). Drafter: one flat `DraftCache` for the
whole batch, each element tagged with its row as the document id, so the attention rule keeps rows apart.
P-EAGLE drafts K tokens in ONE drafter pass; EAGLE-3 drafts them in K sequential passes that feed the drafter's
hidden state forward. Without a drafter the same engine does plain autoregressive decoding (the baseline).
Acceptance: `verify.greedy_accept` (T = 0) or `verify.rejection_accept` (T > 0), the distributions from
`sampling.process_logits` on both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..models.common import DraftCache
from .runner import VerifierRunner
from .sampling import process_logits, sample
from .verify import greedy_accept, rejection_accept


class GenerationError(UserError, ValueError):
    """A generation request the engine cannot serve (too long for the cache, more drafts than trained)."""

@dataclass
class GenerationConfig:
    """How to decode."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    num_speculative_tokens: int = 7
    seed: int = 0
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class Result:
    """One prompt's output and what it cost."""

    token_ids: list[int]
    num_verifier_passes: int = 0
    accepted_per_pass: list[int] = field(default_factory=list)
    time_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    finish_reason: str | None = None  # "stop" (ended by a stop token) | "length" (reached max_new_tokens)


class Engine:
    """Generate with a verifier and an optional drafter (P-EAGLE or EAGLE-3)."""

    def __init__(self, verifier, drafter=None, max_len: int = 4096):
        self.verifier = verifier
        self.drafter = drafter
        aux = list(drafter.cfg.aux_layer_ids) if drafter is not None else []
        self.runner = VerifierRunner(verifier, aux, max_batch=1, max_len=max_len)
        self.vocab = verifier.config.vocab_size
        if drafter is not None:
            drafter.eval()
            self.draft_ids = drafter.d2t + torch.arange(len(drafter.d2t), device=drafter.d2t.device)  # [Vd]

    # ----------------------------------------------------------------------------------------- drafting

    def _q(self, draft_logits: torch.Tensor, g: GenerationConfig) -> torch.Tensor:
        """Drafter logits [..., Vd] -> proposal distribution over the TARGET vocabulary [..., V]."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab), float("-inf"))
        full[..., self.draft_ids] = draft_logits
        return process_logits(full, g.temperature, g.top_p, g.top_k)

    @torch.inference_mode()
    def _draft(self, ctx: list[tuple], rows: list[int], cache: DraftCache, g: GenerationConfig, gen):
        """K draft tokens per row: -> (draft [R, K] target ids, q [R, K, V])."""
        d = self.drafter
        K = g.num_speculative_tokens
        toks = torch.cat([ctx[r][0] for r in rows])
        hids = torch.cat([ctx[r][1] for r in rows]).to(d.fc.weight.dtype)
        pos = torch.cat([ctx[r][2] for r in rows])
        counts = [int(ctx[r][0].numel()) for r in rows]
        doc = torch.tensor(rows)  # each row is its own document in the shared drafter cache
        if d.cfg.algorithm == "peagle":  # ONE drafter pass for all K
            q = self._q(d.draft(toks, hids, pos, K, cache, doc=doc, counts=counts), g)  # [R, K, V]
            draft = q.argmax(-1) if g.temperature <= 0 else sample(q, gen)
            return draft, q
        # EAGLE-3: a context step, then K-1 chain steps feeding the drafter's own hidden state forward
        logits, h = d.context_step(toks, hids, pos, cache, doc=doc.repeat_interleave(torch.tensor(counts)))
        keep = len(cache)
        ends = torch.tensor(counts).cumsum(0) - 1
        hp, anchor = h[ends], pos[ends]  # [R, H], [R]
        q = self._q(logits[ends], g)
        qs, drafts = [], []
        for s in range(1, K + 1):
            x = q.argmax(-1) if g.temperature <= 0 else sample(q, gen)  # [R]
            qs.append(q)
            drafts.append(x)
            if s == K:
                break
            lg, hp = d.chain_step(x, hp, anchor, s, cache, doc=doc)
            q = self._q(lg, g)
        cache.truncate(keep)  # chain elements are speculative: only context slots stay
        return torch.stack(drafts, 1), torch.stack(qs, 1)

    # ----------------------------------------------------------------------------------------- generate

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], g: GenerationConfig, on_tokens=None) -> list[Result]:
        """Generate for a batch of tokenized prompts. on_tokens(row, new_ids) streams accepted tokens."""
        t_start = time.perf_counter()
        depths = getattr(getattr(self.drafter, "cfg", None), "num_depths", None)
        if depths is not None and g.num_speculative_tokens > depths:
            raise GenerationError(f"--num-speculative-tokens {g.num_speculative_tokens}: this P-EAGLE drafter was "
                                  f"trained on {depths} depths; draft at most {depths}")
        gen = torch.Generator().manual_seed(g.seed)
        B = len(prompts)
        dev = self.runner.device
        self.runner.alloc(B)
        res = [Result(token_ids=[]) for _ in range(B)]
        eos = set(g.eos_token_ids)
        ctx: list[tuple | None] = [None] * B  # new drafter context slots per row (tokens, hidden, positions)
        pending = torch.zeros(B, dtype=torch.long)
        for b, p in enumerate(prompts):  # prefill row by row (ragged prompts)
            if len(p) + g.max_new_tokens + g.num_speculative_tokens + 1 > self.runner.max_len:
                raise GenerationError(f"prompt {b} of {len(p)} tokens + {g.max_new_tokens} new tokens exceeds the "
                                      f"KV cache ({self.runner.max_len} tokens, --max-len)")
            logits, aux = self.runner.forward(torch.tensor([p], device=dev), rows=torch.tensor([b], device=dev))
            probs = process_logits(logits[0, -1], g.temperature, g.top_p, g.top_k)
            x = int(probs.argmax()) if g.temperature <= 0 else int(sample(probs, gen))
            pending[b] = x
            res[b].token_ids.append(x)
            res[b].num_verifier_passes += 1
            if on_tokens:
                on_tokens(b, [x])
            if self.drafter is not None:
                toks = torch.tensor(p[1:] + [x])
                ctx[b] = (toks, aux[0].float(), torch.arange(1, len(p) + 1))
        def finished(r: Result) -> bool:  # the one stop rule of a row; records why it ended
            if r.token_ids[-1] in eos:
                r.finish_reason = "stop"
            elif len(r.token_ids) >= g.max_new_tokens:
                r.finish_reason = "length"
            return r.finish_reason is not None

        active = [b for b in range(B) if not finished(res[b])]
        cache = DraftCache()
        while active:
            rows = torch.tensor(active, device=dev)
            if self.drafter is None:
                t0 = time.perf_counter()
                logits, _ = self.runner.forward(pending[active][:, None].to(dev), rows=rows)
                probs = process_logits(logits[:, 0], g.temperature, g.top_p, g.top_k)
                nxt = probs.argmax(-1) if g.temperature <= 0 else sample(probs, gen)
                dt = time.perf_counter() - t0
                for j, b in enumerate(active):
                    x = int(nxt[j])
                    res[b].token_ids.append(x)
                    res[b].num_verifier_passes += 1
                    res[b].accepted_per_pass.append(0)
                    res[b].verify_s += dt
                    pending[b] = x
                    if on_tokens:
                        on_tokens(b, [x])
            else:
                t0 = time.perf_counter()
                draft, q = self._draft(ctx, active, cache, g, gen)  # [R, K], [R, K, V]
                t1 = time.perf_counter()
                start = self.runner.lengths[rows].clone()
                inp = torch.cat([pending[active][:, None], draft], 1).to(dev)  # [R, K+1]
                logits, aux = self.runner.forward(inp, rows=rows)
                p = process_logits(logits, g.temperature, g.top_p, g.top_k)  # [R, K+1, V]
                if g.temperature <= 0:
                    n_acc, nxt = greedy_accept(draft, p.argmax(-1))
                else:
                    n_acc, nxt = rejection_accept(draft, q, p, gen)
                self.runner.set_lengths(rows, start + n_acc.to(dev) + 1)  # roll back the rejected drafts
                t2 = time.perf_counter()
                for j, b in enumerate(active):
                    m = int(n_acc[j])
                    new = draft[j, :m].tolist() + [int(nxt[j])]
                    room = g.max_new_tokens - len(res[b].token_ids)
                    cut = new[:room]
                    for i, t in enumerate(cut):
                        if t in eos:
                            cut = cut[:i + 1]
                            break
                    res[b].token_ids.extend(cut)
                    res[b].num_verifier_passes += 1
                    res[b].accepted_per_pass.append(m)
                    res[b].draft_s += t1 - t0
                    res[b].verify_s += t2 - t1
                    pending[b] = new[-1]
                    last_pos = int(start[j])  # position of the pending token fed this round
                    ctx[b] = (torch.tensor(new), aux[j, :m + 1].float(),
                              torch.arange(last_pos + 1, last_pos + m + 2))
                    if on_tokens:
                        on_tokens(b, cut)
            still = [b for b in active if not finished(res[b])]
            if self.drafter is not None and len(still) < len(active):
                cache.keep_docs(still)  # finished rows' drafter keys leave the attention of the rest
            active = still
        total = time.perf_counter() - t_start
        for r in res:
            r.time_s = total
        return res
