"""The target head: the verifier's own final norm and lm_head, turning stored last hidden states (before the final
norm) into the distributions the drafter is trained to match. It calls the model's modules, so any family's norm
(RMSNorm with or without an offset, a LayerNorm) gives exactly the model's logits."""

from __future__ import annotations

import torch

from .adapters import adapter_for


class VerifierHead:
    """final norm + lm_head of a verifier (its own modules, on the device given)."""

    CHUNK = 1024  # rows per lm_head call in `targets`

    def __init__(self, model, device: str = "cpu"):
        self.adapter, self.model = adapter_for(model), model
        self.norm = self.adapter.final_norm(model)
        self.lm_head = model.lm_head
        self.device = device

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """last_hidden [S, H] (pre-norm) -> logits [S, V] float32, as the model computes them. Never through
        decoding's timed small-M rule (verifier/linear.py): a sample with 2..16 trained positions would get
        targets whose last bits depend on which path a timing picked in this process, and a resumed or rerun
        training would not be bit-identical."""
        dtype = self.lm_head.weight.dtype
        normed = self.norm(last_hidden.to(self.device, dtype))  # [S, H]
        return self.adapter.logits(self.model, normed, small_m=False).float()  # [S, V]

    @torch.no_grad()
    def targets(self, last_hidden: torch.Tensor, draft_target_ids: torch.Tensor, chunk: int = CHUNK):
        """last_hidden [S, H] -> (target_p [S, Vd] float32 over the draft vocabulary, target_ids [S] the argmax over
        the FULL vocabulary)."""
        ps = [torch.zeros(0, len(draft_target_ids), device=self.device)]  # [0, Vd]: no rows gives empty targets
        ids = [torch.zeros(0, dtype=torch.long, device=self.device)]
        for s in range(0, last_hidden.shape[0], chunk):
            logits = self.logits(last_hidden[s:s + chunk])  # [c, V]
            ids.append(logits.argmax(-1))
            ps.append(torch.softmax(logits[:, draft_target_ids], dim=-1))
        return torch.cat(ps), torch.cat(ids)
