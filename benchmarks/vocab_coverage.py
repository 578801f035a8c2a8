"""How much of the verifier's greedy output a draft vocabulary can express: the ceiling of depth-0 acceptance.

For each draft-vocabulary size, the vocabulary is built as `paradraft train` builds it (most frequent trained tokens
of the train split + the template's special tokens); coverage = the fraction of held-out trained positions whose
verifier argmax (the target a greedy drafter must hit) lies in it.
usage: python benchmarks/vocab_coverage.py --data DIR --hidden-states DIR [--sizes 1024,2048,4096,8192,16384,32768]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from paradraft.data.prepare import PreparedDataset
from paradraft.data.vocab import draft_vocabulary
from paradraft.train.data import OfflineSource, TargetHead
from paradraft.verifier import load_verifier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--hidden-states", required=True)
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--output", default="benchmarks/results/vocab_coverage.json")
    a = ap.parse_args()
    ds = PreparedDataset(a.data)
    model, tok = load_verifier(ds.manifest["verifier"])
    V = model.config.vocab_size
    src = OfflineSource(a.hidden_states)
    val = src.available(ds.indices("val"))
    head = TargetHead(model, torch.arange(8), "cpu")  # only its full-vocabulary argmax is used here
    b = head.slot_batch(src.get(val))
    targets = b.target_ids[b.valid]  # [n] verifier argmax at every held-out trained slot
    freqs = ds.token_freqs()[:V]
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        _, t2d = draft_vocabulary(freqs, size, V, tok, fill=True)
        rows.append({"draft_vocab_size": size, "coverage": float(t2d[targets].float().mean())})
        print(f"draft vocab {size:6d}: {rows[-1]['coverage']:.1%} of held-out verifier targets")
    out = {"benchmark": "vocab_coverage", "date": time.strftime("%Y-%m-%d"), "data": a.data,
           "heldout_targets": int(targets.numel()), "distinct_trained_token_ids": int((freqs > 0).sum()), "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
