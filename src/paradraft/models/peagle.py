"""P-EAGLE: K draft tokens in ONE forward pass.

Slot 1 of a draft pass is (token just accepted, verifier aux hidden state); slots 2..K are (mask token embedding,
`mask_hidden` through fc) at consecutive positions. Training covers prediction depths 0..K-1 with Conditional
Drop-token (COD) sampling and the attention rule of attention.py.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .. import kernels
from ..config import ConfigError
from ..data.vocab import template_special_ids
from ..utils import compile_step, graphs_compiled
from .attention import Elements
from .common import DraftCache, DraftConfig, DraftModel, RowCache
from .loss import SlotBatch, depth_reduce, draft_loss, element_targets
from .registry import register


def cod_sample(loss_mask: torch.Tensor, num_depths: int, ratio: float = 0.7, ratio_min: float = 0.2,
               generator: torch.Generator | None = None, document_ids: torch.Tensor | None = None):
    """Conditional Drop-token sampling of training elements.

    loss_mask [T] bool: the target at slot t is trained. Returns (anchor_pos [N], depth [N]) int64:
      depth 0: every position 0..T-1 (the context), in order;
      depth d >= 1: anchors a whose element exists (a + d < T, loss_mask[a + d], same document as a), drawn only
      from the anchors kept at depth d-1 (every kept element has its whole chain); round(max(ratio**d, ratio_min) *
      #valid anchors at depth d) are kept (fewer if the previous depth left fewer candidates).
    """
    T = int(loss_mask.shape[0])
    loss_mask = loss_mask.bool()
    dev = loss_mask.device
    if document_ids is None:
        document_ids = torch.zeros(T, dtype=torch.long, device=dev)
    anchors = [torch.arange(T, device=dev)]
    depths = [torch.zeros(T, dtype=torch.long, device=dev)]
    kept = torch.ones(T, dtype=torch.bool, device=dev)  # anchors alive at the previous depth
    for d in range(1, num_depths):
        valid = torch.zeros(T, dtype=torch.bool, device=dev)
        if d < T:
            valid[: T - d] = loss_mask[d:] & (document_ids[d:] == document_ids[: T - d])
        cand = torch.nonzero(valid & kept).flatten()
        n_keep = min(int(cand.numel()), int(round(max(ratio ** d, ratio_min) * int(valid.sum()))))
        if n_keep == 0:
            break
        perm = torch.randperm(int(cand.numel()), generator=generator, device="cpu")[:n_keep].to(dev)
        chosen = cand[perm].sort().values
        kept = torch.zeros(T, dtype=torch.bool, device=dev)
        kept[chosen] = True
        anchors.append(chosen)
        depths.append(torch.full_like(chosen, d))
    return torch.cat(anchors), torch.cat(depths)


def choose_mask_token_id(tokenizer, vocab_size: int, token_freqs=None) -> int:
    """A verifier-vocabulary token that never appears in text, for the mask embedding.

    Preference: an embedding row beyond the tokenizer (padding rows, e.g. Qwen3); else a special token that the
    chat template does not emit and that is not bos/eos/pad/unk (named 'mask'/'reserved' first); else the id with
    the lowest frequency in the training data.
    """
    n = len(tokenizer)
    if vocab_size > n:
        return n
    used = set(template_special_ids(tokenizer)) | {
        t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        if t is not None}
    cands = []
    for tid, tok in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items()):
        if getattr(tok, "special", False) and tid not in used and tid < vocab_size:
            rank = 0 if ("mask" in tok.content.lower() or "reserved" in tok.content.lower()) else 1
            if token_freqs is None or int(token_freqs[tid]) == 0:
                cands.append((rank, tid))
    if cands:
        return min(cands)[1]
    if token_freqs is not None:
        return int(torch.as_tensor(token_freqs[:vocab_size]).argmin())
    raise ValueError("no unused token for the P-EAGLE mask; pass mask_token_id explicitly")


@register
class PEagleDrafter(DraftModel):
    """The shared drafter plus a trainable mask-token embedding row and a learnable `mask_hidden` [1, 3Hv]."""

    algorithm = "peagle"
    architecture = "PEagleSpeculator"
    # depth d weighted 0.3^d: ahead of 0.5^d, 0.5^d ahead of 0.7^d and 0.7^d ahead of equal weights, from 351k
    # trained tokens on, two seeds each at 351k and 710k (BENCHMARKS.md, "Depth decay at 351k and 710k tokens").
    # Runs saved before any decay was the default trained with equal weights (unset_loss_decay); those saved since
    # record theirs
    default_loss_decay = 0.3
    unset_loss_decay = 1.0
    has_mask_hidden = True
    # speculators' P-EAGLE defaults, together: Muon + AdamW (weight decay 0.01, beta2 0.999), linear decay after 1
    # warmup step, its q/k-norm layer (served by vLLM for any verifier) with norm before residual. At the reference
    # recipe's budget (600 steps, 0.82M trained tokens) they lift the held-out estimate from 1.40 to 1.51 and depth-0
    # accuracy from 34% to 42%; at the quickstart's, by 0.03, and only together (BENCHMARKS.md, "Where the
    # reference's lead comes from" and "The reference's defaults at the recipe's budget")
    train_defaults = {**DraftModel.train_defaults, "optimizer": "muon", "weight_decay": 0.01, "adam_beta2": 0.999,
                      "lr_schedule": "linear", "warmup_steps": 1, "draft_layer": "qwen3",
                      "norm_before_residual": True}

    # ---- the drafter protocol (common.py)
    @classmethod
    def resolve_train_config(cls, cfg) -> None:
        if cfg.num_speculative_tokens is None:
            cfg.num_speculative_tokens = min(7, cfg.num_depths)
        elif cfg.num_speculative_tokens > cfg.num_depths:
            raise ConfigError(f"--num-speculative-tokens {cfg.num_speculative_tokens} > --num-depths "
                              f"{cfg.num_depths}: a P-EAGLE drafter drafts only the depths it was trained on")
        super().resolve_train_config(cfg)

    @classmethod
    def train_args(cls, cfg) -> dict:
        return {"num_depths": cfg.num_depths, "cod_ratio": cfg.cod_ratio, "cod_ratio_min": cfg.cod_ratio_min,
                "loss_decay": cfg.loss_decay, "out_of_vocab": cfg.train_out_of_vocab}

    @classmethod
    def scored_depths(cls, cfg) -> int:
        return cfg.num_depths

    @classmethod
    def validation_args(cls, args: dict) -> dict:
        return {**args, "cod_ratio": 1.0, "cod_ratio_min": 1.0}  # no COD: every depth at every position

    @classmethod
    def config_overrides(cls, cfg, tokenizer, vocab_size: int, token_freqs) -> dict:
        mask = choose_mask_token_id(tokenizer, vocab_size, token_freqs) if tokenizer is not None else vocab_size - 1
        return {"mask_token_id": mask, "num_depths": cfg.num_depths}

    def config_keys(self) -> dict:
        return {"mask_token_id": self.cfg.mask_token_id, "parallel_drafting": True}

    @classmethod
    def speculative_config_keys(cls) -> dict:
        return {"parallel_drafting": True}

    def checkpoint_state_dict(self, sd: dict) -> dict:
        sd = dict(sd)
        emb = sd["embed_tokens.weight"].clone()  # vLLM reads the trained mask row from the embedding table
        emb[self.cfg.mask_token_id] = sd.pop("mask_embedding").to(emb.dtype)
        sd["embed_tokens.weight"] = emb
        return sd

    @classmethod
    def state_dict_from_checkpoint(cls, sd: dict, cfg: DraftConfig) -> dict:
        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.vocab_size or "mask_hidden" not in sd:
            raise ValueError("a P-EAGLE checkpoint needs mask_token_id (in the vocabulary) and mask_hidden")
        sd = dict(sd)
        sd["mask_embedding"] = sd["embed_tokens.weight"][cfg.mask_token_id].clone()
        if sd["mask_hidden"].dim() == 3:
            sd["mask_hidden"] = sd["mask_hidden"].reshape(1, -1)
        return sd

    def max_draft_tokens(self) -> int | None:
        return self.cfg.num_depths

    def propose(self, tokens, hidden, positions, counts, doc, k, cache, choose):
        """ONE drafter pass drafts all k positions of every row (on a RowCache: `draft_rows`)."""
        if isinstance(cache, RowCache):
            return choose(self.draft_rows(tokens, hidden, positions, counts, doc, k, cache))  # [R, k], [R, k, V]
        return choose(self.draft(tokens, hidden, positions, k, cache, doc=doc, counts=counts))

    def row_cache(self, batch: int, max_len: int, k: int, device=None) -> RowCache:
        # a pass writes up to k - 1 drafts and k padding places after a row's context (draft_rows)
        places = max_len + 2 * k + 2
        return RowCache(self.cfg, batch, places, device or self.fc.weight.device, self.fc.weight.dtype)

    def __init__(self, cfg: DraftConfig):
        if cfg.mask_token_id is None:
            raise ValueError("P-EAGLE needs cfg.mask_token_id")
        super().__init__(cfg)
        H = cfg.hidden_size
        self.mask_embedding = nn.Parameter(torch.zeros(H))  # written to embed_tokens.weight[mask_token_id]
        self.mask_hidden = nn.Parameter(torch.randn(1, 3 * cfg.verifier_hidden) * 0.02)
        self._compiled_rows = None  # compile_rows()
        self._index_cache: dict = {}  # draft_rows' (counts, arange) tensors per (counts, elements, device)
        self.compile_s = 0.0  # seconds draft_rows' compiled passes spent compiling

    def init_from_verifier(self, verifier, d2t, t2d, norm: bool = False) -> None:
        super().init_from_verifier(verifier, d2t, t2d, norm)
        with torch.no_grad():
            self.mask_embedding.copy_(self.embed_tokens.weight[self.cfg.mask_token_id])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(tokens)  # [N, H]
        is_mask = (tokens == self.cfg.mask_token_id)[:, None]
        return torch.where(is_mask, self.mask_embedding.to(e.dtype).expand_as(e), e)

    def element_inputs(self, tokens0: torch.Tensor, hidden0: torch.Tensor, depth: torch.Tensor):
        """Inputs of elements: depth 0 (token, verifier hidden), depth >= 1 (mask token, mask_hidden).

        tokens0 [N], hidden0 [N, 3Hv] (used where depth == 0) -> emb [N, H], projected hidden [N, H].
        """
        is0 = depth == 0
        tok = torch.where(is0, tokens0, torch.full_like(tokens0, self.cfg.mask_token_id))
        hid = torch.where(is0[:, None], hidden0, self.mask_hidden.to(hidden0.dtype).expand_as(hidden0))
        return self.embed(tok), self.project(hid)

    def train_forward(self, b: SlotBatch, num_depths: int, ratio: float = 0.7, ratio_min: float = 0.2,
                      generator: torch.Generator | None = None, decay: float = 1.0, anchors=None,
                      out_of_vocab: bool = False, prefix: DraftCache | None = None, counts: list[int] | None = None,
                      context_kv: bool = False):
        """Loss and per-depth stats of one packed sequence; `anchors` = (anchor, depth) overrides COD sampling.
        `prefix`, `counts`, `context_kv`: one partition of a longer sequence (see `DraftModel.training_loss`)."""
        if anchors is None:
            anchors = cod_sample(b.valid, num_depths, ratio, ratio_min, generator, document_ids=b.doc)
        anchor, depth = (t.to(b.tokens.device) for t in anchors)
        emb, hid = self.element_inputs(b.tokens[anchor], b.hidden[anchor], depth)
        elems = Elements(anchor, depth, b.doc[anchor])
        h, kv = self.run_layers(emb, hid, b.positions[anchor] + depth, elems, prefix)
        logits = self.logits(h)  # [N, Vd]
        tgt, valid = element_targets(b, anchor, depth)
        kl, trained, correct = draft_loss(logits, b, tgt, valid, self.d2t, self.t2d, out_of_vocab)
        loss, stats = depth_reduce(kl, trained, correct, valid, depth, num_depths, decay, counts)
        stats["num_elements"] = int(anchor.numel())
        stats["elements"] = (anchor.detach(), depth.detach(), correct.detach(), valid.detach())
        if context_kv:  # the context elements come first (cod_sample's order)
            n0 = int((depth == 0).sum())
            stats["context_kv"] = [(k[:, :, :n0], v[:, :, :n0]) for k, v in kv]
        return loss, stats, logits, (anchor, depth)

    def train_elements(self, b: SlotBatch, generator: torch.Generator | None = None, num_depths: int = 8,
                       cod_ratio: float = 0.7, cod_ratio_min: float = 0.2, **_):
        """COD's draw for the whole sequence: every position at depth 0, then the kept anchors of depths 1.."""
        return cod_sample(b.valid, num_depths, cod_ratio, cod_ratio_min, generator, document_ids=b.doc)

    def training_loss(self, b: SlotBatch, generator: torch.Generator | None = None, num_depths: int = 8,
                      cod_ratio: float = 0.7, cod_ratio_min: float = 0.2, loss_decay: float = 1.0,
                      out_of_vocab: bool = False, anchors=None, prefix=None, counts=None, context_kv=False, **_):
        """Training loss and stats (what the generic trainer calls through `forward`)."""
        loss, stats, _, _ = self.train_forward(b, num_depths, cod_ratio, cod_ratio_min, generator, loss_decay,
                                               anchors=anchors, out_of_vocab=out_of_vocab, prefix=prefix,
                                               counts=counts, context_kv=context_kv)
        return loss, stats

    def draft_rows(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, counts: list[int],
                   rows: torch.Tensor, k: int, cache: RowCache) -> torch.Tensor:
        """`draft` on a RowCache (attention.py's second form of the rule): the same draft logits [R, k, Vd].

        Row r (cache row rows[r]) has counts[r] new context slots of tokens [n], hidden [n, 3Hv], positions [n]
        (concatenated, each row's continuing its earlier ones). Its k - 1 mask slots follow its last context slot,
        and a row with fewer slots than the most is padded after them (mask slots, whose places are never read),
        so the pass is one block of [R, max(counts) + k - 1] elements. A block of more than ATTENTION_QUERIES
        elements per row (a prompt's first pass) runs row by row: padding ragged prompts would cost more than it
        saves.
        """
        R, c_max = len(counts), max(counts)
        n = c_max + k - 1
        if R > 1 and n > kernels.ATTENTION_QUERIES:
            ends = [0, *torch.tensor(counts).cumsum(0).tolist()]
            return torch.cat([self.draft_rows(tokens[a:b], hidden[a:b], positions[a:b], [b - a], rows[r:r + 1], k,
                                              cache) for r, (a, b) in enumerate(zip(ends, ends[1:]))])
        dev = tokens.device
        key = (tuple(counts), n, dev)  # the pass's small index tensors, made once per shape (a pass is ~1 ms)
        idx = self._index_cache.get(key)
        if idx is None:
            if len(self._index_cache) > 256:
                self._index_cache.clear()
            idx = self._index_cache[key] = (torch.tensor(counts, device=dev), torch.arange(n, device=dev))
        eager = self._compiled_rows is None or n > kernels.ATTENTION_QUERIES  # a prompt's pass stays eager
        if not eager and tokens.shape[0] == 1:
            # one new slot (one row, no draft accepted) goes in as two, the slot repeated: dynamo specialises a
            # dimension of size 1 even where it is marked dynamic, so a pass of one slot and a pass of several were
            # two compilations, and the second one fell inside a timed run when a warm-up accepted nothing (1.4 s
            # for a tiny GPT-OSS drafter on a 2-core CPU). The repeat is never read: a row's context slots are its
            # first c, and the others are masks.
            tokens, hidden, positions = tokens.repeat(2), hidden.repeat(2, 1), positions.repeat(2)  # [2], [2, 3Hv]
        args = (tokens, hidden, positions, *idx, rows, cache.origin, cache.kv, k)
        if eager:
            return self._rows_pass(*args)
        for t in args[:7]:  # slots, rows, elements per row and the batch vary from pass to pass and call to call
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for kc, vc in cache.kv:  # a generate call's rows and places
            for t in (kc, vc):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
        graphs = graphs_compiled()
        t0 = time.perf_counter()
        out = self._compiled_rows(*args)
        if graphs_compiled() > graphs:  # this pass compiled (or recompiled) a graph
            self.compile_s += time.perf_counter() - t0
        return out

    def compile_rows(self) -> None:
        """Compile `draft_rows`' pass (torch.compile, inductor) for passes of up to ATTENTION_QUERIES elements per
        row: its ~100 small operations cost more than its weights' read on a CPU. The first pass of one row and of
        several pays the compilation, added to `compile_s`."""
        if self._compiled_rows is None:
            # this drafter's own code, its modules unguarded
            self._compiled_rows = compile_step(self._rows_pass, self.mask_hidden.device)

    def _rows_pass(self, tokens, hidden, positions, c, j, rows, origins, kv, k: int) -> torch.Tensor:
        """draft_rows' pass: the new slots tokens [N], hidden [N, 3Hv], positions [N], c [R] of them each row's,
        j = arange(n) (elements per row: max(c) + k - 1), rows [R], the RowCache's origin [B] (updated) and kv
        -> logits [R, k, Vd]."""
        R, n = c.shape[0], j.shape[0]
        first = c.cumsum(0) - c  # [R] each row's first slot in tokens
        last = positions[first + c - 1]  # [R] each row's last context position: its drafts' anchor
        ctx = j[None] < c[:, None]  # [R, n]: context slots, then k - 1 drafts, then padding
        src = (first[:, None] + j[None]).clamp(max=tokens.shape[0] - 1)  # [R, n] index into the new slots
        pos = torch.where(ctx, positions[src], last[:, None] + 1 + j[None] - c[:, None])  # [R, n] anchor + depth
        origin = origins[rows]
        origin = torch.where(origin < 0, positions[first], origin)  # [R] a row's first pass sets its origin
        origins[rows] = origin
        tok = torch.where(ctx, tokens[src], self.cfg.mask_token_id)  # [R, n]
        hid = torch.where(ctx[..., None], hidden[src], self.mask_hidden.to(hidden.dtype))  # [R, n, 3Hv]
        emb = self.embed(tok.reshape(R * n)).view(R, n, -1)  # [R, n, H]
        h = self.run_rows(emb, self.project(hid.reshape(R * n, -1)).view(R, n, -1), pos, pos - origin[:, None],
                          rows, kv)  # [R, n, H]
        take = (c - 1)[:, None] + torch.arange(k, device=c.device)[None]  # [R, k]: the last context slot, drafts
        return self.logits(h[torch.arange(R, device=c.device)[:, None], take])  # [R, k, Vd]

    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, k: int,
              cache: DraftCache | None = None, doc: torch.Tensor | None = None,
              counts: list[int] | None = None) -> torch.Tensor:
        """ONE forward pass: new context slots + (k-1) mask slots per row -> draft logits [R, k, Vd] ([k, Vd] for
        a single row given without `counts`).

        tokens [n], hidden [n, 3Hv], positions [n] are the new context slots of all rows, concatenated (anchor =
        position); counts[r] of them belong to row r, whose document id is doc[r] (default: one row, doc 0). The
        cache holds the context slots of earlier rounds and receives the new ones (mask slots are never cached).
        """
        single = counts is None
        counts = counts or [int(tokens.shape[0])]
        dev = tokens.device
        R = len(counts)
        doc = torch.zeros(R, dtype=torch.long, device=dev) if doc is None else doc
        n = int(tokens.shape[0])
        ends = torch.tensor(counts, device=dev).cumsum(0) - 1  # each row's last context slot
        ctx_doc = doc.repeat_interleave(torch.tensor(counts, device=dev))
        depth = torch.cat([torch.zeros(n, dtype=torch.long, device=dev), torch.arange(1, k, device=dev).repeat(R)])
        anchor = torch.cat([positions, positions[ends].repeat_interleave(k - 1)])
        tok0 = torch.cat([tokens, tokens.new_zeros(R * (k - 1))])
        hid0 = torch.cat([hidden, hidden.new_zeros(R * (k - 1), hidden.shape[1])])
        emb, hid = self.element_inputs(tok0, hid0, depth)
        elems = Elements(anchor, depth, torch.cat([ctx_doc, doc.repeat_interleave(k - 1)]))
        h, kv = self.run_layers(emb, hid, anchor + depth, elems, cache)
        if cache is not None:
            cache.append([(kk[:, :, :n], vv[:, :, :n]) for kk, vv in kv], elems.slice(0, n))
        slots = torch.cat([h[ends][:, None], h[n:].view(R, k - 1, h.shape[-1])], 1)  # [R, k, H]
        logits = self.logits(slots)  # [R, k, Vd]
        return logits[0] if single else logits
