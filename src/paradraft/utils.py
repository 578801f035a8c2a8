"""Small shared helpers: atomic writes, JSON files, checksums."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path


def json_safe(obj):
    """obj with NaN / infinite floats replaced by None, so that the JSON written is standard (no bare NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | Path, obj, indent: int = 2) -> None:
    """Write standard JSON (non-finite floats as null) atomically (temp file in the same dir, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(json_safe(obj), fh, indent=indent, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)


def read_json(path: str | Path):
    """Read a JSON file."""
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = False):
    """Yield a temporary directory beside `target`; on success it replaces `target` in one rename.

    A killed run leaves only a hidden `.tmp-*` directory, never a half-written `target`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if target.exists():
            if not overwrite:
                raise FileExistsError(f"{target} exists")
            old = target.parent / f".old-{target.name}-{os.getpid()}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(chunk):
            h.update(b)
    return h.hexdigest()


def fingerprint(obj) -> str:
    """Short stable hash of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
