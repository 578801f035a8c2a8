"""The vLLM driver without vLLM: how it finds vLLM, and how a worker that cannot start is reported and cleaned up.
(Runs through vLLM itself are `make test-vllm`: scripts/vllm_interop.py and scripts/check_vllm_extract.py.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import paradraft.vllm_driver as driver
from paradraft.vllm_driver import VllmEngine, VllmError, engine_args, find_vllm_python, worker_env


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


def test_import_bounds_onednns_cache_unless_the_user_set_it_and_vllm_workers_get_theirs_back(tmp_path, monkeypatch):
    """oneDNN's primitive cache grew an offline training run by ~30 MB a step (BENCHMARKS.md, "Memory"): importing
    paradraft bounds it to 64 primitives, a value in the environment wins, and a vLLM worker does not inherit
    paradraft's own bound."""
    key = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    probe = "import os, paradraft; print(os.environ[paradraft.ONEDNN_CACHE_ENV], paradraft.ONEDNN_CACHE_SET_HERE)"
    env = {k: v for k, v in os.environ.items() if k != key}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["64", "True"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, key: "7"}, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["7", "False"]
    monkeypatch.setenv(key, "64")
    monkeypatch.setattr(driver, "ONEDNN_CACHE_SET_HERE", True)
    assert key not in worker_env(tmp_path) and worker_env(tmp_path)["VLLM_CACHE_ROOT"] == str(tmp_path)
    monkeypatch.setattr(driver, "ONEDNN_CACHE_SET_HERE", False)
    assert worker_env(tmp_path)[key] == "64"
