"""The vLLM driver without vLLM: how it finds vLLM, and how a worker that cannot start is reported and cleaned up.
(Runs through vLLM itself are `make test-vllm`: scripts/vllm_interop.py and scripts/check_vllm_extract.py.)"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from paradraft.vllm_driver import VllmEngine, VllmError, engine_args, find_vllm_python


def test_find_vllm_python_order(tmp_path, monkeypatch):
    with pytest.raises(VllmError, match="--vllm-python /nonexistent/python: no such file"):
        find_vllm_python("/nonexistent/python")
    assert find_vllm_python(sys.executable) == sys.executable
    monkeypatch.setenv("PARADRAFT_VLLM_PYTHON", "/nonexistent/env-python")
    with pytest.raises(VllmError, match="PARADRAFT_VLLM_PYTHON=/nonexistent/env-python"):
        find_vllm_python()
    monkeypatch.delenv("PARADRAFT_VLLM_PYTHON")
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(VllmError, match="no Python with vLLM found"):
            find_vllm_python()
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert find_vllm_python() == ".venv-vllm/bin/python"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM")
def test_a_worker_that_cannot_start_vllm_is_reported_and_its_process_group_ends(tmp_path):
    with pytest.raises(VllmError) as e:
        VllmEngine(engine_args("/nonexistent/model", "float32", 64), "probe", tmp_path, python=sys.executable)
    assert "vLLM engine 'probe' failed during start" in str(e.value) and "No module named 'vllm'" in str(e.value)
    assert str(tmp_path / "vllm-probe.log") in str(e.value)


def test_engine_args_turn_metrics_on_and_prefix_caching_off():
    a = engine_args("/m", "bfloat16", 512, seed=3, speculative_config={"method": "ngram"})
    assert a["disable_log_stats"] is False and a["enable_prefix_caching"] is False
    assert (a["model"], a["dtype"], a["max_model_len"], a["seed"]) == ("/m", "bfloat16", 512, 3)
