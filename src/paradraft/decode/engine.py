"""The speculative decoding engine: draft K, verify once, accept a prefix + one verifier token, roll back.

Verifier: `VerifierRunner` (ragged per-row KV cache, rollback by length). Drafter: the cache its `row_cache` gives:
P-EAGLE a `RowCache` (a cache per row, each element at position anchor + depth, the rejected drafts overwritten by
the next pass's context), EAGLE-3 one flat `DraftCache` for the whole batch, each element tagged with its row as
the document id, so the attention rule keeps rows apart.
P-EAGLE drafts K tokens in ONE drafter pass; EAGLE-3 drafts them in K sequential passes that feed the drafter's
hidden state forward. Without a drafter the same engine does plain autoregressive decoding (the baseline).
Acceptance: `verify.greedy_accept` (T = 0) or `verify.rejection_accept` (T > 0), the distributions from
`sampling.process_logits` on both sides.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..errors import UserError
from ..verifier import make_runner
from .sampling import greedy, process_logits, sample
from .verify import greedy_accept, rejection_accept


class GenerationError(UserError, ValueError):
    """A generation request the engine cannot serve (too long for the cache, more drafts than trained)."""


COMPILE_ENV = "PARADRAFT_COMPILE"
AUTO_COMPILE_TOKENS = 2048


def compile_wanted(setting: str, device: str, new_tokens: int | None = None) -> bool:
    """THE rule of every command's --compile: `on` / `off` as asked; `auto` compiles the verifier's steps on a CPU
    for a run of at least AUTO_COMPILE_TOKENS new tokens (None: a run of unknown length, as regenerate's and
    bench's, counts as long), unless $PARADRAFT_COMPILE=off (the test suite sets it: every tiny model would
    compile). Compiling costs ~25 s on 2 cores the first time on a host and ~4 s afterwards (inductor's on-disk
    cache), and saves ~12 ms per bf16 step of the embedded verifier there; a GPU is not compiled by `auto` (the
    compiled path has not run on one)."""
    if setting in ("on", "off"):
        return setting == "on"
    if os.environ.get(COMPILE_ENV, "auto").lower() == "off" or not str(device).startswith("cpu"):
        return False
    return new_tokens is None or new_tokens >= AUTO_COMPILE_TOKENS

PREFILL_TOKENS = 2048  # tokens (padding included) that one prefill forward of several prompts may take


def prefill_groups(lengths: list[int], budget: int = PREFILL_TOKENS) -> list[list[int]]:
    """THE rule of a batched prefill: the rows (indices into `lengths`) in groups, each fed in one verifier forward
    right-padded to its first row, the longest. Longest first; a row joins the group before it while the group's
    padded tokens stay within `budget` and the row is at least 3/4 of the group's longest (the padding is computed
    and thrown away). A prompt at or above the budget goes alone, as every prompt went before."""
    groups: list[list[int]] = []
    for b in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * lengths[g[0]] <= budget and 4 * lengths[b] >= 3 * lengths[g[0]]:
            g.append(b)
        else:
            groups.append([b])
    return groups


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
    """Generate with a verifier and an optional drafter (P-EAGLE or EAGLE-3).

    `compile=True` runs the verifier's decoding and verification steps through torch.compile (VerifierRunner.compile;
    `compile_wanted` is the commands' rule), and P-EAGLE's drafting pass (compile_rows); the first step of each
    kind pays the compilation, `compile_s` says how long. On a CPU the projections take paradraft's kernel where it
    is built (kernels/, verifier/linear.py)."""

    def __init__(self, verifier, drafter=None, max_len: int = 4096, max_len_flag: str | None = None,
                 compile: bool = False):
        self.verifier = verifier
        self.drafter = drafter
        self.max_len_flag = max_len_flag  # the flag that sets max_len in the calling command, if it has one
        self.prefill_tokens = PREFILL_TOKENS  # prefill_groups' budget (1: every prompt alone)
        aux = list(drafter.cfg.aux_layer_ids) if drafter is not None else []
        self.runner = make_runner(verifier, aux, max_batch=1, max_len=max_len)
        # the verifier's decoding and verification steps through torch.compile (runner.compile); the generic
        # runner (Hugging Face's own forward) is not compiled
        self.compiled = bool(compile) and hasattr(self.runner, "compile")
        if self.compiled:
            self.runner.compile()
            if hasattr(drafter, "compile_rows"):  # P-EAGLE's pass on its row cache
                drafter.compile_rows()
        self.vocab = verifier.config.vocab_size
        if drafter is not None:
            drafter.eval()
            if self.runner.device.type == "cpu":
                kernels.move_to_huge_pages(drafter)  # its pass streams its weights too (kernels.on_huge_pages)
            self.draft_ids = drafter.d2t + torch.arange(len(drafter.d2t), device=drafter.d2t.device)  # [Vd]
            # draft ids in ascending target id (paradraft's and speculators' vocabularies): at T=0 the draft argmax
            # maps to the argmax of the full-vocabulary q without building it
            self.ascending = bool((self.draft_ids[1:] > self.draft_ids[:-1]).all())

    @property
    def compile_s(self) -> float:
        """Seconds this engine's steps (and its drafter's compiled passes, which engines sharing the drafter share)
        spent compiling so far (0 when not compiled)."""
        return getattr(self.runner, "compile_s", 0.0) + getattr(self.drafter, "compile_s", 0.0)

    # ----------------------------------------------------------------------------------------- the steps

    def _q(self, draft_logits: torch.Tensor, g: GenerationConfig) -> torch.Tensor:
        """Drafter logits [..., Vd] -> proposal distribution over the TARGET vocabulary [..., V]."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab), float("-inf"))
        full[..., self.draft_ids] = draft_logits
        return process_logits(full, g.temperature, g.top_p, g.top_k)

    def _pick(self, probs: torch.Tensor, st: _State) -> torch.Tensor:
        """The sampling rule on processed probabilities [..., V]: argmax at T=0, else a draw."""
        return greedy(probs) if st.g.temperature <= 0 else sample(probs, st.gen)

    def _token(self, logits: torch.Tensor, st: _State) -> torch.Tensor:
        """The verifier's token from its logits [..., V] -> [...]. At T=0 the argmax of the logits, which is the
        argmax of process_logits' one-hot (the same first index) without building a [..., V] one-hot per step."""
        g = st.g
        return greedy(logits) if g.temperature <= 0 else self._pick(process_logits(logits, g.temperature, g.top_p,
                                                                                       g.top_k), st)

    def prefill(self, st: _State, prompts: list[list[int]]) -> None:
        """The prompts through the verifier, in groups of similar length (`prefill_groups`: one forward per group,
        its rows right-padded to its longest); each row's first token, drawn in row order; the drafter's context."""
        g, dev = st.g, self.runner.device
        for b, p in enumerate(prompts):
            if len(p) + g.max_new_tokens + g.num_speculative_tokens + 1 > self.runner.max_len:
                fix = f"raise {self.max_len_flag}" if self.max_len_flag else "shorten the prompt or --max-new-tokens"
                raise GenerationError(f"prompt {b} of {len(p)} tokens + {g.max_new_tokens} new tokens exceeds the "
                                      f"KV cache of {self.runner.max_len} tokens; {fix}")
        last = [None] * len(prompts)  # each row's logits at its last prompt position [V]
        hidden = [None] * len(prompts)  # each row's aux states over its prompt [len(p), 3H] (with a drafter)
        for group in prefill_groups([len(p) for p in prompts], self.prefill_tokens):
            n = len(prompts[group[0]])  # the longest first
            group = sorted(group)  # rows ascending, as the runner takes them (VerifierRunner.forward)
            toks = torch.tensor([prompts[b] + [0] * (n - len(prompts[b])) for b in group], device=dev)  # [G, n]
            counts = torch.tensor([len(prompts[b]) for b in group], device=dev)  # [G]
            logits, aux = self.runner.forward(toks, rows=torch.tensor(group, device=dev), last_only=True,
                                              counts=None if len(group) == 1 else counts)  # [G, 1, V], [G, n, 3H]
            for j, b in enumerate(group):
                last[b], hidden[b] = logits[j, -1], aux[j, :len(prompts[b])]
        for b, p in enumerate(prompts):  # the first tokens in row order (a sampled run draws as it always did)
            x = int(self._token(last[b], st))
            st.emit(b, [x], accepted=None)
            if self.drafter is not None:
                st.ctx[b] = (torch.tensor(p[1:] + [x], device=dev), hidden[b],
                             torch.arange(1, len(p) + 1, device=dev))

    def plain_step(self, st: _State, active: list[int]) -> None:
        """One verifier pass of plain decoding: one new token per active row."""
        dev = self.runner.device
        t0 = time.perf_counter()
        logits, _ = self.runner.forward(st.pending_tokens(active, dev), rows=st.rows(active, dev))
        nxt = self._token(logits[:, 0], st).tolist()
        dt = time.perf_counter() - t0
        for j, b in enumerate(active):
            st.emit(b, [nxt[j]], accepted=0, verify_s=dt)

    def draft(self, st: _State, active: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K draft tokens per active row from the drafter's protocol -> (draft [R, K] target ids, q [R, K, V])."""
        d = self.drafter
        if len(active) == 1:
            toks, hids, pos = st.ctx[active[0]]
        else:
            toks, hids, pos = (torch.cat([st.ctx[r][i] for r in active]) for i in range(3))
        hids = hids.to(d.fc.weight.dtype)
        counts = [st.ctx[r][0].shape[0] for r in active]
        doc = st.rows(active, toks.device)  # each row is its own document in the shared drafter cache

        def choose(draft_logits):  # [..., Vd] -> (target ids [...], q [..., V], None at T=0: greedy needs no q)
            if st.g.temperature <= 0 and self.ascending:  # the first max in draft order is the first in target order
                return self.draft_ids[greedy(draft_logits)], None
            q = self._q(draft_logits, st.g)
            return self._pick(q, st), q
        return d.propose(toks, hids, pos, counts, doc, st.g.num_speculative_tokens, st.cache, choose)

    def verify(self, st: _State, active: list[int], draft: torch.Tensor, q: torch.Tensor):
        """One verifier pass over [pending, drafts] per row; the acceptance rule; rejected drafts rolled back.
        -> (n_acc [R], next token [R], aux hidden states [R, K+1, 3H])."""
        g, dev = st.g, self.runner.device
        rows = st.rows(active, dev)
        start = self.runner.lengths[rows]  # [R] (a copy: indexed by a tensor)
        inp = torch.cat([st.pending_tokens(active, dev), draft.to(dev)], 1)  # [R, K+1]
        logits, aux = self.runner.forward(inp, rows=rows)
        if g.temperature <= 0:
            n_acc, nxt = greedy_accept(draft, self._token(logits, st))  # [R, K+1] argmax
        else:
            p = process_logits(logits, g.temperature, g.top_p, g.top_k)  # [R, K+1, V]
            n_acc, nxt = rejection_accept(draft, q, p, st.gen)
        self.runner.set_lengths(rows, start + n_acc.to(dev) + 1)  # roll back the rejected drafts
        return n_acc, nxt, aux, start

    def accept(self, st: _State, active: list[int], draft, n_acc, nxt, aux, start, draft_s: float,
               verify_s: float) -> None:
        """Emit each row's accepted drafts + the verifier's token; the drafter's next context slots."""
        dev = aux.device
        drafts, n_acc, nxt, start = draft.tolist(), n_acc.tolist(), nxt.tolist(), start.tolist()  # one read each
        for j, b in enumerate(active):
            m = n_acc[j]
            new = drafts[j][:m] + [nxt[j]]
            st.emit(b, new, accepted=m, draft_s=draft_s, verify_s=verify_s)
            last_pos = start[j]  # position of the pending token fed this round
            st.ctx[b] = (torch.tensor(new, device=dev), aux[j, :m + 1],
                         torch.arange(last_pos + 1, last_pos + m + 2, device=dev))

    def speculative_step(self, st: _State, active: list[int]) -> None:
        """draft -> verify -> accept for the active rows."""
        t0 = time.perf_counter()
        draft, q = self.draft(st, active)  # [R, K], [R, K, V]
        t1 = time.perf_counter()
        n_acc, nxt, aux, start = self.verify(st, active, draft, q)
        t2 = time.perf_counter()
        self.accept(st, active, draft, n_acc, nxt, aux, start, t1 - t0, t2 - t1)

    # ----------------------------------------------------------------------------------------- generate

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], g: GenerationConfig, on_tokens=None) -> list[Result]:
        """Generate for a batch of tokenized prompts. on_tokens(row, new_ids) streams accepted tokens."""
        t_start = time.perf_counter()
        limit = self.drafter.max_draft_tokens() if self.drafter is not None else None
        if limit is not None and g.num_speculative_tokens > limit:
            raise GenerationError(f"--num-speculative-tokens {g.num_speculative_tokens}: this drafter was trained "
                                  f"on {limit} depths; draft at most {limit}")
        self.runner.alloc(len(prompts))
        st = _State(g, len(prompts), on_tokens, device=self.runner.device)
        if self.drafter is not None:
            st.cache = self.drafter.row_cache(len(prompts), self.runner.max_len, g.num_speculative_tokens,
                                              self.runner.device)
        self.prefill(st, prompts)
        active = [b for b in range(len(prompts)) if not st.finished(b)]
        while active:
            if self.drafter is None:
                self.plain_step(st, active)
            else:
                self.speculative_step(st, active)
            still = [b for b in active if not st.finished(b)]
            if self.drafter is not None and len(still) < len(active):
                st.cache.keep_docs(still)  # finished rows' drafter keys leave the attention of the rest
            active = still
        total = time.perf_counter() - t_start
        for r in st.res:
            r.time_s = total
        return st.res


class _State:
    """What one `generate` call carries between steps: results, each row's pending token and new drafter
    context slots, the drafter cache, the sampling generator."""

    def __init__(self, g: GenerationConfig, batch: int, on_tokens=None, device="cpu"):
        self.g, self.on_tokens = g, on_tokens
        self.gen = torch.Generator(device=device).manual_seed(g.seed)  # on the device its samples are drawn on
        self.res = [Result(token_ids=[]) for _ in range(batch)]
        self.pending = [0] * batch  # each row's last token, fed to the verifier next
        self._rows: tuple | None = None  # (active rows, their tensor): `rows`
        self.ctx: list[tuple | None] = [None] * batch  # (tokens, hidden, positions) of new drafter context slots
        self.cache = None  # the drafter's cache (Engine.generate: the drafter's row_cache)
        self.eos = set(g.eos_token_ids)

    def rows(self, active: list[int], device) -> torch.Tensor:
        """The active rows as a tensor [R] on `device`, made again only when they change (every step needs it)."""
        if self._rows is None or self._rows[0] != (active, device):
            self._rows = ((list(active), device), torch.tensor(active, device=device))
        return self._rows[1]

    def pending_tokens(self, active: list[int], device) -> torch.Tensor:
        """The active rows' pending tokens [R, 1], fed to the verifier first."""
        return torch.tensor([[self.pending[b]] for b in active], device=device)

    def emit(self, b: int, new: list[int], accepted: int | None, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        """Row b's new tokens after one verifier pass, cut at max_new_tokens and at the first stop token."""
        r = self.res[b]
        cut = new[: self.g.max_new_tokens - len(r.token_ids)]
        for i, t in enumerate(cut):
            if t in self.eos:
                cut = cut[:i + 1]
                break
        r.token_ids.extend(cut)
        r.num_verifier_passes += 1
        if accepted is not None:
            r.accepted_per_pass.append(accepted)
        r.draft_s += draft_s
        r.verify_s += verify_s
        self.pending[b] = new[-1]
        if self.on_tokens:
            self.on_tokens(b, cut)

    def finished(self, b: int) -> bool:
        """The one stop rule of a row; records why it ended."""
        r = self.res[b]
        if r.token_ids[-1] in self.eos:
            r.finish_reason = "stop"
        elif len(r.token_ids) >= self.g.max_new_tokens:
            r.finish_reason = "length"
        return r.finish_reason is not None
