"""`paradraft bench --engine vllm`: the same benchmark, measured inside vLLM (where users serve drafters).

Plain decoding runs in one vLLM engine that lives for the whole benchmark; each (drafter, K) gets its own engine
(vLLM fixes the speculative config at start). Every repeat runs plain decoding and then the method, so plain runs
are spread over the whole benchmark like the methods they are compared with. Acceptance comes from vLLM's own
speculative-decoding counters (vllm:spec_decode_*), tokens/s from wall time around `LLM.generate`, batch 1.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from ..config import BenchConfig, ExportConfig
from ..export.vllm import export, speculative_config
from ..models.checkpoint import load_drafter
from ..utils import fingerprint
from ..verifier import resolve_verifier
from ..vllm_driver import VllmEngine, engine_args
from .metrics import engine_len, median_speedup, speedup_per_repeat, tokens_per_s

PROMPT_LOOKUP_NGRAM = 2  # longest n-gram matched, as Hugging Face's prompt lookup (max_matching_ngram_size)


def _summary(reply: dict) -> dict:
    m = reply["metrics"]
    drafts = m.get("num_drafts") or 0
    return {"tokens": sum(len(t) for t in reply["tokens"]), "wall_s": reply["wall_s"], "num_drafts": drafts,
            "passes": drafts if drafts else sum(len(t) for t in reply["tokens"]),  # verifier forward passes
            "num_accepted": m.get("num_accepted_tokens") or 0, "accepted_per_pos": m.get("accepted_per_pos") or [],
            "token_ids": reply["tokens"], "output_digest": fingerprint(reply["tokens"])}


def bench_vllm(cfg: BenchConfig, prompts: list[list[int]], eos: list[int], log_dir: Path) -> tuple[list, dict]:
    """Measure plain decoding and every drafter at every K in vLLM -> (results rows, extra fields of the output)."""
    verifier_dir = resolve_verifier(cfg.verifier)
    max_len = engine_len(max(len(p) for p in prompts), cfg.max_new_tokens, max(cfg.num_speculative_tokens))
    base = engine_args(verifier_dir, cfg.dtype, max_model_len=max_len, seed=cfg.seed)
    seeds = [cfg.seed * 1000 + i for i in range(len(prompts))]

    def run(engine, rep):
        return _summary(engine.generate(prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                        seeds=[s + rep for s in seeds] if cfg.temperature > 0 else None,
                                        stop_token_ids=eos, batch_1=True))

    plain_runs, results, starts = [], [], {}
    with tempfile.TemporaryDirectory(prefix=".paradraft-bench-vllm-", dir=log_dir) as tmp:
        methods = []  # (method, drafter, k, vLLM speculative config)
        for i, path in enumerate(cfg.drafter):
            out = Path(tmp) / f"drafter-{i}"  # vLLM reads the exported format, in the benchmark's dtype
            export(ExportConfig(drafter=path, output=str(out), dtype=cfg.dtype, force=cfg.force,
                                num_speculative_tokens=max(cfg.num_speculative_tokens)))
            algo = load_drafter(out, verifier=None, allow_missing_embeddings=True).cfg.algorithm
            methods += [(algo, path, k, speculative_config(str(out), algo, k)) for k in cfg.num_speculative_tokens]
        if cfg.prompt_lookup and cfg.temperature <= 0:  # vLLM's prompt lookup: n-gram matches in the context
            methods += [("prompt_lookup", None, k, {"method": "ngram", "num_speculative_tokens": k,
                                                    "prompt_lookup_max": PROMPT_LOOKUP_NGRAM, "prompt_lookup_min": 1})
                        for k in cfg.num_speculative_tokens]
        bar = tqdm(total=cfg.repeats * max(1, len(methods)), desc="bench (vllm)", unit="run", disable=None)
        with VllmEngine(base, "plain", log_dir, cfg.vllm_python) as plain:
            starts["plain"] = plain.start_s
            plain.generate(prompts[:1], 4)  # warm-up
            if not methods:
                for rep in range(cfg.repeats):
                    plain_runs.append(run(plain, rep))
                    bar.update(1)
            for algo, path, k, spec in methods:
                name = f"{algo}-k{k}-{len(starts)}"
                with VllmEngine({**base, "speculative_config": spec}, name, log_dir, cfg.vllm_python) as eng:
                    starts[name] = eng.start_s
                    eng.generate(prompts[:1], 4)
                    runs, paired = [], []
                    for rep in range(cfg.repeats):  # interleaved with plain decoding
                        paired.append(run(plain, rep))
                        runs.append(run(eng, rep))
                        bar.update(1)
                    plain_runs += paired
                results.append((algo, path, k, runs, paired))
        bar.close()
    plain_tps = tokens_per_s(plain_runs)
    rows = [{"method": "plain", "drafter": None, "k": 0, "acceptance_length": 1.0, "per_position_acceptance": None,
             "tokens_per_s": plain_tps, "speedup": 1.0, "speedup_per_repeat": None, "draft_fraction": None,
             "tokens": int(statistics.median(r["tokens"] for r in plain_runs)),
             "passes": int(statistics.median(r["passes"] for r in plain_runs)),
             "wall_s": statistics.median(r["wall_s"] for r in plain_runs),
             "output_digest": plain_runs[0]["output_digest"]}]
    for algo, path, k, runs, paired in results:
        drafts = sum(r["num_drafts"] for r in runs)
        accepted = sum(r["num_accepted"] for r in runs)
        per_pos = [sum(r["accepted_per_pos"][i] for r in runs if len(r["accepted_per_pos"]) > i) / drafts
                   for i in range(k)] if drafts else None
        tps, per = tokens_per_s(runs), speedup_per_repeat(runs, paired)
        rows.append({"method": algo, "drafter": path, "k": k,
                     "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                     "per_position_acceptance": per_pos, "tokens_per_s": tps, "speedup": median_speedup(per),
                     "speedup_per_repeat": per,
                     "draft_fraction": None, "tokens": int(statistics.median(r["tokens"] for r in runs)),
                     "output_digest": runs[0]["output_digest"],
                     "passes": int(statistics.median(r["passes"] for r in runs)),
                     "wall_s": statistics.median(r["wall_s"] for r in runs),
                     "tokens_equal_plain": all(r["token_ids"] == p["token_ids"] for r, p in zip(runs, paired))
                     if cfg.temperature <= 0 else None})
    return rows, {"engine_start_s": starts}
