"""The verifier's projections for a few rows: a verification step multiplies K+1 rows (per sequence) by every
weight matrix, a decoding step one.

On a CPU in float32, `F.linear(x, W)` (what nn.Linear runs: x @ W^T) takes a small-M path that costs 2-3x the
same product computed as (W @ x^T)^T for 2..16 rows, measured on a 2-core AVX2 host with MKL (BENCHMARKS.md,
"Small-M matmuls"): there a K=3 verification step cost 1.8x a decoding step, and speculative decoding ran slower
than plain decoding. Elsewhere (one row, many rows, bf16, a GPU, a Linear subclass or a module with hooks) the
module runs as it is.
"""

from __future__ import annotations

import torch
from torch import nn


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a projection: x [..., in] -> [..., out], with the small-M float32 CPU rule above."""
    w = getattr(module, "weight", None)
    rows = x.numel() // max(1, x.shape[-1])
    if (type(module) is not nn.Linear or not 2 <= rows <= 16 or w.dtype != torch.float32 or x.dtype != w.dtype
            or w.device.type != "cpu" or module._forward_hooks or module._forward_pre_hooks):
        return module(x)
    y = (w @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], w.shape[0])  # [rows, out] -> [..., out]
    return y if module.bias is None else y + module.bias


# the gated MLPs whose forward is down(act(gate(x)) * up(x)) in transformers
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


def mlp(block: nn.Module, x: torch.Tensor):
    """A decoder layer's MLP: the gated MLPs of GATED_MLPS through `linear`; any other block (experts with a
    router) runs as it is, and may return router scores too."""
    if type(block).__name__ not in GATED_MLPS or block._forward_hooks or block._forward_pre_hooks:
        return block(x)
    return linear(block.down_proj, block.act_fn(linear(block.gate_proj, x)) * linear(block.up_proj, x))
