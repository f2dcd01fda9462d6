"""The w4a8 form of the expert GEMMs (``activations="mxfp8"``): MXFP4 weights times activations quantized to MXFP8.

Every activation matrix an expert GEMM reads is quantized the way ``mxmoe.core.mxfp4.mxfp8_round_trip`` says (the
OCP MX recipe: per 32 values along K the e8m0 scale byte ``max(e - 8, 0)``, ``e`` the biased exponent of the
block's largest magnitude; values divided by it, saturated to +-448, rounded to nearest even e4m3):

* the hidden states by :func:`mxfp8_quant_kernel`, once per forward, before the w13 GEMM; the alternative, quantizing
  the gathered tile on load inside the GEMM, would redo it for every column tile (45 of them for gpt-oss's
  2I = 5760 at BLOCK_N = 128) and every slot: about 10 ALU operations per value against the BLOCK_N multiply-adds
  the tensor core spends on it, which on an H100 SM (2048 fp8 MAC/clk vs 128 ALU op/clk) is ~1.2x the MMA time
  itself, and twice that on Blackwell. The separate launch reads T x H bf16 and writes T x H bytes + scales.
* the GLU output in the w13 GEMM's epilogue (each value is produced exactly once there, so quantizing it costs
  nothing extra), written as e4m3 bytes + scale bytes for the w2 GEMM; rounded first to the layer's dtype, as the
  reference rounds the GLU output before quantizing it.

The MMA by arch (``FP8_HOPPER``):

* sm_100 (``FP8_HOPPER=False``): ``tl.dot_scaled`` with both operands' scales, which Triton lowers to the
  block-scaled ``tcgen05.mma ... kind::mxf8f6f4.block_scale`` (SASS ``UTCQMMA``): the tensor core reads the e2m1
  weights, e4m3 activations and both e8m0 scale tiles itself, no upcast. It needs the MMA's M operand to have 128+
  rows: tiles of 128+ token rows put the activations first (acc [BLOCK_M, BLOCK_N]); smaller ones (``SWAP_AB``) put
  the weight rows first (BLOCK_N >= 128) and the tokens as the MMA's N (16-64), acc^T [BLOCK_N, BLOCK_M].
* sm_90 (``FP8_HOPPER=True``): Hopper's tensor cores have no block scales and Triton upcasts ``tl.dot_scaled`` to
  bf16 there, so the loop is written out: the e2m1 weights become e4m3 in registers with their block scales folded
  in relative to the largest scale of the K step (``_e2m1_to_e4m3``: exact while the scales of one row within a
  step span at most 11 binades, rounded to nearest even e4m3 beyond), the MMA is a plain fp8 ``tl.dot`` (wgmma
  e4m3 x e4m3, weights as the register operand), and the partial product of each K step is scaled into the fp32
  accumulator by 2^(weight reference + activation scale). The activations come with :data:`HOPPER_FOLD` scale
  groups per K step already folded onto one scale by the quantizer (``FOLD``), which is exact except for values
  below e4m3's subnormal step at the shared scale (at most 2^-10 of that scale, i.e. under 2^-17 of the step's
  largest value).
"""

import os

import triton
import triton.language as tl

from ._gemm_kernels import _block_rows, _cast_if_last, _glu_columns, _scale_tile, _tile_coords, _value_tile

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

#: MXFP8 scale groups (of 32 values) per K step of the Hopper w4a8 GEMMs, folded onto one scale by the quantizer
HOPPER_FOLD = 2


@triton.jit
def _pow2(e):
    """Exact 2^e in fp32 for integer tensors e in [-252, 252], as the product of two normal factors."""
    h = e // 2
    return ((h + 127) << 23).to(tl.float32, bitcast=True) * ((e - h + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(q):
    """fp32 ``q`` (|q| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32. Only for the
    interpreter: Triton 3.9's interpreter casts fp32 -> fp8 rounding half up and drops the carry into the exponent
    (31.75 -> 16); the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` rounds right, so compiled kernels skip this."""
    b = q.to(tl.int32, bitcast=True)
    normal = ((b >> 23) & 0xFF) >= 121  # |q| >= 2^-6: e4m3 normal
    rn = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # RNE to 3 mantissa bits
    a = tl.abs(q)
    sub = (a + 16384.0) - 16384.0  # RNE to a multiple of 2^-9 (fp32 ulp at 2^14 is 2^-9)
    return tl.where(normal, rn, tl.where(q < 0, -sub, sub))


@triton.jit
def _round_bf16(x):
    """fp32 ``x`` rounded to bf16 (nearest even), as fp32. Triton 3.9's interpreter converts fp32 -> bf16 by
    truncation, so interpreted kernels round the bits themselves; compiled ones convert (RNE on the GPU)."""
    if INTERPRETED:
        b = x.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _to_e4m3(q):
    """fp32 (|q| <= 448) -> float8e4nv, round to nearest even."""
    if INTERPRETED:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _mxfp8(x, ROWS: tl.constexpr, COLS: tl.constexpr, FOLD: tl.constexpr):
    """fp32 x [ROWS, COLS] -> (e4m3 values [ROWS, COLS], e8m0 scale bytes uint8 [ROWS, COLS / 32]): the OCP MX
    quantization of ``mxfp4.mxfp8_round_trip``. FOLD > 1 (the Hopper form): every FOLD consecutive groups are then
    put on their largest scale (values re-rounded to e4m3, each group's byte set to that scale)."""
    x3 = x.reshape(ROWS, COLS // 32, 32)
    amax = tl.max(tl.abs(x3), axis=2)
    byte = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 8, 0)
    inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)  # 2^(127 - byte): normal for every byte <= 247
    q = tl.minimum(tl.maximum(x3 * inv[:, :, None], -448.0), 448.0)
    q = _to_e4m3(q)
    if FOLD > 1:
        b4 = byte.reshape(ROWS, COLS // (32 * FOLD), FOLD)
        top = tl.max(b4, axis=2)
        shift = _pow2(b4 - top[:, :, None]).reshape(ROWS, COLS // 32)
        q = _to_e4m3(q.to(tl.float32) * shift[:, :, None])
        byte = tl.broadcast_to(top[:, :, None], [ROWS, COLS // (32 * FOLD), FOLD]).reshape(ROWS, COLS // 32)
    return q.reshape(ROWS, COLS), byte.to(tl.uint8)


@triton.jit(do_not_specialize=["num_rows"])
def mxfp8_quant_kernel(x_ptr, q_ptr, s_ptr, num_rows, COLS: tl.constexpr, FOLD: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """q [R, COLS] (e4m3 bytes), s [R, COLS / 32] (scale bytes) = MXFP8 of x [R, COLS] (COLS a multiple of 32)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    sc = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    r64 = r.to(tl.int64)
    mask = (r[:, None] < num_rows) & (c[None, :] < COLS)
    x = tl.load(x_ptr + r64[:, None] * COLS + c[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = _mxfp8(x, BLOCK_R, BLOCK_C, FOLD)
    tl.store(q_ptr + r64[:, None] * COLS + c[None, :], q.to(tl.uint8, bitcast=True), mask=mask)
    tl.store(s_ptr + r64[:, None] * (COLS // 32) + sc[None, :], s,
             mask=(r[:, None] < num_rows) & (sc[None, :] < COLS // 32))


@triton.jit
def _e2m1_to_e4m3(w, shift, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed e2m1 weights [BLOCK_N, BLOCK_K/2] (two codes a byte, low nibble first along K) times 2^shift
    (int32 [BLOCK_N, BLOCK_K/32], one per scale group; <= 6 so nothing passes 448) -> e4m3 [BLOCK_N, BLOCK_K],
    built as fp32 bits and converted (exact where the result is an e4m3 value, nearest even otherwise)."""
    c = tl.join(w & 15, w >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.int32)
    sh = tl.broadcast_to(shift[:, :, None], [BLOCK_N, BLOCK_K // 32, 32]).reshape(BLOCK_N, BLOCK_K)
    mag = c & 7
    # e2m1 magnitude codes 2..7 are 2^((m >> 1) - 1) * (1 + (m & 1) / 2); code 1 is 0.5
    exp = tl.maximum(tl.where(mag >= 2, (mag >> 1) + 126, 126) + sh, 1)
    bits = (exp << 23) | tl.where(mag >= 2, (mag & 1) << 22, 0)
    bits = tl.where(mag == 0, 0, bits) | ((c & 8) << 28)
    return _to_e4m3(bits.to(tl.float32, bitcast=True))


@triton.jit
def _w4a8_mma(a_rows, a_scale_rows, row_mask, w_ptr, s_ptr, expert, cols, col_mask, N: tl.constexpr,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP_AB: tl.constexpr, FP8_HOPPER: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = mxfp8(a) @ mxfp4(W[cols])^T over all of K. ``a_rows`` / ``a_scale_rows``
    point at each row's e4m3 bytes / scale bytes; ``cols`` are the weight rows (output columns)."""
    kb = tl.arange(0, BLOCK_K // 2)
    w_base = w_ptr + expert.to(tl.int64) * (N * K // 2) + cols.to(tl.int64)[:, None] * (K // 2)
    if SWAP_AB or FP8_HOPPER:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < K), other=0)
        a = a.to(tl.float8e4nv, bitcast=True)
        # scale byte 0 where there is no value (masked rows, past K): the Hopper form takes the largest scale
        a_s = tl.load(a_scale_rows + ks[None, :], mask=row_mask[:, None] & (ks[None, :] < K // 32), other=0)
        ws = _scale_tile(s_ptr, expert, cols, col_mask, k0, N, K, BLOCK_K)
        if FP8_HOPPER:
            w = tl.load(w_base + (k0 // 2 + kb)[None, :], mask=col_mask[:, None] & ((k0 // 2 + kb) < K // 2)[None, :],
                        other=0)
            ws = ws.to(tl.int32)
            # the largest scale of the step (groups past K read 127: left out) less 6, so that the largest
            # code (6) of the largest scale lands on 384 <= 448
            wref = tl.max(tl.where((ks < K // 32)[None, :], ws, 0), axis=1) - 6
            w8 = _e2m1_to_e4m3(w, ws - wref[:, None], BLOCK_N, BLOCK_K)
            a_ref = tl.max(a_s.to(tl.int32), axis=1)  # the quantizer folded the step's groups onto one scale
            part = tl.dot(w8, tl.trans(a))
            acc_t += part * _pow2(wref - 127)[:, None] * _pow2(a_ref - 127)[None, :]
        elif SWAP_AB:
            w = tl.load(w_base + (k0 // 2 + kb)[None, :], mask=col_mask[:, None] & ((k0 // 2 + kb) < K // 2)[None, :],
                        other=0)
            acc_t = tl.dot_scaled(w, ws, "e2m1", tl.trans(a), a_s, "e4m3", acc_t)
        else:
            w = _value_tile(w_ptr, expert, cols, col_mask, k0, N, K, BLOCK_K)
            acc = tl.dot_scaled(a, a_s, "e4m3", w, ws, "e2m1", acc)
    if SWAP_AB or FP8_HOPPER:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def glu_gemm_w4a8_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, actq_ptr, acts_ptr,
                         sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                         HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, SWIGLU_OAI: tl.constexpr,
                         ALPHA: tl.constexpr, LIMIT: tl.constexpr, ROUND_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, FP8_HOPPER: tl.constexpr, FOLD: tl.constexpr):
    """act = MXFP8(GLU(mxfp8(x[token]) @ w13[e]^T + b13[e])) in expert-sorted row order: e4m3 bytes
    [T*k, I] and scale bytes [T*k, I/32]. Columns and GLU as in ``glu_gemm_kernel``; the GLU output is rounded to
    bf16 first (ROUND_BF16, bf16 layers) as the reference rounds it, then quantized per 32 columns (FOLD: see
    :func:`_mxfp8`; BLOCK_N / 2 is a multiple of 32 * FOLD). The matmul's output is rounded to bf16 too before
    the GLU (as the reference rounds it): at the e4m3 step the two roundings decide between neighbours."""
    block, pid_n = _tile_coords(GROUP_M)
    expert, rows, row_mask = _block_rows(block, block_expert_ptr, block_start_ptr, expert_offsets_ptr, BLOCK_M)
    if expert < 0:
        return
    tokens = (tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0) // TOP_K).to(tl.int64)
    act_col, cols, col_mask = _glu_columns(pid_n, BLOCK_N, INTERLEAVED, INTERMEDIATE)
    acc = _w4a8_mma(xq_ptr + tokens[:, None] * HIDDEN, xs_ptr + tokens[:, None] * (HIDDEN // 32), row_mask,
                    w_ptr, s_ptr, expert, cols, col_mask, 2 * INTERMEDIATE, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K,
                    SWAP_AB, FP8_HOPPER)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * (2 * INTERMEDIATE) + cols, mask=col_mask, other=0.0)[None, :]
    if ROUND_BF16:  # the reference rounds the matmul's output and the GLU's to the layer dtype: a value off by
        acc = _round_bf16(acc)  # that rounding would often quantize to another e4m3 step
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    if SWIGLU_OAI:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        act = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
    else:
        act = up * gate * tl.sigmoid(gate)
    out_col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    act = tl.where(out_col[None, :] < INTERMEDIATE, act, 0.0)
    if ROUND_BF16:
        act = _round_bf16(act)
    q, s = _mxfp8(act, BLOCK_M, BLOCK_N // 2, FOLD)
    rows64 = rows.to(tl.int64)
    tl.store(actq_ptr + rows64[:, None] * INTERMEDIATE + out_col[None, :], q.to(tl.uint8, bitcast=True),
             mask=row_mask[:, None] & (out_col[None, :] < INTERMEDIATE))
    s_col = pid_n * (BLOCK_N // 64) + tl.arange(0, BLOCK_N // 64)
    tl.store(acts_ptr + rows64[:, None] * (INTERMEDIATE // 32) + s_col[None, :], s,
             mask=row_mask[:, None] & (s_col[None, :] < INTERMEDIATE // 32))


@triton.jit(do_not_specialize=["num_tokens"])
def combine_gemm_w4a8_kernel(actq_ptr, acts_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr,
                             sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                             cast_ptr, num_tokens, rows_ptr, ids_ptr,
                             HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                             FP8_HOPPER: tl.constexpr, FUSED_CAST: tl.constexpr, SLOT_ROWS: tl.constexpr):
    """The w2 GEMM of the w4a8 form: out[token] += weight[pair] * (act[sorted row] @ w2[e]^T + b2[e]) with act
    the MXFP8 rows the w13 GEMM wrote; the combine (fp32 atomics, or SLOT_ROWS and FUSED_CAST) as in
    ``combine_gemm_kernel`` (no split K)."""
    block, pid_n = _tile_coords(GROUP_M)
    expert, rows, row_mask = _block_rows(block, block_expert_ptr, block_start_ptr, expert_offsets_ptr, BLOCK_M)
    if expert < 0:
        if FUSED_CAST:
            _cast_if_last(out_ptr, cast_ptr, num_tokens, pid_n, HIDDEN, BLOCK_N, SLOT_ROWS, rows_ptr,
                          routing_weights_ptr, ids_ptr, TOP_K, 1, False, False)
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN
    rows64 = rows.to(tl.int64)
    acc = _w4a8_mma(actq_ptr + rows64[:, None] * INTERMEDIATE, acts_ptr + rows64[:, None] * (INTERMEDIATE // 32),
                    row_mask, w_ptr, s_ptr, expert, cols, col_mask, HIDDEN, INTERMEDIATE, BLOCK_M, BLOCK_N, BLOCK_K,
                    SWAP_AB, FP8_HOPPER)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * HIDDEN + cols, mask=col_mask, other=0.0)[None, :]
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)
    if SLOT_ROWS:
        tl.store(rows_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + cols[None, :], acc.to(rows_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])
    else:
        acc *= tl.load(routing_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        tl.atomic_add(out_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * HIDDEN + cols[None, :], acc,
                      mask=row_mask[:, None] & col_mask[None, :], sem="relaxed")
    if FUSED_CAST:
        _cast_if_last(out_ptr, cast_ptr, num_tokens, pid_n, HIDDEN, BLOCK_N, SLOT_ROWS, rows_ptr,
                      routing_weights_ptr, ids_ptr, TOP_K, 1, False, False)
