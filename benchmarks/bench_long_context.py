"""Peak memory of one training step on long samples: sequence partitioning against one unpartitioned step.

A tiny random Qwen3 verifier (hidden 64, 8 layers, 64k+ positions) with the embedded SmolLM2 tokenizer writes the
hidden states online; P-EAGLE with 8 depths trains ONE optimizer step, each row in its own process (peak RSS of
that process). The data is one conversation per row whose assistant answer is random words, prepared with
`paradraft prepare --seq-length L`, so the sample has exactly L tokens. Rows:

  8k step        one 8,192-token sample, --batch-tokens 8192: the reference step
  32k / 64k      one 32,768- / 65,536-token sample, partitioned at --partition-tokens (default 8192) and, where it
                 fits the machine, unpartitioned (--partition-tokens larger than the sample)

usage: python benchmarks/bench_long_context.py [--lengths 8192 32768 65536] [--partition 8192]
       [--unpartitioned 8192 32768] [--out benchmarks/results/long-context-memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def host() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    return f"{cpu}, {os.cpu_count()} cores{', AMX' if amx else ''}"


def build_world(work: Path, lengths: list[int]) -> Path:
    """The verifier directory and one prepared dataset per length (reused when present)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from paradraft.config import PrepareConfig
    from paradraft.data.prepare import prepare
    from paradraft.verifier import load_tokenizer

    vdir = work / "verifier"
    tok = load_tokenizer("smollm2-135m")
    if not (vdir / "config.json").is_file():
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=max(lengths) + 1024, tie_word_embeddings=False)
        Qwen3ForCausalLM(cfg).eval().save_pretrained(vdir)
        tok.save_pretrained(vdir)
    words = [w for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3][:5000]
    rng = random.Random(0)
    for L in lengths:
        data = work / f"data-{L}"
        if (data / "manifest.json").is_file():
            continue
        answer = "".join(rng.choice(words) for _ in range(L + 64)).replace("Ġ", " ")  # ~1 token per word
        src = work / f"conv-{L}.jsonl"
        src.write_text(json.dumps({"id": f"long-{L}", "messages": [
            {"role": "user", "content": "Write a long text."}, {"role": "assistant", "content": answer}]}) + "\n")
        prepare(PrepareConfig(data=[str(src)], output=str(data), verifier=str(vdir), seq_length=L, val_fraction=0.0),
                tokenizer=tok)
    return vdir


def child(data: str, verifier: str, partition: int) -> dict:
    from paradraft.config import TrainConfig
    from paradraft.data.prepare import PreparedDataset
    from paradraft.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as d:
        t = Trainer(TrainConfig(data=data, verifier=verifier, online=True, output=d, max_steps=1, batch_tokens=8192,
                                partition_tokens=partition, num_depths=8, val_samples=0, save_every=10_000,
                                draft_vocab_size=8192, autocast="float32", verifier_dtype="float32"))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        t0 = time.perf_counter()
        t.train()
        step_s = time.perf_counter() - t0
        row = json.loads((Path(d) / "metrics.jsonl").read_text().splitlines()[0])
    n = len(PreparedDataset(data).sample(0)[0])
    return {"sample_tokens": n, "partition_tokens": partition, "peak_rss_gib": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss_before_step_gib": before, "step_s": round(step_s, 1),
        "loss": row.get("loss")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--partition", type=int, default=8192)
    ap.add_argument("--unpartitioned", type=int, nargs="*", default=[8192, 32768],
                    help="lengths also run without partitioning (a 64k one does not fit 24 GB)")
    ap.add_argument("--work", default="runs/bench-long-context")
    ap.add_argument("--out", default="benchmarks/results/long-context-memory.json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    vdir = build_world(work, sorted(set(a.lengths) | set(a.unpartitioned)))
    rows = []
    plan = [(L, a.partition) for L in a.lengths] + [(L, 10 ** 9) for L in a.unpartitioned]
    for L, p in plan:
        r = subprocess.run([sys.executable, __file__, "--child", str(work / f"data-{L}"), str(vdir), str(p)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        if r.returncode:
            rows.append({"sample_tokens": L, "partition_tokens": p, "error": r.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        if rows[-1].get("partition_tokens") == 10 ** 9:
            rows[-1]["partition_tokens"] = None  # unpartitioned
        print(json.dumps(rows[-1]), flush=True)
    ref = next((r for r in rows if r["sample_tokens"] == 8192 and "peak_rss_gib" in r
                and r["partition_tokens"] is None), None) or next(
        (r for r in rows if r["sample_tokens"] == 8192 and "peak_rss_gib" in r), None)
    for r in rows:
        if ref and "peak_rss_gib" in r:
            r["peak_vs_8k_step"] = round(r["peak_rss_gib"] / ref["peak_rss_gib"], 3)
    out = {"benchmark": "bench_long_context", "date": time.strftime("%Y-%m-%d"), "host": host(),
           "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix()] + sys.argv[1:]),
           "verifier": "tiny random Qwen3 (hidden 64, 8 layers), embedded SmolLM2 tokenizer, float32",
           "drafter": "P-EAGLE, 8 depths, draft vocabulary 8192, --online, one optimizer step", "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
