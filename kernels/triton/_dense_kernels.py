"""A shared expert held in the activation dtype (``shared_format="bf16"``): its two linear layers as plain Triton
GEMMs over all tokens, rounded where the reference's linear layers round (``mxmoe.core.reference.shared_expert``).

The MXFP4 shared expert runs through the grouped GEMMs as one more expert; these weights are not MXFP4, so they
take a dense tile loop of their own. Operands go through fp32 (a tf32 dot for bf16: bf16 values are exact in tf32,
and Triton's interpreter mis-multiplies bf16 dots; an IEEE dot for fp32 layers).
"""

import triton
import triton.language as tl

from ._gemm_kernels import _glu
from ._routing_kernel import round_to_bf16


@triton.jit
def _round_to(v, ROUND_BF16: tl.constexpr):
    """fp32 ``v`` rounded to the activation dtype (bf16 with ROUND_BF16, to nearest even under the interpreter too)."""
    if ROUND_BF16:
        return round_to_bf16(v)
    return v


@triton.jit
def _dense_dot(a, w, acc, IEEE_FP32: tl.constexpr):
    if IEEE_FP32:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="tf32")


@triton.jit(do_not_specialize=["num_tokens"])
def dense_glu_kernel(x_ptr, w_ptr, act_ptr, num_tokens, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                     SWIGLU_OAI: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                     IEEE_FP32: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[t, c] = GLU(gate, up) of h = x[t] @ w13^T (w13 [2I, H]: gate rows, then up rows), h rounded to the
    activation dtype as a linear layer's output, the GLU in fp32 (``_gemm_kernels._glu``) rounded again. Program
    (m, n): BLOCK_M tokens x BLOCK_N columns of both halves."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask, c_mask = rows < num_tokens, cols < INTERMEDIATE
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < HIDDEN
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * HIDDEN + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & c_mask[None, :]
        wg = tl.load(w_ptr + cols.to(tl.int64)[None, :] * HIDDEN + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_ptr + (INTERMEDIATE + cols).to(tl.int64)[None, :] * HIDDEN + k[:, None], mask=w_mask,
                     other=0.0)
        gate = _dense_dot(x, wg, gate, IEEE_FP32)
        up = _dense_dot(x, wu, up, IEEE_FP32)
    act = _round_to(_glu(_round_to(gate, ROUND_BF16), _round_to(up, ROUND_BF16), SWIGLU_OAI, ACTIVATION, ALPHA,
                         LIMIT), ROUND_BF16)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=r_mask[:, None] & c_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def dense_out_kernel(a_ptr, w_ptr, gate_ptr, out_ptr, num_tokens, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                     IEEE_FP32: tl.constexpr, ROUND_BF16: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = a @ w2^T (w2 [H, I]) rounded to the activation dtype; GATED: times the token's gate ``gate_ptr`` [T]
    (fp32, sigmoid already applied) and rounded again. ADD: added by an fp32 atomic into the layer's accumulator
    ``out_ptr`` [T, H] (the routed experts' sums: two adds from zero give the same bits in either order, and plans
    with more adds take the other form); else written to ``out_ptr`` (the shared rows the deterministic combine adds
    last, with weight 1)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask, c_mask = rows < num_tokens, cols < HIDDEN
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTERMEDIATE, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < INTERMEDIATE
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE + k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * INTERMEDIATE + k[:, None],
                    mask=k_mask[:, None] & c_mask[None, :], other=0.0)
        acc = _dense_dot(a, w, acc, IEEE_FP32)
    y = _round_to(acc, ROUND_BF16)
    if GATED:
        y = _round_to(y * tl.load(gate_ptr + rows, mask=r_mask, other=0.0)[:, None], ROUND_BF16)
    offs = rows.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
    mask = r_mask[:, None] & c_mask[None, :]
    if ADD:
        tl.atomic_add(out_ptr + offs, y, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
