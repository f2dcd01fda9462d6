"""The two grouped MXFP4 GEMMs of an MoE layer, and the cast of their fp32 accumulator.

* ``glu_gemm_kernel``: w13 with bias and GLU activation fused -> activations [T*k, I] (bf16) in
  expert-sorted row order, so the second GEMM reads its rows contiguously.
* ``combine_gemm_kernel``: w2 with bias, routing-weight multiply and the combine back to token
  order fused, by fp32 atomic adds into a zeroed [T, H] accumulator.

Both run over the padded, expert-sorted row space the grouping kernels build (``sorted_pairs``,
``expert_offsets``, ``block_expert``, ``block_start``): program (b, n) computes rows
``block_start[b] + [0, BLOCK_M)`` of expert ``block_expert[b]`` against BLOCK_N weight columns. Two ways to
multiply by the MXFP4 weights (the layout's flags, ``mxmoe.core.layouts.Layout.hopper_words`` / ``.tiles``):

* ``W_HOPPER`` (sm_90, values in :data:`mxmoe.core.layouts.TRITON_HOPPER` order): the weight tile is decoded
  to bf16 in registers by a few integer ops and one bf16x2 multiply per pair of values, and is the
  *left* operand of a plain ``tl.dot`` against the gathered activation rows (``acc^T = W x^T``), so a
  warpgroup MMA reads it straight from registers; the accumulator is transposed once for the epilogue.
* otherwise the weights (the checkpoint's row-major order) are the rhs of ``tl.dot_scaled`` as a
  [BLOCK_K/2, BLOCK_N] uint8 tile packed along K with a [BLOCK_N, BLOCK_K/32] e8m0 scale tile (Blackwell's
  native MXFP4 MMA; on Hopper Triton upcasts them itself, at about twice the instructions per value).

The values are always K-contiguous rows (``K_CONTIGUOUS`` must be True: plans of format /1 name the
constant; an N-contiguous layout was measured, not faster, and needed ``num_stages=1`` on Hopper with
Triton 3.6, so it is gone).

Combine determinism: with atomics, adds into one output element come from a token's k slots (and SPLIT_K
partial sums) in whatever order their CTAs finish. Starting from 0, fp32 ``0 + a + b == 0 + b + a`` exactly, so
two adds per element are bitwise deterministic; more may differ run to run in the last fp32 bit (well below the
final bf16 rounding, which it can still flip). ``SLOT_ROWS`` (plans compiled with ``deterministic=True``, for the
classes where atomics would add more than twice) writes each (token, slot)'s expert output as a row instead
(rounded to the activation dtype like the reference's ``[T, k, H]``; fp32 partial rows when K is split), and
:func:`combine_slots_kernel` (or, in the gemv class, the combine's last program per column tile) adds a token's
rows in slot order: the same bits on every run, at the cost of a [T*k, H] write and read.
"""

import os

import triton
import triton.language as tl

from mxmoe.core.swizzle import HOPPER_PAIR_BITS, HOPPER_TILE_BYTES, HOPPER_TILE_ROWS

from ._routing_kernel import round_to_bf16

#: This module is executed once as compiled kernels and, when interpreted kernels are asked for, once
#: more under TRITON_INTERPRET (see kernels.py): the interpreter cannot run inline PTX.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def _hopper_decode_asm(wide_scales: bool) -> str:
    """PTX that turns one stored word ($4) into the four bf16 pairs $0..$3 (pair j: rows r / r+8 for even /
    odd j, k / k+16 for j < 2 / j >= 2), each multiplied by its row's factor ($5: row r, $7: row r+8).
    Fast form: one multiply by 2^126 * scale (exact when every scale byte is <= 128). Wide form: by 2^126,
    then by the e8m0 scale (exact for every scale, NaN for 255)."""
    lines = [".reg .b32 t, u, z, b;", "mov.b32 z, 0x80008000;", "mov.b32 b, 0x7E807E80;"]
    for j, groups in enumerate(HOPPER_PAIR_BITS):
        for reg, (mask, r) in zip("tu", groups):
            src = "$4"
            if r:
                lines.append(f"shf.l.wrap.b32 {reg}, $4, $4, {r};")
                src = reg
            lines.append(f"and.b32 {reg}, {src}, {mask:#010x};")
        if len(groups) == 2:
            lines.append("or.b32 t, t, u;")
        factor = "$7" if j % 2 else "$5"
        if wide_scales:
            lines.append("fma.rn.bf16x2 t, t, b, z;")
        lines.append(f"fma.rn.bf16x2 ${j}, t, {factor}, z;")  # a*b + (-0) is a*b exactly, signed zeros too
    return "{\n" + "\n".join(lines) + "\n}"


HOPPER_ASM_FAST = tl.constexpr(_hopper_decode_asm(False))
HOPPER_ASM_WIDE = tl.constexpr(_hopper_decode_asm(True))
# the same (mask, rotation) groups for the interpreter's twin of the asm (pair 3 has two groups)
(_P0M, _P0R), = HOPPER_PAIR_BITS[0]
(_P1M, _P1R), = HOPPER_PAIR_BITS[1]
(_P2M, _P2R), = HOPPER_PAIR_BITS[2]
(_P3M, _P3R), (_P3MB, _P3RB) = HOPPER_PAIR_BITS[3]
P0M, P0R, P1M, P1R, P2M, P2R, P3M, P3R, P3MB, P3RB = map(
    tl.constexpr, (_P0M, _P0R, _P1M, _P1R, _P2M, _P2R, _P3M, _P3R, _P3MB, _P3RB))
#: a decoded pair's bits are its values times 2^-126
TWO_126 = tl.constexpr(2.0 ** 126)
TILE_ROWS = tl.constexpr(HOPPER_TILE_ROWS)
TILE_BYTES = tl.constexpr(HOPPER_TILE_BYTES)


@triton.jit
def _value_tile(w_ptr, expert, cols, col_mask, k0, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed values [BLOCK_K/2, BLOCK_N] of one expert's columns (two e2m1 codes a byte, along K)."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    w_base = w_ptr + expert.to(tl.int64) * (N * K // 2)
    w_offs = cols[None, :] * (K // 2) + kb[:, None]
    return tl.load(w_base + w_offs, mask=(kb[:, None] < K // 2) & col_mask[None, :], other=0)


@triton.jit
def _rotl(w, r: tl.constexpr):
    return (w << r) | (w >> (32 - r))


@triton.jit
def _hopper_pair(word, MASK_A: tl.constexpr, ROT_A: tl.constexpr, MASK_B: tl.constexpr, ROT_B: tl.constexpr,
                 factor):
    """Interpreter twin of one asm pair: [..., h] fp32 values (bits are v * 2^-126, times 2^126 * factor)."""
    p = _rotl(word, ROT_A) & MASK_A if ROT_A else word & MASK_A
    if MASK_B:
        p = p | (_rotl(word, ROT_B) & MASK_B)
    lo = (p << 16).to(tl.float32, bitcast=True) * TWO_126
    hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True) * TWO_126
    return tl.join(lo * factor, hi * factor)


@triton.jit
def _hopper_decode_interpreted(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decode of :func:`_hopper_decode` in fp32 arithmetic (exact for every scale byte)."""
    G: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 32
    b = w.to(tl.uint32).reshape(G, 2, 8, KB, 4, 4)  # [g, jl, i, kb, q, byte]
    word = tl.sum(b << (tl.arange(0, 4) * 8)[None, None, None, None, None, :], axis=5)
    s = s.to(tl.uint32)
    f = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23)).to(tl.float32, bitcast=True)
    f_r, f_r8 = tl.split(tl.permute(f.reshape(G, 2, 8, KB), (0, 2, 3, 1)))  # [g, i, kb] of rows r, r + 8
    f_r = tl.broadcast_to(f_r[:, None, :, :, None], [G, 2, 8, KB, 4])
    f_r8 = tl.broadcast_to(f_r8[:, None, :, :, None], [G, 2, 8, KB, 4])
    p0 = _hopper_pair(word, P0M, P0R, 0, 0, f_r)
    p1 = _hopper_pair(word, P1M, P1R, 0, 0, f_r8)
    p2 = _hopper_pair(word, P2M, P2R, 0, 0, f_r)
    p3 = _hopper_pair(word, P3M, P3R, P3MB, P3RB, f_r8)
    v = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [g, jl, i, kb, q, h, rb, t]
    v = tl.permute(v, (0, 6, 2, 3, 7, 1, 4, 5)).reshape(BLOCK_N, BLOCK_K)
    # Every value is a bf16 already, so its bits are the fp32 bits' top half (the interpreter's own fp32 ->
    # bf16 conversion flushes subnormals such as 0.5 * 2^-127).
    return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _hopper_decode(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDE_SCALES: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] bf16 (tile rows in order, k in order) from a tile of stored
    :data:`~mxmoe.core.layouts.TRITON_HOPPER` bytes [BLOCK_N, BLOCK_K/2] (whole 16-row groups) and its scales
    [BLOCK_N, BLOCK_K/32]. Stored word (g, jl, i, kb, q) = bytes 16kb + 4q + [0, 4) of tile row
    16g + 8jl + i; its byte e = 2rb + h carries, through pairs rb + 2t, the values of row 16g + 8rb + i at
    k = 32kb + 16t + 8jl + 2q + h. The reshapes below say exactly that, and Triton keeps them in registers:
    the four bytes of a word are consecutive registers of one thread, where the MMA wants them."""
    if INTERPRETED:
        return _hopper_decode_interpreted(w, s, BLOCK_N, BLOCK_K)
    G: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 32
    s = s.to(tl.uint32)
    if WIDE_SCALES:  # bf16 bits of 2^(s-127): 0 -> the subnormal 2^-127, 255 -> NaN
        f = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7))
    else:  # bf16 bits of 2^126 * 2^(s-127) = 2^(s-1)
        f = (s + 126) << 7
    f = f | (f << 16)
    f = tl.permute(f.reshape(G, 2, 8, KB), (0, 2, 3, 1))  # [g, i, kb, rb]
    f = tl.broadcast_to(f[:, None, :, :, None, :, None], [G, 2, 8, KB, 4, 2, 2]).reshape(BLOCK_N, BLOCK_K // 2)
    if WIDE_SCALES:
        r0, r1 = tl.inline_asm_elementwise(HOPPER_ASM_WIDE, "=r,=r,=r,=r,r,r,r,r,r", [w, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        r0, r1 = tl.inline_asm_elementwise(HOPPER_ASM_FAST, "=r,=r,=r,=r,r,r,r,r,r", [w, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    v = tl.join(r0, r1).reshape(G, 2, 8, KB, 4, 2, 2, 2)  # [g, jl, i, kb, q, rb, h, t]
    return tl.permute(v, (0, 5, 2, 3, 7, 1, 4, 6)).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _dot_w_xt(w, x, acc):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K]^T, bf16 in, fp32 accumulation."""
    if INTERPRETED:  # Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits
        return tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _hopper_mma(a_rows, row_mask, w_ptr, s_ptr, expert, w_rows, w_mask, tile_row, N: tl.constexpr,
                K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, W_TMA: tl.constexpr, W_TILES: tl.constexpr, WIDE_SCALES: tl.constexpr,
                k_lo, k_hi, row_scale=None, SCALE_ROWS: tl.constexpr = False):
    """acc^T [BLOCK_N, BLOCK_M] = W[w_rows] @ a^T over k in [k_lo, k_hi) (k_lo a multiple of BLOCK_K): the
    Hopper path's main loop, shared by both GEMMs. ``a_rows`` points at each of the BLOCK_M activation rows;
    ``tile_row`` is the first of ``w_rows`` (which are then consecutive) for TMA loads. SCALE_ROWS: each row times
    its ``row_scale`` first (:func:`_scale_rows`)."""
    tl.static_assert(not (W_TMA and W_TILES), "TMA tiles read the row order, not the tiled one")
    if W_TMA:
        desc = _weight_descriptor(w_ptr, N, K, NUM_EXPERTS, BLOCK_N, BLOCK_K)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # scales prefetched one K step ahead, as in the dot_scaled loops
    s_next = _scale_tile(s_ptr, expert, w_rows, w_mask, k_lo, N, K, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        s = s_next
        s_next = _scale_tile(s_ptr, expert, w_rows, w_mask, k0 + BLOCK_K, N, K, BLOCK_K)
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < K), other=0.0)
        if SCALE_ROWS:
            a = _scale_rows(a, row_scale)
        if W_TMA:
            w = desc.load([expert * N + tile_row, k0 // 2])
        else:
            w = _hopper_tile(w_ptr, expert, w_rows, w_mask, k0, N, K, BLOCK_K, W_TILES)
        acc_t = _dot_w_xt(_hopper_decode(w, s, BLOCK_N, BLOCK_K, WIDE_SCALES), a.to(tl.bfloat16), acc_t)
    return acc_t


@triton.jit
def _scale_rows(a, row_scale):
    """Router weight on input: rows ``a`` [M, K] times their weight [M] (fp32, already rounded to a's dtype), the
    product rounded to a's dtype (to nearest even, also under the interpreter), as the reference's ``weight_rows``
    does before the experts."""
    p = a.to(tl.float32) * row_scale[:, None]
    if a.dtype == tl.bfloat16:
        p = round_to_bf16(p)
    return p.to(a.dtype)


@triton.jit
def _weight_descriptor(w_ptr, N: tl.constexpr, K: tl.constexpr, NUM_EXPERTS, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """TMA descriptor over all experts' packed values as one [E*N, K/2] matrix: tile (expert*N + n0, k0/2)
    is BLOCK_N rows of BLOCK_K/2 bytes. Rows past an expert's N read the next expert's (their output
    columns are masked), rows past the last expert and bytes past K/2 read as zero codes."""
    return tl.make_tensor_descriptor(w_ptr, shape=[NUM_EXPERTS * N, K // 2], strides=[K // 2, 1],
                                     block_shape=[BLOCK_N, BLOCK_K // 2])


@triton.jit
def _hopper_tile(w_ptr, expert, rows, row_mask, k0, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 TILED: tl.constexpr):
    """Stored bytes [BLOCK_N, BLOCK_K/2] of TRITON_HOPPER values for tile rows ``rows`` (whole 16-row groups).
    TILED: the TRITON_HOPPER_TILED order (``mxmoe.core.swizzle.hopper_tile_offsets``: 64-row groups stored in
    128-byte chunks along K; ``k0`` is a multiple of BLOCK_K <= 256, so the tile lies in one chunk ``j``).
    When N and K/2 are multiples of the group and the chunk, the offset is a row term plus a column term.
    (``_value_tile(...).T`` is the same tensor, but Triton lays the transposed load out differently: other SASS.)"""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    w_base = w_ptr + expert.to(tl.int64) * (N * K // 2)
    if TILED:
        tl.static_assert(BLOCK_K <= 2 * TILE_BYTES, "tiled Hopper weights need BLOCK_K <= 256")
        j = k0 // (2 * TILE_BYTES)
        chunk = j * TILE_BYTES
        if N % TILE_ROWS.value == 0 and (K // 2) % TILE_BYTES.value == 0:
            row_offs = rows // TILE_ROWS * (TILE_ROWS * (K // 2)) + rows % TILE_ROWS * TILE_BYTES
            offs = row_offs[:, None] + (kb + chunk * (TILE_ROWS - 1))[None, :]
        else:  # a shorter last group (rows) or chunk (width): the general formula
            g0 = rows // TILE_ROWS * TILE_ROWS
            width16 = tl.minimum(TILE_BYTES // 16, (K // 2 - chunk) // 16)  # the chunk's bytes per row / 16
            row_offs = g0 * (K // 2) + tl.minimum(TILE_ROWS, N - g0) * chunk + (rows - g0) * (width16 * 16)
            offs = row_offs[:, None] + (kb - chunk)[None, :]
    else:
        offs = rows[:, None] * (K // 2) + kb[None, :]
    return tl.load(w_base + offs, mask=row_mask[:, None] & (kb[None, :] < K // 2), other=0)


@triton.jit
def _scale_tile(s_ptr, expert, cols, col_mask, k0, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """e8m0 scales [BLOCK_N, BLOCK_K/32] of one expert's columns; 127 (= 1.0) past K."""
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s_base = s_ptr + expert.to(tl.int64) * (N * K // 32)
    s_offs = cols[:, None] * (K // 32) + ks[None, :]
    return tl.load(s_base + s_offs, mask=col_mask[:, None] & (ks[None, :] < K // 32), other=127)


@triton.jit
def _tile_coords(GROUP_M: tl.constexpr):
    """(row block, column tile) of this program on the (row blocks, column tiles) grid.

    The hardware starts programs in grid order, so this order decides what the programs in flight
    share in L2. GROUP_M = 0: row blocks vary fastest (programs in flight share one weight tile and
    each reads its own activation rows; activation rows are then re-read from DRAM once per column
    tile). GROUP_M > 0: programs walk GROUP_M row blocks across every column tile before moving on,
    so a row block's activations are read from DRAM about once and a weight tile about once per group.
    """
    if GROUP_M == 0:
        return tl.program_id(0), tl.program_id(1)
    num_blocks = tl.num_programs(0)
    per_group = GROUP_M * tl.num_programs(1)
    pid = tl.program_id(1) * num_blocks + tl.program_id(0)
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _block_rows(block, block_expert_ptr, block_start_ptr, expert_offsets_ptr, BLOCK_M: tl.constexpr):
    """(expert, sorted rows, row mask) of row block ``block``; expert < 0 means nothing to do."""
    expert = tl.load(block_expert_ptr + block)
    start, end = _block_span(block, block_start_ptr, expert_offsets_ptr, tl.maximum(expert, 0))
    rows = start + tl.arange(0, BLOCK_M)
    return expert, rows, rows < end


@triton.jit
def _block_span(block, block_start_ptr, expert_offsets_ptr, expert):
    """(first sorted row, end of the expert's rows) of row block ``block`` of expert ``expert`` (>= 0)."""
    return tl.load(block_start_ptr + block), tl.load(expert_offsets_ptr + expert + 1)


@triton.jit
def _glu_columns(pid_n, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr, INTERMEDIATE: tl.constexpr):
    """(activation column, w13 weight row, mask) of each of a GLU tile's BLOCK_N columns: (gate, up) pairs of
    BLOCK_N / 2 activation columns, the rows interleaved or [gate | up]."""
    c = tl.arange(0, BLOCK_N)
    act_col = pid_n * (BLOCK_N // 2) + c // 2
    if INTERLEAVED:
        cols = 2 * act_col + c % 2
    else:
        cols = act_col + (c % 2) * INTERMEDIATE
    return act_col, cols, act_col < INTERMEDIATE


@triton.jit
def glu_gemm_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr,
                    sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                    HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, SWIGLU_OAI: tl.constexpr,
                    ALPHA: tl.constexpr, LIMIT: tl.constexpr, K_CONTIGUOUS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    W_TMA: tl.constexpr, NUM_EXPERTS: tl.constexpr, GROUP_M: tl.constexpr = 0,
                    W_HOPPER: tl.constexpr = False, WIDE_SCALES: tl.constexpr = False, W_TILES: tl.constexpr = False,
                    SCALE_ROWS: tl.constexpr = False, row_weights_ptr=None, ACTIVATION: tl.constexpr = 0,
                    TAIL_M: tl.constexpr = 0):
    """act[sorted row, :] = GLU(x[token] @ w13[e]^T + b13[e]), written in expert-sorted row order.

    Tile column c holds w13 row ``glu_row(pid_n*BLOCK_N/2 + c//2, c%2)``: gate for even c, up for
    odd c, so one dot yields matched gate/up pairs for either GLU layout and the activation is
    applied before anything leaves registers. x rows are gathered by token index in the loads.
    W_TMA loads the weight tiles through a TMA descriptor (needs interleaved gate/up rows, so that a tile's
    w13 rows are consecutive). W_HOPPER: the decode-in-registers path (see
    the module docstring); WIDE_SCALES picks its exact-for-every-scale multiply; W_TILES: its values in the
    tiled order (``mxmoe.core.layouts.TRITON_HOPPER_TILED``). K_CONTIGUOUS: always True (module docstring).
    SCALE_ROWS (router weight on input): each gathered row times its pair's routing weight ``row_weights_ptr``
    [T*k] fp32, rounded to x's dtype, before the GEMM (the reference's ``weight_rows``).
    TAIL_M (Hopper path): a row block holding at most TAIL_M rows (an expert's last, partly filled block) runs
    TAIL_M-row MMAs instead of BLOCK_M ones (:func:`_glu_tile` twice: both widths are compiled in).
    """
    tl.static_assert(K_CONTIGUOUS, "the values are K-contiguous rows (the N-contiguous path is gone)")
    tl.static_assert(TAIL_M == 0 or (W_HOPPER and TAIL_M < BLOCK_M), "tail tiles: Hopper path, narrower than BLOCK_M")
    block, pid_n = _tile_coords(GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start, end = _block_span(block, block_start_ptr, expert_offsets_ptr, expert)
    if TAIL_M > 0:
        if end - start <= TAIL_M:
            _glu_tile(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, sorted_pairs_ptr, row_weights_ptr, expert, start, end,
                      pid_n, HIDDEN, INTERMEDIATE, TOP_K, HAS_BIAS, INTERLEAVED, SWIGLU_OAI, ALPHA, LIMIT, TAIL_M,
                      BLOCK_N, BLOCK_K, W_TMA, NUM_EXPERTS, W_HOPPER, WIDE_SCALES, W_TILES, SCALE_ROWS, ACTIVATION)
        else:
            _glu_tile(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, sorted_pairs_ptr, row_weights_ptr, expert, start, end,
                      pid_n, HIDDEN, INTERMEDIATE, TOP_K, HAS_BIAS, INTERLEAVED, SWIGLU_OAI, ALPHA, LIMIT, BLOCK_M,
                      BLOCK_N, BLOCK_K, W_TMA, NUM_EXPERTS, W_HOPPER, WIDE_SCALES, W_TILES, SCALE_ROWS, ACTIVATION)
    else:
        _glu_tile(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, sorted_pairs_ptr, row_weights_ptr, expert, start, end,
                  pid_n, HIDDEN, INTERMEDIATE, TOP_K, HAS_BIAS, INTERLEAVED, SWIGLU_OAI, ALPHA, LIMIT, BLOCK_M,
                  BLOCK_N, BLOCK_K, W_TMA, NUM_EXPERTS, W_HOPPER, WIDE_SCALES, W_TILES, SCALE_ROWS, ACTIVATION)


@triton.jit
def _glu_tile(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, sorted_pairs_ptr, row_weights_ptr, expert, start, end, pid_n,
              HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
              INTERLEAVED: tl.constexpr, SWIGLU_OAI: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
              NUM_EXPERTS: tl.constexpr, W_HOPPER: tl.constexpr, WIDE_SCALES: tl.constexpr, W_TILES: tl.constexpr,
              SCALE_ROWS: tl.constexpr, ACTIVATION: tl.constexpr):
    """:func:`glu_gemm_kernel`'s work for sorted rows ``start + [0, BLOCK_M)`` (those before ``end``) of ``expert``
    against column tile ``pid_n``."""
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)
    tokens = pairs // TOP_K
    row_scale = None
    if SCALE_ROWS:  # the weight rounded to x's dtype first, as engines do (x * w.to(x.dtype))
        row_scale = tl.load(row_weights_ptr + pairs, mask=row_mask, other=0.0)
        if x_ptr.dtype.element_ty == tl.bfloat16:
            row_scale = round_to_bf16(row_scale)
    act_col, cols, col_mask = _glu_columns(pid_n, BLOCK_N, INTERLEAVED, INTERMEDIATE)
    c = tl.arange(0, BLOCK_N)  # the TMA [gate | up] path below maps tile rows itself

    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * HIDDEN
    if W_HOPPER:
        # Tile rows must be whole 16-row groups of the stored layout: interleaved gate/up rows are
        # consecutive already; the concatenated order takes BLOCK_N/2 gate rows, then their up rows.
        if INTERLEAVED:
            w_rows, w_mask = cols, col_mask
        else:
            half = pid_n * (BLOCK_N // 2) + c % (BLOCK_N // 2)
            w_rows, w_mask = half + (c // (BLOCK_N // 2)) * INTERMEDIATE, half < INTERMEDIATE
        tl.static_assert(INTERLEAVED or not W_TMA, "W_TMA needs interleaved gate/up rows")
        acc_t = _hopper_mma(x_rows, row_mask, w_ptr, s_ptr, expert, w_rows, w_mask, pid_n * BLOCK_N, 2 * INTERMEDIATE,
                            HIDDEN, NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, W_TILES, WIDE_SCALES, 0, HIDDEN,
                            row_scale, SCALE_ROWS)
        if not INTERLEAVED:  # [gate | up] tile rows -> the (gate, up) column pairs the epilogue splits
            acc_t = tl.permute(acc_t.reshape(2, BLOCK_N // 2, BLOCK_M), (1, 0, 2)).reshape(BLOCK_N, BLOCK_M)
        acc = tl.trans(acc_t)
    else:
        if W_TMA:
            tl.static_assert(INTERLEAVED, "W_TMA needs interleaved gate/up rows")
            desc = _weight_descriptor(w_ptr, 2 * INTERMEDIATE, HIDDEN, NUM_EXPERTS, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # The scale rows are too short for Triton's async-copy pipelining (BLOCK_K/32 bytes), so they
        # are prefetched one K step ahead by hand instead of stalling every step on a global load.
        s_next = _scale_tile(s_ptr, expert, cols, col_mask, 0, 2 * INTERMEDIATE, HIDDEN, BLOCK_K)
        for k0 in range(0, HIDDEN, BLOCK_K):
            s = s_next
            s_next = _scale_tile(s_ptr, expert, cols, col_mask, k0 + BLOCK_K, 2 * INTERMEDIATE, HIDDEN, BLOCK_K)
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < HIDDEN), other=0.0)
            if SCALE_ROWS:
                x = _scale_rows(x, row_scale)
            if W_TMA:
                w = desc.load([expert * (2 * INTERMEDIATE) + pid_n * BLOCK_N, k0 // 2]).T
            else:
                w = _value_tile(w_ptr, expert, cols, col_mask, k0, 2 * INTERMEDIATE, HIDDEN, BLOCK_K)
            acc = tl.dot_scaled(x.to(tl.bfloat16), None, "bf16", w, s, "e2m1", acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * (2 * INTERMEDIATE) + cols, mask=col_mask, other=0.0)[None, :]

    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    act = _glu(gate, up, SWIGLU_OAI, ACTIVATION, ALPHA, LIMIT)

    out_col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE + out_col[None, :],
             act.to(act_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (out_col[None, :] < INTERMEDIATE))


@triton.jit
def _glu(gate, up, SWIGLU_OAI: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr,
         LIMIT: tl.constexpr):
    """The GLU of fp32 ``gate`` and ``up`` (``mxmoe.core.reference.glu``): SWIGLU_OAI gpt-oss's clamped
    ``(up + 1) * gate * sigmoid(ALPHA * gate)``; else by ACTIVATION (``ACTIVATIONS`` in the planner): 0 silu, 1 exact
    gelu (erf), 2 gelu's tanh form (as gate * sigmoid(2 z): tanh z = 2 sigmoid(2z) - 1), 3 silu with gpt-oss's
    clamps; times ``up``."""
    if SWIGLU_OAI or ACTIVATION == 3:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if SWIGLU_OAI:
        return (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
    if ACTIVATION == 1:
        return up * (gate * 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476)))
    if ACTIVATION == 2:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return up * (gate * tl.sigmoid(2.0 * inner))  # gate/2 * (1 + tanh(inner))
    return up * gate * tl.sigmoid(gate)


@triton.jit
def _reduce_slots(rows_ptr, weights_ptr, ids_ptr, out_ptr, t, cols, num_tokens, HIDDEN: tl.constexpr,
                  TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_ROWS: tl.constexpr, UNIT_WEIGHTS: tl.constexpr,
                  SHARED: tl.constexpr = False, SHARED_GATE: tl.constexpr = False, shared_rows_ptr=None,
                  shared_w_ptr=None):
    """out[t, cols] = sum over slots j in order of weight[t, j] * y[t, j] (fp32, one fma per slot from 0), rounded to
    the output dtype. y[t, j] is row t*k + j of ``rows_ptr`` ([SPLIT_K, T*k, HIDDEN]: the SPLIT_K partial rows
    added in order, then rounded to bf16 with ROUND_ROWS, as the reference rounds each expert's output); a slot
    whose expert id is negative (not this layer's) adds nothing; UNIT_WEIGHTS: weight 1 (router weight on input).
    SHARED: the shared expert's row [T, HIDDEN] comes last, times its gate ``shared_w_ptr`` [T] (SHARED_GATE) or 1.
    Rows may come from other programs of the same launch: read through L2."""
    t_mask = t < num_tokens
    c_mask = cols < HIDDEN
    num_pairs = num_tokens.to(tl.int64) * TOP_K
    acc = tl.zeros([t.shape[0], cols.shape[0]], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t.to(tl.int64) * TOP_K + j
        valid = t_mask & (tl.load(ids_ptr + pair, mask=t_mask, other=-1) >= 0)
        mask = valid[:, None] & c_mask[None, :]
        y = tl.zeros([t.shape[0], cols.shape[0]], tl.float32)
        for s in tl.static_range(SPLIT_K):
            y += tl.load(rows_ptr + (s * num_pairs + pair)[:, None] * HIDDEN + cols[None, :], mask=mask, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        if ROUND_ROWS:
            y = y.to(tl.bfloat16).to(tl.float32)
        if UNIT_WEIGHTS:
            w = tl.where(valid, 1.0, 0.0)
        else:
            w = tl.load(weights_ptr + pair, mask=valid, other=0.0)
        acc = tl.fma(w[:, None], y, acc)
    if SHARED:
        mask = t_mask[:, None] & c_mask[None, :]
        y = tl.load(shared_rows_ptr + t.to(tl.int64)[:, None] * HIDDEN + cols[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        if SHARED_GATE:
            w = tl.load(shared_w_ptr + t, mask=t_mask, other=0.0)
        else:
            w = tl.where(t_mask, 1.0, 0.0)
        acc = tl.fma(w[:, None], y, acc)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * HIDDEN + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _cast_if_last(out_ptr, cast_ptr, num_tokens, pid_n, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr,
                  SLOT_ROWS: tl.constexpr = False, rows_ptr=None, weights_ptr=None, ids_ptr=None,
                  TOP_K: tl.constexpr = 1, SPLIT_K: tl.constexpr = 1, ROUND_ROWS: tl.constexpr = False,
                  UNIT_WEIGHTS: tl.constexpr = False, SHARED: tl.constexpr = False, SHARED_GATE: tl.constexpr = False,
                  shared_rows_ptr=None, shared_w_ptr=None):
    """The last program (of the row blocks and K splits) to finish column tile ``pid_n`` writes its
    [T, BLOCK_N] sums to ``cast_ptr`` in the output dtype (SLOT_ROWS: adds up the tile's slot rows,
    :func:`_reduce_slots`). Programs count themselves in an int32 per column tile kept in row T of ``out_ptr``
    (zeroed with the accumulator); the count is an acquire-release atomic after a barrier, so the last program
    reads every other program's atomics or rows (from L2). That program also sets the tile's sums and its count
    back to zero: a call leaves the accumulator as it found it (zeroed once by the executor, not every call)."""
    tl.debug_barrier()
    counter = (out_ptr + num_tokens.to(tl.int64) * HIDDEN).to(tl.pointer_type(tl.int32), bitcast=True) + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * tl.num_programs(2) - 1:
        tl.store(counter, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        for t0 in range(0, num_tokens, 16):
            t = t0 + tl.arange(0, 16)
            if SLOT_ROWS:
                _reduce_slots(rows_ptr, weights_ptr, ids_ptr, cast_ptr, t, cols, num_tokens, HIDDEN, TOP_K, SPLIT_K,
                              ROUND_ROWS, UNIT_WEIGHTS, SHARED, SHARED_GATE, shared_rows_ptr, shared_w_ptr)
            else:
                offs = t.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
                mask = (t[:, None] < num_tokens) & (cols[None, :] < HIDDEN)
                v = tl.load(out_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(cast_ptr + offs, v.to(cast_ptr.dtype.element_ty), mask=mask)
                tl.debug_barrier()  # every read of the sums done (in every thread) before they are cleared
                tl.store(out_ptr + offs, tl.zeros_like(v), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])  # as AOT compiles it (a JIT run at 1 token made it a constant)
def combine_gemm_kernel(act_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr,
                        sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                        cast_ptr, num_tokens,
                        HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, K_CONTIGUOUS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        W_TMA: tl.constexpr, NUM_EXPERTS: tl.constexpr, GROUP_M: tl.constexpr = 0,
                        W_HOPPER: tl.constexpr = False, WIDE_SCALES: tl.constexpr = False,
                        FUSED_CAST: tl.constexpr = False, W_TILES: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
                        SLOT_ROWS: tl.constexpr = False, ROUND_ROWS: tl.constexpr = False,
                        UNIT_WEIGHTS: tl.constexpr = False, SHARED: tl.constexpr = False,
                        SHARED_GATE: tl.constexpr = False, rows_ptr=None, ids_ptr=None, shared_rows_ptr=None,
                        shared_w_ptr=None, TAIL_M: tl.constexpr = 0):
    """out[token] += weight[pair] * (act[sorted row] @ w2[e]^T + b2[e]), fp32 atomics into [T, H].

    Rows of ``act`` are read contiguously (they are already expert-sorted); only the combine
    scatters, by token. A token receives exactly TOP_K adds, one per slot. W_TMA: weight tiles
    through a TMA descriptor. W_HOPPER / WIDE_SCALES: as in glu_gemm_kernel.
    FUSED_CAST (the gemv class): ``out_ptr`` has T + 1 rows and the last program of each column tile writes
    the finished [T, BLOCK_N] tile to ``cast_ptr`` in its dtype, so no separate cast launch follows.
    SPLIT_K (Hopper path): grid axis 2 splits I into that many ranges of whole BLOCK_K steps, each program
    adding its partial sums (the bias with the first); at one token the w2 GEMM has few programs per SM.
    SLOT_ROWS (deterministic plans): no atomics; program (b, n, s) writes its rows' unweighted sums (bias with
    split 0) to ``rows_ptr`` [SPLIT_K, T*k, H] at their pair's row, and FUSED_CAST's last program adds them up in
    slot order (:func:`_reduce_slots`; ``ids_ptr``: the expert ids, negative ones skipped; SHARED: the shared
    expert's rows last). UNIT_WEIGHTS: every routing weight is 1 (the router weight was applied to the input).
    TAIL_M: as in glu_gemm_kernel (:func:`_combine_tile`).
    """
    tl.static_assert(SPLIT_K == 1 or W_HOPPER, "split-K is built for the Hopper path only")
    tl.static_assert(K_CONTIGUOUS, "the values are K-contiguous rows (the N-contiguous path is gone)")
    tl.static_assert(TAIL_M == 0 or (W_HOPPER and TAIL_M < BLOCK_M), "tail tiles: Hopper path, narrower than BLOCK_M")
    block, pid_n = _tile_coords(GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        if FUSED_CAST:  # an empty row block still counts towards its column tile
            _cast_if_last(out_ptr, cast_ptr, num_tokens, pid_n, HIDDEN, BLOCK_N, SLOT_ROWS, rows_ptr,
                          routing_weights_ptr, ids_ptr, TOP_K, SPLIT_K, ROUND_ROWS, UNIT_WEIGHTS, SHARED, SHARED_GATE,
                          shared_rows_ptr, shared_w_ptr)
        return
    start, end = _block_span(block, block_start_ptr, expert_offsets_ptr, expert)
    if TAIL_M > 0:
        if end - start <= TAIL_M:
            _combine_tile(act_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr, sorted_pairs_ptr, rows_ptr,
                          num_tokens, expert, start, end, pid_n, HIDDEN, INTERMEDIATE, TOP_K, HAS_BIAS, TAIL_M,
                          BLOCK_N, BLOCK_K, W_TMA, NUM_EXPERTS, W_HOPPER, WIDE_SCALES, W_TILES, SPLIT_K, SLOT_ROWS,
                          UNIT_WEIGHTS)
        else:
            _combine_tile(act_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr, sorted_pairs_ptr, rows_ptr,
                          num_tokens, expert, start, end, pid_n, HIDDEN, INTERMEDIATE, TOP_K, HAS_BIAS, BLOCK_M,
                          BLOCK_N, BLOCK_K, W_TMA, NUM_EXPERTS, W_HOPPER, WIDE_SCALES, W_TILES, SPLIT_K, SLOT_ROWS,
                          UNIT_WEIGHTS)
    else:
        _combine_tile(act_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr, sorted_pairs_ptr, rows_ptr,
                      num_tokens, expert, start, end, pid_n, HIDDEN, INTERMEDIATE, TOP_K, HAS_BIAS, BLOCK_M, BLOCK_N,
                      BLOCK_K, W_TMA, NUM_EXPERTS, W_HOPPER, WIDE_SCALES, W_TILES, SPLIT_K, SLOT_ROWS, UNIT_WEIGHTS)
    if FUSED_CAST:
        _cast_if_last(out_ptr, cast_ptr, num_tokens, pid_n, HIDDEN, BLOCK_N, SLOT_ROWS, rows_ptr,
                      routing_weights_ptr, ids_ptr, TOP_K, SPLIT_K, ROUND_ROWS, UNIT_WEIGHTS, SHARED, SHARED_GATE,
                      shared_rows_ptr, shared_w_ptr)


@triton.jit
def _combine_tile(act_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr, sorted_pairs_ptr, rows_ptr, num_tokens,
                  expert, start, end, pid_n, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  W_TMA: tl.constexpr, NUM_EXPERTS: tl.constexpr, W_HOPPER: tl.constexpr, WIDE_SCALES: tl.constexpr,
                  W_TILES: tl.constexpr, SPLIT_K: tl.constexpr, SLOT_ROWS: tl.constexpr, UNIT_WEIGHTS: tl.constexpr):
    """:func:`combine_gemm_kernel`'s work for sorted rows ``start + [0, BLOCK_M)`` (those before ``end``) of
    ``expert`` against column tile ``pid_n`` (and K range ``program_id(2)``)."""
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN

    a_rows = act_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE
    if W_HOPPER:
        if SPLIT_K == 1:  # constant bounds: run-time ones change how Triton pipelines the loop (slower MMA waits)
            k_lo, k_hi = 0, INTERMEDIATE
        else:
            STEPS_PER_SPLIT: tl.constexpr = ((INTERMEDIATE + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K
            k_lo = tl.program_id(2) * (STEPS_PER_SPLIT * BLOCK_K)
            k_hi = tl.minimum(INTERMEDIATE, k_lo + STEPS_PER_SPLIT * BLOCK_K)
        acc = tl.trans(_hopper_mma(a_rows, row_mask, w_ptr, s_ptr, expert, cols, col_mask, pid_n * BLOCK_N, HIDDEN,
                                   INTERMEDIATE, NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, W_TILES, WIDE_SCALES,
                                   k_lo, k_hi))
    else:
        if W_TMA:
            desc = _weight_descriptor(w_ptr, HIDDEN, INTERMEDIATE, NUM_EXPERTS, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        s_next = _scale_tile(s_ptr, expert, cols, col_mask, 0, HIDDEN, INTERMEDIATE, BLOCK_K)
        for k0 in range(0, INTERMEDIATE, BLOCK_K):
            s = s_next  # prefetched one K step ahead, as in glu_gemm_kernel
            s_next = _scale_tile(s_ptr, expert, cols, col_mask, k0 + BLOCK_K, HIDDEN, INTERMEDIATE, BLOCK_K)
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < INTERMEDIATE), other=0.0)
            if W_TMA:
                w = desc.load([expert * HIDDEN + pid_n * BLOCK_N, k0 // 2]).T
            else:
                w = _value_tile(w_ptr, expert, cols, col_mask, k0, HIDDEN, INTERMEDIATE, BLOCK_K)
            acc = tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", w, s, "e2m1", acc)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * HIDDEN + cols, mask=col_mask, other=0.0)
        acc += tl.where(tl.program_id(2) == 0, bias, 0.0)[None, :]  # once, with the first K range

    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)
    if SLOT_ROWS:
        split_rows = tl.program_id(2).to(tl.int64) * num_tokens * TOP_K + pairs.to(tl.int64)
        tl.store(rows_ptr + split_rows[:, None] * HIDDEN + cols[None, :], acc.to(rows_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])
    else:
        if not UNIT_WEIGHTS:
            acc *= tl.load(routing_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        tokens = pairs // TOP_K
        tl.atomic_add(out_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + cols[None, :], acc,
                      mask=row_mask[:, None] & col_mask[None, :], sem="relaxed")


@triton.jit
def cast_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    """fp32 accumulator -> output dtype (the combine needs fp32 for its atomics); the accumulator is left zero
    for the next call."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()  # every read of the sums done (in every thread) before they are cleared
    tl.store(src_ptr + offs, tl.zeros_like(v), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def combine_slots_kernel(rows_ptr, weights_ptr, ids_ptr, out_ptr, num_tokens,
                         HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_ROWS: tl.constexpr,
                         UNIT_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                         SHARED: tl.constexpr = False, SHARED_GATE: tl.constexpr = False, shared_rows_ptr=None,
                         shared_w_ptr=None):
    """The deterministic combine: out[t] = sum over slots j in order of weight[t, j] * y[t, j] from the slot rows
    ``combine_gemm_kernel`` wrote with SLOT_ROWS (:func:`_reduce_slots`), BLOCK_T tokens x BLOCK_H columns a
    program."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _reduce_slots(rows_ptr, weights_ptr, ids_ptr, out_ptr, t, cols, num_tokens, HIDDEN, TOP_K, SPLIT_K, ROUND_ROWS,
                  UNIT_WEIGHTS, SHARED, SHARED_GATE, shared_rows_ptr, shared_w_ptr)
