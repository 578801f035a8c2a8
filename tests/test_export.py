"""Export for vLLM and import of other layouts (speculators without paradraft keys, original EAGLE-3 `midlayer`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import all_elements, make_tokenizer, random_slots, save_tiny_verifier
from paradraft.config import ExportConfig
from paradraft.data.vocab import build_vocab
from paradraft.export.vllm import export, serve_command
from paradraft.models.checkpoint import build_drafter, load_drafter, save_drafter
from paradraft.models.common import DraftConfig


def trained_like(verifier, algorithm):
    torch.manual_seed(0)
    cfg = DraftConfig.from_verifier(verifier.config, algorithm=algorithm, draft_vocab_size=200,
                                    mask_token_id=len(make_tokenizer()) - 1 if algorithm == "peagle" else None,
                                    verifier=str(verifier.name_or_path))
    d = build_drafter(cfg)
    d2t, t2d = build_vocab(torch.arange(verifier.config.vocab_size).numpy() + 1, 200, verifier.config.vocab_size)
    d.init_from_verifier(verifier, d2t, t2d)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.requires_grad and "norm" not in n:
                p.normal_(0, 0.2)
    return d.eval()


def same_logits(a, b, algorithm):
    batch = random_slots(16, a)
    with torch.no_grad():
        if algorithm == "peagle":
            el = all_elements(16, 3)
            return torch.allclose(a.train_forward(batch, 3, anchors=el)[2], b.train_forward(batch, 3, anchors=el)[2],
                                  atol=1e-5)
        return torch.allclose(a.train_forward(batch, 3)[2][2], b.train_forward(batch, 3)[2][2], atol=1e-5)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_export_writes_vllm_checkpoint_and_command(tmp_path, capsys, algorithm):
    from transformers import AutoModelForCausalLM

    vdir = save_tiny_verifier(tmp_path)
    verifier = AutoModelForCausalLM.from_pretrained(vdir)
    d = trained_like(verifier, algorithm)
    save_drafter(d, tmp_path / "trained")
    out = export(ExportConfig(drafter=str(tmp_path / "trained"), output=str(tmp_path / "exp"), dtype="float32"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(vdir)
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    text = capsys.readouterr().out
    assert "vllm serve" in text and '"method": "eagle3"' in text
    assert ('"parallel_drafting": true' in text) == (algorithm == "peagle")
    assert same_logits(d, load_drafter(out, verifier=verifier), algorithm)
    cmd = serve_command(str(vdir), str(out), algorithm, 7)
    assert '"num_speculative_tokens": 7' in cmd


def test_export_writes_qk_norm_layers_for_a_llama_verifier_and_llama_layers_for_qwen3(tmp_path):
    from transformers import AutoModelForCausalLM

    def saved(qwen3_verifier: bool, flavour: str):
        vdir = save_tiny_verifier(tmp_path / f"v-{qwen3_verifier}", qwen3=qwen3_verifier)
        verifier = AutoModelForCausalLM.from_pretrained(vdir)
        cfg = DraftConfig.from_verifier(verifier.config, algorithm="eagle3", draft_vocab_size=200, flavour=flavour,
                                        verifier=str(vdir))
        d = build_drafter(cfg)
        V = verifier.config.vocab_size
        d.init_from_verifier(verifier, *build_vocab(torch.arange(V).numpy() + 1, 200, V))
        return save_drafter(d, tmp_path / f"d-{qwen3_verifier}-{flavour}")

    q_for_llama = saved(False, "qwen3")  # `train --draft-layer qwen3` (the reference's layer) for a Llama verifier
    out = export(ExportConfig(drafter=str(q_for_llama), output=str(tmp_path / "exp"), dtype="float32"))
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3"  # vLLM picks Eagle3Qwen3ForCausalLM by this, whatever the verifier
    llama_for_qwen3 = saved(True, "llama")  # as published EAGLE-3 drafters for Qwen3 verifiers are
    out = export(ExportConfig(drafter=str(llama_for_qwen3), output=str(tmp_path / "exp2"), dtype="float32"))
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "llama"


def test_import_speculators_checkpoint_without_paradraft_keys(tmp_path):
    from transformers import AutoModelForCausalLM

    vdir = save_tiny_verifier(tmp_path)
    verifier = AutoModelForCausalLM.from_pretrained(vdir)
    d = trained_like(verifier, "peagle")
    save_drafter(d, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    del cfg["paradraft"]  # as another tool writes it
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(tmp_path / "c" / "model.safetensors"))
    sd["mask_hidden"] = sd["mask_hidden"].view(1, 1, -1)  # the (1, 1, 3H) shape some writers use
    save_file(sd, str(tmp_path / "c" / "model.safetensors"))
    loaded = load_drafter(tmp_path / "c", verifier=verifier)
    assert loaded.cfg.mask_token_id == d.cfg.mask_token_id and loaded.cfg.norm_before_residual is False
    assert same_logits(d, loaded, "peagle")


def test_import_original_eagle3_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    vdir = save_tiny_verifier(tmp_path)
    verifier = AutoModelForCausalLM.from_pretrained(vdir)
    d = trained_like(verifier, "eagle3")
    src = tmp_path / "orig"
    src.mkdir()
    sd = {k.replace("layers.0.", "midlayer."): v.contiguous() for k, v in d.state_dict().items()
          if not k.startswith("rotary.") and k != "embed_tokens.weight"}
    torch.save(sd, src / "pytorch_model.bin")
    c = d.cfg
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"], "vocab_size": c.vocab_size, "draft_vocab_size": 200,
        "max_position_embeddings": 512}))
    loaded = load_drafter(src, verifier=verifier)  # embeddings come from the verifier
    assert loaded.cfg.algorithm == "eagle3" and loaded.cfg.aux_layer_ids == [2, 4, 5]
    assert same_logits(d, loaded, "eagle3")
    out = export(ExportConfig(drafter=str(src), output=str(tmp_path / "converted"), verifier=str(vdir),
                              dtype="float32"))
    written = load_file(str(out / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in written
    # export read the verifier's embedding from its safetensors file alone (verifier_tensor), not the whole model
    assert torch.equal(written["embed_tokens.weight"], verifier.get_input_embeddings().weight.detach().float())


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_streamed_export_equals_the_model_path(tmp_path, algorithm, dtype):
    """export streams a speculators-format checkpoint tensor by tensor in row chunks: the same file contents as
    loading the drafter whole and writing it, for every dtype; with a chunk smaller than one tensor too; and a
    checkpoint without embed_tokens.weight takes the verifier's, read from its safetensors alone."""
    from transformers import AutoModelForCausalLM

    import paradraft.models.checkpoint as ck
    from paradraft.models.checkpoint import write_drafter

    vdir = save_tiny_verifier(tmp_path)
    verifier = AutoModelForCausalLM.from_pretrained(vdir)
    d = trained_like(verifier, algorithm)
    save_drafter(d, tmp_path / "trained")
    ck.STREAM_CHUNK_BYTES, old = 4096, ck.STREAM_CHUNK_BYTES  # many chunks per matrix
    try:
        out = export(ExportConfig(drafter=str(tmp_path / "trained"), output=str(tmp_path / "exp"), dtype=dtype,
                                  num_speculative_tokens=2))
    finally:
        ck.STREAM_CHUNK_BYTES = old
    whole = load_drafter(tmp_path / "trained", verifier=verifier)
    whole.cfg.verifier, whole.cfg.num_speculative_tokens = str(vdir), 2
    whole.cfg.verifier_architectures = ["LlamaForCausalLM"]
    (tmp_path / "ref").mkdir()
    write_drafter(whole, tmp_path / "ref", dtype=getattr(torch, dtype))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (out, tmp_path / "ref"))
    assert ca == cb
    # a checkpoint without its embedding (vLLM shares the verifier's): the verifier's rows are written
    sd = load_file(str(tmp_path / "trained" / "model.safetensors"))
    del sd["embed_tokens.weight"]
    if algorithm == "peagle":
        return  # P-EAGLE's trained mask row lives in the embedding: train always writes it
    save_file(sd, str(tmp_path / "trained" / "model.safetensors"))
    out2 = export(ExportConfig(drafter=str(tmp_path / "trained"), output=str(tmp_path / "exp2"), dtype="float32"))
    emb = load_file(str(out2 / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(emb, verifier.get_input_embeddings().weight.detach().float())


def test_export_serves_the_k_validation_supports(tmp_path, capsys):
    """export prints (and records) the smallest K within 0.01 of the best held-out acceptance estimate, and why;
    --num-speculative-tokens overrides it; a drafter without estimates keeps its K."""
    from transformers import AutoModelForCausalLM

    vdir = save_tiny_verifier(tmp_path)
    verifier = AutoModelForCausalLM.from_pretrained(vdir)
    d = trained_like(verifier, "peagle")
    d.cfg.num_depths = 7
    est = {"1": 1.30, "2": 1.42, "3": 1.425, "4": 1.426, "7": 1.427}
    save_drafter(d, tmp_path / "run", extra_provenance={"final": {"val": {"acceptance_length_by_k": est}}})
    capsys.readouterr()
    out = export(ExportConfig(drafter=str(tmp_path / "run"), output=str(tmp_path / "e"), dtype="float32"))
    text = capsys.readouterr().out
    assert "K=2 (held-out validation estimates acceptance length 1.420 at K=2 and 1.427 at K=7" in text
    assert '"num_speculative_tokens": 2' in text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    again = export(ExportConfig(drafter=str(out), output=str(tmp_path / "e2"), dtype="float32"))  # estimates kept
    assert "K=2 (" in capsys.readouterr().out and again.is_dir()
    export(ExportConfig(drafter=str(tmp_path / "run"), output=str(tmp_path / "e3"), dtype="float32",
                        num_speculative_tokens=5))
    assert '"num_speculative_tokens": 5' in capsys.readouterr().out
    save_drafter(d, tmp_path / "bare")
    export(ExportConfig(drafter=str(tmp_path / "bare"), output=str(tmp_path / "e4"), dtype="float32"))
    assert f"K={d.cfg.num_speculative_tokens} (no held-out estimate" in capsys.readouterr().out


def test_a_drafter_builds_on_the_meta_device_for_every_rope_type():
    """export checks a checkpoint against the drafter its config describes, built on the meta device (no memory):
    that must work for the rope scalings the verifier families use (GPT-OSS: yarn; Llama 3: llama3)."""
    for rope in ({"rope_type": "default", "rope_theta": 1e4},
                 {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096, "truncate": False},
                 {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}):
        cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=120, draft_vocab_size=60, mask_token_id=119, rope_parameters=rope,
                          max_position_embeddings=131072)
        with torch.device("meta"):
            m = build_drafter(cfg)
        assert m.fc.weight.is_meta, rope["rope_type"]
        if rope["rope_type"] != "default":  # computed by Hugging Face's rope init, on the CPU whatever the device
            assert not m.rotary.inv_freq.is_meta and bool(torch.isfinite(m.rotary.inv_freq).all())
