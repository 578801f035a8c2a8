"""Extraction throughput vs the verifier's bare forward pass (same batches, same dtype, one run, interleaved).

usage: python benchmarks/bench_extract.py [--samples 96] [--seq-length 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from paradraft.config import ExtractConfig, PrepareConfig
from paradraft.data.hidden_states import batches_by_tokens, extract
from paradraft.data.prepare import PreparedDataset, prepare
from paradraft.verifier import load_verifier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/extract.json")
    args = ap.parse_args()
    model, tok = load_verifier("smollm2-135m", dtype=torch.bfloat16)
    work = Path(tempfile.mkdtemp())
    prepare(PrepareConfig(data=["sharegpt"], output=str(work / "data"), max_samples=args.samples,
                          seq_length=args.seq_length, val_fraction=0), tokenizer=tok)
    ds = PreparedDataset(work / "data")
    samples = [ds.sample(i) for i in range(len(ds))]
    n_tok = sum(len(s[0]) for s in samples)
    groups = batches_by_tokens([len(s[0]) for s in samples], args.batch_tokens)

    @torch.inference_mode()
    def bare():
        for g in groups:
            S = max(len(samples[i][0]) for i in g)
            ids = torch.full((len(g), S), tok.pad_token_id or 0, dtype=torch.long)
            att = torch.zeros((len(g), S), dtype=torch.long)
            for r, i in enumerate(g):
                ids[r, :len(samples[i][0])] = torch.from_numpy(samples[i][0])
                att[r, :len(samples[i][0])] = 1
            model.model(input_ids=ids, attention_mask=att, use_cache=False)

    def ext():
        out = work / "hs"
        shutil.rmtree(out, ignore_errors=True)
        extract(ExtractConfig(data=str(work / "data"), output=str(out), batch_tokens=args.batch_tokens,
                              samples_per_shard=args.samples), model=model, tokenizer=tok)

    t_bare, t_ext = [], []
    bare()  # warm-up
    for _ in range(args.repeats):  # interleaved: bare, extract, bare, extract, ...
        t0 = time.perf_counter()
        bare()
        t_bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ext()
        t_ext.append(time.perf_counter() - t0)
    shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(b / e for b, e in zip(t_bare, t_ext))
    res = {"benchmark": "extract", "date": time.strftime("%Y-%m-%d"), "samples": args.samples, "tokens": n_tok,
           "batch_tokens": args.batch_tokens, "dtype": "bfloat16", "threads": torch.get_num_threads(),
           "bare_tok_s": n_tok / statistics.median(t_bare), "extract_tok_s": n_tok / statistics.median(t_ext),
           "extract_over_bare": ratio, "bare_s": t_bare, "extract_s": t_ext}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
