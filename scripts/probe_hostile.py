"""The second hostile-user round: 150+ probes of every command through the real CLI, on a fresh clone.

Designed from the commands' `--help` and the README alone, as a user who has not read the code would try them.
Each probe runs `paradraft ...` in a subprocess on the embedded verifier (or a small one the script builds) and is
judged on what a user sees:
  data loss        a file or directory the user owns was changed or deleted
  silent wrong     exit 0 where the result is wrong (or the command should have refused), or a wrong file written
  traceback        a Python traceback (a user error must be one line; PARADRAFT_DEBUG=1 keeps tracebacks)
  unclear          an error that does not name the flag, file or host at fault, or names a flag the command lacks
  minor            anything else (a missing lock, a value that should have been refused)
Needs no `make demo`: it builds its own world (tiny data, a 2-step drafter) under runs/probes2/. Writes
runs/probes2/report.json and prints the totals by class; exit 1 if any probe is bad.

    python scripts/probe_hostile.py [--only SUBSTRING ...] [--list]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "probes2"
W = WORK / "world"
P = WORK / "probe"  # per-probe scratch, emptied before each probe
FULL = WORK / "full"  # a tiny tmpfs: a full disk
PARADRAFT = [sys.executable, "-m", "paradraft"]
CLASSES = ("data loss", "silent wrong", "traceback", "unclear", "minor")


def cli(*argv, env=None, timeout=900) -> tuple[int, str, str]:
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    e.pop("PARADRAFT_DEBUG", None)
    p = subprocess.run(PARADRAFT + [str(a) for a in argv], capture_output=True, text=True, env=e, cwd=ROOT,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


# ------------------------------------------------------------------------------------------------ the probes

@dataclass
class Probe:
    name: str
    argv: list
    expect: str = "error"  # "error": one line, exit 1; "ok": exit 0
    names: tuple = ()  # strings the error line must hold (the flag / path / host at fault)
    protect: list = field(default_factory=list)  # user paths that must survive byte for byte
    setup: callable = None
    check: callable = None  # extra check after the run: returns (class, reason) for a bad result, else None
    avoid: tuple = ()  # strings the error must NOT hold (a flag the command does not have)
    env: dict = None
    wrong_class: str = "silent wrong"  # what an exit 0 on an expected error counts as
    needs_mount: bool = False


def snap(paths) -> dict:
    out = {}
    for p in map(Path, paths):
        if p.is_symlink():
            out[str(p)] = ("link", os.readlink(p))
        elif p.is_dir():
            out[str(p)] = ("dir", {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()})
        elif p.is_file():
            out[str(p)] = ("file", p.read_bytes())
        else:
            out[str(p)] = ("absent", None)
    return out


def judge(pr: Probe, rc: int, out: str, err: str, before: dict) -> tuple[str | None, str]:
    """(None, '') when the probe passes, else (class, reason)."""
    after = snap(before)
    changed = [k for k in before if before[k] != after[k]]
    if changed:
        return "data loss", f"changed: {', '.join(changed)}"
    if "Traceback" in err or "Traceback" in out:
        return "traceback", err.strip().splitlines()[-1][:200] if err.strip() else "traceback on stdout"
    if pr.expect == "ok":
        if rc != 0:
            return "silent wrong" if rc == 0 else "minor", f"exit {rc}: {err.strip()[-200:]}"
    else:
        if rc == 0:
            return pr.wrong_class, "exit 0 where the command should refuse"
        lines = [ln for ln in err.strip().splitlines() if ": error:" in ln]
        if rc != 1 or len(lines) != 1:
            return "unclear", f"exit {rc}, {len(lines)} error lines: {err.strip()[-200:]}"
        missing = [n for n in pr.names if str(n) not in lines[0]]
        if missing:
            return "unclear", f"the error does not name {missing}: {lines[0][:200]}"
        bad = [a for a in pr.avoid if a in lines[0]]
        if bad:
            return "unclear", f"the error names {bad}, which this command does not have: {lines[0][:200]}"
    if pr.check is not None:
        res = pr.check()
        if res:
            return res
    return None, ""


# ------------------------------------------------------------------------------------------------ the world

def build_world() -> None:
    """Tiny real assets on the embedded verifier: data, vocabulary, a 2-step drafter, its export, bench results."""
    if (W / "done").is_file():
        return
    shutil.rmtree(W, ignore_errors=True)
    W.mkdir(parents=True)
    steps = [
        ["prepare", "--data", "chitchat", "--max-samples", "48", "--seq-length", "256", "--val-fraction", "0.2",
         "-o", W / "data"],
        ["vocab", "--data", W / "data", "--size", "512", "--fill", "-o", W / "vocab.safetensors"],
        ["extract", "--data", W / "data", "-o", W / "hs", "--max-samples", "8", "--samples-per-shard", "4"],
        ["train", "--data", W / "data", "--online", "-o", W / "run", "--max-steps", "2", "--num-depths", "3",
         "--vocab", W / "vocab.safetensors", "--batch-tokens", "512", "--val-samples", "4"],
        ["export", W / "run", "-o", W / "export"],
        ["generate", "--drafter", W / "run", "--prompt", "hi", "--max-new-tokens", "4", "-o", W / "gen.jsonl"],
        ["bench", "--drafter", W / "run", "--data", W / "data", "--num-prompts", "1", "--max-new-tokens", "4",
         "--repeats", "1", "--num-speculative-tokens", "2", "--no-prompt-lookup", "-o", W / "bench.json",
         "--plot", W / "bench.png"],
    ]
    for argv in steps:
        rc, out, err = cli(*argv)
        if rc != 0:
            raise SystemExit(f"world: {' '.join(map(str, argv))} failed:\n{err[-3000:]}")
    write_jsonl(W / "chat.jsonl", [{"id": str(i), "messages": [
        {"role": "user", "content": f"Question number {i}: what is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris. " * (1 + i % 3)}]} for i in range(12)])
    write_jsonl(W / "prompts.jsonl", [{"id": "a", "prompt": "Say hi."}])
    # a shallow verifier (6 layers) with the embedded tokenizer: too shallow for the default aux layers
    code = ("import sys; from transformers import LlamaConfig, LlamaForCausalLM; from paradraft.verifier import "
            "load_tokenizer; t = load_tokenizer('smollm2-135m'); m = LlamaForCausalLM(LlamaConfig(vocab_size=len(t), "
            "hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, "
            "num_key_value_heads=2)); m.save_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(W / "shallow")], check=True, cwd=ROOT)
    (W / "done").write_text("ok\n")


def write_jsonl(path: Path, recs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def user_file(path: Path, data: bytes = b"the user's own notes\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def png_bytes() -> bytes:
    """A valid 1x1 PNG that paradraft did not draw."""
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def copy_drafter(src: Path, dst: Path, edit_config=None, edit_weights=None) -> Path:
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg = edit_config(cfg)
        (dst / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    if edit_weights:
        from safetensors.torch import load_file, save_file
        sd = load_file(str(dst / "model.safetensors"))
        save_file(edit_weights(sd), str(dst / "model.safetensors"))
    return dst


def nan_weights(sd):
    k = next(k for k in sd if k.startswith("fc."))
    sd[k] = sd[k] * float("nan")
    return sd


def copy_data(dst: Path, edit=None) -> Path:
    shutil.copytree(W / "data", dst)
    if edit:
        edit(dst)
    return dst


def copy_hs(dst: Path, edit=None) -> Path:
    shutil.copytree(W / "hs", dst)
    if edit:
        edit(dst)
    return dst


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


# ------------------------------------------------------------------------------------------------ endpoint

class Endpoint:
    """A local OpenAI-compatible server with misbehaving modes: /MODE/v1/chat/completions."""

    def __init__(self):
        handler = self._handler()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}/v1"

    @staticmethod
    def _handler():
        def reply(content, finish="stop"):
            return json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                            "finish_reason": finish}]}).encode()

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                mode = self.path.strip("/").split("/")[0]
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                user = next((m["content"] for m in reversed(body.get("messages", [])) if m["role"] == "user"), "")
                status, ctype, data = 200, "application/json", None
                if mode == "good":
                    data = reply(f"An answer to: {user[:40]}")
                elif mode == "empty":
                    data = reply("")
                elif mode == "null":
                    data = reply(None)
                elif mode == "blank":
                    data = reply("   \n ")
                elif mode == "halfempty":
                    data = reply("" if "1" in user or "3" in user else "A fine answer.")
                elif mode == "html":
                    ctype, data = "text/html", b"<html><body><h1>Welcome to nginx!</h1></body></html>"
                elif mode == "badjson":
                    data = b'{"choices": [{"message": '
                elif mode == "nochoices":
                    data = json.dumps({"object": "error", "message": "model not found"}).encode()
                elif mode == "emptychoices":
                    data = json.dumps({"choices": []}).encode()
                elif mode == "number":
                    data = reply(42)
                elif mode == "parts":
                    data = reply([{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}])
                elif mode == "e500":
                    status, data = 500, b"Internal Server Error: CUDA out of memory"
                elif mode == "hang":
                    time.sleep(6)
                    data = reply("late")
                else:
                    status, data = 404, b"no such mode"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
        return H


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def held_lock(target: Path):
    """Hold paradraft's lock on `target`, as a second command running on it would."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def fill_disk() -> None:
    """Take every free byte of the tmpfs: room for an empty lock file (an inode), none for any data."""
    st = os.statvfs(FULL)
    user_file(FULL / "filler", b"x" * (st.f_bavail * st.f_frsize))


def mount_full() -> bool:
    FULL.mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", str(FULL)], capture_output=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(FULL)],
                          capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------------------ the list

def probes(ep: Endpoint) -> list[Probe]:
    out: list[Probe] = []
    add = out.append
    gen = ["generate", "--prompt", "hi", "--max-new-tokens", "2"]
    bench = ["bench", "--data", W / "data", "--num-prompts", "1", "--max-new-tokens", "2", "--repeats", "1",
             "--no-prompt-lookup"]
    regen = ["regenerate", "--data", W / "chat.jsonl", "--max-samples", "2", "--max-new-tokens", "4"]
    train_online = ["train", "--data", W / "data", "--online", "--max-steps", "1", "--num-depths", "2",
                    "--vocab", W / "vocab.safetensors", "--batch-tokens", "512", "--val-samples", "0"]

    # --- A. single-file outputs: never another's file --------------------------------------------------------
    file_outputs = [
        ("generate -o", gen + ["-o"], "--output"),
        ("bench -o", bench + ["-o"], "--output"),
        ("bench --plot", bench + ["-o", P / "b.json", "--plot"], "--plot"),
        ("vocab -o", ["vocab", "--data", W / "data", "--size", "64", "-o"], "--output"),
        ("regenerate -o", regen + ["--endpoint", ep.url("good"), "--model-name", "m", "-o"], "--output"),
    ]
    for label, argv, flag in file_outputs:
        ext = ".safetensors" if label.startswith("vocab") else (".png" if "plot" in label else ".jsonl")
        target = P / f"mine{ext}"
        add(Probe(f"{label} onto a user's text file", argv + [target], names=(flag, target), protect=[target],
                  setup=lambda t=target: user_file(t), wrong_class="data loss"))
        add(Probe(f"{label} onto a user's binary file", argv + [target], names=(flag,), protect=[target],
                  setup=lambda t=target: user_file(t, bytes(range(256)) * 8), wrong_class="data loss"))
        add(Probe(f"{label} through a symlink to a user's file", argv + [P / f"link{ext}"], names=(flag,),
                  protect=[P / "real.txt", P / f"link{ext}"],
                  setup=lambda e=ext: (user_file(P / "real.txt"), os.symlink(P / "real.txt", P / f"link{e}")),
                  wrong_class="data loss"))
        add(Probe(f"{label} onto a directory", argv + [P / "adir"], names=(flag,), protect=[P / "adir"],
                  setup=lambda: user_file(P / "adir" / "x.txt")))
        add(Probe(f"{label} under a file", argv + [P / "afile" / f"x{ext}"], names=(flag,), protect=[P / "afile"],
                  setup=lambda: user_file(P / "afile")))
    add(Probe("vocab -o onto a user's model weights", ["vocab", "--data", W / "data", "--size", "64", "-o",
                                                       P / "my-model" / "model.safetensors"],
              names=("--output",), protect=[P / "my-model"], wrong_class="data loss",
              setup=lambda: (P / "my-model").mkdir() or shutil.copy(W / "export" / "model.safetensors",
                                                                     P / "my-model" / "model.safetensors")))
    add(Probe("vocab -o beside a user's NAME.json", ["vocab", "--data", W / "data", "--size", "64", "-o",
                                                      P / "v.safetensors"],
              names=("--output",), protect=[P / "v.json"], wrong_class="data loss",
              setup=lambda: user_file(P / "v.json", b'{"my": "settings"}')))
    add(Probe("generate -o onto a user's JSONL of other records", gen + ["-o", P / "notes.jsonl"],
              names=("--output",), protect=[P / "notes.jsonl"], wrong_class="data loss",
              setup=lambda: write_jsonl(P / "notes.jsonl", [{"id": 1, "note": "keep"}])))
    add(Probe("bench -o onto a user's JSON", bench + ["-o", P / "r.json"], names=("--output",),
              protect=[P / "r.json"], wrong_class="data loss",
              setup=lambda: user_file(P / "r.json", b'{"results": "my spreadsheet"}')))
    add(Probe("bench --plot onto a user's PNG", bench + ["-o", P / "r.json", "--plot", P / "pic.png"],
              names=("--plot",), protect=[P / "pic.png"], wrong_class="data loss",
              setup=lambda: user_file(P / "pic.png", png_bytes())))
    add(Probe("bench --plot is --output", bench + ["-o", P / "same.json", "--plot", P / "same.json"],
              names=("--plot",)))
    add(Probe("generate -o replaces its own earlier output", gen + ["-o", P / "g.jsonl"], expect="ok",
              setup=lambda: shutil.copy(W / "gen.jsonl", P / "g.jsonl")))
    add(Probe("vocab -o replaces its own earlier vocabulary", ["vocab", "--data", W / "data", "--size", "64", "--fill",
                                                               "-o", P / "v.safetensors"], expect="ok",
              setup=lambda: (shutil.copy(W / "vocab.safetensors", P / "v.safetensors"),
                             shutil.copy(W / "vocab.json", P / "v.json"))))
    add(Probe("bench -o / --plot replace their own earlier files",
              bench + ["--drafter", W / "run", "--num-speculative-tokens", "2", "-o", P / "b.json", "--plot",
                       P / "b.png"], expect="ok",
              setup=lambda: (shutil.copy(W / "bench.json", P / "b.json"), shutil.copy(W / "bench.png", P / "b.png"))))
    add(Probe("generate -o onto an empty file", gen + ["-o", P / "empty.jsonl"], expect="ok",
              setup=lambda: user_file(P / "empty.jsonl", b"")))

    # --- B. directory outputs -------------------------------------------------------------------------------
    dir_outputs = [
        ("prepare", ["prepare", "--data", W / "chat.jsonl", "-o"]),
        ("extract", ["extract", "--data", W / "data", "--max-samples", "2", "-o"]),
        ("train", train_online + ["-o"]),
        ("export", ["export", W / "run", "-o"]),
        ("quickstart", ["quickstart", "--num-samples", "2", "-o"]),
    ]
    for label, argv in dir_outputs:
        add(Probe(f"{label} -o into a user's directory", argv + [P / "mine"], names=("--output",),
                  protect=[P / "mine"], setup=lambda: user_file(P / "mine" / "thesis.tex"), wrong_class="data loss"))
        add(Probe(f"{label} -o onto a user's file", argv + [P / "f"], names=("--output",), protect=[P / "f"],
                  setup=lambda: user_file(P / "f"), wrong_class="data loss"))
    add(Probe("export -o onto the training run", ["export", W / "run", "-o", W / "data"], names=("--output",),
              protect=[W / "data"], wrong_class="data loss"))
    add(Probe("export -o is the drafter itself", ["export", W / "export", "-o", W / "export"], names=("--output",),
              protect=[W / "export"], wrong_class="data loss"))
    add(Probe("prepare -o into a hidden-states dir", ["prepare", "--data", W / "chat.jsonl", "-o", W / "hs"],
              names=("--output",), protect=[W / "hs"], wrong_class="data loss"))
    add(Probe("train -o into a prepared dataset", train_online + ["-o", W / "data"], names=("--output",),
              protect=[W / "data"], wrong_class="data loss"))

    # --- C. silent wrong results ----------------------------------------------------------------------------
    add(Probe("train --lr inf", train_online + ["-o", P / "r", "--lr", "inf"], names=("--lr",)))
    add(Probe("train --lr nan", train_online + ["-o", P / "r", "--lr", "nan"], names=("--lr",)))
    add(Probe("train --lr 1e30 diverges", train_online + ["-o", P / "r", "--lr", "1e30"],
              check=lambda: ("silent wrong", "a diverged drafter was saved")
              if (P / "r" / "model.safetensors").exists() else None))
    add(Probe("export a NaN drafter", ["export", P / "nan", "-o", P / "out"], names=("NaN",),
              setup=lambda: copy_drafter(W / "export", P / "nan", edit_weights=nan_weights),
              check=lambda: ("silent wrong", "exported") if (P / "out" / "config.json").exists() else None))
    add(Probe("generate with a NaN drafter", gen + ["--drafter", P / "nan"], names=("NaN",),
              setup=lambda: copy_drafter(W / "export", P / "nan", edit_weights=nan_weights)))
    add(Probe("bench with a NaN drafter", bench + ["--drafter", P / "nan", "-o", P / "b.json"], names=("NaN",),
              setup=lambda: copy_drafter(W / "export", P / "nan", edit_weights=nan_weights)))
    for mode in ("empty", "null", "blank"):
        add(Probe(f"endpoint answers {mode}", regen + ["--endpoint", ep.url(mode), "--model-name", "m", "-o",
                                                       P / "r.jsonl"], names=("empty",),
                  check=lambda: ("silent wrong", "empty answers written as finished")
                  if (P / "r.jsonl").exists() and (P / "r.jsonl").read_text().strip() else None))
    add(Probe("endpoint answers some empty", regen + ["--max-samples", "4", "--endpoint", ep.url("halfempty"),
                                                      "--model-name", "m", "-o", P / "r.jsonl"], expect="ok",
              check=lambda: ("silent wrong", "an empty answer was written") if any(
                  not m["content"].strip() for ln in (P / "r.jsonl").read_text().splitlines()
                  for m in json.loads(ln)["messages"] if m["role"] == "assistant") else None))
    add(Probe("endpoint answers in content parts", regen + ["--endpoint", ep.url("parts"), "--model-name", "m", "-o",
                                                            P / "r.jsonl"], expect="ok",
              check=lambda: None if "Part one." in (P / "r.jsonl").read_text() else ("silent wrong", "parts lost")))
    add(Probe("regenerate into another verifier's file", regen + ["--endpoint", ep.url("good"), "--model-name",
                                                                  "other-model", "-o", P / "r.jsonl"],
              names=("--output",), protect=[P / "r.jsonl"],
              setup=lambda: cli(*regen, "--endpoint", ep.url("good"), "--model-name", "first-model", "--max-samples",
                                "1", "-o", P / "r.jsonl")))
    add(Probe("regenerate local into an endpoint model's file", regen + ["--max-new-tokens", "2", "-o",
                                                                         P / "r.jsonl"],
              names=("--output",), protect=[P / "r.jsonl"],
              setup=lambda: cli(*regen, "--endpoint", ep.url("good"), "--model-name", "gpt-x", "--max-samples",
                                "1", "-o", P / "r.jsonl")))
    add(Probe("regenerate --endpoint '' (unset variable)", regen + ["--endpoint", "", "-o", P / "r.jsonl"],
              names=("--endpoint",)))
    add(Probe("regenerate --endpoint without a scheme", regen + ["--endpoint", "localhost:8000/v1", "-o",
                                                                 P / "r.jsonl"], names=("--endpoint",)))
    add(Probe("generate --prompt ''", ["generate", "--prompt", "", "--max-new-tokens", "2"], names=("--prompt",)))
    add(Probe("generate --verifier ''", gen + ["--verifier", ""], names=("--verifier",)))
    add(Probe("train --data ''", train_online[:1] + ["--data", "", "--online", "-o", P / "r"], names=("--data",)))
    yaml_cases = [
        ("max_new_tokens: 2.7", "--max-new-tokens"), ("max_new_tokens: true", "--max-new-tokens"),
        ("max_new_tokens: [1, 2]", "--max-new-tokens"), ("temperature: hot", "--temperature"),
        ("temperature: .inf", "--temperature"), ("stream: 1", "--stream"), ("seed: 1.5", "--seed"),
        ("num_speculative_tokens: 2.0", "--num-speculative-tokens"), ("prompt: 5", "--prompt"),
        ("top_p: .nan", "--top-p"),
    ]
    for text, flag in yaml_cases:
        add(Probe(f"YAML {text}", ["generate", "--config", P / "c.yaml"] + (["--prompt", "hi"] if "prompt:" not in
                                                                           text else []),
                  names=(flag,), setup=lambda t=text: user_file(P / "c.yaml", (t + "\n").encode())))
    add(Probe("YAML max_new_tokens: '3' (a quoted number)", ["generate", "--config", P / "c.yaml", "--prompt", "hi"],
              expect="ok", setup=lambda: user_file(P / "c.yaml", b"max_new_tokens: '3'\n")))
    bom = b"\xef\xbb\xbf"

    def bom_jsonl():
        data = (W / "chat.jsonl").read_bytes()
        user_file(P / "bom.jsonl", bom + data)

    def same_count():
        a = json.loads((P / "d1" / "manifest.json").read_text())["num_samples"]
        b = json.loads((P / "d2" / "manifest.json").read_text())["num_samples"]
        return None if a == b else ("silent wrong", f"{b} samples with a BOM against {a} without")
    add(Probe("prepare a JSONL with a byte-order mark",
              ["prepare", "--data", P / "bom.jsonl", "-o", P / "d2", "--val-fraction", "0"], expect="ok",
              setup=lambda: (bom_jsonl(), cli("prepare", "--data", W / "chat.jsonl", "-o", P / "d1",
                                              "--val-fraction", "0")), check=same_count))

    def bom_array():
        recs = [json.loads(ln) for ln in (W / "chat.jsonl").read_text().splitlines()]
        user_file(P / "bom.json", bom + json.dumps(recs).encode())
    add(Probe("prepare a JSON array with a byte-order mark",
              ["prepare", "--data", P / "bom.json", "-o", P / "d2", "--val-fraction", "0"], expect="ok",
              setup=lambda: (bom_array(), cli("prepare", "--data", W / "chat.jsonl", "-o", P / "d1",
                                              "--val-fraction", "0")), check=same_count))
    add(Probe("generate --prompts with a byte-order mark", ["generate", "--prompts", P / "p.jsonl",
                                                            "--max-new-tokens", "2", "-o", P / "g.jsonl"],
              expect="ok", setup=lambda: user_file(P / "p.jsonl", bom + b'{"id": "x", "prompt": "hi"}\n'),
              check=lambda: None if json.loads((P / "g.jsonl").read_text().splitlines()[0])["id"] == "x"
              else ("silent wrong", "the first prompt lost its id")))
    add(Probe("--config YAML with a byte-order mark", ["generate", "--config", P / "c.yaml", "--prompt", "hi"],
              expect="ok", setup=lambda: user_file(P / "c.yaml", bom + b"max_new_tokens: 2\n")))
    add(Probe("drafter config.json with a byte-order mark", gen + ["--drafter", P / "d"], expect="ok",
              setup=lambda: copy_drafter(W / "export", P / "d",
                                         edit_config=lambda c: "\ufeff" + json.dumps(c))))
    for flag, value in (("--temperature", "inf"), ("--temperature", "nan"), ("--top-p", "nan"),
                        ("--temperature", "-1"), ("--max-new-tokens", "0"), ("--num-speculative-tokens", "0")):
        add(Probe(f"generate {flag} {value}", gen + [flag, value], names=(flag,), wrong_class="minor"))
    for flag, value in (("--cod-ratio", "nan"), ("--time-limit", "inf"), ("--max-grad-norm", "inf"),
                        ("--hidden-noise", "nan"), ("--batch-tokens", "1")):
        add(Probe(f"train {flag} {value}", train_online + ["-o", P / "r", flag, value], names=(flag,),
                  wrong_class="minor"))
    add(Probe("bench --num-speculative-tokens 2,,", bench + ["--num-speculative-tokens", "2,,", "-o", P / "b.json",
                                                             "--drafter", W / "run"], expect="ok"))
    add(Probe("bench --num-speculative-tokens abc", bench + ["--num-speculative-tokens", "abc", "-o", P / "b.json"],
              names=("--num-speculative-tokens",)))

    # --- D. tracebacks: disks, files handed in, configs, endpoints, devices ------------------------------------
    full = [
        ("prepare", ["prepare", "--data", W / "chat.jsonl", "-o", FULL / "d"]),
        ("vocab", ["vocab", "--data", W / "data", "--size", "64", "-o", FULL / "v.safetensors"]),
        ("export", ["export", W / "run", "-o", FULL / "e"]),
        ("train", train_online + ["-o", FULL / "r", "--save-every", "1"]),
        ("generate", gen + ["-o", FULL / "g.jsonl", "--max-new-tokens", "2"]),
        ("extract", ["extract", "--data", W / "data", "--max-samples", "4", "-o", FULL / "hs"]),
        ("bench", bench + ["-o", FULL / "b.json", "--plot", FULL / "b.png"]),
    ]
    for label, argv in full:
        add(Probe(f"{label} onto a full disk", argv, names=(str(FULL),), needs_mount=True, setup=fill_disk))
    add(Probe("--chat-template missing", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d", "--chat-template",
                                          P / "nope.jinja"], names=("--chat-template",)))
    add(Probe("--chat-template a directory", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d",
                                              "--chat-template", P], names=("--chat-template",)))
    add(Probe("--chat-template with a syntax error", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d",
                                                      "--chat-template", P / "t.jinja"], names=("--chat-template",),
              setup=lambda: user_file(P / "t.jinja", b"{% for m in messages %}{{ m.content }")))
    add(Probe("--chat-template that raises", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d",
                                              "--chat-template", P / "t.jinja"], names=("--chat-template",),
              setup=lambda: user_file(P / "t.jinja", b"{{ raise_exception('roles must alternate') }}")))
    add(Probe("--chat-template empty", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d", "--chat-template",
                                        P / "t.jinja"], names=("--chat-template",),
              setup=lambda: user_file(P / "t.jinja", b"")))
    add(Probe("--chat-template binary", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d", "--chat-template",
                                         P / "t.jinja"], names=("--chat-template",),
              setup=lambda: user_file(P / "t.jinja", bytes(range(128, 256)))))
    add(Probe("--chat-template undefined variable", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d",
                                                     "--chat-template", P / "t.jinja"], names=("--chat-template",),
              setup=lambda: user_file(P / "t.jinja", b"{{ messages[0].content | nosuchfilter }}")))
    ds_edits = {
        "manifest not JSON": lambda d: user_file(d / "manifest.json", b"{not json"),
        "manifest a list": lambda d: user_file(d / "manifest.json", b"[1, 2]"),
        "manifest without keys": lambda d: user_file(d / "manifest.json", b"{}"),
        "input_ids.npy truncated": lambda d: truncate(d / "input_ids.npy", 200),
        "offsets.npy missing": lambda d: (d / "offsets.npy").unlink(),
        "loss_mask.npy not numpy": lambda d: user_file(d / "loss_mask.npy", b"hello"),
        "sample_ids.json corrupt": lambda d: user_file(d / "sample_ids.json", b"[\"a\""),
        "token_freqs.npy truncated": lambda d: truncate(d / "token_freqs.npy", 100),
        "split.npy of another length": lambda d: __import__("numpy").save(d / "split.npy",
                                                                             __import__("numpy").zeros(3, "uint8")),
    }
    for what, edit in ds_edits.items():
        for cmd in (["vocab", "--size", "64", "-o", P / "v.safetensors", "--data"],
                    train_online[:1] + ["--online", "--max-steps", "1", "-o", P / "r", "--data"]):
            if what.startswith("token_freqs") and cmd[0] == "train":
                continue
            if what.startswith("sample_ids"):  # vocab and train never read the ids: the rest of the data is sound
                add(Probe(f"{cmd[0]} on a dataset with {what} (not read)", cmd + [P / "ds"], expect="ok",
                          setup=lambda e=edit: copy_data(P / "ds", e)))
                continue
            add(Probe(f"{cmd[0]} on a dataset with {what}", cmd + [P / "ds"], names=(str(P / "ds"),),
                      setup=lambda e=edit: copy_data(P / "ds", e)))

    hs_edits = {
        "manifest not JSON": lambda d: user_file(d / "manifest.json", b"{"),
        "manifest without shards": lambda d: user_file(d / "manifest.json", json.dumps(
            {k: v for k, v in json.loads((W / "hs" / "manifest.json").read_text()).items()
             if k != "shards"}).encode()),
        "a shard truncated": lambda d: truncate(sorted(d.glob("shard-*.safetensors"))[0], 1000),
        "a shard missing": lambda d: sorted(d.glob("shard-*.safetensors"))[0].unlink(),
        "a shard replaced by another file": lambda d: user_file(sorted(d.glob("shard-*.safetensors"))[0], b"x" * 64),
    }
    for what, edit in hs_edits.items():
        add(Probe(f"train on hidden states with {what}",
                  ["train", "--data", W / "data", "--hidden-states", P / "hs", "--max-steps", "1", "-o", P / "r",
                   "--num-depths", "2", "--batch-tokens", "512", "--val-samples", "0"],
                  names=(str(P / "hs"),), setup=lambda e=edit: copy_hs(P / "hs", e)))
        add(Probe(f"extract --validate on hidden states with {what}", ["extract", "--validate", "-o", P / "hs"],
                  names=(str(P / "hs"),), setup=lambda e=edit: copy_hs(P / "hs", e)))
    for what, text in (("a syntax error", b"max_new_tokens: [1, 2\n"), ("a list", b"- a\n- b\n"),
                       ("binary bytes", bytes(range(128, 256))), ("a tab indent", b"a:\n\tb: 1\n")):
        add(Probe(f"--config with {what}", ["generate", "--prompt", "hi", "--config", P / "c.yaml"],
                  names=("--config",), setup=lambda t=text: user_file(P / "c.yaml", t)))
    add(Probe("--config missing", ["generate", "--prompt", "hi", "--config", P / "none.yaml"], names=("--config",)))
    add(Probe("--config a directory", ["generate", "--prompt", "hi", "--config", P], names=("--config",)))
    add(Probe("--config unknown key", ["generate", "--prompt", "hi", "--config", P / "c.yaml"],
              names=("max_new_tokns",),
              setup=lambda: user_file(P / "c.yaml", b"max_new_tokns: 3\n")))
    for cmd in (train_online + ["-o", P / "r"], ["extract", "--data", W / "data", "-o", P / "hs"]):
        for dev in ("banana", "cuda", "cuda:7", "gpu", ""):
            add(Probe(f"{cmd[0]} --device {dev!r}", cmd + ["--device", dev], names=("--device",)))
    cfg_edits = {
        "hidden_size -1": lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                        "hidden_size": -1}},
        "num_attention_heads 0": lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                               "num_attention_heads": 0}},
        "heads not a multiple of KV heads": lambda c: {**c, "transformer_layer_config": {
            **c["transformer_layer_config"], "num_key_value_heads": 4}},
        "draft vocab above the vocab": lambda c: {**c, "draft_vocab_size": 10 ** 6},
        "hidden_size a string": lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                              "hidden_size": "big"}},
        "one aux layer": lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [1]},
        "mask token out of range": lambda c: {**c, "mask_token_id": -5},
        "a JSON list": lambda c: [c],
        "not JSON": lambda c: "{oops",
        "no layer config": lambda c: {k: v for k, v in c.items() if k != "transformer_layer_config"},
        "rms_norm_eps negative": lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"],
                                                                               "rms_norm_eps": -1.0}},
    }
    for what, edit in cfg_edits.items():
        for cmd in (gen + ["--drafter"], ["export", "-o", P / "out"]):
            add(Probe(f"{cmd[0]} a drafter whose config.json has {what}", cmd + [P / "d"], names=(str(P / "d"),),
                      setup=lambda e=edit: copy_drafter(W / "export", P / "d", edit_config=e)))
    add(Probe("generate a drafter with truncated weights", gen + ["--drafter", P / "d"], names=(str(P / "d"),),
              setup=lambda: (copy_drafter(W / "export", P / "d"), truncate(P / "d" / "model.safetensors", 5000))))
    add(Probe("export a drafter without weights", ["export", P / "d", "-o", P / "out"], names=(str(P / "d"),),
              setup=lambda: (copy_drafter(W / "export", P / "d"), (P / "d" / "model.safetensors").unlink())))
    endpoint_cases = [("html", "not JSON"), ("badjson", "not JSON"), ("nochoices", "chat completion"),
                      ("emptychoices", "chat completion"), ("number", "content"), ("e500", "500"),
                      ("nomode", "404")]
    for mode, text in endpoint_cases:
        add(Probe(f"endpoint replies {mode}", regen + ["--endpoint", ep.url(mode), "--model-name", "m", "-o",
                                                       P / "r.jsonl"], names=("--endpoint", text)))
    add(Probe("endpoint hangs", regen + ["--endpoint", ep.url("hang"), "--model-name", "m", "--timeout", "1", "-o",
                                         P / "r.jsonl"], names=("--endpoint",)))
    add(Probe("endpoint refuses connections", regen + ["--endpoint", f"http://127.0.0.1:{closed_port()}/v1",
                                                       "--model-name", "m", "-o", P / "r.jsonl"],
              names=("--endpoint",)))
    add(Probe("endpoint host does not resolve", regen + ["--endpoint", "http://no-such-host.invalid/v1",
                                                         "--model-name", "m", "-o", P / "r.jsonl"],
              names=("--endpoint",)))
    prompt_files = {
        "a directory": lambda: (P / "p.jsonl").mkdir(),
        "binary bytes": lambda: user_file(P / "p.jsonl", bytes(range(128, 256))),
        "nothing": lambda: user_file(P / "p.jsonl", b""),
        "a JSON number per line": lambda: user_file(P / "p.jsonl", b"1\n2\n"),
        "invalid JSON": lambda: user_file(P / "p.jsonl", b'{"prompt": \n'),
        "no prompt key": lambda: user_file(P / "p.jsonl", b'{"text": "hi"}\n'),
    }
    for what, setup in prompt_files.items():
        add(Probe(f"generate --prompts holding {what}", ["generate", "--prompts", P / "p.jsonl",
                                                         "--max-new-tokens", "2"], names=("p.jsonl",), setup=setup))
        add(Probe(f"bench --dataset holding {what}", bench + ["--dataset", P / "p.jsonl", "-o", P / "b.json"],
                  names=("p.jsonl",), setup=setup))
    add(Probe("generate --prompts missing", ["generate", "--prompts", P / "none.jsonl"], names=("--prompts",)))
    vocab_files = {
        "missing": lambda: None,
        "corrupt": lambda: user_file(P / "v.safetensors", b"garbage" * 10),
        "JSON": lambda: user_file(P / "v.safetensors", b'{"d2t": []}'),
        "of other tensors": lambda: shutil.copy(sorted((W / "hs").glob("shard-*.safetensors"))[0],
                                                P / "v.safetensors"),
    }
    for what, setup in vocab_files.items():
        add(Probe(f"train --vocab {what}", train_online[:-6] + ["--batch-tokens", "512", "--val-samples", "0",
                                                                "--vocab", P / "v.safetensors", "-o", P / "r"],
                  names=("v.safetensors",), setup=setup))
    data_files = {
        "binary": lambda: user_file(P / "x.json", bytes(range(256)) * 4),
        "gzip": lambda: user_file(P / "x.json", b"\x1f\x8b\x08\x00" + bytes(64)),
        "a JSON object": lambda: user_file(P / "x.json", b'{"conversations": "nope"}'),
        "empty": lambda: user_file(P / "x.json", b""),
        "only bad records": lambda: user_file(P / "x.json", b'{"a": 1}\n[2]\n'),
        "a directory that is no dataset": lambda: (P / "x.json").mkdir(),
    }
    for what, setup in data_files.items():
        add(Probe(f"prepare --data {what}", ["prepare", "--data", P / "x.json", "-o", P / "d"], names=("x.json",),
                  setup=setup))
        add(Probe(f"regenerate --data {what}", ["regenerate", "--data", P / "x.json", "-o", P / "r.jsonl",
                                                "--endpoint", ep.url("good"), "--model-name", "m"],
                  names=("x.json",), setup=setup))
    verifiers = {
        "a missing path": lambda: None,
        "a directory without config": lambda: (P / "v").mkdir(),
        "a corrupt config.json": lambda: user_file(P / "v" / "config.json", b"{nope"),
        "a file": lambda: user_file(P / "v"),
    }
    for what, setup in verifiers.items():
        add(Probe(f"generate --verifier {what}", ["generate", "--prompt", "hi", "--verifier", P / "v"],
                  names=("--verifier",), setup=setup))

    # --- E. unclear messages, OpenAI records ----------------------------------------------------------------
    add(Probe("train --online on a 6-layer verifier", ["train", "--data", P / "d", "--online", "--max-steps", "1",
                                                       "-o", P / "r", "--verifier", W / "shallow"],
              names=("layer",), avoid=("(--layers)",),
              setup=lambda: cli("prepare", "--data", W / "chat.jsonl", "-o", P / "d", "--verifier", W / "shallow")))
    add(Probe("bench a prompt longer than the KV cache", bench + ["--dataset", P / "long.jsonl", "-o", P / "b.json"],
              names=("KV cache",), avoid=("--max-len",),
              setup=lambda: write_jsonl(P / "long.jsonl", [{"id": "l", "prompt": "word " * 9000}])))
    tool_conv = {"id": "t", "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
        {"role": "assistant", "content": "It is 18C and sunny in Paris."}]}
    parts_conv = {"id": "p", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe this picture."},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]}]}

    def kept(n):
        def check():
            m = json.loads((P / "d" / "manifest.json").read_text())
            return None if m["num_samples"] == n else ("unclear", f"{m['num_samples']} kept, skipped {m['skipped']}")
        return check
    add(Probe("prepare OpenAI tool-call conversations", ["prepare", "--data", P / "t.jsonl", "-o", P / "d",
                                                         "--val-fraction", "0"], expect="ok",
              setup=lambda: write_jsonl(P / "t.jsonl", [tool_conv]), check=kept(1)))
    add(Probe("prepare OpenAI content-part lists", ["prepare", "--data", P / "t.jsonl", "-o", P / "d",
                                                    "--val-fraction", "0"], expect="ok",
              setup=lambda: write_jsonl(P / "t.jsonl", [parts_conv]), check=kept(1)))
    add(Probe("regenerate OpenAI tool-call conversations", regen + ["--data", P / "t.jsonl", "--endpoint",
                                                                    ep.url("good"), "--model-name", "m", "-o",
                                                                    P / "r.jsonl"], expect="ok",
              setup=lambda: write_jsonl(P / "t.jsonl", [tool_conv, parts_conv])))

    # --- F. locks ---------------------------------------------------------------------------------------------
    for label, argv, target in (
            ("vocab", ["vocab", "--data", W / "data", "--size", "64", "-o", P / "v.safetensors"], P / "v.safetensors"),
            ("export", ["export", W / "run", "-o", P / "e"], P / "e"),
            ("generate", gen + ["-o", P / "g.jsonl"], P / "g.jsonl"),
            ("bench", bench + ["-o", P / "b.json"], P / "b.json"),
            ("prepare", ["prepare", "--data", W / "chat.jsonl", "-o", P / "d"], P / "d"),
            ("regenerate", regen + ["--endpoint", ep.url("good"), "--model-name", "m", "-o", P / "r.jsonl"],
             P / "r.jsonl")):
        add(Probe(f"{label} while another {label} writes the same output", argv, names=("another paradraft",),
                  setup=lambda t=target: _locks.append(held_lock(t)), wrong_class="minor"))
    return out


_locks: list = []


def run_probe(pr: Probe) -> dict:
    shutil.rmtree(P, ignore_errors=True)
    P.mkdir(parents=True)
    if pr.needs_mount and not mount_full():
        return {"name": pr.name, "result": "skipped", "why": "cannot mount a tmpfs (needs root)"}
    ctx = contextlib.ExitStack()
    try:
        if pr.setup:
            pr.setup()
        for lk in _locks:
            ctx.enter_context(lk)
        _locks.clear()
        before = snap(pr.protect)
        t0 = time.time()
        rc, out, err = cli(*pr.argv, env=pr.env)
        cls, why = judge(pr, rc, out, err, before)
    finally:
        ctx.close()
        if pr.needs_mount:
            subprocess.run(["umount", str(FULL)], capture_output=True)
    last = (err.strip().splitlines() or [""])[-1]
    return {"name": pr.name, "argv": " ".join(map(str, pr.argv)).replace(str(ROOT) + "/", ""),
            "result": "bad" if cls else "ok", "class": cls, "why": why, "exit": rc, "message": last[:300],
            "seconds": round(time.time() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="run the probes whose name holds one of these")
    ap.add_argument("--list", action="store_true", help="list the probes and exit")
    args = ap.parse_args()
    ep = Endpoint()
    all_probes = probes(ep)
    if args.list:
        for pr in all_probes:
            print(pr.name)
        print(f"{len(all_probes)} probes")
        return 0
    build_world()
    chosen = [p for p in all_probes if not args.only or any(s in p.name for s in args.only)]
    report = []
    for i, pr in enumerate(chosen, 1):
        r = run_probe(pr)
        report.append(r)
        mark = {"ok": "ok ", "bad": "BAD", "skipped": "-- "}[r["result"]]
        print(f"[{i:3d}/{len(chosen)}] {mark} {pr.name}" + (f"  <{r['class']}: {r['why'][:160]}>" if r.get("class")
                                                             else ""), flush=True)
    totals = {c: sum(r.get("class") == c for r in report) for c in CLASSES}
    summary = {"probes": len(report), "ok": sum(r["result"] == "ok" for r in report),
               "bad": sum(r["result"] == "bad" for r in report),
               "skipped": sum(r["result"] == "skipped" for r in report), "by_class": totals,
               "date": time.strftime("%Y-%m-%d %H:%M"), "host": os.uname().nodename,
               "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip()}
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "report.json").write_text(json.dumps({"summary": summary, "probes": report}, indent=1) + "\n")
    print(json.dumps(summary))
    return 1 if summary["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
