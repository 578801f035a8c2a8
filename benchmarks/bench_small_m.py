"""Small-M float32 matmuls on this CPU: a verification step multiplies K+1 rows by every weight matrix, decoding
one row. `F.linear(x, W)` (what nn.Linear runs) against `(W @ x.T).T` for M = 1..16 rows on the embedded
SmolLM2's shapes, then plain decoding and speculative decoding (a drafter, K=3 and 7) through paradraft's engine
with the verifier's projections run three ways, interleaved, medians over repeats: as the module itself
(`module(x)`, the engine before paradraft.verifier.linear), always `(W @ x.T).T` for 2..16 rows
($PARADRAFT_SMALL_M=on), and as the engine runs by default (each shape measured once, the faster kept).

usage: python benchmarks/bench_small_m.py --drafter DIR [--prompts 3] [--max-new-tokens 48] [--repeats 3]
       [--k 3 7] [--output benchmarks/results/dtype/small_m.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

import paradraft.verifier.adapters as adapters
import paradraft.verifier.linear as small_m
import paradraft.verifier.runner as runner
from paradraft.data.sources import read_humaneval
from paradraft.data.template import encode_prompt, stop_token_ids
from paradraft.decode.engine import Engine, GenerationConfig
from paradraft.models.checkpoint import load_drafter
from paradraft.verifier import load_verifier
from paradraft.verifier.linear import SMALL_M_ENV

ROUTES = ("module(x)", "transposed", "measured")  # as the module; (W @ x.T).T at 2..16 rows; the measured rule
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]  # one layer


@contextlib.contextmanager
def as_modules():
    """The engine with every projection run as the module itself (the engine before paradraft.verifier.linear)."""
    saved = runner.linear, runner.mlp, adapters.linear
    runner.linear = adapters.linear = lambda module, x: module(x)
    runner.mlp = lambda block, x: block(x)
    try:
        yield
    finally:
        runner.linear, runner.mlp, adapters.linear = saved


def kernels(repeats: int) -> dict:
    ws = [torch.randn(o, i) for i, o in SHAPES]
    out = {}
    for m in (1, 2, 4, 8, 16):
        xs = [torch.randn(m, i) for i, _ in SHAPES]
        t = {"F.linear": [], "(W @ x.T).T": []}
        for _ in range(repeats):
            for name in t:
                t0 = time.perf_counter()
                for _ in range(20):
                    for x, w in zip(xs, ws):
                        (torch.nn.functional.linear(x, w) if name == "F.linear" else (w @ x.T).T)
                t[name].append((time.perf_counter() - t0) / 20 * 1000)
        out[m] = {k: statistics.median(v) for k, v in t.items()}
        print(f"M={m:2d}  " + "  ".join(f"{k} {v:.2f} ms" for k, v in out[m].items()) + "  (one layer's 7 matmuls)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7], help="drafts per step (K + 1 verified rows)")
    ap.add_argument("--output", default="benchmarks/results/dtype/small_m.json")
    a = ap.parse_args()
    res = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "kernels_ms": kernels(a.repeats)}
    model, tok = load_verifier("smollm2-135m", dtype="float32")
    drafter = load_drafter(a.drafter, verifier=model, verifier_name="smollm2-135m").float()
    problems = [r["messages"][0]["content"] for r in list(read_humaneval())[: a.prompts]]
    prompts = [encode_prompt(tok, {"prompt": p}) for p in problems]
    eos = stop_token_ids(tok)
    runs = {}
    configs = [("plain", None, 0)] + [(route, route, k) for k in a.k for route in ROUTES]
    with torch.inference_mode():
        for rep in range(a.repeats):
            # odd repeats run the configurations in reverse order (A B C, C B A, ...), so neighbours in the order
            # do not inherit each other's warm caches or a machine that slows down within a repeat
            for name, route, k in (configs if rep % 2 == 0 else configs[::-1]):
                engine = Engine(model, drafter if k else None, max_len=2048)
                g = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_token_ids=eos,
                                     num_speculative_tokens=max(k, 1))
                os.environ[SMALL_M_ENV] = {"transposed": "on", "measured": "auto"}.get(route, "off")
                with as_modules() if route == "module(x)" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    outs = [engine.generate([p], g)[0] for p in prompts]
                    s = time.perf_counter() - t0
                n = sum(len(o.token_ids) for o in outs)
                runs.setdefault(name if k == 0 else f"{name} K={k}", []).append(
                    {"tokens_per_s": n / s, "tokens": [o.token_ids for o in outs]})
    os.environ.pop(SMALL_M_ENV, None)
    res["measured_choice"] = {f"rows={r} W={o}x{i} threads={t}": faster
                              for (r, o, i, t), faster in sorted(small_m._FASTER.items())}
    res["decode"] = {}
    for name, rs in runs.items():
        res["decode"][name] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                               "per_repeat": [r["tokens_per_s"] for r in rs]}
    base = res["decode"]["plain"]["tokens_per_s"]
    for name, r in res["decode"].items():
        r["over_plain"] = r["tokens_per_s"] / base
        print(f"{name:22s} {r['tokens_per_s']:6.2f} tokens/s  {r['over_plain']:.2f}x of plain")
    same = all(rs[0]["tokens"] == runs["plain"][0]["tokens"] for rs in runs.values())
    res["same_tokens_everywhere"] = same
    print(f"same tokens in every configuration: {same}")
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(res, indent=2) + "\n")
    print(f"-> {a.output}")


if __name__ == "__main__":
    main()
