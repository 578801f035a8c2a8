"""Drafter training-step cost: COD sampling vs every depth at every position; dense SDPA vs flex forward.

SmolLM2-135M sizes (H=576, 9 heads / 3 KV heads, 30-layer verifier -> 3H aux), 1 draft layer, 8k draft vocab,
K=8 depths, one 2,048-token sequence. Each configuration runs in its own process, so peak RSS is its own.
usage: python benchmarks/bench_drafter.py [--output benchmarks/results/drafter.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def make(T: int, K: int):
    from paradraft.models.common import DraftConfig
    from paradraft.models.loss import SlotBatch
    from paradraft.models.peagle import PEagleDrafter

    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, num_layers=1, vocab_size=49152, draft_vocab_size=8192, mask_token_id=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = PEagleDrafter(cfg)
    model.t2d[:8192] = True  # draft vocab = target ids 0..8191 (d2t offsets all 0)
    g = torch.Generator().manual_seed(0)
    b = SlotBatch(tokens=torch.randint(0, 49152, (T,), generator=g), hidden=torch.randn(T, 3 * 576, generator=g),
                  positions=torch.arange(T) + 1, doc=torch.zeros(T, dtype=torch.long),
                  target_p=torch.softmax(torch.randn(T, 8192, generator=g), -1),
                  target_ids=torch.randint(0, 9000, (T,), generator=g),
                  valid=torch.arange(T) >= T * 15 // 100)  # prompt, answer
    return model, b


def run_train(mode: str, T: int, K: int, repeats: int) -> dict:
    model, b = make(T, K)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ratio, floor = (0.7, 0.2) if mode == "cod" else (1.0, 1.0)
    times, n = [], 0
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats, _, _ = model.train_forward(b, K, ratio, floor, torch.Generator().manual_seed(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
        n = stats["num_elements"]
    return {"mode": mode, "tokens": T, "depths": K, "elements": n, "step_s_median": statistics.median(times),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_forward(backend: str, T: int, K: int, repeats: int) -> dict:
    from paradraft.models.attention import Elements, attention
    from paradraft.models.peagle import cod_sample

    a, d = cod_sample(torch.arange(T) >= T * 15 // 100, K, generator=torch.Generator().manual_seed(0))
    e = Elements(a, d, torch.zeros_like(a))
    n = len(e)
    q, k, v = torch.randn(1, 9, n, 64), torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)
    times = []
    fn = lambda: attention(q, k, v, e, e, backend=backend)  # noqa: E731
    if backend == "flex-compiled":  # CPU flex forward through torch.compile (inductor C++ codegen)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from paradraft.models.attention import flex_mask_mod

        compiled = torch.compile(flex_attention)
        bm = create_block_mask(flex_mask_mod(e, e), None, None, n, n, device="cpu")
        fn = lambda: compiled(q, k, v, block_mask=bm, scale=0.125, enable_gqa=True)  # noqa: E731
    with torch.no_grad():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            fn()
            if i:
                times.append(time.perf_counter() - t0)
    return {"backend": backend, "elements": n, "forward_s_median": statistics.median(times),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/drafter.json")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        kind, name = args.child.split(":")
        fn = run_train if kind == "train" else run_forward
        print(json.dumps(fn(name, args.tokens, args.depths, args.repeats)))
        return
    rows = []
    for child in ("train:cod", "train:all", "forward:sdpa", "forward:flex", "forward:flex-compiled"):
        out = subprocess.run([sys.executable, __file__, "--child", child, "--tokens", str(args.tokens),
                              "--depths", str(args.depths), "--repeats", str(args.repeats)],
                             capture_output=True, text=True)
        if out.returncode:
            rows.append({"child": child, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    cod, full = rows[0], rows[1]
    result = {"benchmark": "drafter", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.machine(), "rows": rows}
    if "step_s_median" in cod and "step_s_median" in full:
        result["cod_vs_all_time"] = cod["step_s_median"] / full["step_s_median"]
        result["cod_vs_all_memory"] = cod["peak_rss_gib"] / full["peak_rss_gib"]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
