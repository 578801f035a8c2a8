"""Two or more versions of paradraft's CPU kernel side by side in one process: the projections of a decoding step.

Each version is `src/paradraft/kernels/small_linear.cpp` at a git revision (or the working tree: `--rev work`),
built with this CPU's flags under its own op namespace, so that all of them load into one process and their passes
interleave: on the project's noisy machines two versions timed in separate processes minutes apart differed by more
than the change being measured. One pass multiplies `rows` rows by every projection of SmolLM2-135M as the engine
calls them (per layer q|k|v in one call, o, gate|up in one call, down; then the lm_head), random weights of those
shapes on 2 MiB pages (what the engine does), read from memory. Reported per (dtype, rows, version): the median
pass in ms and the weights' GB/s. Every version's outputs are checked against the first one's.

  python benchmarks/bench_kernel_ab.py --rev 7fb6bf9 --rev work [--rows 1 2 4 8] [--dtypes bfloat16 float32]
        [--passes 30] [--output benchmarks/results/kernel-ab.json]

With --attention the versions' `decode_attention` instead: one layer of SmolLM2's heads (9 query heads on 3 kv heads,
head size 64) at batch 1 and 32, --keys cached keys and --queries queries per row (a decoding step: 1, the K=3
verification: 4), microseconds per call, medians of interleaved calls (200 at batch 1, 40 at batch 32). The caches
fit in the CPU's caches at batch 1, as one layer's do in a step. Every version's outputs are checked against the
first one's (and reported: equal bit for bit or not).

  python benchmarks/bench_kernel_ab.py --attention --rev 8abc8f2~1 --rev work [--keys 300 1000] [--queries 1 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_engine_limit import host  # benchmarks/ (the script's own directory)
from bench_small_linear import FF, H, L, V  # SmolLM2-135M's hidden, MLP, vocabulary, layers

from paradraft import kernels

CALLS = [[(H, H), (192, H), (192, H)], [(H, H)], [(FF, H), (FF, H)], [(H, FF)]]  # one layer's calls, as the engine
SOURCE = "src/paradraft/kernels/small_linear.cpp"


def source_at(rev: str) -> str:
    if rev == "work":
        return Path(SOURCE).read_text()
    out = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"--rev {rev}: {out.stderr.strip() or 'no such revision'}")
    return out.stdout


def build(rev: str, i: int, cflags: list[str]):
    """The kernel at `rev` built and loaded under its own op namespace: torch.ops.pdab<i> (its small_linear,
    decode_attention, ...)."""
    from paradraft.utils import cache_root

    ns = f"pdab{i}"
    src = re.sub(r"TORCH_LIBRARY(_IMPL)?\(paradraft\b", lambda m: f"TORCH_LIBRARY{m.group(1) or ''}({ns}",
                 source_at(rev))
    key = hashlib.sha256((src + repr((cflags, torch.__version__))).encode()).hexdigest()[:16]
    d = cache_root() / "kernels" / f"ab-{key}"
    lib = d / f"{ns}.so"
    if lib.is_file():
        torch.ops.load_library(str(lib))
    else:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{ns}.cpp").write_text(src)
        print(f"building the kernel at {rev} ...", file=sys.stderr, flush=True)
        kernels.compile_library(ns, d / f"{ns}.cpp", d, cflags)  # built and loaded
    return getattr(torch.ops, ns)


def attention_rows(a, ops) -> list[dict]:
    """--attention: each version's decode_attention on the same inputs, calls interleaved -> rows."""
    H, KVH, D = 9, 3, 64  # SmolLM2-135M's heads
    g = torch.Generator().manual_seed(0)
    empty = torch.empty(0)
    rows = []
    for dtype in (getattr(torch, d) for d in a.dtypes):
        for batch in (1, 32):
            for S in a.keys:
                for n in a.queries:
                    kc = torch.randn(batch, KVH, S + 16, D, generator=g).to(dtype)  # [B, KVH, S_max, D]
                    vc = torch.randn(batch, KVH, S + 16, D, generator=g).to(dtype)
                    q = torch.randn(batch, n, H, D, generator=g).to(dtype)  # [B, n, H, D]
                    pos = (S - n + torch.arange(n))[None].expand(batch, n).contiguous()  # [B, n]: the last n keys
                    r = torch.arange(batch)

                    def call(op, q=q, kc=kc, vc=vc, r=r, pos=pos):
                        return op.decode_attention(q, kc, vc, r, pos, 0, 0.125, empty)

                    outs = [call(op) for op in ops]  # each version's output once
                    ref = outs[0].double()
                    same = [bool(torch.equal(o, outs[0])) for o in outs]
                    for o in outs[1:]:
                        assert (o.double() - ref).abs().max() <= 1e-2 * ref.abs().max(), \
                            "the versions' attention differs"
                    ts = [[] for _ in ops]
                    calls = 200 if batch == 1 else 40
                    for i in range(calls + 10):  # the first 10 rounds warm up
                        for t, op in zip(ts, ops):
                            t0 = time.perf_counter()
                            call(op)
                            if i >= 10:
                                t.append(time.perf_counter() - t0)
                    for rev, t, eq in zip(a.rev, ts, same):
                        rows.append({"dtype": str(dtype).split(".")[-1], "batch": batch, "keys": S, "queries": n,
                                     "rev": rev, "us": 1e6 * statistics.median(t), "equal_to_first": eq})
                        print(f"{rows[-1]['dtype']:9s} batch {batch:2d} keys {S:5d} queries {n:2d}  {rev:12s} "
                              f"{rows[-1]['us']:9.1f} us{'' if eq else '  (outputs not bit-equal)'}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", action="append", required=True, help="a git revision, or `work` (the working tree)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--output", default="benchmarks/results/kernel-ab.json")
    ap.add_argument("--attention", action="store_true", help="the versions' decode_attention instead")
    ap.add_argument("--keys", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    a = ap.parse_args()
    if len(a.rev) < 2:
        raise SystemExit("--rev: give at least two versions to compare")
    if any(r < 1 or r > kernels.MAX_ROWS for r in a.rows):
        raise SystemExit(f"--rows: 1 to {kernels.MAX_ROWS}")
    cflags = kernels.build_flags()  # what this process's engine would build ($PARADRAFT_KERNELS=avx2 included)
    if cflags is None:
        raise SystemExit("this CPU lacks AVX2 and FMA: the kernel does not build here")
    torch.set_grad_enabled(False)
    ops = [build(rev, i, cflags) for i, rev in enumerate(a.rev)]
    g = torch.Generator().manual_seed(0)
    rows = attention_rows(a, ops) if a.attention else []
    for dtype in (getattr(torch, d) for d in ([] if a.attention else a.dtypes)):
        shapes = [c for _ in range(L) for c in CALLS] + [[(V, H)]]
        flat = kernels.on_huge_pages([torch.randn(*s, generator=g).to(dtype) * 0.02 for c in shapes for s in c])
        calls, i = [], 0
        for c in shapes:
            calls.append(flat[i:i + len(c)])
            i += len(c)
        nbytes = sum(w.numel() * w.element_size() for w in flat)
        for m in a.rows:
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (H, FF)}
            for op in ops[1:]:  # the same products (float32 sums in another order; bf16 rounded once)
                for ws in calls[:4] + calls[-1:]:
                    x = xs[ws[0].shape[1]]
                    ref, got = ops[0].small_linear(x, ws).double(), op.small_linear(x, ws).double()
                    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max(), "the versions' products differ"
            ts = [[] for _ in ops]
            for p in range(a.passes + 2):  # interleaved; the first 2 rounds warm up
                for t, op in zip(ts, ops):
                    t0 = time.perf_counter()
                    for ws in calls:
                        op.small_linear(xs[ws[0].shape[1]], ws)
                    if p >= 2:
                        t.append(time.perf_counter() - t0)
            for rev, t in zip(a.rev, ts):
                med = statistics.median(t)
                rows.append({"dtype": str(dtype).split(".")[-1], "rows": m, "rev": rev, "pass_ms": 1000 * med,
                             "gbs": nbytes / med / 1e9})
                print(f"{rows[-1]['dtype']:9s} rows {m:2d}  {rev:12s} {1000 * med:7.2f} ms  "
                      f"{nbytes / med / 1e9:5.1f} GB/s", flush=True)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    name = "kernel_ab_attention" if a.attention else "kernel_ab"
    tmp.write_text(json.dumps({"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M"),
                               "host": {**host(), "isa": kernels.isa()},
                               "threads": torch.get_num_threads(), "args": vars(a), "rows": rows}, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
