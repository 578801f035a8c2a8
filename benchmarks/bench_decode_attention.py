"""The engine's attention kernel (`kernels.decode_attention`) on its own: a decoding step (1 query per row) and
verification steps (4 and 8 queries per row) against 300 to 4,000 cached keys, with the embedded SmolLM2's heads
(9 query heads, 3 kv heads, head size 64), batch 1 and 32, bf16 and float32; beside it torch's SDPA on the same
keys (what a CPU without the kernel computes). In bf16 on AMX hosts the kernel runs its products on AMX tiles;
`$PARADRAFT_ATTENTION_TILES=off` keeps them in its float32 loops: each setting runs in its own process, one after
another, and the rows are medians of interleaved repeats (microseconds per call, one layer, caches in the CPU's
caches). Outputs are checked against a float64 softmax attention first.

usage: python benchmarks/bench_decode_attention.py [--keys 300 1000 4000] [--queries 1 4 8] [--repeats 200]
       [--output benchmarks/results/decode-attention.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

H, KVH, D = 9, 3, 64


def child(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from paradraft import kernels

    torch.set_grad_enabled(False)
    if not kernels.available():
        raise SystemExit(f"the kernel is not built here: {kernels.status()['why_not']}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 32):
            S_max = max(args.keys) + 16
            kc = torch.randn(batch, KVH, S_max, D, generator=g).to(dtype)
            vc = torch.randn(batch, KVH, S_max, D, generator=g).to(dtype)
            r = torch.arange(batch)
            for S in args.keys:
                for n in args.queries:
                    q = torch.randn(batch, n, H, D, generator=g).to(dtype)
                    pos = (S - n + torch.arange(n))[None].expand(batch, n).contiguous()  # [B, n]
                    mask = (torch.arange(S)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, n, S]
                    kk, vv = kc[:, :, :S], vc[:, :, :S]

                    def ours(q=q, kc=kc, vc=vc, r=r, pos=pos):
                        return kernels.decode_attention(q, kc, vc, r, pos, 0.125)

                    def sdpa(q=q, kk=kk, vv=vv, mask=mask):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask, scale=0.125,
                                                              enable_gqa=True).transpose(1, 2)

                    want = sdpa().double()
                    err = float((ours().double() - want).abs().max() / want.abs().max())
                    times = {"kernel": [], "sdpa": []}
                    for _ in range(10):
                        ours(), sdpa()
                    for _ in range(args.repeats):
                        for name, f in (("kernel", ours), ("sdpa", sdpa)):
                            t0 = time.perf_counter()
                            f()
                            times[name].append(time.perf_counter() - t0)
                    rows.append({"dtype": str(dtype).split(".")[1], "batch": batch, "keys": S, "queries": n,
                                 "kernel_us": 1e6 * statistics.median(times["kernel"]),
                                 "sdpa_us": 1e6 * statistics.median(times["sdpa"]), "max_rel_err_vs_sdpa": err})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, nargs="+", default=[300, 1000, 4000])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--output", default="benchmarks/results/decode-attention.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    out = {}
    for setting, env in (("tiles", {}), ("float32 loops", {"PARADRAFT_ATTENTION_TILES": "off"})):
        cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats), "--keys", *map(str, args.keys),
               "--queries", *map(str, args.queries)]
        print(f"[bench_decode_attention] {setting} ...", file=sys.stderr, flush=True)
        res = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        out[setting] = json.loads(res.stdout.strip().splitlines()[-1])
    lines = ["| dtype | batch | keys | queries | kernel (AMX tiles in bf16) | kernel, float32 loops | torch SDPA |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for a, b in zip(out["tiles"], out["float32 loops"]):
        lines.append(f"| {a['dtype']} | {a['batch']} | {a['keys']} | {a['queries']} | {a['kernel_us']:.1f} us | "
                     f"{b['kernel_us']:.1f} us | {a['sdpa_us']:.1f} us |")
    md = "\n".join(lines)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine_limit import host

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"benchmark": "decode_attention", "date": time.strftime("%Y-%m-%d %H:%M"),
                                             "commit": commit, "host": host(), "args": vars(args), "rows": out,
                                             "table": md}, indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
