"""The one device rule (utils.resolve_device) and the work split of `extract` and `regenerate` under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import save_tiny_verifier
from paradraft.cli import main
from paradraft.errors import UserError
from paradraft.utils import resolve_device

SRC = str(Path(__file__).parents[1] / "src")


def test_the_rank_to_device_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    for name in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(UserError, match=f"--device {name}: no CUDA device here"):
            resolve_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("auto") == "cuda:0" and resolve_device("cuda") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun: each rank its own GPU
    assert resolve_device("auto") == "cuda:3" and resolve_device("cuda") == "cuda:3"
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"  # an explicit choice wins
    with pytest.raises(UserError, match="cuda:0..cuda:3"):
        resolve_device("cuda:4")
    with pytest.raises(UserError, match="--device 'banana'"):
        resolve_device("banana")


@pytest.mark.parametrize("command", ["generate", "bench", "regenerate", "extract", "train", "quickstart"])
def test_every_model_command_takes_device(command, capsys, tmp_path):
    args = {"generate": ["--prompt", "hi"], "train": ["--online"], "regenerate": ["-o", tmp_path / "r.jsonl"],
            "bench": ["-o", tmp_path / "b.json"], "extract": ["-o", tmp_path / "hs"],
            "quickstart": ["-o", tmp_path / "qs"]}[command]
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--device" in capsys.readouterr().out
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc = main([command, *map(str, args), "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip().splitlines()[-1].startswith(f"paradraft {command}: error: --device cuda: no CUDA")
    assert not any(tmp_path.iterdir())  # refused before anything was made


# bit-for-bit comparisons across processes need MKL's reproducible mode: its float32 GEMMs may round differently with
# the operands' memory alignment, which differs between processes (tests/test_safety.py, EXACT_ENV)
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": SRC, "MKL_CBWR": "COMPATIBLE"}


def _torchrun(args: list, port: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), "-m", "paradraft", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=600)


def _one(args: list) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV}
    return subprocess.run([sys.executable, "-m", "paradraft", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.e2e
def test_extract_and_regenerate_under_torchrun_equal_one_process(tmp_path):
    vdir = save_tiny_verifier(tmp_path)
    recs = [{"id": str(i), "messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                                        {"role": "assistant", "content": "The capital is Paris. " * (1 + i % 3)}]}
            for i in range(11)]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    # regenerate: rank r answers conversations r, r + 2, ...; rank 0 writes them in one process's order
    base = ["regenerate", "--data", src, "--verifier", vdir, "--max-new-tokens", "6", "--batch-size", "3",
            "--dtype", "float32"]
    one = _one([*base, "-o", tmp_path / "one.jsonl"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _torchrun([*base, "-o", tmp_path / "two.jsonl"], 29541)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert len((tmp_path / "one.jsonl").read_text().splitlines()) == 11
    assert not list(tmp_path.glob(".two.jsonl.rank*"))  # the rank files are merged and gone
    # extract: rank r writes shards r, r + 2, ...; the shards and the manifest equal one process's
    assert main(["prepare", "--data", str(src), "-o", str(tmp_path / "data"), "--verifier", str(vdir)]) == 0
    ext = ["extract", "--data", tmp_path / "data", "--samples-per-shard", "3", "--dtype", "float32"]
    one = _one([*ext, "-o", tmp_path / "hs1"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _torchrun([*ext, "-o", tmp_path / "hs2"], 29542)
    assert two.returncode == 0, two.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "hs1").glob("shard-*.safetensors"))
    assert len(shards) == 4 and shards == sorted(p.name for p in (tmp_path / "hs2").glob("shard-*.safetensors"))
    for name in shards:
        assert (tmp_path / "hs1" / name).read_bytes() == (tmp_path / "hs2" / name).read_bytes(), name
    m1, m2 = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("hs1", "hs2"))
    assert m1["shards"] == m2["shards"] and m1["num_tokens"] == m2["num_tokens"]
