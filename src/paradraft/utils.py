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


_BF16_GEMM: dict[str, bool] = {}  # device type -> bf16_gemm's answer


def bf16_gemm(device: str = "cpu") -> bool:
    """Whether torch multiplies bf16 matrices through a fast kernel on `device`: a CUDA GPU that supports bf16, or a
    CPU where oneDNN takes them (AVX-512 BF16 or AMX). Elsewhere torch's CPU fallback costs every row what one row
    costs: on a 2-core AMD EPYC with AVX2 a 150-row bf16 projection took 16 ms against 2.2 ms in float32, and
    Muon's bf16 orthogonalisation made a quickstart training step 26 s (BENCHMARKS.md, "The engine at the machine's
    limit", fifth run). The engine (verifier/linear.py) and Muon (train/trainer.py) then compute in float32."""
    import torch

    kind = torch.device(device).type
    if kind not in _BF16_GEMM:
        if kind == "cuda":
            _BF16_GEMM[kind] = bool(torch.cuda.is_bf16_supported())
        elif kind == "cpu":
            _BF16_GEMM[kind] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        else:
            _BF16_GEMM[kind] = True
    return _BF16_GEMM[kind]


# a compiled step's loops over fewer elements than this run on one thread (inductor's cpp.min_chunk_size, per
# thread of 2): a decoding or verification step's norms, rotations and residuals of up to 16 rows of the embedded
# verifier (~10k elements) took OpenMP's fork and join for a few microseconds of work each. Measured on the 2-core AMX
# host, interleaved in one process (verification of 4 rows minus decoding of 1, median of paired steps): 1.2-1.7 ms
# against 2.0-2.4 ms with inductor's default (512 per thread).
SERIAL_ELEMENTS = 32768

# $PARADRAFT_CPP_WRAPPER=on compiles a CPU step with inductor's C++ wrapper (cpp_wrapper) instead of the Python one,
# which calls each of a step's ~150 kernels and projections from Python. Not the default: on the 2-core AVX2 host
# (BENCHMARKS.md, "The engine at the machine's limit", seventh run) it saved ~1 ms of a 14.8 ms bf16 decoding step
# and nothing in float32, and the first compilation on a host took ~90 s against ~50 s
CPP_WRAPPER_ENV = "PARADRAFT_CPP_WRAPPER"


def compile_step(method, device="cpu"):
    """THE way paradraft compiles an inference step (the verifier's layer groups and logits, P-EAGLE's drafting
    pass): torch.compile (inductor, dynamic where the caller marks it) of a bound method on a code object of its own,
    whose guards skip the owner's modules. The step's owner (a runner, a drafter) holds one model whose modules do
    not change under it, so those guards, which dynamo checks on every call (~0.3 ms a call on the embedded
    verifier's groups of 10 layers, 5 calls a speculative pass), would only repeat what its own code already
    holds; its inputs (activations, caches, packed weights) keep theirs. A code object of its own keeps a graph
    compiled for one model from being run for another (dynamo's cache belongs to a code object, and without the
    module guards nothing else would tell two models of the same shapes apart). On a CPU `device` with
    $PARADRAFT_CPP_WRAPPER=on, inductor's C++ wrapper (CPP_WRAPPER_ENV)."""
    import types

    import torch

    f = method.__func__
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    own.__kwdefaults__, own.__qualname__ = f.__kwdefaults__, f.__qualname__
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
               "cpp.min_chunk_size": SERIAL_ELEMENTS // 2,
               # no size, stride and alignment asserts in the generated code (~140 per call of a group of 10 layers:
               # every input and every projection's output): the guards already check the inputs, and the kernels'
               # outputs have their fake's shapes (kernels._register_fake). Measured on the 2-core AMX host,
               # interleaved in one process: a bf16 plain step 16.7 against 17.5 ms, a K=3 pass 20.7 against 21.8
               "size_asserts": False, "alignment_asserts": False}
    if torch.device(device).type == "cpu" and os.environ.get(CPP_WRAPPER_ENV, "off").lower() == "on":
        options["cpp_wrapper"] = True
    return torch.compile(types.MethodType(own, method.__self__), dynamic=None, options=options)


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far: a compiled step that raised it paid a compilation
    (the first of its kind, or a recompilation a new shape or path needed: a batch past the kernel's rows takes
    another path than a batch of 2), which the step's owner adds to its `compile_s`."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """A dtype flag's value with `auto` resolved for `device` (fast_dtype)."""
    return fast_dtype(device) if name == "auto" else name


def engine_dtype(name: str, engine: str = "paradraft", device: str = "cpu") -> str:
    """The dtype a decoding command (`generate`, `bench`, `regenerate`) runs in: `auto` resolved for the device the
    engine runs on (paradraft's engine: `device`, resolved by resolve_device; vLLM: the GPU when there is one)."""
    import torch

    if engine == "vllm":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_dtype(name, device)


def resolve_device(name: str, flag: str = "--device") -> str:
    """THE device rule of every command that runs a model: `auto` is the GPU when torch sees one (cuda:LOCAL_RANK
    under torchrun) and the CPU otherwise; `cuda` is cuda:LOCAL_RANK under torchrun; asking for a GPU that is not
    there is a one-line error (UserError naming the flag)."""
    import torch

    from .errors import UserError

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        return f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if not name.startswith("cuda"):
        raise UserError(f"{flag} {name!r}: give auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise UserError(f"{flag} {name}: no CUDA device here ({why}); use --device cpu or auto")
    index = local if name == "cuda" else int(name.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise UserError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                        f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return f"cuda:{index}"


_LIBC = None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Sequence partitioning calls it between partitions: a long sample's targets, its context pass and each partition
    free hundreds of medium blocks that glibc keeps, fragmented, in its heap. Measured on a 32k-token sample: a peak
    of 7.4 GB without, about that of an 8k step with (BENCHMARKS.md, "Long samples")."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 (glibc only)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def cache_root() -> Path:
    """Cache root: $PARADRAFT_CACHE or ~/.cache/paradraft."""
    return Path(os.environ.get("PARADRAFT_CACHE") or Path.home() / ".cache" / "paradraft")


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
    with open(path, encoding="utf-8-sig") as fh:  # a byte-order mark (some editors write one) is not JSON
        return json.load(fh)


def read_json_input(path: str | Path, error: type[Exception], what: str, keys: tuple[str, ...] = ()) -> dict:
    """A JSON object from a file the user handed in (a manifest, a config): anything unreadable, not an object, or
    missing one of `keys` is `error` naming the file and what it should have been, never a traceback."""
    path = Path(path)
    try:
        d = read_json(path)
    except FileNotFoundError:
        raise error(f"{path}: missing ({what} needs it)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:80]}); the {what} is damaged") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(d, dict):
        raise error(f"{path}: holds a JSON {type(d).__name__}, not an object; the {what} is damaged")
    missing = [k for k in keys if k not in d]
    if missing:
        raise error(f"{path}: lacks {', '.join(missing)}; the {what} is damaged or was not written by paradraft")
    return d


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


def _write_failure(e: Exception, path: str | Path) -> OSError:
    """An OSError for a writer that failed without one (safetensors and torch.save report a full disk as their own
    exception types), so that the CLI answers a full disk with one line naming the file; errno ENOSPC when the
    filesystem is (nearly) full, EIO otherwise."""
    import errno

    try:
        st = os.statvfs(Path(path).parent)
        full = st.f_bavail * st.f_frsize < (64 << 20)
    except OSError:
        full = False
    full = full or "os error 28" in str(e) or "No space left" in str(e)
    code = errno.ENOSPC if full else errno.EIO
    err = OSError(code, os.strerror(code) + ("" if full else f" ({type(e).__name__}: {e})"), str(path))
    return err


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except OSError:
            raise
        except Exception as e:  # SafetensorError: I/O errors (a full disk) come as this type
            if "I/O error" not in str(e):
                raise
            raise _write_failure(e, path) from None


def save_npy(path: str | Path, array) -> None:
    """np.save; numpy reports a short write on a full disk as an OSError without an errno ("N requested and M
    written"), which becomes ENOSPC here so that the CLI names the file in one line."""
    import numpy as np

    try:
        np.save(path, array)
    except OSError as e:
        if e.errno is not None:
            raise
        raise _write_failure(e, path) from None


def save_torch(obj, path: str | Path) -> None:
    """torch.save, atomically; a failed write (torch reports a full disk as a RuntimeError) is an OSError."""
    import torch

    with atomic_path(path) as tmp:
        try:
            torch.save(obj, tmp)
        except OSError:
            raise
        except RuntimeError as e:
            if "inline_container" not in str(e) and "write" not in str(e).lower():
                raise
            raise _write_failure(e, path) from None
