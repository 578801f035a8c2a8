"""paradraft's CPU kernel against torch's own product on the projections of a decoding step, weights from memory;
in bf16 on AMX hosts also `tile_linear` on the same weights packed once (what the engine's runner does).

One pass multiplies `rows` rows by every projection matrix of SmolLM2-135M (30 layers x q, k, v, o, gate, up, down,
and the 49,152 x 576 lm_head: 211 matrices, 269 MB in bf16), each read from memory as a decoding step reads it
(random weights of those shapes; the model's ~0.5 GB in float32 exceeds the caches). Reported as the weights' GB/s:
the bandwidth a step reaches on its projections. Median of 15 passes per (dtype, rows, path). Each path also on the
same weights copied onto 2 MiB pages (`kernels.on_huge_pages`, what the engine does; "huge" in the JSON). And the
kernel on one weight kept in the caches, on one thread ("hot_1thread"): what its arithmetic allows (`hot_gbs`).

  python benchmarks/bench_small_linear.py [--rows 1 2 4 8 16 32 64 128] [--output benchmarks/results/small-linear.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paradraft import kernels

H, FF, V, L = 576, 1536, 49152, 30  # hidden, MLP, vocabulary, layers
SHAPES = [(H, H), (192, H), (192, H), (H, H), (FF, H), (FF, H), (H, FF)]


def gbs(fn, ws, xs, reps: int = 15) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w, x in zip(ws, xs):
            fn(x, w)
        ts.append(time.perf_counter() - t0)
    return sum(w.numel() * w.element_size() for w in ws) / statistics.median(ts) / 1e9


def hot_gbs(dtype: torch.dtype, m: int, g: torch.Generator, calls: int = 100, reps: int = 15) -> float:
    """The kernel on one 576 x 576 weight (SmolLM2's o_proj) called again and again on one thread, so that it stays
    in the CPU's caches (663 KB in bf16, within a 1 MB L2): what the arithmetic allows, with memory out of the way.
    Where this is not far above the weights' GB/s from memory, the rows are bound by the arithmetic."""
    w, x = torch.randn(H, H, generator=g).to(dtype), torch.randn(m, H, generator=g).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(calls):
            kernels.small_linear(x, [w])
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                kernels.small_linear(x, [w])
            ts.append((time.perf_counter() - t0) / calls)
    finally:
        torch.set_num_threads(threads)
    return w.numel() * w.element_size() / statistics.median(ts) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--output", default="benchmarks/results/small-linear.json")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if not kernels.available():
        raise SystemExit(f"the kernel is not available here: {kernels.status()['why_not']}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        ws = [torch.randn(*s, generator=g).to(dtype) for _ in range(L) for s in SHAPES]
        ws.append(torch.randn(V, H, generator=g).to(dtype))
        huge = kernels.on_huge_pages(ws)  # the same weights on 2 MiB pages
        tiled = dtype == torch.bfloat16 and kernels.tiles_available()
        if tiled:  # the weights packed once, in 4 KiB and in 2 MiB pages
            packed = [kernels.pack_tiles(w) for w in ws]
            packed_huge = kernels.on_huge_pages(packed)
        for m in a.rows:
            xs = [torch.randn(m, w.shape[1], generator=g).to(dtype) for w in ws]
            row = {"dtype": str(dtype).split(".")[-1], "rows": m, "torch_gbs": gbs(lambda x, w: F.linear(x, w), ws, xs),
                   "kernel_gbs": None, "kernel_huge_gbs": None}
            if m <= kernels.MAX_ROWS:
                row["kernel_gbs"] = gbs(lambda x, w: kernels.small_linear(x, [w]), ws, xs)
                row["kernel_huge_gbs"] = gbs(lambda x, w: kernels.small_linear(x, [w]), huge, xs)
                row["kernel_hot_1thread_gbs"] = hot_gbs(dtype, m, g)
            tiles = ""
            if tiled:
                row["tiles_gbs"] = gbs(lambda x, p: kernels.tile_linear(x, [p]), packed, xs)
                row["tiles_huge_gbs"] = gbs(lambda x, p: kernels.tile_linear(x, [p]), packed_huge, xs)
                tiles = f", tile-packed {row['tiles_gbs']:5.1f} ({row['tiles_huge_gbs']:5.1f}) GB/s"
            rows.append(row)
            kern = (f"kernel {row['kernel_gbs']:5.1f} ({row['kernel_huge_gbs']:5.1f}) GB/s, hot on 1 thread "
                    f"{row['kernel_hot_1thread_gbs']:5.1f} GB/s" if row["kernel_gbs"]
                    else f"kernel - (> {kernels.MAX_ROWS} rows)")
            print(f"{row['dtype']:9s} rows {m:3d}: torch {row['torch_gbs']:5.1f} GB/s, {kern}{tiles}  (in parentheses: "
                  "on 2 MiB pages)", flush=True)
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps({"benchmark": "small_linear", "date": time.strftime("%Y-%m-%d %H:%M"),
                                          "threads": torch.get_num_threads(), "kernel": kernels.status(),
                                          "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
