"""Engine speed on the embedded SmolLM2 (bf16, batch 1, 2 threads): plain decoding vs Hugging Face generate,
work outside the model forwards in a speculative step, and the cost of one P-EAGLE draft pass at K=7 vs K=1.

usage: python benchmarks/bench_engine.py [--drafter DIR] [--prompts 6] [--max-new-tokens 96] [--repeats 3]
Without --drafter, an untrained drafter of the default shape stands in (costs do not depend on training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from paradraft.data.sources import read_humaneval
from paradraft.data.template import encode_prompt
from paradraft.decode.engine import Engine, GenerationConfig
from paradraft.models.checkpoint import build_drafter, load_drafter
from paradraft.models.common import DraftCache, DraftConfig
from paradraft.verifier import load_verifier


class Timer:
    """Record the wall time of every call of wrapped callables."""

    def __init__(self):
        self.calls: list[float] = []

    @property
    def t(self) -> float:
        return sum(self.calls)

    def wrap(self, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.calls.append(time.perf_counter() - t0)
            return out
        return inner


def drafter_or_stand_in(path: str | None, model, dtype: torch.dtype):
    """The drafter at `path`, or an untrained P-EAGLE drafter of the default shape (8,192-token draft vocabulary)
    standing in: a pass costs what it costs whatever the drafter learnt."""
    if path:
        return load_drafter(path, verifier=model, force=True).to(dtype)
    torch.manual_seed(0)
    cfg = DraftConfig.from_verifier(model.config, algorithm="peagle", draft_vocab_size=8192, mask_token_id=16)
    drafter = build_drafter(cfg)
    d2t = torch.zeros(8192, dtype=torch.long)
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[:8192] = True
    drafter.init_from_verifier(model, d2t, t2d)
    return drafter.to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/engine.json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load_verifier("smollm2-135m", dtype=torch.bfloat16)
    probs = [r["messages"][0]["content"] for r in list(read_humaneval())[: args.prompts]]
    prompts = [encode_prompt(tok, {"prompt": p}) for p in probs]
    eos = [tok.eos_token_id]
    g = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos, num_speculative_tokens=7)

    drafter = drafter_or_stand_in(args.drafter, model, torch.bfloat16)

    def hf_run():
        n, t0 = 0, time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
            n += out.shape[1] - len(p)
        return n / (time.perf_counter() - t0)

    plain = Engine(model)

    def engine_run():
        n, t0 = 0, time.perf_counter()
        for p in prompts:
            n += len(plain.generate([p], g)[0].token_ids)
        return n / (time.perf_counter() - t0)

    hf_run()  # warm-up
    hf, mine = [], []
    for _ in range(args.repeats):  # interleaved
        hf.append(hf_run())
        mine.append(engine_run())

    # --- work outside the model forwards in speculative steps
    spec = Engine(model, drafter)
    vt, dt = Timer(), Timer()
    spec.runner.forward = vt.wrap(spec.runner.forward)
    drafter.run_layers = dt.wrap(drafter.run_layers)
    drafter.logits = dt.wrap(drafter.logits)
    outside, same, agree = [], 0, []
    plain_out = [plain.generate([p], g)[0].token_ids for p in prompts]
    for p, ref in zip(prompts, plain_out):
        vt.calls, dt.calls = [], []
        t0 = time.perf_counter()
        r = spec.generate([p], g)
        total = time.perf_counter() - t0
        prefill = vt.calls[0]  # the first verifier call is the prompt; the rest is the speculative loop
        loop = total - prefill
        fwd = sum(vt.calls[1:]) + dt.t  # verifier and drafter forwards inside the loop
        outside.append(1 - fwd / loop)
        # bf16: does the speculative path reproduce plain greedy decoding token for token?
        same += r[0].token_ids == ref
        agree.append(next((i for i, (a, b) in enumerate(zip(r[0].token_ids, ref)) if a != b),
                          min(len(ref), len(r[0].token_ids))))

    # --- one P-EAGLE draft pass: K=7 vs K=1 on a 500-slot context
    H3 = 3 * model.config.hidden_size
    cache = DraftCache()
    ctx = torch.arange(1, 501)
    with torch.no_grad():
        drafter.draft(torch.randint(0, 8000, (500,)), torch.randn(500, H3, dtype=torch.bfloat16), ctx, 1, cache)

    def pass_time(K):
        ts = []
        for _ in range(40):
            c = DraftCache()
            c.kv, c.elems = cache.kv, cache.elems
            t0 = time.perf_counter()
            drafter.draft(torch.randint(0, 8000, (2,)), torch.randn(2, H3, dtype=torch.bfloat16),
                          torch.tensor([501, 502]), K, c)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[5:])

    k1, k7 = pass_time(1), pass_time(7)
    res = {"benchmark": "engine", "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
           "dtype": "bfloat16", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "hf_generate_tok_s": statistics.median(hf), "engine_plain_tok_s": statistics.median(mine),
           "engine_over_hf": statistics.median(m / h for m, h in zip(mine, hf)),
           "outside_forwards_fraction_of_spec_step": statistics.median(outside),
           "bf16_spec_equals_plain_prompts": f"{same}/{len(prompts)}",
           "bf16_tokens_before_first_divergence": agree,
           "peagle_draft_pass_ms_k1": 1000 * k1, "peagle_draft_pass_ms_k7": 1000 * k7, "k7_over_k1": k7 / k1,
           "drafter": args.drafter or "untrained, default shape (1 layer, 8k vocab)"}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
