"""paradraft's CPU kernel for the few-row projections of decoding (small_linear.cpp), built once per host.

A decoding step multiplies one row per sequence by every weight matrix and a verification step K+1 rows, so its
time is the time to stream the weights from memory. torch's own CPU path streams bf16 weights at ~10 GB/s on the
2-core AVX-512 host of BENCHMARKS.md ("The engine at the machine's limit"), and float32 weights at ~13 GB/s for 4
rows; the kernel reads them at ~22 GB/s (bf16, 1 row) and 18-22 GB/s (4 rows), against ~22-24 GB/s that the memory
delivers there.

The C++ source is compiled with torch's extension toolchain (a C++ compiler and ninja) the first time a process
needs it, into $PARADRAFT_CACHE/kernels/<hash of source, torch and CPU flags> (~10 s, reported once on stderr),
and loaded from there afterwards. It needs AVX-512 (F, BW, VL; BF16 and AMX when the CPU has them), or AVX2 and
FMA (the same loops 8 lanes wide, bf16 converted in registers; no tiles). On a CPU without AVX-512's bf16
instructions torch's bf16 product costs every row of x what one row costs (on the 2-core AMD EPYC of BENCHMARKS.md
a 4-row step's projections ~4x one row's), where the kernel reads the weights once for all rows. Where it cannot
be built or loaded (another CPU, no compiler) the projections run through torch, with one line saying why;
nothing else changes. $PARADRAFT_KERNELS=off never builds or uses it (reproducing torch's path, or measuring the
kernel); $PARADRAFT_KERNELS=avx2 builds the AVX2 variant on a CPU that has AVX-512 too.

`small_linear(x [M, K], weights) -> [M, sum N_i]`: x @ W_i^T for each weight [N_i, K], side by side, float32
accumulation, rounded once to x's dtype (bfloat16 or float32), 1 <= M <= 64.
`decode_attention(q, kc, vc, rows, pos, ...)`: the attention of 1..16 queries per row against the runner's
cache, float32 inside (see its docstring).
`tile_linear(x [M, K], tiles) -> [M, sum N_i]`: the same for bfloat16 on hosts with AMX (`tiles_available`), each
weight packed once by `pack_tiles` into the AMX tile layout (a copy: the runner keeps one per projection of the
verifier); any M >= 1, beyond 32 rows in groups of 32 that share each weight block while it is cached. It reads
the weights for a 4-row verification step as fast as `small_linear` reads them for one row, where `small_linear`
ran ~25% slower with 4 rows than with 1.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
import weakref
from pathlib import Path

import torch

KERNELS_ENV = "PARADRAFT_KERNELS"
MAX_ROWS = 64
_SOURCE = Path(__file__).with_name("small_linear.cpp")
_STATE: dict = {}  # "ok": bool, "why": str, "build_s": float


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags(flags: set[str]) -> list[str] | None:
    """The compiler flags for this CPU, or None where the kernel cannot run on it: AVX-512 (with its bf16
    instructions and AMX where the CPU has them), else AVX2 and FMA (no tiles there)."""
    if not {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags:
        return ["-O3", "-fopenmp", "-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else None
    out = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]
    if "avx512_bf16" in flags:
        out.append("-mavx512bf16")
    if {"amx_tile", "amx_bf16"} <= flags:
        out += ["-mamx-tile", "-mamx-bf16"]
    return out


def build_flags() -> list[str] | None:
    """The compiler flags of the kernel this process builds (`_compile_flags` of this CPU; $PARADRAFT_KERNELS=avx2:
    the AVX2 build on a CPU that has more, to measure or test it there), or None where it cannot run here."""
    flags = _cpu_flags()
    if os.environ.get(KERNELS_ENV, "on").lower() == "avx2":
        flags = flags & {"avx2", "fma"}
    return _compile_flags(flags)


def compile_library(name: str, source: Path, build: Path, cflags: list[str]) -> Path:
    """Compile a kernel source into build/<name>.so (torch's cpp_extension, ninja) and load it into this process
    (its ops registered in torch.ops) -> the library's path."""
    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    # ninja from this environment's bin (a pip-installed ninja) when the PATH has none
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
    load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build),
         is_python_module=False, verbose=False)
    return build / f"{name}.so"


def _build_dir(cflags: list[str]) -> Path:
    from ..utils import cache_root

    key = hashlib.sha256(_SOURCE.read_bytes() + repr((torch.__version__, cflags, sys.version_info[:2])).encode())
    return cache_root() / "kernels" / f"small_linear-{key.hexdigest()[:16]}"


def _load() -> None:
    """Build (once per host) and load the kernel; record whether it is usable and why not."""
    _STATE.update(ok=False, why="", build_s=0.0)
    setting = os.environ.get(KERNELS_ENV, "on").lower()
    if setting == "off":
        _STATE["why"] = f"${KERNELS_ENV}=off"
        return
    cflags = build_flags()
    _STATE["isa"] = "" if cflags is None else "avx512" if "-mavx512f" in cflags else "avx2"
    if cflags is None:
        _STATE["why"] = "this CPU lacks AVX2 and FMA"
        return
    build = _build_dir(cflags)
    lib = build / "paradraft_small_linear.so"
    t0 = time.perf_counter()
    try:
        if lib.is_file():
            torch.ops.load_library(str(lib))
        else:
            print(f"[paradraft] building the CPU decoding kernel into {build} (once per host)", file=sys.stderr,
                  flush=True)
            compile_library("paradraft_small_linear", _SOURCE, build, cflags)
            _STATE["build_s"] = time.perf_counter() - t0
            print(f"[paradraft] built the CPU decoding kernel in {_STATE['build_s']:.1f} s", file=sys.stderr,
                  flush=True)
    except Exception as e:  # no compiler, no ninja, a read-only cache: torch's path instead, said once
        _STATE["why"] = f"it could not be built ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"
        print(f"[paradraft] the CPU decoding kernel is not used: {_STATE['why']}; projections run through torch",
              file=sys.stderr, flush=True)
        return
    _register_fake()
    _STATE["ok"] = True


def _register_fake() -> None:
    """The op's shape rule for torch.compile (the compiled decode step calls it as an opaque kernel)."""
    if _STATE.get("fake"):
        return

    @torch.library.register_fake("paradraft::small_linear")
    def _(x, weights):
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))

    @torch.library.register_fake("paradraft::tile_linear")
    def _(x, tiles):
        return x.new_empty(x.shape[0], sum(t.shape[0] * 16 for t in tiles))

    @torch.library.register_fake("paradraft::decode_attention")
    def _(q, kc, vc, rows, pos, window, scale, sinks):
        return torch.empty_like(q)

    _STATE["fake"] = True


def available() -> bool:
    """Whether the kernel is built and loaded in this process (building it on first call)."""
    if "ok" not in _STATE:
        _load()
    return _STATE["ok"]


def isa() -> str:
    """The instruction set the kernel in this process was built for: "avx512", "avx2", or "" (none here)."""
    return _STATE.get("isa", "") if available() else ""


def status() -> dict:
    """{"used": bool, "why_not": str, "build_s": float, "isa": str}: for benchmarks' JSON."""
    available()
    return {"used": _STATE["ok"], "why_not": _STATE["why"], "build_s": round(_STATE["build_s"], 2), "isa": isa()}


def small_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W_i^T for each weight W_i [N_i, K] -> [M, sum N_i] (see the module docstring)."""
    return torch.ops.paradraft.small_linear(x, weights)


def tiles_available() -> bool:
    """Whether `tile_linear` runs here (the kernel built with AMX, and the OS grants the tile state)."""
    if "tiles" not in _STATE:
        _STATE["tiles"] = available() and bool(torch.ops.paradraft.tiles_ready())
    return _STATE["tiles"]


def pack_tiles(w: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [N, K] packed for `tile_linear`: [N/16, K/32, 16, 32], for each 16 outputs and 32 k one
    contiguous 1 KB AMX tile in its pair layout, [k pair p, output i, 2] = w[i, 2p:2p+2] (a copy). None where it
    cannot be: another dtype or device, N not a multiple of 16 or K of 32, or no tiles on this host."""
    if (w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.shape[0] % 16 or w.shape[1] % 32
            or not tiles_available()):
        return None
    N, K = w.shape
    # [N/16, i, K/32, p, e] -> [N/16, K/32, p, i, e]
    tiles = w.detach().reshape(N // 16, 16, K // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return tiles.reshape(N // 16, K // 32, 16, 32)


def tile_linear(x: torch.Tensor, tiles: list[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W_i^T for each weight packed by `pack_tiles` -> [M, sum N_i] (see the module docstring)."""
    return torch.ops.paradraft.tile_linear(x, tiles)


ATTENTION_QUERIES = 16  # the most queries per row decode_attention takes


def attends(device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `decode_attention` serves attention on this device, dtype and head size (the one rule the verifier's
    runner and the drafter's row attention share): a CPU where the kernel is built, bf16 or float32, head size a
    multiple of 16."""
    return (torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float32) and head_dim % 16 == 0
            and available())


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                     scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of a decoding or verification step on the cache as it is: q [B', n, H, D] (rotated),
    caches kc / vc [B, KVH, S_max, D] holding this step's keys and values, rows [B'] (each query row's cache row),
    pos [B', n] (each query's position: key j is visible when j <= pos, and j > pos - window with a window),
    sinks [H] (a logit per head in the softmax's denominator) -> [B', n, H, D] in q's dtype. Scores, softmax
    and the weighted sum in float32, a task per (row, kv head) with the heads of its group over torch's threads
    (where there are few such tasks: per head on AVX-512 builds, a row's keys split into chunks on AVX2 builds);
    1 <= n <= ATTENTION_QUERIES, D a multiple of 16, bfloat16 or float32."""
    empty = q.new_empty(0, dtype=torch.float32)
    return torch.ops.paradraft.decode_attention(q, kc, vc, rows, pos, int(window), float(scale),
                                                empty if sinks is None else sinks)


# ---- weights on 2 MiB pages
HUGE_PAGES_ENV = "PARADRAFT_HUGE_PAGES"
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MOVED: weakref.WeakSet = weakref.WeakSet()  # modules whose parameters move_to_huge_pages moved


def _madvise_huge(addr: int, nbytes: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(addr, nbytes, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def _arena(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Empty 1-D buffers of these sizes side by side in one allocation that Linux backs with 2 MiB pages (madvise
    MADV_HUGEPAGE before any of it is written, which transparent huge pages in `madvise` mode honour), each starting
    on 64 bytes, the first on a 2 MiB boundary; None where that cannot be (not Linux, less than one huge page in all,
    $PARADRAFT_HUGE_PAGES=off). Its pages are only made as the buffers are written."""
    if os.environ.get(HUGE_PAGES_ENV, "on").lower() == "off" or not sys.platform.startswith("linux"):
        return None
    size = torch.empty((), dtype=dtype).element_size()
    align = max(1, 64 // size)
    spans = [-(-n // align) * align for n in numels]
    total = sum(spans)
    if total * size < _HUGE_PAGE:
        return None
    arena = torch.empty(total + _HUGE_PAGE // size, dtype=dtype)  # not yet touched: no pages yet
    at = (-arena.data_ptr() % _HUGE_PAGE) // size  # the first element on a 2 MiB boundary
    if not _madvise_huge(arena.data_ptr() + at * size, total * size):
        return None
    out = []
    for n, span in zip(numels, spans):
        out.append(arena[at:at + n])
        at += span
    return out


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of these CPU tensors (one dtype) side by side on 2 MiB pages (`_arena`); the tensors themselves where
    that cannot be (another device, mixed dtypes, or `_arena`'s cases).

    Why: a decoding step streams every weight from memory once, and from 4 KiB pages it needs a new page
    translation every 4 KiB. On the 2-core AMX host of BENCHMARKS.md ("The engine at the machine's limit") the
    embedded verifier's projections (269 MB in bf16) streamed at 21.4 against 14.7 GB/s for one row and 18.2
    against 12.7 for four (tile-packed), and plain decoding ran 18% faster in bf16 and 24% in float32."""
    if not tensors or any(t.device.type != "cpu" or t.dtype != tensors[0].dtype for t in tensors):
        return list(tensors)
    slots = _arena([t.numel() for t in tensors], tensors[0].dtype)
    if slots is None:
        return list(tensors)
    return [slot.view(t.shape).copy_(t) for slot, t in zip(slots, tensors)]


@torch.no_grad()
def move_to_huge_pages(module: torch.nn.Module) -> None:
    """Move a module's contiguous CPU parameters (each once: tied ones stay one) onto 2 MiB pages (`_arena`, one
    buffer per dtype; why: `on_huge_pages`), in place: the same Parameter objects and values, their storage moved.
    Once per module (a module first seen with $PARADRAFT_HUGE_PAGES=off stays where it is)."""
    if module in _MOVED:
        return
    _MOVED.add(module)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in module.parameters():
        if p.device.type == "cpu" and p.is_contiguous():
            by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, params in by_dtype.items():
        slots = _arena([p.numel() for p in params], dtype)
        for p, slot in zip(params, slots or ()):
            p.data = slot.view(p.shape).copy_(p.data)  # one at a time: each old storage is freed as it goes (held by
            # nothing else), so a model's resident memory does not double while it moves
