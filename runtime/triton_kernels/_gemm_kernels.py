"""Triton kernels behind :mod:`.grouped_gemm`.

Both GEMMs run over the padded, expert-sorted row space of :class:`~.grouping.ExpertGroups`:
program (b, n) computes rows ``block_start[b] + [0, BLOCK_M)`` of expert ``block_expert[b]``
against BLOCK_N weight columns. The weights are the rhs of ``tl.dot_scaled`` as a [BLOCK_K/2,
BLOCK_N] uint8 tile packed along K with a [BLOCK_N, BLOCK_K/32] e8m0 scale tile; Hopper upcasts
them to bf16 in the kernel, Blackwell feeds them to its native MXFP4 MMA.
"""

import triton
import triton.language as tl


@triton.jit
def _value_tile(w_ptr, expert, cols, col_mask, k0,
                N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, K_CONTIGUOUS: tl.constexpr):
    """Packed values [BLOCK_K/2, BLOCK_N] of one expert's columns (two e2m1 codes a byte, along K)."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    w_base = w_ptr + expert.to(tl.int64) * (N * K // 2)
    if K_CONTIGUOUS:
        w_offs = cols[None, :] * (K // 2) + kb[:, None]
    else:
        w_offs = kb[:, None] * N + cols[None, :]
    return tl.load(w_base + w_offs, mask=(kb[:, None] < K // 2) & col_mask[None, :], other=0)


@triton.jit
def _weight_descriptor(w_ptr, N: tl.constexpr, K: tl.constexpr, NUM_EXPERTS, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """TMA descriptor over all experts' packed values as one [E*N, K/2] matrix: tile (expert*N + n0, k0/2)
    is BLOCK_N rows of BLOCK_K/2 bytes. Rows past an expert's N read the next expert's (their output
    columns are masked), rows past the last expert and bytes past K/2 read as zero codes."""
    return tl.make_tensor_descriptor(w_ptr, shape=[NUM_EXPERTS * N, K // 2], strides=[K // 2, 1],
                                     block_shape=[BLOCK_N, BLOCK_K // 2])


@triton.jit
def _scale_tile(s_ptr, expert, cols, col_mask, k0,
                N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, K_CONTIGUOUS: tl.constexpr):
    """e8m0 scales [BLOCK_N, BLOCK_K/32] of one expert's columns; 127 (= 1.0) past K."""
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s_base = s_ptr + expert.to(tl.int64) * (N * K // 32)
    if K_CONTIGUOUS:
        s_offs = cols[:, None] * (K // 32) + ks[None, :]
    else:
        s_offs = ks[None, :] * N + cols[:, None]
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
    rows = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK_M)
    row_end = tl.load(expert_offsets_ptr + tl.maximum(expert, 0) + 1)
    return expert, rows, rows < row_end


@triton.jit
def glu_gemm_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr,
                    sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                    HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, SWIGLU_OAI: tl.constexpr,
                    ALPHA: tl.constexpr, LIMIT: tl.constexpr, K_CONTIGUOUS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    W_TMA: tl.constexpr, NUM_EXPERTS: tl.constexpr, GROUP_M: tl.constexpr = 0):
    """act[sorted row, :] = GLU(x[token] @ w13[e]^T + b13[e]), written in expert-sorted row order.

    Tile column c holds w13 row ``glu_row(pid_n*BLOCK_N/2 + c//2, c%2)``: gate for even c, up for
    odd c, so one dot yields matched gate/up pairs for either GLU layout and the activation is
    applied before anything leaves registers. x rows are gathered by token index in the loads.
    W_TMA loads the weight tiles through a TMA descriptor (needs K-contiguous values and interleaved
    gate/up rows, so that a tile's w13 rows are consecutive).
    """
    block, pid_n = _tile_coords(GROUP_M)
    expert, rows, row_mask = _block_rows(block, block_expert_ptr, block_start_ptr, expert_offsets_ptr, BLOCK_M)
    if expert < 0:
        return
    tokens = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0) // TOP_K
    c = tl.arange(0, BLOCK_N)
    act_col = pid_n * (BLOCK_N // 2) + c // 2
    if INTERLEAVED:
        cols = 2 * act_col + c % 2
    else:
        cols = act_col + (c % 2) * INTERMEDIATE
    col_mask = act_col < INTERMEDIATE

    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * HIDDEN
    if W_TMA:
        tl.static_assert(K_CONTIGUOUS and INTERLEAVED, "W_TMA needs K-contiguous values and interleaved gate/up")
        desc = _weight_descriptor(w_ptr, 2 * INTERMEDIATE, HIDDEN, NUM_EXPERTS, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # The scale rows are too short for Triton's async-copy pipelining (BLOCK_K/32 bytes), so they
    # are prefetched one K step ahead by hand instead of stalling every step on a global load.
    s_next = _scale_tile(s_ptr, expert, cols, col_mask, 0, 2 * INTERMEDIATE, HIDDEN, BLOCK_K, K_CONTIGUOUS)
    for k0 in range(0, HIDDEN, BLOCK_K):
        s = s_next
        s_next = _scale_tile(s_ptr, expert, cols, col_mask, k0 + BLOCK_K,
                             2 * INTERMEDIATE, HIDDEN, BLOCK_K, K_CONTIGUOUS)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < HIDDEN), other=0.0)
        if W_TMA:
            w = desc.load([expert * (2 * INTERMEDIATE) + pid_n * BLOCK_N, k0 // 2]).T
        else:
            w = _value_tile(w_ptr, expert, cols, col_mask, k0, 2 * INTERMEDIATE, HIDDEN, BLOCK_K, K_CONTIGUOUS)
        acc = tl.dot_scaled(x.to(tl.bfloat16), None, "bf16", w, s, "e2m1", acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * (2 * INTERMEDIATE) + cols, mask=col_mask, other=0.0)[None, :]

    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    if SWIGLU_OAI:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        act = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
    else:
        act = up * gate * tl.sigmoid(gate)

    out_col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE + out_col[None, :],
             act.to(act_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (out_col[None, :] < INTERMEDIATE))


@triton.jit
def combine_gemm_kernel(act_ptr, w_ptr, s_ptr, bias_ptr, routing_weights_ptr, out_ptr,
                        sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                        HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, TOP_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, K_CONTIGUOUS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        W_TMA: tl.constexpr, NUM_EXPERTS: tl.constexpr, GROUP_M: tl.constexpr = 0):
    """out[token] += weight[pair] * (act[sorted row] @ w2[e]^T + b2[e]), fp32 atomics into [T, H].

    Rows of ``act`` are read contiguously (they are already expert-sorted); only the combine
    scatters, by token. A token receives exactly TOP_K adds, one per slot. W_TMA: weight tiles
    through a TMA descriptor (K-contiguous values only).
    """
    block, pid_n = _tile_coords(GROUP_M)
    expert, rows, row_mask = _block_rows(block, block_expert_ptr, block_start_ptr, expert_offsets_ptr, BLOCK_M)
    if expert < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN

    a_rows = act_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE
    if W_TMA:
        tl.static_assert(K_CONTIGUOUS, "W_TMA needs K-contiguous values")
        desc = _weight_descriptor(w_ptr, HIDDEN, INTERMEDIATE, NUM_EXPERTS, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    s_next = _scale_tile(s_ptr, expert, cols, col_mask, 0, HIDDEN, INTERMEDIATE, BLOCK_K, K_CONTIGUOUS)
    for k0 in range(0, INTERMEDIATE, BLOCK_K):
        s = s_next  # prefetched one K step ahead, as in glu_gemm_kernel
        s_next = _scale_tile(s_ptr, expert, cols, col_mask, k0 + BLOCK_K, HIDDEN, INTERMEDIATE, BLOCK_K, K_CONTIGUOUS)
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & (k[None, :] < INTERMEDIATE), other=0.0)
        if W_TMA:
            w = desc.load([expert * HIDDEN + pid_n * BLOCK_N, k0 // 2]).T
        else:
            w = _value_tile(w_ptr, expert, cols, col_mask, k0, HIDDEN, INTERMEDIATE, BLOCK_K, K_CONTIGUOUS)
        acc = tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", w, s, "e2m1", acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * HIDDEN + cols, mask=col_mask, other=0.0)[None, :]

    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)
    acc *= tl.load(routing_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    tokens = pairs // TOP_K
    tl.atomic_add(out_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + cols[None, :], acc,
                  mask=row_mask[:, None] & col_mask[None, :], sem="relaxed")


@triton.jit
def cast_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    """fp32 accumulator -> output dtype (the combine needs fp32 for its atomics)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)
