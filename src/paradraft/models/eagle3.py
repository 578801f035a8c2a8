"""EAGLE-3: sequential drafting (one token per drafter pass), trained with training-time test (TTT).

TTT unrolls the drafter: step 0 reads (x_{a+1}, verifier g_a); step s reads (x_{a+s+1}, the drafter's own prenorm
output of step s-1 at the same anchor) and predicts the target at slot a+s. Step s of anchor a attends by the same
rule as P-EAGLE depth s (attention.py), so step s of training equals the s-th sequential inference step.
"""

from __future__ import annotations

import torch

from .attention import Elements
from .common import DraftCache, DraftModel
from .loss import SlotBatch, depth_reduce, draft_loss
from .registry import register


@register
class Eagle3Drafter(DraftModel):
    """The shared drafter, drafting sequentially and feeding its hidden states forward."""

    algorithm = "eagle3"
    architecture = "Eagle3Speculator"
    default_norm_before_residual = True
    default_loss_decay = unset_loss_decay = 0.8  # TTT step s weighted 0.8^s

    # ---- the drafter protocol (common.py)
    @classmethod
    def train_args(cls, cfg) -> dict:
        return {"ttt_steps": cfg.ttt_steps, "loss_decay": cfg.loss_decay, "out_of_vocab": cfg.train_out_of_vocab}

    @classmethod
    def scored_depths(cls, cfg) -> int:
        return cfg.ttt_steps

    def propose(self, tokens, hidden, positions, counts, doc, k, cache, choose):
        """A context step over the new slots, then k-1 chain steps feeding the drafter's own hidden state forward."""
        counts_t = torch.tensor(counts, device=doc.device)  # [R] context slots per row
        logits, h = self.context_step(tokens, hidden, positions, cache, doc=doc.repeat_interleave(counts_t))
        keep = len(cache)
        ends = counts_t.cumsum(0) - 1  # each row's last context slot
        hp, anchor = h[ends], positions[ends]  # [R, H], [R]
        x, q = choose(logits[ends])  # [R], [R, V]
        drafts, qs = [x], [q]
        for s in range(1, k):
            lg, hp = self.chain_step(x, hp, anchor, s, cache, doc=doc)
            x, q = choose(lg)
            drafts.append(x)
            qs.append(q)
        cache.truncate(keep)  # chain elements are speculative: only context slots stay
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs[0] is not None else None)  # q: None when greedy

    @staticmethod
    def chain_elements(b: SlotBatch, ttt_steps: int):
        """(anchor [N], depth [N]): step 0 at every slot, then step s at the anchors of step s-1 whose chain stays
        inside the sequence and its document (a + s < T, same document), step by step in anchor order."""
        T, dev = len(b), b.tokens.device
        anchors = [torch.arange(T, device=dev)]
        for s in range(1, ttt_steps):
            cand = anchors[-1][anchors[-1] + s < T]
            cand = cand[b.doc[cand + s] == b.doc[cand]]
            if cand.numel() == 0:
                break
            anchors.append(cand)
        return torch.cat(anchors), torch.cat([torch.full_like(a, s) for s, a in enumerate(anchors)])

    def train_forward(self, b: SlotBatch, ttt_steps: int, decay: float = 0.8, out_of_vocab: bool = False,
                      anchors=None, prefix: DraftCache | None = None, counts: list[int] | None = None,
                      context_kv: bool = False):
        """Loss and per-step stats of one packed sequence, unrolled for `ttt_steps` steps.

        `anchors` = (anchor, depth) (default `chain_elements`), `prefix`, `counts`, `context_kv`: one partition of a
        longer sequence (see `DraftModel.training_loss`).
        Returns (loss, stats, [logits of step s [n_s, Vd]], [anchors of step s [n_s]]).
        """
        anchor_all, depth_all = self.chain_elements(b, ttt_steps) if anchors is None else anchors
        cache = DraftCache()
        if prefix is not None and prefix.kv is not None:  # a copy: the steps' elements are appended to it
            cache.kv, cache.elems, cache.recompute_masks = list(prefix.kv), prefix.elems, prefix.recompute_masks
        all_kl, all_tr, all_cor, all_val, all_dep, logits_out, anchors_out = [], [], [], [], [], [], []
        h_prev, prev_anchors, own_kv = None, None, None
        for s in range(ttt_steps):
            anchors = anchor_all[depth_all == s]  # [n_s], ascending
            if anchors.numel() == 0:
                break
            if s == 0:
                emb, hid = self.embed(b.tokens[anchors]), self.project(b.hidden[anchors])
            else:
                idx = torch.searchsorted(prev_anchors, anchors)
                hid = h_prev[idx]  # [n_s, H] the drafter's own output at the same anchor
                emb = self.embed(b.tokens[anchors + s])
            depth = torch.full_like(anchors, s)
            elems = Elements(anchors, depth, b.doc[anchors])
            h, kv = self.run_layers(emb, hid, b.positions[anchors] + s, elems, cache)
            cache.append(kv, elems)
            own_kv = kv if s == 0 else own_kv
            logits = self.logits(h)
            tgt = anchors + s
            kl, tr, cor = draft_loss(logits, b, tgt, b.valid[tgt], self.d2t, self.t2d, out_of_vocab)
            for lst, v in zip((all_kl, all_tr, all_cor, all_val, all_dep), (kl, tr, cor, b.valid[tgt], depth)):
                lst.append(v)
            logits_out.append(logits)
            anchors_out.append(anchors)
            h_prev, prev_anchors = h, anchors
        loss, stats = depth_reduce(torch.cat(all_kl), torch.cat(all_tr), torch.cat(all_cor), torch.cat(all_val),
                                   torch.cat(all_dep), ttt_steps, decay, counts)
        stats["num_elements"] = sum(int(x.numel()) for x in anchors_out)
        stats["elements"] = (torch.cat(anchors_out).detach(), torch.cat(all_dep).detach(),
                             torch.cat(all_cor).detach(), torch.cat(all_val).detach())
        if context_kv:
            stats["context_kv"] = own_kv
        return loss, stats, logits_out, anchors_out

    def train_elements(self, b: SlotBatch, generator: torch.Generator | None = None, ttt_steps: int = 3, **_):
        return self.chain_elements(b, ttt_steps)

    def training_loss(self, b: SlotBatch, generator: torch.Generator | None = None, ttt_steps: int = 3,
                      loss_decay: float = 0.8, out_of_vocab: bool = False, anchors=None, prefix=None, counts=None,
                      context_kv=False, **_):
        """Training loss and stats (what the generic trainer calls through `forward`)."""
        loss, stats, _, _ = self.train_forward(b, ttt_steps, loss_decay, out_of_vocab, anchors, prefix, counts,
                                               context_kv)
        return loss, stats

    def context_step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     cache: DraftCache | None = None, doc: torch.Tensor | None = None):
        """Step 0 on n new context slots: tokens [n], hidden [n, 3Hv], positions [n], doc [n] (row ids, default 0)
        -> (logits [n, Vd], prenorm [n, H])."""
        depth = torch.zeros_like(positions)
        elems = Elements(positions, depth, torch.zeros_like(positions) if doc is None else doc)
        h, kv = self.run_layers(self.embed(tokens), self.project(hidden), positions, elems, cache)
        if cache is not None:
            cache.append(kv, elems)
        return self.logits(h), h

    def chain_step(self, token: torch.Tensor, prev_hidden: torch.Tensor, anchor, step: int, cache: DraftCache,
                   doc: torch.Tensor | None = None):
        """Draft step `step` >= 1 for R rows: token [R] (target vocab), prev_hidden [R, H], anchor [R] (or an int)
        -> (logits [R, Vd], prenorm [R, H]). The new elements join the cache (the caller truncates them)."""
        dev = token.device
        a = torch.as_tensor(anchor, device=dev).reshape(-1).expand(token.shape[0])
        d = torch.full_like(a, step)
        elems = Elements(a, d, torch.zeros_like(a) if doc is None else doc)
        h, kv = self.run_layers(self.embed(token), prev_hidden, a + d, elems, cache)
        cache.append(kv, elems)
        return self.logits(h), h
