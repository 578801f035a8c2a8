"""Small shared helpers: atomic writes, JSON files, checksums, the fast dtype of a device."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

DTYPES = ("bfloat16", "float32")


def fast_dtype(device: str) -> str:
    """bfloat16 where bf16 matmuls are the fast path (a CUDA GPU that supports bf16, a CPU with AMX tiles), else
    float32. The one rule behind every `auto` dtype (training autocast, the verifier of every command). Measured
    without AMX: bf16 matmuls 1.4x slower than float32 on a 2-core AVX-512 CPU, the embedded verifier's forward
    5-6x slower on a 2-core AVX2 CPU (BENCHMARKS.md, "Verifier dtype")."""
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return "bfloat16" if amx is not None and amx() else "float32"


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """A dtype flag's value with `auto` resolved for `device` (fast_dtype)."""
    return fast_dtype(device) if name == "auto" else name


def engine_dtype(name: str, engine: str = "paradraft") -> str:
    """The dtype a decoding command (`generate`, `bench`, `regenerate`) runs in: `auto` resolved for the engine's
    device: paradraft's engine runs on the CPU, vLLM on the GPU when there is one."""
    import torch

    return resolve_dtype(name, "cuda" if engine == "vllm" and torch.cuda.is_available() else "cpu")


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | Path) -> None:
    """Give a file or directory made by mkstemp / mkdtemp (0600 / 0700) the mode the umask asks for."""
    path = Path(path)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask())


def json_safe(obj):
    """obj with NaN / infinite floats replaced by None, so that the JSON written is standard (no bare NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; when the block succeeds it gets the umask's mode (mkstemp and
    safetensors make 0600 files, which a vLLM server running as another user could not read) and is renamed to
    `path` in one step. A failure or a kill leaves `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        honour_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj, indent: int = 2) -> None:
    """Write standard JSON (non-finite floats as null) atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        json.dump(json_safe(obj), fh, indent=indent, allow_nan=False)
        fh.write("\n")


def read_json(path: str | Path):
    """Read a JSON file."""
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


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


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
