"""Data preparation: loss masks on real template shapes, bad input, atomic writes, vocab, config, regenerate."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest
import torch

from helpers import make_tiny_llama, make_tokenizer, send_json
from paradraft.config import ConfigError, PrepareConfig, RegenerateConfig, build_config
from paradraft.data.prepare import DatasetExistsError, PreparedDataset, prepare, preview
from paradraft.data.template import TemplateError, segment_conversation, template_info, tokenize_segments
from paradraft.data.vocab import VocabError, build_vocab, draft_to_target_ids, template_special_ids
from paradraft.regenerate import LocalGenerator, regenerate


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def encode(tok, messages, last_turn_only=False):
    segs = segment_conversation(tok, template_info(tok), messages)
    (ids, mask), = tokenize_segments(tok, [segs], last_turn_only)
    return ids, mask


CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You are welcome."},
]


def test_chatml_mask_is_exactly_assistant_content_and_end_of_turn():
    tok = make_tokenizer("chatml")
    ids, mask = encode(tok, CONV)
    assert masked_runs(tok, ids, mask) == ["The capital of France is Paris.<|im_end|>", "You are welcome.<|im_end|>"]
    # everything unmasked is template or user text, and re-joins to the rendered conversation
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)
    ids, mask = encode(tok, CONV, last_turn_only=True)
    assert masked_runs(tok, ids, mask) == ["You are welcome.<|im_end|>"]


def test_truncated_answer_keeps_its_end_of_turn_as_context_only():
    tok = make_tokenizer("chatml")
    conv = [dict(m) for m in CONV]
    conv[1]["truncated"] = True  # cut at the length limit by `regenerate`
    ids, mask = encode(tok, conv)
    assert masked_runs(tok, ids, mask) == ["The capital of France is Paris.", "You are welcome.<|im_end|>"]
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)  # the same tokens, fewer targets


def test_llama3_mask():
    tok = make_tokenizer("llama3")
    conv = [{"role": "system", "content": "Be brief."}] + CONV
    ids, mask = encode(tok, conv)
    assert masked_runs(tok, ids, mask) == ["The capital of France is Paris.<|eot_id|>", "You are welcome.<|eot_id|>"]
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>") and mask[0] == 0


def test_qwen3_think_blocks_masked_where_rendered():
    tok = make_tokenizer("qwen3")
    conv = [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 5."},
        {"role": "user", "content": "And 2 and 2?"},
        {"role": "assistant", "content": "<think>\nstep by step\n</think>\n\nIt is 4."},
    ]
    ids, mask = encode(tok, conv)
    # the template drops the first turn's thinking; the last turn's thinking is rendered, so it is trained
    assert masked_runs(tok, ids, mask) == ["It is 5.<|im_end|>",
                                           "<think>\nstep by step\n</think>\n\nIt is 4.<|im_end|>"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def good(i, answer="Paris is the capital."):
    return {"id": f"g{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                        {"role": "assistant", "content": answer}]}


def test_bad_input_is_counted_by_reason(tmp_path, capsys):
    tok = make_tokenizer("chatml")
    src = write_jsonl(tmp_path / "mixed.jsonl", [
        good(0), good(1), good(2),
        "{not json",
        {"id": "x", "messages": "nope"},
        {"id": "r", "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"id": "n", "messages": [{"role": "user", "content": "only a question"}]},
        {"id": "e", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        {"id": "long", "messages": [{"role": "user", "content": "word " * 200},
                                    {"role": "assistant", "content": "short"}]},
        {"id": "sg", "conversations": [{"from": "human", "value": "ShareGPT style?"},
                                       {"from": "gpt", "value": "Yes, that works."}]},
    ])
    m = prepare(PrepareConfig(data=[str(src)], output=str(tmp_path / "out"), seq_length=64, val_fraction=0.25),
                tokenizer=tok)
    assert m["skipped"] == {"malformed_json": 1, "malformed_record": 1, "unknown_role": 1, "no_assistant_turn": 1,
                            "empty_assistant_content": 1, "empty_loss_mask_after_truncation": 1}
    assert m["num_samples"] == 4 and m["num_val"] == 1 and m["num_train"] == 3
    out = capsys.readouterr().out
    assert "skipped:" in out and "unknown_role=1" in out
    ds = PreparedDataset(tmp_path / "out")
    assert len(ds) == 4 and sorted(ds.sample_ids) == ["mixed:g0", "mixed:g1", "mixed:g2", "mixed:sg"]
    ids, mask = ds.sample(0)
    assert m["num_tokens"] == int(ds.offsets[-1]) and m["num_loss_tokens"] == int(ds.loss_mask.sum())
    assert ds.token_freqs().sum() == sum(int(ds.sample(i)[1].sum()) for i in ds.indices("train"))


def test_sharegpt_json_array_cut_off_midway(tmp_path):
    tok = make_tokenizer("chatml")
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": f"A{i}."}]}
            for i in range(5)]
    text = json.dumps(recs, indent=1)
    cut = text[: text.index('"id": "4"') + 12]  # the file ends in the middle of the 5th record
    (tmp_path / "sg.json").write_text(cut)
    m = prepare(PrepareConfig(data=[str(tmp_path / "sg.json")], output=str(tmp_path / "o"), val_fraction=0),
                tokenizer=tok)
    assert m["num_samples"] == 4 and m["skipped"] == {"truncated_record": 1}


def test_datasets_directory_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = make_tokenizer("chatml")
    datasets.Dataset.from_list([good(i) for i in range(6)]).save_to_disk(str(tmp_path / "hfds"))
    m = prepare(PrepareConfig(data=[str(tmp_path / "hfds")], output=str(tmp_path / "o"), val_fraction=0),
                tokenizer=tok)
    assert m["num_samples"] == 6


def test_no_chat_template_is_a_clear_error_unless_given(tmp_path):
    tok = make_tokenizer("chatml")
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(3)])
    (tmp_path / "t.jinja").write_text(tok.chat_template)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="--chat-template"):
        prepare(PrepareConfig(data=[str(src)], output=str(tmp_path / "o")), tokenizer=tok)
    m = prepare(PrepareConfig(data=[str(src)], output=str(tmp_path / "o"), chat_template=str(tmp_path / "t.jinja"),
                              val_fraction=0), tokenizer=tok)
    assert m["num_samples"] == 3


def test_output_dir_with_other_dataset_refused_and_same_reused(tmp_path):
    tok = make_tokenizer("chatml")
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(5)])
    cfg = PrepareConfig(data=[str(src)], output=str(tmp_path / "o"), val_fraction=0)
    prepare(cfg, tokenizer=tok)
    stamp = (tmp_path / "o" / "input_ids.npy").stat().st_mtime_ns
    prepare(cfg, tokenizer=tok)  # same dataset: reused, not rewritten
    assert (tmp_path / "o" / "input_ids.npy").stat().st_mtime_ns == stamp
    other = PrepareConfig(data=[str(src)], output=str(tmp_path / "o"), val_fraction=0.2)
    with pytest.raises(DatasetExistsError, match="--overwrite"):
        prepare(other, tokenizer=tok)
    other.overwrite = True
    assert prepare(other, tokenizer=tok)["num_val"] == 1


def test_killed_write_leaves_no_dataset(tmp_path, monkeypatch):
    tok = make_tokenizer("chatml")
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(5)])
    calls = {"n": 0}
    real_save = np.save

    def dying_save(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the run is killed half-way through writing
        return real_save(*a, **k)

    monkeypatch.setattr(np, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(data=[str(src)], output=str(tmp_path / "o")), tokenizer=tok)
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_preview_brackets_the_trained_text(tmp_path, capsys):
    import io

    tok = make_tokenizer("chatml")
    src = write_jsonl(tmp_path / "d.jsonl", [good(0, "Hello there.")])
    prepare(PrepareConfig(data=[str(src)], output=str(tmp_path / "o"), val_fraction=0), tokenizer=tok)
    buf = io.StringIO()
    preview(tmp_path / "o", tok, 1, stream=buf)
    assert "[[Hello there.<|im_end|>]]" in buf.getvalue()
    assert "[[<|im_start|>" not in buf.getvalue()


def test_vocab_offsets_specials_and_errors():
    freqs = np.zeros(50, dtype=np.int64)
    freqs[[5, 7, 9, 30]] = [10, 3, 8, 1]
    d2t, t2d = build_vocab(freqs, 3, 50, always=[2])
    ids = draft_to_target_ids(d2t)
    assert ids.tolist() == [2, 5, 9]  # special first, then the most frequent, ascending target order
    assert t2d.sum() == 3 and t2d[ids].all()
    with pytest.raises(VocabError, match="--fill"):
        build_vocab(freqs, 10, 50)
    d2t, t2d = build_vocab(freqs, 10, 50, fill=True)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 30]


def test_template_special_ids_include_end_of_turn():
    tok = make_tokenizer("chatml")
    ids = template_special_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.convert_tokens_to_ids("<|im_start|>") in ids


def test_config_yaml_then_flags(tmp_path):
    (tmp_path / "c.yaml").write_text("seq-length: 128\nseed: 3\ndata: [a.jsonl, b.jsonl]\n")
    cfg = build_config(PrepareConfig, tmp_path / "c.yaml", {"seed": 9, "output": None})
    assert (cfg.seq_length, cfg.seed, cfg.data, cfg.output) == (128, 9, ["a.jsonl", "b.jsonl"], "runs/data")
    (tmp_path / "bad.yaml").write_text("seq_lenght: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'seq_lenght' in .*bad.yaml; did you mean 'seq_length'\?"):
        build_config(PrepareConfig, tmp_path / "bad.yaml")
    # overrides follow the same rule (recipes and library callers pass them): a misspelt key is named, not dropped
    with pytest.raises(ConfigError, match="unknown key 'sede' for PrepareConfig; did you mean 'seed'"):
        build_config(PrepareConfig, None, {"sede": 1})
    with pytest.raises(ConfigError, match="unknown key 'zzz' for PrepareConfig; known keys: chat_template, data"):
        build_config(PrepareConfig, None, {"zzz": 1})


def test_cli_reports_errors_cleanly(tmp_path, capsys):
    from paradraft.cli import main

    assert main(["prepare", "--data", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o"),
                 "--verifier", str(tmp_path)]) == 1
    assert "error:" in capsys.readouterr().err


class _ChatServer(BaseHTTPRequestHandler):
    """A small real OpenAI-compatible chat server: answers with a deterministic function of the prompt."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _ChatServer.seen.append(body)
        last = body["messages"][-1]["content"]
        reply = {"choices": [{"message": {"role": "assistant", "content": f"echo: {last}"},
                              "finish_reason": "length" if "3" in last else "stop"}]}
        send_json(self, reply)

    def log_message(self, *a):
        pass


def test_regenerate_endpoint_resumes(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(6)])
    server = HTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        out = tmp_path / "regen.jsonl"
        cfg = RegenerateConfig(data=[str(src)], output=str(out), endpoint=url, max_samples=4, batch_size=2,
                               model_name="m")
        r1 = regenerate(cfg)
        with open(out, "a") as fh:
            fh.write('{"id": "torn')  # a killed run's half line
        cfg.max_samples = 6
        r2 = regenerate(cfg)
    finally:
        server.shutdown()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert r1["written"] == 4 and r2["written"] == 2 and r2["already_done"] == 4
    assert len({x["id"] for x in lines}) == 6 == len(lines)
    assert all(x["messages"][-1]["content"] == "echo: " + x["messages"][-2]["content"] for x in lines)
    assert _ChatServer.seen[0]["model"] == "m" and _ChatServer.seen[0]["max_tokens"] == cfg.max_new_tokens
    # finish_reason "length" marks the answer truncated
    assert [x["messages"][-1].get("truncated", False) for x in lines] == ["3" in x["id"] for x in lines]
    # the output is prepare's input format
    m = prepare(PrepareConfig(data=[str(out)], output=str(tmp_path / "p"), val_fraction=0),
                tokenizer=make_tokenizer("chatml"))
    assert m["num_samples"] == 6


@pytest.mark.slow
def test_regenerate_compiles_its_batch_before_the_answers():
    """--compile on with a batch past the kernel's rows (17+): the generator compiles the step its batches take when
    it starts, so the first batch's answers compile nothing (warmed with 2 rows, a batch of 18 compiled its own graph
    inside the timed generation: ~5 s of a batch of 32 on the embedded verifier)."""
    from paradraft.utils import graphs_compiled

    tok = make_tokenizer("chatml")
    model = make_tiny_llama(vocab_size=len(tok))
    cfg = RegenerateConfig(data=["unused"], output="unused.jsonl", max_new_tokens=4, batch_size=18, compile="on")
    gen = LocalGenerator(cfg, model=model, tokenizer=tok)
    assert gen.engine.compile_s > 0
    before = graphs_compiled()
    answers = gen([[{"role": "user", "content": f"Question {i}?" + " more" * i}] for i in range(18)])
    assert len(answers) == 18 and graphs_compiled() == before


@pytest.mark.e2e
def test_regenerate_compiled_writes_the_eager_answers(tmp_path):
    """--compile on: the engine's steps compile when the generator starts (as vLLM's engine does), before the
    answers are timed; compile_s records it; the answers are the eager engine's (float32), a batch of 2 and the
    last batch of 1 (compiled during the run) alike."""
    tok = make_tokenizer("chatml")
    model = make_tiny_llama(vocab_size=len(tok))
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(3)])
    answers, results = {}, {}
    for mode in ("off", "on"):
        cfg = RegenerateConfig(data=[str(src)], output=str(tmp_path / f"{mode}.jsonl"), max_new_tokens=6,
                               batch_size=2, compile=mode)
        gen = LocalGenerator(cfg, model=model, tokenizer=tok)
        assert gen.engine.compiled == (mode == "on")
        if mode == "on":
            assert gen.engine.compile_s > 0  # compiled when it started, before any answer
        results[mode] = regenerate(cfg, generator=gen)
        answers[mode] = [json.loads(x)["messages"] for x in (tmp_path / f"{mode}.jsonl").read_text().splitlines()]
    assert answers["on"] == answers["off"] and results["on"]["written"] == 3
    assert results["on"]["compile_s"] > 0 and "compile_s" not in results["off"]


def test_regenerate_local_model_batched(tmp_path):
    tok = make_tokenizer("chatml")
    model = make_tiny_llama(vocab_size=len(tok))
    src = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(3)])
    cfg = RegenerateConfig(data=[str(src)], output=str(tmp_path / "r.jsonl"), max_new_tokens=5, batch_size=2)
    gen = LocalGenerator(cfg, model=model, tokenizer=tok)
    r = regenerate(cfg, generator=gen)
    assert r["written"] == 3
    # a random model does not stop within 5 tokens: every answer is marked truncated, and prepare trains none of
    # their end-of-turn tokens
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert r["truncated"] == 3 and all(x["messages"][-1].get("truncated") is True for x in lines)
    prepare(PrepareConfig(data=[str(tmp_path / "r.jsonl")], output=str(tmp_path / "p"), val_fraction=0), tokenizer=tok)
    ds = PreparedDataset(tmp_path / "p")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for i in range(len(ds)):
        ids, mask = ds.sample(i)
        assert eot in ids.tolist() and not mask[ids == eot].any()
    # batched answers equal unbatched ones (left padding is handled)
    one = gen([[{"role": "user", "content": "Question 1?"}]])[0]
    two = gen([[{"role": "user", "content": "Question 1?"}],
               [{"role": "user", "content": "A much longer question, 2?"}]])
    assert two[0] == one
    torch.manual_seed(0)
