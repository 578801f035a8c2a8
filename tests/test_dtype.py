"""`auto` dtypes: one rule (paradraft.utils.fast_dtype) for the training autocast and for the verifier of every
command. bfloat16 only where it is the fast path (a GPU that has it, a CPU with AMX); elsewhere float32, where a
bf16 verifier forward ran 5-6x slower (an AVX2 CPU). Hidden states are stored in bf16 either way."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import save_tiny_verifier
from paradraft.cli import main
from paradraft.config import TrainConfig
from paradraft.decode.generate import load_engine
from paradraft.train.trainer import Trainer
from paradraft.utils import engine_dtype, fast_dtype, resolve_dtype


def set_amx(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: on)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny verifier on disk (float32 weights) and a prepared dataset of it."""
    tmp = tmp_path_factory.mktemp("dtype")
    vdir = save_tiny_verifier(tmp, "chatml")
    recs = [{"id": str(i), "messages": [{"role": "user", "content": f"what is {i}?"},
                                        {"role": "assistant", "content": "Paris is the capital. " * (1 + i % 4)}]}
            for i in range(24)]
    (tmp / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["prepare", "--data", str(tmp / "d.jsonl"), "-o", str(tmp / "data"), "--verifier", str(vdir),
                 "--val-fraction", "0.1"]) == 0
    return tmp, vdir


def test_auto_means_bf16_only_where_it_is_the_fast_path(monkeypatch):
    for on, want in ((True, "bfloat16"), (False, "float32")):
        set_amx(monkeypatch, on)
        assert fast_dtype("cpu") == resolve_dtype("auto", "cpu") == engine_dtype("auto") == want
        assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"  # asked: kept
    if not torch.cuda.is_available():  # vLLM without a GPU runs on this CPU: the CPU's rule
        assert engine_dtype("auto", "vllm") == "float32"


def extract(tmp, out, *extra) -> dict:
    assert main(["extract", "--data", str(tmp / "data"), "-o", str(out), "--samples-per-shard", "10", *extra]) == 0
    return json.loads((out / "identity.json").read_text())


def test_extract_auto_computes_in_the_fast_dtype_and_stores_bf16(world, tmp_path, monkeypatch):
    tmp, _ = world
    set_amx(monkeypatch, False)  # bf16 is the slow path: the verifier runs in float32, the shards hold bf16
    auto = extract(tmp, tmp_path / "auto")
    extract(tmp, tmp_path / "f32", "--dtype", "float32")
    assert auto["dtype"] == "bfloat16" and auto["compute_dtype"] == "float32"
    for name in ("shard-00000", "shard-00001"):
        a, f = (load_file(str(tmp_path / d / f"{name}.safetensors")) for d in ("auto", "f32"))
        for key in ("aux", "last"):
            assert a[key].dtype == torch.bfloat16 and torch.equal(a[key], f[key].to(torch.bfloat16))
    # where bf16 is the fast path, auto is the bf16 extraction made before `auto` existed: same identity, same shards
    set_amx(monkeypatch, True)
    amx = extract(tmp, tmp_path / "auto-amx")
    assert amx == extract(tmp, tmp_path / "bf16", "--dtype", "bfloat16") and "compute_dtype" not in amx
    a, b = (load_file(str(tmp_path / d / "shard-00000.safetensors")) for d in ("auto-amx", "bf16"))
    assert torch.equal(a["aux"], b["aux"])


def online(tmp, out, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(data=str(tmp / "data"), online=True, output=str(out), draft_vocab_size=128,
                                 batch_tokens=200, num_depths=4, warmup_steps=1, autocast="float32", save_every=2,
                                 max_steps=2), **kw})


def test_online_training_runs_the_verifier_in_the_fast_dtype_and_a_resumed_run_keeps_it(world, tmp_path,
                                                                                      monkeypatch):
    tmp, _ = world
    run = tmp_path / "run"
    set_amx(monkeypatch, True)  # begun where bf16 is the fast path
    t = Trainer(online(tmp, run))
    assert next(t.verifier.parameters()).dtype == torch.bfloat16
    assert t.train()["verifier_dtype"] == "bfloat16"
    assert json.loads((run / "checkpoints" / "step-0000002" / "state.json").read_text())["verifier_dtype"] \
        == "bfloat16"
    set_amx(monkeypatch, False)  # resumed where it is not: the run's numerics stay the same
    t = Trainer(online(tmp, run, max_steps=4, resume=True))
    assert next(t.verifier.parameters()).dtype == torch.bfloat16 and t.train()["verifier_dtype"] == "bfloat16"
    # the same flags started anew follow this machine
    t = Trainer(online(tmp, tmp_path / "new", max_steps=1))
    assert next(t.verifier.parameters()).dtype == torch.float32 and t.train()["verifier_dtype"] == "float32"
    # asked for explicitly, a dtype other than the one the run began with is refused on resume, with both named
    with pytest.raises(Exception, match=r"--verifier-dtype 'float32' \(the checkpoint has 'bfloat16'\)"):
        Trainer(online(tmp, run, max_steps=6, resume=True, verifier_dtype="float32"))


def test_bench_records_the_dtype_it_ran_in_and_generate_follows_the_rule(world, tmp_path, monkeypatch):
    tmp, vdir = world
    set_amx(monkeypatch, False)
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "what is 3?"}) + "\n")
    assert main(["bench", "--verifier", str(vdir), "--dataset", str(tmp_path / "p.jsonl"), "--num-prompts", "1",
                 "--max-new-tokens", "4", "--repeats", "1", "--no-prompt-lookup", "-o",
                 str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["dtype"] == "float32"
    for on, want in ((False, torch.float32), (True, torch.bfloat16)):  # generate's engine: the same rule
        set_amx(monkeypatch, on)
        engine, _ = load_engine(str(vdir), None, "auto")
        assert next(engine.verifier.parameters()).dtype == want
