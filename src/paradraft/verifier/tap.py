"""The aux-layer tap: the inputs of chosen decoder layers and the pre-norm last hidden state, captured from the
verifier's own forward (forward pre-hooks), for offline extraction and online training alike.

  aux   [T, 3H]  residual streams at the INPUT of decoder layers `layer_ids` (HF output_hidden_states[i]),
                 concatenated in the order of layer_ids: the tensor vLLM's EAGLE-3 path hands the drafter
  last  [T, H]   the last decoder layer's output BEFORE the final norm; the verifier's distribution at t is
                 exactly lm_head(norm(last[t])) (head.py)
"""

from __future__ import annotations

import numpy as np
import torch

from .adapters import VerifierError, adapter_for, decoder_layers


class Tap:
    """Capture aux hidden states (inputs of chosen decoder layers) and the pre-norm last hidden state."""

    def __init__(self, model, layer_ids: list[int]):
        layers = decoder_layers(model)
        L = len(layers)
        bad = [i for i in layer_ids if not 0 <= i < L]
        if bad:
            raise VerifierError(f"layer ids {bad} out of range for a {L}-layer verifier (valid: 0..{L - 1})")
        self.model, self.layer_ids = model, list(layer_ids)
        self.captured: dict = {}
        self.handles = []
        for i in sorted(set(layer_ids)):
            self.handles.append(layers[i].register_forward_pre_hook(self._pre(i), with_kwargs=True))
        norm = adapter_for(model).final_norm(model)
        self.handles.append(norm.register_forward_pre_hook(self._pre("last"), with_kwargs=True))

    def _pre(self, key):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.captured[key] = x
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """input_ids [B, S] -> (aux [B, S, 3H], last [B, S, H]); runs the decoder stack only (no lm_head)."""
        self.captured = {}
        self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        return aux, self.captured["last"]


def batches_by_tokens(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices (sorted by length, longest first) so that batch size x longest length <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def compute_samples(tap: Tap, samples: list[tuple[np.ndarray, np.ndarray]], batch_tokens: int, device="cpu",
                    pad_id: int = 0) -> list[dict]:
    """Run the verifier on samples [(ids [T], mask [T])] -> per sample {input_ids, loss_mask, aux, last} (CPU)."""
    out: list[dict | None] = [None] * len(samples)
    for group in batches_by_tokens([len(s[0]) for s in samples], batch_tokens):
        S = max(len(samples[i][0]) for i in group)
        ids = torch.full((len(group), S), pad_id, dtype=torch.long)
        att = torch.zeros((len(group), S), dtype=torch.long)
        for r, i in enumerate(group):  # right padding: causal attention keeps real positions exact
            n = len(samples[i][0])
            ids[r, :n] = torch.from_numpy(samples[i][0])
            att[r, :n] = 1
        aux, last = tap(ids.to(device), att.to(device))
        for r, i in enumerate(group):
            n = len(samples[i][0])
            out[i] = {"input_ids": torch.from_numpy(samples[i][0]).to(torch.int32),
                      "loss_mask": torch.from_numpy(samples[i][1].astype(np.uint8)),
                      "aux": aux[r, :n].cpu(), "last": last[r, :n].cpu()}
    return out  # type: ignore[return-value]
