"""The engine against the machine's memory bandwidth: plain decoding and a K=3 speculative step, before and after.

Batch-1 decoding reads every weight once per token, so its limit is (verifier bytes) / (memory bandwidth). This
measures, side by side in one run, each configuration in its own process, run one after another (never two torch
processes at once):
  before      the engine without paradraft's CPU kernel and without compilation ($PARADRAFT_KERNELS=off, eager):
              the engine as it was before issue #44, its projections through torch
  kernel      paradraft's CPU kernel, eager
  compiled    the kernel and torch.compile (what bench, regenerate and quickstart run on a CPU), its weights on 4 KiB
              pages ($PARADRAFT_HUGE_PAGES=off, as are the two above)
  huge-pages  the same with the weights on 2 MiB pages (kernels.on_huge_pages): the default
  torch-compiled  the default without paradraft's kernel ($PARADRAFT_KERNELS=off, compiled, 2 MiB pages): what a
              CPU without AVX-512 ran before the kernel's AVX2 build (not in the default --configs)
  cpp-wrapper the default with inductor's C++ wrapper instead of its Python one ($PARADRAFT_CPP_WRAPPER=on; not
              in the default --configs)
for bf16 and float32: plain decoding tokens/s (batch 1, through Engine.generate, prefill included), the time of
one plain step and of one K=3 speculative pass (draft + verify K+1, per pass, from the engine's own timers), their
ratio, and a profile of the top operations of a plain step. The bandwidth is the fastest of six reads of 1 GiB
(a plain streaming read, torch's dot and torch's sum, each on 4 KiB and on 2 MiB pages; medians of 7: `bandwidths`).
Float32 outputs of every configuration are compared token for token.

  python benchmarks/bench_engine_limit.py [--drafter DIR] [--prompts 8] [--max-new-tokens 128] [--repeats 3]
        [--configs before kernel compiled huge-pages torch-compiled cpp-wrapper]
        [--output benchmarks/results/engine-limit.json]
Without --drafter an untrained P-EAGLE drafter of the default shape stands in: a pass costs what it costs whatever
the drafter learnt (acceptance changes the tokens per pass, not the time of a pass).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {"before": {"PARADRAFT_KERNELS": "off", "PARADRAFT_HUGE_PAGES": "off"},
           "kernel": {"PARADRAFT_HUGE_PAGES": "off"}, "compiled": {"PARADRAFT_HUGE_PAGES": "off"}, "huge-pages": {},
           "torch-compiled": {"PARADRAFT_KERNELS": "off"}, "cpp-wrapper": {"PARADRAFT_CPP_WRAPPER": "on"}}
COMPILED = ("compiled", "huge-pages", "torch-compiled", "cpp-wrapper")
DEFAULT_CONFIGS = ["before", "kernel", "compiled", "huge-pages"]


def host() -> dict:
    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        model = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return {"cpu": model.split(":", 1)[-1].strip(), "cores": os.cpu_count(), "amx": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "node": platform.node()}


READ_BYTES = 1 << 30  # what each read of the yardstick reads: 1 GiB, past any cache here


def _timed_gbs(read, repeats: int = 7) -> float:
    """GB/s of `read()` over READ_BYTES: the median of `repeats` after one untimed read."""
    read()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read()
        ts.append(time.perf_counter() - t0)
    return READ_BYTES / statistics.median(ts) / 1e9


def stream_read_op():
    """benchmarks/stream_read.cpp built (once per host, beside the kernel's builds) and loaded -> its op, or a string
    saying why not (a CPU the kernel does not build for, no compiler)."""
    import hashlib

    import torch

    from paradraft import kernels
    from paradraft.utils import cache_root

    if kernels.build_flags() is None:  # (the kernel's rule: AVX2 and FMA at least)
        return "this CPU has neither AVX2 nor AVX-512"
    source = Path(__file__).with_name("stream_read.cpp")
    cflags = ["-O3", "-mavx2", "-fopenmp"]  # (-fopenmp: at::parallel_for is inline, its threads come from it)
    key = hashlib.sha256(source.read_bytes() + repr((cflags, torch.__version__)).encode()).hexdigest()[:16]
    build = cache_root() / "kernels" / f"stream-read-{key}"
    try:
        if (build / "paradraft_bench.so").is_file():
            torch.ops.load_library(str(build / "paradraft_bench.so"))
        else:
            kernels.compile_library("paradraft_bench", source, build, cflags)
    except Exception as e:  # no compiler or ninja: the torch reads alone
        return f"stream_read.cpp could not be built ({type(e).__name__}: {str(e).strip()[-200:]})"
    return torch.ops.paradraft_bench.stream_read


def bandwidths() -> dict:
    """The memory's bandwidth to three reads of the same 1 GiB of float32, on 4 KiB pages and on 2 MiB pages (where
    the engine keeps its weights, kernels.on_huge_pages): a plain streaming read (benchmarks/stream_read.cpp: loads
    and a prefetch, nothing else), torch's dot of its two halves (MKL) and torch's sum, GB/s each as
    "<read>_<pages>"; "limit_gbs": the fastest, the yardstick of the limit. Until the thirteenth run the yardstick
    was torch's sum on 4 KiB pages alone, which computes as it reads: on the 2-core AMX host 17-21 GB/s, where the
    streaming read from 2 MiB pages reached 24-37 (BENCHMARKS.md, "The yardstick")."""
    import torch

    from paradraft import kernels

    op = stream_read_op()
    out = {} if callable(op) else {"stream_read_why_not": op}
    x4k = torch.ones(READ_BYTES // 4)
    x2m = kernels.on_huge_pages([x4k])[0]  # (x4k itself where there are no 2 MiB pages)
    for pages, x in (("4k", x4k), ("2m", x2m if x2m.data_ptr() != x4k.data_ptr() else None)):
        if x is None:  # no 2 MiB pages here
            continue
        half = x.numel() // 2
        out[f"torch_sum_{pages}"] = _timed_gbs(x.sum)
        out[f"torch_dot_{pages}"] = _timed_gbs(functools.partial(torch.dot, x[:half], x[half:]))
        if callable(op):
            out[f"stream_read_{pages}"] = _timed_gbs(functools.partial(op, x))
    out["limit_gbs"] = max(v for v in out.values() if isinstance(v, float))
    return out


def one(args) -> dict:
    """One configuration in this process -> its measurements."""
    import torch
    from bench_engine import drafter_or_stand_in  # benchmarks/ (the script's own directory)

    from paradraft import kernels
    from paradraft.data.sources import read_humaneval
    from paradraft.data.template import encode_prompt
    from paradraft.decode.engine import Engine, GenerationConfig
    from paradraft.verifier import load_verifier

    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    model, tok = load_verifier("smollm2-135m", dtype=dtype)
    texts = [r["messages"][0]["content"] for r in list(read_humaneval())[: args.prompts]]
    prompts = [encode_prompt(tok, {"prompt": p}) for p in texts]
    drafter = drafter_or_stand_in(args.drafter, model, dtype)
    compiled = args.config in COMPILED
    plain, spec = Engine(model, compile=compiled), Engine(model, drafter, compile=compiled)
    g = GenerationConfig(max_new_tokens=args.max_new_tokens, num_speculative_tokens=3,
                         eos_token_ids=[tok.eos_token_id])
    warm = GenerationConfig(max_new_tokens=8, num_speculative_tokens=3)
    plain.generate(prompts[:1], warm)
    spec.generate(prompts[:1], warm)

    def run(engine):
        t0 = time.perf_counter()
        rs = [engine.generate([p], g)[0] for p in prompts]
        wall = time.perf_counter() - t0
        passes = sum(r.num_verifier_passes - 1 for r in rs)  # the prefill's pass is not a step
        step = sum(r.draft_s + r.verify_s for r in rs)
        return {"tokens": sum(len(r.token_ids) for r in rs), "wall_s": wall, "step_ms": 1000 * step / passes,
                "tokens_per_pass": sum(len(r.token_ids) - 1 for r in rs) / passes,
                "outputs": [r.token_ids for r in rs]}

    reps = {"plain": [], "spec": []}
    for _ in range(args.repeats):  # interleaved
        reps["plain"].append(run(plain))
        reps["spec"].append(run(spec))
    med = {k: {"tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in v),
               "step_ms": statistics.median(r["step_ms"] for r in v),
               "tokens_per_pass": statistics.median(r["tokens_per_pass"] for r in v)} for k, v in reps.items()}
    # profile of plain steps (the top operations by self time)
    from torch.profiler import profile

    with profile() as prof:
        plain.generate(prompts[:1], GenerationConfig(max_new_tokens=32))
    top = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1000, 2), "calls": e.count}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]]
    return {"config": args.config, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "kernel": kernels.status(), "compile_s": round(plain.compile_s + spec.compile_s, 2),
            "plain": med["plain"], "spec_k3": med["spec"],
            "spec_step_over_plain_step": med["spec"]["step_ms"] / med["plain"]["step_ms"],
            "profile_plain_top_ops": top,
            "outputs": reps["plain"][0]["outputs"], "spec_outputs": reps["spec"][0]["outputs"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--output", default="benchmarks/results/engine-limit.json")
    ap.add_argument("--one", dest="config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.config:  # a child: one configuration, JSON on stdout's last line
        print(json.dumps(one(args)))
        return
    import torch

    from paradraft.utils import write_json
    from paradraft.verifier import load_verifier

    reads = bandwidths()
    bw = reads["limit_gbs"]
    rows = []
    for dtype in args.dtypes:
        m, _ = load_verifier("smollm2-135m", dtype=getattr(torch, dtype))
        nbytes = sum(p.numel() * p.element_size() for p in m.parameters())  # tied lm_head counted once
        del m
        for config in args.configs:
            env = CONFIGS[config]
            cmd = [sys.executable, __file__, "--one", config, "--dtype", dtype, "--prompts", str(args.prompts),
                   "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)]
            if args.drafter:
                cmd += ["--drafter", args.drafter]
            print(f"[bench_engine_limit] {dtype} {config} ...", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            limit = bw * 1e9 / nbytes  # tokens/s if a step were the weights' read alone
            r.update(weight_bytes=nbytes, limit_tokens_per_s=limit,
                     plain_fraction_of_limit=r["plain"]["tokens_per_s"] / limit)
            rows.append(r)
    for dtype in args.dtypes:  # float32 outputs of every configuration (against the first run), token for token
        by = [r for r in rows if r["dtype"] == dtype]
        same = all(r["outputs"] == by[0]["outputs"] and r["spec_outputs"] == by[0]["outputs"] for r in by)
        for r in by:
            r["outputs_equal_before"] = same
    for r in rows:
        r.pop("outputs")
        r.pop("spec_outputs")
    each = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in reads.items()
                     if isinstance(v, float) and k != "limit_gbs")
    lines = [f"bandwidth {bw:.1f} GB/s, the fastest read of 1 GiB ({each}); {host()['cpu']}, {os.cpu_count()} cores",
             "| dtype | engine | plain tokens/s | % of limit | plain step | K=3 pass | pass / step | compile s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['config']} | {r['plain']['tokens_per_s']:.1f} | "
                     f"{100 * r['plain_fraction_of_limit']:.0f}% of {r['limit_tokens_per_s']:.0f} | "
                     f"{r['plain']['step_ms']:.1f} ms | {r['spec_k3']['step_ms']:.1f} ms | "
                     f"{r['spec_step_over_plain_step']:.2f} | {r['compile_s']:.1f} |")
    md = "\n".join(lines)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    write_json(args.output, {"benchmark": "engine_limit", "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
                             "host": host(), "bandwidth_gbs": bw, "bandwidth_reads": reads,
                             "args": {k: v for k, v in vars(args).items() if k not in ("config",)},
                             "rows": rows, "table": md})
    print(md)


if __name__ == "__main__":
    main()
