"""Triton kernel behind :mod:`.routing`."""

import triton
import triton.language as tl


@triton.jit
def route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens,
                 NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                 SLOTS_POW2: tl.constexpr, BLOCK_T: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr):
    """One program routes BLOCK_T tokens: k rounds of argmax-and-mask, then one softmax.

    SOFTMAX_OVER_ALL divides by the sum over all experts ("softmax_topk" without renormalisation);
    otherwise by the sum over the k chosen, which is both "topk_softmax" and renormalised
    "softmax_topk" (softmax is monotonic, so selecting on logits selects on probabilities too).
    """
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_POW2)
    slots = tl.arange(0, SLOTS_POW2)
    token_mask = tokens < num_tokens
    # Rows past the end re-read the last token (never stored) so no row is all -inf (NaN softmax).
    rows = tl.minimum(tokens, num_tokens - 1).to(tl.int64)
    logits = tl.load(logits_ptr + rows[:, None] * NUM_EXPERTS + experts[None, :],
                     mask=experts[None, :] < NUM_EXPERTS, other=-float("inf")).to(tl.float32)

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

    out = tokens[:, None] * TOP_K + slots[None, :]
    out_mask = token_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, chosen_id, mask=out_mask)
