"""Triton kernels behind :mod:`.routing`: top-k + softmax on logits, optionally fused with the router linear."""

import triton
import triton.language as tl


@triton.jit
def _select_and_store(logits, tokens, token_mask, weights_ptr, ids_ptr,
                      TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr, SLOTS_POW2: tl.constexpr,
                      BLOCK_T: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr):
    """k rounds of argmax-and-mask over fp32 ``logits`` [BLOCK_T, EXPERTS_POW2] (padding at -inf),
    then one softmax; stores weights [T, k] fp32 and ids [T, k] int32 for the rows in ``token_mask``.

    SOFTMAX_OVER_ALL divides by the sum over all experts ("softmax_topk" without renormalisation);
    otherwise by the sum over the k chosen, which is both "topk_softmax" and renormalised
    "softmax_topk" (softmax is monotonic, so selecting on logits selects on probabilities too).
    Ties go to the lower expert id, as in the reference op.
    """
    experts = tl.arange(0, EXPERTS_POW2)
    slots = tl.arange(0, SLOTS_POW2)
    chosen_logit = tl.full([BLOCK_T, SLOTS_POW2], -float("inf"), tl.float32)
    chosen_id = tl.zeros([BLOCK_T, SLOTS_POW2], tl.int32)
    remaining = logits
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=1, tie_break_left=True).to(tl.int32)
        best_logit = tl.max(remaining, axis=1)
        chosen_logit = tl.where(slots[None, :] == j, best_logit[:, None], chosen_logit)
        chosen_id = tl.where(slots[None, :] == j, best[:, None], chosen_id)
        remaining = tl.where(experts[None, :] == best[:, None], -float("inf"), remaining)

    top = tl.max(chosen_logit, axis=1)  # slot 0's logit, also the row max
    numer = tl.exp(chosen_logit - top[:, None])  # padded slots: exp(-inf) = 0
    if SOFTMAX_OVER_ALL:
        denom = tl.sum(tl.exp(logits - top[:, None]), axis=1)
    else:
        denom = tl.sum(numer, axis=1)
    weights = numer / denom[:, None]

    out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = token_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, chosen_id, mask=out_mask)


@triton.jit
def route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens,
                 NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                 SLOTS_POW2: tl.constexpr, BLOCK_T: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr):
    """One program routes BLOCK_T tokens from precomputed logits [T, E]."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_POW2)
    token_mask = tokens < num_tokens
    # Rows past the end re-read the last token (never stored) so no row is all -inf (NaN softmax).
    rows = tl.minimum(tokens, num_tokens - 1).to(tl.int64)
    logits = tl.load(logits_ptr + rows[:, None] * NUM_EXPERTS + experts[None, :],
                     mask=experts[None, :] < NUM_EXPERTS, other=-float("inf")).to(tl.float32)
    _select_and_store(logits, tokens, token_mask, weights_ptr, ids_ptr,
                      TOP_K, EXPERTS_POW2, SLOTS_POW2, BLOCK_T, SOFTMAX_OVER_ALL)


@triton.jit
def router_kernel(x_ptr, w_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens,
                  HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                  EXPERTS_POW2: tl.constexpr, SLOTS_POW2: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ROUND_LOGITS_BF16: tl.constexpr, IEEE_FP32: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr):
    """The whole router in one kernel: logits = x @ w^T + b for BLOCK_T tokens, then top-k + softmax.

    x [T, H] and the router weight w [E, H] share a dtype (bf16, or fp32 with IEEE_FP32 for a
    full-precision dot); the bias is added in fp32. ROUND_LOGITS_BF16 rounds the logits to bf16
    before selection, as the layer's bf16 ``F.linear`` does, so near-ties resolve the same way.
    """
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_POW2)
    token_mask = tokens < num_tokens
    rows = tl.minimum(tokens, num_tokens - 1).to(tl.int64)
    expert_mask = experts < NUM_EXPERTS
    acc = tl.zeros([BLOCK_T, EXPERTS_POW2], tl.float32)
    for h0 in range(0, HIDDEN, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + h[None, :], mask=h[None, :] < HIDDEN, other=0.0)
        w = tl.load(w_ptr + experts[None, :] * HIDDEN + h[:, None],
                    mask=expert_mask[None, :] & (h[:, None] < HIDDEN), other=0.0)
        if IEEE_FP32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + experts, mask=expert_mask, other=0.0).to(tl.float32)[None, :]
    if ROUND_LOGITS_BF16:
        acc = acc.to(tl.bfloat16).to(tl.float32)
    logits = tl.where(expert_mask[None, :], acc, -float("inf"))
    _select_and_store(logits, tokens, token_mask, weights_ptr, ids_ptr,
                      TOP_K, EXPERTS_POW2, SLOTS_POW2, BLOCK_T, SOFTMAX_OVER_ALL)
