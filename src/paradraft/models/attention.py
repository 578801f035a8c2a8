"""The ONE attention rule of drafting, and its two backends.

Every drafter token is an *element* (anchor a, depth d, document doc):
  depth 0      the context: the drafter slot at sequence position a (real token + verifier hidden state);
  depth d >= 1 the d-th token drafted ahead from anchor a (P-EAGLE: mask token + mask_hidden;
               EAGLE-3 training-time test: unroll step d).
Rule: element (a, d) may attend to
  - every depth-0 element at anchor <= a in the same document, and
  - the elements of its own chain (same anchor, same document) with depth <= d.
Nothing else. With only depth-0 elements this is plain causal attention within documents.

The same rule drives: training (dense SDPA mask on CPU, flex_attention block mask on GPU), inference with a KV
cache (the cache keeps each element's anchor/depth/doc), the tests and the benchmarks.

At inference the rule has a second, equivalent form (`row_attention`): each row (document) keeps its own cache,
and element (a, d) sits at position a + d of it. A row's context slots are consecutive positions and its drafts
follow its last context slot (a + 1, ..., a + K - 1), so the keys at positions <= a + d are exactly the context at
anchors <= a and the chain's depths <= d: the rule is causal attention by position within a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import kernels
from ..utils import release_free_memory


def may_attend(q_anchor, q_depth, q_doc, k_anchor, k_depth, k_doc):
    """The rule, elementwise and broadcastable (works on tensors and inside flex-attention mask_mods)."""
    context = (k_depth == 0) & (k_anchor <= q_anchor)
    chain = (k_anchor == q_anchor) & (k_depth <= q_depth)
    return (q_doc == k_doc) & (context | chain)


@dataclass
class Elements:
    """Per-element metadata [N] each: anchor position, depth, document id."""

    anchor: torch.Tensor  # [N] int64
    depth: torch.Tensor  # [N] int64
    doc: torch.Tensor  # [N] int64

    def __len__(self) -> int:
        return int(self.anchor.shape[0])

    @staticmethod
    def cat(parts: list["Elements"]) -> "Elements":
        """Concatenate element lists."""
        return Elements(torch.cat([p.anchor for p in parts]), torch.cat([p.depth for p in parts]),
                        torch.cat([p.doc for p in parts]))

    def slice(self, start: int, end: int | None = None) -> "Elements":
        """Elements [start:end]."""
        return Elements(self.anchor[start:end], self.depth[start:end], self.doc[start:end])

    def select(self, idx: torch.Tensor) -> "Elements":
        """Elements at these indices [n]."""
        return Elements(self.anchor[idx], self.depth[idx], self.doc[idx])

    def to(self, device) -> "Elements":
        return Elements(self.anchor.to(device), self.depth.to(device), self.doc.to(device))


def dense_mask(q: Elements, k: Elements) -> torch.Tensor:
    """Bool mask [Nq, Nk], True = may attend."""
    return may_attend(q.anchor[:, None], q.depth[:, None], q.doc[:, None],
                      k.anchor[None, :], k.depth[None, :], k.doc[None, :])


def parallel_draft_mask(anchor_pos: torch.Tensor, depth: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """Bool [N, N] mask (True = may attend) of P-EAGLE training elements; document_ids is per position [T]."""
    e = Elements(anchor_pos, depth, document_ids[anchor_pos])
    return dense_mask(e, e)


def flex_mask_mod(q: Elements, k: Elements):
    """flex_attention `mask_mod` implementing the same rule (indices into the element lists)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return may_attend(q.anchor[q_idx], q.depth[q_idx], q.doc[q_idx],
                          k.anchor[kv_idx], k.depth[kv_idx], k.doc[kv_idx])

    return mask_mod


def _gqa_expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    # x [B, KVH, N, D] -> [B, KVH * groups, N, D]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


_compiled_flex = None


def attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, q: Elements, k: Elements,
              backend: str = "sdpa", scale: float | None = None, query_block: int = 512,
              recompute: bool = False) -> torch.Tensor:
    """Masked attention by the rule. qh [1, H, Nq, D], kh/vh [1, KVH, Nk, D] -> [1, H, Nq, D].

    backend "sdpa": dense boolean mask, built per block of `query_block` queries (the CPU path; flex_attention has
    no CPU backward). Each block attends only over the span of keys [lo, hi) that its mask allows at all: keys
    outside it are masked for every query of the block, so dropping them changes nothing but the cost. Training
    lists elements by depth (context first), so context queries see a causal prefix and depth-d queries the context
    plus depths 1..d: about 0.6x the work of the full element x element product at 8 depths.
    `recompute` (sdpa, with a graph): each block's mask is rebuilt in backward rather than kept. SDPA keeps a float
    copy of a boolean mask for its backward (4.5 bytes per query x key entry, measured), and a partition of a long
    sample (train/partition.py), whose queries see every earlier key, would keep masks that grow with the sample.
    Rebuilding costs one more forward of the block.
    backend "flex": flex_attention with a block mask from `flex_mask_mod` (the GPU path; compiled off-CPU).
    """
    groups = qh.shape[1] // kh.shape[1]
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        global _compiled_flex
        fn = flex_attention
        if qh.is_cuda:
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention, dynamic=True)
            fn = _compiled_flex
        block = create_block_mask(flex_mask_mod(q, k), None, None, qh.shape[2], kh.shape[2], device=qh.device)
        return fn(qh, kh, vh, block_mask=block, scale=scale, enable_gqa=groups > 1)
    if backend != "sdpa":
        raise ValueError(f"unknown attention backend {backend!r} (sdpa | flex)")
    kh, vh = _gqa_expand(kh, groups), _gqa_expand(vh, groups)
    outs = []
    for s in range(0, qh.shape[2], query_block):
        qb = q.slice(s, s + query_block)
        m = dense_mask(qb, k)  # [nq, Nk]
        used = torch.nonzero(m.any(0)).flatten()  # keys some query of the block may attend to
        lo, hi = (int(used[0]), int(used[-1]) + 1) if used.numel() else (0, m.shape[1])
        args = (qh[:, :, s:s + query_block], kh[:, :, lo:hi], vh[:, :, lo:hi])
        if recompute:
            del m
            outs.append(checkpoint(_masked_block, *args, qb, k.slice(lo, hi), scale, use_reentrant=False))
        else:
            outs.append(F.scaled_dot_product_attention(*args, attn_mask=m[:, lo:hi], scale=scale))
    if recompute:
        # the blocks' masks are medium-sized transients that glibc keeps, fragmented, in its heap: after the keys of
        # a long partition's prefix they held 2 GB that the loss could not reuse (utils.release_free_memory)
        release_free_memory()
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def row_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The rule on row caches (the module docstring): q [R, n, H, D] (rotated), caches kc / vc [B, KVH, S, D] that
    hold this pass's keys and values, rows [R] (each query row's cache row), idx [R, n] (each query's place in its
    row) -> [R, n, H, D]. Query i of row r attends to places 0..idx[r, i] of row r.

    On a CPU where paradraft's kernel is built, its decode_attention (n <= ATTENTION_QUERIES); elsewhere SDPA
    with the causal mask of each row [R, 1, n, S]."""
    R, n, H, D = q.shape
    if n <= kernels.ATTENTION_QUERIES and kc.dtype == q.dtype and kernels.attends(q.device, q.dtype, D):
        return kernels.decode_attention(q.contiguous(), kc, vc, rows, idx, scale)
    S = int(idx.max()) + 1  # places in use
    k, v = kc[rows, :, :S], vc[rows, :, :S]  # [R, KVH, S, D]
    mask = (torch.arange(S, device=q.device)[None, None, :] <= idx[:, :, None])[:, None]  # [R, 1, n, S]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=H != k.shape[1])  # [R, H, n, D]
    return o.transpose(1, 2)


def _masked_block(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, q: Elements, k: Elements,
                  scale: float | None) -> torch.Tensor:
    """SDPA of one query block [1, H, nq, D] over its keys [1, H, nk, D] with the rule's mask, built here."""
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=dense_mask(q, k), scale=scale)
