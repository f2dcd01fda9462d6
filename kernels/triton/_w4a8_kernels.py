"""The w4a8 form of the expert GEMMs (``activations="mxfp8"``): MXFP4 weights times activations quantized to MXFP8.

Every activation matrix an expert GEMM reads is quantized the way ``mxmoe.core.mxfp4.mxfp8_round_trip`` says (the
OCP MX recipe: per 32 values along K the e8m0 scale byte ``max(e - 8, 0)``, ``e`` the biased exponent of the
block's largest magnitude; values divided by it, saturated to +-448, rounded to nearest even e4m3):

* the hidden states by :func:`mxfp8_quant_kernel`, once per forward, before the w13 GEMM; the alternative, quantizing
  the gathered tile on load inside the GEMM, would redo it for every column tile (45 of them for gpt-oss's
  2I = 5760 at BLOCK_N = 128) and every slot: about 10 ALU operations per value against the BLOCK_N multiply-adds
  the tensor core spends on it, which on an H100 SM (2048 fp8 MAC/clk vs 128 ALU op/clk) is ~1.2x the MMA time
  itself, and twice that on Blackwell. The separate launch reads T x H bf16 and writes T x H bytes + scales.
* the GLU output in the w13 GEMM's epilogue on sm_100 (each value is produced exactly once there, so quantizing it
  costs nothing extra), written as e4m3 bytes + scale bytes for the w2 GEMM; rounded first to the layer's dtype, as
  the reference rounds the GLU output before quantizing it (sm_90: a second quantizer launch, below).

The MMA by arch (``FP8_HOPPER``):

* sm_100 (``FP8_HOPPER=False``): ``tl.dot_scaled`` with both operands' scales, which Triton lowers to the
  block-scaled ``tcgen05.mma ... kind::mxf8f6f4.block_scale`` (SASS ``UTCQMMA``): the tensor core reads the e2m1
  weights, e4m3 activations and both e8m0 scale tiles itself, no upcast. It needs the MMA's M operand to have 128+
  rows: tiles of 128+ token rows put the activations first (acc [BLOCK_M, BLOCK_N]); smaller ones (``SWAP_AB``) put
  the weight rows first (BLOCK_N >= 128) and the tokens as the MMA's N (16-64), acc^T [BLOCK_N, BLOCK_M].
* sm_90 (``FP8_HOPPER=True``): Hopper's tensor cores have no block scales and Triton upcasts ``tl.dot_scaled`` to
  bf16 there, so the loop is written out (:func:`_w4a8_mma_hopper`) as a plain chain of fp8 MMAs (wgmma e4m3 x
  e4m3, the weights as the register operand) into one accumulator, both operands' scales folded in so that no
  partial product needs a rescale (a rescale per K step waits for that step's MMA; that loop ran at a third of the
  bf16 form's speed):

  - each weight row's groups relative to the row's largest scale (read before the loop): a group ``d`` binades
    below it becomes e4m3 values ``v * 2^(6 - d)`` by a byte-table lookup per stored word (two ``prmt``, the
    table's bytes shifted by the group's exponent). Exact for d <= 11; groups further below read as zeros (their
    values are at most 2^-12 of the largest the row's top group can hold; compare e4m3's 2^-4 relative rounding of
    every activation);
  - each activation row onto its largest scale by the quantizer (``FOLD`` = the row): the MXFP8 values re-rounded
    to e4m3 at that scale, exact except values under e4m3's subnormal step there (they move by at most 2^-10 of
    it). The quantizer also lays each K step's bytes out in the order the decode's two halves meet them
    (:func:`_hopper_a_column`), so each half's activations are one contiguous run that Triton copies straight into
    the MMA's shared layout. The w13 GEMM writes its GLU output in the layer's dtype for a second quantizer launch
    (a tile holds only part of a row's columns).
"""

import os

import triton
import triton.language as tl

from ._gemm_kernels import _block_rows, _cast_if_last, _glu_columns, _scale_tile, _tile_coords, _value_tile

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


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


def hopper_a_stride(K: int, BLOCK_K: int) -> int:
    """Row stride (bytes) of the sm_90 activation bytes: K padded to whole K steps (zeros past K)."""
    return (K + BLOCK_K - 1) // BLOCK_K * BLOCK_K


@triton.jit
def _hopper_a_column(c, BLOCK_K: tl.constexpr):
    """Where activation column ``c`` is stored for the sm_90 main loop: in each K step, first the columns the decode's
    ``lo`` half meets (k = 8q + j, j < 4), then the ``hi`` half's (k = 8q + 4 + j), so that each half is one
    contiguous run of BLOCK_K / 2 bytes (``_hopper_fp8_weights``)."""
    r = c % BLOCK_K
    return c - r + (r % 8) // 4 * (BLOCK_K // 2) + r // 8 * 4 + r % 4


@triton.jit(do_not_specialize=["num_rows"])
def mxfp8_quant_kernel(x_ptr, q_ptr, s_ptr, num_rows, COLS: tl.constexpr, FOLD: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HOPPER_K: tl.constexpr = 0):
    """q [R, COLS] (e4m3 bytes), s [R, COLS / 32] (scale bytes) = MXFP8 of x [R, COLS] (COLS a multiple of 32).
    HOPPER_K (the sm_90 GEMMs' K step; then BLOCK_C spans a row): q's rows are :func:`hopper_a_stride` long, columns
    placed by :func:`_hopper_a_column`, zeros past COLS."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    sc = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    r64 = r.to(tl.int64)
    mask = (r[:, None] < num_rows) & (c[None, :] < COLS)
    x = tl.load(x_ptr + r64[:, None] * COLS + c[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = _mxfp8(x, BLOCK_R, BLOCK_C, FOLD)
    q = q.to(tl.uint8, bitcast=True)
    if HOPPER_K:
        stride: tl.constexpr = (COLS + HOPPER_K - 1) // HOPPER_K * HOPPER_K
        tl.store(q_ptr + r64[:, None] * stride + _hopper_a_column(c, HOPPER_K)[None, :], q,
                 mask=(r[:, None] < num_rows) & (c[None, :] < stride))
    else:
        tl.store(q_ptr + r64[:, None] * COLS + c[None, :], q, mask=mask)
    tl.store(s_ptr + r64[:, None] * (COLS // 32) + sc[None, :], s,
             mask=(r[:, None] < num_rows) & (sc[None, :] < COLS // 32))


#: e4m3 bytes of the e2m1 magnitudes 0..3 / 4..7 (0, 0.5, 1, 1.5 / 2, 3, 4, 6), packed as the two words of the
#: Hopper decode's byte table; adding 8 * d to each nonzero byte multiplies its value by 2^d (the exponent field)
LUT_LO = tl.constexpr(0x3C383000)
LUT_HI = tl.constexpr(0x4C484440)
#: the lowest shift that keeps 0.5 * 2^d a normal e4m3 (exponent field 6 + d >= 1); groups below are read as 0
MIN_SHIFT = tl.constexpr(-5)
#: headroom of the row's largest scale group: its 6 lands on 6 * 2^6 = 384 <= 448
TOP_SHIFT = tl.constexpr(6)


def _hopper_fp8_decode_asm() -> str:
    """PTX for one stored word ($2: bytes 4q..4q+3 of a row, i.e. codes k = 8q + [0, 8), low nibble first) with its
    group's byte table ($3 / $7: the two words of e4m3 bytes for magnitudes 0..3 / 4..7): $0 = the e4m3 bytes of
    k = 8q + [0, 4), $1 of k = 8q + [4, 8). ``prmt`` looks each nibble's magnitude up in the table, a second
    ``prmt`` sets the sign bytes."""
    return "{\n" + "\n".join([
        ".reg .b32 sel, t, z, s;",
        "mov.b32 z, 0;",
        "mov.b32 s, 0x80808080;",
        "and.b32 sel, $2, 0x77777777;",
        "prmt.b32 $0, $3, $7, sel;",
        "shr.b32 sel, sel, 16;",
        "prmt.b32 $1, $3, $7, sel;",
        "shr.b32 t, $2, 1;",
        "and.b32 t, t, 0x44444444;",
        "prmt.b32 sel, z, s, t;",
        "or.b32 $0, $0, sel;",
        "shr.b32 t, t, 16;",
        "prmt.b32 sel, z, s, t;",
        "or.b32 $1, $1, sel;",
    ]) + "\n}"


HOPPER_FP8_ASM = tl.constexpr(_hopper_fp8_decode_asm())


@triton.jit
def _fp8_codes(c, d):
    """e4m3 bytes (int32) of e2m1 codes ``c`` times 2^d (d <= 6; 0 where d < MIN_SHIFT): the asm's table, in
    arithmetic (for the interpreter)."""
    mag = c & 7
    base = tl.where(mag >= 2, 0x30 + 4 * mag, 0x30)
    return tl.where((mag == 0) | (d < MIN_SHIFT), 0, base + 8 * d) | ((c & 8) << 4)


@triton.jit
def _hopper_fp8_weights(w, shift, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed e2m1 weights [BLOCK_N, BLOCK_K/2] (row-major bytes, low nibble first) times 2^shift (int32
    [BLOCK_N, BLOCK_K/32], one per scale group, <= TOP_SHIFT) -> two e4m3 tiles [BLOCK_N, BLOCK_K/2]: ``lo`` holds
    k = 8q + j at column 4q + j, ``hi`` k = 8q + 4 + j (j < 4), the order one table lookup per stored word gives.
    Exact where shift >= MIN_SHIFT; a group further below its row's largest scale reads as zeros."""
    G: tl.constexpr = BLOCK_K // 32
    if INTERPRETED:
        b = w.to(tl.int32).reshape(BLOCK_N, BLOCK_K // 8, 4)
        d = tl.broadcast_to(shift.reshape(BLOCK_N, G, 1, 1), [BLOCK_N, G, 4, 4]).reshape(BLOCK_N, BLOCK_K // 8, 4)
        # the word's nibbles in order: byte 0 low, byte 0 high, byte 1 low, ...
        n = tl.join(b & 15, b >> 4).reshape(BLOCK_N, BLOCK_K // 8, 2, 4)
        lo, hi = tl.split(tl.permute(n, (0, 1, 3, 2)))
        lo = _fp8_codes(lo, d).reshape(BLOCK_N, BLOCK_K // 2).to(tl.uint8)
        hi = _fp8_codes(hi, d).reshape(BLOCK_N, BLOCK_K // 2).to(tl.uint8)
    else:
        ok = shift >= MIN_SHIFT
        t_lo = tl.where(ok, LUT_LO + shift * 0x08080800, 0)
        t_hi = tl.where(ok, LUT_HI + shift * 0x08080808, 0)
        t_lo = tl.broadcast_to(t_lo[:, :, None], [BLOCK_N, G, 16]).reshape(BLOCK_N, BLOCK_K // 2)
        t_hi = tl.broadcast_to(t_hi[:, :, None], [BLOCK_N, G, 16]).reshape(BLOCK_N, BLOCK_K // 2)
        lo, hi = tl.inline_asm_elementwise(HOPPER_FP8_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [w, t_lo, t_hi],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _hopper_k_step(acc_t, a8, w_base, s_ptr, expert, cols, col_mask, row_mask, top, k0, N: tl.constexpr,
                   K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """One K step of the sm_90 loop: decode BLOCK_K weight columns to e4m3 and chain their two halves' MMAs into
    ``acc_t``. MASK_K: the step may start past the activation rows' padded length (a promotion group's tail)."""
    kb = tl.arange(0, BLOCK_K // 2)
    w = tl.load(w_base + (k0 // 2 + kb)[None, :], mask=col_mask[:, None] & ((k0 // 2 + kb) < K // 2)[None, :],
                other=0)
    ws = _scale_tile(s_ptr, expert, cols, col_mask, k0, N, K, BLOCK_K).to(tl.int32)
    w_lo, w_hi = _hopper_fp8_weights(w, ws - top[:, None] + TOP_SHIFT, BLOCK_N, BLOCK_K)
    # the activation rows hold each half's columns contiguously, zeros past K (mxfp8_quant_kernel, HOPPER_K)
    if MASK_K:
        a_mask = row_mask[:, None] & (k0 < K)
    else:
        a_mask = row_mask[:, None]
    a_lo = tl.load(a8 + (k0 + kb)[None, :], mask=a_mask, other=0.0)
    a_hi = tl.load(a8 + (k0 + BLOCK_K // 2 + kb)[None, :], mask=a_mask, other=0.0)
    acc_t = tl.dot(w_lo, tl.trans(a_lo), acc_t)
    return tl.dot(w_hi, tl.trans(a_hi), acc_t)


@triton.jit
def _w4a8_mma_hopper(a_rows, a_scale_rows, row_mask, w_ptr, s_ptr, expert, cols, col_mask, N: tl.constexpr,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PROMOTE: tl.constexpr):
    """The sm_90 main loop: acc^T [BLOCK_N, BLOCK_M] fp32. Each weight row's scale groups are folded into its e4m3
    values relative to the row's largest scale (read once before the loop), each activation row comes on one scale
    (the quantizer folded the whole row), so the loop is a plain chain of fp8 MMAs and both scales are applied once
    at the end. PROMOTE = 0: one chain over all of K into the accumulator; P > 0: chains of P K steps into a fresh
    partial sum, each added to the fp32 accumulator (Hopper's fp8 MMA adds with fewer bits than fp32: the chain's
    rounding grows with its length)."""
    KS: tl.constexpr = K // 32
    KS_P2: tl.constexpr = triton.next_power_of_2(KS)
    s_base = s_ptr + expert.to(tl.int64) * (N * KS) + cols.to(tl.int64)[:, None] * KS
    ks = tl.arange(0, KS_P2)
    top = tl.max(tl.load(s_base + ks[None, :], mask=col_mask[:, None] & (ks < KS)[None, :], other=0).to(tl.int32),
                 axis=1)
    # group 0 holds the row's one scale (a_scale_rows is [BLOCK_M, 1])
    a_scale = tl.reshape(tl.load(a_scale_rows, mask=row_mask[:, None], other=127), [BLOCK_M]).to(tl.int32)
    w_base = w_ptr + expert.to(tl.int64) * (N * K // 2) + cols.to(tl.int64)[:, None] * (K // 2)
    # loaded as e4m3 (no bitcast between the load and the MMA, so Triton's pipeline copies straight to the MMA's
    # shared layout)
    a8 = a_rows.to(tl.pointer_type(tl.float8e4nv))
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PROMOTE == 0:
        for k0 in range(0, K, BLOCK_K):
            acc_t = _hopper_k_step(acc_t, a8, w_base, s_ptr, expert, cols, col_mask, row_mask, top, k0, N, K,
                                   BLOCK_N, BLOCK_K, False)
    else:
        MASK_K: tl.constexpr = PROMOTE > 1 and K % (BLOCK_K * PROMOTE) != 0
        for k0 in range(0, K, BLOCK_K * PROMOTE):
            part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for j in tl.static_range(PROMOTE):
                part = _hopper_k_step(part, a8, w_base, s_ptr, expert, cols, col_mask, row_mask, top,
                                      k0 + j * BLOCK_K, N, K, BLOCK_N, BLOCK_K, MASK_K)
            acc_t += part
    return acc_t * _pow2(top - (127 + TOP_SHIFT))[:, None] * _pow2(a_scale - 127)[None, :]


@triton.jit
def _w4a8_mma(a_rows, a_scale_rows, row_mask, w_ptr, s_ptr, expert, cols, col_mask, N: tl.constexpr,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP_AB: tl.constexpr, FP8_HOPPER: tl.constexpr, PROMOTE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = mxfp8(a) @ mxfp4(W[cols])^T over all of K. ``a_rows`` / ``a_scale_rows``
    point at each row's e4m3 bytes / scale bytes; ``cols`` are the weight rows (output columns)."""
    if FP8_HOPPER:
        return tl.trans(_w4a8_mma_hopper(a_rows, a_scale_rows, row_mask, w_ptr, s_ptr, expert, cols, col_mask, N, K,
                                         BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE))
    kb = tl.arange(0, BLOCK_K // 2)
    w_base = w_ptr + expert.to(tl.int64) * (N * K // 2) + cols.to(tl.int64)[:, None] * (K // 2)
    if SWAP_AB:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < K), other=0)
        a = a.to(tl.float8e4nv, bitcast=True)
        a_s = tl.load(a_scale_rows + ks[None, :], mask=row_mask[:, None] & (ks[None, :] < K // 32), other=0)
        ws = _scale_tile(s_ptr, expert, cols, col_mask, k0, N, K, BLOCK_K)
        if SWAP_AB:
            w = tl.load(w_base + (k0 // 2 + kb)[None, :], mask=col_mask[:, None] & ((k0 // 2 + kb) < K // 2)[None, :],
                        other=0)
            acc_t = tl.dot_scaled(w, ws, "e2m1", tl.trans(a), a_s, "e4m3", acc_t)
        else:
            w = _value_tile(w_ptr, expert, cols, col_mask, k0, N, K, BLOCK_K)
            acc = tl.dot_scaled(a, a_s, "e4m3", w, ws, "e2m1", acc)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def glu_gemm_w4a8_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, actq_ptr, acts_ptr, act_ptr,
                         sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                         HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, SWIGLU_OAI: tl.constexpr,
                         ALPHA: tl.constexpr, LIMIT: tl.constexpr, ROUND_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, FP8_HOPPER: tl.constexpr,
                         PROMOTE: tl.constexpr = 0):
    """act = MXFP8(GLU(mxfp8(x[token]) @ w13[e]^T + b13[e])) in expert-sorted row order: e4m3 bytes
    [T*k, I] and scale bytes [T*k, I/32]. Columns and GLU as in ``glu_gemm_kernel``; the GLU output is rounded to
    bf16 first (ROUND_BF16, bf16 layers) as the reference rounds it, then quantized per 32 columns. The matmul's
    output is rounded to bf16 too before the GLU (as the reference rounds it): at the e4m3 step the two roundings
    decide between neighbours. FP8_HOPPER: the GLU output goes to ``act_ptr`` (the layer's dtype) instead, for
    ``mxfp8_quant`` to put each row on one scale (a tile holds only BLOCK_N / 2 of its columns)."""
    block, pid_n = _tile_coords(GROUP_M)
    expert, rows, row_mask = _block_rows(block, block_expert_ptr, block_start_ptr, expert_offsets_ptr, BLOCK_M)
    if expert < 0:
        return
    tokens = (tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0) // TOP_K).to(tl.int64)
    act_col, cols, col_mask = _glu_columns(pid_n, BLOCK_N, INTERLEAVED, INTERMEDIATE)
    XQ_STRIDE: tl.constexpr = (HIDDEN + BLOCK_K - 1) // BLOCK_K * BLOCK_K if FP8_HOPPER else HIDDEN
    acc = _w4a8_mma(xq_ptr + tokens[:, None] * XQ_STRIDE, xs_ptr + tokens[:, None] * (HIDDEN // 32), row_mask,
                    w_ptr, s_ptr, expert, cols, col_mask, 2 * INTERMEDIATE, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K,
                    SWAP_AB, FP8_HOPPER, PROMOTE)
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
    rows64 = rows.to(tl.int64)
    if FP8_HOPPER:
        tl.store(act_ptr + rows64[:, None] * INTERMEDIATE + out_col[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (out_col[None, :] < INTERMEDIATE))
        return
    q, s = _mxfp8(act, BLOCK_M, BLOCK_N // 2, 1)
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
                             FP8_HOPPER: tl.constexpr, FUSED_CAST: tl.constexpr, SLOT_ROWS: tl.constexpr,
                             PROMOTE: tl.constexpr = 0):
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
    AQ_STRIDE: tl.constexpr = (INTERMEDIATE + BLOCK_K - 1) // BLOCK_K * BLOCK_K if FP8_HOPPER else INTERMEDIATE
    acc = _w4a8_mma(actq_ptr + rows64[:, None] * AQ_STRIDE, acts_ptr + rows64[:, None] * (INTERMEDIATE // 32),
                    row_mask, w_ptr, s_ptr, expert, cols, col_mask, HIDDEN, INTERMEDIATE, BLOCK_M, BLOCK_N, BLOCK_K,
                    SWAP_AB, FP8_HOPPER, PROMOTE)
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
