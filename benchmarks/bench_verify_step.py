"""What a verification step of K+1 rows costs against a plain decoding step, in fresh processes, and what the
small-M rule of `paradraft.verifier.linear` chose in each (the rule is measured once per process, so a choice that
flips between processes shows as a step cost that does too).

Each process loads the embedded SmolLM2 (float32), feeds a 200-token context to the engine's runner, then times
steps of 1, 2, 4 and 8 rows at that context (rolled back after each), interleaved, medians of --steps.

    python benchmarks/bench_verify_step.py --processes 4 --also on off \
        --output benchmarks/results/dtype/verify_step.json [--src /tmp/before/src]
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

ROWS = (1, 2, 4, 8)


def child(steps: int) -> dict:
    import torch

    from paradraft.verifier import linear as L
    from paradraft.verifier import load_verifier
    from paradraft.verifier.runner import VerifierRunner

    model, _ = load_verifier("smollm2-135m", dtype="float32")
    runner = VerifierRunner(model, [2, 15, 27], 1, 1024)
    g = torch.Generator().manual_seed(0)
    ctx = 200
    ts: dict[int, list[float]] = {n: [] for n in ROWS}
    with torch.inference_mode():
        runner.forward(torch.randint(0, 49000, (1, ctx), generator=g))

        def step(n: int) -> float:
            tokens = torch.randint(0, 49000, (1, n), generator=g)  # [1, n]
            t0 = time.perf_counter()
            runner.forward(tokens)
            dt = time.perf_counter() - t0
            runner.set_lengths(torch.tensor([0]), torch.tensor([ctx]))  # back to the context
            return dt

        for n in ROWS:  # warm-up; the rule measures each shape here
            step(n)
        for _ in range(steps):
            for n in ROWS:
                ts[n].append(step(n))
    ms = {str(n): statistics.median(v) * 1e3 for n, v in ts.items()}  # JSON keys: rows as text
    chosen = {f"{k[0]} rows {k[1]}x{k[2]}": bool(v) for k, v in sorted(L._FASTER.items())}
    return {"step_ms": ms, "ratio": {n: t / ms["1"] for n, t in ms.items()}, "transposed": chosen,
            "small_m": os.environ.get(L.SMALL_M_ENV, "auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=4, help="fresh processes with the rule measured (auto)")
    ap.add_argument("--also", nargs="*", default=["on", "off"], help="also one process per forced setting")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--src", default=None, help="another commit's src/ to import paradraft from (side by side)")
    ap.add_argument("--output", default="benchmarks/results/dtype/verify_step.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.steps)))
        return
    runs = []
    for setting in ["auto"] * a.processes + list(a.also):
        env = dict(os.environ, PARADRAFT_SMALL_M=setting, HF_HUB_OFFLINE="1")
        if a.src:
            env["PYTHONPATH"] = os.pathsep.join([str(Path(a.src).resolve()), env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(a.steps)], env=env, check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        runs.append(r)
        picked = sum(r["transposed"].values())
        print(f"{setting:>4}: " + "  ".join(f"{n} rows {t:.1f} ms" for n, t in r["step_ms"].items())
              + f"  ratio 4/1 {r['ratio']['4']:.2f}  transposed {picked}/{len(r['transposed'])} shapes", flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "steps": a.steps, "rows": list(ROWS),
           "src": a.src, "runs": runs}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(a.output).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, a.output)
    print(f"-> {a.output}")


if __name__ == "__main__":
    main()
