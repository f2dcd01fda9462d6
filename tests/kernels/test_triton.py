"""The Triton kernels against a plain-torch reference, in the plans production builds.

Every case plans its layer with the production planner (``mxmoe.kernels.triton.planner.plan_layer``: what
``mxmoe.compile`` runs on the layer it finds in the IR) and runs the plan with ``TritonExecutor``: under
Triton's interpreter on CPU tensors (``mode="interpret"``) without a GPU, JIT-compiled on CUDA with one (the
``gpu`` tests add cubins and larger shapes). Checks of one kernel run only its launches of a production plan
(``TritonExecutor.run(x, kernels=..., buffers=...)``). Targets: sm_90 reads the Hopper words tiled (its
production layout) or in row order (artifacts compiled before the tiles), sm_100 the checkpoint's order
through ``tl.dot_scaled``.
"""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mxmoe.core.bridge import dtype_name, to_numpy, to_torch
from mxmoe.core.layouts import get_layout
from mxmoe.kernels.triton import KernelPlan, LayerSpec, PlanError, StoredWeight, fit_scale_range, plan_layer
from mxmoe.kernels.triton.kernels import arg_names
from mxmoe.kernels.triton.tile_config import (HOPPER_LARGE_ROWS_PER_EXPERT, MID_WIDE_ROWS_PER_EXPERT,
                                              PREFILL_ROWS_PER_EXPERT, TileConfig, class_config, shape_classes)
from mxmoe.runtime.triton_executor import TritonExecutor
from mxmoe.torch_frontend import ties

HAS_CUDA = torch.cuda.is_available()
DEVICE, MODE = ("cuda", "jit") if HAS_CUDA else ("cpu", "interpret")

if not HAS_CUDA:
    from triton.runtime.interpreter import InterpreterBuilder

    if not hasattr(InterpreterBuilder, "create_dot_scaled"):  # Triton < 3.7's interpreter
        pytestmark = pytest.mark.skip(reason="this Triton's interpreter has no tl.dot_scaled")

#: (arch, weight layout) of the plans under test
SM90 = (90, "triton-mxfp4-hopper-tiled")
SM90_ROWS = (90, "triton-mxfp4-hopper")
SM100 = (100, "mxfp4-rowmajor")
TARGETS = {"sm90": SM90, "sm90_rows": SM90_ROWS, "sm100": SM100}
#: the kernels that route (the few-token classes' launch groups too)
ROUTERS = {"router_route_group", "router_route_scatter", "router_route", "router_gemm", "route_partials"}

# ---------------------------------------------------------------- reference

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def dequantize(w, s):
    """[E, N, K/2] codes + [E, N, K/32] e8m0 -> [E, N, K] fp32 (low nibble = even k)."""
    codes = torch.stack([w & 0xF, w >> 4], -1).flatten(-2).long()
    return E2M1.to(w.device)[codes] * torch.exp2(s.float() - 127).repeat_interleave(32, -1)


def reference_route(logits, top_k, routing="topk_softmax", renormalize=False):
    logits = logits.float()
    if routing == "topk_softmax":
        top, ids = ties.top_k(logits, top_k)
        return torch.softmax(top, dim=1), ids.int()
    top, ids = ties.top_k(torch.softmax(logits, dim=1), top_k)
    if renormalize:
        top = top / top.sum(1, keepdim=True)
    return top, ids.int()


def reference_moe(x, logits, w, spec):
    """Gather each expert's tokens, run its MLP in fp32, scatter-add weighted outputs (``w``: logical weights)."""
    W13, W2 = dequantize(w["w13"], w["w13_scale"]), dequantize(w["w2"], w["w2_scale"])
    b13, b2 = w.get("w13_bias"), w.get("w2_bias")
    I = spec.intermediate
    weights, ids = reference_route(logits, spec.top_k, spec.routing, spec.renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(W13.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        h = x[t].float() @ W13[e].T + (b13[e].float() if b13 is not None else 0)
        gate, up = (h[:, 0::2], h[:, 1::2]) if spec.interleaved else (h[:, :I], h[:, I:])
        if spec.activation == "swiglu_oai":
            gate, up = gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
            a = (up + 1) * gate * torch.sigmoid(spec.alpha * gate)
        else:
            a = up * gate * torch.sigmoid(gate)
        y = a.to(x.dtype).float() @ W2[e].T + (b2[e].float() if b2 is not None else 0)
        out.index_add_(0, t, weights[t, j, None] * y)
    return out.to(x.dtype)


def reference_groups(ids, num_experts, block_m, num_blocks):
    """What the grouping kernels must produce for ids [T, k]: pairs stably sorted by expert, each expert's
    first sorted row, and the block map (each expert's rows in BLOCK_M blocks, then -1 blocks)."""
    flat = ids.flatten().long()
    here = flat >= 0  # -1: not this layer's expert, in no group
    counts = torch.bincount(flat[here], minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    block_expert, block_start = [], []
    for e in range(num_experts):
        for j in range(-(-int(counts[e]) // block_m)):
            block_expert.append(e)
            block_start.append(int(offsets[e]) + j * block_m)
    for b in range(len(block_expert), num_blocks):
        block_expert.append(-1)
        block_start.append(b * block_m)
    order = torch.argsort(torch.where(here, flat, num_experts), stable=True)[:int(here.sum())]
    return {"sorted_pairs": order, "expert_offsets": offsets,
            "block_expert": torch.tensor(block_expert), "block_start": torch.tensor(block_start)}


# ---------------------------------------------------------------- layers, plans, executors

def layer_spec(E, k, H, I, target=SM90, *, dtype=torch.bfloat16, bias=True, router_bias=True,
               routing="topk_softmax", renormalize=False, activation="swiglu_oai", interleaved=True) -> LayerSpec:
    """A layer as the compiler would match it, its weights named after their operands."""
    dt = dtype_name(dtype)

    def w(name, shape, wdt="uint8", present=True):
        return StoredWeight(name, shape, wdt) if present else None

    return LayerSpec(
        num_experts=E, top_k=k, hidden=H, intermediate=I, routing=routing, renormalize=renormalize,
        activation=activation, alpha=1.702, limit=7.0, interleaved=interleaved, dtype=dt, layout=target[1],
        router_weight=w("router_weight", (E, H), dt), router_bias=w("router_bias", (E,), dt, router_bias),
        w13=w("w13", (E, 2 * I, H // 2)), w13_scale=w("w13_scale", (E, 2 * I, H // 32)),
        w13_bias=w("w13_bias", (E, 2 * I), dt, bias), w2=w("w2", (E, H, I // 2)), w2_scale=w("w2_scale", (E, H, I // 32)),
        w2_bias=w("w2_bias", (E, H), dt, bias))


def random_mxfp4(E, N, K, *, gen):
    """Random codes with scales sized so that a K-long dot with N(0,1) inputs is O(1)."""
    w = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    center = 127 - round(0.5 * math.log2(K * 8.6))  # 8.6 = mean square of the e2m1 values
    return w, torch.randint(center - 1, center + 2, (E, N, K // 32), generator=gen).to(torch.uint8)


def random_weights(spec: LayerSpec, seed=0) -> dict[str, torch.Tensor]:
    """Logical weights (checkpoint order, CPU) by operand name; absent biases left out."""
    gen = torch.Generator().manual_seed(seed)
    E, H, I, dt = spec.num_experts, spec.hidden, spec.intermediate, getattr(torch, spec.dtype)
    w = {"router_weight": (torch.randn(E, H, generator=gen) / math.sqrt(H)).to(dt)}
    w["w13"], w["w13_scale"] = random_mxfp4(E, 2 * I, H, gen=gen)
    w["w2"], w["w2_scale"] = random_mxfp4(E, H, I, gen=gen)
    for name, shape in (("router_bias", (E,)), ("w13_bias", (E, 2 * I)), ("w2_bias", (E, H))):
        if getattr(spec, name) is not None:
            w[name] = (0.5 * torch.randn(*shape, generator=gen)).to(dt)
    return w


def stored(spec: LayerSpec, weights) -> dict[str, torch.Tensor]:
    """The parameters as the plan reads them: MXFP4 values in the layer's layout (``core.layouts``)."""
    layout = get_layout(spec.layout)
    return {getattr(spec, op).name: to_torch(layout.encode("values", to_numpy(t))) if op in ("w13", "w2") else t
            for op, t in weights.items()}


def executor(spec: LayerSpec, weights, arch: int, *, mode=MODE, binaries=None) -> TritonExecutor:
    """The production plan of ``spec`` for sm_<arch>, with the decode form production picks for these weights
    (``fit_scale_range``), bound to ``weights`` on this machine's device."""
    params = stored(spec, weights)
    plan = fit_scale_range(plan_layer(spec, arch), params)
    return TritonExecutor(plan, params, binaries, device=DEVICE, mode=mode)


def tokens(T, H, dtype=torch.bfloat16, seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def router_logits(x, weights):
    """The router's logits as the kernels make them: fp32 sums (bf16 products are exact), rounded to the
    layer's dtype (as its F.linear rounds them)."""
    b = weights.get("router_bias")
    return F.linear(x.float(), weights["router_weight"].float(), None if b is None else b.float()).to(x.dtype)


def check_forward(ex, spec, weights, x, near_tie_tokens):
    """The plan's output against :func:`reference_moe`, token by token; tokens at a routing near-tie (their
    k-th and (k+1)-th logits within 2 ulps, where another summation order may pick the other expert) skipped.
    The reference gets the router logits the kernels compute (up to the summation order). Tolerance: bf16
    level, absolute in units of the output's largest value (the bf16 output and activations round to 2^-9 of
    their size; under the interpreter fp32 -> bf16 conversions truncate, which doubles that)."""
    out = ex(x.to(DEVICE)).cpu()
    assert out.dtype == x.dtype and out.shape == x.shape
    logits = router_logits(x, weights)
    ref = reference_moe(x, logits, weights, spec)
    keep = ~near_tie_tokens(logits, spec.top_k)
    assert keep.sum() >= max(1, x.shape[0] * 3 // 4), f"{int((~keep).sum())} near-tie tokens of {x.shape[0]}"
    out, ref = out[keep].float(), ref[keep].float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)
    return out


# ---------------------------------------------------------------- routing and grouping

def router_executor(logits, top_k, routing="topk_softmax", renormalize=False, H=96):
    """(executor, x) whose router logits are exactly ``logits`` [T, E]: fp32 layer, x the first T unit rows,
    the router weight holding the logits in its first T columns (a one-hot dot is exact)."""
    T, E = logits.shape
    spec = layer_spec(E, top_k, H, 32, dtype=torch.float32, router_bias=False, routing=routing,
                      renormalize=renormalize)
    weights = random_weights(spec)
    weights["router_weight"] = torch.zeros(E, H)
    weights["router_weight"][:, :T] = logits.T
    return executor(spec, weights, 90), torch.eye(T, H)


@pytest.mark.parametrize("routing,renormalize", [("topk_softmax", False), ("softmax_topk", False),
                                                 ("softmax_topk", True)])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens,num_experts", [(1, 8), (17, 8), (70, 32), (5, 6)])
def test_routing_matches_the_reference_top_k(routing, renormalize, top_k, num_tokens, num_experts):
    """The routing launches of the class of T: the fused few-token router (1, 5, 17 tokens) and router_gemm +
    route_partials (70 tokens, sparse class)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(top_k))
    ex, x = router_executor(logits, top_k, routing, renormalize)
    bufs = ex.run(x.to(DEVICE), kernels=ROUTERS)
    ref_weights, ref_ids = reference_route(logits, top_k, routing, renormalize)
    assert torch.equal(bufs["expert_ids"].cpu(), ref_ids)
    torch.testing.assert_close(bufs["routing_weights"].cpu(), ref_weights, atol=1e-6, rtol=1e-5)


def test_routing_breaks_ties_towards_lower_expert():
    ex, x = router_executor(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]]), 3, H=32)
    bufs = ex.run(x.to(DEVICE), kernels=ROUTERS)
    assert bufs["expert_ids"].tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(bufs["routing_weights"].cpu(), torch.full((2, 3), 1 / 3))


# ---------------------------------------------------------------- the routing contract (issue #22)

L_TIE = 1.2265625  # a bf16 value (issue #22's tied logit); one ulp above it is L_TIE + 2^-7


def contract_router(E=16, k=3, H=256, seed=0):
    """(spec, weights, patterns, expected) for routing-contract checks, bf16, no router bias. Each pattern is a
    token (x row) whose k-th place is contested by experts a < b:

    * 64 tie patterns (x one-hot at column 128 + j, value 2^(j % 3)): logits of a and b exactly equal (even j:
      ``expected`` is a, the lower index) or b one ulp above (odd j: b); every logit exact, whatever the order;
    * 32 cancellation patterns (i < 16, two variants): expert a's logit is 2^10 (column i) - 2^10 (64 + i)
      - 2^-15 (96 + i) + L + d (192 + i, 224 + i), d = 2^-7 or 2^-8: the -2^-15 survives or not depending on
      how H is chunked, and decides the bf16 rounding (the midpoint for 2^-8). What a target picks is its
      summation order's business (docs/routing.md); that it picks the same in every class is the contract.
      (Before #22 the few-token classes chunked H by 128 and the others by 64 steps: they disagreed here.)
    """
    rng = torch.Generator().manual_seed(seed)
    spec = layer_spec(E, k, H, 32, router_bias=False)
    weights = random_weights(spec, seed=seed)
    R = torch.zeros(E, H)
    patterns, expected = [], []

    def column(a, b, winners, tie_value, b_value):
        col = -4.0 - torch.randint(0, 8, (E,), generator=rng).float()
        col[winners] = 8.0 - torch.arange(len(winners)).float()
        col[a], col[b] = tie_value, b_value
        return col

    def contest():
        order = torch.randperm(E, generator=rng).tolist()
        a, b = sorted(order[k - 1:k + 1])
        return a, b, [e for e in order[:k + 1] if e not in (a, b)]

    for j in range(64):
        a, b, winners = contest()
        R[:, 128 + j] = column(a, b, winners, L_TIE, L_TIE + (j % 2) * 2.0 ** -7)
        x = torch.zeros(H)
        x[128 + j] = 2.0 ** (j % 3)
        patterns.append(x)
        expected.append(sorted(winners + [b if j % 2 else a]))
    for d in (2.0 ** -7, 2.0 ** -8):
        for i in range(16):
            a, b, winners = contest()
            b, a = a, b  # a, the order-sensitive one, above b: a tie goes to b, a rounding up makes a win
            R[:, 192 + i] = column(a, b, winners, L_TIE, L_TIE)
            R[a, i], R[a, 64 + i], R[a, 96 + i], R[a, 224 + i] = 2.0 ** 10, -2.0 ** 10, -2.0 ** -15, d
            x = torch.zeros(H)
            x[[i, 64 + i, 96 + i, 192 + i, 224 + i]] = 1.0
            patterns.append(x)
            expected.append(None)
    weights["router_weight"] = R.bfloat16()
    assert torch.equal(weights["router_weight"].float(), R)
    return spec, weights, torch.stack(patterns).bfloat16(), expected


@pytest.mark.parametrize("E,k,batches,classes", [
    (16, 3, (1, 5, 64, 65, 171, 600, 700, 1025, 2731),
     {"gemv", "decode", "sparse", "mid", "mid_wide", "prefill", "large"}),
    (64, 8, (1, 5, 33, 64), {"gemv", "decode"})], ids=["16-experts-every-class", "64-experts-top8-decode-scatter"])
def test_routing_contract_holds_in_every_class(E, k, batches, classes):
    """Every shape class routes a token alike, bit for bit (ids and weights), and exact ties go to the lower
    expert index, one ulp apart to the larger logit: tokens of :func:`contract_router` run in batches of 1 to
    2731 (gemv, decode, sparse, mid, mid_wide, prefill, large for 16 experts, top 3) against the same tokens in
    batches of four (gemv). 64 experts with top-8: the decode class groups from per-block counts
    (``router_route_scatter``) where the gemv class sorts."""
    spec, weights, patterns, expected = contract_router(E=E, k=k)
    ex = executor(spec, weights, 90)
    if E == 64:
        assert ex.kernel_plan.kernels[ex.kernel_plan.shape_class(64).launches[0].kernel].kernel == \
            "router_route_scatter"
    P = patterns.shape[0]
    alone = {name: torch.cat([ex.run(patterns[i:i + 4].to(DEVICE), kernels=ROUTERS)[name].cpu()
                              for i in range(0, P, 4)]) for name in ("expert_ids", "routing_weights")}
    for p, want in enumerate(expected):
        if want is not None:
            assert sorted(alone["expert_ids"][p].tolist()) == want, (p, alone["expert_ids"][p].tolist(), want)
    seen = set()
    for T in batches:
        rows = torch.arange(T) * 7 % P  # every pattern, in some order, several times
        bufs = ex.run(patterns[rows].to(DEVICE), kernels=ROUTERS)
        seen.add(ex.kernel_plan.shape_class(T).name)
        for name in ("expert_ids", "routing_weights"):
            got, want = bufs[name].cpu(), alone[name][rows]
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"T={T}: {name} of pattern(s) {sorted({int(rows[b]) for b in bad})} differ"
    assert seen == classes


def options_executor(spec, weights, **options) -> TritonExecutor:
    params = stored(spec, weights)
    return TritonExecutor(fit_scale_range(plan_layer(spec, 90, **options), params), params, device=DEVICE, mode=MODE)


def test_deterministic_and_batch_invariant_plans():
    """What the options change in a plan: deterministic classes whose fp32 atomics would add more than twice per
    output element (k slots x K splits) write slot rows and add them in slot order (a ``combine_slots`` launch,
    or the gemv class's fused last program), with no [T, H] accumulator; batch-invariant plans also take one K
    step and no split K in every class; the options are recorded."""
    def plan(k, **options):
        return plan_layer(layer_spec(32, k, 2880, 2880), 90, **options)

    def combine(cls):
        return [p.kernels[lc.kernel] for lc in cls.launches if p.kernels[lc.kernel].kernel == "combine_gemm"][0]

    p = plan(4)
    assert p.options.deterministic is False and not any(combine(c).constexprs["SLOT_ROWS"] for c in p.classes)
    p = plan(4, deterministic=True)
    assert p.to_dict()["options"] == {"deterministic": True, "batch_invariant": False}
    for cls in p.classes:
        kernels = [p.kernels[lc.kernel].kernel for lc in cls.launches]
        assert combine(cls).constexprs["SLOT_ROWS"]
        assert kernels[-1] == ("combine_gemm" if cls.name == "gemv" else "combine_slots"), kernels
        assert cls.vars["ACC"] == ("T + 1" if cls.name == "gemv" else "0")  # gemv: its counters
    assert {cls.vars["SP"] for cls in p.classes} == {"2 * T * 4", "0"}  # gemv splits K: fp32 partial rows
    p = plan(2, deterministic=True)  # two adds: atomics stay, but gemv's split K makes four
    assert [combine(c).constexprs["SLOT_ROWS"] for c in p.classes] == [True] + [False] * (len(p.classes) - 1)
    p = plan(4, batch_invariant=True)
    assert p.options.deterministic and p.options.batch_invariant
    assert {(c.tiles[g]["BLOCK_K"], c.tiles[g]["SPLIT_K"]) for c in p.classes for g in ("w13", "w2")} == {(128, 1)}
    assert len({c.tiles["w13"]["BLOCK_M"] for c in p.classes}) > 1  # the rows per tile stay the class's
    p = plan(2, batch_invariant=True)  # no split K anywhere: two atomic adds in every class
    assert not any(combine(c).constexprs["SLOT_ROWS"] for c in p.classes)
    assert KernelPlan.from_dict({k: v for k, v in plan(4).to_dict().items() if k != "options"}).options == \
        plan(4).options  # plans written before the options: both off


@pytest.mark.parametrize("options", [dict(deterministic=True), dict(batch_invariant=True)])
def test_deterministic_forward_matches_reference_and_repeats(options, near_tie_tokens):
    """Slot rows and their slot-order sum against the reference in the gemv class (I = 2080, whose parts keep 4+ K
    steps, splits K: fp32 partial rows, k = 2 x 2 parts, summed in the combine's last program), decode and sparse
    (k = 4, I = 160); the same input twice gives the same bits."""
    split = layer_spec(8, 2, 96, 2080)
    assert plan_layer(split, 90, **options).shape_class(1).tiles["w2"]["SPLIT_K"] == (
        1 if options.get("batch_invariant") else 2)
    cases = ((split, (1,)),) if not options.get("batch_invariant") else ()  # batch-invariant plans never split
    for spec, Ts in (*cases, (layer_spec(8, 4, 96, 160), (9, 70))):
        weights = random_weights(spec, seed=11)
        ex = options_executor(spec, weights, **options)
        for T in Ts:
            x = tokens(T, 96, seed=T + 11)
            check_forward(ex, spec, weights, x, near_tie_tokens)
            if T in (1, 9):
                assert torch.equal(ex(x.to(DEVICE)), ex(x.to(DEVICE)))



@pytest.mark.parametrize("dtype,options", [(torch.bfloat16, {}), (torch.bfloat16, dict(deterministic=True)),
                                           (torch.float32, {})], ids=["bf16", "bf16-deterministic", "fp32"])
def test_reserved_scratch_is_zeroed_once(dtype, options):
    """Whole calls on reserved scratch (what a CUDA graph holds) skip the memset of its zeroed part when the last
    call left it zero: the router's counters and the accumulator (with the gemv class's per-tile counts) are set
    back to zero by their last users. Calls through the classes in a mixed order give a fresh executor's
    outputs and leave that memory zero; an fp32 layer whose output is the accumulator keeps the memset; a call
    that raised gets it again."""
    spec = layer_spec(8, 4, 96, 160, dtype=dtype)
    params = stored(spec, random_weights(spec, seed=5))
    plan = fit_scale_range(plan_layer(spec, 90, **options), params)
    kept, fresh = (TritonExecutor(plan, params, device=DEVICE, mode=MODE) for _ in range(2))
    kept.reserve(70)
    zeroed = {n: b.left_zero for n, b in plan.buffers.items() if b.init == "zeros"}
    assert zeroed["route_counter"] and zeroed.get("accumulator", True) == (dtype == torch.bfloat16)
    left_zero = all(zeroed.values())

    def same(got, want):  # bit for bit under the interpreter; on a GPU fp32 atomics add in any order
        scale = 0 if MODE == "interpret" else 1e-3 * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=scale, rtol=0 if MODE == "interpret" else 1e-2)

    classes = set()
    for i, T in enumerate((1, 9, 70, 3, 40, 1)):
        x = tokens(T, 96, seed=20 + i).to(DEVICE)
        classes.add(plan.shape_class(T).name)
        same(kept(x), fresh(x))
        assert kept._zeros_left == left_zero
        if left_zero:
            assert not kept._reserved[1].any(), f"T={T}: the call left its zeroed scratch non-zero"
    assert classes == {"gemv", "decode", "mid"}
    real, x = kept.launch, tokens(9, 96, seed=3).to(DEVICE)

    def fails_second(step, *args, **kwargs):
        if step is kept.steps(9)[1]:
            raise RuntimeError("launch failed")
        real(step, *args, **kwargs)

    kept.launch = fails_second
    with pytest.raises(RuntimeError, match="launch failed"):
        kept(x)
    assert not kept._zeros_left  # the router left its counters counted: the next call zeroes them
    del kept.launch
    same(kept(x), fresh(x))
    assert KernelPlan.from_dict({**plan.to_dict(), "buffers": {n: {k: v for k, v in b.items() if k != "left_zero"}
                                                                for n, b in plan.to_dict()["buffers"].items()}}
                                ).buffers["route_counter"].left_zero is False  # plans before the flag: memset

def test_batch_invariant_rows_equal_the_tokens_alone():
    """batch_invariant=True: rows of a batch of 1030 tokens (the large class for 4 experts, top 3) are bit for bit
    the same tokens run in batches of 1, 5 and 70 (gemv, decode, mid), and so is their routing."""
    spec = layer_spec(4, 3, 64, 64, routing="softmax_topk")
    weights = random_weights(spec, seed=12)
    ex = options_executor(spec, weights, batch_invariant=True)
    x = tokens(1030, 64, seed=12).to(DEVICE)
    assert ex.kernel_plan.shape_class(1030).name == "large"
    big = ex.run(x)
    for T, first in ((1, 17), (5, 3), (70, 900)):
        small = ex.run(x[first:first + T])
        for name in ("expert_ids", "routing_weights", "output"):
            assert torch.equal(small[name].cpu(), big[name][first:first + T].cpu()), (T, name)


def test_batch_invariant_rows_through_tail_tiles():
    """batch_invariant=True with the sparse class's tail tiles: 16 experts, top 2, a batch of 200 tokens (sparse: 32-row
    blocks, those of at most 16 rows on 16-row MMAs) gives each token the bits it gets alone and in a batch of 1030."""
    spec = layer_spec(16, 2, 64, 64)
    weights = random_weights(spec, seed=13)
    ex = options_executor(spec, weights, batch_invariant=True)
    sparse = ex.kernel_plan.shape_class(200)
    assert sparse.name == "sparse" and sparse.tiles["w13"]["TAIL_M"] == 16
    x = tokens(1030, 64, seed=13).to(DEVICE)
    big, mid = ex.run(x), ex.run(x[400:600])
    counts = torch.bincount(mid["expert_ids"].cpu().flatten().long(), minlength=16)
    assert ((counts % 32 > 0) & (counts % 32 <= 16)).any() and (counts % 32 > 16).any()  # both kinds of last block
    assert torch.equal(mid["output"].cpu(), big["output"][400:600].cpu())
    for t in (400, 555):
        assert torch.equal(ex.run(x[t:t + 1])["output"].cpu(), big["output"][t:t + 1].cpu())


def assert_groups(bufs, ids, ex, num_tokens):
    block_m = ex.kernel_plan.shape_class(num_tokens).tiles["w13"]["BLOCK_M"]
    ref = reference_groups(ids, ex.kernel_plan.layer.num_experts, block_m, bufs["block_expert"].numel())
    for name, want in ref.items():
        got = bufs[name].cpu().long()
        assert torch.equal(got[:want.numel()], want), name  # sorted_pairs: rows past the local pairs are unused


@pytest.mark.parametrize("case,T,E,k", [("random", 100, 8, 2), ("empty_experts", 300, 8, 2),
                                        ("empty_experts", 1300, 6, 2), ("one_expert", 1300, 6, 2),
                                        ("random", 90, 8, 3), ("remote", 1300, 8, 3), ("remote", 90, 8, 3)])
def test_parallel_grouping_matches_reference(case, T, E, k):
    """The chunked histogram / scan / scatter launches of the many-token classes (sparse at 100 tokens, mid at
    90 (top_k 3) and 300 (three 256-pair chunks), prefill over 11-16 chunks at 1300) on given expert ids; "remote": a
    third of the ids -1 (another rank's experts under expert parallelism), which no group holds."""
    gen = torch.Generator().manual_seed(7)
    if case in ("random", "remote"):
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        if case == "remote":
            ids[torch.rand(T, k, generator=gen) < 1 / 3] = -1
    elif case == "empty_experts":
        ids = torch.randint(0, 3, (T, k), generator=gen) * 2  # experts 1, 3, 5 get no pairs
    else:
        ids = torch.full((T, k), 4)
    spec = layer_spec(E, k, 64, 32)
    ex = executor(spec, random_weights(spec), 90)
    bufs = ex.run(tokens(T, 64).to(DEVICE), kernels={"chunk_histogram", "chunk_scan", "chunk_scatter"},
                  buffers={"expert_ids": ids.int()})
    assert_groups(bufs, ids, ex, T)


def test_grouping_chunks_follow_the_class():
    """Pairs per grouping program: one step's worth up to GROUP_PROGRAMS programs at the class's largest batch, then
    doubling, at most GROUP_CHUNK (the open-ended class); what the plans' NC and kernel constants say."""
    from mxmoe.kernels.triton.planner import GROUP_CHUNK, GROUP_PROGRAMS, group_chunk

    assert [group_chunk(32, p) for p in (260, 4096, 16380, 16385, 65536, None)] == [256, 256, 256, 512, 1024, 1024]
    assert [group_chunk(128, p) for p in (4096, 4097, 16384, 65532)] == [64, 128, 256, 1024]
    for E in (6, 32, 128, 256):
        for p in (100, 4096, 30000):
            c = group_chunk(E, p)
            assert c <= GROUP_CHUNK and (c == GROUP_CHUNK or -(-p // c) <= GROUP_PROGRAMS)
    plan = plan_layer(layer_spec(128, 4, 2880, 2880), 90)
    for cls in plan.classes:
        if cls.name in ("sparse", "mid", "mid_wide", "prefill", "large"):
            chunk = group_chunk(128, None if cls.max_tokens is None else 4 * cls.max_tokens)
            assert cls.vars["NC"] == f"cdiv(T * 4, {chunk})"
            hist = next(lc.kernel for lc in cls.launches if plan.kernels[lc.kernel].kernel == "chunk_histogram")
            assert plan.kernels[hist].constexprs["CHUNK"] == chunk


@pytest.mark.parametrize("T,E,k,case", [(1, 8, 2, "random"), (4, 128, 4, "random"), (16, 8, 4, "random"),
                                         (17, 32, 4, "random"), (40, 128, 4, "random"), (64, 32, 4, "random"),
                                         (64, 128, 4, "random"), (33, 8, 1, "random"), (33, 128, 1, "random"),
                                         (40, 16, 3, "odd_off"), (40, 128, 3, "odd_off"), (50, 8, 2, "one"),
                                         (50, 128, 2, "one"), (40, 64, 8, "random"), (64, 64, 8, "one"),
                                         (21, 64, 8, "odd_off")])
def test_few_token_router_launch_routes_and_groups(T, E, k, case):
    """The few-token router launch: the router split over H (640 = five programs per 16-token block), top-k
    routing per block, and the grouping (sorted in the last block routed: ``router_route_group``; with 128+
    experts in the decode class scattered from per-block counts: ``router_route_scatter``) give the ids of
    the reference routing and exactly the reference groups and block map (64 experts with top-8 scatter too: their
    decode class sorts 64 x 8 pairs over 64 experts). Integer x and router weights plus
    a bias of e/1024 keep every logit exact and distinct (no near-ties)."""
    H = 640
    spec = layer_spec(E, k, H, 32, dtype=torch.float32, bias=False)
    gen = torch.Generator().manual_seed(T * E + k)
    weights = random_weights(spec)
    x = torch.randint(-3, 4, (T, H), generator=gen).float()
    weights["router_weight"] = torch.randint(-3, 4, (E, H), generator=gen).float()
    bias = weights["router_bias"] = torch.arange(E).float() / 1024
    if case == "odd_off":
        bias[1::2] -= 4096.0  # odd experts never chosen
    elif case == "one":
        bias[5] += 4096.0  # expert 5 takes every token
    ex = executor(spec, weights, 90)
    launch = ex.kernel_plan.shape_class(T).launches[0]
    router = ex.kernel_plan.kernels[launch.kernel]
    scatter = T > 4 and (E >= 128 or (E, k) == (64, 8))
    assert router.kernel == ("router_route_scatter" if scatter else "router_route_group")
    assert router.constexprs["SPLITS"] == 5
    bufs = ex.run(x.to(DEVICE), kernels=ROUTERS)
    weights_ref, ids = reference_route(x @ weights["router_weight"].t() + bias, k)
    assert torch.equal(bufs["expert_ids"].cpu(), ids)
    torch.testing.assert_close(bufs["routing_weights"].cpu(), weights_ref, atol=1e-6, rtol=1e-5)
    if case == "one":
        assert bool((ids[:, 0] == 5).all())
    assert_groups(bufs, ids, ex, T)


@pytest.mark.parametrize("T,E_local", [(3, 16), (40, 16), (3, 128), (40, 128), (70, 128)])
def test_expert_parallel_routing_maps_and_groups_local_pairs(T, E_local):
    """Expert parallelism in the router launches: routing over 160 global experts, ids stored through the expert
    map (-1 for another rank's), and only the local pairs grouped: the few-token sort (gemv), the grouping from
    block counts (decode with 128 local experts), the chunked grouping (70 tokens)."""
    E_global, k, H = 160, 4, 256
    spec = dataclasses.replace(layer_spec(E_local, k, H, 32, dtype=torch.float32, bias=False),
                               global_experts=E_global, expert_map=StoredWeight("expert_map", (E_global,), "int32"),
                               router_weight=StoredWeight("router_weight", (E_global, H), "float32"),
                               router_bias=StoredWeight("router_bias", (E_global,), "float32"))
    gen = torch.Generator().manual_seed(T + E_local)
    weights = random_weights(layer_spec(E_local, k, H, 32, dtype=torch.float32, bias=False))
    x = torch.randint(-3, 4, (T, H), generator=gen).float()
    weights["router_weight"] = torch.randint(-3, 4, (E_global, H), generator=gen).float()
    weights["router_bias"] = torch.arange(E_global).float() / 1024  # exact, distinct logits
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[torch.randperm(E_global, generator=gen)[:E_local]] = torch.randperm(E_local, generator=gen).int()
    weights["expert_map"] = emap
    ex = executor(spec, weights, 90)
    bufs = ex.run(x.to(DEVICE), kernels=ROUTERS | {"chunk_histogram", "chunk_scan", "chunk_scatter"})
    _, ids = reference_route(x @ weights["router_weight"].t() + weights["router_bias"], k)
    local = emap[ids.long()]
    assert torch.equal(bufs["expert_ids"].cpu(), local)
    assert (local < 0).any() and (local >= 0).any()
    assert_groups(bufs, local, ex, T)


#: routers of the common families (docs/routing.md) as the routing kernels take them: LayerSpec fields, E, k
ROUTER_CASES = {
    "sigmoid_topk-bias-renorm": (dict(routing="sigmoid_topk", renormalize=True), 16, 3, True),
    "sigmoid_topk-groups-scaled": (dict(routing="sigmoid_topk", renormalize=True, n_group=4, topk_group=2,
                                        scaling=2.5), 32, 5, True),
    "sigmoid_topk-groups-no-bias": (dict(routing="sigmoid_topk", n_group=8, topk_group=3), 32, 6, False),
    "topk_sigmoid-k1": (dict(routing="topk_sigmoid"), 16, 1, False),
    "softmax_topk-renorm-scaled": (dict(routing="softmax_topk", renormalize=True, scaling=0.5), 12, 3, False),
    "topk_softmax-fp32-router": (dict(router_fp32=True), 16, 2, False),
}


def router_case(name, tie_groups=False):
    """(spec, weights, reference (weights, ids)) of a ROUTER_CASES layer (bf16, H=256): x and the router weight
    multiples of 1/8 in [-3/8, 3/8] and the router bias i/1024, so every logit is exact (in fp32 and in bf16 after
    the one rounding) and the reference's routing is the kernels' up to exp's last bit. ``tie_groups``: experts
    16-23 copy 8-15's router rows and bias, both raised by 4 (groups 1 and 3 of 4 tie as the best two)."""
    from types import SimpleNamespace

    from mxmoe.core.reference import route

    fields, E, k, score_bias = ROUTER_CASES[name]
    H, fp32 = 256, fields.get("router_fp32", False)
    spec = dataclasses.replace(layer_spec(E, k, H, 32, bias=False), **fields)
    if score_bias:
        spec = dataclasses.replace(spec, score_bias=StoredWeight("score_bias", (E,), "float32"))
    if fp32:
        spec = dataclasses.replace(spec, router_weight=StoredWeight("router_weight", (E, H), "float32"),
                                   router_bias=StoredWeight("router_bias", (E,), "float32"))
    gen = torch.Generator().manual_seed(E + k)
    weights = random_weights(layer_spec(E, k, H, 32, bias=False))
    rdt = torch.float32 if fp32 else torch.bfloat16
    w = torch.randint(-3, 4, (E, H), generator=gen).float() / 8
    b = torch.arange(E).float() / 1024
    if tie_groups:
        b[8:16] += 4
        w[16:24], b[16:24] = w[8:16], b[8:16]
    weights["router_weight"], weights["router_bias"] = w.to(rdt), b.to(rdt)
    sb = None
    if score_bias:
        sb = (torch.randn(E, generator=gen) / 8).float()
        weights["score_bias"] = sb
    cfg = SimpleNamespace(top_k=k, routing=spec.routing, renormalize=spec.renormalize, n_group=spec.n_group,
                          topk_group=spec.topk_group, routed_scaling_factor=spec.scaling)

    def reference(x):
        logits = x.float() @ w.T + b  # exact
        logits = logits if fp32 else logits.bfloat16().float()
        rw, ids = route(logits.numpy(), cfg, None if sb is None else sb.numpy())
        return torch.from_numpy(rw), torch.from_numpy(ids).int()

    return spec, weights, reference


@pytest.mark.parametrize("T", [3, 40, 100, 1100])
@pytest.mark.parametrize("name", list(ROUTER_CASES))
def test_routers_of_the_families_in_every_router_kernel(name, T):
    """sigmoid_topk (correction bias, expert groups, renormalised with the slot-order sum + 1e-20), topk_sigmoid,
    routed_scaling_factor and fp32 routers in each router kernel (3 tokens: router_route_group, 40: the decode
    class's, 100: router_gemm + route_partials, 1100: router_route) against ``mxmoe.core.reference.route``: the
    same ids, the weights to exp's last bits, and every class of one plan alike (the contract: docs/routing.md)."""
    spec, weights, reference = router_case(name)
    ex = executor(spec, weights, 90)
    x = (torch.randint(-3, 4, (T, 256), generator=torch.Generator().manual_seed(T)).float() / 8).bfloat16()
    bufs = ex.run(x.to(DEVICE), kernels=ROUTERS)
    ref_w, ref_ids = reference(x)
    assert torch.equal(bufs["expert_ids"].cpu(), ref_ids)
    torch.testing.assert_close(bufs["routing_weights"].cpu(), ref_w, atol=1e-6, rtol=1e-5)
    kinds = {ex.kernel_plan.kernels[lc.kernel].kernel for lc in ex.kernel_plan.shape_class(T).launches}
    assert kinds & ROUTERS == {3: {"router_route_group"}, 40: {"router_route_group"},
                              100: {"router_gemm", "route_partials"}, 1100: {"router_route"}}[T]


@pytest.mark.parametrize("T", [5, 100])
def test_tied_expert_groups_go_to_the_lower_group(T):
    """Two groups with equal scores (the same router rows): the lower group is kept, and inside the kept groups
    equal choice values go to the lower expert, as the reference's stable sorts do."""
    spec, weights, reference = router_case("sigmoid_topk-groups-no-bias", tie_groups=True)
    spec = dataclasses.replace(spec, n_group=4, topk_group=1, top_k=4)
    ex = executor(spec, weights, 90)
    x = (torch.randint(-3, 4, (T, 256), generator=torch.Generator().manual_seed(T)).float() / 8).bfloat16()
    bufs = ex.run(x.to(DEVICE), kernels=ROUTERS)
    from types import SimpleNamespace

    from mxmoe.core.reference import route

    logits = (x.float() @ weights["router_weight"].float().T + weights["router_bias"].float()).bfloat16().float()
    cfg = SimpleNamespace(top_k=4, routing="sigmoid_topk", renormalize=False, n_group=4, topk_group=1,
                          routed_scaling_factor=1.0)
    ref_w, ref_ids = route(logits.numpy(), cfg)
    assert torch.equal(bufs["expert_ids"].cpu(), torch.from_numpy(ref_ids).int())
    torch.testing.assert_close(bufs["routing_weights"].cpu(), torch.from_numpy(ref_w), atol=1e-6, rtol=1e-5)
    ids = bufs["expert_ids"].cpu()
    assert bool(((ids >= 8) & (ids < 16)).all())  # group 1, never its twin 3


def test_the_planner_refuses_what_the_kernels_do_not_run():
    spec = layer_spec(8, 2, 64, 96)
    with pytest.raises(PlanError, match="routing 'sparsemixer' is not one the Triton kernels run"):
        dataclasses.replace(spec, routing="sparsemixer")
    with pytest.raises(PlanError, match="activation 'relu2' is not one the Triton kernels run"):
        dataclasses.replace(spec, activation="relu2")
    with pytest.raises(PlanError, match="expert groups are 'sigmoid_topk''s"):
        dataclasses.replace(spec, n_group=2, topk_group=1)


def earlier_plan(plan: dict) -> dict:
    """``plan`` as plans built before 2026-11-24 ran the few-token classes (artifacts of then still name these
    kernels): gemv routed and sorted its pairs in one program (``route_and_group``) after its own router launch;
    decode ran ``router_gemm``, ``route_partials`` and the one-program sort ``group_by_expert``."""
    plan = copy.deepcopy(plan)
    k = plan["layer"]["top_k"]
    for cls in plan["classes"][:2]:
        fused = plan["kernels"][cls["launches"][0]["kernel"]]
        assert fused["kernel"] == "router_route_group"
        c, by_name = fused["constexprs"], {a["name"]: a for a in fused["args"]}
        by_name["num_pairs"] = {"name": "num_pairs", "bind": "expr", "expr": f"T * {k}", "type": "i32"}

        def entry(kernel, consts, warps, grid):
            consts = {name: c[name] for name in consts} if isinstance(consts, tuple) else consts
            name = f"{kernel}.{cls['name']}.earlier"
            plan["kernels"][name] = {"kernel": kernel, "constexprs": consts, "num_warps": warps, "num_stages": 1,
                                     # constants and run-time arguments added later (with defaults) left out
                                     "args": [by_name[a] for a in arg_names(kernel)
                                              if a not in consts and a in by_name]}
            return {"kernel": name, "grid": grid}

        route = ("NUM_EXPERTS", "TOP_K", "EXPERTS_POW2", "SLOTS_POW2", "SPLITS", "HAS_BIAS", "ROUND_LOGITS_BF16",
                 "BLOCK_T", "SOFTMAX_OVER_ALL")
        launches = [entry("router_gemm", {**{n: c[n] for n in ("HIDDEN", "NUM_EXPERTS", "EXPERTS_POW2",
                                                                "H_PER_SPLIT", "IEEE_FP32", "BLOCK_H")},
                                          "BLOCK_T": c["ROUTER_BLOCK_T"]}, 4, cls["launches"][0]["grid"])]
        if cls["name"] == "gemv":
            launches.append(entry("route_and_group", route + ("GROUP_EXPERTS_POW2", "BLOCK_M", "CHUNK"), 8, [1]))
        else:
            launches.append(entry("route_partials", route, 4, [f"cdiv(T, {c['BLOCK_T']})"]))
            launches.append(entry("group_by_expert", {"NUM_EXPERTS": c["NUM_EXPERTS"], "BLOCK_M": c["BLOCK_M"],
                                                      "EXPERTS_POW2": c["GROUP_EXPERTS_POW2"], "CHUNK": 256}, 8, [1]))
        cls["launches"][:1] = launches
    return plan


@pytest.mark.parametrize("T", [3, 20])
def test_plans_of_earlier_versions_still_run(T):
    """A plan whose few-token classes launch the kernels they did before 2026-11-24 (``route_and_group``,
    ``group_by_expert``) loads and gives exactly today's output (top_k = 2: the combine is bitwise
    deterministic)."""
    spec = layer_spec(8, 2, 64, 96)
    weights = random_weights(spec, seed=T)
    ex = executor(spec, weights, 90)
    old = TritonExecutor(earlier_plan(ex.plan), ex.params, device=DEVICE, mode=MODE)
    assert {"route_and_group", "group_by_expert"} <= {e.kernel for e in old.kernel_plan.kernels.values()}
    x = tokens(T, 64, seed=T).to(DEVICE)
    assert torch.equal(old(x), ex(x))


# ---------------------------------------------------------------- the Hopper decode

@pytest.mark.parametrize("target", [SM90, SM90_ROWS], ids=["tiled", "rows"])
@pytest.mark.parametrize("wide_scales", [True, False])
def test_hopper_decode_every_code_and_scale(wide_scales, target):
    """The GEMMs' decode of the Hopper layouts, value by value against the e2m1 x e8m0 definition: all 256
    bytes under every scale byte it promises to cover (the one-multiply form production picks for scales up
    to 128: 0..128; the two-multiply form: all, 255 giving NaN). The w2 GEMM of a production plan alone on
    identity activations (all tokens routed to expert 0 with weight 1) writes W^T; a row holding an infinity
    or NaN turns every other output of the row into NaN (0 * inf). Runs the inline-PTX decode on a GPU, its
    fp32 twin in the interpreter. (The decode's intermediate bf16 pairs are v * 2^-126, subnormal for the
    small codes under every scale byte, so every scale checks them.)"""
    scales = torch.arange(0, 256) if wide_scales else torch.cat([torch.arange(0, 129), torch.tensor([128])])
    N, K = 16 * len(scales), 32  # each scale byte: 16 rows of 16 bytes, every byte value once
    gen = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randperm(256, generator=gen).to(torch.uint8).reshape(16, 16) for _ in scales])
    s = scales.repeat_interleave(16)[:, None].to(torch.uint8)
    spec = layer_spec(2, 1, N, K, target, dtype=torch.float32, bias=False)
    weights = random_weights(spec)
    weights["router_weight"].zero_()
    weights["router_bias"] = torch.tensor([100.0, 0.0])  # every token to expert 0, weight 1 (softmax of one)
    weights["w2"], weights["w2_scale"] = torch.zeros(2, N, K // 2, dtype=torch.uint8), torch.full((2, N, 1), 127,
                                                                                                   dtype=torch.uint8)
    weights["w2"][0], weights["w2_scale"][0] = w, s
    ex = executor(spec, weights, 90)
    assert {e.constexprs["WIDE_SCALES"] for e in ex.kernel_plan.kernels.values() if "W_HOPPER" in e.constexprs} == {
        wide_scales}
    bufs = ex.run(torch.zeros(K, N).to(DEVICE), kernels={"router_route_group", "combine_gemm"},
                  buffers={"activations": torch.eye(K, dtype=torch.bfloat16)})
    got = bufs["accumulator"].cpu().T  # [N, K]
    want = dequantize(w[None], s[None])[0]
    want[s.expand(N, K).eq(255)] = float("nan")  # e8m0 0xFF is NaN
    others_bad = (~torch.isfinite(want)).sum(1, keepdim=True) - (~torch.isfinite(want)).int()
    want[others_bad > 0] = float("nan")
    finite = torch.isfinite(want)
    assert finite.float().mean() > 0.9
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    # bit-exact (every value is a bf16), but for subnormal results (below 2^-126: scale byte 0), whose low bits
    # the GEMM's operand conversion may drop (the interpreter's bf16 -> fp32 does; its decode alone is exact)
    exact = got == want.bfloat16().float()
    subnormal = (want.abs() < 2.0 ** -126) & ((got - want).abs() < 2.0 ** -126)
    assert bool((exact | subnormal)[finite].all())
    assert exact[finite].float().mean() > 0.99


def test_planner_takes_only_layouts_the_kernels_read():
    with pytest.raises(PlanError, match=r"'cpu-mxfp4-blocksplit' is not one the Triton kernels read \(known: "
                                        r"mxfp4-rowmajor, triton-mxfp4-hopper, triton-mxfp4-hopper-tiled\)"):
        layer_spec(8, 2, 64, 96, (90, "cpu-mxfp4-blocksplit"))
    assert layer_spec(8, 2, 64, 96, (100, "triton-mxfp4-kmajor")).layout == "triton-mxfp4-kmajor"  # an alias


def test_hopper_layout_needs_whole_row_groups():
    w = torch.zeros(1, 24, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="N a multiple of 16"):
        get_layout(SM90_ROWS[1]).encode("values", to_numpy(w))


# ---------------------------------------------------------------- the plan

def test_plan_round_trips_its_format_and_checks_it():
    """``to_dict`` / ``from_dict`` keep format /1 exactly (byte for byte as JSON); a broken plan is refused with
    a message naming the problem."""
    import json

    plan = plan_layer(layer_spec(8, 3, 96, 160, interleaved=False, bias=False), 90)
    d = plan.to_dict()
    assert json.dumps(KernelPlan.from_dict(json.loads(json.dumps(d))).to_dict()) == json.dumps(d)
    assert KernelPlan.from_dict(d) == plan
    bad = copy.deepcopy(d)
    bad["classes"][0]["launches"][0]["kernel"] = "no_such_entry"
    with pytest.raises(PlanError, match="class gemv launches unknown kernel 'no_such_entry'"):
        KernelPlan.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["buffers"]["activations"]["shape"][0] = "T * XX"
    with pytest.raises(PlanError, match="buffer activations .* uses undefined XX"):
        KernelPlan.from_dict(bad)
    bad = copy.deepcopy(d)
    del bad["kernels"]
    with pytest.raises(PlanError, match="kernel plan has no 'kernels'"):
        KernelPlan.from_dict(bad)
    with pytest.raises(PlanError, match="not a kernel plan"):
        KernelPlan.from_dict({**d, "format": "mxmoe-triton-plan/0"})


@pytest.mark.parametrize("target", [SM90, SM100], ids=["sm90", "sm100"])
def test_class_tiles(target):
    """The tiles production plans carry per class (gpt-oss dims; ``tile_config.class_config``)."""
    def tiles(T, E=32, k=4, H=2880, I=2880):
        cls = plan_layer(layer_spec(E, k, H, I, target), target[0]).shape_class(T)
        return TileConfig(**cls.tiles["w13"]), TileConfig(**cls.tiles["w2"])

    assert tiles(1)[0].BLOCK_M == tiles(64)[0].BLOCK_M == 16 and tiles(2048)[0].BLOCK_M >= 64  # gemv, decode
    if target == SM100:  # dot_scaled: 1-4 tokens on narrow tiles and 2 warps
        assert tiles(4)[0].BLOCK_N < tiles(5)[0].BLOCK_N
    for T in (1, 4, 5, 64, 65, 256, 257, 1024, 2048, 4096, 16384):  # both GEMMs of one forward share BLOCK_M
        w13, w2 = tiles(T)
        assert w13.BLOCK_M == w2.BLOCK_M
    # "large" (256-row tiles, grouped launch order) from 512 rows per expert: T*k/E >= 512; on sm_90 from 160
    # (gpt-oss-20b: 1280 tokens)
    assert (tiles(4095)[0].BLOCK_M, tiles(4095)[0].GROUP_M) == ((256, 4) if target == SM90 else (128, 0))
    assert (tiles(1279)[0].BLOCK_M, tiles(1280)[0].BLOCK_M) == ((128, 256) if target == SM90 else (128, 128))
    # sm_90 prefill: grouped launch order where the class's smallest batch has more w2 input rows than L2 holds
    # (gpt-oss-120b from 4097 tokens: 94 MB; gpt-oss-20b from 1025: 24 MB)
    assert [tiles(8192, E=128)[g].GROUP_M for g in (0, 1)] == ([4, 4] if target == SM90 else [0, 0])
    assert tiles(256)[0].BLOCK_M == 32 and tiles(257)[0].BLOCK_M == 64
    assert tiles(1024, E=128)[0].BLOCK_M == 32
    assert (tiles(4096)[0].BLOCK_M, tiles(4096)[0].GROUP_M) == (256, 4)
    # sm_90: large takes K steps of 128 in 3 stages; mid_wide's w2 GEMM too where its K (= I) is deep (HOPPER_DEEP_K)
    assert [(t.BLOCK_K, t.num_stages) for t in tiles(4096)] == ([(128, 3)] * 2 if target == SM90 else [(64, 4)] * 2)
    mixtral = tiles(512, E=8, k=2, H=4096, I=14336)  # 128 rows per expert: mid_wide on sm_90
    assert [(t.BLOCK_K, t.num_stages) for t in mixtral] == (
        [(64, 4), (128, 3)] if target == SM90 else [(64, 4)] * 2)
    assert [t.BLOCK_K for t in tiles(1024)] == [64, 64]  # gpt-oss's mid_wide (I = 2880)
    # 128 experts: on sm_90 mid's 64-row tiles up to 96 rows per expert (3072 tokens), mid_wide's 128-row ones with
    # 64-row tails to 128 rows (4096), then prefill's 128 (to 5119), large from 160 rows (5120)
    assert tiles(3072, E=128)[0].BLOCK_M == (64 if target == SM90 else 128)
    assert [tiles(T, E=128)[0].TAIL_M for T in (3072, 3073, 4096, 4097)] == (
        [0, 64, 64, 0] if target == SM90 else [0] * 4)
    assert tiles(3073, E=128)[0].BLOCK_M == tiles(4096, E=128)[0].BLOCK_M == tiles(4097, E=128)[0].BLOCK_M == 128
    assert tiles(5120, E=128)[0].BLOCK_M == (256 if target == SM90 else 128)
    assert tiles(16384, E=128)[0].BLOCK_M == 256
    # 8 experts, top-2 (mixtral's): on sm_90 mid_wide ends at 128 rows per expert (512 tokens), large from 160 (640)
    assert [tiles(T, E=8, k=2, H=4096, I=14336)[0].BLOCK_M for T in (512, 513, 640, 1024)] == (
        [128, 128, 256, 256] if target == SM90 else [64, 64, 64, 64])
    assert tiles(1, E=8, k=2, H=96, I=32)[0].BLOCK_N == (32 if target == SM100 else 64)
    assert tiles(2000, E=8, k=2, H=96, I=32)[0].BLOCK_N == 64  # clamped to the (tiny) N = 2I
    assert tiles(1)[1].SPLIT_K == (2 if target == SM90 else 1) and tiles(5)[1].SPLIT_K == 1
    # sm_90: the sparse class runs an expert's last block of at most 16 rows with 16-row MMAs, the large class one
    # of at most 128 rows with 128-row MMAs, mid_wide (20b: 769-1024 tokens) one of at most 64; mid and prefill one
    # width
    assert [tiles(T)[g].TAIL_M for T in (64, 65, 256, 257, 768, 769, 2048, 4096) for g in (0, 1)] == (
        [0, 0, 16, 16, 16, 16, 0, 0, 0, 0, 64, 64, 128, 128, 128, 128] if target == SM90 else [0] * 16)
    with pytest.raises(ValueError, match="TAIL_M"):
        TileConfig(32, 64, 128, 4, 3, TAIL_M=32)
    with pytest.raises(ValueError, match="gemm"):
        class_config("prefill", 2880, 2880, target[0], "w2")
    with pytest.raises(ValueError):
        TileConfig(24, 64, 128, 4, 3)
    with pytest.raises(ValueError, match="GROUP_M"):
        TileConfig(16, 64, 128, 4, 3, GROUP_M=-1)


def test_shape_classes_follow_rows_per_expert():
    gpt_oss_20b, gpt_oss_120b, tiny = shape_classes(32, 4), shape_classes(128, 4), shape_classes(4, 2)
    assert gpt_oss_20b[-2:] == (("prefill", 4095), ("large", None))
    assert gpt_oss_120b[-2:] == (("prefill", 16383), ("large", None))
    # 512 rows per expert are reached by 1024 tokens: no prefill class between mid and large; 32 rows by 64
    # tokens: no sparse class either
    assert [name for name, _ in tiny] == ["gemv", "decode", "mid", "large"]
    # sparse (32-row tiles) after decode up to 32 rows per expert: 256 tokens for 20b, 1024 (all of mid) for 120b
    assert gpt_oss_20b[2:4] == (("sparse", 256), ("mid", 1024))
    assert [name for name, _ in gpt_oss_120b] == ["gemv", "decode", "sparse", "prefill", "large"]
    assert gpt_oss_120b[2] == ("sparse", 1024)
    # the Hopper bf16 path: mid up to 128 rows per expert (4096 tokens for 120b; 20b's 1024 unchanged), past 96 rows
    # per expert on 128-row tiles (mid_wide)
    hopper_120b = shape_classes(128, 4, PREFILL_ROWS_PER_EXPERT)
    assert hopper_120b[2:] == (("sparse", 1024), ("mid", 4096), ("prefill", 16383), ("large", None))
    assert shape_classes(32, 4, PREFILL_ROWS_PER_EXPERT) == gpt_oss_20b
    assert shape_classes(128, 4, PREFILL_ROWS_PER_EXPERT, MID_WIDE_ROWS_PER_EXPERT)[2:5] == (
        ("sparse", 1024), ("mid", 3072), ("mid_wide", 4096))
    assert shape_classes(32, 4, PREFILL_ROWS_PER_EXPERT, MID_WIDE_ROWS_PER_EXPERT)[3:5] == (("mid", 768),
                                                                                        ("mid_wide", 1024))
    assert shape_classes(4, 2, 0, MID_WIDE_ROWS_PER_EXPERT)[2:4] == (("mid", 192), ("mid_wide", 1024))
    # the tiled Hopper words: large from 160 rows per expert, and on layers of few experts mid's range ends at 128 rows
    # per expert (mixtral's 8 experts, top-2: 512 tokens) rather than at 1024 tokens
    hopper = (PREFILL_ROWS_PER_EXPERT, MID_WIDE_ROWS_PER_EXPERT, HOPPER_LARGE_ROWS_PER_EXPERT)
    assert shape_classes(32, 4, *hopper)[3:] == (("mid", 768), ("mid_wide", 1024), ("prefill", 1279), ("large", None))
    assert shape_classes(128, 4, *hopper)[4:] == (("mid_wide", 4096), ("prefill", 5119), ("large", None))
    assert shape_classes(8, 2, *hopper)[2:] == (("sparse", 128), ("mid", 384), ("mid_wide", 512), ("prefill", 639),
                                                ("large", None))
    bounds = [limit for _, limit in gpt_oss_20b[:-1]]
    assert bounds == sorted(bounds)
    with pytest.raises(ValueError, match="num_experts"):
        shape_classes(0, 4)


# ---------------------------------------------------------------- the whole forward

FORWARD_CASES = {
    # name: (T, E, k, H, I, target, options)
    # sm_90 (the tiled Hopper words): 64-row groups in 128-byte chunks along K. H = 96 leaves a 32-row last
    # group and K/2 = 48 one short chunk, K/2 = 80 a 80-byte last chunk (the general address); H = 256 /
    # I = 512 has whole groups and chunks in both GEMMs (the row + column address); the gemv class (1-4 tokens)
    # casts its own tiles and splits the w2 GEMM's K in two where each part keeps 4+ K steps of 256 (I = 2080: 9
    # steps, 5 + 4, the last one 32 deep); K (96, 160, 320) not a multiple of BLOCK_K; N = H = 96 not a multiple of
    # BLOCK_N = 64 (a half-empty last tile of whole 16-row groups)
    "t1_sm90": (1, 8, 2, 96, 160, SM90, dict()),
    "t2_sm90_split_k": (2, 8, 2, 96, 2080, SM90, dict()),
    "t3_sm90_k4_k_chunks": (3, 8, 4, 320, 160, SM90, dict()),
    "t4_sm90_whole_groups_and_chunks": (4, 8, 4, 256, 512, SM90, dict()),
    "t17_sm90_k4_silu_concat": (17, 8, 4, 96, 320, SM90, dict(activation="silu", interleaved=False)),
    "t9_sm90_k3_softmax_topk_renorm_nobias": (9, 8, 3, 96, 160, SM90, dict(
        routing="softmax_topk", renormalize=True, bias=False, router_bias=False)),
    "t5_sm90_fp32": (5, 8, 2, 64, 64, SM90, dict(dtype=torch.float32)),
    "t70_sm90_sparse": (70, 8, 2, 96, 160, SM90, dict()),
    "t200_sm90_mid_concat": (200, 8, 2, 64, 96, SM90, dict(interleaved=False)),
    # mid_wide: 128-row tiles on 8 warps, an expert's last block of <= 64 rows on 64-row MMAs (~125 rows per expert)
    "t500_sm90_mid_wide": (500, 8, 2, 96, 160, SM90, dict()),
    # 128-row tiles, 8 warps (~150 rows per expert); 256-row tiles in grouped launch order (25 row blocks: the last
    # group of 4 partial)
    "t600_sm90_prefill_nobias": (600, 8, 2, 320, 96, SM90, dict(bias=False)),
    "t1100_sm90_large_concat": (1100, 8, 4, 96, 96, SM90, dict(interleaved=False)),
    # the Hopper words in row order (sm_90 artifacts compiled before the tiles)
    "t1_sm90_rows": (1, 8, 2, 96, 160, SM90_ROWS, dict()),
    "t17_sm90_rows_k4_silu_concat": (17, 8, 4, 96, 160, SM90_ROWS, dict(activation="silu", interleaved=False)),
    # sm_100 (tl.dot_scaled on the checkpoint's order): gemv tiles (32 wide, 2 warps); TMA weight tiles from the
    # decode class on (w2's N = H = 160 not a multiple of BLOCK_N = 64: the last tile's rows run into the next
    # expert, masked; K = 96 past K/2 read as zero codes), the concatenated order falling back to plain loads;
    # mid's 256-wide N tiles and 8 warps; prefill and large as above
    "t1_sm100": (1, 8, 2, 64, 64, SM100, dict()),
    "t3_sm100_k4_silu_concat_nobias_softmax_renorm": (3, 8, 4, 96, 160, SM100, dict(
        activation="silu", interleaved=False, bias=False, routing="softmax_topk", renormalize=True)),
    "t17_sm100_k1": (17, 8, 1, 64, 96, SM100, dict()),
    "t17_sm100_softmax_topk": (17, 8, 2, 64, 96, SM100, dict(routing="softmax_topk")),
    "t7_sm100_tma": (7, 8, 4, 160, 96, SM100, dict()),
    "t7_sm100_concat_no_tma": (7, 8, 2, 96, 160, SM100, dict(interleaved=False)),
    "t64_sm100_k4_concat": (64, 8, 4, 64, 160, SM100, dict(interleaved=False)),
    "t5_sm100_fp32_silu": (5, 8, 2, 64, 64, SM100, dict(dtype=torch.float32, activation="silu")),
    "t200_sm100_mid": (200, 8, 2, 128, 160, SM100, dict()),
    "t1100_sm100_prefill": (1100, 8, 2, 64, 96, SM100, dict()),
    "t1100_sm100_large_nobias": (1100, 8, 4, 64, 96, SM100, dict(bias=False)),
}


def forward_case(name):
    """(spec, its weights, tokens, arch) of a case of :data:`FORWARD_CASES`."""
    T, E, k, H, I, target, opts = FORWARD_CASES[name]
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.bfloat16)
    spec = layer_spec(E, k, H, I, target, dtype=dtype, **opts)
    return spec, random_weights(spec, seed=T), tokens(T, H, dtype, seed=T), target[0]


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_forward_matches_reference(name, near_tie_tokens):
    spec, weights, x, arch = forward_case(name)
    ex = executor(spec, weights, arch)
    if name == "t2_sm90_split_k":
        assert ex.kernel_plan.shape_class(x.shape[0]).tiles["w2"]["SPLIT_K"] == 2
    check_forward(ex, spec, weights, x, near_tie_tokens)


def test_forward_with_a_large_scale_uses_the_wide_decode(near_tie_tokens):
    """A scale byte over 128 (weights past +-12) keeps the two-multiply decode, which stays exact."""
    spec, weights, x, arch = forward_case("t17_sm90_k4_silu_concat")
    weights["w13_scale"][3, 5, 1] = 132  # one 32-value block of expert 3's w13 row 5, 2^5 over 127
    ex = executor(spec, weights, arch)
    assert {e.constexprs["WIDE_SCALES"] for e in ex.kernel_plan.kernels.values() if "W_HOPPER" in e.constexprs} == {
        True}
    check_forward(ex, spec, weights, x, near_tie_tokens)


@pytest.mark.parametrize("target", [SM90, SM100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("T", [2, 20])
def test_forward_all_tokens_on_one_expert(T, top_k, target, near_tie_tokens):
    """Expert 5 takes every token (and slot 0); with k=1 seven experts are empty (2 tokens: the gemv class,
    whose fused cast still counts the empty row blocks)."""
    spec = layer_spec(8, top_k, 64, 96, target)
    weights = random_weights(spec, seed=3)
    weights["router_bias"][5] += 100.0
    x = tokens(T, 64, seed=3)
    assert bool((F.linear(x, weights["router_weight"], weights["router_bias"]).argmax(1) == 5).all())
    check_forward(executor(spec, weights, target[0]), spec, weights, x, near_tie_tokens)


@pytest.mark.parametrize("target", [SM90, SM100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("T", [9, 70])
def test_forward_with_unused_experts(T, target, near_tie_tokens):
    spec = layer_spec(8, 2, 64, 64, target)
    weights = random_weights(spec, seed=4)
    weights["router_bias"][1::2] -= 100.0  # odd experts never chosen
    check_forward(executor(spec, weights, target[0]), spec, weights, tokens(T, 64, seed=4), near_tie_tokens)


@pytest.mark.parametrize("name,tail", [("t70_sm90_sparse", 16), ("t200_sm90_mid_concat", 16),
                                       ("t500_sm90_mid_wide", 64), ("t200_sm90_mid_concat", 32),
                                       ("t600_sm90_prefill_nobias", 64),
                                       ("t1100_sm90_large_concat", 128)])
def test_tail_tiles_match_reference(name, tail, near_tie_tokens):
    """TAIL_M: both grouped GEMMs of the class run a row block holding at most ``tail`` rows with ``tail``-row MMAs.
    The router bias spreads the experts' row counts so that blocks of both kinds occur (checked)."""
    spec, weights, x, arch = forward_case(name)
    weights["router_bias"] += torch.linspace(-3, 3, spec.num_experts).to(weights["router_bias"].dtype)
    ex = executor(spec, weights, arch)
    T = x.shape[0]
    cls = ex.kernel_plan.shape_class(T)
    gemms = {lc.kernel for lc in cls.launches if ex.kernel_plan.kernels[lc.kernel].kernel in ("glu_gemm", "combine_gemm")}
    assert len(gemms) == 2
    block_m = {ex.kernel_plan.kernels[g].constexprs["BLOCK_M"] for g in gemms}.pop()
    _, ids = reference_route(router_logits(x, weights), spec.top_k, spec.routing, spec.renormalize)
    counts = torch.bincount(ids.flatten().long(), minlength=spec.num_experts)
    last_rows = [int(c) % block_m or block_m for c in counts if c > 0]  # rows of each expert's last block
    assert min(last_rows) <= tail < max(last_rows), (block_m, sorted(last_rows))
    plan = ex.kernel_plan.replace_constexprs({g: {"TAIL_M": tail} for g in gemms})
    check_forward(TritonExecutor(plan, ex.params, device=DEVICE, mode=MODE), spec, weights, x, near_tie_tokens)


def test_mid_wide_k_steps_of_128_match_reference(near_tie_tokens):
    """mid_wide's GEMMs with K steps of 128 (what its w2 GEMM runs on layers of I >= HOPPER_DEEP_K; this H = 96 / I =
    160 make the last step partly past K), with its 64-row tails: the large class's K step on mid_wide's 128-row
    tiles."""
    spec, weights, x, arch = forward_case("t500_sm90_mid_wide")
    ex = executor(spec, weights, arch)
    cls = ex.kernel_plan.shape_class(x.shape[0])
    assert cls.name == "mid_wide"
    gemms = [lc.kernel for lc in cls.launches
             if ex.kernel_plan.kernels[lc.kernel].kernel in ("glu_gemm", "combine_gemm")]
    assert {ex.kernel_plan.kernels[g].constexprs["BLOCK_K"] for g in gemms} == {64}
    plan = ex.kernel_plan.replace_constexprs({g: {"BLOCK_K": 128} for g in gemms})
    check_forward(TritonExecutor(plan, ex.params, device=DEVICE, mode=MODE), spec, weights, x, near_tie_tokens)


# ---------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("T", [1, 64, 200, 900, 1024, 4096])
def test_gpu_medium_shape(T, target, near_tie_tokens):
    """Three calls each: a miscompiled pipeline (Triton 3.6's mid_wide, tile_config.compile_stages) got a few rows
    wrong, different ones each call."""
    arch_layout = TARGETS[target]
    for opts in (dict(), dict(activation="silu", interleaved=False)):
        spec = layer_spec(32, 4, 512, 768, arch_layout, **opts)
        weights = random_weights(spec, seed=T)
        ex = executor(spec, weights, arch_layout[0])
        for _ in range(3):
            check_forward(ex, spec, weights, tokens(T, 512, seed=T), near_tie_tokens)


@pytest.mark.gpu
@gpu
def test_gpu_cubins_match_the_reference(near_tie_tokens):
    """The sm_90 plan's AOT cubins (this machine's Triton), loaded by the executor's driver path."""
    from mxmoe.kernels.triton.aot import compile_plan

    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor != 90:
        pytest.skip("the cubins are for sm_90")
    spec = layer_spec(32, 4, 512, 768, SM90)
    weights = random_weights(spec)
    params = stored(spec, weights)
    plan = fit_scale_range(plan_layer(spec, 90), params)
    binaries, meta = compile_plan(plan)
    ex = TritonExecutor(plan.to_dict() | {"cubins": meta}, params, binaries, mode="cubin")
    assert ex.mode == "cubin"
    for T in (1, 7, 64, 333, 1024):  # seeds whose 1 and 7 tokens have no near-tie (E = 32: ~10% of tokens do)
        check_forward(ex, spec, weights, tokens(T, 512, seed=T + 100), near_tie_tokens)


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@pytest.mark.parametrize("T", [1, 64, 1024])
@pytest.mark.parametrize("target", [SM90, SM100], ids=["sm90", "sm100"])
def test_gpu_gpt_oss_20b_shape(T, target, near_tie_tokens):
    spec = layer_spec(32, 4, 2880, 2880, target)
    weights = random_weights(spec, seed=T)
    check_forward(executor(spec, weights, target[0]), spec, weights, tokens(T, 2880, seed=T), near_tie_tokens)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("target", [SM90, SM100], ids=["sm90", "sm100"])
def test_gpu_top2_combine_is_bitwise_deterministic(target):
    """fp32 atomics from 0: a + b == b + a, so with k <= 2 the combine does not depend on order."""
    spec = layer_spec(32, 2, 512, 512, target)
    ex = executor(spec, random_weights(spec, seed=7), target[0])
    x = tokens(512, 512, seed=7).to(DEVICE)
    first = ex(x)
    assert all(torch.equal(first, ex(x)) for _ in range(5))
