"""Speed metrics of `paradraft bench`, one definition for both engines (see run.py's docstring for the schema)."""

from __future__ import annotations

import statistics


def tokens_per_s(runs: list[dict]) -> float:
    """Median over repeats of new tokens / wall time; each run is {"tokens", "wall_s", ...}."""
    return statistics.median(r["tokens"] / r["wall_s"] for r in runs)


def speedup_per_repeat(runs: list[dict], plain: list[dict]) -> list[float]:
    """Each repeat's tokens/s over that of the plain run of the same repeat (interleaved, so paired)."""
    return [(r["tokens"] / r["wall_s"]) / (p["tokens"] / p["wall_s"]) for r, p in zip(runs, plain)]


def median_speedup(per_repeat: list[float]) -> float:
    """A bench row's `speedup` from its `speedup_per_repeat`: the median of the paired ratios, each comparing two
    runs made side by side, so a slow phase of the machine hits both. (The ratio of the two median speeds pairs runs
    of different repeats: on a noisy host it can lie above every repeat but one.)"""
    return statistics.median(per_repeat)


ENGINE_MARGIN = 16  # tokens of KV cache beyond prompt + answer + drafts (vLLM's max_model_len and paradraft's engine)


def engine_len(prompt_tokens: int, max_new_tokens: int, k: int) -> int:
    """The KV-cache length a prompt of `prompt_tokens` needs with its answer and K drafts, in either engine."""
    return prompt_tokens + max_new_tokens + k + ENGINE_MARGIN
