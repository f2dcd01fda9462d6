"""The cpu target's C microkernel (kernels/cpu/mxfp4_matvec.c) and the lowering that dispatches it.

Three levels: the kernel alone (built as a shared library, called through ctypes, against a float64
numpy reference that implements the documented activation format independently), whole layers compiled
for cpu at shapes that exercise its edges (an odd block count, a partial output tile, one expert with 32
rows, top_k 1 and 4, f16 activations and bias; f32 layers stay on the exact linalg matvec), and the build/fallback logic (cached object, no C
compiler, switched off, an artifact that runs after the object is gone).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings (a GPU machine may lack them)")

import mxmoe
import mxmoe.runtime
from mxmoe.compiler import targets as pipeline
from mxmoe.compiler.passes.lowering import cpu_ukernel
from mxmoe.kernels import cpu as ukernels
from mxmoe.core.config import PRESETS
from mxmoe.torch_frontend.moe import MoE

TINY = PRESETS["tiny"]
#: tests of the microkernel path skip where it cannot be built (no C compiler, no AVX2/FMA/F16C), like GPU tests
needs_ukernel = pytest.mark.skipif(ukernels.matvec_object().path is None,
                                   reason=f"no cpu microkernel here: {ukernels.matvec_object().reason}")
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max())


# ------------------------------------------------------------------------------------- the kernel alone
#: the flavors this host runs (each kernel test runs on each of them: the AVX2 one stays tested on AVX-512 hosts)
HOST_FLAVORS = ukernels.host_flavors()


class Kernel(tuple):
    """(matvec, quantizer, grouping) entry points of one flavor; ``bf16``: whether bf16 activations take its
    exact bf16 path (else they are quantized to int16 like the others)."""
    flavor: str
    bf16: bool


@pytest.fixture(scope="module", params=HOST_FLAVORS or ["none"])
def kernel(request):
    """The C file built as a shared library in one flavor."""
    if ukernels.matvec_object().path is None or request.param == "none":
        pytest.skip(f"no microkernel on this host: {ukernels.matvec_object().reason}")
    so = ukernels.shared_library(request.param)
    k = Kernel((getattr(so, ukernels.MATVEC_SYMBOL), getattr(so, ukernels.QUANTIZE_SYMBOL),
                getattr(so, ukernels.GROUP_SYMBOL)))
    k.flavor, k.bf16 = request.param, request.param in ukernels.BF16_FLAVORS
    return k


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [R, K] f32 -> the kernels' (xq [R, 64 np] int16, xs [R, nb padded to 8] f32), from the format's
    description in the C file, and the values they stand for ([R, K] float64, natural order)."""
    R, K = x.shape
    nb = K // 32
    npairs = (nb + 1) // 2
    blocks = x.reshape(R, nb, 32).astype(np.float64)
    m = np.abs(blocks).max(2)
    e = np.clip(np.floor(np.log2(np.where(m > 0, m, 2.0 ** -127))), -100, 127)  # an all-zero block: E = -100
    q = np.clip(np.rint(blocks * np.exp2(14 - e)[..., None]), -32767, 32767).astype(np.int16)
    qp = np.zeros((R, 2 * npairs, 32), np.int16)
    qp[:, :nb] = q
    xq = qp.reshape(R, npairs, 2, 4, 8).transpose(0, 1, 3, 2, 4).reshape(R, -1)  # [pair][j][block of pair][8]
    xs = np.zeros((R, -(-nb // 8) * 8), np.float32)
    xs[:, :nb] = np.exp2(e - 14 - 9)  # the decode's int16 are 512 x the value
    x_hat = (q * np.exp2(e - 14)[..., None]).reshape(R, K)
    return np.ascontiguousarray(xq), xs, x_hat


memref = ukernels.memref_args


def c_quantize(fn, x: np.ndarray, order: np.ndarray, div: int, kind: int = 2, rows_per_wg: int = 3,
               nvalid: int | None = None):
    """The C quantizer over every workgroup: sorted row p < nvalid (default: all) from x[order[p] // div]."""
    S, K = len(order), x.shape[-1]
    nb = K // 32
    xq = np.full((S, 64 * ((nb + 1) // 2)), 0x5A5A, np.int16)  # poison: every element must be written
    xs = np.full((S, -(-nb // 8) * 8), np.nan, np.float32)
    counts = np.array([0, S if nvalid is None else nvalid], np.int32)
    for wg in range(-(-S // rows_per_wg)):
        fn(*memref(x), *memref(order), *memref(counts), *memref(xq), *memref(xs), ctypes.c_size_t(K),
           ctypes.c_size_t(div), ctypes.c_size_t(kind), ctypes.c_size_t(rows_per_wg), ctypes.c_size_t(wg))
    return xq, xs


c_group = ukernels.group_slots


def run_kernel(fns, x, w, s, bias, bias_kind, rows, tile_n=64, deinterleave=False, idle=0, x_kind=2, chunk=64,
               glu=None, out_dt=np.float32):
    """Every workgroup of one grouped matvec: experts 0.. get ``rows`` rows each, in order, then ``idle``
    rows of no expert (ids from mxmoe_group_slots, work items of at most ``chunk`` rows); the sorted rows go
    to the slots of a fixed random permutation, and the result is returned in sorted order. ``x`` is f32
    (x_kind 2: the int16 path) or bf16-exact values given as bf16 (x_kind 1: the bf16 path where the
    flavor has it). ``glu``: (activation, alpha, limit) of the GLU epilogue (with deinterleave), whose
    [S, N / 2] of ``out_dt`` is then the result."""
    matvec, quant, group = fns
    E, N, kh = w.shape
    K = 2 * kh
    S = x.shape[0]
    assert S == sum(rows) + idle
    ids = np.concatenate([np.full(r, u, np.int32) for u, r in enumerate(rows)] + [np.full(idle, -1, np.int32)])
    perm = np.random.default_rng(S).permutation(S)  # sorted row p lives in slot perm[p]
    slot_ids = np.empty_like(ids)
    slot_ids[perm] = ids
    order, info, counts = c_group(group, slot_ids, E, chunk)
    slots = np.empty_like(x)
    slots[perm] = x
    raw = torch.from_numpy(np.ascontiguousarray(slots)).bfloat16().view(torch.int16).numpy() if x_kind == 1 else slots
    xq, xs = c_quantize(quant, np.ascontiguousarray(raw), order, 1, kind=x_kind, nvalid=int(counts[1]))
    out = np.full((S, N // 2 if glu else N), np.nan, np.float32).astype(out_dt if glu else np.float32)
    el = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(np.dtype(out_dt), "bf16")
    epilogue = [ctypes.c_size_t(v) for v in cpu_ukernel.glu_scalars(glu, el)]
    for u in range(min(S, E) + S // chunk + 1):  # item `items` zeroes the idle rows; later ones return at once
        for t in range(-(-N // tile_n)):
            matvec(*memref(xq), *memref(xs), *memref(w), *memref(s), *memref(bias), *memref(info), *memref(counts),
                   *memref(order), *memref(out), ctypes.c_size_t(S), ctypes.c_size_t(N), ctypes.c_size_t(K),
                   ctypes.c_size_t(x_kind), ctypes.c_size_t(bias_kind),
                   ctypes.c_size_t(cpu_ukernel.gate_up_order(deinterleave, glu)),
                   ctypes.c_size_t(tile_n), ctypes.c_size_t(t), ctypes.c_size_t(u), *epilogue)
    return out[perm]


@pytest.mark.parametrize("K,kind", [(96, 2), (64, 1), (2880, 3), (160, 1), (544, 2), (224, 1), (2880, 1)])
def test_c_quantizer_matches_the_format(kernel, K, kind):
    """Exactly the documented int16 values and scales, in the documented order, for an odd and an even
    block count, every activation kind, rows gathered through order / div; values from 2^-110 to 2^100.
    bf16 rows on the bf16 path: the bf16 bits themselves, in the order the decode produces."""
    g = torch.Generator().manual_seed(K)
    T, k = 5, 3
    scale = torch.exp2(torch.randint(-110, 100, (T, K // 32, 1), generator=g).float())
    x = (torch.randn(T, K // 32, 32, generator=g) * scale).reshape(T, K)
    x[0, :32] = 0.0  # an all-zero block
    dt = {1: torch.bfloat16, 2: torch.float32, 3: torch.float16}[kind]
    if kind == 3:
        x = x.clamp(-6e4, 6e4)
    xt = x.to(dt)
    raw = xt.view(torch.int16).numpy() if kind != 2 else xt.numpy()
    order = np.random.default_rng(K).permutation(T * k).astype(np.int32)
    xq, xs = c_quantize(kernel[1], np.ascontiguousarray(raw), order, k, kind)
    if kind == 1 and kernel.bf16:
        np.testing.assert_array_equal(xq, pack_bf16(raw[order // k]))
        return
    want_q, want_s, _ = quantize(xt.float().numpy()[order // k])
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(xs, want_s)


def pack_bf16(rows: np.ndarray) -> np.ndarray:
    """bf16 rows [R, K] (as int16) in the bf16 path's order: per quad of blocks 4j..4j+3, four planes of 32 values,
    plane n holding in word i value c + 16 (n % 2), c = 2 (i % 8) + n // 2, of block 4j + i // 8; the last K / 32 % 4
    blocks per pair, values 0..15 of both blocks, then values 16..31 of both (zeros for a missing last block)."""
    R, K = rows.shape
    nb = K // 32
    nq = nb // 4
    i = np.arange(32)
    planes = [(i // 8) * 32 + 2 * (i % 8) + n // 2 + 16 * (n % 2) for n in range(4)]
    quads = rows[:, : 128 * nq].reshape(R, nq, 128)[:, :, np.concatenate(planes)].reshape(R, -1)
    rest = nb - 4 * nq
    blocks = np.zeros((R, rest + rest % 2, 2, 16), np.int16)
    blocks[:, :rest] = rows[:, 128 * nq :].reshape(R, rest, 2, 16)
    pairs = blocks.reshape(R, -1, 2, 2, 16).transpose(0, 1, 3, 2, 4).reshape(R, -1)
    return np.concatenate([quads, pairs], axis=1)


@pytest.mark.parametrize("S,E,invalid,chunk", [(0, 4, 0.0, 64), (1, 32, 0.0, 64), (7, 4, 0.5, 64), (4, 4, 1.0, 64),
                                               (4096, 32, 0.3, 64), (300, 128, 0.0, 64), (64, 8, 0.0, 64),
                                               (200, 8, 0.0, 16), (129, 8, 0.0, 64)])
def test_c_grouping_is_a_stable_counting_sort(kernel, S, E, invalid, chunk):
    """order = the valid slots by expert, each expert's in slot order (a stable sort), then the slots whose
    id is outside [0, E) (-1, E, large, negative) in slot order; the work items cover each used expert's
    rows in order, in ceil(rows / chunk) pieces whose sizes differ by at most one; counts = (items, valid
    slots); the table past the items is zero."""
    rng = np.random.default_rng(S + E)
    ids = rng.integers(0, E, S).astype(np.int32)
    if S in (64, 129):
        ids[:] = 3  # every slot on one expert (129: three items of 43)
    bad = rng.random(S) < invalid
    ids[bad] = rng.choice(np.array([-1, E, E + 5, -1000, 2**31 - 1], np.int32), bad.sum())
    order, info, counts = c_group(kernel[2], ids, E, chunk)
    valid = (ids >= 0) & (ids < E)
    want = np.concatenate([np.flatnonzero(valid)[np.argsort(ids[valid], kind="stable")], np.flatnonzero(~valid)])
    np.testing.assert_array_equal(order, want)
    used, rows = np.unique(ids[valid], return_counts=True)
    items = [(int(info[2 * i]), int(info[2 * i + 1]) & 0xFFFFFFFF, int(info[2 * i + 1]) >> 32) for i in range(counts[0])]
    assert counts[1] == valid.sum()
    first = 0
    for e, r in zip(used, rows):
        mine = [it for it in items if it[1] == e]
        assert len(mine) == -(-r // chunk) and max(m[2] for m in mine) - min(m[2] for m in mine) <= 1
        for start, _, n in mine:
            assert start == first and 0 < n <= chunk
            first += n
    assert len(items) == sum(-(-r // chunk) for r in rows) and first == valid.sum()
    assert (info[2 * counts[0]:] == 0).all()


def test_c_grouping_is_linear_in_slots(kernel):
    """A million slots group in milliseconds (the quadratic form this replaced took minutes there)."""
    import time

    ids = np.random.default_rng(0).integers(-1, 32, 2**20).astype(np.int32)
    c_group(kernel[2], ids[:1024], 32)
    t0 = time.perf_counter()
    order, _, counts = c_group(kernel[2], ids, 32)
    elapsed = time.perf_counter() - t0
    assert counts[1] == (ids >= 0).sum() and np.array_equal(np.sort(order), np.arange(len(ids)))
    assert elapsed < 1.0, elapsed


def test_c_quantizer_non_finite_blocks(kernel):
    """A block holding inf or NaN: zeros and a NaN scale; the other blocks of the row are unaffected."""
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    x[0, 40], x[1, 100] = float("inf"), float("nan")
    xq, xs = c_quantize(kernel[1], x.numpy(), np.arange(2, dtype=np.int32), 1)
    want_q, want_s, _ = quantize(np.nan_to_num(x.numpy(), posinf=0.0, nan=0.0))
    bad = {(0, 1), (1, 3)}
    for r in range(2):
        for blk in range(4):
            pair, lane = divmod(blk, 2)
            sel = np.zeros(xq.shape[1], bool)
            sel[64 * pair:64 * pair + 64] = (np.arange(64) // 8) % 2 == lane
            if (r, blk) in bad:
                assert np.isnan(xs[r, blk]) and (xq[r, sel] == 0).all()
            else:
                assert xs[r, blk] == want_s[r, blk] and (xq[r, sel] == want_q[r, sel]).all()


def reference(x, w, s, bias_f32, rows, magnitude=False):
    """float64: x @ dequant(w[e])^T + bias[e] for each expert's rows (blocksplit layout); with ``magnitude``
    the sums of the products' magnitudes instead (what bounds an f32 accumulation's error)."""
    E, N, kh = w.shape
    K = 2 * kh
    out = np.zeros((x.shape[0], N))
    first = 0
    for u, r in enumerate(rows):
        b = w[u].reshape(N, K // 32, 16)
        dec = np.concatenate([E2M1[b & 15], E2M1[b >> 4]], axis=2) * np.exp2(s[u].astype(np.float64) - 127)[..., None]
        xr, dec = x[first:first + r].astype(np.float64), dec.reshape(N, K)
        out[first:first + r] = np.abs(xr) @ np.abs(dec).T if magnitude else xr @ dec.T + bias_f32[u]
        first += r
    return out


@pytest.mark.parametrize("x_kind", [2, 1], ids=["f32-int16", "bf16"])
@pytest.mark.parametrize("out", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_glu_epilogue_is_the_reference_glu(kernel, x_kind, out, interleaved, glu_io):
    """The GLU epilogue (gate/up rows interleaved or in halves, bias; the bf16 path's item forms: matvec (2 rows: its
    weight rows prefetched as one stream where adjacent; 5 rows) and GEMM (13); an expert with no rows, slots with
    no expert, a partial last tile, tile_n 64) against the reference's rounding and GLU applied to the same kernel's
    f32 result, for every activation it has; gate and up reach past the clamps."""
    E, N, K = 4, 160, 96
    rng = np.random.default_rng(12)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(121, 127, (E, N, K // 32), dtype=np.uint8)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    rows = [2, 0, 13, 5]
    x = (3 * torch.randn(23, K, generator=torch.Generator().manual_seed(7))).bfloat16().float().numpy()
    h = run_kernel(kernel, x, w, s, bias, 2, rows, idle=3, x_kind=x_kind)
    assert 0.1 < np.mean(np.abs(h[:20]) > 7) < 0.9  # both sides of the clamps
    for glu in glu_io.cases:
        got = run_kernel(kernel, x, w, s, bias, 2, rows, deinterleave=interleaved, idle=3, x_kind=x_kind, glu=glu,
                         out_dt=glu_io.dtypes[out])
        glu_io.check(got[:20], h[:20], glu, interleaved)
        assert (got[20:].astype(np.float32) == 0).all()  # the slots with no expert


@pytest.mark.parametrize("x_kind", [2, 1], ids=["f32-int16", "bf16"])
@pytest.mark.parametrize("E,N,K,rows,bias_kind,tile_n", [
    (3, 96, 96, [1, 3, 5], 1, 64),     # 3 blocks (a lone last block), bf16 bias; bf16 path: matvecs of 1, 3, 5 rows
    (2, 64, 64, [8, 4], 2, 32),        # f32 bias, one pair; 8 rows: the bf16 path's widest single matvec pass
    (4, 128, 2880, [1, 2, 10, 13], 3, 64),  # gpt-oss K (90 blocks), f16 bias; 10: two matvec passes; 13: GEMM
    (2, 69, 160, [7, 1], 0, 64),       # no bias, 5 blocks, N not a multiple of the tile: a last tile of 5 outputs
    (5, 32, 64, [32], 1, 32),          # one expert with 32 rows (8 groups), four idle expert slots
    (2, 36, 3232, [70, 3], 2, 32),     # 101 blocks: the bf16 GEMM decodes K in two chunks; 70 rows: two items
    (3, 40, 224, [3, 11, 14], 1, 32),  # 7 blocks: one quad, a pair and a lone block; passes of 5 + 6; GEMM 4+4+4+2
    (3, 80, 1056, [37, 16, 6], 1, 64),  # 33 blocks (AMX: K chunks of 6 or 10 pairs, a lone last block); 37 rows: three
                                        # 16-row tile groups, the last partial; a last output tile of 16
])
def test_kernel_matches_float64(kernel, E, N, K, rows, bias_kind, tile_n, x_kind):
    """Exact arithmetic up to f32 accumulation: against float64 on the values the kernel was given (the
    bf16 activations themselves on the bf16 path, their int16 rounding on the other)."""
    rng = np.random.default_rng(E * N + K)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(118, 132, (E, N, K // 32), dtype=np.uint8)
    b32 = rng.standard_normal((E, N)).astype(np.float32)
    if bias_kind == 1:
        bt = torch.from_numpy(b32).bfloat16()
        bias, bias_f32 = bt.view(torch.int16).numpy(), bt.float().numpy()
    elif bias_kind == 3:
        bias, bias_f32 = b32.astype(np.float16), b32.astype(np.float16).astype(np.float32)
    elif bias_kind == 2:
        bias, bias_f32 = b32, b32
    else:
        bias, bias_f32 = np.zeros(1, np.float32), np.zeros_like(b32)
    x = torch.randn(sum(rows), K, generator=torch.Generator().manual_seed(K)).bfloat16().float().numpy()
    out = run_kernel(kernel, x, w, s, bias, bias_kind, rows, tile_n, x_kind=x_kind)
    ref = reference(x if x_kind == 1 and kernel.bf16 else quantize(x)[2], w, s, bias_f32, rows)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-6


@pytest.mark.parametrize("deinterleave", [False, True])
def test_kernel_zeroes_the_rows_of_slots_with_no_expert(kernel, deinterleave):
    """Slots with no expert (sorted after the valid ones) get an output row of zeros, no bias, and every
    other row is as without them."""
    E, N, K = 3, 128, 96
    rng = np.random.default_rng(8)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(120, 130, (E, N, K // 32), dtype=np.uint8)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(9)).bfloat16().float().numpy()
    out = run_kernel(kernel, x, w, s, bias, 2, [2, 3], tile_n=32, deinterleave=deinterleave, idle=4)
    alone = run_kernel(kernel, x[:5], w, s, bias, 2, [2, 3], tile_n=32, deinterleave=deinterleave)
    assert (out[5:] == 0).all()
    np.testing.assert_array_equal(out[:5], alone)
    everyone_idle = run_kernel(kernel, x[:3], w, s, bias, 2, [], tile_n=32, deinterleave=deinterleave, idle=3)
    assert (everyone_idle == 0).all()


def test_kernel_deinterleaves_gate_up_rows(kernel):
    """With deinterleave, output o lands in column o / 2 (even o) or N / 2 + o / 2 (odd o)."""
    E, N, K = 2, 192, 96
    rng = np.random.default_rng(5)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(120, 130, (E, N, K // 32), dtype=np.uint8)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(6)).bfloat16().float().numpy()
    plain = run_kernel(kernel, x, w, s, bias, 2, [2, 3])
    split = run_kernel(kernel, x, w, s, bias, 2, [2, 3], deinterleave=True)
    np.testing.assert_array_equal(split, np.concatenate([plain[:, 0::2], plain[:, 1::2]], axis=1))


@pytest.mark.parametrize("x_kind", [2, 1], ids=["f32-int16", "bf16"])
@pytest.mark.parametrize("rows", [2, 7, 13], ids=["matvec2", "matvec7", "gemm"])
@pytest.mark.parametrize("K", [256, 352], ids=["quads", "quads-pair-lone"])
def test_kernel_every_code_nan_scale_and_small_activations(kernel, rows, x_kind, K):
    """All 256 weight bytes, scale bytes 0 (2^-127), 1, 2, 252 and 255 (NaN) beside ordinary ones, and
    activations spanning 2^-20..2^6 within a block. int16 path: a bf16 value within 2^7 of its block's
    largest is exact in int16, smaller ones are rounded to 2^-15 of that power of two at most. bf16 path:
    exact (a row with scale bytes outside 2..252 takes the f32 decode, which loses only bf16 subnormals:
    here the 2^-127-scaled block, ~1e-38 of the output)."""
    N = 64
    w = (np.arange(N * K // 2) % 256).astype(np.uint8).reshape(1, N, K // 2)
    s = np.full((1, N, K // 32), 127, np.uint8)
    s[0, :32, 1] = 0
    s[0, 40:, 2] = np.array([1, 2, 130, 252, 120, 125, 2, 131] * 3)[:24]
    s[0, 5, 3] = 255  # output 5 reads a NaN scale
    if K > 256:  # the same in the blocks after the last quad (a pair and a lone block)
        s[0, 8:16, 9] = [0, 1, 2, 252, 0, 130, 1, 2]
        s[0, 16:24, 10] = [252, 0, 1, 2, 127, 130, 120, 252]
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
    x = x * torch.exp2(torch.randint(-20, 7, (rows, K), generator=torch.Generator().manual_seed(2)))
    x[:, 64:96] *= 2.0**-90  # block 2 meets the largest scales: keep its products in f32 range
    x[:, 288:] *= 2.0**-90  # blocks 9 and 10 too
    x = x.bfloat16().float().numpy()
    out = run_kernel(kernel, x, w, s, np.zeros(1, np.float32), 0, [rows], x_kind=x_kind)
    ref = reference(x, w, np.where(s == 255, 127, s), np.zeros((1, N)), [rows])
    assert np.isnan(out[:, 5]).all()
    keep = np.arange(N) != 5
    err = np.abs(out[:, keep] - ref[:, keep])
    if x_kind == 1 and kernel.bf16:  # f32 accumulation of exact products, per output
        mag = reference(x, w, np.where(s == 255, 127, s), np.zeros((1, N)), [rows], magnitude=True)
        bound = K * 2.0**-24 * mag[:, keep] + 1e-30
    else:  # per output: 32 products per block, each activation off by at most half a step of its block
        steps = np.exp2(np.floor(np.log2(np.abs(x.reshape(rows, -1, 32)).max(2))) - 15)  # [rows, blocks]
        wscale = np.exp2(s[0, keep].astype(np.float64) - 127)  # [outputs, blocks]
        bound = 6 * 32 * steps @ wscale.T + 1e-6 * np.abs(ref[:, keep])
    assert (err <= bound).all()


# ------------------------------------------------------------------------------ whole layers, compiled
AWKWARD = {
    # hidden 96 = 3 blocks (a lone last block in the kernel), w13 N = 192 = 3 tiles, w2 N = 96 = 1.5 tiles
    "odd-blocks-bias": TINY.replace(hidden=96, intermediate=96, num_experts=8, top_k=4),
    "top1-nobias": TINY.replace(top_k=1, bias=False, routing="softmax_topk"),
    "gate-up-split-silu": TINY.replace(interleaved=False, activation="silu"),
}


@needs_ukernel
@pytest.mark.parametrize("name", list(AWKWARD))
def test_awkward_layers_through_the_microkernel(name, flavor):
    moe = MoE.random(AWKWARD[name], seed=21)
    cm = mxmoe.compile(moe, target="cpu")
    # bf16 layers: the blocksplit matvec, or on AMX hosts the rows16 form (test_cpu_bf16_rows16.py)
    symbol = ukernels.BF16_ROWS16_SYMBOL if ukernels.bf16_layout(flavor) == "rows16" else ukernels.MATVEC_SYMBOL
    assert "stream.executable" in cm.mlir and symbol in cm.mlir
    assert f"mxfp4_matvec-{flavor}-" in cm.mlir
    for T in (1, 2, 5, 32, 65):
        x = torch.randn(T, moe.config.hidden, generator=torch.Generator().manual_seed(T)).bfloat16()
        assert rel_err(cm(x), moe(x)) < 1e-2, (name, T)


def test_f32_layers_keep_the_exact_linalg_matvec():
    """int16 activations would show at f32 precision: an f32 layer is lowered without the microkernel and
    matches the reference to f32 accuracy."""
    moe = MoE.random(TINY, seed=22, dtype=torch.float32)
    cm = mxmoe.compile(moe, target="cpu")
    assert "stream.executable" not in cm.mlir
    for T in (1, 7):
        x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(T))
        assert rel_err(cm(x), moe(x)) < 1e-5, T


@needs_ukernel
@pytest.mark.parametrize("hidden,experts,top_k", [(64, 4, 2), (512, 8, 2)])
def test_microkernel_layers_round_where_the_reference_rounds(hidden, experts, top_k, flavor):
    """The GLU and combine round the kernel's f32 rows to bf16 themselves; if that rounding were lost (an
    extf(truncf(x)) pair is folded away by IREE's bf16 handling) the error would stay under any loose
    tolerance, but most outputs would stop matching the reference bit for bit: measured 97-99% identical
    with the rounding, 38% without."""
    cfg = TINY.replace(hidden=hidden, intermediate=hidden, num_experts=experts, top_k=top_k)
    moe = MoE.random(cfg, seed=4)
    cm = mxmoe.compile(moe, target="cpu")
    x = torch.randn(16, hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    out, ref = cm(x), moe(x)
    assert (out.view(torch.int16) == ref.view(torch.int16)).float().mean().item() > 0.9


@needs_ukernel
def test_f16_layer_through_the_microkernel():
    moe = MoE.random(TINY, seed=26, dtype=torch.float16)
    cm = mxmoe.compile(moe, target="cpu")
    assert "memref<?xf16>, memref<?xi64>" in cm.mlir  # the f16 bias reaches the kernel as f16
    for T in (1, 7):
        x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(T)).half()
        assert rel_err(cm(x), moe(x)) < 1e-2, T


# --------------------------------------------------------------------------------- build and fallback
#: instructions each flavor's object must hold (its GEMM and matvec) and must not (those of a better flavor)
FLAVOR_ISA = {"avx512amx": ({"tdpbf16ps", "ldtilecfg", "tilerelease", "vdpbf16ps", "vpdpbusd"}, set()),
              "avx512bf16": ({"vdpbf16ps", "vpdpbusd"}, {"tdpbf16ps", "ldtilecfg"}),
              "avx2": ({"vpmaddwd", "vpmaddubsw"}, {"vdpbf16ps", "tdpbf16ps", "vpdpbusd"})}


@pytest.mark.parametrize("flavor_name", list(ukernels.FLAVORS))
def test_each_flavor_emits_its_instructions(flavor_name, tmp_path):
    """What each flavor's object holds, checked in its disassembly on any x86-64 host with a C compiler (the
    AMX and AVX-512 ones are built, not run, where the CPU lacks them)."""
    cc, objdump = ukernels._compiler(), shutil.which("objdump")
    if cc is None or objdump is None or os.uname().machine != "x86_64":
        pytest.skip("needs an x86-64 host with a C compiler and objdump")
    obj = tmp_path / f"{flavor_name}.o"
    built = subprocess.run([cc, *ukernels.BASE_CFLAGS, *ukernels.FLAVORS[flavor_name][1], "-c", str(ukernels.SOURCE),
                            "-o", str(obj)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"{cc} does not build the {flavor_name} flavor: {built.stderr.strip()[:200]}")
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split("\t") for line in asm.splitlines()]  # "   30c60:\tldtilecfg 0x400(%rsp)"
    mnemonics = {r[1].split()[0] for r in rows if len(r) > 1 and r[0].strip().endswith(":") and r[1].strip()}
    must, must_not = FLAVOR_ISA[flavor_name]
    assert must <= mnemonics, f"{flavor_name} lacks {sorted(must - mnemonics)}"
    assert not (must_not & mnemonics), f"{flavor_name} holds {sorted(must_not & mnemonics)}"


def test_object_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path))
    ukernels.matvec_object.cache_clear()
    try:
        first = ukernels.matvec_object()
        if first.path is None:
            pytest.skip(first.reason)
        assert first.path.startswith(str(tmp_path)) and first.path.endswith(".o")
        mtime = os.stat(first.path).st_mtime_ns
        ukernels.matvec_object.cache_clear()
        again = ukernels.matvec_object()
        assert again.path == first.path and os.stat(again.path).st_mtime_ns == mtime
    finally:
        ukernels.matvec_object.cache_clear()


def test_without_a_c_compiler_the_linalg_matvec_is_used_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(ukernels, "_compiler", lambda: None)
    ukernels.matvec_object.cache_clear()
    pipeline._warn_once.cache_clear()
    try:
        assert "no C compiler" in ukernels.matvec_object().reason
        moe = MoE.random(TINY, seed=23)
        with pytest.warns(UserWarning, match="microkernel is not available .*no C compiler"):
            cm = mxmoe.compile(moe, target="cpu")
        assert "stream.executable" not in cm.mlir
        assert cm.save(tmp_path / "layer.mxmoe")["target"]["cpu_microkernel"] is False
        x = torch.randn(3, TINY.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
        assert rel_err(cm(x), moe(x)) < 1e-2
    finally:
        ukernels.matvec_object.cache_clear()


def test_switched_off_by_environment(linalg_matvec):
    assert ukernels.matvec_object().path is None and "MXMOE_CPU_UKERNEL" in ukernels.matvec_object().reason
    cm = mxmoe.compile(MoE.random(TINY, seed=24), target="cpu")
    assert "stream.executable" not in cm.mlir


@needs_ukernel
def test_a_failing_compiler_is_reported(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: no such thing' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MXMOE_CC", str(fake))
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "cache"))
    ukernels.matvec_object.cache_clear()
    try:
        uk = ukernels.matvec_object()
        assert uk.path is None and "failed on mxfp4_matvec.c" in uk.reason and "no such thing" in uk.reason
    finally:
        ukernels.matvec_object.cache_clear()


def test_saved_artifact_runs_without_the_object(tmp_path, monkeypatch):
    """The object is linked into the module: the artifact runs after it is deleted (the deploy machine
    needs no compiler and no cache)."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "cache"))
    ukernels.matvec_object.cache_clear()
    try:
        moe = MoE.random(TINY, seed=25)
        cm = mxmoe.compile(moe, target="cpu")
        obj = ukernels.matvec_object().path
        if obj is None:
            pytest.skip(ukernels.matvec_object().reason)
        manifest = cm.save(tmp_path / "layer.mxmoe")
        assert manifest["target"]["cpu_microkernel"] is True
        os.unlink(obj)
        loaded = mxmoe.runtime.load(tmp_path / "layer.mxmoe")
        x = torch.randn(2, TINY.hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
        assert rel_err(loaded(torch.as_tensor(x)), moe(x)) < 1e-2
    finally:
        ukernels.matvec_object.cache_clear()
