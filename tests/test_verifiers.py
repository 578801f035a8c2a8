"""Every verifier family through the parts that touch it: the tap equals Hugging Face's hidden states, the target
head equals the model's logits, the runner equals a full forward after rollbacks, and greedy speculative decoding
with P-EAGLE and EAGLE-3 equals Hugging Face `generate` at batch 1 and 4 (float32). Tiny random models: Llama,
Qwen3 with a padded vocabulary, Qwen3-MoE, GPT-OSS (sinks, sliding windows, experts) and Granite (generic path)."""

from __future__ import annotations

import pytest
import torch

from helpers import FAMILIES, drafter_for, make_tiny_verifier
from paradraft.decode.engine import Engine, GenerationConfig
from paradraft.verifier import GenericRunner, Tap, VerifierHead, VerifierRunner, adapter_for, make_runner

V = 120


@pytest.fixture(scope="module", params=FAMILIES)
def verifier(request):
    return request.param, make_tiny_verifier(request.param, V, seed=1)


def prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(k),), generator=g).tolist() for k in torch.randint(5, 16, (n,), generator=g)]


def test_adapter_choice(verifier):
    family, model = verifier
    runner = make_runner(model, [2, 4, 5])
    assert isinstance(runner, GenericRunner if family == "granite" else VerifierRunner)
    assert adapter_for(model).embedding_rows(model) == (V + 16 if family == "qwen3_padded" else V)


def test_tap_and_head_equal_hugging_face(verifier):
    _, model = verifier
    ids = torch.tensor([prompts(1, seed=3)[0] * 2])  # longer than GPT-OSS's window of 6
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    tap = Tap(model, [2, 4, 5])
    aux, last = tap(ids, torch.ones_like(ids))
    tap.remove()
    H = model.config.hidden_size
    for j, layer in enumerate([2, 4, 5]):
        torch.testing.assert_close(aux[..., j * H:(j + 1) * H], ref.hidden_states[layer])
    torch.testing.assert_close(VerifierHead(model).logits(last[0]), ref.logits[0].float())


def test_runner_equals_full_forward_after_rollback(verifier):
    _, model = verifier
    p = prompts(1, seed=5)[0]
    runner = make_runner(model, [2, 4, 5], max_batch=2, max_len=64)
    rows = torch.tensor([1])
    runner.forward(torch.tensor([p]), rows=rows)
    runner.forward(torch.tensor([[7, 8, 9]]), rows=rows)  # three drafts...
    runner.set_lengths(rows, torch.tensor([len(p) + 1]))  # ...of which one is kept
    logits, aux = runner.forward(torch.tensor([[11, 12]]), rows=rows)
    seq = torch.tensor([p + [7, 11, 12]])
    with torch.no_grad():
        ref = model(seq, output_hidden_states=True)
    torch.testing.assert_close(logits[0], ref.logits[0, -2:].float(), atol=1e-4, rtol=1e-4)
    ref_aux = torch.cat([ref.hidden_states[i][0, -2:] for i in (2, 4, 5)], -1)
    torch.testing.assert_close(aux[0], ref_aux, atol=1e-4, rtol=1e-4)


def test_cache_places_are_zeroed_as_reached_and_a_short_rows_stale_places_stay_harmless(verifier):
    """The caches come from torch.empty and are zeroed only as far as the keys in use reach: poisoned with NaN (what
    empty memory may hold), a batch of a short and a long row still equals each row's own full forward, though the
    short row's attention spans places past its length (masked: they must be finite, not NaN)."""
    family, model = verifier
    if family == "granite":
        pytest.skip("the generic runner keeps Hugging Face's own caches")
    runner = make_runner(model, [2, 4, 5], max_batch=2, max_len=2 * VerifierRunner.ZERO_CHUNK + 8)
    for t in runner.k + runner.v:
        t.fill_(float("nan"))
    short, long = prompts(1, seed=7)[0][:5], prompts(1, seed=8)[0] + prompts(1, seed=9)[0]
    runner.forward(torch.tensor([short]), rows=torch.tensor([0]))
    runner.forward(torch.tensor([long]), rows=torch.tensor([1]))
    logits, _ = runner.forward(torch.tensor([[7], [8]]))  # both rows: the keys of the long one
    assert runner._zeroed == VerifierRunner.ZERO_CHUNK  # not all of max_len
    assert all(torch.isnan(t[:, :, runner._zeroed:]).all() for t in runner.k + runner.v)
    for row, seq in ((0, short + [7]), (1, long + [8])):
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0, -1].float()
        torch.testing.assert_close(logits[row, -1], ref, atol=1e-4, rtol=1e-4)


def test_prefill_logits_of_the_last_position_only(verifier):
    """last_only (the engine's prefill) gives the last row of the full logits, the same aux states and lengths."""
    _, model = verifier
    p = torch.tensor([prompts(1, seed=6)[0] * 2])  # [1, n], longer than GPT-OSS's window
    full, last = (make_runner(model, [2, 4, 5], max_batch=2, max_len=64) for _ in range(2))
    rows = torch.tensor([1])
    ref_logits, ref_aux = full.forward(p, rows=rows)
    logits, aux = last.forward(p, rows=rows, last_only=True)
    assert logits.shape == (1, 1, ref_logits.shape[-1]) and aux.shape == ref_aux.shape
    torch.testing.assert_close(logits[:, 0], ref_logits[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux)
    assert int(last.lengths[1]) == int(full.lengths[1]) == p.shape[1]


def test_a_right_padded_prefill_equals_each_prompt_alone(verifier):
    """A batched prefill (counts: rows right-padded to the longest) gives each row what it alone gives: the last real
    position's logits, its aux states, its length; and the next step of every row equals a full forward, so what the
    padding wrote past a row's length never reaches it."""
    _, model = verifier
    ps = [p * 2 for p in prompts(3, seed=7)]  # longer than GPT-OSS's window
    n = max(map(len, ps))
    runner = make_runner(model, [2, 4, 5], max_batch=3, max_len=64)
    toks = torch.tensor([p + [1] * (n - len(p)) for p in ps])  # [3, n], padded with a real token id
    counts = torch.tensor([len(p) for p in ps])
    assert len(set(counts.tolist())) > 1
    logits, aux = runner.forward(toks, rows=torch.tensor([0, 1, 2]), last_only=True, counts=counts)
    assert logits.shape[:2] == (3, 1) and aux.shape[:2] == (3, n)
    assert runner.lengths.tolist() == counts.tolist()
    for j, p in enumerate(ps):
        alone = make_runner(model, [2, 4, 5], max_batch=1, max_len=64)
        ref_logits, ref_aux = alone.forward(torch.tensor([p]), last_only=True)
        torch.testing.assert_close(logits[j], ref_logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux[j, :len(p)], ref_aux[0], atol=1e-5, rtol=1e-5)
    nxt, _ = runner.forward(torch.tensor([[7], [8], [9]]))  # every row's next token, at its own length
    for j, (p, x) in enumerate(zip(ps, (7, 8, 9))):
        with torch.no_grad():
            ref = model(torch.tensor([p + [x]])).logits[0, -1].float()
        torch.testing.assert_close(nxt[j, -1], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_greedy_speculative_equals_hf_generate(verifier, algorithm):
    _, model = verifier
    ps = prompts(4)
    g = GenerationConfig(max_new_tokens=14, num_speculative_tokens=4)
    hf = []
    for p in ps:
        ids = torch.tensor([p])
        hf.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, min_new_tokens=14,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist())
    drafter = drafter_for(model, algorithm)
    for bs in (1, 4):
        out = []
        for s in range(0, len(ps), bs):
            out += Engine(model, drafter, max_len=128).generate(ps[s:s + bs], g)
        assert [r.token_ids for r in out] == hf, bs


@pytest.mark.parametrize("family", ["llama", "qwen3_padded", "qwen3_moe", "gpt_oss", "granite"])
def test_workflow_through_the_cli(family, tmp_path, capsys):
    """prepare -> vocab -> extract -> train --vocab -> lossless generate -> export, on a saved tiny verifier."""
    import json

    from safetensors.torch import load_file

    from helpers import make_tokenizer
    from paradraft.cli import main

    tok = make_tokenizer("chatml")
    model = make_tiny_verifier(family, len(tok), seed=2)
    rows = model.get_input_embeddings().weight.shape[0]
    vdir = tmp_path / f"verifier-{family}"
    model.save_pretrained(vdir)
    tok.save_pretrained(vdir)
    recs = [{"id": str(i), "messages": [{"role": "user", "content": f"what is {i}?"},
                                        {"role": "assistant", "content": "Paris is the capital. " * (1 + i % 3)}]}
            for i in range(24)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = str(tmp_path)
    assert main(["prepare", "--data", f"{t}/d.jsonl", "-o", f"{t}/data", "--verifier", str(vdir),
                 "--val-fraction", "0.2"]) == 0
    assert main(["vocab", "--data", f"{t}/data", "-o", f"{t}/v.safetensors", "--size", "64", "--fill"]) == 0
    assert load_file(f"{t}/v.safetensors")["t2d"].shape == (rows,)  # sized to the embedding rows, not the tokenizer
    assert main(["extract", "--data", f"{t}/data", "-o", f"{t}/hs", "--dtype", "float32"]) == 0
    assert main(["train", "--data", f"{t}/data", "--hidden-states", f"{t}/hs", "-o", f"{t}/run", "--vocab",
                 f"{t}/v.safetensors", "--max-steps", "2", "--num-depths", "4", "--batch-tokens", "256",
                 "--autocast", "float32", "--verifier-dtype", "float32", "--warmup-steps", "1"]) == 0
    gen = ["generate", "--verifier", str(vdir), "--prompt", "what is 3?", "--max-new-tokens", "10",
           "--dtype", "float32", "--num-speculative-tokens", "3"]
    assert main([*gen, "--drafter", f"{t}/run", "-o", f"{t}/spec.jsonl"]) == 0
    assert main([*gen, "-o", f"{t}/plain.jsonl"]) == 0
    spec, plain = (json.loads((tmp_path / f).read_text()) for f in ("spec.jsonl", "plain.jsonl"))
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 0
    assert main(["export", f"{t}/run", "-o", f"{t}/exp", "--dtype", "float32"]) == 0
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["transformer_layer_config"]["vocab_size"] == rows
    assert cfg["speculators_config"]["verifier"]["architectures"] == list(model.config.architectures)


def test_each_family_is_one_file_that_registers_itself():
    import importlib
    import pkgutil

    from paradraft.verifier import adapters, registered_families

    registered = registered_families()
    package = importlib.import_module("paradraft.verifier.families")
    modules = [m.name for m in pkgutil.iter_modules(package.__path__)]
    assert sorted(modules) == ["gpt_oss", "llama", "qwen3"]
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"} <= set(registered)
    assert registered["qwen3_moe"].flavour == "qwen3" and registered["gpt_oss"].moe
    before = dict(registered)
    try:  # what a new family's file does: one call
        adapters.register("my_family", flavour="qwen3")
        assert registered_families()["my_family"].flavour == "qwen3"
    finally:
        registered.clear()
        registered.update(before)


def test_small_m_projections_equal_the_modules_and_respect_what_they_cannot_see():
    """verifier.linear: 2..16 float32 CPU rows as (W @ x^T)^T, the same product as the module up to float
    rounding; one row, many rows, bf16, a Linear subclass and a module with hooks run as the module itself."""
    from torch import nn

    from paradraft.verifier.linear import linear, mlp

    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    for shape in ((1, 64), (2, 64), (1, 4, 64), (2, 8, 64), (16, 64), (17, 64), (3, 7, 64)):
        x = torch.randn(shape)
        y = linear(lin, x)
        assert y.shape == (*shape[:-1], 96)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 64)
    assert torch.equal(linear(lin.to(torch.bfloat16), x.bfloat16()), lin(x.bfloat16()))  # bf16: the module
    lin.float()

    class Scaled(nn.Linear):  # a subclass may change forward: it runs itself
        def forward(self, x):
            return 2 * super().forward(x)

    sub = Scaled(64, 96)
    torch.testing.assert_close(linear(sub, x), 2 * nn.functional.linear(x, sub.weight, sub.bias))
    seen = []
    handle = lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    linear(lin, x)
    handle.remove()
    assert seen == [(4, 96)]  # a hook (a tap, an adapter) still fires
    model = make_tiny_verifier("llama")
    block = model.model.layers[0].mlp
    h = torch.randn(1, 4, model.config.hidden_size)
    torch.testing.assert_close(mlp(block, h), block(h), rtol=1e-5, atol=1e-5)


def test_small_m_path_is_measured_once_per_shape_and_can_be_forced(monkeypatch):
    """Without paradraft's kernel (a CPU without AVX-512), which path a few float32 rows take is measured on this CPU,
    once per (rows, weight shape, threads), and $PARADRAFT_SMALL_M=on / off forces it: on gives exactly
    (W @ x^T)^T + b, off exactly the module. With autograd recording (training) the module always runs."""
    from torch import nn

    import paradraft.verifier.linear as L
    from paradraft import kernels

    monkeypatch.setattr(kernels, "available", lambda: False)

    torch.manual_seed(0)
    lin, x = nn.Linear(64, 96), torch.randn(4, 64)
    monkeypatch.setenv(L.SMALL_M_ENV, "on")
    assert torch.is_grad_enabled() and torch.equal(L.linear(lin, x), lin(x))  # training: the module
    with torch.inference_mode():
        transposed = (lin.weight @ x.T).T + lin.bias  # [4, 96]
        assert torch.equal(L.linear(lin, x), transposed)
        monkeypatch.setenv(L.SMALL_M_ENV, "off")
        assert torch.equal(L.linear(lin, x), lin(x))
        monkeypatch.delenv(L.SMALL_M_ENV)
        calls, verdict = [], {4: True, 3: False}
        monkeypatch.setattr(L, "_FASTER", {})
        monkeypatch.setattr(L, "_measure", lambda w, rows: calls.append((tuple(w.shape), rows)) or verdict[rows])
        for _ in range(3):
            assert torch.equal(L.linear(lin, x), transposed)  # measured faster: transposed
            assert torch.equal(L.linear(lin, x[:3]), lin(x[:3]))  # measured slower: the module
    assert calls == [((96, 64), 4), ((96, 64), 3)]  # once per shape
    state = torch.get_rng_state()
    monkeypatch.undo()  # the real _measure again
    L._measure(lin.weight.detach(), 4)  # timing a shape leaves the global RNG where it was
    assert torch.equal(torch.get_rng_state(), state)


def test_training_targets_never_take_the_timed_small_m_path(monkeypatch):
    """The training targets (VerifierHead) of a sample with 2..16 trained positions are the module's own bits
    whichever path a timing would pick: with the transposed path forced, the decoding head takes it and the
    target head does not. (A timing that picked differently under load made a resumed run differ from an
    uninterrupted one in the last bits: the recipe pause-and-continue test, 2026-12-05.)"""
    import paradraft.verifier.linear as L
    from paradraft import kernels

    real_kernel = kernels.available()
    monkeypatch.setattr(kernels, "available", lambda: False)
    model = make_tiny_verifier("llama").float()
    head, adapter = VerifierHead(model), adapter_for(model)
    torch.manual_seed(0)
    last = torch.randn(5, model.config.hidden_size)  # [5, H]: five trained positions
    with torch.no_grad():
        expected = model.lm_head(model.model.norm(last)).float()  # [5, V]
        transposed = (model.lm_head.weight @ model.model.norm(last).T).T  # [5, V]
    # (on the 2-core hosts' BLAS the two differ in the last bits: ~1e-5 here; where they agree this test is weaker)
    for forced in ("on", "off"):
        monkeypatch.setenv(L.SMALL_M_ENV, forced)
        assert torch.equal(head.logits(last), expected)
        p, ids = head.targets(last, torch.arange(64))
        assert torch.equal(p, torch.softmax(expected[:, :64], -1)) and torch.equal(ids, expected.argmax(-1))
    monkeypatch.setenv(L.SMALL_M_ENV, "on")
    with torch.inference_mode():  # decoding keeps the rule (forced on: the transposed product)
        assert torch.equal(adapter.logits(model, model.model.norm(last)), transposed)
    if real_kernel:  # paradraft's kernel: decoding takes it, the targets stay the module's bits
        monkeypatch.setattr(kernels, "available", lambda: True)
        with torch.inference_mode():
            decoded = adapter.logits(model, model.model.norm(last))
            assert torch.equal(decoded, kernels.small_linear(model.model.norm(last), [model.lm_head.weight]))
        assert torch.equal(head.logits(last), expected)
