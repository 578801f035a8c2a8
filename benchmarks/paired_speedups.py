"""Benchmark results under both definitions of `speedup`, side by side, from the JSON `paradraft bench` wrote.

Until 2026-12-03 a row's `speedup` was the ratio of two medians: the method's median tokens/s over plain decoding's
median tokens/s, which pairs runs of different repeats. Since then it is the median of the paired per-repeat
speedups (`paradraft.bench.metrics.median_speedup`), which every results file already holds as
`speedup_per_repeat`. This script recomputes both for files written either way:

  python benchmarks/paired_speedups.py FILE.json [FILE.json ...] [--output JSON]

and prints a markdown table (file, method, K, acceptance length, both speedups, the repeats).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradraft.bench.metrics import median_speedup


def rows(path: Path) -> list[dict]:
    out = json.loads(path.read_text())
    plain = next(r for r in out["results"] if r["method"] == "plain")
    res = []
    for r in out["results"]:
        per = r.get("speedup_per_repeat")
        if r["method"] == "plain" or not per:
            continue
        res.append({"file": str(path), "method": r["method"], "drafter": r.get("drafter"), "k": r["k"],
                    "acceptance_length": r["acceptance_length"],
                    "ratio_of_medians": r["tokens_per_s"] / plain["tokens_per_s"],
                    "median_of_paired": median_speedup(per), "per_repeat": per})
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--output", type=Path, help="also write the rows as JSON")
    a = ap.parse_args()
    table = [r for f in a.files for r in rows(f)]
    print("| file | method | drafter | K | acceptance length | ratio of medians (before) | median of paired (now) "
          "| per repeat |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {Path(r['file']).name} | {r['method']} | {r['drafter'] or '-'} | {r['k']} | "
              f"{r['acceptance_length']:.2f} | {r['ratio_of_medians']:.2f}x | {r['median_of_paired']:.2f}x | "
              + " ".join(f"{x:.2f}" for x in r["per_repeat"]) + " |")
    if a.output:
        a.output.write_text(json.dumps({"benchmark": "paired_speedups", "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
