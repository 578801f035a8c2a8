"""`make demo`'s pipeline at toy size on the real embedded verifier: every step runs, a rerun reuses them."""

from __future__ import annotations

import json

import pytest
import torch

from paradraft.config import QuickstartConfig
from paradraft.quickstart import quickstart, verdict

pytestmark = pytest.mark.e2e


def test_quickstart_runs_end_to_end_and_reuses_steps(tmp_path, capsys):
    cfg = QuickstartConfig(output=str(tmp_path / "qs"), num_samples=10, max_new_tokens=24, max_prompt_tokens=96,
                           regen_batch_size=5, seq_length=160, draft_vocab_size=1024, max_steps=3, num_depths=3,
                           bench_prompts=1, bench_tokens=12, num_speculative_tokens=[2, 3], bench_repeats=2)
    out = quickstart(cfg)
    run = tmp_path / "qs"
    for f in ("regenerated.jsonl", "data/manifest.json", "hidden_states/manifest.json", "peagle/config.json",
              "peagle/model.safetensors", "peagle/training.png", "results.json", "results.png"):
        assert (run / f).is_file(), f
    methods = [(r["method"], r["k"]) for r in out["results"]]
    assert methods == [("plain", 0), ("peagle", 2), ("peagle", 3)]
    assert json.loads((run / "results.json").read_text())["results"][0]["speedup"] == 1.0
    assert all(len(r["speedup_per_repeat"]) == 2 for r in out["results"])  # interleaved repeats, each paired
    assert "2 interleaved repeats" in capsys.readouterr().out
    assert torch.is_grad_enabled()  # benchmarking must not switch autograd off for whatever runs next
    res = json.loads((run / "results.json").read_text())  # as written before speedup was the paired median
    res["results"][1]["speedup"] = 9.99
    (run / "results.json").write_text(json.dumps(res))
    again = quickstart(cfg)  # the rerun reuses every finished step
    text = capsys.readouterr().out
    per = out["results"][1]["speedup_per_repeat"]
    assert again["results"][1]["speedup"] == out["results"][1]["speedup"] == pytest.approx((per[0] + per[1]) / 2)
    assert json.loads((run / "results.json").read_text())["results"][1]["speedup"] != 9.99
    assert "already holds this dataset" in text and "already holds a drafter trained with these flags" in text
    assert "10 already done" in text


@pytest.mark.parametrize("per,text", [([1.3], "1 repeat"), ([1.1, 1.25, 1.2], "1.10x to 1.25x"),
                                      ([0.9, 1.2, 1.1], "too busy to tell"), ([0.8, 0.9, 0.95], "slower than plain")])
def test_the_final_line_says_how_noisy_the_speedup_was(per, text):
    best = {"k": 3, "acceptance_length": 1.3, "speedup": sorted(per)[len(per) // 2], "speedup_per_repeat": per}
    line = verdict(best, {"num_prompts": 6})
    assert text in line and "median speedup" in line and "exact count" in line
