"""The cpu target's int8-activation forms (``activations="mxint8"``, and ``"mxint16"``: each activation row as two
int8 planes): kernels/cpu/mxint8_rows16.c, the cpu-mxfp4-rows16 weight layout, and whole layers compiled with them.

The kernel alone (built as a shared library in each flavor this host runs, called through ctypes): the
quantizer bit for bit against ``mxfp4.mxint8_round_trip`` / ``mxint16_round_trip`` (the reference's forms), the
matmul against float64 of the same quantized activations. Whole layers against the numpy reference that models the
form exactly (tight), and their error against the bf16 reference is reported (and bounded).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings (a GPU machine may lack them)")

import mxmoe
from mxmoe.core import mxfp4, swizzle
from mxmoe.core.config import PRESETS
from mxmoe.core.layouts import CPU_ROWS16
from mxmoe.compiler.passes.lowering import cpu_ukernel
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.kernels import cpu as ukernels
from mxmoe.torch_frontend.moe import MoE

TINY = PRESETS["tiny"]
HOST_FLAVORS = ukernels.host_flavors()
needs_ukernel = pytest.mark.skipif(ukernels.matvec_object().path is None,
                                   reason=f"no cpu microkernel here: {ukernels.matvec_object().reason}")
KIND_F32, KIND_BF16 = 2, 1
#: form -> (int8 planes per row, the quantizer's and the matmul's C symbols, the numpy round trip)
FORMS = {"mxint8": (1, ukernels.MXINT8_QUANTIZE_SYMBOL, ukernels.ROWS16_SYMBOL, mxfp4.mxint8_round_trip),
         "mxint16": (2, ukernels.MXINT16_QUANTIZE_SYMBOL, ukernels.ROWS16X2_SYMBOL, mxfp4.mxint16_round_trip)}


memref = ukernels.memref_args


def glu_args(glu: tuple | None, out_dt=np.float32) -> list:
    """The matmul's trailing epilogue arguments (out_dt: the GLU's output type)."""
    el = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(np.dtype(out_dt), "bf16")
    return [ctypes.c_size_t(v) for v in cpu_ukernel.glu_scalars(glu, el)]


def _build(flavor: str, *defines: str):
    if ukernels.matvec_object().path is None or flavor == "none":
        pytest.skip(f"no microkernel on this host: {ukernels.matvec_object().reason}")
    return ukernels.shared_library(flavor, defines)


@pytest.fixture(scope="module", params=HOST_FLAVORS or ["none"])
def lib(request):
    """The C file built as a shared library in one flavor."""
    return _build(request.param)


@pytest.fixture(scope="module", params=HOST_FLAVORS or ["none"])
def lib_pair(request):
    """One flavor built as is and with the block scales always multiplied (``MXMOE_R16_SLOW_ONLY``: no
    exponent-add form), to check the two forms give the same bits."""
    return _build(request.param), _build(request.param, "-DMXMOE_R16_SLOW_ONLY")


def c_quantize(lib, x: np.ndarray, kind: int = KIND_F32, rows_per_wg: int = 3, form: str = "mxint8"):
    """A C quantizer over every workgroup (sorted row p from x[p]): (q [R, planes K] int8, xs [R, planes 2 nb] f32)."""
    R, K = x.shape
    nb, planes = K // 32, FORMS[form][0]
    q = np.full((R, planes * K), 0x5A, np.int8)
    xs = np.full((R, planes * 2 * nb), np.nan, np.float32)
    order, counts = np.arange(R, dtype=np.int32), np.array([0, R], np.int32)
    for wg in range(-(-R // rows_per_wg)):
        getattr(lib, FORMS[form][1])(
            *memref(x), *memref(order), *memref(counts), *memref(q), *memref(xs), ctypes.c_size_t(K),
            ctypes.c_size_t(1), ctypes.c_size_t(kind), ctypes.c_size_t(rows_per_wg), ctypes.c_size_t(wg))
    return q, xs


def dequantized(q: np.ndarray, xs: np.ndarray, planes: int = 1) -> np.ndarray:
    """The values the quantizer's output stands for, float64 (per plane q x 2 x the stored half scale, summed)."""
    R, K = q.shape[0], q.shape[1] // planes
    nb = K // 32
    q, xs = q.reshape(R, planes, nb, 32), xs.reshape(R, planes, 2 * nb)
    return (q * (2.0 * xs[:, :, :nb].astype(np.float64))[..., None]).sum(1).reshape(R, K)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("K", [32, 96, 2880])
def test_quantizer_is_the_reference(lib, K, form):
    """Bit for bit against the form's round trip, values over many binades (ties included: x 2^(6-E) = n + 0.5 is
    one for MXINT8), each plane's offset correction is -12 x its block's sum, and bf16 input reads the same as its
    f32 value. mxint16: the planes are hi in [-64, 64] and lo in [-128, 127] of q = 256 hi + lo."""
    planes, _, _, round_trip = FORMS[form]
    rng = np.random.default_rng(K)
    x = (rng.standard_normal((7, K)) * np.exp2(rng.integers(-60, 60, (7, K // 32, 1))).repeat(32, 2).reshape(7, K))
    x = x.astype(np.float32)
    x[0, :32] = np.float32(2.0) ** 3 * (np.arange(32) - 15.5) / 64  # E = 2: every 0.5 x 2^(E-6) step a tie
    x[1, :32] = 0.0
    x[2, :32] = 1.999  # saturates to 127
    x[3, :32] = np.float32(1e-38)  # clamped exponent: rounds to 0
    q, xs = c_quantize(lib, x, form=form)
    ref = round_trip(x)
    np.testing.assert_array_equal(dequantized(q, xs, planes).astype(np.float32), ref)
    nb = K // 32
    qp = q.reshape(7, planes, nb, 32).astype(np.int64)
    if planes == 1:
        assert np.abs(q).max() <= 127 and (q[2, :32] == 127).all()
    else:
        assert np.abs(qp[:, 0]).max() <= 64 and np.abs(qp[:, 0]).max() == 64 and qp[:, 1].min() >= -128
        assert np.abs(256 * qp[:, 0] + qp[:, 1]).max() <= 1 << 14
    corr = xs.reshape(7, planes, 2 * nb)[:, :, nb:].view(np.int32)
    np.testing.assert_array_equal(corr, -12 * qp.sum(-1))
    xb = torch.from_numpy(x).bfloat16()
    qb, xsb = c_quantize(lib, xb.view(torch.int16).numpy().copy(), KIND_BF16, form=form)
    np.testing.assert_array_equal(dequantized(qb, xsb, planes).astype(np.float32), round_trip(xb.float().numpy()))


def test_mxint16_holds_bf16_values_near_the_block_max_exactly():
    """mxint16's elements are 2^-13 of the block scale: a bf16 value within 2^-6 of its block's largest is exact."""
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((64, 96)).astype(np.float32)).bfloat16().float().numpy()
    amax = np.abs(x.reshape(64, 3, 32)).max(-1, keepdims=True).repeat(32, -1).reshape(64, 96)
    near = np.abs(x) >= amax / 64
    np.testing.assert_array_equal(mxfp4.mxint16_round_trip(x)[near], x[near])
    assert np.abs(mxfp4.mxint16_round_trip(x) - x).max() <= amax.max() * 2.0 ** -14


@pytest.mark.parametrize("form", list(FORMS))
def test_quantizer_non_finite_blocks(lib, form):
    """A block holding an inf or NaN: zeros, correction 0 and a NaN scale in every plane (its outputs NaN, as the
    reference's); the other blocks of the row are untouched."""
    planes, _, _, round_trip = FORMS[form]
    x = np.random.default_rng(1).standard_normal((2, 96)).astype(np.float32)
    x[0, 40], x[1, 70] = np.inf, np.nan
    q, xs = c_quantize(lib, x, form=form)
    nb = 3
    qp, xsp = q.reshape(2, planes, 96), xs.reshape(2, planes, 2 * nb)
    assert np.isnan(xsp[0, :, 1]).all() and np.isnan(xsp[1, :, 2]).all() and np.isnan(xsp[:, :, :nb]).sum() == 2 * planes
    assert (qp[0, :, 32:64] == 0).all() and (qp[1, :, 64:] == 0).all()
    assert (xsp[0, :, nb + 1].view(np.int32) == 0).all() and (xsp[1, :, nb + 2].view(np.int32) == 0).all()
    ref = round_trip(x)
    assert np.isnan(ref[0, 32:64]).all() and np.isnan(ref[1, 64:]).all() and np.isnan(ref).sum() == 64
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(dequantized(q, xs, planes).astype(np.float32)[finite], ref[finite])


def test_rows16_layout_round_trip_and_refusals():
    rng = np.random.default_rng(0)
    v = rng.integers(0, 256, (3, 48, 80), dtype=np.uint8)
    s = rng.integers(0, 255, (3, 48, 5), dtype=np.uint8)
    for role, a in (("values", v), ("scales", s)):
        st = CPU_ROWS16.encode(role, a)
        assert st.shape == a.shape and not np.array_equal(st, a)
        np.testing.assert_array_equal(CPU_ROWS16.decode(role, st), a)
    with pytest.raises(ValueError, match="groups of 16"):
        swizzle.rows16_swizzle(v[:, :40])


def run_matmul(lib, x, w, s, bias, rows, tile_n=32, deinterleave=False, idle=0, form="mxint8", glu=None,
               out_dt=np.float32):
    """Every workgroup of one grouped matmul: experts 0.. get ``rows`` rows each, then ``idle`` rows of no
    expert, at the slots of a random permutation (x row s is slot s's); returns (results in sorted order,
    the sorted rows' activations as the quantizer gave them, float64, and the sorted rows' experts). ``glu``:
    (activation, alpha, limit) of the GLU epilogue (with deinterleave): the results are then its [S, N / 2] of
    ``out_dt``."""
    E, N, Kh = w.shape
    K = 2 * Kh
    S = sum(rows) + idle
    ids = np.concatenate([np.full(r, e, np.int32) for e, r in enumerate(rows)] + [np.full(idle, -1, np.int32)])
    perm = np.random.default_rng(5).permutation(S).astype(np.int32)
    slot_ids = np.empty(S, np.int32)
    slot_ids[perm] = ids
    order, info, counts = ukernels.group_slots(getattr(lib, ukernels.GROUP_SYMBOL), slot_ids, E)
    sorted_ids = slot_ids[order]
    assert (np.diff(sorted_ids[:sum(rows)]) >= 0).all() and (sorted_ids[sum(rows):] == -1).all()
    xq, xs = c_quantize(lib, np.ascontiguousarray(x[order]), form=form)
    wst, sst = swizzle.rows16_swizzle(w), swizzle.rows16_scales(s)
    out = np.full((S, N // 2 if glu else N), np.nan, np.float32).astype(out_dt if glu else np.float32)
    b = np.zeros(1, np.float32) if bias is None else bias
    fn = getattr(lib, FORMS[form][2])
    for tile in range(-(-N // tile_n)):
        for u in range(int(counts[0]) + 1 + 2):  # two past the last: must return at once
            fn(*memref(xq), *memref(xs), *memref(wst), *memref(sst), *memref(b), *memref(info), *memref(counts),
               *memref(order), *memref(out), ctypes.c_size_t(S), ctypes.c_size_t(N), ctypes.c_size_t(K),
               ctypes.c_size_t(0 if bias is None else KIND_F32),
               ctypes.c_size_t(cpu_ukernel.gate_up_order(deinterleave, glu)),
               ctypes.c_size_t(tile_n), ctypes.c_size_t(tile), ctypes.c_size_t(u), *glu_args(glu, out_dt))
    if glu:
        return out[order], dequantized(xq, xs, FORMS[form][0]), sorted_ids
    if deinterleave:
        out = np.concatenate([out[:, :N // 2, None], out[:, N // 2:, None]], 2).reshape(S, N)
    return out[order], dequantized(xq, xs, FORMS[form][0]), sorted_ids


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("N,K,rows", [(16, 32, (1,)), (48, 96, (2, 0, 3)), (96, 160, (9, 1, 17)),
                                      (32, 2880, (64, 5)), (48, 288, (15, 16, 17, 33, 12, 24))])
def test_matmul_matches_float64(lib, N, K, rows, form):
    """Matvec (1-3 rows) and GEMM (more: passes of up to 16 / 4 int8 rows: 15, 16, 17 = 9 + 8, 33 = 11 x 3; mxint16
    rows are two each, in one pass, joined per block: passes of up to 12 / 2 rows, 12 and 24 = 12 x 2) forms, an expert with no rows, a partial output tile
    (N = 48, tiles of 32), K of 1, 3, 5, 9 and 90 blocks, the scale byte 0 (2^-127: its group takes the multiplied
    scales, the others the exponent add)."""
    rng = np.random.default_rng(N + K)
    E = len(rows)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    s = rng.integers(110, 140, (E, N, K // 32), dtype=np.uint8)
    s[0, 0, 0], s[-1, -1, -1] = 0, 160
    bias = rng.standard_normal((E, N)).astype(np.float32)
    x = rng.standard_normal((sum(rows) + 2, K)).astype(np.float32)
    out, xd, ids = run_matmul(lib, x, w, s, bias, rows, idle=2, form=form)
    wd = mxfp4.dequantize(w, s, dtype=np.float64)
    for p, e in enumerate(ids):
        if e < 0:
            assert (out[p] == 0).all()
            continue
        ref = wd[e].astype(np.float64) @ xd[p] + bias[e]
        np.testing.assert_allclose(out[p], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=f"row {p}")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("rows", [(1, 4, 8), (15, 16, 17), (33, 2)])
def test_scale_forms_give_the_same_bits(lib_pair, rows, form):
    """The GEMM's two forms of the block scale product (exponent add where r16_fast allows it, else vmulps)
    give the same bits, at every pass width and at the edges of the fast form: products of exponent field
    exactly 0 and 1, 255 and 256 (subnormal, least normal, inf, past inf), the weight byte 0 (2^-127), wide
    ranges, and a non-finite activation block (NaN scale). Random data in range first, then the edges."""
    fast, slow = lib_pair
    rng = np.random.default_rng(sum(rows))
    N, K, E = 48, 256, len(rows)
    w = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    x = rng.standard_normal((sum(rows) + 1, K)).astype(np.float32)
    s = rng.integers(100, 150, (E, N, K // 32), dtype=np.uint8)
    a, _, _ = run_matmul(fast, x, w, s, None, rows, idle=1, form=form)
    b, _, _ = run_matmul(slow, x, w, s, None, rows, idle=1, form=form)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))
    # activation blocks whose largest magnitude is 1.5 x 2^e exactly (MXINT8 exponent E = e, scale field
    # e + 120), weight scale bytes in [lo, hi]: the product's field is byte + e - 7
    for (lo, hi), (e0, e1) in [((1, 1), (6, 6)), ((1, 1), (7, 7)), ((1, 2), (-100, -90)), ((0, 0), (20, 20)),
                               ((0, 130), (-20, 10)), ((254, 254), (8, 8)), ((254, 254), (9, 9)),
                               ((160, 162), (90, 100)), ((1, 254), (-100, 120))]:
        s = rng.integers(lo, hi + 1, (E, N, K // 32), dtype=np.uint8)
        e = rng.integers(e0, e1 + 1, (x.shape[0], K // 32, 1))
        xe = rng.uniform(-1, 1, (x.shape[0], K // 32, 32)) * np.exp2(e)
        xe[:, :, 0] = 1.5 * np.exp2(e[:, :, 0]) * rng.choice([-1, 1], e.shape[:2])
        xe = xe.reshape(x.shape).astype(np.float32)
        if (lo, hi) == (1, 254):
            xe[3, 40] = np.inf
        a, _, _ = run_matmul(fast, xe, w, s, None, rows, idle=1, form=form)
        b, _, _ = run_matmul(slow, xe, w, s, None, rows, idle=1, form=form)
        np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32), err_msg=f"bytes {lo}-{hi}, E {e0}-{e1}")


@pytest.mark.parametrize("form", list(FORMS))
def test_matmul_deinterleaves_gate_up_rows(lib, form):
    rng = np.random.default_rng(3)
    w = rng.integers(0, 256, (2, 64, 48), dtype=np.uint8)
    s = rng.integers(120, 130, (2, 64, 3), dtype=np.uint8)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    a, _, _ = run_matmul(lib, x, w, s, None, (2, 3), deinterleave=True, form=form)
    b, _, _ = run_matmul(lib, x, w, s, None, (2, 3), form=form)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("out", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_glu_epilogue_is_the_reference_glu(lib, form, out, interleaved, glu_io):
    """The matmul's GLU epilogue (gate/up rows interleaved or in halves, bias; matvec and GEMM passes, an expert with no rows,
    slots with no expert, a partial last tile) against the reference's rounding and GLU applied to the same
    matmul's f32 result, for every activation it has; gate and up values reach past the clamps."""
    rng = np.random.default_rng(11)
    w = rng.integers(0, 256, (3, 96, 80), dtype=np.uint8)
    s = rng.integers(121, 126, (3, 96, 5), dtype=np.uint8)
    bias = rng.standard_normal((3, 96)).astype(np.float32)
    x = (3 * rng.standard_normal((24, 160))).astype(np.float32)
    rows = (2, 0, 19)
    h, _, _ = run_matmul(lib, x, w, s, bias, rows, tile_n=64, idle=3, form=form)
    assert 0.1 < np.mean(np.abs(h[:21]) > 7) < 0.9  # both sides of the clamps
    for glu in glu_io.cases:
        got, _, _ = run_matmul(lib, x, w, s, bias, rows, tile_n=64, deinterleave=interleaved, idle=3, form=form, glu=glu,
                               out_dt=glu_io.dtypes[out])
        glu_io.check(got[:21], h[:21], glu, interleaved)
        assert (got[21:].astype(np.float32) == 0).all()  # the slots with no expert


# --------------------------------------------------------------------------------------------- layers


def _check_layer(moe: MoE, cm, tokens, dtype, exact_tol: float, bf16_tol: float, form: str = "mxint8") -> list[float]:
    """Each T: the compiled layer of ``form`` against the reference of that form (exact semantics) within
    ``exact_tol``, and against the bf16 reference within ``bf16_tol``; returns the errors against the bf16 one."""
    errs = []
    for T in tokens:
        x = torch.randn(T, moe.config.hidden, generator=torch.Generator().manual_seed(T)).to(dtype)
        out = cm(x).float().numpy()
        xn = x.float().numpy()
        ref8 = numpy_reference(moe.to_weights(), xn, np.dtype(np.float32) if dtype == torch.float32 else
                               mxfp4.ml_dtypes.bfloat16, activations=form)
        ref16 = moe(x).float().numpy()
        e8, e16 = relative_error(out, ref8), relative_error(out, ref16)
        assert e8 < exact_tol, (T, e8, e16)
        if dtype == torch.bfloat16:  # measured: every output equal bit for bit at these shapes
            assert (out == ref8).mean() > 0.95, (T, (out == ref8).mean())
        assert e16 < bf16_tol, (T, e8, e16)
        errs.append(e16)
    return errs


AWKWARD = {
    # tiny: E=4 k=2 H=I=64 (interleaved GLU, biases); one token, an expert with none, all tokens on one expert
    "tiny": (TINY, (1, 3, 33)),
    # K and N not multiples of 64 (H = 96: 3 blocks, a partial output tile; I = 160: 5 blocks), top-3 of 5
    "odd-top3": (TINY.replace(hidden=96, intermediate=160, num_experts=5, top_k=3), (1, 2, 9)),
    "split-silu-top1": (TINY.replace(interleaved=False, activation="silu", top_k=1), (1, 4)),
}


@needs_ukernel
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(AWKWARD))
def test_layers_match_the_reference_of_their_form(name, flavor, form):
    cfg, tokens = AWKWARD[name]
    moe = MoE.random(cfg, seed=31)
    cm = mxmoe.compile(moe, target="cpu", activations=form)
    assert FORMS[form][2] in cm.mlir and f"mxfp4_matvec-{flavor}-" in cm.mlir and cm.target.activations == form
    # bf16 layers: an f32 sum added in another order than numpy's may round to the other bf16 neighbour (one ulp,
    # 2^-8 relative; measured: none at these shapes); against the bf16 reference MXINT8 costs 1.4-2.4e-2, mxint16
    # a bf16 rounding step here and there (one ulp of an intermediate: measured <= 2.2e-3)
    errs = _check_layer(moe, cm, tokens, torch.bfloat16, 4e-3, 5e-2 if form == "mxint8" else 8e-3, form)
    if form == "mxint8":
        assert max(errs) > 5e-3  # the 8-bit activations show (so the check above can tell the forms apart)


@needs_ukernel
@pytest.mark.parametrize("form", list(FORMS))
def test_all_tokens_on_one_expert_and_f32_layers(flavor, form):
    """An f32 layer (no bf16 rounding between the steps): the mxint8 path equals its reference to f32
    accumulation-order accuracy. Every token routed to expert 0: a zero router ties all experts, and ties go to
    the lower index (the routing contract)."""
    moe = MoE.random(TINY.replace(top_k=1), seed=7, dtype=torch.float32)
    with torch.no_grad():
        moe.router_weight.zero_()
        if moe.router_bias is not None:
            moe.router_bias.zero_()
    cm = mxmoe.compile(moe, target="cpu", activations=form)
    # mxint16 against the f32 layer: its 15-bit activations (2^-14 of each block's largest)
    _check_layer(moe, cm, (1, 70), torch.float32, 1e-5, 5e-2 if form == "mxint8" else 1e-3, form)


@needs_ukernel
@pytest.mark.parametrize("form", list(FORMS))
def test_f32_layer_with_a_dense_shared_expert(form):
    """An f32 layer whose shared expert is dense (shared_format="bf16": f32 linears here): iree-compile's data tiling
    of that linear, fused with the add after it, broke its vector-size limit in the int8 forms (a random-config sweep,
    2026-11-28); the cpu target compiles such a module without data tiling."""
    moe = MoE.random(TINY.replace(shared_intermediate=64, shared_format="bf16", shared_gate=True), seed=8,
                     dtype=torch.float32)
    cm = mxmoe.compile(moe, target="cpu", activations=form)
    _check_layer(moe, cm, (1, 9), torch.float32, 1e-5, 5e-2 if form == "mxint8" else 1e-3, form)


def test_bad_activations_are_refused():
    moe = MoE.random(TINY, seed=1)
    with pytest.raises(ValueError, match=r"activations must be one of bf16, mxint8, mxint16, got 'int8'") as e:
        mxmoe.compile(moe, target="cpu", activations="int8")
    assert "\n" not in str(e.value)
    for form in FORMS:
        with pytest.raises(ValueError, match=form):
            mxmoe.compile(moe, target="rocm:gfx942", activations=form)


@pytest.mark.parametrize("form", list(FORMS))
def test_int8_forms_without_the_microkernel_are_refused(monkeypatch, form):
    """No linalg form reads the rows16 layout: with the microkernel switched off the compile says so, one line."""
    monkeypatch.setenv(ukernels.ENV_SWITCH, "0")
    ukernels.matvec_object.cache_clear()
    try:
        with pytest.raises(ValueError, match=rf"activations='{form}' runs on the C microkernel only.*MXMOE_CPU_UKERNEL=0") as e:
            mxmoe.compile(MoE.random(TINY, seed=1), target="cpu", activations=form)
        assert "\n" not in str(e.value)
    finally:
        ukernels.matvec_object.cache_clear()


@needs_ukernel
@pytest.mark.parametrize("form", list(FORMS))
def test_int8_form_layers_are_batch_invariant(flavor, form):
    """What the artifact records (numerics.batch_invariant): a token's output bits do not depend on its batch, though
    its rows go through the matvec alone and through GEMM passes (of up to 16 int8 rows) in a batch of 70."""
    moe = MoE.random(TINY, seed=12)
    cm = mxmoe.compile(moe, target="cpu", activations=form)
    x = torch.randn(70, TINY.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = cm(x)
    for t in (0, 5, 69):
        assert torch.equal(cm(x[t:t + 1]).view(torch.int16), whole[t:t + 1].view(torch.int16)), t
