"""Benchmark `paradraft prepare` on N ShareGPT conversations for the embedded verifier; writes JSON.

usage: python benchmarks/bench_prepare.py [--num 5000] [--repeats 3] [--output benchmarks/results/prepare.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from paradraft.config import PrepareConfig
from paradraft.data.prepare import prepare
from paradraft.verifier import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--output", default="benchmarks/results/prepare.json")
    args = ap.parse_args()
    tok = load_tokenizer("smollm2-135m")
    times, manifest = [], None
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            manifest = prepare(PrepareConfig(data=["sharegpt"], output=str(Path(d) / "o"), max_samples=args.num,
                                             seq_length=args.seq_length), tokenizer=tok)
            times.append(time.perf_counter() - t0)
    result = {"benchmark": "prepare", "num_conversations": args.num, "seq_length": args.seq_length,
              "seconds_median": statistics.median(times), "seconds_all": times,
              "tokens": manifest["num_tokens"], "tokens_per_s": manifest["num_tokens"] / statistics.median(times),
              "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d")}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
