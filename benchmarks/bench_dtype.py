"""Verifier dtype on this CPU: the embedded SmolLM2's forward (what `extract` and online training run), plain
greedy decoding at batch 1 (what `generate` and `bench` run) and at `--batch` (what `regenerate` runs), bfloat16
against float32, interleaved, medians over repeats, with the CPU's vector extensions and what `auto` resolves to
here (paradraft.utils.fast_dtype).

usage: python benchmarks/bench_dtype.py [--tokens 1024] [--rows 2] [--prompts 3] [--max-new-tokens 32]
       [--batch 16] [--repeats 3] [--output benchmarks/results/dtype/verifier_dtype.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from paradraft.data.sources import read_humaneval
from paradraft.data.template import encode_prompt
from paradraft.decode.engine import Engine, GenerationConfig
from paradraft.utils import fast_dtype
from paradraft.verifier import load_verifier

DTYPES = ("bfloat16", "float32")


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return sorted(f for f in set(flags) if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per row of the forward batch")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="prompts decoded together (regenerate's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/dtype/verifier_dtype.json")
    a = ap.parse_args()
    models = {d: load_verifier("smollm2-135m", dtype=d) for d in DTYPES}
    tok = models["float32"][1]
    problems = [r["messages"][0]["content"] for r in list(read_humaneval())[: max(a.prompts, a.batch)]]
    batch = [encode_prompt(tok, {"prompt": p}) for p in problems[: a.batch]]
    prompts = batch[: a.prompts] if a.prompts <= a.batch else [encode_prompt(tok, {"prompt": p}) for p in problems]
    ids = torch.randint(0, tok.vocab_size, (a.rows, a.tokens), generator=torch.Generator().manual_seed(0))
    g = GenerationConfig(max_new_tokens=a.max_new_tokens, temperature=0.0, eos_token_ids=[])
    fwd = {d: [] for d in DTYPES}
    dec = {d: [] for d in DTYPES}
    dec_b = {d: [] for d in DTYPES}
    with torch.inference_mode():
        for d in DTYPES:  # warm-up
            models[d][0].model(ids[:, :64])
        for _ in range(a.repeats):
            for d in DTYPES:  # interleaved: a busy spell slows both
                m = models[d][0]
                t0 = time.perf_counter()
                m.model(ids)
                fwd[d].append(ids.numel() / (time.perf_counter() - t0))
                engine = Engine(m, None, max_len=max(len(p) for p in prompts + batch) + a.max_new_tokens + 8)
                t0 = time.perf_counter()
                n = sum(len(engine.generate([p], g)[0].token_ids) for p in prompts)
                dec[d].append(n / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                n = sum(len(o.token_ids) for o in engine.generate(batch, g))
                dec_b[d].append(n / (time.perf_counter() - t0))
    med = {k: {d: statistics.median(v[d]) for d in DTYPES}
           for k, v in (("forward", fwd), ("decode", dec), (f"decode_batch{a.batch}", dec_b))}
    out = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
           "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "auto_resolves_to": fast_dtype("cpu"), "repeats": a.repeats, "forward_tokens": ids.numel(),
           "decode_tokens": a.prompts * a.max_new_tokens, "batch": a.batch,
           "forward_tokens_per_s": {d: fwd[d] for d in DTYPES}, "decode_tokens_per_s": {d: dec[d] for d in DTYPES},
           f"decode_batch{a.batch}_tokens_per_s": {d: dec_b[d] for d in DTYPES},
           "median": med,
           "float32_over_bfloat16": {k: med[k]["float32"] / med[k]["bfloat16"] for k in med}}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")
    flags = " ".join(out["cpu_flags"]) or "(none of avx2 / avx512 / amx)"
    print(f"CPU flags {flags}; auto -> {out['auto_resolves_to']}")
    for k, unit in (("forward", "tokens/s"), ("decode", "new tokens/s"), (f"decode_batch{a.batch}", "new tokens/s")):
        print(f"{k:15s} bf16 {med[k]['bfloat16']:8.1f}  fp32 {med[k]['float32']:8.1f} {unit}  "
              f"(fp32 / bf16 = {out['float32_over_bfloat16'][k]:.2f}x)")
    print(f"-> {a.output}")


if __name__ == "__main__":
    main()
