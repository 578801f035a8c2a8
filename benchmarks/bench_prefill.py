"""The engine's prefill of a batch: every prompt alone (as before) against prompts fed together in groups of similar
length (`engine.prefill_groups`), for several token budgets per forward, in one process, budgets interleaved.

The prompts are what `paradraft regenerate` feeds the verifier: the first user turn (with any system turn) of
ShareGPT conversations after its shuffle, those of at most --max-prompt-tokens. Each budget's first tokens (greedy)
are compared with those of every prompt alone.

  python benchmarks/bench_prefill.py [--prompts 32] [--max-prompt-tokens 256] [--dtype float32]
        [--budgets 1 512 1024 2048 4096] [--repeats 3] [--output benchmarks/results/prefill.json]
A budget of 1 puts every prompt alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def regenerate_prompts(tok, n: int, max_prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """The first `n` prompts `regenerate --data sharegpt --seed SEED` feeds the verifier (its shuffle and filter)."""
    from paradraft.config import RegenerateConfig
    from paradraft.regenerate import first_turn, fitting_conversations, prompt_ids, read_conversations

    cfg = RegenerateConfig(data=["sharegpt"], max_samples=n, max_prompt_tokens=max_prompt_tokens, seed=seed)
    convs, skipped = read_conversations(cfg)
    kept = fitting_conversations(cfg, convs, tok, skipped)
    return prompt_ids(tok, [first_turn(c["messages"]) for c in kept], max_prompt_tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 512, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/prefill.json")
    a = ap.parse_args()

    import torch
    from bench_engine_limit import host  # benchmarks/ (the script's own directory)

    from paradraft.decode.engine import Engine, GenerationConfig, _State, prefill_groups
    from paradraft.verifier import load_verifier

    torch.set_grad_enabled(False)
    model, tok = load_verifier("smollm2-135m", dtype=getattr(torch, a.dtype))
    prompts = regenerate_prompts(tok, a.prompts, a.max_prompt_tokens)
    lengths = [len(p) for p in prompts]
    engine = Engine(model, max_len=a.max_prompt_tokens + 16)
    g = GenerationConfig(max_new_tokens=1, num_speculative_tokens=0)

    def prefill(budget: int) -> tuple[float, list[int]]:
        engine.prefill_tokens = budget
        engine.runner.alloc(len(prompts))
        st = _State(g, len(prompts))
        t0 = time.perf_counter()
        engine.prefill(st, prompts)
        return time.perf_counter() - t0, [r.token_ids[0] for r in st.res]

    with torch.inference_mode():
        prefill(a.budgets[0])  # warm-up
        times: dict[int, list[float]] = {b: [] for b in a.budgets}
        firsts: dict[int, list[int]] = {}
        for r in range(a.repeats):
            for b in (a.budgets if r % 2 == 0 else a.budgets[::-1]):
                t, firsts[b] = prefill(b)
                times[b].append(t)
    alone = firsts.get(1) or firsts[a.budgets[0]]
    rows = []
    for b in a.budgets:
        groups = prefill_groups(lengths, b)
        padded = sum(len(gr) * lengths[gr[0]] for gr in groups)
        med = statistics.median(times[b])
        rows.append({"budget": b, "forwards": len(groups), "padded_tokens": padded, "seconds": med,
                     "tokens_per_s": sum(lengths) / med, "runs": times[b], "first_tokens_as_alone": firsts[b] == alone})
        print(f"budget {b:5d}: {len(groups):3d} forwards, {padded} tokens with padding ({sum(lengths)} real), "
              f"{med:.2f} s, {sum(lengths) / med:.0f} prompt tokens/s, first tokens as alone: {firsts[b] == alone}")
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"benchmark": "prefill", "date": time.strftime("%Y-%m-%d %H:%M"), "host": host(),
                               "args": vars(a), "prompt_tokens": sum(lengths), "rows": rows}, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
