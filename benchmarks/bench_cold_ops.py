"""What a small eager operation costs right after a decoding step has streamed its weights through the caches.

A batch-1 decoding step of the embedded verifier reads 269 MB (bf16) of weights, far more than a 2-core machine's
share of the caches, so whatever ran before it (the interpreter's objects, torch's dispatcher, small tensors) is
evicted by the time the step's eager bookkeeping runs. This times a few of the engine's small operations (the
acceptance rule's comparison, its prefix length, the argmax of a verification's logits, an embedding lookup)
"hot" (each right after the same operations, as a loop would run them) and "cold" (each set right after a
`--stream-mb` read of a buffer on 2 MiB pages, as a step's weights are read), interleaved, medians of `--repeats`.
Microseconds per operation, to JSON.

  python benchmarks/bench_cold_ops.py [--stream-mb 300] [--repeats 50] [--output benchmarks/results/cold-ops.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_engine_limit import host  # benchmarks/ (the script's own directory)

from paradraft import kernels
from paradraft.decode.sampling import greedy
from paradraft.decode.verify import greedy_accept
from paradraft.utils import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stream-mb", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--output", default="benchmarks/results/cold-ops.json")
    args = ap.parse_args()
    kernels.available()
    big = kernels.on_huge_pages([torch.ones(args.stream_mb << 20, dtype=torch.uint8)])[0]
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([[11, 12, 13]])  # [1, K]
    target = torch.tensor([[11, 12, 14, 15]])  # [1, K+1]
    logits = torch.randn(1, 4, 49152, generator=g)  # a K=3 verification's float32 logits [1, K+1, V]
    table = torch.randn(49152, 576, generator=g).to(torch.bfloat16)  # an embedding table [V, H]
    tokens = torch.tensor([[5]])
    ops = {"compare (draft == target)": lambda: (draft == target[:, :-1]).int(),
           "greedy_accept [1, 3]": lambda: greedy_accept(draft, target),
           "greedy (argmax) of [1, 4, 49152]": lambda: greedy(logits),
           "embedding of one token": lambda: torch.nn.functional.embedding(tokens, table)}
    times = {(mode, name): [] for mode in ("hot", "cold") for name in ops}
    with torch.inference_mode():
        for r in range(args.repeats + 1):
            for mode in (("hot", "cold") if r % 2 == 0 else ("cold", "hot")):
                if mode == "cold":
                    big.view(torch.int64).sum()  # the stream: the caches hold this buffer now
                else:
                    for f in ops.values():
                        f()
                for name, f in ops.items():
                    t0 = time.perf_counter()
                    f()
                    if r:  # the first round warms up
                        times[(mode, name)].append(time.perf_counter() - t0)
    rows = [{"op": name, "hot_us": 1e6 * statistics.median(times[("hot", name)]),
             "cold_us": 1e6 * statistics.median(times[("cold", name)])} for name in ops]
    for row in rows:
        row["cold_over_hot"] = row["cold_us"] / row["hot_us"]
        print(f"{row['op']:36s} hot {row['hot_us']:7.1f} us  cold {row['cold_us']:7.1f} us  "
              f"{row['cold_over_hot']:.1f}x")
    write_json(args.output, {"benchmark": "cold_ops", "date": time.strftime("%Y-%m-%d %H:%M"), "host": host(),
                             "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
