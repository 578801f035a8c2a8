"""The engine is lossless: greedy equality with plain decoding and HF generate; T>0 matches the verifier's law."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import make_tiny_llama, make_tokenizer, tiny_drafter
from paradraft.config import PrepareConfig, TrainConfig
from paradraft.decode.engine import Engine, GenerationConfig
from paradraft.decode.sampling import process_logits
from paradraft.decode.verify import greedy_accept, rejection_accept
from paradraft.models.checkpoint import load_drafter
from paradraft.models.common import DraftCache
from paradraft.pipeline import run_steps

N_PROMPTS = 20


def prompts_for(vocab, n=N_PROMPTS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 2, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 14, (n,), generator=g)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny verifier and P-EAGLE / EAGLE-3 drafters trained on its own greedy answers (high acceptance)."""
    tmp = tmp_path_factory.mktemp("engine")
    tok = make_tokenizer("chatml")
    v = make_tiny_llama(vocab_size=len(tok), layers=8, seed=3)
    eng = Engine(v)
    qs = [f"question number {i}: what is the capital of France?" for i in range(48)]
    enc = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in qs]
    enc = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else e for e in enc]
    outs = eng.generate(enc, GenerationConfig(max_new_tokens=48))
    recs = [{"id": str(i), "messages": [{"role": "user", "content": q},
                                        {"role": "assistant", "content": tok.decode(o.token_ids)}]}
            for i, (q, o) in enumerate(zip(qs, outs))]
    (tmp / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    steps = [("prepare", PrepareConfig(data=[str(tmp / "regen.jsonl")], output=str(tmp / "data"), val_fraction=0.1,
                                       verifier="tiny"))]
    for algo in ("peagle", "eagle3"):
        steps.append(("train", TrainConfig(algorithm=algo, data=str(tmp / "data"), online=True, output=str(tmp / algo),
                                           draft_vocab_size=len(tok), max_steps=60, lr=3e-3, warmup_steps=5,
                                           batch_tokens=512, num_depths=6, ttt_steps=4, verifier="tiny",
                                           autocast="float32", save_every=1000)))
    run_steps(steps, verifier=v, tokenizer=tok)
    drafters = {algo: load_drafter(tmp / algo, verifier=v, force=True) for algo in ("peagle", "eagle3")}
    return v, tok, drafters, enc


def gen(engine, prompts, bs, g):
    out = []
    for s in range(0, len(prompts), bs):
        out += engine.generate(prompts[s:s + bs], g)
    return out


def test_plain_engine_equals_hf_generate():
    for qwen in (False, True):
        v = make_tiny_llama(vocab_size=120, qwen3=qwen, seed=1)
        prompts = prompts_for(120)
        g = GenerationConfig(max_new_tokens=20)
        mine = gen(Engine(v), prompts, 4, g)
        for p, r in zip(prompts, mine):
            ids = torch.tensor([p])  # explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id
            hf = v.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert r.token_ids == hf


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
@pytest.mark.parametrize("flavour", ["llama", "qwen3"])
def test_greedy_lossless_random_drafters(algorithm, flavour):
    v = make_tiny_llama(vocab_size=120, qwen3=(flavour == "qwen3"), seed=1)
    d, _ = tiny_drafter(algorithm, flavour, verifier=v)
    prompts = prompts_for(120)
    g = GenerationConfig(max_new_tokens=24, num_speculative_tokens=5)
    ref = gen(Engine(v), prompts, 1, g)
    for bs in (1, 4):
        out = gen(Engine(v, d), prompts, bs, g)
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_greedy_lossless_trained_drafters_and_hf(trained, algorithm):
    v, tok, drafters, enc = trained
    prompts = enc[:N_PROMPTS]
    g = GenerationConfig(max_new_tokens=40, num_speculative_tokens=5, eos_token_ids=[tok.eos_token_id])
    ref = gen(Engine(v), prompts, 1, g)
    for bs in (1, 4):
        out = gen(Engine(v, drafters[algorithm]), prompts, bs, g)
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    for p, r in zip(prompts[:5], ref):
        ids = torch.tensor([p])
        hf = v.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert r.token_ids == hf
    # the trained drafter really drafts: many tokens per verifier pass (a real test of the acceptance path)
    acc = sum(sum(r.accepted_per_pass) for r in out) / sum(len(r.accepted_per_pass) for r in out)
    assert acc > 1.0
    assert all(len(r.token_ids) == sum(r.accepted_per_pass) + len(r.accepted_per_pass) + 1 or
               r.token_ids[-1] == tok.eos_token_id or len(r.token_ids) == 40 for r in out)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_greedy_drafts_skip_the_full_vocabulary_q_and_stay_the_same(algorithm):
    """At T=0 a draft token is the drafter's argmax mapped to its target id, with no [.., V] proposal built: the
    same drafts, passes and tokens as the argmax of the full-vocabulary one-hot q (a 60-of-120 draft vocabulary)."""
    v = make_tiny_llama(vocab_size=120, seed=1)
    d, _ = tiny_drafter(algorithm, verifier=v)
    prompts = prompts_for(120, n=6)
    g = GenerationConfig(max_new_tokens=16, num_speculative_tokens=4)
    runs = {}
    for fast in (True, False):
        eng, drafts = Engine(v, d), []
        assert eng.ascending
        eng.ascending = fast  # False: the one-hot q over the target vocabulary, as sampling builds it

        def recorded(st, active, draft=eng.draft, drafts=drafts):
            drafts.append(draft(st, active))  # (draft [R, K], q [R, K, V] or None)
            return drafts[-1]

        eng.draft = recorded
        out = eng.generate(prompts, g)
        assert all((q is None) == fast for _, q in drafts)
        runs[fast] = ([dr.tolist() for dr, _ in drafts], [r.token_ids for r in out], [r.accepted_per_pass for r in out])
    assert runs[True] == runs[False]


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_one_draft_token_per_pass(algorithm):
    v = make_tiny_llama(vocab_size=120, seed=1)
    d, _ = tiny_drafter(algorithm, verifier=v)
    prompts = prompts_for(120, n=3)
    g = GenerationConfig(max_new_tokens=12, num_speculative_tokens=1)
    assert [r.token_ids for r in Engine(v, d).generate(prompts, g)] == \
        [r.token_ids for r in Engine(v).generate(prompts, g)]


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_eos_and_length_limits_per_row(algorithm, monkeypatch):
    v = make_tiny_llama(vocab_size=120, seed=1)
    d, _ = tiny_drafter(algorithm, verifier=v)
    prompts = prompts_for(120, n=4)
    free = Engine(v).generate(prompts, GenerationConfig(max_new_tokens=16))
    eos = free[0].token_ids[5]  # a token row 0 emits: it must stop there
    kept = []  # the rows left in the drafter cache each time a row finishes
    real_keep = DraftCache.keep_docs

    def spy(cache, docs):
        real_keep(cache, docs)
        kept.append(sorted(set(cache.elems.doc.tolist())))
    monkeypatch.setattr(DraftCache, "keep_docs", spy)
    out = Engine(v, d).generate(prompts, GenerationConfig(max_new_tokens=16, num_speculative_tokens=4,
                                                          eos_token_ids=[eos]))
    if algorithm == "eagle3":  # one flat cache: row 0 stopped first, and its drafter keys left it (P-EAGLE's
        assert kept and 0 not in kept[0]  # RowCache keeps rows apart: nothing to remove)
    for f, o in zip(free, out):
        want = f.token_ids[: f.token_ids.index(eos) + 1] if eos in f.token_ids else f.token_ids
        assert o.token_ids == want
        assert o.finish_reason == ("stop" if eos in f.token_ids else "length")
    assert len(out[0].token_ids) <= 6


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (cells with expected < 5 merged), p-value via the regularized gamma."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_c > 0
    stat = (((obs_c - exp_c) ** 2) / exp_c)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_sampling_matches_verifier_distribution(algorithm):
    """T>0: the marginals of generated tokens 2 and 3 (both produced by draft/verify) match the verifier's exact
    marginals. Statistic: chi-square goodness of fit over 3,000 samples; the test fails if p < 0.001."""
    V = 24
    v = make_tiny_llama(vocab_size=V, hidden=32, seed=5)
    d, _ = _small_drafter(v, algorithm)
    prompt = [3, 7, 1]
    g = GenerationConfig(max_new_tokens=3, temperature=1.0, top_p=0.95, num_speculative_tokens=3)
    eng = Engine(v, d)
    toks = []
    for s in range(60):
        g.seed = s
        toks += [r.token_ids for r in eng.generate([prompt] * 50, g)]
    toks = torch.tensor(toks)  # [3000, 3]
    with torch.no_grad():  # exact marginals by enumeration
        p1 = process_logits(v(torch.tensor([prompt])).logits[0, -1], 1.0, 0.95)
        seq2 = torch.tensor([prompt + [a] for a in range(V)])
        p2c = process_logits(v(seq2).logits[:, -1], 1.0, 0.95)  # [V, V] P(x2 | x1)
        seq3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3c = process_logits(v(seq3).logits[:, -1], 1.0, 0.95).view(V, V, V)
    m2 = (p1[:, None] * p2c).sum(0)
    m3 = (p1[:, None, None] * p2c[:, :, None] * p3c).sum((0, 1))
    c2 = torch.bincount(toks[:, 1], minlength=V).double()
    c3 = torch.bincount(toks[:, 2], minlength=V).double()
    assert chi2_pvalue(c2, m2.double()) > 1e-3
    assert chi2_pvalue(c3, m3.double()) > 1e-3
    # the statistic has power: the drafter's own proposals (always accepted) are rejected by it
    q_only = torch.bincount(toks[:, 0], minlength=V).double()
    assert chi2_pvalue(q_only, m2.double()) < 1e-3


def _small_drafter(v, algorithm):
    from paradraft.data.vocab import build_vocab
    from paradraft.models.checkpoint import build_drafter
    from paradraft.models.common import DraftConfig

    torch.manual_seed(11)
    V = v.config.vocab_size
    cfg = DraftConfig.from_verifier(v.config, algorithm=algorithm, num_layers=1, draft_vocab_size=V - 4,
                                    mask_token_id=V - 1 if algorithm == "peagle" else None)
    d = build_drafter(cfg)
    d2t, t2d = build_vocab(torch.arange(V).numpy() + 1, V - 4, V)
    d.init_from_verifier(v, d2t, t2d)
    with torch.no_grad():
        d.lm_head.weight.mul_(3.0)  # a peaked, wrong-ish proposal: many rejections to exercise the residual
    return d.eval(), v


def test_prefill_groups_respect_the_budget_and_the_length_rule():
    from paradraft.decode.engine import prefill_groups

    lengths = [10, 300, 100, 98, 80, 75, 60, 300, 4000, 12, 9]
    groups = prefill_groups(lengths, budget=1024)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))  # every row once
    assert groups[0] == [8]  # a prompt above the budget alone, first (the longest)
    for g in groups:
        longest = lengths[g[0]]
        assert all(lengths[b] <= longest and 4 * lengths[b] >= 3 * longest for b in g)
        assert len(g) == 1 or len(g) * longest <= 1024
    assert [1, 7] in groups and [2, 3, 4, 5] in groups  # the similar lengths together
    assert prefill_groups(lengths, budget=1) == [[b] for b in sorted(range(11), key=lambda b: -lengths[b])]
    assert prefill_groups([]) == []


def test_a_batched_prefill_draws_the_first_tokens_as_one_at_a_time_does():
    """T > 0: the batched prefill (groups in length order) draws each row's first token in row order from the seeded
    generator, as feeding the prompts one at a time did: the same seed gives the same first tokens."""
    from paradraft.decode.engine import prefill_groups
    from paradraft.decode.sampling import sample

    v = make_tiny_llama(vocab_size=120, seed=1)
    prompts = prompts_for(120, n=8, seed=3)
    groups = prefill_groups([len(p) for p in prompts])
    assert len(groups) < len(prompts)  # some prompts share a forward...
    order = [b for grp in groups for b in grp]
    assert order != list(range(len(prompts)))  # ...and the groups' order is not the rows'
    with torch.no_grad():
        probs = [process_logits(v(torch.tensor([p])).logits[0, -1].float(), 3.0) for p in prompts]

    def draws(rows):  # each row's draw when the rows draw in this order from one seeded generator
        gen = torch.Generator().manual_seed(5)
        return dict((b, int(sample(probs[b], gen))) for b in rows)

    want = [draws(range(len(prompts)))[b] for b in range(len(prompts))]
    assert want != [draws(order)[b] for b in range(len(prompts))]  # the order matters: the test can fail
    got = Engine(v).generate(prompts, GenerationConfig(max_new_tokens=1, temperature=3.0, seed=5))
    assert [r.token_ids[0] for r in got] == want


def test_acceptance_rules_by_hand():
    n, nxt = greedy_accept(torch.tensor([[4, 5, 6], [4, 9, 6]]), torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7]]))
    assert n.tolist() == [3, 1] and nxt.tolist() == [7, 5]
    # q == p: everything is accepted; p puts no mass on the draft: rejected, residual = p
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    n, nxt = rejection_accept(torch.tensor([[1]]), q, p)
    assert n.tolist() == [1] and nxt.tolist() == [2]
    q2 = torch.tensor([[[1.0, 0.0, 0.0]]])
    n, nxt = rejection_accept(torch.tensor([[0]]), q2, p)
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_sampling_rule_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert process_logits(logits, 0.0).tolist() == [1.0, 0.0, 0.0, 0.0]
    p = process_logits(logits, 1.0, top_k=2)
    assert p[2:].sum() == 0 and abs(float(p.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)
    p = process_logits(logits, 1.0, top_p=float(full[0]) + 1e-3)  # needs the 2nd token to reach top_p
    assert (p > 0).tolist() == [True, True, False, False]


def test_speedup_is_the_median_of_the_paired_repeats():
    from paradraft.bench.metrics import median_speedup, speedup_per_repeat

    def runs(tps):
        return [{"tokens": 120, "wall_s": 120 / t} for t in tps]
    plain, spec = runs([10.0, 20.0, 12.0]), runs([15.0, 21.0, 13.0])  # repeat 1 ran plain decoding in a slow phase
    per = speedup_per_repeat(spec, plain)
    assert [round(x, 3) for x in per] == [1.5, 1.05, 1.083]
    assert abs(median_speedup(per) - 13 / 12) < 1e-9  # not 15 / 12, the ratio of the medians (higher than 2 of 3)
    assert median_speedup(speedup_per_repeat(plain, plain)) == 1.0


def test_bench_table_and_plot_keep_same_named_drafters_apart(tmp_path):
    from paradraft.bench.run import drafter_labels, format_table, plot_results

    row = dict(acceptance_length=1.5, tokens_per_s=10.0, speedup=1.2, draft_fraction=0.1,
               per_position_acceptance=[0.5, 0.2])
    out = {"dataset": "d", "num_prompts": 1, "max_new_tokens": 4, "temperature": 0.0, "dtype": "float32",
           "verifier": "v", "results": [dict(row, method="plain", drafter=None, k=0, per_position_acceptance=[],
                                             draft_fraction=None),
                                        dict(row, method="peagle", drafter="runs/a/peagle", k=2),
                                        dict(row, method="peagle", drafter="runs/b/peagle", k=2),
                                        dict(row, method="eagle3", drafter="runs/a/eagle3", k=2)]}
    assert drafter_labels(out) == {"runs/a/peagle": "a/peagle", "runs/b/peagle": "b/peagle",
                                   "runs/a/eagle3": "a/eagle3"}
    table = format_table(out)
    assert "| a/peagle |" in table and "| b/peagle |" in table
    assert plot_results(out, tmp_path / "p.png").stat().st_size > 0


@pytest.mark.e2e
@pytest.mark.parametrize("flavour", ["llama", "qwen3"])
def test_compiled_engine_writes_the_eager_engines_tokens(flavour):
    """The compiled decoding and verification steps (Engine(compile=True), `--compile on`) change no float32 token:
    plain decoding equals the eager engine and HF generate; P-EAGLE at K=3 (4 rows verified) equals plain decoding;
    one row and several, rows finishing apart (the compiled step then serves a subset of the cache's rows);
    Qwen3's q/k norms; the compiled drafting pass drafts the eager one's drafts. Compilation is recorded in
    compile_s."""
    from torch._dynamo.utils import counters

    v = make_tiny_llama(vocab_size=120, qwen3=(flavour == "qwen3"), seed=1)
    d, _ = tiny_drafter("peagle", flavour, verifier=v)
    prompts = prompts_for(120, n=6)
    counters.clear()
    eager = gen(Engine(v), prompts, 3, GenerationConfig(max_new_tokens=24))
    counts = torch.bincount(torch.tensor([t for r in eager for t in r.token_ids[4:]]), minlength=120)
    g = GenerationConfig(max_new_tokens=24, num_speculative_tokens=3, eos_token_ids=[int(counts.argmax())])
    ref = gen(Engine(v), prompts, 3, g)
    lengths = {len(r.token_ids) for r in ref}
    assert len(lengths) > 1  # rows end apart: the stop token cuts some early
    plain, spec = Engine(v, compile=True), Engine(v, d, compile=True)
    assert plain.compiled and spec.compiled
    for bs in (1, 3):
        assert [r.token_ids for r in gen(plain, prompts, bs, g)] == [r.token_ids for r in ref]
        out = gen(spec, prompts, bs, g)
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]
        # the compiled drafting pass (P-EAGLE's compile_rows) drafts what the eager one drafts
        assert [r.accepted_per_pass for r in out] == [r.accepted_per_pass for r in gen(Engine(v, d), prompts, bs, g)]
    assert plain.compile_s > 0 and spec.compile_s > 0 and d.compile_s > 0
    assert not counters["graph_break"], dict(counters["graph_break"])  # every step one graph per layer group
    for p, r in zip(prompts[:3], gen(plain, prompts[:3], 1, GenerationConfig(max_new_tokens=24))):
        ids = torch.tensor([p])
        hf = v.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                        do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.token_ids == hf
