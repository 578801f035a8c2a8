"""Long conversations and reasoning traces: prepare keeps a long conversation as several samples (and reassembles
ShareGPT's parts), regenerate answers every user turn on its own earlier answers and keeps or drops a thinking
block, bench reports acceptance by prompt length."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from helpers import QWEN3, make_tokenizer, save_tiny_verifier, send_json
from paradraft.bench.run import acceptance_by_context, context_bucket, format_table
from paradraft.cli import main
from paradraft.config import PrepareConfig
from paradraft.data.prepare import PreparedDataset, prepare, split_long
from paradraft.data.sources import join_parts

# Qwen3's generation prompt: enable_thinking=false opens the turn with an empty thinking block
QWEN3_THINKING = QWEN3.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _conv(cid, turns, words=12):
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t} of {cid}: what is the capital of France?"})
        msgs.append({"role": "assistant", "content": " ".join(["Paris is the capital."] * words) + f" turn {t}"})
    return {"id": cid, "messages": msgs}


# ------------------------------------------------------------------------------------------------ prepare

def test_split_long_trains_every_token_once_in_windows_that_fit():
    ids = list(range(100))
    mask = [0] * 10 + [1] * 20 + [0] * 10 + [1] * 30 + [0] * 5 + [1] * 25
    trained = [i for i, m in zip(ids, mask) if m]
    for L in (16, 30, 40, 64, 99):
        windows = split_long(ids, mask, L)
        assert all(len(w) <= L and len(w) == len(m) for w, m in windows)
        got = sorted(t for w, m in windows for t, x in zip(w, m) if x)
        assert got == trained, L  # every assistant token once
        for w, m in windows:  # a window is a contiguous slice with the context before its new tokens
            assert w == list(range(w[0], w[0] + len(w)))
            first = m.index(1)
            assert not any(m[:first]) and all(mask[w[0] + j] for j, x in enumerate(m) if x)
    # where a turn's end fits, the window ends there; it carries as much context as fits
    assert [(w[0], w[-1] + 1) for w, _ in split_long(ids, mask, 64)] == [(0, 30), (6, 70), (36, 100)]
    assert split_long(ids, mask, 100) == [(ids, mask)]


def test_prepare_keeps_long_conversations_as_several_samples(tmp_path):
    tok = make_tokenizer("chatml")
    src = _write(tmp_path / "d.jsonl", [_conv(f"c{i}", turns=6) for i in range(6)] +
                 [_conv(f"s{i}", turns=1, words=2) for i in range(6)])
    base = dict(data=[str(src)], verifier="tiny", seq_length=160, val_fraction=0.3)
    cut = prepare(PrepareConfig(output=str(tmp_path / "cut"), **base), tokenizer=tok)
    kept = prepare(PrepareConfig(output=str(tmp_path / "split"), long_conversations="split", **base), tokenizer=tok)
    assert cut["num_samples"] == 12 and kept["num_samples"] > 12
    assert kept["num_loss_tokens"] > 2 * cut["num_loss_tokens"]
    assert kept["long_conversations"]["conversations_split"] == 6
    ds = PreparedDataset(tmp_path / "split")
    ids = ds.sample_ids
    assert all(len(ds.sample(i)[0]) <= 160 for i in range(len(ds)))
    # a conversation's windows stay together in one split
    conv = [x.split("#")[0] for x in ids]
    splits = {}
    for c, sp in zip(conv, ds.split.tolist()):
        splits.setdefault(c, set()).add(sp)
    assert all(len(s) == 1 for s in splits.values()) and 1 in ds.split
    # the whole conversation's assistant tokens are trained: as many as prepared without a length limit
    whole = prepare(PrepareConfig(output=str(tmp_path / "whole"), **{**base, "seq_length": 100_000}), tokenizer=tok)
    assert kept["num_loss_tokens"] == whole["num_loss_tokens"]
    # the default (truncate) identity is the one datasets prepared before the option had: they are reused
    assert "long_conversations" not in cut["identity"] and kept["identity"]["long_conversations"] == "split"
    # bench's held-out prompts: up to the first assistant turn, or the whole context up to the last one
    from paradraft.bench.run import load_prompts

    whole_ds = PreparedDataset(tmp_path / "whole")
    first = load_prompts("sharegpt-val", 50, tok, str(tmp_path / "whole"))
    last = load_prompts("sharegpt-val", 50, tok, str(tmp_path / "whole"), val_context="last")
    val = [i for i in range(len(whole_ds)) if whole_ds.split[i]]
    assert len(first) == len(last) == len(val) and any(len(b) > len(a) for a, b in zip(first, last))
    for i, a, b in zip(val, first, last):
        ids, mask = whole_ds.sample(i)
        assert ids[:len(b)].tolist() == b and b[:len(a)] == a  # a prefix of the sample, the first prompt's too
        rest = mask[len(b):]
        assert rest[0] and not mask[len(b) - 1] and not (rest[1:] & ~rest[:-1]).any()  # the last assistant turn


def test_join_parts_reassembles_sharegpt_parts_in_suffix_order(tmp_path):
    parts = [{"id": "abc_1", "messages": [{"role": "user", "content": "second question"},
                                          {"role": "assistant", "content": "second answer"}]},
             {"id": "solo", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
             {"id": "abc_0", "messages": [{"role": "user", "content": "first question"},
                                          {"role": "assistant", "content": "first answer"}]},
             {"id": "abc_10", "messages": [{"role": "assistant", "content": "more of the second answer"}]}]
    out = list(join_parts(parts))
    assert [o["id"] for o in out] == ["abc", "solo"]
    assert [m["content"] for m in out[0]["messages"]] == [
        "first question", "first answer", "second question", "second answer\n\nmore of the second answer"]
    assert out[0]["parts"] == 3
    # through the CLI: prepare --join-parts --long-conversations split
    src = _write(tmp_path / "p.jsonl", parts)
    tokdir = save_tiny_verifier(tmp_path)
    rc = main(["prepare", "--data", str(src), "-o", str(tmp_path / "data"), "--verifier", str(tokdir),
               "--join-parts", "--long-conversations", "split", "--seq-length", "24", "--val-fraction", "0"])
    assert rc == 0
    m = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert m["identity"]["join_parts"] is True and m["long_conversations"]["conversations"] == 2


# ------------------------------------------------------------------------------------------------ regenerate

class _ThinkingServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible server of a reasoning model: thinks unless enable_thinking is false, and returns the
    thinking apart (`reasoning_content`), as vLLM's reasoning parser does."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _ThinkingServer.seen.append(body)
        turn = sum(m["role"] == "user" for m in body["messages"])
        think = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        msg = {"role": "assistant", "content": f"Answer {turn}."}
        if think:
            msg["reasoning_content"] = f"Let me think about question {turn}."
        send_json(self, {"choices": [{"message": msg, "finish_reason": "stop"}]})

    def log_message(self, *a):
        pass


@pytest.fixture
def thinking_server():
    server = HTTPServer(("127.0.0.1", 0), _ThinkingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _ThinkingServer.seen = []
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


def _qwen3_thinking_verifier(tmp_path):
    """A tiny verifier directory whose tokenizer renders Qwen3's thinking switch."""
    path = save_tiny_verifier(tmp_path, kind="qwen3", qwen3=True)
    tok = make_tokenizer("qwen3")
    tok.chat_template = QWEN3_THINKING
    tok.save_pretrained(path)
    return path, tok


def test_regenerate_multi_turn_keeps_or_drops_the_thinking_through_the_cli(tmp_path, thinking_server, capsys):
    vdir, tok = _qwen3_thinking_verifier(tmp_path)
    src = _write(tmp_path / "d.jsonl", [_conv(f"c{i}", turns=3, words=2) for i in range(2)])
    outs = {}
    for mode in ("keep", "drop"):
        out = tmp_path / f"{mode}.jsonl"
        rc = main(["regenerate", "--data", str(src), "-o", str(out), "--verifier", str(vdir), "--endpoint",
                   thinking_server, "--max-turns", "3", "--reasoning", mode])
        assert rc == 0, capsys.readouterr().err
        outs[mode] = [json.loads(x) for x in out.read_text().splitlines()]
    # every user turn answered, in order, each request holding the verifier's own earlier answers
    keep = outs["keep"][0]["messages"]
    assert [m["role"] for m in keep] == ["user", "assistant"] * 3
    assert keep[1]["content"] == "<think>\nLet me think about question 1.\n</think>\n\nAnswer 1."
    assert keep[5]["content"].endswith("Answer 3.")
    third = [b for b in _ThinkingServer.seen if sum(m["role"] == "user" for m in b["messages"]) == 3][0]
    assert third["messages"][1]["content"].endswith("Answer 1.") and third["messages"][3]["content"].endswith(
        "Answer 2.")
    assert all(m["content"].startswith("Answer") for m in outs["drop"][0]["messages"] if m["role"] == "assistant")
    assert {b["chat_template_kwargs"]["enable_thinking"] for b in _ThinkingServer.seen} == {True, False}
    # the kept thinking is trained: prepare masks the last turn's thinking block as assistant text
    prepare(PrepareConfig(data=[str(tmp_path / "keep.jsonl")], output=str(tmp_path / "p"), val_fraction=0,
                          verifier="tiny"), tokenizer=tok)
    ids, mask = PreparedDataset(tmp_path / "p").sample(0)
    trained = tok.decode(ids[mask.astype(bool)].tolist())
    assert "Let me think about question 3." in trained and "Answer 3." in trained
    # a template without a thinking switch: one line naming the flag
    plain = save_tiny_verifier(tmp_path)
    capsys.readouterr()
    rc = main(["regenerate", "--data", str(src), "-o", str(tmp_path / "x.jsonl"), "--verifier", str(plain),
               "--endpoint", thinking_server, "--reasoning", "drop"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "--reasoning drop" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_local_generator_prompts_follow_the_thinking_switch():
    from paradraft.regenerate import answer_decoder, prompt_ids

    tok = make_tokenizer("qwen3")
    tok.chat_template = QWEN3_THINKING
    conv = [[{"role": "user", "content": "Hello?"}]]
    keep, drop, default = (prompt_ids(tok, conv, 512, r)[0] for r in ("keep", "drop", None))
    assert keep == default and tok.decode(drop[len(keep):]) == "<think>\n\n</think>\n\n"
    # the thinking block's tags survive decoding; other special tokens do not
    ids = tok("<think>\nhm\n</think>\n\nyes<|im_end|>", add_special_tokens=False)["input_ids"]
    assert answer_decoder(tok)(ids) == "<think>\nhm\n</think>\n\nyes"


# ------------------------------------------------------------------------------------------------ bench

def test_acceptance_by_context_buckets_prompts_by_their_tokens():
    assert [context_bucket(n) for n in (3, 600, 5000, 40000)] == ["0-511", "512-1023", "4096-8191", "32768+"]
    runs = [{"by_prompt": [[100, 10, 10], [5000, 30, 10]]}, {"by_prompt": [[100, 6, 10], [5000, 10, 10]]}]
    by = acceptance_by_context(runs)
    assert list(by) == ["0-511", "4096-8191"]
    assert by["0-511"] == {"prompts": 1, "passes": 20, "acceptance_length": pytest.approx(1.8)}
    assert by["4096-8191"]["acceptance_length"] == pytest.approx(3.0)
    out = {"dataset": "p.jsonl", "num_prompts": 2, "max_new_tokens": 8, "temperature": 0.0, "dtype": "float32",
           "results": [{"method": "plain", "drafter": None, "k": 0, "acceptance_length": 1.0, "tokens_per_s": 1.0,
                        "speedup": 1.0, "draft_fraction": None, "per_position_acceptance": None,
                        "acceptance_by_context": None},
                       {"method": "peagle", "drafter": "runs/d", "k": 3, "acceptance_length": 2.4,
                        "tokens_per_s": 2.0, "speedup": 1.5, "draft_fraction": 0.1,
                        "per_position_acceptance": [0.5, 0.3, 0.1], "acceptance_by_context": by}]}
    table = format_table(out)
    assert "acceptance length by prompt tokens" in table and "| peagle | d | 3 | 1.80 (1) | 3.00 (1) |" in table


def test_long_held_out_contexts_keep_their_last_tokens_that_fit_the_verifier():
    from types import SimpleNamespace

    from paradraft.bench.run import _prompt_room
    from paradraft.config import BenchConfig

    cfg = BenchConfig(val_context="last", max_new_tokens=64, num_speculative_tokens=[3, 5])
    assert _prompt_room(cfg, SimpleNamespace(max_position_embeddings=8192)) == 8192 - 64 - 5 - 16
    assert _prompt_room(BenchConfig(max_new_tokens=64, num_speculative_tokens=[3]),
                        SimpleNamespace(max_position_embeddings=8192)) is None  # first turns: as they are
    assert _prompt_room(cfg, SimpleNamespace()) is None
