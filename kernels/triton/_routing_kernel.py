"""The router of a kernel plan: the router linear (split along H), the routing on the logits (top-k + softmax,
the sigmoid routers, expert groups, scaling: docs/routing.md), and for few tokens both in one launch that also
groups the pairs by expert."""

import triton
import triton.language as tl

from ._grouping_kernel import block_pair_counts, group_pairs, scatter_by_block_counts


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as fp32: the contract's one rounding of the router
    logits (docs/routing.md), written in integer ops so that the GPU and Triton's interpreter (whose own fp32 ->
    bf16 conversion truncates) round alike. Infinities stay, overflow goes to infinity, NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _tree_sum(v, ROWS: tl.constexpr, N: tl.constexpr):
    """Row sums of fp32 ``v`` [ROWS, N] (N a power of two) by a fixed pairwise tree over adjacent columns: the same
    bits whatever layout Triton gives ``v`` (a ``tl.sum`` adds in the order of its layout, which differs between
    kernels and tile shapes)."""
    for _ in tl.static_range(N.bit_length() - 1):
        a, b = tl.split(tl.reshape(v, [ROWS, v.shape[1] // 2, 2]))
        v = a + b
    return tl.reshape(v, [ROWS])


@triton.jit
def _sigmoid(v):
    """1 / (1 + exp(-v)) in fp32, the reference's formula (the routers' scores)."""
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _group_limit(choice, EXPERTS_POW2: tl.constexpr, BLOCK_T: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                 N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPS_POW2: tl.constexpr):
    """``choice`` [BLOCK_T, EXPERTS_POW2] with the experts outside the TOPK_GROUP best of N_GROUP groups of consecutive
    experts at -inf: a group's score is the sum of its two largest values, groups picked by rounds of arg-max with
    ties to the lower group (``mxmoe.core.reference.group_limited``)."""
    experts = tl.arange(0, EXPERTS_POW2)
    groups = tl.arange(0, GROUPS_POW2)
    gid = experts // (NUM_EXPERTS // N_GROUP)
    scores = tl.full([BLOCK_T, GROUPS_POW2], -float("inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        v = tl.where((gid == g)[None, :], choice, -float("inf"))
        first = tl.argmax(v, axis=1, tie_break_left=True)
        second = tl.max(tl.where(experts[None, :] == first[:, None], -float("inf"), v), axis=1)
        scores = tl.where(groups[None, :] == g, (tl.max(v, axis=1) + second)[:, None], scores)
    keep = tl.zeros([BLOCK_T, EXPERTS_POW2], tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(scores, axis=1, tie_break_left=True)
        keep = keep | (gid[None, :] == best[:, None])
        scores = tl.where(groups[None, :] == best[:, None], -float("inf"), scores)
    return tl.where(keep, choice, -float("inf"))


@triton.jit
def _select_and_store(logits, tokens, token_mask, weights_ptr, ids_ptr, map_ptr,
                      TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr, SLOTS_POW2: tl.constexpr,
                      BLOCK_T: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr, HAS_MAP: tl.constexpr = False,
                      SIGMOID: tl.constexpr = 0, RENORMALIZE: tl.constexpr = False, SCALING: tl.constexpr = 1.0,
                      scores=None):
    """k rounds of argmax-and-mask over fp32 ``logits`` [BLOCK_T, EXPERTS_POW2] (padding at -inf),
    then the weights; stores weights [T, k] fp32 and ids [T, k] int32 for the rows in ``token_mask``
    (HAS_MAP: the ids through ``map_ptr``, the expert map: a global id's local one, or -1).

    SIGMOID 0 (the softmax routings): one softmax. SOFTMAX_OVER_ALL divides by the sum over all experts
    ("softmax_topk" without renormalisation); otherwise by the sum over the k chosen, which is both "topk_softmax"
    and renormalised "softmax_topk" (softmax is monotonic, so selecting on logits selects on probabilities too).
    SIGMOID 1 ("topk_sigmoid"): the chosen logits' sigmoids. SIGMOID 2 ("sigmoid_topk"): ``logits`` are the choice
    values (scores + correction bias, group-limited: :func:`_logits_to_routing`), the weights the chosen experts'
    ``scores``, with RENORMALIZE divided by their sum in slot order + 1e-20. Every weight times SCALING last.
    Ties go to the lower expert id, as in the reference op. Every sum has a fixed order (the k chosen in slot
    order, all experts by :func:`_tree_sum`), so a token's weights are the same bits in every kernel and tile
    that routes it (docs/routing.md).
    """
    experts = tl.arange(0, EXPERTS_POW2)
    slots = tl.arange(0, SLOTS_POW2)
    chosen_num = tl.zeros([BLOCK_T, SLOTS_POW2], tl.float32)
    chosen_id = tl.zeros([BLOCK_T, SLOTS_POW2], tl.int32)
    remaining = logits
    top = tl.max(logits, axis=1)  # slot 0's logit (a max is exact in any order)
    denom = tl.zeros([BLOCK_T], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=1, tie_break_left=True).to(tl.int32)
        if SIGMOID == 0:
            num = tl.exp(tl.max(remaining, axis=1) - top)
        elif SIGMOID == 1:
            num = _sigmoid(tl.max(remaining, axis=1))
        else:  # the chosen expert's score (one non-zero term: exact)
            num = tl.sum(tl.where(experts[None, :] == best[:, None], scores, 0.0), axis=1)
        denom += num  # the k chosen, in slot order
        chosen_num = tl.where(slots[None, :] == j, num[:, None], chosen_num)
        chosen_id = tl.where(slots[None, :] == j, best[:, None], chosen_id)
        remaining = tl.where(experts[None, :] == best[:, None], -float("inf"), remaining)
    if SIGMOID == 0:
        if SOFTMAX_OVER_ALL:
            denom = _tree_sum(tl.exp(logits - top[:, None]), BLOCK_T, EXPERTS_POW2)
        weights = chosen_num / denom[:, None]
    elif SIGMOID == 2 and RENORMALIZE:
        weights = chosen_num / (denom + 1e-20)[:, None]
    else:
        weights = chosen_num
    if SCALING != 1.0:
        weights = weights * SCALING

    out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = token_mask[:, None] & (slots[None, :] < TOP_K)
    if HAS_MAP:
        chosen_id = tl.load(map_ptr + chosen_id, mask=out_mask, other=-1)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, chosen_id, mask=out_mask)


@triton.jit(do_not_specialize=["num_tokens"])  # as AOT compiles it: _runtime_zero needs it at run time
def router_gemm_kernel(x_ptr, w_ptr, partial_ptr, num_tokens,
                       HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                       H_PER_SPLIT: tl.constexpr, IEEE_FP32: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Router logits, split along H: program (i, s) writes partial[s, tokens of block i, :] =
    x[:, s*H_PER_SPLIT : (s+1)*H_PER_SPLIT] @ w[:, same]^T in fp32.

    Splitting H gives the router enough programs to stream its weight at full bandwidth when there
    are few tokens; the partial sums are added in a fixed order by :func:`route_partials_kernel`, so
    the logits (and the routing) are the same on every run. x [T, H] and w [E, H] share a dtype:
    bf16 (upcast and multiplied with a tf32 dot: bf16 values are exact in tf32, so products are the
    bf16 products, summed in fp32; Triton 3.9's interpreter also mis-multiplies bf16 dots), or fp32
    with IEEE_FP32 for a full-precision dot.
    """
    _router_partial(x_ptr, w_ptr, partial_ptr, num_tokens, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, H_PER_SPLIT, IEEE_FP32,
                    BLOCK_T, BLOCK_H)


@triton.jit
def _router_x(x_ptr, rows, h, h_mask, HIDDEN: tl.constexpr):
    """Hidden states [ROWS, BLOCK_H] of token ``rows`` at columns ``h`` (0 outside ``h_mask``)."""
    return tl.load(x_ptr + rows.to(tl.int64)[:, None] * HIDDEN + h[None, :], mask=h_mask[None, :], other=0.0)


@triton.jit
def _router_w(w_ptr, h, h_mask, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """Router weight [BLOCK_H, EXPERTS_POW2] at columns ``h`` (0 outside ``h_mask`` and past the experts)."""
    experts = tl.arange(0, EXPERTS_POW2)
    return tl.load(w_ptr + experts[None, :] * HIDDEN + h[:, None],
                   mask=(experts < NUM_EXPERTS)[None, :] & h_mask[:, None], other=0.0)


@triton.jit
def _runtime_zero(num_tokens):
    """0.0 that the compiler cannot prove zero (``num_tokens`` is never negative): the router chunks' accumulators
    start from it. Triton folds ``acc + dot(x, w, 0)`` into ``dot(x, w, acc)`` when the dot's accumulator is a
    constant zero, which sums the chunk's products onto ``acc`` inside the MMA: other bits than the chunk's sum
    added to ``acc``, which is what the few-token classes compute (their chunks are other programs' partial sums).
    Seen on an H100: the issue's token 3467 routed differently in a batch of 4096 than alone."""
    return (num_tokens < 0).to(tl.float32)


@triton.jit
def _router_mm(x, w, IEEE_FP32: tl.constexpr, zero):
    """One router chunk: x [16, BLOCK_H] @ w [BLOCK_H, EXPERTS_POW2] into a fresh fp32 accumulator. bf16 operands
    are upcast and multiplied with a tf32 dot (bf16 values are exact in tf32, so products are the bf16 products,
    summed in fp32; Triton 3.9's interpreter also mis-multiplies bf16 dots); fp32 layers use an IEEE dot. Every
    class computes every chunk of every token with this one call on a 16-row tile (the MMA's own rows: the same
    instruction sequence for a token whatever the tile it sits in), which is what makes a token's logits the same
    bits in every batch (docs/routing.md). ``zero``: :func:`_runtime_zero`."""
    acc = tl.zeros([x.shape[0], w.shape[1]], tl.float32) + zero  # never a constant zero: see _runtime_zero
    if IEEE_FP32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="tf32")


@triton.jit
def _router_partial(x_ptr, w_ptr, partial_ptr, num_tokens,
                    HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                    H_PER_SPLIT: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """partial[split, tokens of block i, :] for program (i, split): the chunk ``split`` of H (plans since #22
    have BLOCK_H >= H_PER_SPLIT, one :func:`_router_mm`; older ones step BLOCK_H and add the steps)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    experts = tl.arange(0, EXPERTS_POW2)
    rows = tl.minimum(tokens, num_tokens - 1)
    hb = tl.arange(0, BLOCK_H)
    h = split * H_PER_SPLIT + hb
    h_mask = (h < HIDDEN) & (hb < H_PER_SPLIT)
    zero = _runtime_zero(num_tokens)
    acc = _router_mm(_router_x(x_ptr, rows, h, h_mask, HIDDEN),
                     _router_w(w_ptr, h, h_mask, HIDDEN, NUM_EXPERTS, EXPERTS_POW2), IEEE_FP32, zero)
    for h0 in range(BLOCK_H, H_PER_SPLIT, BLOCK_H):
        h = split * H_PER_SPLIT + h0 + hb
        h_mask = (h < HIDDEN) & (h0 + hb < H_PER_SPLIT)
        acc += _router_mm(_router_x(x_ptr, rows, h, h_mask, HIDDEN),
                          _router_w(w_ptr, h, h_mask, HIDDEN, NUM_EXPERTS, EXPERTS_POW2), IEEE_FP32, zero)
    out = partial_ptr + (split.to(tl.int64) * num_tokens + tokens.to(tl.int64))[:, None] * EXPERTS_POW2 \
        + experts[None, :]
    tl.store(out, acc, mask=(tokens < num_tokens)[:, None])


@triton.jit
def _logits_to_routing(acc, b_ptr, tokens, token_mask, weights_ptr, ids_ptr, map_ptr, NUM_EXPERTS: tl.constexpr,
                       TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr, SLOTS_POW2: tl.constexpr,
                       HAS_BIAS: tl.constexpr, ROUND_LOGITS_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
                       SOFTMAX_OVER_ALL: tl.constexpr, HAS_MAP: tl.constexpr, SIGMOID: tl.constexpr = 0,
                       RENORMALIZE: tl.constexpr = False, SCALING: tl.constexpr = 1.0, N_GROUP: tl.constexpr = 1,
                       TOPK_GROUP: tl.constexpr = 1, GROUPS_POW2: tl.constexpr = 1,
                       HAS_SCORE_BIAS: tl.constexpr = False, sb_ptr=None):
    """The contract's last steps on fp32 sums ``acc`` [BLOCK_T, EXPERTS_POW2]: + bias in fp32, rounded once to bf16
    (ROUND_LOGITS_BF16; :func:`round_to_bf16`; an fp32 router keeps its sums), then the selection and weights
    (:func:`_select_and_store`). SIGMOID 2 ("sigmoid_topk") chooses on the scores sigmoid(logit) + the fp32
    correction bias ``sb_ptr`` (HAS_SCORE_BIAS), limited to TOPK_GROUP of N_GROUP groups (:func:`_group_limit`)."""
    experts = tl.arange(0, EXPERTS_POW2)
    expert_mask = experts < NUM_EXPERTS
    if HAS_BIAS:
        acc += tl.load(b_ptr + experts, mask=expert_mask, other=0.0).to(tl.float32)[None, :]
    if ROUND_LOGITS_BF16:
        acc = round_to_bf16(acc)
    logits = tl.where(expert_mask[None, :], acc, -float("inf"))
    if SIGMOID == 2:
        scores = _sigmoid(logits)
        choice = scores
        if HAS_SCORE_BIAS:
            choice = choice + tl.load(sb_ptr + experts, mask=expert_mask, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(expert_mask[None, :], choice, -float("inf"))
        if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
            choice = _group_limit(choice, EXPERTS_POW2, BLOCK_T, NUM_EXPERTS, N_GROUP, TOPK_GROUP, GROUPS_POW2)
        _select_and_store(choice, tokens, token_mask, weights_ptr, ids_ptr, map_ptr, TOP_K, EXPERTS_POW2,
                          SLOTS_POW2, BLOCK_T, SOFTMAX_OVER_ALL, HAS_MAP, SIGMOID, RENORMALIZE, SCALING, scores)
    else:
        _select_and_store(logits, tokens, token_mask, weights_ptr, ids_ptr, map_ptr, TOP_K, EXPERTS_POW2,
                          SLOTS_POW2, BLOCK_T, SOFTMAX_OVER_ALL, HAS_MAP, SIGMOID, RENORMALIZE, SCALING, logits)


@triton.jit
def _logits_tile(logits_ptr, rows, token_mask, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """The engine's router logits of ``rows`` (the monolithic entry) as fp32 [ROWS, EXPERTS_POW2]."""
    experts = tl.arange(0, EXPERTS_POW2)
    return tl.load(logits_ptr + rows.to(tl.int64)[:, None] * NUM_EXPERTS + experts[None, :],
                   mask=token_mask[:, None] & (experts < NUM_EXPERTS)[None, :], other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens"])
def router_route_kernel(x_ptr, w_ptr, b_ptr, weights_ptr, ids_ptr, map_ptr, num_tokens,
                        HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                        H_PER_SPLIT: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_H: tl.constexpr,
                        ROUTER_BLOCK_T: tl.constexpr, SUB_BLOCKS: tl.constexpr, TOP_K: tl.constexpr,
                        SLOTS_POW2: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_LOGITS_BF16: tl.constexpr,
                        SOFTMAX_OVER_ALL: tl.constexpr, HAS_MAP: tl.constexpr, LOGITS_IN: tl.constexpr = False,
                        SIGMOID: tl.constexpr = 0, RENORMALIZE: tl.constexpr = False,
                        SCALING: tl.constexpr = 1.0, N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
                        GROUPS_POW2: tl.constexpr = 1, HAS_SCORE_BIAS: tl.constexpr = False, sb_ptr=None):
    """Router and routing of many tokens in one launch: program i takes SUB_BLOCKS (1, 2 or 4) blocks of
    ROUTER_BLOCK_T (16) tokens from token ``i * 16 * SUB_BLOCKS``, walks H in the chunks of the few-token router
    (H_PER_SPLIT wide, one :func:`_router_mm` each, the weight chunk loaded once for the sub-blocks), adds the chunk
    sums in chunk order from 0 (exactly what ``route_partials`` does with the few-token router's partials), and
    routes each block (:func:`_logits_to_routing`). So a token's logits and routing are the same bits in every
    class, and no partial sums go through memory (issue #22). LOGITS_IN (the monolithic entry): ``x_ptr`` holds the
    engine's logits [T, NUM_EXPERTS], routed as they are. HAS_MAP: ids through the expert map ``map_ptr``."""
    tl.static_assert(SUB_BLOCKS == 1 or SUB_BLOCKS == 2 or SUB_BLOCKS == 4, "SUB_BLOCKS is 1, 2 or 4")
    first = tl.program_id(0) * (ROUTER_BLOCK_T * SUB_BLOCKS)
    t0 = first + tl.arange(0, ROUTER_BLOCK_T)
    t1 = t0 + ROUTER_BLOCK_T
    t2 = t1 + ROUTER_BLOCK_T
    t3 = t2 + ROUTER_BLOCK_T
    last = num_tokens - 1
    r0, r1, r2, r3 = tl.minimum(t0, last), tl.minimum(t1, last), tl.minimum(t2, last), tl.minimum(t3, last)
    acc0 = tl.zeros([ROUTER_BLOCK_T, EXPERTS_POW2], tl.float32)
    acc1 = tl.zeros([ROUTER_BLOCK_T, EXPERTS_POW2], tl.float32)
    acc2 = tl.zeros([ROUTER_BLOCK_T, EXPERTS_POW2], tl.float32)
    acc3 = tl.zeros([ROUTER_BLOCK_T, EXPERTS_POW2], tl.float32)
    hb = tl.arange(0, BLOCK_H)
    zero = _runtime_zero(num_tokens)
    if LOGITS_IN:
        acc0 = _logits_tile(x_ptr, r0, t0 < num_tokens, NUM_EXPERTS, EXPERTS_POW2)
        acc1 = _logits_tile(x_ptr, r1, t1 < num_tokens, NUM_EXPERTS, EXPERTS_POW2)
        acc2 = _logits_tile(x_ptr, r2, t2 < num_tokens, NUM_EXPERTS, EXPERTS_POW2)
        acc3 = _logits_tile(x_ptr, r3, t3 < num_tokens, NUM_EXPERTS, EXPERTS_POW2)
    for c in range(0, 0 if LOGITS_IN else (HIDDEN + H_PER_SPLIT - 1) // H_PER_SPLIT):
        h = c * H_PER_SPLIT + hb
        h_mask = (h < HIDDEN) & (hb < H_PER_SPLIT)
        w = _router_w(w_ptr, h, h_mask, HIDDEN, NUM_EXPERTS, EXPERTS_POW2)
        acc0 += _router_mm(_router_x(x_ptr, r0, h, h_mask, HIDDEN), w, IEEE_FP32, zero)
        if SUB_BLOCKS > 1:
            acc1 += _router_mm(_router_x(x_ptr, r1, h, h_mask, HIDDEN), w, IEEE_FP32, zero)
        if SUB_BLOCKS > 2:
            acc2 += _router_mm(_router_x(x_ptr, r2, h, h_mask, HIDDEN), w, IEEE_FP32, zero)
            acc3 += _router_mm(_router_x(x_ptr, r3, h, h_mask, HIDDEN), w, IEEE_FP32, zero)
    _logits_to_routing(acc0, b_ptr, t0, t0 < num_tokens, weights_ptr, ids_ptr, map_ptr, NUM_EXPERTS, TOP_K,
                       EXPERTS_POW2, SLOTS_POW2, HAS_BIAS, ROUND_LOGITS_BF16, ROUTER_BLOCK_T, SOFTMAX_OVER_ALL,
                       HAS_MAP, SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS,
                       sb_ptr)
    if SUB_BLOCKS > 1:
        _logits_to_routing(acc1, b_ptr, t1, t1 < num_tokens, weights_ptr, ids_ptr, map_ptr, NUM_EXPERTS, TOP_K,
                           EXPERTS_POW2, SLOTS_POW2, HAS_BIAS, ROUND_LOGITS_BF16, ROUTER_BLOCK_T, SOFTMAX_OVER_ALL,
                           HAS_MAP, SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS,
                           sb_ptr)
    if SUB_BLOCKS > 2:
        _logits_to_routing(acc2, b_ptr, t2, t2 < num_tokens, weights_ptr, ids_ptr, map_ptr, NUM_EXPERTS, TOP_K,
                           EXPERTS_POW2, SLOTS_POW2, HAS_BIAS, ROUND_LOGITS_BF16, ROUTER_BLOCK_T, SOFTMAX_OVER_ALL,
                           HAS_MAP, SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS,
                           sb_ptr)
        _logits_to_routing(acc3, b_ptr, t3, t3 < num_tokens, weights_ptr, ids_ptr, map_ptr, NUM_EXPERTS, TOP_K,
                           EXPERTS_POW2, SLOTS_POW2, HAS_BIAS, ROUND_LOGITS_BF16, ROUTER_BLOCK_T, SOFTMAX_OVER_ALL,
                           HAS_MAP, SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS,
                           sb_ptr)


@triton.jit(do_not_specialize=["num_tokens"])
def router_route_group_kernel(x_ptr, w_ptr, partial_ptr, num_tokens, b_ptr, weights_ptr, ids_ptr,
                              sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_blocks,
                              counter_ptr,
                              HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                              H_PER_SPLIT: tl.constexpr, IEEE_FP32: tl.constexpr, ROUTER_BLOCK_T: tl.constexpr,
                              BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, SLOTS_POW2: tl.constexpr,
                              SPLITS: tl.constexpr,
                              HAS_BIAS: tl.constexpr, ROUND_LOGITS_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
                              SOFTMAX_OVER_ALL: tl.constexpr, GROUP_EXPERTS_POW2: tl.constexpr,
                              BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                              GROUP_EXPERTS: tl.constexpr = 0, HAS_MAP: tl.constexpr = False,
                              LOGITS_IN: tl.constexpr = False,
                              map_ptr=None, SIGMOID: tl.constexpr = 0, RENORMALIZE: tl.constexpr = False,
                              SCALING: tl.constexpr = 1.0, N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
                              GROUPS_POW2: tl.constexpr = 1, HAS_SCORE_BIAS: tl.constexpr = False, sb_ptr=None):
    """Router, routing and grouping in one launch (the few-token classes). Program (i, s) computes the router
    partial sums of token block i (ROUTER_BLOCK_T tokens, >= 16 for the dot) over H split s
    (:func:`router_gemm_kernel`); the last of a block's SPLITS programs to finish routes its first BLOCK_T
    tokens (:func:`route_partials_kernel`), and the last block to be routed groups all pairs
    (:func:`group_pairs`, CHUNK pairs a step). Programs count themselves in ``counter_ptr`` (cdiv(T,
    ROUTER_BLOCK_T) + 1 zeroed int32: [0] routed blocks, [1 + i] finished splits of block i) after a CTA
    barrier with acquire-release atomics, so each last program reads what the others wrote (the acquire makes
    their stores visible to plain loads). Each count's last program sets it back to zero, so a call leaves the
    counters as it found them (the executor zeroes them once, not every call)."""
    _router_route_and_group(x_ptr, w_ptr, partial_ptr, num_tokens, b_ptr, weights_ptr, ids_ptr, sorted_pairs_ptr,
                            expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_blocks, counter_ptr,
                            counter_ptr, counter_ptr, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, H_PER_SPLIT, IEEE_FP32,
                            ROUTER_BLOCK_T, BLOCK_H, TOP_K, SLOTS_POW2, SPLITS, HAS_BIAS, ROUND_LOGITS_BF16, BLOCK_T,
                            SOFTMAX_OVER_ALL, GROUP_EXPERTS_POW2, BLOCK_M, False, CHUNK, 1, 1,
                            GROUP_EXPERTS, HAS_MAP, LOGITS_IN, map_ptr,
                            SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS, sb_ptr)


@triton.jit(do_not_specialize=["num_tokens"])
def router_route_scatter_kernel(x_ptr, w_ptr, partial_ptr, num_tokens, b_ptr, weights_ptr, ids_ptr,
                                sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_blocks,
                                counter_ptr, block_counts_ptr, ranks_ptr,
                                HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                                H_PER_SPLIT: tl.constexpr, IEEE_FP32: tl.constexpr, ROUTER_BLOCK_T: tl.constexpr,
                                BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, SLOTS_POW2: tl.constexpr,
                                SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_LOGITS_BF16: tl.constexpr,
                                BLOCK_T: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr,
                                GROUP_EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                                TOKEN_BLOCKS_POW2: tl.constexpr, LANES: tl.constexpr,
                                GROUP_EXPERTS: tl.constexpr = 0, HAS_MAP: tl.constexpr = False,
                                LOGITS_IN: tl.constexpr = False,
                                map_ptr=None, SIGMOID: tl.constexpr = 0, RENORMALIZE: tl.constexpr = False,
                                SCALING: tl.constexpr = 1.0, N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
                                GROUPS_POW2: tl.constexpr = 1, HAS_SCORE_BIAS: tl.constexpr = False, sb_ptr=None):
    """:func:`router_route_group_kernel` grouping from per-block counts: the last split of each token block
    also counts the block's pairs per expert with their ranks once it has routed them
    (:func:`block_pair_counts`, into ``block_counts_ptr`` [cdiv(T, ROUTER_BLOCK_T), GROUP_EXPERTS_POW2] and
    ``ranks_ptr`` [T*k]), and the last block routed scatters from the counts
    (:func:`scatter_by_block_counts`, LANES pairs a step): its work grows with the token blocks (at most
    TOKEN_BLOCKS_POW2), not with the pairs. Same result as :func:`group_pairs`."""
    _router_route_and_group(x_ptr, w_ptr, partial_ptr, num_tokens, b_ptr, weights_ptr, ids_ptr, sorted_pairs_ptr,
                            expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_blocks, counter_ptr,
                            block_counts_ptr, ranks_ptr, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, H_PER_SPLIT, IEEE_FP32,
                            ROUTER_BLOCK_T, BLOCK_H, TOP_K, SLOTS_POW2, SPLITS, HAS_BIAS, ROUND_LOGITS_BF16, BLOCK_T,
                            SOFTMAX_OVER_ALL, GROUP_EXPERTS_POW2, BLOCK_M, True, LANES, TOKEN_BLOCKS_POW2, LANES,
                            GROUP_EXPERTS, HAS_MAP, LOGITS_IN, map_ptr,
                            SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS, sb_ptr)


@triton.jit
def _router_route_and_group(x_ptr, w_ptr, partial_ptr, num_tokens, b_ptr, weights_ptr, ids_ptr, sorted_pairs_ptr,
                            expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_blocks, counter_ptr,
                            block_counts_ptr, ranks_ptr, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                            EXPERTS_POW2: tl.constexpr, H_PER_SPLIT: tl.constexpr, IEEE_FP32: tl.constexpr,
                            ROUTER_BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr,
                            SLOTS_POW2: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ROUND_LOGITS_BF16: tl.constexpr, BLOCK_T: tl.constexpr, SOFTMAX_OVER_ALL: tl.constexpr,
                            GROUP_EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SCATTER: tl.constexpr,
                            CHUNK: tl.constexpr, TOKEN_BLOCKS_POW2: tl.constexpr, LANES: tl.constexpr,
                            GROUP_EXPERTS: tl.constexpr, HAS_MAP: tl.constexpr, LOGITS_IN: tl.constexpr, map_ptr,
                            SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, SCALING: tl.constexpr,
                            N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPS_POW2: tl.constexpr,
                            HAS_SCORE_BIAS: tl.constexpr, sb_ptr):
    """The two kernels above: SCATTER picks the grouping (``block_counts_ptr``/``ranks_ptr`` unused without).
    GROUP_EXPERTS: the layer's own experts, which the grouping counts (0: NUM_EXPERTS, the experts routed over; they
    differ under expert parallelism, where HAS_MAP maps the routed ids through ``map_ptr``, -1 for another rank's).
    LOGITS_IN (the monolithic entry): ``partial_ptr`` is the engine's logits [T, NUM_EXPERTS] (in the activation
    dtype), routed as they are; no router, one program per token block."""
    if not LOGITS_IN:
        _router_partial(x_ptr, w_ptr, partial_ptr, num_tokens, HIDDEN, NUM_EXPERTS, EXPERTS_POW2, H_PER_SPLIT,
                        IEEE_FP32, ROUTER_BLOCK_T, BLOCK_H)
    tl.debug_barrier()
    block = tl.program_id(0)
    if tl.atomic_add(counter_ptr + 1 + block, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        tl.store(counter_ptr + 1 + block, 0)  # the block's last program: its count is done, left zero for the next call
        _route_partials(partial_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens, block * ROUTER_BLOCK_T,
                        NUM_EXPERTS, TOP_K, EXPERTS_POW2, SLOTS_POW2, SPLITS, HAS_BIAS, ROUND_LOGITS_BF16, BLOCK_T,
                        SOFTMAX_OVER_ALL, map_ptr, HAS_MAP, LOGITS_IN, SIGMOID, RENORMALIZE, SCALING, N_GROUP,
                        TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS, sb_ptr)
        tl.debug_barrier()  # the ids this program just stored are read back by other threads
        if SCATTER:
            block_pair_counts(ids_ptr, block_counts_ptr, ranks_ptr, num_tokens * TOP_K, block,
                              ROUTER_BLOCK_T * TOP_K, BLOCK_T * SLOTS_POW2, GROUP_EXPERTS_POW2)
            tl.debug_barrier()
        last = True
        if tl.num_programs(0) > 1:  # one token block (1-16 tokens): no second round trip
            last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1
        if last:
            if tl.num_programs(0) > 1:
                tl.store(counter_ptr, 0)
            if GROUP_EXPERTS == 0:
                _group(ids_ptr, ranks_ptr, block_counts_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr,
                       block_start_ptr, num_tokens, num_blocks, NUM_EXPERTS, GROUP_EXPERTS_POW2, TOKEN_BLOCKS_POW2,
                       ROUTER_BLOCK_T, TOP_K, BLOCK_M, LANES, CHUNK, SCATTER)
            else:
                _group(ids_ptr, ranks_ptr, block_counts_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr,
                       block_start_ptr, num_tokens, num_blocks, GROUP_EXPERTS, GROUP_EXPERTS_POW2, TOKEN_BLOCKS_POW2,
                       ROUTER_BLOCK_T, TOP_K, BLOCK_M, LANES, CHUNK, SCATTER)


@triton.jit
def _group(ids_ptr, ranks_ptr, block_counts_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr,
           block_start_ptr, num_tokens, num_blocks, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
           TOKEN_BLOCKS_POW2: tl.constexpr, ROUTER_BLOCK_T: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
           LANES: tl.constexpr, CHUNK: tl.constexpr, SCATTER: tl.constexpr):
    if SCATTER:
        scatter_by_block_counts(ids_ptr, ranks_ptr, block_counts_ptr, sorted_pairs_ptr, expert_offsets_ptr,
                                block_expert_ptr, block_start_ptr, num_tokens, num_tokens * TOP_K,
                                num_blocks, tl.num_programs(0), NUM_EXPERTS, EXPERTS_POW2,
                                TOKEN_BLOCKS_POW2, ROUTER_BLOCK_T * TOP_K, BLOCK_M, LANES)
    else:
        group_pairs(ids_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                    num_tokens * TOP_K, num_blocks, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M, CHUNK)


@triton.jit(do_not_specialize=["num_tokens"])
def route_partials_kernel(partial_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens,
                          NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                          SLOTS_POW2: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ROUND_LOGITS_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
                          SOFTMAX_OVER_ALL: tl.constexpr, map_ptr=None, HAS_MAP: tl.constexpr = False,
                          LOGITS_IN: tl.constexpr = False, SIGMOID: tl.constexpr = 0,
                          RENORMALIZE: tl.constexpr = False,
                          SCALING: tl.constexpr = 1.0, N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
                          GROUPS_POW2: tl.constexpr = 1, HAS_SCORE_BIAS: tl.constexpr = False, sb_ptr=None):
    """:func:`_route_partials` for tokens ``program_id(0) * BLOCK_T + [0, BLOCK_T)`` (LOGITS_IN: ``partial_ptr`` is
    the engine's logits, the monolithic entry)."""
    _route_partials(partial_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens, tl.program_id(0) * BLOCK_T,
                    NUM_EXPERTS, TOP_K, EXPERTS_POW2, SLOTS_POW2, SPLITS, HAS_BIAS, ROUND_LOGITS_BF16, BLOCK_T,
                    SOFTMAX_OVER_ALL, map_ptr, HAS_MAP, LOGITS_IN, SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP,
                    GROUPS_POW2, HAS_SCORE_BIAS, sb_ptr)


@triton.jit(do_not_specialize=["num_tokens"])
def route_and_group_kernel(partial_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens,
                           sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_blocks,
                           NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                           SLOTS_POW2: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           ROUND_LOGITS_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
                           SOFTMAX_OVER_ALL: tl.constexpr, GROUP_EXPERTS_POW2: tl.constexpr,
                           BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Routing and grouping of up to BLOCK_T tokens in one program: the routing of
    :func:`route_partials_kernel`, a CTA barrier (the grouping reads the ids this program just stored),
    then :func:`group_pairs`. Plans now fold this into :func:`router_route_group_kernel`; gemv plans compiled
    before 2026-11-24 name it (their JIT fallback needs it)."""
    _route_partials(partial_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens, 0,
                    NUM_EXPERTS, TOP_K, EXPERTS_POW2, SLOTS_POW2, SPLITS, HAS_BIAS, ROUND_LOGITS_BF16, BLOCK_T,
                    SOFTMAX_OVER_ALL)
    tl.debug_barrier()
    group_pairs(ids_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                num_tokens * TOP_K, num_blocks, NUM_EXPERTS, GROUP_EXPERTS_POW2, BLOCK_M, CHUNK)


@triton.jit
def _route_partials(partial_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens, first_token,
                    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                    SLOTS_POW2: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ROUND_LOGITS_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
                    SOFTMAX_OVER_ALL: tl.constexpr, map_ptr=None, HAS_MAP: tl.constexpr = False,
                    LOGITS_IN: tl.constexpr = False, SIGMOID: tl.constexpr = 0, RENORMALIZE: tl.constexpr = False,
                    SCALING: tl.constexpr = 1.0, N_GROUP: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
                    GROUPS_POW2: tl.constexpr = 1, HAS_SCORE_BIAS: tl.constexpr = False, sb_ptr=None):
    """Top-k + softmax of the router logits of tokens ``first_token + [0, BLOCK_T)``: logits = the SPLITS partials
    added in order from 0, + bias in fp32, rounded to bf16 with ROUND_LOGITS_BF16 (the contract of
    docs/routing.md: :func:`_logits_to_routing`)."""
    tokens = first_token + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_POW2)
    token_mask = tokens < num_tokens
    rows = tl.minimum(tokens, num_tokens - 1).to(tl.int64)
    if LOGITS_IN:  # the engine's logits [T, NUM_EXPERTS]
        acc = _logits_tile(partial_ptr, rows, token_mask, NUM_EXPERTS, EXPERTS_POW2)
    else:
        acc = tl.zeros([BLOCK_T, EXPERTS_POW2], tl.float32)
        for s in tl.static_range(SPLITS):  # rows past T are never stored: not read either
            acc += tl.load(partial_ptr + (s * num_tokens + rows)[:, None] * EXPERTS_POW2 + experts[None, :],
                           mask=token_mask[:, None], other=0.0,
                           cache_modifier=".cg")  # written by other programs (router_route_group_kernel)
    _logits_to_routing(acc, b_ptr, tokens, token_mask, weights_ptr, ids_ptr, map_ptr, NUM_EXPERTS, TOP_K,
                       EXPERTS_POW2, SLOTS_POW2, HAS_BIAS, ROUND_LOGITS_BF16, BLOCK_T, SOFTMAX_OVER_ALL, HAS_MAP,
                       SIGMOID, RENORMALIZE, SCALING, N_GROUP, TOPK_GROUP, GROUPS_POW2, HAS_SCORE_BIAS, sb_ptr)


@triton.jit
def shared_gate_kernel(x_ptr, w_ptr, out_ptr, num_tokens, HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The shared expert's gate: out[t] = sigmoid(round(x[t] @ w)) in fp32, w [H] the gate weight, the dot summed in
    fp32 (BLOCK_H columns a step, in order) and rounded once to bf16 with ROUND_BF16, as a linear layer in the
    activation dtype gives it. One kernel for every class: a token's gate is the same bits in every batch."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.minimum(t, num_tokens - 1).to(tl.int64)
    acc = tl.zeros([BLOCK_T], tl.float32)
    for h0 in range(0, HIDDEN, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + rows[:, None] * HIDDEN + h[None, :], mask=(h < HIDDEN)[None, :], other=0.0)
        w = tl.load(w_ptr + h, mask=h < HIDDEN, other=0.0)
        acc += _tree_sum(x.to(tl.float32) * w.to(tl.float32)[None, :], BLOCK_T, BLOCK_H)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    tl.store(out_ptr + t, tl.sigmoid(acc), mask=t < num_tokens)
