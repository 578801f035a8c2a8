"""The one rule for outputs: write beside the target and rename; replace only what paradraft itself made.

Every directory a command writes carries a marker file, `.paradraft.json`, naming the kind of output it is
(`dataset`, `hidden_states`, `train_run`, `drafter`, `quickstart`). A command may replace or add to a directory
only when it is new, empty, or marked with the command's own kind; and it replaces as a whole only directories
holding nothing but the files that kind is made of. Anything else is refused with a message naming the path and
the flag, and nothing is deleted that paradraft did not create. Files and directories honour the umask.
A lock file beside the target (`.NAME.lock`, flock) keeps two commands from writing one output at once.

Single files follow the same rule (`claim_file`): a command writes a file only where nothing is (or an empty
file), or where the file is one it recognises as its own kind by its content (a generate JSONL, bench results,
a plot carrying paradraft's PNG marker, a draft vocabulary), or a file of its kind inside a directory paradraft
marked; it replaces it by rename. Anything else, a symbolic link included, is refused before any work.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import fnmatch
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

from .errors import UserError
from .utils import honour_umask, umask, write_json

MARKER = ".paradraft.json"

# The entries each kind of output directory is made of (glob patterns); hidden temporaries of paradraft's own
# atomic writes (".tmp-*", ".*.tmp*") are always recognised.
KIND_FILES: dict[str, tuple[str, ...]] = {
    "dataset": ("input_ids.npy", "loss_mask.npy", "offsets.npy", "split.npy", "token_freqs.npy", "sample_ids.json",
                "manifest.json"),
    "hidden_states": ("identity.json", "manifest.json", "shard-*.safetensors", "shard-*.json"),
    "drafter": ("config.json", "model.safetensors", "provenance.json"),
    "train_run": ("config.json", "model.safetensors", "provenance.json", "metrics.jsonl", "training.png",
                  "final_metrics.json", "train_config.yaml", "tensorboard", "checkpoints"),
    "quickstart": ("regenerated.jsonl", "data", "hidden_states", "peagle", "results.json", "results.png",
                   "results.config.json", "peagle-vllm"),  # results.config.json: written by versions before 0.2
}
TEMPORARIES = (".tmp-*", ".*.tmp*", ".*.final", ".old-*", ".*.lock")


class OutputError(UserError, FileExistsError):
    """An output path the command may not write: another kind of output, foreign files, a file, read-only."""


def _flag(flag: str) -> str:
    return flag if flag.startswith("-") else f"--{flag}"


def check_writable(path: str | Path, flag: str, *, is_dir: bool) -> Path:
    """Fail early (before any work) when `path` cannot be written: a file where a directory goes or the
    reverse, a parent that is a file, a read-only place. Creates nothing."""
    path = Path(path).expanduser()
    if path.exists():
        if is_dir and not path.is_dir():
            raise OutputError(f"{_flag(flag)} {path}: is a file, not a directory")
        if not is_dir and path.is_dir():
            raise OutputError(f"{_flag(flag)} {path}: is a directory; give a file path")
    probe = path if (is_dir and path.is_dir()) else path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{_flag(flag)} {path}: {probe} is a file, so nothing can be created under it")
    try:  # a real write: os.access says yes to root on a read-only filesystem
        fd, tmp = tempfile.mkstemp(prefix=".paradraft-probe-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise OutputError(f"{_flag(flag)} {path}: cannot write in {probe} ({e.strerror})") from None
    return path


def read_marker(path: str | Path) -> dict | None:
    """The marker of an output directory, or None when it has none (or an unreadable one)."""
    try:
        m = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("kind"), str) else None


def marker_payload(kind: str) -> dict:
    return {"kind": kind, "tool": "paradraft", "command": " ".join(sys.argv[:2]),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_marker(path: str | Path, kind: str) -> None:
    """Mark `path` as a `kind` output of paradraft (kept if already there)."""
    path = Path(path)
    if (read_marker(path) or {}).get("kind") != kind:
        write_json(path / MARKER, marker_payload(kind))


def _recognised(name: str, kind: str) -> bool:
    return name == MARKER or any(fnmatch.fnmatch(name, p) for p in KIND_FILES[kind] + TEMPORARIES)


def foreign_entries(path: str | Path, kind: str) -> list[str]:
    """Entries of `path` that a `kind` output is not made of."""
    return sorted(e.name for e in Path(path).iterdir() if not _recognised(e.name, kind))


def claim_dir(path: str | Path, kind: str, flag: str, *, legacy=None) -> str:
    """May a `kind` command write into directory `path`? Returns "new" (absent), "empty", or "ours" (marked
    `kind`, or an unmarked directory `legacy(path)` recognises as one paradraft wrote before markers existed).
    Refuses (OutputError naming the path and the flag) a file, another kind, or a directory paradraft did not make.
    """
    path = check_writable(path, flag, is_dir=True)
    if not path.exists():
        return "new"
    entries = [e.name for e in path.iterdir()]
    if not entries:
        return "empty"
    marker = read_marker(path)
    if marker is not None:
        if marker["kind"] != kind:
            raise OutputError(f"{_flag(flag)} {path}: holds a paradraft {marker['kind'].replace('_', ' ')} output, "
                              f"not a {kind.replace('_', ' ')}; choose another {_flag(flag)}")
        return "ours"
    if legacy is not None and legacy(path) and not foreign_entries(path, kind):
        return "ours"
    shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    raise OutputError(f"{_flag(flag)} {path}: exists and was not written by paradraft ({shown}); "
                      f"paradraft replaces only its own outputs: choose another {_flag(flag)}")


def check_replaceable(path: str | Path, kind: str, flag: str) -> None:
    """Refuse to replace a marked directory that also holds files its kind is not made of (they are not ours)."""
    path = Path(path)
    if path.is_dir():
        extra = foreign_entries(path, kind)
        if extra:
            raise OutputError(f"{_flag(flag)} {path}: holds files paradraft did not write ({', '.join(extra[:5])}); "
                              f"move them away or choose another {_flag(flag)}")


_HELD: set[str] = set()  # the lock files this process holds


@contextlib.contextmanager
def output_lock(target: str | Path, flag: str, *, reentrant: bool = False):
    """Hold an exclusive lock on `target` (a lock file beside it) for the duration; refuse when another
    paradraft command holds it. The lock dies with the process (flock), so a killed run leaves no stale lock.
    `reentrant`: a writer a command calls while it holds its output's lock (save_drafter inside export) passes
    through that lock; any other second lock on one target is refused, in this process too."""
    target = Path(target).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    key = str(lock_path.resolve())
    if reentrant and key in _HELD:  # the outer holder releases it
        yield
        return
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise OutputError(f"{_flag(flag)} {target}: another paradraft command is writing it now "
                                  f"(lock {lock_path}); wait for it or choose another {_flag(flag)}") from None
            raise
        try:  # the file we locked must still be the one at lock_path (a releasing holder unlinks it)
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)


@contextlib.contextmanager
def replace_dir(target: str | Path, kind: str, flag: str):
    """Yield a fresh temporary directory beside `target`; on success it becomes `target` in one rename and is
    marked `kind`. An existing `target` must have been claimed first (`claim_dir`): it is replaced only when it
    holds nothing but `kind` files, so no user file is ever deleted. A killed run leaves only a hidden `.tmp-*`.
    """
    target = Path(target).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        write_json(tmp / MARKER, marker_payload(kind))
        honour_umask(tmp)
        if not target.exists():
            os.rename(tmp, target)
        elif read_marker(target) is None and not any(target.iterdir()):
            # an empty directory the user made stays theirs: move the files in, completion markers last
            last = ("manifest.json", MARKER)
            for e in sorted(tmp.iterdir(), key=lambda e: (e.name in last, last.index(e.name) if e.name in last else 0)):
                os.rename(e, target / e.name)
        else:
            check_replaceable(target, kind, flag)  # checked again at the last moment
            old = target.parent / f".old-{target.name}-{os.getpid()}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)  # only files of this kind, written by paradraft (checked above)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ single-file outputs

PNG_MARK = "paradraft"  # the PNG text chunk (Software) every paradraft plot carries: how a plot is known as ours
RECOGNISE_BYTES = 64 << 20  # a file larger than this is never read whole to recognise it


def _json_lines(path: Path, limit: int = 256) -> list | None:
    """The first `limit` non-empty lines of a JSONL file as objects, or None when any is not a JSON object."""
    out = []
    try:
        with open(path, encoding="utf-8-sig") as fh:
            for line in fh:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    return None
                out.append(rec)
                if len(out) >= limit:
                    break
    except (OSError, ValueError):
        return None
    return out


def _is_generate_jsonl(path: Path) -> bool:
    recs = _json_lines(path)
    return bool(recs) and all({"id", "text", "token_ids"} <= set(r) for r in recs)


def _is_json_object_with(path: Path, keys: set) -> bool:
    if path.stat().st_size > RECOGNISE_BYTES:
        return False
    try:
        d = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and keys <= set(d)


def _is_bench_json(path: Path) -> bool:
    return _is_json_object_with(path, {"identity", "results"})


def _is_vocab_summary(path: Path) -> bool:
    return _is_json_object_with(path, {"draft_vocab_size", "target_vocab_size"})


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file ({} for anything that is not a PNG)."""
    out: dict[str, str] = {}
    try:
        with open(path, "rb") as fh:
            if fh.read(8) != b"\x89PNG\r\n\x1a\n":
                return {}
            while True:
                head = fh.read(8)
                if len(head) < 8:
                    return out
                n, ctype = struct.unpack(">I4s", head)
                if ctype == b"IDAT" or ctype == b"IEND" or n > RECOGNISE_BYTES:
                    return out
                body = fh.read(n)
                fh.read(4)  # crc
                if ctype == b"tEXt" and b"\0" in body:
                    k, v = body.split(b"\0", 1)
                    out[k.decode("latin-1")] = v.decode("latin-1")
    except OSError:
        return out


def _is_paradraft_png(path: Path) -> bool:
    return any(PNG_MARK in v for v in png_text(path).values())


def safetensors_header(path: str | Path, limit: int = 64 << 20) -> tuple[dict, int]:
    """(the header of a safetensors file without its __metadata__, the byte offset its data starts at), read without
    reading the data. OSError / ValueError / struct.error for anything that is not one (a header over `limit`)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > limit:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def safetensors_names(path: Path) -> set[str] | None:
    """Tensor names in a safetensors file's header, or None for anything else."""
    try:
        return set(safetensors_header(path, limit=16 << 20)[0])
    except (OSError, ValueError, struct.error):
        return None


def _is_vocab_file(path: Path) -> bool:
    return safetensors_names(path) == {"d2t", "t2d"}


# kind -> (what it is called in messages, how a file of it is recognised by content)
FILE_KINDS: dict[str, tuple[str, callable]] = {
    "generate": ("generate output (JSONL of {id, text, token_ids})", _is_generate_jsonl),
    "bench": ("bench results file", _is_bench_json),
    "plot": ("plot paradraft drew", _is_paradraft_png),
    "vocab": ("draft vocabulary (d2t, t2d)", _is_vocab_file),
    "vocab_summary": ("vocabulary summary", _is_vocab_summary),
}


def _in_own_dir(path: Path) -> bool:
    """A file of its directory's kind inside a directory paradraft marked (e.g. results.png of a quickstart)."""
    marker = read_marker(path.parent)
    return marker is not None and marker["kind"] in KIND_FILES and _recognised(path.name, marker["kind"])


def claim_file(path: str | Path, kind: str, flag: str) -> Path:
    """May a `kind` command write file `path`? Yes where nothing is (or an empty file), or where the file is
    recognised as a `kind` file paradraft wrote (by content, or as its kind's file inside a marked directory).
    Refuses (OutputError naming the path and the flag) a symbolic link, a directory, and any other file. Call it
    before any work; write with `utils.atomic_path` (beside the target, then rename)."""
    desc, recognise = FILE_KINDS[kind]
    path = Path(path).expanduser()
    if path.is_symlink():
        raise OutputError(f"{_flag(flag)} {path}: is a symbolic link; paradraft writes only regular files it made: "
                          f"give the real path or choose another {_flag(flag)}")
    path = check_writable(path, flag, is_dir=False)
    if not path.exists():
        return path
    if not path.is_file():
        raise OutputError(f"{_flag(flag)} {path}: is not a regular file; choose another {_flag(flag)}")
    if path.stat().st_size == 0 or _in_own_dir(path) or recognise(path):
        return path
    raise OutputError(f"{_flag(flag)} {path}: exists and is not a {desc} paradraft wrote; paradraft replaces only "
                      f"its own files: move it away or choose another {_flag(flag)}")
