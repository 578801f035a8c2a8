"""Probe every command as a hostile but realistic user would, through the real CLI on the embedded verifier.

Each probe runs `paradraft ...` in a subprocess and checks three things: the exit code, that a user error is one
line (`paradraft COMMAND: error: ...`, no traceback), and that nothing the user owns was deleted or changed.
Some probes kill a run (SIGKILL) and rerun it, or start two writers at once. Needs `make demo` first (it reads
runs/quickstart). Writes runs/probes/report.json and prints a table; exit code 1 if any probe fails.

    python scripts/probe_cli.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QS = ROOT / "runs" / "quickstart"
WORK = ROOT / "runs" / "probes"
PARADRAFT = [sys.executable, "-m", "paradraft"]


def cli(*argv, env=None, wait=True):
    cmd = PARADRAFT + [str(a) for a in argv]
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT)
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=900)
    return p.returncode, p.stdout, p.stderr


def one_line_error(err: str, command: str) -> bool:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith(f"paradraft {command}: error:")]
    return len(lines) == 1 and "Traceback" not in err


def user_dir(path: Path, names=("notes.txt", "sub/keep.bin")) -> dict:
    made = {}
    for n in names:
        p = path / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"user data {n}".encode())
        made[p] = p.read_bytes()
    return made


def intact(made: dict) -> bool:
    return all(p.is_file() and p.read_bytes() == b for p, b in made.items())


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


def expect_error(command: str, argv: list, text: str, check=None):
    """A probe: the command must fail with one line holding `text`, and `check()` (if given) must hold after."""
    def run():
        rc, out, err = cli(command, *argv)
        ok = rc == 1 and one_line_error(err, command) and text in err and (check() if check else True)
        return ok, err.strip().splitlines()[-1] if err.strip() else f"rc={rc}"
    return run


def train_flags(out, *extra, data=None, hs=None):
    return ["--data", data or QS / "data", "--hidden-states", hs or QS / "hidden_states", "-o", out,
            "--max-steps", "3", "--save-every", "1", "--batch-tokens", "512", "--num-depths", "4",
            "--warmup-steps", "1", *extra]


def probes() -> dict:
    W = WORK
    P = {}
    for c in ("prepare", "regenerate", "vocab", "extract", "train", "generate", "bench", "export", "quickstart"):
        P[f"help-{c}"] = (lambda c=c: (lambda r: (r[0] == 0 and "usage:" in r[1], f"rc={r[0]}"))(cli(c, "--help")))

    # ---- data loss
    def export_into_user_dir():
        made = user_dir(W / "export-user")
        rc, _, err = cli("export", QS / "peagle", "--output", W / "export-user")
        return rc == 1 and one_line_error(err, "export") and intact(made), err.strip()[-160:]
    P["export-into-user-dir"] = export_into_user_dir

    def export_onto_run():
        before = snapshot(QS / "peagle")
        rc, _, err = cli("export", QS / "peagle", "--output", QS / "peagle")
        return rc == 1 and one_line_error(err, "export") and snapshot(QS / "peagle") == before, err.strip()[-160:]
    P["export-onto-its-run"] = export_onto_run

    def export_onto_quickstart():
        before = snapshot(QS)
        rc, _, err = cli("export", QS / "peagle", "--output", QS)
        return rc == 1 and one_line_error(err, "export") and snapshot(QS) == before, err.strip()[-160:]
    P["export-onto-quickstart-dir"] = export_onto_quickstart

    def export_twice():
        rc1, _, e1 = cli("export", QS / "peagle", "--output", W / "exp")
        rc2, _, e2 = cli("export", QS / "peagle", "--output", W / "exp")
        modes = {oct(p.stat().st_mode & 0o777) for p in (W / "exp").iterdir()}
        return rc1 == 0 and rc2 == 0 and modes == {"0o644"}, f"modes {sorted(modes)}"
    P["export-twice-replaces-own-export-umask"] = export_twice

    def prepare_overwrite_user_dir():
        made = user_dir(W / "prep-user")
        rc, _, err = cli("prepare", "--data", QS / "regenerated.jsonl", "-o", W / "prep-user", "--overwrite")
        return rc == 1 and one_line_error(err, "prepare") and intact(made) and "--overwrite" not in err, \
            err.strip()[-160:]
    P["prepare-overwrite-user-dir"] = prepare_overwrite_user_dir

    def train_into_finished_drafter():
        d = W / "finished"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(QS / "peagle", d, ignore=shutil.ignore_patterns("checkpoints"))
        before = snapshot(d)
        rc, _, err = cli("train", *train_flags(d))
        return rc == 1 and one_line_error(err, "train") and snapshot(d) == before, err.strip()[-160:]
    P["train-into-finished-drafter"] = train_into_finished_drafter

    def other_data():
        rc, _, err = cli("prepare", "--data", QS / "regenerated.jsonl", "-o", W / "other-data", "--max-samples", "60",
                         "--seq-length", "256", "--overwrite")
        assert rc == 0, err
        rc, _, err = cli("train", *train_flags(W / "mismatch", data=W / "other-data"))
        return rc == 1 and one_line_error(err, "train") and "another dataset" in err \
            and not (W / "mismatch").exists(), err.strip()[-160:]
    P["train-hidden-states-of-other-data"] = other_data

    def two_prepares():
        out = W / "race"
        shutil.rmtree(out, ignore_errors=True)
        a = cli("prepare", "--data", "sharegpt", "--max-samples", "300", "-o", out, wait=False)
        time.sleep(0.5)
        b = cli("prepare", "--data", "sharegpt", "--max-samples", "200", "-o", out, wait=False)
        ea, eb = a.communicate()[1], b.communicate()[1]
        m = json.loads((out / "manifest.json").read_text())
        codes = sorted([a.returncode, b.returncode])
        loser = eb if b.returncode else ea
        return codes == [0, 1] and "another paradraft command" in loser, f"codes {codes}, kept {m['num_samples']}"
    P["two-prepares-one-dir"] = two_prepares

    def dup_and_bytes():
        src = W / "dup.jsonl"
        rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there!"}]}
        lines = [json.dumps({**rec, "id": str(i)}) for i in range(3)]
        bad = json.dumps({"id": "b", "messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": "AAA"}]}).encode()
        src.write_bytes(("\n".join(lines) + "\n").encode() + bad.replace(b"AAA", b"A\xff\xfeA") + b"\n")
        rc, out, err = cli("prepare", "--data", src, "-o", W / "dup", "--val-fraction", "0", "--overwrite")
        m = json.loads((W / "dup" / "manifest.json").read_text()) if rc == 0 else {}
        return m.get("num_samples") == 1 and m["skipped"] == {"duplicate": 2, "undecodable": 1}, str(m.get("skipped"))
    P["prepare-duplicates-and-bad-bytes"] = dup_and_bytes

    def depths_recorded():
        out = W / "depth4"
        rc, _, err = cli("train", *train_flags(out, "--overwrite"))
        cfg = json.loads((out / "config.json").read_text()) if rc == 0 else {}
        k = cfg.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens")
        rc2, _, err2 = cli("export", out, "-o", W / "depth4-exp", "--num-speculative-tokens", "7")
        return k == 4 and rc2 == 1 and one_line_error(err2, "export"), f"K recorded {k}; {err2.strip()[-80:]}"
    P["peagle-4-depths-records-K-4"] = depths_recorded

    def resume_changed_flags():
        rc, _, err = cli("train", *train_flags(W / "depth4", "--resume", "--lr", "0.01"))
        return rc == 1 and one_line_error(err, "train") and "--lr" in err, err.strip()[-160:]
    P["resume-with-changed-flags"] = resume_changed_flags

    def resume_other_algorithm():
        rc, _, err = cli("train", *train_flags(W / "depth4", "--resume", "--algorithm", "eagle3"))
        return rc == 1 and one_line_error(err, "train") and "--algorithm" in err, err.strip()[-160:]
    P["resume-with-other-algorithm"] = resume_other_algorithm

    def sigkill_train_then_resume():
        out = W / "killed"
        shutil.rmtree(out, ignore_errors=True)  # a fresh run: checkpoints of an earlier probe run would count
        p = cli("train", *train_flags(out, "--max-steps", "40", "--save-every", "5"), wait=False)
        deadline = time.time() + 600
        while time.time() < deadline and len(list((out / "checkpoints").glob("step-*"))) < 2:
            time.sleep(0.5)
        time.sleep(1.5)
        p.send_signal(signal.SIGKILL)
        p.communicate()
        rc, _, err = cli("train", *train_flags(out, "--resume", "--max-steps", "40", "--save-every", "5"))
        steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        return rc == 0 and steps == list(range(1, 41)), f"rc {rc}, {len(steps)} metric lines, unique {len(set(steps))}"
    P["train-sigkill-then-resume"] = sigkill_train_then_resume

    def damaged_checkpoint():
        out = W / "killed"
        newest = sorted((out / "checkpoints").glob("step-*"))[-1]
        f = newest / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
        rc, o, err = cli("train", *train_flags(out, "--resume", "--max-steps", "42", "--save-every", "5"))
        return rc == 0 and "trying the checkpoint before it" in o, (o + err).strip().splitlines()[-1][-160:]
    P["resume-past-damaged-checkpoint"] = damaged_checkpoint

    def generate_into_dir():
        t0 = time.time()
        rc, _, err = cli("generate", "--drafter", QS / "peagle", "--prompt", "hello", "-o", W)
        return rc == 1 and one_line_error(err, "generate") and "is a directory" in err, \
            f"{time.time() - t0:.1f} s: {err.strip()[-100:]}"
    P["generate-output-is-a-directory"] = generate_into_dir

    def edited_config():
        d = W / "edited"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(QS / "peagle", d, ignore=shutil.ignore_patterns("checkpoints"))
        cfg = json.loads((d / "config.json").read_text())
        cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 2
        (d / "config.json").write_text(json.dumps(cfg))
        rc, _, err = cli("generate", "--drafter", d, "--prompt", "hello", "--max-new-tokens", "4")
        return rc == 1 and one_line_error(err, "generate") and "num_speculative_tokens" in err, err.strip()[-160:]
    P["config-json-top-level-edited"] = edited_config

    def garbage_bin():
        d = W / "garbage"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copy(QS / "peagle" / "config.json", d / "config.json")
        (d / "pytorch_model.bin").write_bytes(os.urandom(2048))
        rc, _, err = cli("export", d, "-o", W / "garbage-exp")
        return rc == 1 and one_line_error(err, "export") and "pytorch_model.bin" in err, err.strip()[-160:]
    P["export-garbage-pytorch-model-bin"] = garbage_bin

    def truncated_drafter():
        d = W / "truncated"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(QS / "peagle", d, ignore=shutil.ignore_patterns("checkpoints"))
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:5000])
        rc, _, err = cli("generate", "--drafter", d, "--prompt", "hello")
        return rc == 1 and one_line_error(err, "generate") and "model.safetensors" in err, err.strip()[-160:]
    P["generate-truncated-drafter"] = truncated_drafter

    P["extract-layer-out-of-range"] = expect_error("extract", ["--data", QS / "data", "-o", W / "hs-bad",
                                                               "--layers", "2,15,99"], "99",
                                                   lambda: not (W / "hs-bad").exists())
    P["extract-two-layers"] = expect_error("extract", ["--data", QS / "data", "-o", W / "hs2", "--layers", "2,15"],
                                           "3 distinct")
    P["extract-layers-5-5-5"] = expect_error("extract", ["--layers", "5,5,5"], "3 distinct")
    P["train-num-depths-0"] = expect_error("train", ["--online", "--num-depths", "0"], "--num-depths")
    P["train-max-steps-0"] = expect_error("train", ["--online", "--max-steps", "0"], "--max-steps")
    P["generate-K-0"] = expect_error("generate", ["--prompt", "x", "--num-speculative-tokens", "0"], "must be >= 1")
    P["generate-top-p-0"] = expect_error("generate", ["--prompt", "x", "--top-p", "0"], "--top-p")
    P["generate-temperature-negative"] = expect_error("generate", ["--prompt", "x", "--temperature", "-1"],
                                                      "--temperature")
    P["generate-max-new-tokens-0"] = expect_error("generate", ["--prompt", "x", "--max-new-tokens", "0"],
                                                  "--max-new-tokens")
    P["generate-batch-size-0"] = expect_error("generate", ["--prompt", "x", "--batch-size", "0"], "--batch-size")
    P["extract-samples-per-shard-0"] = expect_error("extract", ["--samples-per-shard", "0"], "--samples-per-shard")
    P["bench-num-prompts-0"] = expect_error("bench", ["--num-prompts", "0"], "--num-prompts")
    P["prepare-output-is-a-file"] = expect_error("prepare", ["-o", QS / "regenerated.jsonl"], "is a file")
    P["prepare-output-read-only"] = expect_error("prepare", ["-o", "/sys/paradraft-out"], "cannot write")
    P["train-output-read-only"] = expect_error("train", train_flags("/sys/paradraft-out"), "cannot write")
    P["prompts-not-json"] = expect_error("generate", ["--prompts", QS / "results.png"], "not JSON")
    P["verifier-missing-dir"] = expect_error("generate", ["--prompt", "x", "--verifier", "./no/such/model"],
                                             "no such directory")
    P["config-yaml-unknown-key"] = expect_error("train", ["--config", W / "bad.yaml"], "unknown key")

    def regenerate_foreign():
        f = W / "mine.jsonl"
        f.write_text('{"a": 1}\nnot json\n')
        before = f.read_bytes()
        rc, _, err = cli("regenerate", "-o", f, "--max-samples", "1", "--max-new-tokens", "4")
        return rc == 1 and one_line_error(err, "regenerate") and f.read_bytes() == before, err.strip()[-160:]
    P["regenerate-into-foreign-file"] = regenerate_foreign

    def sigkill_extract():
        out = W / "hs-killed"
        shutil.rmtree(out, ignore_errors=True)
        p = cli("extract", "--data", QS / "data", "-o", out, "--samples-per-shard", "16", wait=False)
        deadline = time.time() + 300
        while time.time() < deadline and len(list(out.glob("shard-*.json"))) < 2:
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        p.communicate()
        rc, _, err = cli("extract", "--data", QS / "data", "-o", out, "--samples-per-shard", "16")
        rc2, o2, _ = cli("extract", "-o", out, "--validate")
        return rc == 0 and rc2 == 0 and "all valid" in o2, err.strip()[-120:]
    P["extract-sigkill-then-rerun"] = sigkill_extract
    return P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="run only these probes")
    args = ap.parse_args()
    if not (QS / "peagle" / "model.safetensors").is_file():
        print("run `make demo` first: the probes read runs/quickstart", file=sys.stderr)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "bad.yaml").write_text("online: true\nnum_deptsh: 3\n")
    results = []
    for name, probe in probes().items():
        if args.only and name not in args.only:
            continue
        t0 = time.time()
        try:
            ok, detail = probe()
        except Exception as e:  # a probe that crashes is a failed probe, reported with its cause
            ok, detail = False, f"probe crashed: {type(e).__name__}: {e}"
        results.append({"probe": name, "ok": bool(ok), "detail": str(detail)[:300],
                        "seconds": round(time.time() - t0, 1)})
        print(f"{'PASS' if ok else 'FAIL'}  {name:40s} {time.time() - t0:6.1f} s  {str(detail)[:110]}", flush=True)
    n_ok = sum(r["ok"] for r in results)
    report = {"date": time.strftime("%Y-%m-%d"), "probes": len(results), "passed": n_ok, "results": results}
    (WORK / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{n_ok} of {len(results)} probes pass -> {WORK / 'report.json'}")
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
