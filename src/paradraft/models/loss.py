"""Training targets and the drafter loss: one place, used by both algorithms, training, tests and benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SlotBatch:
    """One packed training sequence in *slot* coordinates (the EAGLE one-step shift applied).

    Slot j holds the drafter input (token x_{j+1}, verifier aux hidden g_j) at position id pos(x_{j+1}); its target is
    the verifier's distribution at position j+1 (the one that predicts x_{j+2}).
    """

    tokens: torch.Tensor  # [T] int64, x_{j+1}
    hidden: torch.Tensor  # [T, 3Hv] verifier aux hidden states g_j
    positions: torch.Tensor  # [T] int64, position id of x_{j+1} in its document
    doc: torch.Tensor  # [T] int64 document id (packing)
    target_p: torch.Tensor  # [T, Vd] verifier distribution restricted to the draft vocab, renormalized
    target_ids: torch.Tensor  # [T] int64 verifier argmax, target vocabulary
    valid: torch.Tensor  # [T] bool: x_{j+2} exists in the same document and is a trained (loss-masked) token
    entropy: torch.Tensor | None = None  # [T] sum p log p of target_p (filled by `target_entropy`)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def target_entropy(self) -> torch.Tensor:
        """[T] negative entropy sum_v p log p of each slot's target, computed once per batch (every depth and
        every training-time-test step of a slot shares it)."""
        if self.entropy is None:
            p = self.target_p.float()
            self.entropy = torch.xlogy(p, p).sum(-1)
        return self.entropy


def slot_valid(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [S] -> valid [S-1] bool: slot j (verifier position j + 1, which predicts x_{j+2}) trains iff
    x_{j+2} is a trained token; the last slot has nothing to predict."""
    S = int(loss_mask.shape[0])
    valid = torch.zeros(S - 1, dtype=torch.bool, device=loss_mask.device)
    valid[: S - 2] = loss_mask[2:].bool()
    return valid


def slots_from_sample(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
                      target_p: torch.Tensor, target_ids: torch.Tensor, doc_id: int = 0) -> SlotBatch:
    """Apply the EAGLE one-step shift to one sample of S tokens -> S-1 slots.

    input_ids [S], loss_mask [S] bool, aux_hidden [S, 3Hv], target_p [S, Vd], target_ids [S] (per verifier position).
    """
    S = int(input_ids.shape[0])
    j = torch.arange(S - 1)
    valid = slot_valid(loss_mask)
    return SlotBatch(tokens=input_ids[1:].long(), hidden=aux_hidden[: S - 1], positions=j + 1,
                     doc=torch.full((S - 1,), doc_id, dtype=torch.long), target_p=target_p[1:],
                     target_ids=target_ids[1:].long(), valid=valid)


def pack_slots(parts: list[SlotBatch]) -> SlotBatch:
    """Concatenate samples into one packed sequence; document ids keep them apart in attention. One sample is
    returned as it is (document 0), without a copy of its targets: a long sample holds them once."""
    if len(parts) == 1:
        return dataclasses.replace(parts[0], doc=torch.zeros_like(parts[0].doc))
    docs = [torch.full_like(p.doc, i) for i, p in enumerate(parts)]
    return SlotBatch(*(torch.cat([getattr(p, f) for p in parts]) for f in
                       ("tokens", "hidden", "positions")), torch.cat(docs),
                     torch.cat([p.target_p for p in parts]), torch.cat([p.target_ids for p in parts]),
                     torch.cat([p.valid for p in parts]))


def draft_loss(logits: torch.Tensor, b: SlotBatch, rows: torch.Tensor, valid: torch.Tensor,
               d2t: torch.Tensor, t2d: torch.Tensor, out_of_vocab: bool = False):
    """Per-element KL(verifier || drafter) over the draft vocab, and whether the drafter's argmax is right.

    logits [N, Vd]; element i is scored against slot rows[i] of `b` (its target_p [T, Vd] and target_ids [T]);
    valid [N] bool -> (kl [N] (0 where not trained), trained [N] bool, correct [N] bool).
    KL = sum p log p (the slot's negative entropy, computed once per slot: no gradient flows through it)
       + cross-entropy(p, softmax(logits)) (one fused soft-target kernel, about half the time of writing it out).
    Positions whose verifier argmax lies OUTSIDE the draft vocabulary get no loss (the drafter can never propose
    that token, and the renormalized target would teach it a wrong favourite), unless `out_of_vocab`
    (--train-out-of-vocab: they train on the renormalized target, as the reference trainer's loss does); either way
    they count as wrong in `correct`, so accuracy is an honest estimate of greedy acceptance.
    """
    target_ids = b.target_ids[rows]  # [N]
    ce = F.cross_entropy(logits.float(), b.target_p[rows].float(), reduction="none")  # [N]
    kl = b.target_entropy()[rows] + ce
    trained = trained_elements(b, rows, valid, t2d, out_of_vocab)
    kl = torch.where(trained, kl, torch.zeros_like(kl))
    pred = logits.argmax(-1)
    correct = valid & ((pred + d2t[pred]) == target_ids)
    return kl, trained, correct


def element_targets(b: SlotBatch, anchor: torch.Tensor, depth: torch.Tensor):
    """anchor/depth [N] -> (rows [N]: the slot each element is scored against, anchor + depth (clamped into the
    sequence); valid [N] bool: that slot exists and trains)."""
    T = len(b)
    rows = torch.clamp(anchor + depth, max=T - 1)
    return rows, b.valid[rows] & (anchor + depth < T)


def trained_elements(b: SlotBatch, rows: torch.Tensor, valid: torch.Tensor, t2d: torch.Tensor,
                     out_of_vocab: bool = False) -> torch.Tensor:
    """[N] bool: the elements scored against slots `rows` [N] that train (valid [N], and unless `out_of_vocab` the
    verifier's argmax is in the draft vocabulary: see `draft_loss`)."""
    return valid if out_of_vocab else valid & t2d[b.target_ids[rows]]


def trained_counts(trained: torch.Tensor, depth: torch.Tensor, num_depths: int) -> list[int]:
    """Trained elements per depth [num_depths]: the denominators of `depth_reduce`."""
    return [int((trained & (depth == d)).sum()) for d in range(num_depths)]


def depth_reduce(kl: torch.Tensor, trained: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor,
                 depth: torch.Tensor, num_depths: int, decay: float = 1.0, counts: list[int] | None = None):
    """Loss = sum_d w_d * mean KL at depth d / sum_d w_d, with w_d = decay**d; plus per-depth stats.

    `counts` [num_depths]: the trained elements per depth of the WHOLE sequence when these elements are one
    partition of it (sequence partitioning, train/partition.py): the means then divide by the sequence's counts, so
    the partitions' losses sum to the sequence's loss. Default: these elements' own counts."""
    loss = kl.new_zeros(())
    wsum = 0.0
    own = trained_counts(trained, depth, num_depths)
    stats = {"kl": [], "acc": [], "count": [], "trained": own}
    for d in range(num_depths):
        sel = depth == d
        nt = own[d] if counts is None else counts[d]
        nv = int((valid & sel).sum())
        if nt:
            w = decay ** d
            loss = loss + w * kl[sel].sum() / nt
            wsum += w
        stats["kl"].append(float(kl[sel].detach().sum()) / own[d] if own[d] else float("nan"))
        stats["acc"].append(float((correct & sel).sum()) / nv if nv else float("nan"))
        stats["count"].append(nv)
    # a pack with nothing to train (every target outside the draft vocabulary) still gives a loss on the graph:
    # zero gradients, so backward and every DDP rank's all-reduce go on as usual
    return (loss / wsum if wsum else kl.sum() * 0.0), stats


def acceptance_estimate(anchor: torch.Tensor, depth: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor,
                        num_depths: int) -> dict:
    """Per-depth conditional accuracy and the acceptance length it implies.

    c_d = P(depth d correct | depths 0..d-1 of the same chain correct), over chains whose element (a, d) is trained.
    Greedy verification accepts draft k only if drafts 1..k are all right, so with K drafts
        estimated acceptance length = 1 + sum_{k=1..K} prod_{d<k} c_d    (the 1 is the verifier's bonus token).
    anchor/depth/correct/valid [N] -> {"conditional_acc": [D], "acceptance_length": {K: AL for K = 1..D}}.
    """
    A = int(anchor.max()) + 1 if anchor.numel() else 1
    ok = torch.zeros(A, num_depths, dtype=torch.bool)
    present = torch.zeros(A, num_depths, dtype=torch.bool)
    a, d = anchor.cpu(), depth.cpu()
    present[a, d] = valid.cpu().bool()
    ok[a, d] = correct.cpu().bool() & valid.cpu().bool()
    cond, prev = [], torch.ones(A, dtype=torch.bool)
    for k in range(num_depths):
        denom = prev & present[:, k]
        prev = denom & ok[:, k]
        cond.append(float(prev.sum()) / int(denom.sum()) if int(denom.sum()) else float("nan"))
    al, prod, total = {}, 1.0, 1.0
    for k, c in enumerate(cond, start=1):
        if c != c:  # nan: no data this deep
            break
        prod *= c
        total += prod
        al[k] = total
    return {"conditional_acc": cond, "acceptance_length": al}
