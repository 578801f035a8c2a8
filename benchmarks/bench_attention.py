"""Training attention on CPU: paradraft's SDPA path (query blocks over the key span their mask allows) against one
SDPA over every key with the full element x element mask, on the elements of a real P-EAGLE pack.

Elements come from `cod_sample` (8 depths, COD 0.7 / 0.2) over a 2,048-slot pack of 4 documents; shapes are the
SmolLM2 drafter's (9 query heads, 3 KV heads, head dim 64), bf16 as under autocast. Forward + backward, the two
interleaved, median over repeats; the outputs are checked equal first.
usage: python benchmarks/bench_attention.py [--slots 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paradraft.models.attention import Elements, attention, dense_mask
from paradraft.models.peagle import cod_sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=2048)
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default="benchmarks/results/attention.json")
    a = ap.parse_args()
    T = a.slots
    doc = torch.arange(T) * 4 // T  # 4 documents
    g = torch.Generator().manual_seed(0)
    anchor, depth = cod_sample(torch.rand(T, generator=g) < 0.8, a.depths, 0.7, 0.2, g, document_ids=doc)
    e = Elements(anchor, depth, doc[anchor])
    n = len(e)
    q0 = torch.randn(1, 9, n, 64, generator=g).bfloat16()
    k0, v0 = torch.randn(1, 3, n, 64, generator=g).bfloat16(), torch.randn(1, 3, n, 64, generator=g).bfloat16()

    def full(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                              attn_mask=dense_mask(e, e), scale=0.125)

    def paradraft(q, k, v):
        return attention(q, k, v, e, e, backend="sdpa", scale=0.125)

    with torch.no_grad():
        torch.testing.assert_close(paradraft(q0, k0, v0).float(), full(q0, k0, v0).float(), atol=2e-2, rtol=2e-2)
    times: dict[str, list[float]] = {"full mask, every key": [], "paradraft (key span per query block)": []}
    for _ in range(a.repeats):
        for name, fn in (("full mask, every key", full), ("paradraft (key span per query block)", paradraft)):
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            t0 = time.perf_counter()
            fn(q, k, v).float().square().mean().backward()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["full mask, every key"]
    rows = [{"method": k, "fwd_bwd_s_median": v, "speedup": base / v} for k, v in med.items()]
    out = {"benchmark": "attention", "date": time.strftime("%Y-%m-%d"), "slots": T, "elements": n,
           "threads": torch.get_num_threads(), "repeats": a.repeats, "rows": rows}
    for r in rows:
        print(f"{r['method']:40s} {r['fwd_bwd_s_median'] * 1000:8.0f} ms  {r['speedup']:.2f}x")
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
