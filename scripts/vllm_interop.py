"""`make test-vllm`: the proof that vLLM serves paradraft's drafters as paradraft runs them, measured by the same
benchmark command on both engines.

1. trains short P-EAGLE (1 layer and --peagle-layers N, with P-EAGLE's default q/k-norm layer, and with
   --llama-layer one with a Llama-style layer, no norm before residual) and EAGLE-3 drafters on the verifier (or
   takes --drafter): the verifier regenerates 48 conversations, `extract` stores their hidden states once in
   float32, and every drafter trains offline from them (online training would run the verifier again on every
   step of every drafter: on a 2-core AVX2 CPU that was 4-6 s of a 10 s step);
2. `paradraft bench --engine paradraft` and `paradraft bench --engine vllm` on the same held-out prompts, float32,
   greedy, batch 1 (vLLM runs in its own environment through paradraft.vllm_driver);
3. asserts, for plain decoding and every drafter at every K: identical generated tokens (output digests) and equal
   acceptance lengths (vLLM's spec-decode counters against paradraft's count);
4. with --regenerate N: `paradraft regenerate` through both engines on N conversations, greedy, float32, and
   asserts identical answers;
writes WORK/report.json (both engines side by side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def short_drafters(work: Path, steps: int, verifier: str, peagle_layers: list[int], eagle3: bool = True,
                   llama_layer: bool = False) -> list[Path]:
    from paradraft.config import ExtractConfig, PrepareConfig, RegenerateConfig, TrainConfig
    from paradraft.data.prepare import PreparedDataset
    from paradraft.pipeline import run_steps

    regen = work / "regenerated.jsonl"
    chain = [("regenerate", RegenerateConfig(data=["sharegpt"], output=str(regen), max_samples=48, max_new_tokens=128,
                                             max_prompt_tokens=256, batch_size=16, verifier=verifier)),
             ("prepare", PrepareConfig(data=[str(regen)], output=str(work / "data"), seq_length=512,
                                       val_fraction=0.1, verifier=verifier)),
             ("extract", ExtractConfig(data=str(work / "data"), output=str(work / "hidden_states"), dtype="float32"))]
    run_steps(chain)
    # the draft vocabulary holds every token the answers train (~1,000 distinct in the embedded verifier's 48, a
    # quarter of 8192's head to train; a random verifier's answers use more): the next power of 2, 1024 to 8192
    trained = int((PreparedDataset(work / "data").token_freqs() > 0).sum())
    vocab = min(8192, 1 << max(10, (trained - 1).bit_length()))
    runs = [("peagle" if n == 1 else f"peagle-{n}layers", "peagle", n, {}) for n in peagle_layers]
    if llama_layer:  # P-EAGLE's layer before 2026-12-04 (--draft-layer llama): no q/k norms, no norm before residual
        runs.append(("peagle-llama-layer", "peagle", 1, {"draft_layer": "llama", "norm_before_residual": False}))
    if eagle3:
        runs.append(("eagle3", "eagle3", 1, {}))
    # 3 depths: what K=3 reads (the quickstart's choice too)
    run_steps([("train", TrainConfig(algorithm=algo, data=str(work / "data"), hidden_states=str(work / "hidden_states"),
                                     num_layers=layers, output=str(work / name), max_steps=steps, lr=1e-3,
                                     warmup_steps=5, batch_tokens=2048, draft_vocab_size=vocab, num_depths=3,
                                     ttt_steps=3, save_every=10_000, num_speculative_tokens=3, **over))
               for name, algo, layers, over in runs])
    return [work / name for name, _, _, _ in runs]


def regenerate_check(work: Path, verifier: str, n: int, max_tokens: int) -> dict:
    """Both engines answer the same n conversations greedily in float32: the answers must be identical."""
    from paradraft.config import RegenerateConfig
    from paradraft.regenerate import regenerate

    answers, stats = {}, {}
    for engine in ("paradraft", "vllm"):
        out = work / f"regenerate-{engine}.jsonl"
        out.unlink(missing_ok=True)
        stats[engine] = regenerate(RegenerateConfig(data=["sharegpt"], output=str(out), max_samples=n,
                                                    max_new_tokens=max_tokens, max_prompt_tokens=256, batch_size=n,
                                                    verifier=verifier, dtype="float32", engine=engine, seed=1))
        recs = [json.loads(ln) for ln in out.read_text().splitlines()]
        answers[engine] = {r["id"]: r["messages"] for r in recs}
    same = sum(answers["paradraft"][i] == answers["vllm"].get(i) for i in answers["paradraft"])
    return {"conversations": len(answers["paradraft"]), "identical_answers": same, "stats": stats}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", action="append", default=[])
    ap.add_argument("--work", default=str(ROOT / "runs" / "vllm"))
    ap.add_argument("--verifier", default="smollm2-135m", help="verifier (default: the embedded SmolLM2)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--peagle-layers", type=int, nargs="+", default=[1],
                    help="P-EAGLE drafters trained with these layer counts")
    ap.add_argument("--no-eagle3", action="store_true", help="P-EAGLE drafters only")
    ap.add_argument("--llama-layer", action="store_true",
                    help="also a P-EAGLE drafter with a Llama-style layer and no norm before residual (its default "
                         "has q/k norms and norm before residual)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--regenerate", type=int, default=0, help="also check regenerate on this many conversations")
    ap.add_argument("--speed-only", action="store_true",
                    help="record speed and acceptance side by side without asserting (e.g. bf16, whose kernels differ)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from paradraft.bench.run import bench
    from paradraft.config import BenchConfig

    drafters = [Path(d) for d in args.drafter] or short_drafters(work, args.steps, args.verifier, args.peagle_layers,
                                                                   not args.no_eagle3, args.llama_layer)
    data = drafters[0].parent / "data"  # the held-out split the drafters were trained beside
    common = dict(verifier=args.verifier, drafter=[str(d) for d in drafters], dataset="sharegpt-val", data=str(data),
                  num_prompts=args.prompts, max_new_tokens=args.max_tokens, num_speculative_tokens=args.k, repeats=1,
                  prompt_lookup=False, dtype=args.dtype, vllm_python=args.vllm_python)
    res = {e: bench(BenchConfig(**common, engine=e, output=str(work / f"bench-{e}.json")))
           for e in ("paradraft", "vllm")}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "verifier": args.verifier, "dtype": args.dtype,
              "k": args.k, "prompts": res["paradraft"]["num_prompts"], "max_tokens": args.max_tokens, "runs": [],
              "vllm_engine_start_s": res["vllm"].get("engine_start_s")}
    failures = []
    theirs = {(r["method"], r["drafter"], r["k"]): r for r in res["vllm"]["results"]}
    for mine in res["paradraft"]["results"]:
        key = (mine["method"], mine["drafter"], mine["k"])
        v = theirs[key]
        name = Path(mine["drafter"]).name if mine["drafter"] else "plain"
        row = {"name": name, "method": mine["method"], "k": mine["k"],
               "paradraft_acceptance_length": mine["acceptance_length"],
               "vllm_acceptance_length": v["acceptance_length"],
               "paradraft_per_position": mine["per_position_acceptance"],
               "vllm_per_position": v["per_position_acceptance"],
               "paradraft_tokens_per_s": mine["tokens_per_s"], "vllm_tokens_per_s": v["tokens_per_s"],
               "paradraft_speedup": mine["speedup"], "vllm_speedup": v["speedup"],
               "tokens_equal": mine["output_digest"] == v["output_digest"]}
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
        if not row["tokens_equal"]:
            failures.append(f"{name} K={mine['k']}: vLLM's greedy tokens differ from paradraft's")
        if abs(v["acceptance_length"] - mine["acceptance_length"]) > 0.005:
            failures.append(f"{name} K={mine['k']}: acceptance length paradraft {mine['acceptance_length']:.3f} vs "
                            f"vLLM {v['acceptance_length']:.3f}")
    if args.regenerate:
        rc = regenerate_check(work, args.verifier, args.regenerate, args.max_tokens)
        report["regenerate"] = rc
        print(json.dumps(rc), flush=True)
        if rc["identical_answers"] != rc["conversations"]:
            failures.append(f"regenerate: {rc['conversations'] - rc['identical_answers']} of {rc['conversations']} "
                            f"answers differ between the engines")
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if failures and not args.speed_only:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"vLLM interop: all checks passed ({work / 'report.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
