"""Training throughput and peak memory of both algorithms on the embedded verifier (each in its own process).

Needs prepared data + extracted hidden states (e.g. from `make demo`: runs/quickstart/{data,hidden_states}).
usage: python benchmarks/bench_train.py [--data runs/quickstart/data] [--hidden-states runs/quickstart/hidden_states]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(algo: str, data: str, hs: str, steps: int) -> dict:
    from paradraft.config import TrainConfig
    from paradraft.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as d:
        t = Trainer(TrainConfig(algorithm=algo, data=data, hidden_states=hs, output=d, max_steps=steps,
                                batch_tokens=2048, save_every=10_000, val_samples=0, warmup_steps=2))
        t.train()
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    tps = sorted(r["tokens_per_s"] for r in rows[1:])
    return {"algorithm": algo, "steps": steps, "tokens_per_s_median": tps[len(tps) // 2],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "settings": "1 draft layer, 8k draft vocab, 2048-slot packs, bf16 autocast; peagle 8 depths COD 0.7/0.2; "
                        "eagle3 3 TTT steps"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="runs/quickstart/data")
    ap.add_argument("--hidden-states", default="runs/quickstart/hidden_states")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--output", default="benchmarks/results/train.json")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.data, a.hidden_states, a.steps)))
        return
    rows = []
    for algo in ("peagle", "eagle3"):
        r = subprocess.run([sys.executable, __file__, "--child", algo, "--data", a.data, "--hidden-states",
                            a.hidden_states, "--steps", str(a.steps)], capture_output=True, text=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
                    {"algorithm": algo, "error": r.stderr[-500:]})
        print(rows[-1], flush=True)
    out = {"benchmark": "train", "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
