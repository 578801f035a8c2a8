"""Plain decoding of a batch through `Engine.generate` with the engine's default KV cache (4,096 places), the way
`paradraft generate` and the library run a batch: wall time and new tokens/s, medians of repeats, each revision in
its own process, alternated.

  python benchmarks/bench_batch_generate.py [--src OTHER/src ...] [--batch 32] [--max-new-tokens 48]
        [--dtype float32] [--repeats 3] [--output benchmarks/results/batch-generate.json]
--src adds another checkout's src/ (before a change, say) as a side of the comparison; this checkout's is always one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"


def child(a) -> None:
    import torch

    from paradraft.data.sources import read_humaneval
    from paradraft.data.template import encode_prompt
    from paradraft.decode.engine import Engine, GenerationConfig
    from paradraft.verifier import load_verifier

    torch.set_grad_enabled(False)
    model, tok = load_verifier("smollm2-135m", dtype=getattr(torch, a.dtype))
    rows = list(read_humaneval())[: a.batch]
    prompts = [encode_prompt(tok, {"prompt": r["messages"][0]["content"]})[:150] for r in rows]
    engine = Engine(model, compile=True)
    engine.generate(prompts, GenerationConfig(max_new_tokens=8))  # compiles
    t0 = time.perf_counter()
    rs = engine.generate(prompts, GenerationConfig(max_new_tokens=a.max_new_tokens))
    wall = time.perf_counter() - t0
    print(json.dumps({"wall_s": wall, "new_tokens": sum(len(r.token_ids) for r in rs)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", nargs="*", default=[])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/batch-generate.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    sides = [str(HERE)] + [str(Path(s).resolve()) for s in a.src]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(a.repeats):  # alternated, one process at a time
        for s in sides:
            env = dict(os.environ, PYTHONPATH=s)
            out = subprocess.run([sys.executable, __file__, "--child", "--batch", str(a.batch), "--max-new-tokens",
                                  str(a.max_new_tokens), "--dtype", a.dtype], env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{s}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
            runs[s].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(s, runs[s][-1], flush=True)
    rows = [{"src": s, "wall_s": statistics.median(r["wall_s"] for r in v),
             "tokens_per_s": statistics.median(r["new_tokens"] / r["wall_s"] for r in v), "runs": v}
            for s, v in runs.items()]
    for r in rows:
        print(f"{r['src']}: {r['wall_s']:.2f} s, {r['tokens_per_s']:.1f} new tokens/s (median of {a.repeats})")
    from bench_engine_limit import host  # benchmarks/ (the script's own directory)

    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"benchmark": "batch_generate", "date": time.strftime("%Y-%m-%d %H:%M"),
                               "host": host(), "args": vars(a), "rows": rows}, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
