"""The second hostile-user round (scripts/probe_hostile.py), one test per defect class it found:
single-file outputs that replaced a user's file, results that were wrong but reported as success, tracebacks for
errors a user causes (full disks, files handed in, configs, endpoints, devices), messages naming a flag the command
does not have, OpenAI-style records called malformed, and writers without a lock.

Everything runs through the real command line (`paradraft.cli.main`) on a tiny random verifier saved to disk.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import struct
import subprocess
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_tokenizer, save_tiny_verifier
from paradraft.cli import main
from paradraft.config import ConfigError, GenerateConfig, build_config
from paradraft.data.sources import normalize, read_source
from paradraft.outputs import output_lock


def cli(*argv) -> int:
    return main([str(a) for a in argv])


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc: int, err: str, *names) -> bool:
    """A user error: exit 1, one line `paradraft CMD: error: ...` (the last; progress bars may come before it)
    holding every name, no traceback."""
    lines = [ln for ln in err.strip().splitlines() if ": error:" in ln]
    return rc == 1 and len(lines) == 1 and err.strip().endswith(lines[0]) and "Traceback" not in err and \
        all(str(n) in lines[0] for n in names)


def jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def chats(n: int) -> list[dict]:
    return [{"id": str(i), "messages": [{"role": "user", "content": f"what is {i}?"},
                                        {"role": "assistant", "content": "Paris is the capital. " * (1 + i % 3)}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny verifier on disk, a prepared dataset, a 1-step P-EAGLE drafter and its export."""
    tmp = tmp_path_factory.mktemp("hostile")
    vdir = save_tiny_verifier(tmp, "chatml")
    src = jsonl(tmp / "d.jsonl", chats(24))
    assert cli("prepare", "--data", src, "-o", tmp / "data", "--verifier", vdir, "--val-fraction", "0.2") == 0
    assert cli("train", "--data", tmp / "data", "--online", "-o", tmp / "run", "--max-steps", "1",
                 "--num-depths", "2", "--draft-vocab-size", "64", "--batch-tokens", "200", "--autocast", "float32",
                 "--val-samples", "0") == 0
    assert cli("export", tmp / "run", "-o", tmp / "export", "--dtype", "float32") == 0
    return tmp, vdir


def gen_args(world, *extra):
    tmp, vdir = world
    return ["generate", "--verifier", vdir, "--prompt", "hi", "--max-new-tokens", "2", *extra]


def bench_args(world, *extra):
    tmp, vdir = world
    return ["bench", "--verifier", vdir, "--data", tmp / "data", "--num-prompts", "1", "--max-new-tokens", "2",
            "--repeats", "1", "--no-prompt-lookup", "--dtype", "float32", *extra]


# ------------------------------------------------------------------------------------ single-file outputs


def test_single_file_outputs_never_replace_a_users_file(world, tmp_path, capsys):
    tmp, vdir = world
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    weights = tmp_path / "model.safetensors"
    shutil.copy(tmp / "export" / "model.safetensors", weights)
    picture = tmp_path / "picture.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    link = tmp_path / "link.jsonl"
    os.symlink(notes, link)
    before = {p: p.read_bytes() for p in (notes, weights, picture)}
    cases = [
        (gen_args(world, "-o", notes), "--output"),
        (gen_args(world, "-o", link), "--output"),
        (bench_args(world, "-o", notes), "--output"),
        (bench_args(world, "-o", tmp_path / "b.json", "--plot", picture), "--plot"),
        (["vocab", "--data", tmp / "data", "--size", "32", "-o", weights], "--output"),
    ]
    for argv, flag in cases:
        rc, _, err = run(capsys, *argv)
        assert one_line(rc, err, flag), (argv, err)
    assert {p: p.read_bytes() for p in before} == before
    assert link.is_symlink()
    side = tmp_path / "v.json"  # the vocabulary's summary goes beside it: a user's file there is refused too
    side.write_text('{"mine": 1}')
    rc, _, err = run(capsys, "vocab", "--data", tmp / "data", "--size", "32", "-o", tmp_path / "v.safetensors")
    assert one_line(rc, err, "--output") and side.read_text() == '{"mine": 1}'
    assert not (tmp_path / "v.safetensors").exists()


def test_outputs_replace_their_own_files(world, tmp_path, capsys):
    tmp, vdir = world
    out, res, plot = tmp_path / "g.jsonl", tmp_path / "b.json", tmp_path / "b.png"
    vocab = tmp_path / "v.safetensors"
    for _ in range(2):  # the second run replaces what the first wrote
        assert run(capsys, *gen_args(world, "-o", out))[0] == 0
        assert run(capsys, *bench_args(world, "-o", res, "--plot", plot, "--drafter", tmp / "export",
                                       "--num-speculative-tokens", "2"))[0] == 0
        assert run(capsys, "vocab", "--data", tmp / "data", "--size", "32", "--fill", "-o", vocab)[0] == 0
    assert json.loads(out.read_text().splitlines()[0])["token_ids"]
    assert "results" in json.loads(res.read_text())
    assert set(load_file(str(vocab))) == {"d2t", "t2d"}


def test_every_single_file_writer_is_locked(world, tmp_path, capsys):
    tmp, vdir = world
    for argv, target in ((["vocab", "--data", tmp / "data", "--size", "32", "-o", tmp_path / "v.safetensors"],
                          tmp_path / "v.safetensors"),
                         (["export", tmp / "run", "-o", tmp_path / "e"], tmp_path / "e"),
                         (gen_args(world, "-o", tmp_path / "g.jsonl"), tmp_path / "g.jsonl"),
                         (bench_args(world, "-o", tmp_path / "b.json"), tmp_path / "b.json")):
        with output_lock(target, "--output"):  # another command is writing it now
            rc, _, err = run(capsys, *argv)
        assert one_line(rc, err, "another paradraft command"), (argv, err)
        assert not target.exists()


# ------------------------------------------------------------------------------------ silent wrong results


def test_a_diverged_drafter_is_never_saved_exported_or_loaded(world, tmp_path, capsys, monkeypatch):
    tmp, vdir = world
    import paradraft.train.trainer as trainer_mod

    build = trainer_mod.build_optimizer

    def diverging(model, cfg):  # an update that leaves a weight NaN while the loss before it was finite
        opt = build(model, cfg)
        step = opt.step

        def step_then_nan(*a, **kw):
            out = step(*a, **kw)
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))
            return out
        opt.step = step_then_nan
        return opt
    monkeypatch.setattr(trainer_mod, "build_optimizer", diverging)
    rc, _, err = run(capsys, "train", "--data", tmp / "data", "--online", "-o", tmp_path / "r", "--max-steps", "1",
                     "--num-depths", "2", "--draft-vocab-size", "64", "--batch-tokens", "200", "--autocast",
                     "float32", "--val-samples", "0", "--optimizer", "adamw")
    assert one_line(rc, err, "NaN or infinity", "step 1")
    assert not (tmp_path / "r" / "model.safetensors").exists()
    monkeypatch.undo()
    rc, _, err = run(capsys, "train", "--data", tmp / "data", "--online", "-o", tmp_path / "r2", "--lr", "1e39")
    assert one_line(rc, err, "--lr")
    bad = tmp_path / "nan"
    shutil.copytree(tmp / "export", bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["fc.weight"] = sd["fc.weight"] * float("nan")
    save_file(sd, str(bad / "model.safetensors"))
    for argv in (["export", bad, "-o", tmp_path / "out"], gen_args(world, "--drafter", bad),
                 bench_args(world, "--drafter", bad, "-o", tmp_path / "b.json")):
        rc, _, err = run(capsys, *argv)
        assert one_line(rc, err, "NaN"), (argv, err)
    assert not (tmp_path / "out").exists()


def test_config_values_keep_their_type(tmp_path, capsys):
    cases = {"max_new_tokens: 2.7": "--max-new-tokens", "max_new_tokens: true": "--max-new-tokens",
             "stream: 1": "--stream", "temperature: .inf": "--temperature", "top_p: .nan": "--top-p",
             "prompt: 5": "--prompt", "seed: [1]": "--seed"}
    for text, flag in cases.items():
        (tmp_path / "c.yaml").write_text(text + "\n")
        with pytest.raises(ConfigError, match=flag):
            build_config(GenerateConfig, tmp_path / "c.yaml", {"prompt": "hi"} if "prompt" not in text else {})
    (tmp_path / "c.yaml").write_text("max_new_tokens: '3'\nstream: yes\n")
    cfg = build_config(GenerateConfig, tmp_path / "c.yaml", {"prompt": "hi"})
    assert cfg.max_new_tokens == 3 and cfg.stream is True
    (tmp_path / "c.yaml").write_bytes(b"\xef\xbb\xbfmax_new_tokens: 4\n")  # a byte-order mark is not a key
    assert build_config(GenerateConfig, tmp_path / "c.yaml", {"prompt": "hi"}).max_new_tokens == 4
    for argv, flag in ((["generate", "--prompt", "hi", "--temperature", "inf"], "--temperature"),
                       (["generate", "--prompt", "hi", "--top-p", "nan"], "--top-p"),
                       (["generate", "--prompt", "", "--max-new-tokens", "2"], "--prompt"),
                       (["regenerate", "--endpoint", "", "-o", tmp_path / "r.jsonl"], "--endpoint"),
                       (["regenerate", "--endpoint", "localhost:8000", "-o", tmp_path / "r.jsonl"], "--endpoint"),
                       (["train", "--online", "--lr", "inf"], "--lr")):
        rc, _, err = run(capsys, *argv)
        assert one_line(rc, err, flag), (argv, err)


def test_byte_order_marks_and_openai_records(tmp_path):
    recs = chats(5)
    plain = jsonl(tmp_path / "a.jsonl", recs)
    bom = tmp_path / "b.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    arr = tmp_path / "c.json"
    arr.write_bytes(b"\xef\xbb\xbf" + json.dumps(recs).encode())
    counts = [sum(isinstance(x, dict) for x in read_source(str(p))) for p in (plain, bom, arr)]
    assert counts == [5, 5, 5]
    tool = {"messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."}]}
    conv = normalize(tool, "s", "0")
    assert conv["messages"] == [{"role": "user", "content": "weather in Paris?"},
                                {"role": "assistant", "content": "It is 18C."}]
    assert conv["tool_turns_left_out"] == 2
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    assert normalize(parts, "s", "0")["messages"] == [{"role": "user", "content": "Describe it."},
                                                       {"role": "assistant", "content": "A cat."}]
    assert normalize({"messages": [{"role": "user", "content": 5}]}, "s", "0").reason == "malformed_record"


# ------------------------------------------------------------------------------------ endpoints


@contextlib.contextmanager
def endpoint():
    """A local OpenAI-compatible server: /MODE/v1/chat/completions answers as MODE says."""
    def reply(content):
        return json.dumps({"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}).encode()

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            mode = self.path.strip("/").split("/")[0]
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            data = {"good": reply("An answer."), "empty": reply(""), "null": reply(None),
                    "html": b"<html><body>Welcome to nginx!</body></html>", "badjson": b'{"choices": ['}.get(mode)
            if mode == "hang":
                time.sleep(3)
                data = reply("late")
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # the client that gave up on "hang" closed its socket: the late answer's broken pipe is expected

    server = Server(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield lambda mode: f"http://127.0.0.1:{server.server_address[1]}/{mode}/v1"
    finally:
        # every request thread finished before the next test: the "hang" one, left behind, printed its broken pipe's
        # traceback later, and Python 3.11 builds a traceback's carets with ast.parse, whose state is shared between
        # threads: a later test's ast.parse (test_layering) then failed with "AST constructor recursion depth
        # mismatch"
        server.shutdown()
        server.server_close()


def test_endpoint_failures_are_one_line_and_empty_answers_never_finished(world, tmp_path, capsys):
    tmp, vdir = world
    args = ["regenerate", "--data", tmp / "d.jsonl", "--max-samples", "2", "--max-new-tokens", "4",
            "--verifier", vdir]
    with endpoint() as url:
        for mode, text in (("empty", "empty answer"), ("null", "empty answer"), ("html", "not JSON"),
                           ("badjson", "not JSON")):
            out = tmp_path / f"{mode}.jsonl"
            rc, _, err = run(capsys, *args, "--endpoint", url(mode), "--model-name", "m", "-o", out)
            assert one_line(rc, err, "--endpoint", text), (mode, err)
            assert not out.exists() or not out.read_text().strip(), mode
        rc, _, err = run(capsys, *args, "--endpoint", url("hang"), "--timeout", "1", "--model-name", "m",
                         "-o", tmp_path / "h.jsonl")
        assert one_line(rc, err, "--endpoint", "--timeout")
        mine = tmp_path / "mine.jsonl"
        assert run(capsys, *args, "--endpoint", url("good"), "--model-name", "model-a", "-o", mine,
                   "--max-samples", "1")[0] == 0
        assert json.loads(mine.read_text())["verifier"] == "model-a"
        before = mine.read_bytes()
        rc, _, err = run(capsys, *args, "--endpoint", url("good"), "--model-name", "model-b", "-o", mine)
        assert one_line(rc, err, "--output", "model-a") and mine.read_bytes() == before
        rc, _, err = run(capsys, *args, "-o", mine)  # the local verifier into the endpoint model's file
        assert one_line(rc, err, "--output") and mine.read_bytes() == before
        assert run(capsys, *args, "--endpoint", url("good"), "--model-name", "model-a", "-o", mine)[0] == 0


# ------------------------------------------------------------------------------------ files handed in


def test_files_handed_in_are_one_line(world, tmp_path, capsys):
    tmp, vdir = world
    prep = ["prepare", "--data", tmp / "d.jsonl", "-o", tmp_path / "d", "--verifier", vdir]
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    (tmp_path / "raise.jinja").write_text("{{ raise_exception('no') }}")
    for tpl in (tmp_path / "missing.jinja", tmp_path / "bad.jinja", tmp_path / "raise.jinja", tmp_path):
        rc, _, err = run(capsys, *prep, "--chat-template", tpl)
        assert one_line(rc, err, "--chat-template"), (tpl, err)
    (tmp_path / "c.yaml").write_text("max_new_tokens: [1, 2\n")
    rc, _, err = run(capsys, *gen_args(world, "--config", tmp_path / "c.yaml"))
    assert one_line(rc, err, "--config", "not valid YAML")
    damaged = {
        "manifest.json": lambda d: (d / "manifest.json").write_text("{oops"),
        "input_ids.npy": lambda d: (d / "input_ids.npy").write_bytes((d / "input_ids.npy").read_bytes()[:150]),
        "offsets.npy": lambda d: (d / "offsets.npy").unlink(),
    }
    for name, edit in damaged.items():
        ds = tmp_path / f"ds-{name}"
        shutil.copytree(tmp / "data", ds)
        edit(ds)
        for argv in (["vocab", "--data", ds, "--size", "16", "-o", tmp_path / "v.safetensors"],
                     ["train", "--data", ds, "--online", "-o", tmp_path / "r", "--max-steps", "1"]):
            rc, _, err = run(capsys, *argv)
            assert one_line(rc, err, ds), (name, argv[0], err)
    for edit in ({"draft_vocab_size": -3}, {"transformer_layer_config": {"hidden_size": "big"}},
                 {"transformer_layer_config": {"num_attention_heads": 0}}, {"mask_token_id": 10 ** 9}):
        d = tmp_path / "d-cfg"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(tmp / "export", d)
        cfg = json.loads((d / "config.json").read_text())
        for k, v in edit.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
        (d / "config.json").write_text(json.dumps(cfg))
        rc, _, err = run(capsys, *gen_args(world, "--drafter", d))
        assert one_line(rc, err, d, "config.json"), (edit, err)


def test_devices_are_checked(world, tmp_path, capsys):
    tmp, vdir = world
    devices = ["banana", "gpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])
    for dev in devices:
        for argv in (["train", "--data", tmp / "data", "--online", "-o", tmp_path / "r"],
                     ["extract", "--data", tmp / "data", "-o", tmp_path / "hs"]):
            rc, _, err = run(capsys, *argv, "--device", dev)
            assert one_line(rc, err, "--device"), (dev, err)
    assert not (tmp_path / "r").exists() and not (tmp_path / "hs").exists()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_is_one_line(world, tmp_path, capsys):
    tmp, vdir = world
    full = tmp_path / "full"
    if not _mount_tmpfs(full, "96k"):
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        for argv in (["export", tmp / "run", "-o", full / "e"],
                     ["prepare", "--data", tmp / "d.jsonl", "-o", full / "d", "--verifier", vdir],
                     ["vocab", "--data", tmp / "data", "--size", "64", "--fill", "-o", full / "v.safetensors"],
                     ["train", "--data", tmp / "data", "--online", "-o", full / "r", "--max-steps", "1",
                      "--num-depths", "2", "--draft-vocab-size", "64", "--batch-tokens", "200", "--autocast",
                      "float32", "--val-samples", "0"]):
            st = os.statvfs(full)  # the disk is full: room for an empty lock file (an inode), none for data
            (full / "filler").write_bytes(b"x" * (st.f_bavail * st.f_frsize))
            rc, _, err = run(capsys, *argv)
            assert one_line(rc, err, "No space left on device"), (argv[0], err)
            (full / "filler").unlink()
    finally:
        subprocess.run(["umount", str(full)], capture_output=True)


# ------------------------------------------------------------------------------------ messages


def test_errors_name_only_flags_the_command_has(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer("chatml")
    shallow = tmp_path / "shallow"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(shallow)
    tok.save_pretrained(shallow)
    jsonl(tmp_path / "d.jsonl", chats(6))
    assert cli("prepare", "--data", tmp_path / "d.jsonl", "-o", tmp_path / "d", "--verifier", shallow) == 0
    rc, _, err = run(capsys, "train", "--data", tmp_path / "d", "--online", "-o", tmp_path / "r", "--max-steps", "1")
    assert one_line(rc, err, "6-layer") and "(--layers)" not in err and "extract --layers" in err
    jsonl(tmp_path / "long.jsonl", [{"id": "x", "prompt": "what is " * 3000}])
    rc, _, err = run(capsys, "bench", "--verifier", shallow, "--dataset", tmp_path / "long.jsonl", "--num-prompts",
                     "1", "--max-new-tokens", "2", "--repeats", "1", "--no-prompt-lookup", "-o", tmp_path / "b.json")
    assert one_line(rc, err, "KV cache") and "--max-len" not in err


def test_a_plot_is_recognised_by_its_marker(tmp_path):
    from paradraft.outputs import claim_file, png_text

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    foreign = tmp_path / "a.png"
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
                        + chunk(b"tEXt", b"Software\x00GIMP") + chunk(b"IEND", b""))
    assert png_text(foreign) == {"Software": "GIMP"}
    with pytest.raises(Exception, match="--plot"):
        claim_file(foreign, "plot", "--plot")
    from paradraft.bench.run import plot_results

    ours = tmp_path / "b.png"
    plot_results({"verifier": "v", "dataset": "d", "temperature": 0, "results": [
        {"method": "peagle", "drafter": "x", "k": 2, "speedup": 1.1, "acceptance_length": 1.3}]}, ours)
    assert "paradraft" in png_text(ours)["Software"]
    assert claim_file(ours, "plot", "--plot") == ours
