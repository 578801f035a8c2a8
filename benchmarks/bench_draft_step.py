"""What one speculative step costs: the drafter's pass and the verifier's pass, in ms, against a plain decoding step.

Greedy decoding of HumanEval prompts through paradraft's engine on the embedded SmolLM2 (float32, batch 1), plain
and with a drafter at K drafts, each source tree in its own process; --compare-src runs the same with another
commit's src/ (side by side), the processes interleaved over --repeats (A B A B ...), medians reported. Every run's
tokens are checked against plain decoding's (lossless).

    git worktree add /tmp/before HEAD~1
    python benchmarks/bench_draft_step.py --drafter runs/quickstart/peagle --compare-src /tmp/before/src

usage: python benchmarks/bench_draft_step.py --drafter DIR [--k 3] [--prompts 3] [--max-new-tokens 48]
       [--repeats 4] [--compare-src DIR] [--output benchmarks/results/draft_step.json]
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

SRC = str(Path(__file__).resolve().parents[1] / "src")


def child(drafter_dir: str, k: int, n_prompts: int, max_new: int) -> dict:
    import torch

    import paradraft
    from paradraft.data.sources import read_humaneval
    from paradraft.data.template import encode_prompt, stop_token_ids
    from paradraft.decode.engine import Engine, GenerationConfig
    from paradraft.models.checkpoint import load_drafter
    from paradraft.verifier import load_verifier

    model, tok = load_verifier("smollm2-135m", dtype="float32")
    drafter = load_drafter(drafter_dir, verifier=model, verifier_name="smollm2-135m").float()
    prompts = [encode_prompt(tok, {"prompt": r["messages"][0]["content"]}) for r in list(read_humaneval())[:n_prompts]]
    g = GenerationConfig(max_new_tokens=max_new, eos_token_ids=stop_token_ids(tok), num_speculative_tokens=k)

    def run(d) -> dict:
        eng = Engine(model, d, max_len=2048)
        t0 = time.perf_counter()
        outs = [eng.generate([p], g)[0] for p in prompts]
        s = time.perf_counter() - t0
        passes = sum(o.num_verifier_passes for o in outs)
        return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / s, "passes": passes,
                "draft_ms": 1e3 * sum(o.draft_s for o in outs) / passes,
                "verify_ms": 1e3 * sum(o.verify_s for o in outs) / passes, "tokens": [o.token_ids for o in outs]}

    with torch.inference_mode():
        run(drafter)  # warm-up (and the small-M rule's measurements)
        plain, spec = run(None), run(drafter)
    return {"source": str(Path(paradraft.__file__).parents[1]), "plain_tokens_per_s": plain["tokens_per_s"],
            "plain_step_ms": plain["verify_ms"], "tokens_per_s": spec["tokens_per_s"], "draft_ms": spec["draft_ms"],
            "verify_ms": spec["verify_ms"], "passes": spec["passes"], "same_tokens": spec["tokens"] == plain["tokens"],
            "speedup": spec["tokens_per_s"] / plain["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--compare-src", default=None, help="another commit's src/ directory, run side by side")
    ap.add_argument("--output", default="benchmarks/results/draft_step.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.drafter, a.k, a.prompts, a.max_new_tokens)))
        return
    sources = [SRC] + ([str(Path(a.compare_src).resolve())] if a.compare_src else [])
    runs: dict[str, list] = {}
    for rep in range(a.repeats):
        for src in (sources if rep % 2 == 0 else sources[::-1]):
            r = subprocess.run([sys.executable, __file__, "--child", "--drafter", a.drafter, "--k", str(a.k),
                                "--prompts", str(a.prompts), "--max-new-tokens", str(a.max_new_tokens)],
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=src))
            if r.returncode != 0:
                sys.exit(f"bench_draft_step: {src} failed:\n{r.stderr[-2000:]}")
            row = json.loads(r.stdout.strip().splitlines()[-1])
            runs.setdefault(src, []).append(row)
            print(f"[bench_draft_step] repeat {rep + 1}: {row}", flush=True)
    keys = ("plain_tokens_per_s", "plain_step_ms", "tokens_per_s", "draft_ms", "verify_ms", "speedup")
    rows = [{"source": src, "runs": len(rs), "same_tokens": all(r["same_tokens"] for r in rs),
             **{k: statistics.median(r[k] for r in rs) for k in keys}, "per_repeat": rs} for src, rs in runs.items()]
    out = {"benchmark": "draft_step", "date": time.strftime("%Y-%m-%d"), "k": a.k, "prompts": a.prompts,
           "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "drafter": a.drafter,
           "settings": "embedded SmolLM2, float32, batch 1, greedy; ms per verifier pass; medians over processes",
           "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"{r['source']:32s} plain {r['plain_step_ms']:5.1f} ms/step  K={a.k}: draft {r['draft_ms']:5.1f} ms, "
              f"verify {r['verify_ms']:5.1f} ms, {r['speedup']:.2f}x of plain, same tokens: {r['same_tokens']}")
    print(f"-> {a.output}")


if __name__ == "__main__":
    main()
