"""The bf16 form on rows16 weights (kernels/cpu/bf16_rows16.c): what the cpu target gives bf16 layers on AMX hosts.

The kernel alone, built in each AVX512-BF16 flavor this host runs (avx512amx: AMX tiles; avx512bf16: the same
products on vdpbf16ps, the path a kernel that refuses the tile state takes), called through ctypes: the packer's
permuted rows in each work item's bands, the matmul against float64 of the dequantized weights at awkward shapes (row counts of
1-128 per item, the last item's rows running past the buffer, an expert with no rows, slots with no expert, partial
tiles, every e2m1 code, the scale bytes that take the f32 decode), gate/up deinterleaving and the GLU epilogue. Whole
layers compiled with ``MXMOE_CPU_BF16_LAYOUT=rows16`` (the avx512amx flavor's default) against the reference, bit for
bit on most outputs, and batch invariant.
"""

from __future__ import annotations

import ctypes
import mmap

import ml_dtypes
import numpy as np
import pytest
import torch

pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings (a GPU machine may lack them)")

import mxmoe
from mxmoe.compiler.passes.lowering import cpu_ukernel
from mxmoe.core import mxfp4, swizzle
from mxmoe.core.config import PRESETS
from mxmoe.kernels import cpu as ukernels
from mxmoe.torch_frontend.moe import MoE

memref = ukernels.memref_args

TINY = PRESETS["tiny"]
KIND_F32, KIND_BF16 = 2, 1
BF16_FLAVORS = [f for f in ukernels.host_flavors() if f in ukernels.BF16_FLAVORS]


@pytest.fixture(scope="module", params=BF16_FLAVORS or ["none"])
def lib(request):
    """The C file built as a shared library in one AVX512-BF16 flavor."""
    if request.param == "none":
        pytest.skip("the host runs no AVX512-BF16 flavor")
    return ukernels.shared_library(request.param)


def glu_args(glu: tuple | None, out_dt=np.float32) -> list:
    """The matmul's trailing epilogue arguments (out_dt: the GLU's output type)."""
    el = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(np.dtype(out_dt), "bf16")
    return [ctypes.c_size_t(v) for v in cpu_ukernel.glu_scalars(glu, el)]


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16, as float32."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def items_table(items: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(info, counts) as mxmoe_group_slots writes them for work items (first row, rows) that partition the rows."""
    info = np.array([v for f, n in items for v in (f, n << 32)] or [0, 0], np.int64)
    return info, np.array([len(items), sum(n for _, n in items)], np.int32)


def pack(lib, x: np.ndarray, S: int, info: np.ndarray, counts: np.ndarray, rows_per_wg: int = 3) -> np.ndarray:
    """The packer over every workgroup (sorted row p from x[p], p < counts[1], the work items in ``info``): [S, K]
    uint16 words (rows past the items keep the fill)."""
    R, K = x.shape
    xw = np.ascontiguousarray(x.astype(ml_dtypes.bfloat16)).view(np.uint16)
    q = np.full((S, K), 0x7FC1, np.uint16)  # NaN bits: rows nobody packs must not reach an output
    xs = np.zeros(1, np.float32)
    order = np.arange(max(R, 1), dtype=np.int32)
    for wg in range(-(-int(counts[1]) // rows_per_wg)):
        getattr(lib, ukernels.BF16_ROWS16_PACK_SYMBOL)(
            *memref(xw), *memref(order), *memref(counts), *memref(info), *memref(q), *memref(xs), ctypes.c_size_t(K),
            ctypes.c_size_t(1), ctypes.c_size_t(KIND_BF16), ctypes.c_size_t(rows_per_wg), ctypes.c_size_t(wg),
            ctypes.c_size_t(S))
    return q


def test_packer_permutes_each_block_and_packs_items_in_bands(lib):
    """Column 2q + e of a packed block holds value V + 2e of the block, q = 4j + n, V = 4j, 16 + 4j, 4j + 1, 17 + 4j
    for n = 0..3 (the pairs the rows16 nibbles give a B-tile row). Each work item's rows lie at its first row's
    words, in bands of 32 rows from its first, each band block-major: row r of an item of n rows, block b, at word
    32 (32 j nb + b R + r % 32) of the item, j = r / 32, R = min(32, n - 32 j)."""
    rng = np.random.default_rng(0)
    items = [(0, 40), (40, 5), (45, 33)]  # two bands (32 + 8), one short band, two bands (32 + 1)
    x = bf16(rng.standard_normal((78, 96)).astype(np.float32))
    q = pack(lib, x, 80, *items_table(items), rows_per_wg=7).reshape(-1)
    perm = [(16 * (n & 1) + 4 * j + (n >> 1)) + 2 * e for j in range(4) for n in range(4) for e in range(2)]
    xw = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nb = 3
    for f, n in items:
        for r in range(n):
            j, R = r // 32, min(32, n - 32 * (r // 32))
            for b in range(nb):
                at = 96 * f + 32 * (32 * j * nb + b * R + r % 32)
                np.testing.assert_array_equal(q[at:at + 32], xw[f + r, 32 * b:32 * b + 32][perm], err_msg=(f, r, b))
    assert (q[78 * 96:] == 0x7FC1).all()


def guarded(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` that ends where an inaccessible page begins: a kernel reading past its end faults."""
    page = mmap.PAGESIZE
    size = -(-a.nbytes // page) * page
    buf = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + size, page, 0) == 0, ctypes.get_errno()
    out = np.frombuffer(buf, np.uint8, a.nbytes, size - a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    _GUARDED.append(buf)  # kept mapped for the test's life
    return out


_GUARDED: list = []


def run_matmul(lib, x, w, s, bias, rows, tile_n=64, deinterleave=False, idle=0, glu=None, out_dt=np.float32,
               guard=False):
    """Every workgroup of one grouped matmul (as test_cpu_mxint8.run_matmul: experts 0.. get ``rows`` rows each, then
    ``idle`` rows of no expert, at the slots of a random permutation; x row s is slot s's): (the results in sorted
    order, the sorted rows' activations, their experts). The packed buffer has exactly S rows, so the last item's
    tiles run past it; ``guard``: and it ends at an inaccessible page."""
    E, N, Kh = w.shape
    K = 2 * Kh
    S = sum(rows) + idle
    ids = np.concatenate([np.full(r, e, np.int32) for e, r in enumerate(rows)] + [np.full(idle, -1, np.int32)])
    perm = np.random.default_rng(5).permutation(S).astype(np.int32)
    slot_ids = np.empty(S, np.int32)
    slot_ids[perm] = ids
    order, info, counts = ukernels.group_slots(getattr(lib, ukernels.GROUP_SYMBOL), slot_ids, E,
                                               cpu_ukernel.row_chunk(cpu_ukernel.BF16_ROWS16))
    sorted_ids = slot_ids[order]
    xq = pack(lib, np.ascontiguousarray(x[order][:sum(rows)]), S, info, counts)
    if guard:
        xq = guarded(xq)
    wst, sst = swizzle.rows16_swizzle(w), swizzle.rows16_scales(s)
    out = np.full((S, N // 2 if glu else N), np.nan, np.float32).astype(out_dt if glu else np.float32)
    b = np.zeros(1, np.float32) if bias is None else bias
    xs = np.zeros(1, np.float32)
    for tile in range(-(-N // tile_n)):
        for u in range(int(counts[0]) + 1 + 2):  # two past the last: must return at once
            getattr(lib, ukernels.BF16_ROWS16_SYMBOL)(
                *memref(xq), *memref(xs), *memref(wst), *memref(sst), *memref(b), *memref(info), *memref(counts),
                *memref(order), *memref(out), ctypes.c_size_t(S), ctypes.c_size_t(N), ctypes.c_size_t(K),
                ctypes.c_size_t(0 if bias is None else KIND_F32),
                ctypes.c_size_t(cpu_ukernel.gate_up_order(deinterleave, glu)), ctypes.c_size_t(tile_n),
                ctypes.c_size_t(tile), ctypes.c_size_t(u), *glu_args(glu, out_dt))
    if not glu and deinterleave:
        out = np.concatenate([out[:, :N // 2, None], out[:, N // 2:, None]], 2).reshape(S, N)
    return out[order], x[order].astype(np.float64), sorted_ids


def assert_float64(out, xd, ids, w, s, bias=None):
    """Each sorted row against float64 of its activations and its expert's dequantized weights (the products are
    exact, only the f32 sums round: rtol 1e-5); rows of no expert are zero."""
    wd = mxfp4.dequantize(w, s, dtype=np.float64)
    for p, e in enumerate(ids):
        if e < 0:
            assert (out[p] == 0).all()
            continue
        ref = wd[e] @ xd[p] + (0 if bias is None else bias[e])
        np.testing.assert_allclose(out[p], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=f"row {p}")


@pytest.mark.parametrize("N,K,rows", [(16, 32, (1,)), (48, 96, (2, 0, 3)), (96, 160, (9, 1, 17)),
                                      (32, 2880, (64, 5)), (48, 288, (15, 16, 17, 33, 12, 31)),
                                      (64, 64, (4, 37, 64, 50)), (48, 800, (128, 70, 100, 129, 1))])
def test_matmul_matches_float64(lib, N, K, rows):
    """One to eight row groups per item (1-128 rows: 129 make two items; one or two row groups in one pass, more in
    passes of two over chunks of blocks, odd counts too), an expert with no rows, a partial output tile (N = 48 or
    96, tiles of 64), K of 1-90 blocks (25: chunks of 8 and a last of 1), the last
    item's A tiles past the buffer's S rows (copied, zero-filled), blocks with a scale byte outside 2..252 (0, 1, 253:
    the f32 decode) next to fast ones."""
    rng = np.random.default_rng(N + K + len(rows))
    E = len(rows)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(110, 140, (E, N, K // 32), dtype=np.uint8)
    s[0, 0, 0], s[-1, -1, -1], s[E // 2, N // 2, 0] = 0, 253, 1
    bias = rng.standard_normal((E, N)).astype(np.float32)
    x = rng.standard_normal((sum(rows) + 2, K)).astype(np.float32)
    # where the scale is 2^126: magnitudes <= 1.5 (6 x 2^126 is past f32), products small enough to sum in f32
    w[-1, -1, -16:] &= 0xBB
    x[:, -32:] *= np.float32(2.0 ** -100)
    x = bf16(x)
    out, xd, ids = run_matmul(lib, x, w, s, bias, rows, idle=2)
    assert_float64(out, xd, ids, w, s, bias)


@pytest.mark.parametrize("rows", [(64,), (70,), (3, 33), (5, 16), (1,), (100, 17)])
def test_no_tile_reads_past_the_packed_rows(lib, rows):
    """The packed buffer ends at an inaccessible page and the last item ends it (no idle rows): whole bands, a last
    band of 6 or 1 or 4 rows, one row group of 16 or of 1 row (its tile configured to the item's rows). The last
    block's tiles that would run past the end read a zero-filled copy; none faults."""
    rng = np.random.default_rng(len(rows) + rows[-1])
    E, N, K = len(rows), 32, 96
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(115, 135, (E, N, K // 32), dtype=np.uint8)
    x = bf16(rng.standard_normal((sum(rows), K)).astype(np.float32))
    out, xd, ids = run_matmul(lib, x, w, s, None, rows, guard=True)
    assert_float64(out, xd, ids, w, s)


def test_every_code_nan_scale_and_small_values(lib):
    """Every e2m1 code in every position, activations over many binades (products near bf16's smallest normals),
    and the NaN scale byte 255: NaN in exactly the outputs of its row."""
    rng = np.random.default_rng(9)
    E, N, K, rows = 2, 32, 128, (5, 18)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    w[0, :16] = np.arange(256, dtype=np.uint8).reshape(4, 64).repeat(4, 0)[:, :K // 2]
    s = rng.integers(100, 150, (E, N, K // 32), dtype=np.uint8)
    s[1, 3, 2] = 255
    x = rng.standard_normal((sum(rows), K)) * np.exp2(rng.integers(-60, 40, (sum(rows), K // 32, 1))).repeat(
        32, 2).reshape(sum(rows), K)
    x = bf16(x.astype(np.float32))
    out, xd, ids = run_matmul(lib, x, w, s, None, rows)
    nan_rows = ids == 1
    assert np.isnan(out[nan_rows][:, 3]).all() and not np.isnan(np.delete(out, 3, axis=1)).any()
    s_ok = s.copy()
    s_ok[1, 3, 2] = 127
    out[nan_rows, 3] = 0.0
    ref_out, _, _ = run_matmul(lib, x, w, s_ok, None, rows)
    ref_out[nan_rows, 3] = 0.0
    assert_float64(ref_out, xd, ids, w, s_ok)
    np.testing.assert_array_equal(np.delete(out, 3, axis=1), np.delete(ref_out, 3, axis=1))


def test_matmul_deinterleaves_gate_up_rows(lib):
    rng = np.random.default_rng(3)
    w = rng.integers(0, 256, (2, 64, 48), dtype=np.uint8)
    s = rng.integers(120, 130, (2, 64, 3), dtype=np.uint8)
    x = bf16(rng.standard_normal((5, 96)).astype(np.float32))
    a, _, _ = run_matmul(lib, x, w, s, None, (2, 3), deinterleave=True)
    b, _, _ = run_matmul(lib, x, w, s, None, (2, 3))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("out", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_glu_epilogue_is_the_reference_glu(lib, out, interleaved, glu_io):
    """The GLU epilogue (gate/up rows interleaved or in halves: two groups of one output tile at a time, or one with
    three or four row groups; bias; an expert with no rows, slots with no expert, a partial last tile) against the
    reference's rounding and GLU of the same matmul's f32 result."""
    rng = np.random.default_rng(11)
    w = rng.integers(0, 256, (3, 96, 80), dtype=np.uint8)
    s = rng.integers(121, 126, (3, 96, 5), dtype=np.uint8)
    bias = rng.standard_normal((3, 96)).astype(np.float32)
    x = bf16((3 * rng.standard_normal((64, 160))).astype(np.float32))
    rows = (2, 0, 59)
    h, _, _ = run_matmul(lib, x, w, s, bias, rows, idle=3)
    assert 0.1 < np.mean(np.abs(h[:61]) > 7) < 0.9  # both sides of the clamps
    for glu in glu_io.cases:
        got, _, _ = run_matmul(lib, x, w, s, bias, rows, deinterleave=interleaved, idle=3, glu=glu,
                               out_dt=glu_io.dtypes[out])
        glu_io.check(got[:61], h[:61], glu, interleaved)
        assert (got[61:].astype(np.float32) == 0).all()  # the slots with no expert


def test_the_tile_path_and_the_vdpbf16ps_path_agree():
    """On an AMX host: both paths of the avx512amx build (the tiles, and vdpbf16ps where the kernel refuses them, as
    built in the avx512bf16 flavor) give the same results within the f32 summation order."""
    if "avx512amx" not in BF16_FLAVORS or "avx512bf16" not in BF16_FLAVORS:
        pytest.skip("needs a host with AMX tiles")
    amx, avx = ukernels.shared_library("avx512amx"), ukernels.shared_library("avx512bf16")
    rng = np.random.default_rng(4)
    w = rng.integers(0, 256, (3, 64, 144), dtype=np.uint8)
    s = rng.integers(115, 135, (3, 64, 9), dtype=np.uint8)
    x = bf16(rng.standard_normal((70, 288)).astype(np.float32))
    a, _, _ = run_matmul(amx, x, w, s, None, (3, 50, 17))
    b, _, _ = run_matmul(avx, x, w, s, None, (3, 50, 17))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


# --------------------------------------------------------------------------------------------- layers
LAYERS = {
    # tiny: E=4 k=2 H=I=64 (interleaved GLU, biases); one token, an expert with none, 33 tokens
    "tiny": (TINY, (1, 3, 33, 70)),
    # K and N not multiples of 64 (H = 96: 3 blocks, a partial output tile; I = 160: 5 blocks), top-3 of 5
    "odd-top3": (TINY.replace(hidden=96, intermediate=160, num_experts=5, top_k=3), (1, 2, 9, 40)),
    "split-silu-top1": (TINY.replace(interleaved=False, activation="silu", top_k=1, bias=False), (1, 4, 65)),
}


@pytest.fixture
def rows16(monkeypatch):
    """bf16 layers compiled in the rows16 layout whatever the flavor's default (MXMOE_CPU_BF16_LAYOUT=rows16)."""
    monkeypatch.setenv(ukernels.BF16_LAYOUT_SWITCH, "rows16")


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_match_the_reference(name, flavor, rows16):
    if flavor not in ukernels.BF16_FLAVORS:
        pytest.skip(f"the rows16 bf16 form needs an AVX512-BF16 flavor, not {flavor}")
    cfg, tokens = LAYERS[name]
    moe = MoE.random(cfg, seed=31)
    cm = mxmoe.compile(moe, target="cpu")
    assert ukernels.BF16_ROWS16_SYMBOL in cm.mlir and ukernels.MATVEC_SYMBOL not in cm.mlir
    assert 'mxmoe.layout = "cpu-mxfp4-rows16"' in cm.mlir
    for T in tokens:
        x = torch.randn(T, cfg.hidden, generator=torch.Generator().manual_seed(T)).bfloat16()
        out, ref = cm(x), moe(x)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        # exact products, f32 sums in another order than torch's: a bf16 rounding may flip (one ulp, 2^-8)
        assert err < 8e-3, (T, err)
        assert (out.view(torch.int16) == ref.view(torch.int16)).float().mean() > 0.95, T


def test_layers_are_batch_invariant(flavor, rows16):
    """What the artifact records (numerics.batch_invariant): a token's output bits do not depend on its batch (one
    row group or eight: one pass or passes over chunks of blocks)."""
    if flavor not in ukernels.BF16_FLAVORS:
        pytest.skip(f"the rows16 bf16 form needs an AVX512-BF16 flavor, not {flavor}")
    moe = MoE.random(TINY.replace(num_experts=2, top_k=1), seed=12)
    cm = mxmoe.compile(moe, target="cpu")
    x = torch.randn(250, TINY.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = cm(x)
    for t in (0, 5, 249):
        assert torch.equal(cm(x[t:t + 1]).view(torch.int16), whole[t:t + 1].view(torch.int16)), t


def test_other_layers_keep_the_blocksplit_layout(flavor, rows16):
    """rows16 is for bf16 layers: an f16 layer in the same setting keeps the blocksplit layout (its int16 form)."""
    if flavor not in ukernels.BF16_FLAVORS:
        pytest.skip(f"the rows16 bf16 form needs an AVX512-BF16 flavor, not {flavor}")
    moe = MoE.random(TINY, seed=26, dtype=torch.float16)
    cm = mxmoe.compile(moe, target="cpu")
    assert ukernels.MATVEC_SYMBOL in cm.mlir and ukernels.BF16_ROWS16_SYMBOL not in cm.mlir
    x = torch.randn(7, TINY.hidden, generator=torch.Generator().manual_seed(7)).half()
    assert float((cm(x).float() - moe(x).float()).abs().max() / moe(x).float().abs().max()) < 1e-2


def test_layout_switch_is_checked(monkeypatch):
    monkeypatch.setenv(ukernels.BF16_LAYOUT_SWITCH, "tiles")
    with pytest.raises(ValueError, match=r"MXMOE_CPU_BF16_LAYOUT='tiles': expected rows16 or blocksplit"):
        ukernels.bf16_layout("avx512amx")
    monkeypatch.setenv(ukernels.BF16_LAYOUT_SWITCH, "rows16")
    with pytest.raises(ValueError, match="needs an AVX512-BF16 microkernel flavor"):
        ukernels.bf16_layout("avx2")
    monkeypatch.delenv(ukernels.BF16_LAYOUT_SWITCH)
    assert [ukernels.bf16_layout(f) for f in ("avx512amx", "avx512bf16", "avx2")] == ["rows16", "blocksplit",
                                                                                      "blocksplit"]
