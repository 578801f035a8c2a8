"""A small sweep of P-EAGLE training settings on the embedded verifier: which defaults measure best.

Each setting trains for the same number of steps on the same prepared data / hidden states and is scored by the
held-out acceptance-length estimate (paradraft.models.loss.acceptance_estimate) at K=7 and by its depth-0 accuracy.
usage: python benchmarks/sweep_train_defaults.py --data DIR --hidden-states DIR [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from paradraft.config import TrainConfig
from paradraft.train.trainer import train

SETTINGS = {
    "baseline (lr 1e-3, 1 layer, decay 1.0, norm from verifier)": {},
    "norm init ones": {"init_norm": "ones"},
    "lr 3e-4": {"lr": 3e-4},
    "depth decay 0.8": {"loss_decay": 0.8},
    "2 draft layers": {"num_layers": 2},
    "lr 3e-3": {"lr": 3e-3},
    "trainable embeddings": {"train_embeddings": True},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--hidden-states", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--output", default="benchmarks/results/sweep_train_defaults.json")
    ap.add_argument("--only", nargs="*", help="run only these setting names")
    a = ap.parse_args()
    old = json.loads(Path(a.output).read_text())["rows"] if a.only and Path(a.output).is_file() else []
    rows = [r for r in old if r["setting"] not in a.only] if a.only else []  # --only adds to an earlier sweep
    for name, over in SETTINGS.items():
        if a.only and name not in a.only:
            continue
        with tempfile.TemporaryDirectory() as d:
            kw = dict(algorithm="peagle", data=a.data, hidden_states=a.hidden_states, output=d, max_steps=a.steps,
                      batch_tokens=2048, lr=1e-3, warmup_steps=10, num_depths=8, save_every=10_000, val_samples=32,
                      init_norm="verifier", num_layers=1, loss_decay=1.0)  # the base every setting changes one thing of
            kw.update(over)
            t0 = time.time()
            final = train(TrainConfig(**kw))
            v = final["val"]
            rows.append({"setting": name, "overrides": over,
                         "val_acceptance_length_k7": v["acceptance_length_estimate"],
                         "val_acc_depth0": v["acc"][0], "val_acc": v["acc"], "seconds": time.time() - t0})
            print(rows[-1], flush=True)
            write(a, rows)  # after every setting: a stopped sweep keeps what it measured


def write(a, rows) -> None:
    out = {"benchmark": "sweep_train_defaults", "date": time.strftime("%Y-%m-%d"), "steps": a.steps,
           "data": a.data, "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
