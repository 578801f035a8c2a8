"""The workflow from Python: prepare, train, bench and export through the same typed configs the command line fills.

    python examples/python_api.py [--work runs/example-api] [--steps 20] [--samples 64]

The defaults take a few minutes on a 2-core CPU with the embedded verifier; CI runs it smaller
(tests/test_examples.py).
"""

from __future__ import annotations

import argparse
import json

from paradraft.bench.run import bench
from paradraft.config import BenchConfig, ExportConfig, PrepareConfig, TrainConfig
from paradraft.data.prepare import prepare
from paradraft.export.vllm import export
from paradraft.train.trainer import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/example-api")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per benchmark prompt")
    a = ap.parse_args()
    data, drafter = f"{a.work}/data", f"{a.work}/peagle"
    manifest = prepare(PrepareConfig(data=["chitchat"], max_samples=a.samples, seq_length=256, val_fraction=0.1,
                                     output=data))
    final = train(TrainConfig(data=data, online=True, output=drafter, max_steps=a.steps, num_depths=3,
                              draft_vocab_size=2048, batch_tokens=1024, val_samples=4))
    results = bench(BenchConfig(drafter=[drafter], data=data, num_prompts=2, max_new_tokens=a.tokens, repeats=1,
                                prompt_lookup=False, output=f"{a.work}/bench.json"))
    export(ExportConfig(drafter=drafter, output=f"{a.work}/export"))
    spec = next(r for r in results["results"] if r["method"] == "peagle")
    print(json.dumps({"samples": manifest["num_samples"], "final_step": final["step"],
                      "acceptance_length": round(spec["acceptance_length"], 3), "k": spec["k"]}))


if __name__ == "__main__":
    main()
