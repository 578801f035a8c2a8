"""The verifier's projections for a few rows: a verification step multiplies K+1 rows (per sequence) by every
weight matrix, a decoding step one.

THE rule of which path a CPU projection takes at inference (`linear`, `linears`):
- where the caller holds the weights packed in the AMX tile layout (the engine's runner packs the verifier's on AMX
  hosts, kernels.pack_tiles), 2..128 bfloat16 rows take `tile_linear` on them: a verification step's rows then read
  the weights as fast as one row does, a batch of 32 rows ~1.6x as fast as torch's path, 64-128 rows ~1.3x
  (measured by benchmarks/bench_small_linear.py); a longer prefill is as fast or faster through torch (oneDNN);
- paradraft's kernel (kernels/) for 1..16 rows in bfloat16 and 2..16 rows in float32 where it is built for
  AVX-512, measured faster than torch's path there (BENCHMARKS.md, "The engine at the machine's limit"; beyond 16
  rows torch's path, AMX through oneDNN, is faster). One float32 row stays on torch's path there (as fast): an
  eager decoding step is then computed as Hugging Face computes it. Where it is built for AVX2 it takes one float32
  row too (`kernel_rows`: torch's path streamed it at half the kernel's speed);
- else, on hosts without the kernel, the measured small-M rule below for 2..16 float32 rows;
- bfloat16 rows beyond the kernel's (a prefill) where torch has no bf16 GEMM on this CPU (oneDNN's needs AVX-512
  BF16 or AMX; `utils.bf16_gemm`): the product in float32, rounded once to bf16 as torch's own bf16 product is. torch's
  fallback costs every row what one row costs: on the 2-core AMD EPYC (AVX2) of BENCHMARKS.md 150 rows of a
  576 -> 1536 projection took 16 ms, against 2.2 ms in float32 with the weight converted in the call;
- else the module as it is.

Without the kernel, on a CPU in float32, `F.linear(x, W)` (what nn.Linear runs: x @ W^T) takes a small-M path that
costs 2-3x the same product computed as (W @ x^T)^T for 2..16 rows, measured on a 2-core AVX2 host with MKL
(docs/experiments/benchmarks-log.md, "Small-M matmuls"): there a K=3 verification step cost 1.8x a decoding step,
and speculative decoding ran slower than plain decoding. Which path is faster depends on the CPU, its BLAS and the
shape (on that host 8 rows ran slower transposed), so the rule is measured, not assumed: the first time a (rows,
weight shape, threads) is seen, both paths are timed on it, on weights read from memory as a forward reads them
(~ms), and the transposed one is kept only if it is >= 10% faster.
$PARADRAFT_SMALL_M=on / off forces it for 2..16 rows (reproducing a run, or measuring the rule itself).
The drafter's projections take the same rule when it drafts. Elsewhere (other row counts, a GPU, a Linear subclass,
a module with hooks, or outside torch.inference_mode: training, its validation and its no-grad context keys) the
module runs as it is, and so do the training targets (verifier/head.py): what a kernel or a timing picked must
never reach a drafter's weights.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..utils import bf16_gemm

SMALL_M_ENV = "PARADRAFT_SMALL_M"
_FASTER: dict[tuple[int, int, int, int], bool] = {}  # (rows, out, in, threads) -> the transposed path measured faster


def transposed_faster(w: torch.Tensor, rows: int) -> bool:
    """Whether (W @ x.T).T beats F.linear for `rows` rows of this weight [out, in] on this CPU (measured once per
    shape and thread count; $PARADRAFT_SMALL_M=on / off overrides)."""
    forced = os.environ.get(SMALL_M_ENV, "auto").lower()
    if forced in ("on", "off"):
        return forced == "on"
    key = (rows, int(w.shape[0]), int(w.shape[1]), torch.get_num_threads())
    if key not in _FASTER:
        _FASTER[key] = _measure(w, rows)
    return _FASTER[key]


@torch.inference_mode()
def _measure(w: torch.Tensor, rows: int, repeats: int = 5, cold_bytes: int = 64 << 20) -> bool:
    """Best-of-`repeats` time of both paths on a random x [rows, in], interleaved (the first round warms up), each
    sample a pass over copies of w that together exceed the CPU caches (>= `cold_bytes`). A model's forward reads
    each weight once per step, from memory: timing one hot weight again and again chose F.linear for SmolLM2's
    small projections in some processes, and those processes verified K=3 drafts ~25% slower (BENCHMARKS.md,
    "Small-M matmuls")."""
    x = torch.randn(rows, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0))  # global RNG untouched
    ws = [w] + [w.clone() for _ in range(min(63, cold_bytes // max(1, w.numel() * w.element_size())))]
    best = [math.inf, math.inf]  # F.linear, transposed
    for r in range(repeats + 1):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):  # alternate which path runs first
            t0 = time.perf_counter()
            for wc in ws:
                _ = F.linear(x, wc) if k == 0 else (wc @ x.T).T
            if r:
                best[k] = min(best[k], (time.perf_counter() - t0) / len(ws))
    return best[1] < 0.9 * best[0]


KERNEL_ROWS = {torch.bfloat16: (1, 16), torch.float32: (2, 16)}  # rows the kernel takes, per dtype (see above)
KERNEL_ROWS_AVX2 = {torch.bfloat16: (1, 16), torch.float32: (1, 16)}  # the same for the kernel's AVX2 build
TILE_ROWS = (2, 128)  # bfloat16 rows that take tile-packed weights where the caller has them (one row: the
# kernel, as fast on the weights in place)


def kernel_rows(dtype: torch.dtype) -> tuple[int, int]:
    """The rows (lo, hi) the kernel here takes in this dtype (KERNEL_ROWS; KERNEL_ROWS_AVX2 for an AVX2 build, where
    torch's path is not as fast for one float32 row: 12.8 against the kernel's 23.9 GB/s on the 2-core AMD EPYC of
    BENCHMARKS.md); (1, 0) where there is no kernel."""
    if not kernels.available():
        return (1, 0)
    return (KERNEL_ROWS_AVX2 if kernels.isa() == "avx2" else KERNEL_ROWS).get(dtype, (1, 0))


def _plain(module: nn.Module, x: torch.Tensor) -> bool:
    """A plain projection on the CPU in x's dtype, run in inference mode (the engine): what the fast paths may
    replace. Training's own no-grad work (partitioning's context keys, validation) is no inference: it keeps the
    module's bits, whatever a kernel or a timing would pick."""
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and w.dtype == x.dtype and w.device.type == "cpu" and w.is_contiguous()
            and not module._forward_hooks and not module._forward_pre_hooks and not torch.is_grad_enabled()
            # (compiled code is the engine's, traced in inference mode; dynamo cannot ask for the mode itself)
            and (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()))


def _kernel_rows(x: torch.Tensor, rows: int) -> bool:
    lo, hi = kernel_rows(x.dtype)
    return lo <= rows <= hi


def _bf16_in_float32(x: torch.Tensor, rows: int) -> bool:
    return x.dtype == torch.bfloat16 and rows > KERNEL_ROWS[torch.bfloat16][1] and not bf16_gemm("cpu")  # 16


def _tile_rows(x: torch.Tensor, rows: int, tiles) -> bool:
    return tiles is not None and x.dtype == torch.bfloat16 and TILE_ROWS[0] <= rows <= TILE_ROWS[1]


def linears(modules: list[nn.Module], x: torch.Tensor, tiles: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """[m(x) for m in modules] for projections of the same input x [..., in] (q|k|v, gate|up): one kernel call over
    all their weights where a kernel takes them, each output [..., out_i]. `tiles`: the modules' weights packed by
    kernels.pack_tiles, in the same order (None: not packed)."""
    rows = x.numel() // max(1, x.shape[-1])
    if not all(_plain(m, x) for m in modules):
        return [linear(m, x) for m in modules]
    if _tile_rows(x, rows, tiles):
        y = kernels.tile_linear(x.reshape(rows, -1).contiguous(), tiles)  # [rows, sum out_i]
    elif _kernel_rows(x, rows):
        y = kernels.small_linear(x.reshape(rows, -1).contiguous(), [m.weight for m in modules])  # [rows, sum out_i]
    else:
        return [linear(m, x) for m in modules]
    outs = [o.reshape(*x.shape[:-1], o.shape[-1]) for o in y.split([m.weight.shape[0] for m in modules], dim=-1)]
    return [o if m.bias is None else o + m.bias for m, o in zip(modules, outs)]


def linear(module: nn.Module, x: torch.Tensor, tiles: list[torch.Tensor] | None = None) -> torch.Tensor:
    """module(x) for a projection: x [..., in] -> [..., out], by the rule above (`tiles`: its weight packed by
    kernels.pack_tiles, a one-element list, or None)."""
    w = getattr(module, "weight", None)
    rows = x.numel() // max(1, x.shape[-1])
    if not _plain(module, x):
        return module(x)
    if _tile_rows(x, rows, tiles) or _kernel_rows(x, rows):
        return linears([module], x, tiles)[0]
    if _bf16_in_float32(x, rows):  # [..., in] -> [..., out], float32 inside, rounded once
        b = None if module.bias is None else module.bias.float()
        return F.linear(x.float(), w.float(), b).to(x.dtype)
    if (x.dtype != torch.float32 or not 2 <= rows <= 16 or torch.compiler.is_compiling()  # no timing in a graph
            or not transposed_faster(w, rows)):
        return module(x)
    y = (w @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], w.shape[0])  # [rows, out] -> [..., out]
    return y if module.bias is None else y + module.bias


# the gated MLPs whose forward is down(act(gate(x)) * up(x)) in transformers
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


def mlp(block: nn.Module, x: torch.Tensor, tiles=None):
    """A decoder layer's MLP: the gated MLPs of GATED_MLPS through `linear`; any other block (experts with a
    router) runs as it is, and may return router scores too. `tiles`: (gate|up, down) packed, or None."""
    if type(block).__name__ not in GATED_MLPS or block._forward_hooks or block._forward_pre_hooks:
        return block(x)
    gate_up, down = tiles or (None, None)
    gate, up = linears([block.gate_proj, block.up_proj], x, gate_up)
    return linear(block.down_proj, block.act_fn(gate) * up, down)
