"""The examples a user copies run, in a small CPU form (examples/serve_vllm.sh runs in `make test-vllm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import save_tiny_verifier

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.e2e


def test_python_api_example(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py"), "--work", str(tmp_path / "w"),
                        "--samples", "24", "--steps", "3", "--tokens", "8"], capture_output=True, text=True, env=ENV,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["final_step"] == 3 and out["k"] >= 1 and out["acceptance_length"] >= 1.0
    assert (tmp_path / "w" / "export" / "config.json").is_file()


def test_the_seeds_run_script_in_its_cpu_form(tmp_path):
    vdir = save_tiny_verifier(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": "The capital is Paris. " * (1 + i % 3)}]}) + "\n" for i in range(12)))
    env = {**ENV, "VERIFIER": str(vdir), "DATA": str(data), "NPROC": "2", "DEVICE": "cpu", "SAMPLES": "12",
           "SEQ": "256", "DRAFT_VOCAB": "128", "MAX_STEPS": "2", "DEPTHS": "3", "WORK": str(tmp_path / "run"),
           "PY": sys.executable, "MASTER_PORT": "29563"}
    r = subprocess.run(["bash", str(ROOT / "examples" / "train_qwen3_8b_4gpu.sh")], capture_output=True, text=True,
                       env=env, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "vllm serve" in r.stdout and (tmp_path / "run" / "export" / "model.safetensors").is_file()
    assert len((tmp_path / "run" / "regen.jsonl").read_text().splitlines()) == 12  # both ranks' answers, merged
