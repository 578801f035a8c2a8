"""paradraft's CPU kernel for few-row projections (kernels/small_linear.cpp) and the rule that picks it (linear.py).

The kernel is built on first use on an AVX-512 host; elsewhere these tests say why they skip and the projections
run through torch (that fallback is what the rest of the suite then exercises).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paradraft import kernels
from paradraft.verifier.linear import KERNEL_ROWS, KERNEL_ROWS_AVX2, TILE_ROWS, kernel_rows, linear, linears, mlp

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"no kernel here: {kernels.status()['why_not']}")
needs_tiles = pytest.mark.skipif(not kernels.tiles_available(), reason="no AMX tiles here (or no kernel)")


def _reference(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """float64 x @ W^T for each weight, side by side: [M, sum N_i]."""
    return torch.cat([x.double() @ w.double().T for w in ws], dim=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33])
def test_kernel_equals_the_product_for_every_row_count_and_tail(dtype, rows):
    """Every row count (1..4: AVX-512; 5..16 in bf16: AMX where the CPU has it; beyond: blocks of rows), weights
    whose rows and inner size are no multiple of the blocks (tails), several weights side by side."""
    g = torch.Generator().manual_seed(rows)
    for k, ns in ((64, [96]), (576, [576, 192, 192]), (100, [7, 33]), (1536, [576]), (48, [16, 5])):
        x = torch.randn(rows, k, generator=g).to(dtype)
        ws = [torch.randn(n, k, generator=g).to(dtype) for n in ns]
        y = kernels.small_linear(x, ws)
        assert y.shape == (rows, sum(ns)) and y.dtype == dtype
        ref = _reference(x, ws)
        # float32 accumulation in another order; bf16 rounds the result once (2^-8 relative)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        scale = ref.abs().max().item()
        assert (y.double() - ref).abs().max().item() <= tol * scale, (k, ns)


@needs_kernel
def test_kernel_refuses_what_it_cannot_compute():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.small_linear(x, [torch.randn(64, 32).T])  # a transposed view
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.small_linear(x, [torch.randn(8, 64).bfloat16()])
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        kernels.small_linear(torch.randn(65, 64), [torch.randn(8, 64)])


@needs_kernel
def test_the_rule_takes_the_kernel_only_where_measured_faster_and_never_for_training():
    """linear(): the kernel for `kernel_rows` rows in inference mode (the engine); one float32 row is torch's own
    product on AVX-512 builds (plain float32 decoding computed as Hugging Face computes it); many rows, and anything
    outside inference mode (training, its no-grad parts): the module (bf16 rows beyond the kernel's in float32 where
    torch has no bf16 GEMM)."""
    from paradraft.utils import bf16_gemm

    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    with torch.inference_mode():
        table = KERNEL_ROWS_AVX2 if kernels.isa() == "avx2" else KERNEL_ROWS
        assert kernels.isa() in ("avx2", "avx512") and kernel_rows(torch.float32) == table[torch.float32]
        for dtype in KERNEL_ROWS:
            lo, hi = kernel_rows(dtype)
            m = nn.Linear(64, 96).to(dtype)
            for rows in (1, 2, 4, 16, 17):
                x = torch.randn(rows, 64).to(dtype)
                got = linear(m, x)
                if lo <= rows <= hi:
                    assert torch.equal(got, kernels.small_linear(x, [m.weight]) + m.bias)
                elif rows > hi and dtype == torch.bfloat16 and not bf16_gemm("cpu"):  # float32 inside
                    assert torch.equal(got, torch.nn.functional.linear(x.float(), m.weight.float(),
                                                                       m.bias.float()).bfloat16())
                else:
                    assert torch.equal(got, m(x))
        x = torch.randn(1, 3, 64)  # one row in float32, any leading shape: torch's own product on AVX-512 builds
        if kernels.isa() == "avx512":
            assert torch.equal(linear(lin, x[:, :1]), lin(x[:, :1]))
        q, k = linears([lin, nn.Linear(64, 32)], x)  # [1, 3, 96], [1, 3, 32]: one call, split
        assert q.shape == (1, 3, 96) and k.shape == (1, 3, 32)
        torch.testing.assert_close(q, lin(x), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # a weight the kernel cannot read in place (a transposed view): the module
        t = nn.Linear(64, 96)
        t.weight = nn.Parameter(torch.randn(64, 96).T)
        x = torch.randn(4, 64)
        assert torch.equal(linear(t, x), t(x))
    x = torch.randn(4, 64)
    assert torch.equal(linear(lin, x), lin(x))  # autograd recording (training): the module's own bits
    with torch.no_grad():  # training's no-grad work (partitioning's context keys, validation): the module too
        assert torch.equal(linear(lin, x), lin(x))


def test_kernel_off_by_environment_is_said(monkeypatch):
    """$PARADRAFT_KERNELS=off: never built or used, and status says why."""
    saved = dict(kernels._STATE)
    monkeypatch.setenv(kernels.KERNELS_ENV, "off")
    kernels._STATE.clear()
    try:
        assert not kernels.available()
        assert kernels.status() == {"used": False, "why_not": f"${kernels.KERNELS_ENV}=off", "build_s": 0.0,
                                    "isa": ""}
        with torch.inference_mode():
            lin, x = nn.Linear(64, 96), torch.randn(4, 64)
            assert torch.equal(linear(lin.bfloat16(), x.bfloat16()), lin(x.bfloat16()))
    finally:
        kernels._STATE.clear()
        kernels._STATE.update(saved)


def test_compile_flags_follow_the_cpu():
    """Built only where it can run: AVX-512 F/BW/VL, its bf16 and AMX paths only where the CPU has them; else AVX2
    and FMA (small_linear alone); nothing below that."""
    assert kernels._compile_flags({"sse4_2", "avx"}) is None and kernels._compile_flags({"avx2"}) is None
    assert kernels._compile_flags({"avx2", "fma"}) == ["-O3", "-fopenmp", "-mavx2", "-mfma"]
    assert not any("avx512" in f for f in kernels._compile_flags({"avx2", "fma", "avx512f"}))  # F alone is not enough
    base = {"avx512f", "avx512bw", "avx512vl", "fma"}
    assert "-mavx512bf16" not in kernels._compile_flags(base)
    assert "-mavx512bf16" in kernels._compile_flags(base | {"avx512_bf16"})
    assert "-mamx-bf16" in kernels._compile_flags(base | {"avx512_bf16", "amx_tile", "amx_bf16"})
    assert "-mamx-bf16" not in kernels._compile_flags(base | {"amx_tile"})


def test_build_flags_take_the_avx2_build_where_asked(monkeypatch):
    """$PARADRAFT_KERNELS=avx2 builds the AVX2 variant on a CPU that has AVX-512 and AMX (the engine and
    benchmarks/bench_kernel_ab.py build with the same flags)."""
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                        "avx512_bf16", "amx_tile", "amx_bf16"})
    monkeypatch.setenv(kernels.KERNELS_ENV, "on")
    assert "-mamx-bf16" in kernels.build_flags()
    monkeypatch.setenv(kernels.KERNELS_ENV, "avx2")
    assert kernels.build_flags() == ["-O3", "-fopenmp", "-mavx2", "-mfma"]


_AVX2_CHECK = """
import torch
from paradraft import kernels
assert kernels.available(), kernels.status()
assert not kernels.tiles_available()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for M in (1, 2, 3, 4, 5, 16, 64):
        for K in (8, 13, 24, 576, 1545):  # a vector, a tail, 16 + 8, the model's, 96 x 16 (48 x 32) + 8 + 1
            x = torch.randn(M, K, generator=g).to(dtype)
            ws = [torch.randn(37, K, generator=g).to(dtype), torch.randn(64, K, generator=g).to(dtype)]
            ref = torch.cat([x.double() @ w.double().T for w in ws], dim=-1)
            err = (kernels.small_linear(x, ws).double() - ref).abs().max() / ref.abs().max()
            assert err < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, M, K, float(err))
import test_kernels  # the attention's cases, against the softmax in float64
for dtype in (torch.float32, torch.bfloat16):
    for D in (32, 48, 64, 128):
        test_kernels.test_decode_attention_equals_softmax_attention(dtype, D)
print("avx2 ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma"} <= kernels._cpu_flags(), reason="no AVX2 and FMA here")
def test_the_avx2_build_equals_the_product_and_the_softmax_attention(tmp_path):
    """The AVX2 variant ($PARADRAFT_KERNELS=avx2; what a CPU without AVX-512 builds) in its own process: built,
    no tiles, small_linear equal to the float64 product for 1..64 rows and K off its 8- and 16-lane steps, and
    decode_attention through the same cases as the AVX-512 build's."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{kernels.KERNELS_ENV: "avx2"})
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "avx2 ok" in out.stdout, out.stderr[-3000:]


def test_bf16_prefill_rows_in_float32_only_where_torch_has_no_bf16_gemm(monkeypatch):
    """bf16 rows beyond the kernel's: where torch has no oneDNN bf16 GEMM, the product in float32 rounded once (equal
    to the float64 product within one bf16 rounding); where it has one, and outside inference, the module itself."""
    from paradraft import utils

    torch.manual_seed(0)
    lin = nn.Linear(96, 40).bfloat16()
    x = torch.randn(2, 25, 96).bfloat16()  # 50 rows: beyond the kernel's 16
    ref = (x.double() @ lin.weight.double().T + lin.bias.double()).bfloat16()  # [2, 25, 40]
    monkeypatch.setitem(utils._BF16_GEMM, "cpu", False)
    with torch.inference_mode():
        got = linear(lin, x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 25, 40)
    assert ((got.double() - ref.double()).abs() <= ref.double().abs() * 2 ** -7 + 1e-6).all()  # one bf16 ulp
    with torch.no_grad():  # training's no-grad work: the module as it is
        assert torch.equal(linear(lin, x), lin(x))
    monkeypatch.setitem(utils._BF16_GEMM, "cpu", True)
    with torch.inference_mode():
        assert torch.equal(linear(lin, x), lin(x))


def test_projection_through_the_rule_equals_torch_within_rounding():
    """Whatever path this host takes (kernel or not), a few rows of a projection equal torch's within rounding."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 80)
    with torch.inference_mode():
        for rows in (1, 3, 8):
            x = torch.randn(rows, 128)
            torch.testing.assert_close(linear(lin, x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_pack_tiles_refuses_what_tile_linear_cannot_read():
    """None (the weights stay where they are) for another dtype, or shapes off the tile grid."""
    assert kernels.pack_tiles(torch.randn(32, 64)) is None  # float32
    assert kernels.pack_tiles(torch.randn(24, 64).bfloat16()) is None  # rows not a multiple of 16
    assert kernels.pack_tiles(torch.randn(32, 48).bfloat16()) is None  # inner size not a multiple of 32


@needs_tiles
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16, 17, 32, 33, 70])
def test_tile_linear_equals_the_product(rows):
    """Weights packed in the AMX tile layout: an even and an odd number of 16-row blocks (pairs and the last
    one alone), one and several weights side by side, inner sizes of 1 and several k pairs of slices; 17..32 rows
    in two groups, beyond in groups of 32 (the last padded)."""
    g = torch.Generator().manual_seed(rows)
    for k, ns in ((576, [576, 192, 192]), (64, [48]), (1536, [576]), (32, [16, 32])):
        x = torch.randn(rows, k, generator=g).bfloat16()
        ws = [torch.randn(n, k, generator=g).bfloat16() for n in ns]
        tiles = [kernels.pack_tiles(w) for w in ws]
        assert all(t.shape == (w.shape[0] // 16, k // 32, 16, 32) for t, w in zip(tiles, ws))
        y = kernels.tile_linear(x, tiles)
        assert y.shape == (rows, sum(ns)) and y.dtype == torch.bfloat16
        ref = _reference(x, ws)
        assert (y.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), (k, ns)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        kernels.tile_linear(torch.randn(3, 48).bfloat16(), [torch.zeros(1, 1, 16, 32).bfloat16()])


@needs_tiles
def test_the_rule_takes_packed_weights_for_verification_rows_only():
    """linear()/linears()/mlp() with packed weights: tile_linear for TILE_ROWS bf16 rows in inference mode, the
    kernel on the weights in place for one row, the module outside inference mode."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP

    torch.manual_seed(0)
    m = nn.Linear(64, 96).bfloat16()
    t = [kernels.pack_tiles(m.weight)]
    lo, hi = TILE_ROWS
    with torch.inference_mode():
        for rows in (1, lo, hi, hi + 1):
            x = torch.randn(rows, 64).bfloat16()
            got = linear(m, x, t)
            if lo <= rows <= hi:
                assert torch.equal(got, kernels.tile_linear(x, t) + m.bias)
            elif rows == 1:
                assert torch.equal(got, kernels.small_linear(x, [m.weight]) + m.bias)
            else:
                assert torch.equal(got, m(x))
        block = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128)).bfloat16()
        packed = ([kernels.pack_tiles(block.gate_proj.weight), kernels.pack_tiles(block.up_proj.weight)],
                  [kernels.pack_tiles(block.down_proj.weight)])
        x = torch.randn(1, 4, 64).bfloat16()
        gate, up = (kernels.tile_linear(x[0], packed[0])).split([128, 128], -1)
        want = kernels.tile_linear((block.act_fn(gate) * up).contiguous(), packed[1])
        assert torch.equal(mlp(block, x, packed), want[None])
    x = torch.randn(4, 64).bfloat16()
    assert torch.equal(linear(m, x, t), m(x))  # autograd recording: the module's own bits


@needs_tiles
def test_the_runner_packs_the_verifiers_projections_and_verifies_with_them():
    """A bf16 VerifierRunner holds every projection and the lm_head packed; a 4-token verification step through
    them equals the same step on the weights in place (within bf16 rounding), and decoding one token does not
    read them. It packs on its first decoding or verification step of TILE_ROWS rows: a runner of prefills and
    one-row steps holds no copy. A float32 runner packs nothing. Runners of one model share its packed copy until a
    weight changes."""
    from helpers import make_tiny_llama
    from paradraft.verifier.runner import VerifierRunner

    model = make_tiny_llama(layers=8).bfloat16()
    packed = VerifierRunner(model, [1, 4, 6], max_len=64)
    plain = VerifierRunner(model, [1, 4, 6], max_len=64)
    plain._tiles_pending = False  # the weights in place only
    prompt, step = torch.randint(0, 400, (1, 200)), torch.randint(0, 400, (1, 4))
    with torch.inference_mode():
        one = VerifierRunner(model, [1, 4, 6], max_len=512)
        one.forward(prompt, last_only=True)  # prefills and one-row steps: no packed copy
        one.forward(step[:, :1])
        assert one.head_tiles is None and one.tiles == [None] * 8
        prompt = prompt[:, :9]
        outs = [(r.forward(prompt, last_only=True), r.forward(step[:, :1]), r.forward(step)) for r in (packed, plain)]
    # the verification step packed it
    assert packed.head_tiles is not None and all(t[0] and t[1] and t[2][0] and t[2][1] for t in packed.tiles)
    assert plain.head_tiles is None
    for a, b in zip(*outs):
        for x, y in zip(a, b):  # (logits, aux)
            torch.testing.assert_close(x.float(), y.float(), rtol=0.05, atol=0.05)
    assert torch.equal(outs[0][0][0], outs[1][0][0])  # the prefill never reads them
    assert torch.equal(outs[0][1][0], outs[1][1][0])  # one token: the kernel on the weights in place
    def stepped(m, **kw):  # a runner after one verification step (its first step of TILE_ROWS rows packs)
        r = VerifierRunner(m, [1, 4, 6], max_len=64, **kw)
        with torch.inference_mode():
            r.forward(step)
        return r

    f32 = stepped(make_tiny_llama(layers=8))
    assert f32.head_tiles is None and f32.tiles == [None] * 8
    # one packed copy per model, shared by its runners; a weight changed since is packed again
    again = stepped(model)
    assert again.head_tiles[0] is packed.head_tiles[0] and again.tiles[3][0][0] is packed.tiles[3][0][0]
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    changed = stepped(model)
    assert torch.equal(changed.head_tiles[0], kernels.pack_tiles(model.lm_head.weight))
    assert not torch.equal(changed.head_tiles[0], packed.head_tiles[0])
    with torch.inference_mode():  # a verifier loaded in inference mode (bench loads it so): inference tensors
        loaded = make_tiny_llama(layers=8).bfloat16()
    assert stepped(loaded).head_tiles is not None


def _attention_reference(q, kc, vc, rows, pos, scale, window=0, sinks=None):
    """float64 softmax attention of q [B', n, H, D] over each row's visible cached keys -> [B', n, H, D]."""
    Bq, n, H, D = q.shape
    G = H // kc.shape[1]
    out = torch.zeros(Bq, n, H, D, dtype=torch.float64)
    for b in range(Bq):
        for i in range(n):
            p = int(pos[b, i])
            lo = max(0, p - window + 1) if window else 0
            for h in range(H):
                k = kc[rows[b], h // G, lo:p + 1].double()  # [S, D]
                s = (k @ q[b, i, h].double()) * scale  # [S]
                if sinks is not None:
                    s = torch.cat([s, sinks[h:h + 1].double()])
                w = torch.softmax(s, 0)[:k.shape[0]]
                out[b, i, h] = w @ vc[rows[b], h // G, lo:p + 1].double()
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 48 and 80: a last block of 16 lanes after a full one (32 lanes in AVX2 builds, 64 in AVX-512 ones)
@pytest.mark.parametrize("D", [32, 48, 64, 80, 128])
def test_decode_attention_equals_softmax_attention(dtype, D):
    """Rows of the cache in any order and a subset, 1 and several queries (a verification step's causal
    positions), heads sharing kv heads, key counts off the blocks of 4 and 16, a window, sinks, the cache's last
    keys. In bf16 with D a multiple of 64 every case takes the AMX path (on AMX hosts: a task per kv head of up to 16
    query rows, 1..5 queries x 3 heads; per head for 16 queries), with D = 32 the float32 loops."""
    g = torch.Generator().manual_seed(0)
    B, KVH, S_max, H = 3, 2, 70, 6
    kc = torch.randn(B, KVH, S_max, D, generator=g).to(dtype)
    vc = torch.randn(B, KVH, S_max, D, generator=g).to(dtype)
    sinks5 = torch.randn(H, generator=g)
    for n, rows, starts, window, sinks in ((1, [0, 1, 2], [0, 5, 66], 0, None), (4, [2, 0], [17, 33], 0, None),
                                           (3, [1], [40], 9, None), (5, [0, 2], [3, 50], 0, sinks5),
                                           (16, [1], [51], 0, None), (2, [0, 1, 2, 0], [60, 7, 30, 66], 0, None),
                                           (4, [2], [66], 20, sinks5)):
        q = torch.randn(len(rows), n, H, D, generator=g).to(dtype)
        pos = torch.tensor(starts)[:, None] + torch.arange(n)[None]  # [B', n]
        r = torch.tensor(rows)
        got = kernels.decode_attention(q, kc, vc, r, pos, 0.125, window, sinks)
        assert got.shape == q.shape and got.dtype == dtype
        want = _attention_reference(q, kc, vc, r, pos, 0.125, window, sinks)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output rounded once
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="past the cache"):
        kernels.decode_attention(q, kc, vc, r, pos + S_max, 0.125)
    with pytest.raises(RuntimeError, match="1..16 queries"):
        kernels.decode_attention(torch.zeros(1, 17, H, D, dtype=dtype), kc, vc, r, torch.zeros(1, 17), 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_decode_attention_over_many_keys_on_any_threads(dtype, threads):
    """A batch of one row with 3 kv heads and hundreds of keys: on AVX2 builds each kv head's keys are split into
    chunks across the threads (2 threads: 2 chunks, 4: 4) and their partial softmaxes combined; chunk edges inside a
    window, a window past a chunk, sinks, 1 to 16 queries, and a second row (no split at 2 pairs per thread)."""
    g = torch.Generator().manual_seed(1)
    B, KVH, S_max, H, D = 2, 3, 700, 9, 64
    kc = torch.randn(B, KVH, S_max, D, generator=g).to(dtype)
    vc = torch.randn(B, KVH, S_max, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, rows, starts, window, sk in ((1, [1], [300], 0, None), (4, [0], [517], 0, None),
                                            (16, [1], [130], 0, sinks), (3, [0], [650], 100, None),
                                            (4, [1], [400], 20, sinks), (1, [0], [127], 0, None),
                                            (4, [1, 0], [301, 602], 0, None)):
            q = torch.randn(len(rows), n, H, D, generator=g).to(dtype)
            pos = torch.tensor(starts)[:, None] + torch.arange(n)[None]  # [B', n]
            r = torch.tensor(rows)
            got = kernels.decode_attention(q, kc, vc, r, pos, 0.125, window, sk)
            want = _attention_reference(q, kc, vc, r, pos, 0.125, window, sk)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    finally:
        torch.set_num_threads(before)


def _mapping_fields(addr: int) -> dict[str, str] | None:
    """The fields (AnonHugePages, VmFlags, ...) of the mapping in /proc/self/smaps that holds addr; None where smaps
    is not readable."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    fields: dict[str, str] | None = None
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            if fields is not None:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            fields = {} if lo <= addr < hi else None
        elif fields is not None and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_weights_move_to_huge_pages_keeping_parameters_values_and_ties(monkeypatch):
    torch.manual_seed(0)
    emb = nn.Embedding(2048, 512)  # 4 MiB in float32
    head = nn.Linear(512, 2048, bias=False)
    head.weight = emb.weight  # tied, as the embedded verifier's lm_head
    model = nn.Sequential(emb, nn.Linear(512, 512), head)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    kernels.move_to_huge_pages(model)
    assert list(model.parameters()) == params  # the same Parameter objects (an optimizer's keys, the ties)
    assert model[2].weight is model[0].weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.requires_grad
    ptrs = [p.data_ptr() for p in params]
    assert ptrs[0] % (2 << 20) == 0  # the first on a huge page's boundary, the rest after it in one buffer
    assert all(p % 64 == 0 for p in ptrs) and max(ptrs) - min(ptrs) < 8 << 20
    kernels.move_to_huge_pages(model)  # once per module
    assert [p.data_ptr() for p in params] == ptrs
    fields = _mapping_fields(ptrs[0])
    if fields is not None:  # the buffer's own mapping asks for 2 MiB pages (madvise MADV_HUGEPAGE: "hg"); whether
        # the kernel finds free 2 MiB pages for it (AnonHugePages) depends on the host's memory, not on paradraft
        assert "hg" in fields["VmFlags"].split()
    # too small for one huge page, mixed dtypes, or switched off: the tensors themselves
    small = [torch.ones(10)]
    assert kernels.on_huge_pages(small)[0] is small[0]
    big = [torch.ones(1 << 20), torch.ones(1 << 20, dtype=torch.bfloat16)]
    assert all(a is b for a, b in zip(kernels.on_huge_pages(big), big))
    monkeypatch.setenv(kernels.HUGE_PAGES_ENV, "off")
    big = [torch.ones(1 << 20)]
    assert kernels.on_huge_pages(big)[0] is big[0]
