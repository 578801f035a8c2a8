"""Drafters: the mask rule, COD sampling, training == inference, both attention backends, checkpoints."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import all_elements, make_tiny_llama, random_slots, tiny_drafter
from paradraft.data.vocab import build_vocab
from paradraft.models.attention import Elements, attention, dense_mask, flex_mask_mod, parallel_draft_mask
from paradraft.models.checkpoint import CheckpointError, build_drafter, check_compatible, load_drafter, save_drafter
from paradraft.models.common import DraftCache, DraftConfig
from paradraft.models.loss import pack_slots, slots_from_sample
from paradraft.models.peagle import cod_sample
from paradraft.verifier import VerifierHead

# ------------------------------------------------------------------------------------------- the mask rule

def test_parallel_draft_mask_by_hand():
    # elements: depth-0 at 0,1,2 ; (anchor 1, depth 1), (anchor 1, depth 2), (anchor 0, depth 1)
    anchor = torch.tensor([0, 1, 2, 1, 1, 0])
    depth = torch.tensor([0, 0, 0, 1, 2, 1])
    m = parallel_draft_mask(anchor, depth, torch.zeros(3, dtype=torch.long))
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],  # (1,1): context <= 1, itself
        [1, 1, 0, 1, 1, 0],  # (1,2): context <= 1, its chain (1,1), itself
        [1, 0, 0, 0, 0, 1],  # (0,1): context <= 0, itself; never another chain
    ], dtype=torch.bool)
    assert torch.equal(m, expected)
    # documents: position 2 starts a new document, so it sees only itself
    m2 = parallel_draft_mask(anchor, depth, torch.tensor([0, 0, 1]))
    assert m2[2].tolist() == [False, False, True, False, False, False]


def test_flex_mask_mod_is_the_same_rule():
    a, d = all_elements(12, 4)
    doc = (torch.arange(12) >= 7).long()
    e = Elements(a, d, doc[a])
    mod = flex_mask_mod(e, e)
    qi, ki = torch.meshgrid(torch.arange(len(e)), torch.arange(len(e)), indexing="ij")
    assert torch.equal(mod(0, 0, qi, ki), dense_mask(e, e))


def test_sdpa_and_flex_backends_agree():
    torch.manual_seed(0)
    a, d = all_elements(40, 4, doc=(torch.arange(40) >= 25).long())
    e = Elements(a, d, (a >= 25).long())
    n = len(e)
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    # reference: one SDPA over every key with the full element x element mask
    full = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=dense_mask(e, e))
    ref = attention(q, k, v, e, e, backend="sdpa")
    torch.testing.assert_close(ref, full)
    for qb in (7, 16):  # the mask built in blocks, each over only the key span it can use
        torch.testing.assert_close(attention(q, k, v, e, e, backend="sdpa", query_block=qb), full)
    # any element order (the key span is found from the mask, not assumed), with gradients
    perm = torch.randperm(n)
    ep = Elements(e.anchor[perm], e.depth[perm], e.doc[perm])
    qs, ks, vs = (t[:, :, perm].clone().requires_grad_(True) for t in (q, k, v))
    out = attention(qs, ks, vs, ep, ep, backend="sdpa", query_block=5)
    torch.testing.assert_close(out, full[:, :, perm])
    out.square().sum().backward()
    q2, k2, v2 = (t[:, :, perm].clone().requires_grad_(True) for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1),
                                                     attn_mask=dense_mask(ep, ep)).square().sum().backward()
    for a, b in ((qs, q2), (ks, k2), (vs, v2)):
        torch.testing.assert_close(a.grad, b.grad)
    try:
        out = attention(q, k, v, e, e, backend="flex")
    except Exception as exc:  # pragma: no cover - flex unavailable in this torch build
        pytest.skip(f"flex_attention unavailable: {exc}")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no CPU backward")
def test_flex_gradients_match_sdpa_on_gpu():  # pragma: no cover - runs where a GPU is present
    torch.manual_seed(0)
    a, d = all_elements(300, 4)
    e = Elements(a, d, torch.zeros_like(a)).to("cuda")
    n = len(e)
    grads = []
    for backend in ("sdpa", "flex"):
        torch.manual_seed(1)
        q, k, v = (torch.randn(1, h, n, 64, device="cuda", requires_grad=True) for h in (4, 2, 2))
        attention(q, k, v, e, e, backend=backend).square().sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for g1, g2 in zip(*grads):
        torch.testing.assert_close(g1, g2, atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------------------------------- COD sampling

def test_cod_sample_chains_validity_and_ratios():
    T = 4000
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(T, generator=g) < 0.9
    anchor, depth = cod_sample(loss_mask, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(anchor[:T], torch.arange(T)) and (depth[:T] == 0).all()
    kept = {(int(a), int(d)) for a, d in zip(anchor, depth)}
    assert len(kept) == len(anchor)  # no duplicates
    for a, d in kept:
        if d >= 1:
            assert a + d < T and loss_mask[a + d]
            assert (a, d - 1) in kept  # whole chain present
    for d in range(1, 8):
        valid = int(loss_mask[d:].sum())
        n = int((depth == d).sum())
        assert n == min(n, round(max(0.7 ** d, 0.2) * valid))
        assert n >= 0.8 * round(max(0.7 ** d, 0.2) * valid)  # "about" the geometric fraction
    again = cod_sample(loss_mask, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], anchor) and torch.equal(again[1], depth)


def test_cod_sample_respects_documents():
    doc = torch.tensor([0] * 5 + [1] * 5)
    anchor, depth = cod_sample(torch.ones(10, dtype=torch.bool), 4, ratio=1.0, ratio_min=1.0, document_ids=doc)
    for a, d in zip(anchor.tolist(), depth.tolist()):
        assert doc[a] == doc[a + d]
    assert int((depth == 1).sum()) == 8  # 4 per document


# ------------------------------------------------------------------------------------------- training == inference

@pytest.mark.parametrize("flavour", ["llama", "qwen3"])
def test_peagle_training_logits_equal_one_pass_inference(flavour):
    model, _ = tiny_drafter("peagle", flavour)
    K = 5
    b = random_slots(30, model, doc_lengths=[18, 12])
    a, d = all_elements(30, K, b.doc)
    with torch.no_grad():
        _, _, logits, _ = model.train_forward(b, K, anchors=(a, d))
        for j in (3, 11, 17, 20, 24):  # anchors in both documents
            start = 18 if j >= 18 else 0
            sl = slice(start, j + 1)
            # round 1 fills the cache with part of the context, round 2 drafts K tokens in ONE pass
            cache = DraftCache()
            mid = start + (j + 1 - start) // 2
            if mid > start:
                model.draft(b.tokens[start:mid], b.hidden[start:mid], b.positions[start:mid], K, cache)
            out = model.draft(b.tokens[mid:j + 1], b.hidden[mid:j + 1], b.positions[mid:j + 1], K, cache)
            assert len(cache) == j + 1 - start  # only context slots are cached
            for depth in range(K):
                sel = ((a == j) & (d == depth)).nonzero()
                if len(sel) and j + depth < 30 and b.doc[j + depth] == b.doc[j]:
                    torch.testing.assert_close(out[depth], logits[sel[0, 0]], atol=1e-4, rtol=1e-4)
            del sl


def test_cache_keep_docs_drops_finished_rows_and_changes_no_logits():
    model, _ = tiny_drafter("peagle")
    K = 4
    b = random_slots(20, model, doc_lengths=[10, 10])
    toks, hids, pos = b.tokens, b.hidden, b.positions  # rows 0 and 1: slots 0..9 and 10..19
    with torch.no_grad():
        cache = DraftCache()
        model.draft(torch.cat([toks[:6], toks[10:16]]), torch.cat([hids[:6], hids[10:16]]),
                    torch.cat([pos[:6], pos[10:16]]), K, cache, doc=torch.tensor([0, 1]), counts=[6, 6])
        both = model.draft(toks[16:20], hids[16:20], pos[16:20], K, copy.deepcopy(cache), doc=torch.tensor([1]),
                           counts=[4])  # [1, K, Vd]
        cache.keep_docs([1])  # row 0 finished
        assert len(cache) == 6 and set(cache.elems.doc.tolist()) == {1}
        assert all(k.shape[2] == 6 and v.shape[2] == 6 for k, v in cache.kv)
        alone = model.draft(toks[16:20], hids[16:20], pos[16:20], K, cache, doc=torch.tensor([1]), counts=[4])
    torch.testing.assert_close(alone, both, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flavour", ["llama", "qwen3"])
def test_eagle3_ttt_step_equals_sequential_inference(flavour):
    model, _ = tiny_drafter("eagle3", flavour)
    b = random_slots(24, model)
    steps = 4
    with torch.no_grad():
        _, stats, logits, anchors = model.train_forward(b, steps)
        for j in (0, 7, 15):
            cache = DraftCache()
            lg, h = model.context_step(b.tokens[:j + 1], b.hidden[:j + 1], b.positions[:j + 1], cache)
            torch.testing.assert_close(lg[-1], logits[0][j], atol=1e-4, rtol=1e-4)
            hp = h[-1:]
            for s in range(1, steps):
                # the teacher-forced token of training is the token inference would have drafted
                lg, hp = model.chain_step(b.tokens[j + s:j + s + 1], hp, int(b.positions[j]), s, cache)
                row = (anchors[s] == j).nonzero()[0, 0]
                torch.testing.assert_close(lg[0], logits[s][row], atol=1e-4, rtol=1e-4)
    assert len(stats["acc"]) == steps


def test_init_copies_the_verifiers_final_norm_and_lm_head_rows():
    verifier = make_tiny_llama(vocab_size=120)
    with torch.no_grad():
        verifier.model.norm.weight.uniform_(-2, 3)
    cfg = DraftConfig.from_verifier(verifier.config, algorithm="peagle", num_layers=1, draft_vocab_size=60,
                                    mask_token_id=119)
    d2t, t2d = build_vocab(torch.randint(1, 100, (120,)).numpy(), 60, 120)
    model = build_drafter(cfg)
    model.init_from_verifier(verifier, d2t, t2d, norm=True)
    assert torch.equal(model.norm.weight, verifier.model.norm.weight)
    ids = torch.arange(60) + d2t
    assert torch.equal(model.lm_head.weight, verifier.lm_head.weight[ids])
    fresh = build_drafter(cfg)
    fresh.init_from_verifier(verifier, d2t, t2d)  # default: the fresh norm's ones
    assert torch.equal(fresh.norm.weight, torch.ones_like(fresh.norm.weight))


def test_gradients_reach_mask_parameters_not_verifier_embeddings():
    model, _ = tiny_drafter("peagle")
    model.train()
    b = random_slots(40, model)
    b.valid[:] = True
    loss, stats, _, _ = model.train_forward(b, 4, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert model.mask_hidden.grad.abs().sum() > 0 and model.mask_embedding.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is None
    assert stats["count"][0] == 40 and len(stats["acc"]) == 4


def test_targets_and_slots_from_verifier():
    verifier = make_tiny_llama(vocab_size=120)
    d2t, t2d = build_vocab(torch.arange(120).numpy() + 1, 60, 120)
    ids = torch.randint(0, 120, (1, 16))
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
        hs = out.hidden_states  # [L+1] x [1, S, H]; last entry is AFTER the final norm
        last = verifier.model.layers[-1]  # capture the pre-norm last hidden state by recomputation
        pre = []
        h = verifier.model.norm.register_forward_hook(lambda m, i, o: pre.append(i[0]))
        verifier(ids)
        h.remove()
    tp, tid = VerifierHead(verifier).targets(pre[0][0], d2t + torch.arange(60))
    assert torch.equal(tid, out.logits[0].argmax(-1))
    ref = torch.softmax(out.logits[0][:, d2t + torch.arange(60)], -1)
    torch.testing.assert_close(tp, ref, atol=1e-5, rtol=1e-4)
    aux = torch.cat([hs[i][0] for i in (2, 3, 4)], -1)
    mask = torch.ones(16, dtype=torch.bool)
    s = slots_from_sample(ids[0], mask, aux, tp, tid)
    assert len(s) == 15 and torch.equal(s.tokens, ids[0, 1:]) and not s.valid[-1] and s.valid[:-1].all()
    packed = pack_slots([s, s])
    assert len(packed) == 30 and packed.doc.tolist() == [0] * 15 + [1] * 15
    del last


# ------------------------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_checkpoint_roundtrip_and_vllm_keys(tmp_path, algorithm):
    model, verifier = tiny_drafter(algorithm)
    if algorithm == "peagle":
        with torch.no_grad():
            model.mask_embedding.add_(1.0)  # a trained mask row must survive the round trip
    save_drafter(model, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["speculators_model_type"] == algorithm
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    assert cfg["transformer_layer_config"]["vocab_size"] == 120
    assert cfg["draft_vocab_size"] == 60 and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # [2, L//2, L-3], L=8
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == model.cfg.num_speculative_tokens
    prov = json.loads((tmp_path / "ckpt" / "provenance.json").read_text())
    assert {"command", "torch", "transformers", "git_sha", "date"} <= set(prov)
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert sd["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * model.cfg.hidden_size
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
            "layers.0.hidden_norm.weight"} <= set(sd)
    if algorithm == "peagle":
        assert cfg["mask_token_id"] == 119 and sd["mask_hidden"].shape == (1, 3 * model.cfg.hidden_size)
        torch.testing.assert_close(sd["embed_tokens.weight"][119], model.mask_embedding.detach())
    loaded = load_drafter(tmp_path / "ckpt", verifier=verifier).eval()
    b = random_slots(20, model)
    with torch.no_grad():
        if algorithm == "peagle":
            a, d = all_elements(20, 3)
            r1 = model.train_forward(b, 3, anchors=(a, d))[2]
            r2 = loaded.train_forward(b, 3, anchors=(a, d))[2]
        else:
            r1, r2 = model.train_forward(b, 3)[2][1], loaded.train_forward(b, 3)[2][1]
    torch.testing.assert_close(r1, r2)


def test_incompatible_verifier_is_refused_clearly(tmp_path):
    model, verifier = tiny_drafter("peagle")
    model.cfg.verifier = "/models/verifier-a"
    save_drafter(model, tmp_path / "c")
    other = make_tiny_llama(vocab_size=130, hidden=32, layers=8)
    with pytest.raises(CheckpointError, match="hidden size.*vocabulary"):
        load_drafter(tmp_path / "c", verifier=other)
    cfg = load_drafter(tmp_path / "c").cfg
    verifier.config._name_or_path = "/models/verifier-b"
    with pytest.raises(CheckpointError, match="--force"):
        check_compatible(cfg, verifier.config)
    check_compatible(cfg, verifier.config, force=True)
    cfg.aux_layer_ids = [2, 3, 40]  # noqa
    with pytest.raises(CheckpointError, match=r"aux layer ids \[40\]"):
        check_compatible(cfg, verifier.config, force=True)
    with pytest.raises(CheckpointError, match="not a drafter checkpoint"):
        load_drafter(tmp_path)


def _slots(target_p, target_ids):
    from paradraft.models.loss import SlotBatch

    T = target_p.shape[0]
    z = torch.zeros(T, dtype=torch.long)
    return SlotBatch(tokens=z, hidden=torch.zeros(T, 3), positions=z, doc=z, target_p=target_p,
                     target_ids=target_ids, valid=torch.ones(T, dtype=torch.bool))


def test_draft_loss_is_the_kl_written_out_value_and_gradient():
    from paradraft.models.loss import draft_loss

    g = torch.Generator().manual_seed(0)
    T, N, V = 5, 9, 12
    p = torch.softmax(3 * torch.randn(T, V, generator=g), -1)
    p[0, :4] = 0.0  # zero probabilities: 0 log 0 = 0
    p = p / p.sum(-1, keepdim=True)
    b = _slots(p, torch.randint(0, V, (T,), generator=g))
    rows = torch.randint(0, T, (N,), generator=g)  # several elements share a slot, as depths do
    valid = torch.rand(N, generator=g) > 0.2
    d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    logits = torch.randn(N, V, generator=g, requires_grad=True)
    kl, trained, correct = draft_loss(logits, b, rows, valid, d2t, t2d)
    kl.sum().backward()
    grad, logits.grad = logits.grad.clone(), None
    pr = p[rows]
    ref = (torch.xlogy(pr, pr) - pr * torch.log_softmax(logits, -1)).sum(-1) * valid  # KL(p || q), written out
    ref.sum().backward()
    torch.testing.assert_close(kl, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, logits.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(trained, valid) and (kl[valid] >= -1e-5).all()
    assert torch.equal(correct, valid & (logits.argmax(-1) == b.target_ids[rows]))


def test_a_pack_with_nothing_to_train_still_backpropagates():
    from paradraft.models.loss import depth_reduce, draft_loss

    logits = torch.randn(6, 10, requires_grad=True)
    b = _slots(torch.softmax(torch.randn(6, 10), -1), torch.full((6,), 15))  # every target outside the vocabulary
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[:10] = True
    kl, trained, correct = draft_loss(logits, b, torch.arange(6), torch.ones(6, dtype=torch.bool),
                                      torch.zeros(10, dtype=torch.long), t2d)
    valid, depth = torch.ones(6, dtype=torch.bool), torch.zeros(6, dtype=torch.long)
    loss, stats = depth_reduce(kl, trained, correct, valid, depth, 1)
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(logits.grad) == 0 and stats["acc"] == [0.0]


def test_train_out_of_vocab_trains_positions_outside_the_draft_vocabulary_and_scores_them_wrong():
    """--train-out-of-vocab: positions whose verifier argmax is outside the draft vocabulary train on the target
    renormalized over the draft vocabulary (the reference's loss); by default they get no loss. Either way they count
    as wrong, and both algorithms pass the flag from the config to the loss."""
    from paradraft.config import TrainConfig
    from paradraft.models.eagle3 import Eagle3Drafter
    from paradraft.models.loss import SlotBatch, draft_loss
    from paradraft.models.peagle import PEagleDrafter

    g = torch.Generator().manual_seed(0)
    T, Vd, V = 4, 3, 6
    d2t = torch.zeros(Vd, dtype=torch.long)  # draft id i is target id i
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    b = SlotBatch(tokens=torch.zeros(T, dtype=torch.long), hidden=torch.zeros(T, 3), positions=torch.arange(T),
                  doc=torch.zeros(T, dtype=torch.long), target_p=torch.softmax(torch.randn(T, Vd, generator=g), -1),
                  target_ids=torch.tensor([0, 4, 1, 5]), valid=torch.ones(T, dtype=torch.bool))
    logits = torch.randn(T, Vd, generator=g)
    logits[0, 0] = logits[2, 1] = 10.0  # the in-vocabulary positions are right
    rows = torch.arange(T)
    kl, trained, correct = draft_loss(logits, b, rows, b.valid, d2t, t2d)
    assert trained.tolist() == [True, False, True, False] and float(kl[1]) == float(kl[3]) == 0.0
    kl2, trained2, correct2 = draft_loss(logits, b, rows, b.valid, d2t, t2d, out_of_vocab=True)
    assert trained2.all() and (kl2[[1, 3]] > 0).all() and torch.equal(kl2[[0, 2]], kl[[0, 2]])
    assert correct.tolist() == correct2.tolist() == [True, False, True, False]
    for algo, extra in ((PEagleDrafter, {"num_depths": 3}), (Eagle3Drafter, {})):
        for flag in (False, True):
            cfg = TrainConfig(algorithm=algo.algorithm, online=True, train_out_of_vocab=flag, **extra)
            assert algo.train_args(cfg)["out_of_vocab"] is flag


@pytest.mark.parametrize("flavour", ["llama", "qwen3"])
@pytest.mark.parametrize("kernel", [True, False])
def test_peagle_row_cache_drafts_what_the_element_cache_drafts(flavour, kernel, monkeypatch):
    """draft_rows on a RowCache (each element at place anchor + depth of its row, rejected drafts overwritten by
    the next pass's context) == draft on a DraftCache (the element rule), for ragged rows over several passes: a
    first pass longer than the kernel's queries (row by row), then engine-sized passes."""
    from paradraft import kernels
    from paradraft.models.common import RowCache

    if not kernel:
        monkeypatch.setattr(kernels, "available", lambda: False)  # attention.row_attention's SDPA path
    model, _ = tiny_drafter("peagle", flavour)
    K = 4
    b = random_slots(46, model, doc_lengths=[26, 20])
    starts = {0: 0, 1: 26}
    passes = [[15, 13], [2, 1], [1, 3], [4, 1], [3, 1]]  # new context slots of rows (0, 1) per pass
    rows = torch.tensor([1, 0])  # rows 0 and 1 sit in cache rows 1 and 0
    with torch.no_grad():
        elems, places = DraftCache(), model.row_cache(2, 64, K)
        assert isinstance(places, RowCache)
        done = {0: 0, 1: 0}
        for counts in passes:
            idx = torch.cat([torch.arange(starts[r] + done[r], starts[r] + done[r] + c) for r, c in enumerate(counts)])
            args = (b.tokens[idx], b.hidden[idx], b.positions[idx])
            want = model.draft(*args, K, elems, doc=rows, counts=counts)  # [2, K, Vd]
            got = model.draft_rows(*args, counts, rows, K, places)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            for r, c in enumerate(counts):
                done[r] += c
            nxt = slice(starts[1] + done[1], starts[1] + done[1] + 1)  # row 1 alone, its next slot
            one = model.draft_rows(b.tokens[nxt], b.hidden[nxt], b.positions[nxt], [1], rows[1:], K,
                                   copy.deepcopy(places))
            ref = model.draft(b.tokens[nxt], b.hidden[nxt], b.positions[nxt], K, copy.deepcopy(elems), doc=rows[1:],
                              counts=[1])
            torch.testing.assert_close(one, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_row_pass_compiles_once_for_one_slot_and_several():
    """P-EAGLE's compiled drafting pass on one row: a pass of one new slot (nothing accepted) and passes of several
    run one compiled graph (dynamo specialises a dimension of size 1, so they were two compilations and the second
    fell inside timed runs), and it drafts what the eager pass drafts."""
    import torch._dynamo

    model, _ = tiny_drafter("peagle", "qwen3")
    eager = copy.deepcopy(model)  # never compiled: draft_rows runs its pass eagerly
    model.compile_rows()
    K = 3
    b = random_slots(40, model, doc_lengths=[40])
    passes = [20, 1, 2, 1, 4, 3, 1]  # the prompt's pass (eager: more than 16 elements), then the engine's passes
    rows = torch.tensor([0])
    caches = model.row_cache(1, 64, K), eager.row_cache(1, 64, K)
    with torch.no_grad():
        done = 0
        for i, c in enumerate(passes):
            args = (b.tokens[done:done + c], b.hidden[done:done + c], b.positions[done:done + c], [c], rows, K)
            # the first compiled pass (one slot) compiles; no later pass may compile again
            with torch._dynamo.config.patch(error_on_recompile=i > 1):
                got = model.draft_rows(*args, caches[0])
            torch.testing.assert_close(got, eager.draft_rows(*args, caches[1]), atol=1e-4, rtol=1e-4)
            done += c
    assert model.compile_s > 0
