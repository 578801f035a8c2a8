"""Hidden-state extraction: the layer convention, exact targets, resume, validation, disk checks, online mode."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest
import torch

from helpers import make_tiny_llama, make_tokenizer
from paradraft.config import ExtractConfig, PrepareConfig
from paradraft.data import hidden_states as hsmod
from paradraft.data.hidden_states import (
    HiddenStateError,
    HiddenStates,
    NotEnoughDiskError,
    OnlineHiddenStates,
    extract,
)
from paradraft.data.prepare import PreparedDataset, prepare
from paradraft.verifier import Tap, VerifierError


@pytest.fixture
def setup(tmp_path):
    tok = make_tokenizer("chatml")
    model = make_tiny_llama(vocab_size=len(tok), layers=8).to(torch.bfloat16)
    recs = []
    for i in range(23):
        q = " ".join(["what is", "the capital of France", "speculative decoding"][: 1 + i % 3])
        a = "Paris. " * (1 + i % 5) + "def add(a, b): return a + b " * (i % 2)
        recs.append({"id": str(i), "messages": [{"role": "user", "content": q + f" {i}?"},
                                                {"role": "assistant", "content": a}]})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    prepare(PrepareConfig(data=[str(tmp_path / "d.jsonl")], output=str(tmp_path / "data"), val_fraction=0.1,
                          verifier="tiny"), tokenizer=tok)
    return tok, model, tmp_path


def cfg_for(tmp_path, **kw):
    base = dict(data=str(tmp_path / "data"), output=str(tmp_path / "hs"), samples_per_shard=5, batch_tokens=300)
    base.update(kw)
    return ExtractConfig(**base)


def test_layer_convention_matches_hf_output_hidden_states_and_logits():
    model = make_tiny_llama(layers=8).float()
    ids = torch.randint(0, 400, (2, 17))
    att = torch.ones_like(ids)
    tap = Tap(model, [0, 2, 4, 5])
    aux, last = tap(ids, att)
    tap.remove()
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    H = model.config.hidden_size
    for j, layer in enumerate([0, 2, 4, 5]):  # "layer i" = input of decoder layer i = output_hidden_states[i]
        torch.testing.assert_close(aux[..., j * H:(j + 1) * H], ref.hidden_states[layer])
    logits = model.lm_head(model.model.norm(last))  # the verifier's logits, recomputed exactly
    torch.testing.assert_close(logits, ref.logits)
    with pytest.raises(VerifierError, match="out of range"):
        Tap(model, [2, 8])


def test_extract_offline_equals_online_and_batching(setup):
    tok, model, tmp = setup
    m = extract(cfg_for(tmp), model=model, tokenizer=tok)
    assert m["num_shards"] == 5 and m["layer_ids"] == [2, 4, 5] and m["dtype"] == "bfloat16"
    hs = HiddenStates(tmp / "hs")
    offline = list(hs)
    assert [o["sample_index"] for o in offline] == list(range(23))
    ds = PreparedDataset(tmp / "data")
    online = OnlineHiddenStates(model, ds, [2, 4, 5], batch_tokens=10_000).compute([0, 7, 22])
    for o in online:  # different batch composition, same tensors within bf16 tolerance
        off = offline[o["sample_index"]]
        assert torch.equal(o["input_ids"], off["input_ids"]) and torch.equal(o["loss_mask"], off["loss_mask"])
        torch.testing.assert_close(o["aux"].float(), off["aux"].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(o["last"].float(), off["last"].float(), atol=2e-2, rtol=2e-2)
    # an unbatched float32 reference agrees too
    ids, _ = ds.sample(7)
    with torch.no_grad():
        ref = model.float()(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states[4][0]
    torch.testing.assert_close(offline[7]["aux"][:, 64:128].float(), ref, atol=5e-2, rtol=5e-2)


def test_resume_after_kill_recomputes_nothing(setup, monkeypatch):
    tok, model, tmp = setup
    real = hsmod._write_shard
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed while the third shard is being produced
        return real(*a, **k)

    monkeypatch.setattr(hsmod, "_write_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        extract(cfg_for(tmp), model=model, tokenizer=tok)
    assert not (tmp / "hs" / "manifest.json").exists()
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp / "hs").glob("shard-*.safetensors")}
    assert len(stamps) == 2
    written = []
    monkeypatch.setattr(hsmod, "_write_shard", lambda out, s, *a, **k: (written.append(s), real(out, s, *a, **k)))
    m = extract(cfg_for(tmp), model=model, tokenizer=tok)
    assert written == [2, 3, 4] and m["num_shards"] == 5
    assert all((tmp / "hs" / n).stat().st_mtime_ns == t for n, t in stamps.items())
    assert not list((tmp / "hs").glob(".*tmp*"))
    assert sum(1 for _ in HiddenStates(tmp / "hs")) == 23


def test_sharded_processes_and_validate_catches_corruption(setup, capsys):
    tok, model, tmp = setup
    r0 = extract(cfg_for(tmp, shard="0/2"), model=model, tokenizer=tok)
    assert r0 == {"shards_done": 3, "num_shards": 5}
    m = extract(cfg_for(tmp, shard="1/2"), model=model, tokenizer=tok)
    assert m["num_shards"] == 5
    assert extract(cfg_for(tmp, validate=True))["valid"]
    f = tmp / "hs" / "shard-00003.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # flip bits inside the tensor data
    f.write_bytes(bytes(data))
    with pytest.raises(HiddenStateError, match="shard-00003.safetensors is corrupt"):
        extract(cfg_for(tmp, validate=True))
    hs = HiddenStates(tmp / "hs")
    with pytest.raises(HiddenStateError, match="shard-00003"):
        list(hs)  # the training loader finds it too


def test_not_enough_disk_is_refused_up_front(setup, monkeypatch):
    tok, model, tmp = setup
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(NotEnoughDiskError, match="GiB free"):
        extract(cfg_for(tmp), model=model, tokenizer=tok)
    assert not list((tmp / "hs").glob("shard-*"))


def test_trained_only_keeps_what_training_reads(setup):
    tok, model, tmp = setup
    full = extract(cfg_for(tmp), model=model, tokenizer=tok)
    thin = extract(cfg_for(tmp, output=str(tmp / "thin"), trained_only=True), model=model, tokenizer=tok)
    assert thin["bytes"] < full["bytes"]
    a, b = list(HiddenStates(tmp / "hs")), list(HiddenStates(tmp / "thin"))
    for x, y in zip(a, b):
        n = len(y["input_ids"])
        # (batches differ when samples are cut, so bf16 kernels may round differently)
        torch.testing.assert_close(x["aux"][:n].float(), y["aux"].float(), atol=2e-2, rtol=2e-2)
        needed = torch.zeros(n, dtype=torch.bool)
        needed[:-1] = y["loss_mask"][1:].bool()  # last[p] is a target where x_{p+1} is trained
        torch.testing.assert_close(x["last"][:n][needed].float(), y["last"][needed].float(), atol=2e-2, rtol=2e-2)
        assert (y["last"][~needed] == 0).all()


def test_other_extraction_in_output_is_refused(setup):
    tok, model, tmp = setup
    extract(cfg_for(tmp, max_samples=5), model=model, tokenizer=tok)
    with pytest.raises(HiddenStateError, match="another extraction"):
        extract(cfg_for(tmp, layers=[1, 2, 3], max_samples=5), model=model, tokenizer=tok)
