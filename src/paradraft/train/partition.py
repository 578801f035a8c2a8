"""Sequence partitioning: a packed sequence longer than a partition trains in partitions of its anchors.

Peak memory is set by the partition, not the sequence. The verifier's hidden states and targets of the sequence are
computed once (the SlotBatch); the drafter then runs in two phases:

1. Context: the keys/values of every context (depth-0) element, per layer, partition after partition on top of the
   earlier ones, without a graph (`DraftModel.context_cache`): [1, KVH, T, hd] per layer, a few MB per 1k slots.
2. Partitions, LAST FIRST. Partition [s, e) trains the elements whose anchor lies in it (drawn once for the whole
   sequence, so COD keeps its per-depth budgets), on the slots [s, e + span - 1) its targets need. Its queries
   attend by the one rule (models/attention.py) over the context before it, given as leaf tensors, plus its own
   elements. Its loss divides by the WHOLE sequence's trained counts per depth, so the partitions' losses sum to the
   sequence's loss. Backward adds, to the partition's own context keys/values, the gradient that the later
   partitions sent to them (accumulated in a buffer from the leaves' .grad), and sends its own leaves' gradient on
   to the partitions before it. The sum of the partitions' gradients is the gradient of the whole sequence: the
   same loss, the same gradients as one unpartitioned step, up to float rounding (tests/test_partition.py).

Without gradients (validation) the partitions run in order with no buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..models.attention import Elements
from ..models.common import DraftCache
from ..models.loss import SlotBatch, element_targets, trained_counts, trained_elements
from ..utils import release_free_memory


def partition_bounds(T: int, size: int) -> list[tuple[int, int]]:
    """[(s, e)]: the anchors 0..T-1 in runs of `size`."""
    return [(s, min(s + size, T)) for s in range(0, T, size)]


def slot_slice(b: SlotBatch, s: int, e: int) -> SlotBatch:
    """Slots [s, e) of a SlotBatch (views; a computed target entropy is sliced with them)."""
    return SlotBatch(*(getattr(b, f.name)[s:e] if getattr(b, f.name) is not None else None
                       for f in dataclasses.fields(SlotBatch)))


def _prefix(cache: DraftCache, s: int, leaves: bool) -> tuple[DraftCache | None, list]:
    """The context before slot s in partition coordinates (anchors shifted by -s), as leaf tensors that collect
    their gradient when `leaves`. -> (cache or None, [(k_leaf, v_leaf)] per layer)."""
    if s == 0:
        return None, []
    pre = DraftCache()
    kv = [(k[:, :, :s].detach(), v[:, :, :s].detach()) for k, v in cache.kv]  # [1, KVH, s, hd]
    if leaves:
        kv = [(k.requires_grad_(), v.requires_grad_()) for k, v in kv]
    e = cache.elems.slice(0, s)
    pre.kv, pre.elems = kv, Elements(e.anchor - s, e.depth, e.doc)
    pre.recompute_masks = True
    return pre, kv


def _merge_stats(parts: list[tuple[int, dict]], num_depths: int) -> dict:
    """One stats dict of the sequence from its partitions' [(s, stats)] (element anchors back to sequence slots)."""
    count = [sum(p["count"][d] for _, p in parts) for d in range(num_depths)]
    correct = [sum(p["acc"][d] * p["count"][d] for _, p in parts if p["count"][d]) for d in range(num_depths)]
    tr = [sum(p["trained"][d] for _, p in parts) for d in range(num_depths)]
    kl = [sum(p["kl"][d] * p["trained"][d] for _, p in parts if p["trained"][d]) for d in range(num_depths)]
    els = [p["elements"] for _, p in parts]
    shift = [s for s, _ in parts]
    return {"kl": [k / t if t else float("nan") for k, t in zip(kl, tr)],
            "acc": [c / n if n else float("nan") for c, n in zip(correct, count)],
            "count": count, "trained": tr, "num_elements": sum(p["num_elements"] for _, p in parts),
            "elements": tuple(torch.cat([e[i] + (sh if i == 0 else 0) for e, sh in zip(els, shift)])
                              for i in range(4))}


def partitioned(call, model, b: SlotBatch, size: int, span: int, num_depths: int, args: dict,
                generator: torch.Generator | None = None, scale: float | None = None, sync=None,
                check=None) -> tuple[torch.Tensor, dict]:
    """Train (or, with `scale` None, evaluate) one packed sequence in partitions of `size` anchors.

    call(b, **kw) -> (loss, stats): the drafter's `forward` as the trainer runs it (through DDP, under autocast);
    model: the drafter itself (its element draw and t2d); span: the deepest element's reach + 1 (`scored_depths`);
    args: `train_args`; scale: the factor each partition's loss is multiplied by before its backward (1/grad_accum);
    sync(last) -> a context manager each partition's forward and backward run in (DDP: no_sync until the last);
    check(loss): raises on a loss that must not be backpropagated.
    -> (the sequence's loss, detached; its stats as one unpartitioned forward reports them).
    """
    T = len(b)
    train = scale is not None
    anchor, depth = model.train_elements(b, generator, **args)
    anchor, depth = anchor.to(b.tokens.device), depth.to(b.tokens.device)
    tgt, valid = element_targets(b, anchor, depth)
    counts = trained_counts(trained_elements(b, tgt, valid, model.t2d, args.get("out_of_vocab", False)), depth,
                            num_depths)
    bounds = partition_bounds(T, size)
    with torch.no_grad():  # phase 1: every context key/value, no graph (and nothing for DDP to reduce)
        ctx = call(b, context_bounds=bounds)
    grads = [(torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
             for k, v in ctx.kv] if train else []
    total, parts = None, []
    order = list(reversed(bounds)) if train else bounds
    for i, (s, e) in enumerate(order):
        release_free_memory()  # what the targets, the context pass and the partition before left in the C heap
        last = i == len(order) - 1
        sel = (anchor >= s) & (anchor < e)  # context first: cod_sample / chain_elements order is kept
        els = (anchor[sel] - s, depth[sel])
        sub = slot_slice(b, s, min(T, e + span - 1))
        with (sync(last) if sync is not None and train else contextlib.nullcontext()):
            pre, leaves = _prefix(ctx, s, train)
            loss, stats = call(sub, anchors=els, prefix=pre, counts=counts, context_kv=train, **args)
            if check is not None:
                check(loss)
            if train:
                surrogate = loss * scale
                for (k, v), (gk, gv) in zip(stats.pop("context_kv"), grads):  # what later partitions sent
                    surrogate = surrogate + (k.float() * gk[:, :, s:e]).sum() + (v.float() * gv[:, :, s:e]).sum()
                release_free_memory()  # the forward's transients, before backward allocates the gradients
                surrogate.backward()
                for (lk, lv), (gk, gv) in zip(leaves, grads):
                    gk[:, :, :s] += lk.grad.float()
                    gv[:, :, :s] += lv.grad.float()
        total = loss.detach() if total is None else total + loss.detach()
        parts.append((s, stats))
    parts.sort(key=lambda x: x[0])
    return total, _merge_stats(parts, num_depths)
