"""Training throughput and peak memory on the embedded verifier, each run in its own process.

Needs prepared data + extracted hidden states (e.g. from `make demo`: runs/quickstart/{data,hidden_states}).
Rows run interleaved over --repeats (A B A B ...), so a machine that slows down mid-run hits every row alike; the
table reports medians. --compare-src runs the same rows with another commit's source tree as well (side by side):

    git worktree add /tmp/before HEAD~1
    python benchmarks/bench_train.py --compare-src /tmp/before/src --autocast bfloat16 auto --algorithm peagle

usage: python benchmarks/bench_train.py [--data DIR] [--hidden-states DIR] [--autocast auto ...] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def child(algo: str, data: str, hs: str, steps: int, autocast: str) -> dict:
    import paradraft
    from paradraft.config import TrainConfig
    from paradraft.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as d:
        t = Trainer(TrainConfig(algorithm=algo, data=data, hidden_states=hs, output=d, max_steps=steps,
                                batch_tokens=2048, save_every=10_000, val_samples=0, warmup_steps=2,
                                draft_vocab_size=8192, num_depths=7, autocast=autocast))
        t.train()
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]  # the first step pays for allocations
    # offline on a CPU the epochs after the first reuse each sample's verifier targets: their speed is its own row
    by_epoch = {"first_epoch": [r for r in later if r.get("epoch", 0) == 0],
                "later_epochs": [r for r in later if r.get("epoch", 0) > 0]}
    return {"algorithm": algo, "autocast": autocast, "resolved": getattr(t, "autocast", autocast),
            "source": str(Path(paradraft.__file__).parents[1]), "steps": steps,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            **{f"tokens_per_s_{k}": statistics.median(r["tokens_per_s"] for r in v) if v else None
               for k, v in by_epoch.items()},
            "step_s": statistics.median(r["step_s"] for r in later if "step_s" in r) if "step_s" in later[0] else None,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="runs/quickstart/data")
    ap.add_argument("--hidden-states", default="runs/quickstart/hidden_states")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--algorithm", nargs="+", default=["peagle", "eagle3"])
    ap.add_argument("--autocast", nargs="+", default=["auto"], help="autocast values (auto | bfloat16 | float32)")
    ap.add_argument("--compare-src", default=None, help="another commit's src/ directory, run side by side")
    ap.add_argument("--output", default="benchmarks/results/train.json")
    ap.add_argument("--child", nargs=2, default=None, metavar=("ALGORITHM", "AUTOCAST"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.data, a.hidden_states, a.steps, a.child[1])))
        return
    sources = [SRC] + ([str(Path(a.compare_src).resolve())] if a.compare_src else [])
    runs: dict[tuple, list] = {}
    for rep in range(a.repeats):
        for src in sources:
            for algo in a.algorithm:
                for ac in a.autocast:
                    env = dict(os.environ, PYTHONPATH=src)
                    r = subprocess.run([sys.executable, __file__, "--child", algo, ac, "--data", a.data,
                                        "--hidden-states", a.hidden_states, "--steps", str(a.steps)],
                                       capture_output=True, text=True, env=env)
                    if r.returncode != 0 and src != SRC:  # e.g. a flag value the older commit did not have
                        print(f"[bench_train] skipped {algo} {ac} with {src}: {r.stderr.strip().splitlines()[-1]}")
                        continue
                    if r.returncode != 0:
                        sys.exit(f"bench_train: {algo} {ac} ({src}) failed:\n{r.stderr[-2000:]}")
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                    runs.setdefault((src, algo, ac), []).append(row)
                    print(f"[bench_train] repeat {rep + 1}: {row}", flush=True)
    rows = []
    for (src, _, _), rs in runs.items():
        per_epoch = {k: statistics.median(r[k] for r in rs) if all(r.get(k) for r in rs) else None
                     for k in ("tokens_per_s_first_epoch", "tokens_per_s_later_epochs")}
        rows.append({**rs[0], **per_epoch, "source": src,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "tokens_per_s_repeats": [r["tokens_per_s"] for r in rs],
                     "peak_rss_gib": max(r["peak_rss_gib"] for r in rs)})
    out = {"benchmark": "train", "date": time.strftime("%Y-%m-%d"), "repeats": a.repeats, "steps": a.steps,
           "settings": "1 draft layer, 8k draft vocab, 2048-slot packs; peagle 7 depths COD 0.7/0.2; eagle3 3 TTT "
                       "steps; tokens/s = slots per second, median over steps after the first, then over repeats; "
                       "_first_epoch / _later_epochs: the same medians over the steps of epoch 0 / epochs >= 1",
           "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"{r['source']:40s} {r['algorithm']:7s} {r['autocast']:9s}->{r['resolved']:9s} "
              f"{r['tokens_per_s']:8.0f} slots/s  {r['peak_rss_gib']:.2f} GiB  (epoch 0 / later: "
              f"{r['tokens_per_s_first_epoch'] or 0:.0f} / {r['tokens_per_s_later_epochs'] or 0:.0f})")


if __name__ == "__main__":
    main()
