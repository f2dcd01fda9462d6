"""mxmoe.kernels.triton against a plain-torch reference.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (``KernelLaunch.launch``
uses the interpreted twins of the kernels for CPU tensors, see ``mxmoe.kernels.triton.kernels``). With a
GPU the same small cases run compiled on CUDA, and the ``gpu`` tests add larger shapes.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without a GPU the launches run under Triton's interpreter: KernelLaunch.launch picks the
# interpreted twin of each kernel for CPU tensors (no TRITON_INTERPRET needed in this process).
from mxmoe.kernels.triton import (  # noqa: E402
    COL_MAJOR, HOPPER, HOPPER_TILED, LAYOUTS, ROW_MAJOR, TileConfig, choose_config, group_by_expert, moe_forward, route)
from mxmoe.kernels.triton.tile_config import shape_classes  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

if not HAS_CUDA:
    from triton.runtime.interpreter import InterpreterBuilder

    if not hasattr(InterpreterBuilder, "create_dot_scaled"):  # Triton < 3.7's interpreter
        pytestmark = pytest.mark.skip(reason="this Triton's interpreter has no tl.dot_scaled")

# ---------------------------------------------------------------- reference

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def dequantize(w, s):
    """[E, N, K/2] codes + [E, N, K/32] e8m0 -> [E, N, K] fp32 (low nibble = even k)."""
    codes = torch.stack([w & 0xF, w >> 4], -1).flatten(-2).long()
    return E2M1.to(w.device)[codes] * torch.exp2(s.float() - 127).repeat_interleave(32, -1)


def reference_route(logits, top_k, routing="topk_softmax", renormalize=False):
    logits = logits.float()
    if routing == "topk_softmax":
        top, ids = logits.topk(top_k, dim=1)
        return torch.softmax(top, dim=1), ids.int()
    top, ids = torch.softmax(logits, dim=1).topk(top_k, dim=1)
    if renormalize:
        top = top / top.sum(1, keepdim=True)
    return top, ids.int()


def reference_moe(x, logits, w13, s13, b13, w2, s2, b2, *, top_k, routing="topk_softmax",
                  renormalize=False, activation="swiglu_oai", alpha=1.702, limit=7.0, interleaved=True):
    """Gather each expert's tokens, run its MLP in fp32, scatter-add weighted outputs."""
    W13, W2 = dequantize(w13, s13), dequantize(w2, s2)
    intermediate = W13.shape[1] // 2
    weights, ids = reference_route(logits, top_k, routing, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(W13.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        h = x[t].float() @ W13[e].T + (b13[e] if b13 is not None else 0)
        gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :intermediate], h[:, intermediate:])
        if activation == "swiglu_oai":
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            a = (up + 1) * gate * torch.sigmoid(alpha * gate)
        else:
            a = up * gate * torch.sigmoid(gate)
        y = a.to(x.dtype).float() @ W2[e].T + (b2[e] if b2 is not None else 0)
        out.index_add_(0, t, weights[t, j, None] * y)
    return out.to(x.dtype)


def random_mxfp4(E, N, K, *, bias, gen, device=DEVICE):
    """Random codes with scales sized so that a K-long dot with N(0,1) inputs is O(1)."""
    w = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    center = 127 - round(0.5 * math.log2(K * 8.6))  # 8.6 = mean square of the e2m1 values
    s = torch.randint(center - 1, center + 2, (E, N, K // 32), generator=gen).to(torch.uint8)
    b = 0.5 * torch.randn(E, N, generator=gen) if bias else None
    return w.to(device), s.to(device), (b.to(device) if bias else None)


def make_layer(T, E, H, I, *, bias=True, dtype=torch.bfloat16, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    logits = torch.randn(T, E, generator=gen)
    w13, s13, b13 = random_mxfp4(E, 2 * I, H, bias=bias, gen=gen, device=device)
    w2, s2, b2 = random_mxfp4(E, H, I, bias=bias, gen=gen, device=device)
    return x.to(device), logits.to(device), (w13, s13, b13, w2, s2, b2)


def run_and_compare(x, logits, weights, *, layout=ROW_MAJOR, config=None, wide_scales=True, **kw):
    w13, s13, b13, w2, s2, b2 = weights
    w13_l, s13_l = layout.swizzle(w13, s13)
    w2_l, s2_l = layout.swizzle(w2, s2)
    out = moe_forward(x, logits, w13_l, s13_l, b13, w2_l, s2_l, b2, layout=layout, config=config,
                      wide_scales=wide_scales, **kw)
    ref = reference_moe(x, logits, *weights, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return out


# ---------------------------------------------------------------- routing and grouping

@pytest.mark.parametrize("routing,renormalize", [("topk_softmax", False), ("softmax_topk", False),
                                                 ("softmax_topk", True)])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens,num_experts", [(1, 8), (17, 8), (70, 32), (5, 6)])
def test_route_matches_torch_topk(routing, renormalize, top_k, num_tokens, num_experts):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(top_k))
    weights, ids = route(logits.to(DEVICE), top_k, routing, renormalize)
    ref_weights, ref_ids = reference_route(logits, top_k, routing, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)


def test_route_breaks_ties_towards_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    weights, ids = route(logits, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_group_by_expert(case, block_m):
    E, T, k = 8, 37, 2
    gen = torch.Generator().manual_seed(1)
    if case == "random":
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    elif case == "empty_experts":
        ids = torch.stack([torch.randperm(3, generator=gen)[:k] * 2 for _ in range(T)])  # 0, 2, 4
    else:
        ids = torch.full((T, 1), 5)
    groups = group_by_expert(ids.int().to(DEVICE), E, block_m)
    flat = ids.flatten()
    sorted_pairs = groups.sorted_pairs.cpu()
    offsets = groups.expert_offsets.cpu()
    assert torch.equal(sorted_pairs, torch.argsort(flat, stable=True).int())
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(offsets, torch.cat([torch.zeros(1), counts.cumsum(0)]).int())
    # Every sorted row is covered by exactly one block of its own expert.
    covered = torch.zeros(flat.numel(), dtype=torch.int32)
    for e, start in zip(groups.block_expert.tolist(), groups.block_start.tolist()):
        if e < 0:
            continue
        rows = torch.arange(start, min(start + block_m, int(offsets[e + 1])))
        assert int(offsets[e]) <= start < int(offsets[e + 1])
        assert bool((flat[sorted_pairs[rows].long()] == e).all())
        covered[rows] += 1
    assert bool((covered == 1).all())
    assert sum(-(-int(c) // block_m) for c in counts) == int((groups.block_expert >= 0).sum())


def test_route_and_group_kernel_of_earlier_plans():
    """gemv plans compiled before the router was folded into their routing launch name ``route_and_group``
    (their JIT fallback runs it): it still routes like ``route`` and groups like ``group_by_expert``."""
    from mxmoe.kernels.triton._launch import KernelLaunch
    from mxmoe.kernels.triton._routing_kernel import route_and_group_kernel

    T, E, k, block_m = 3, 8, 2, 16
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    partials = torch.full((1, T, 16), -1.0, device=DEVICE)
    partials[0, :, :E] = logits
    nb = T * k // block_m + min(E, T * k)
    out = dict(weights_ptr=torch.empty(T, k, device=DEVICE),
               ids_ptr=torch.empty(T, k, dtype=torch.int32, device=DEVICE),
               sorted_pairs_ptr=torch.empty(T * k, dtype=torch.int32, device=DEVICE),
               expert_offsets_ptr=torch.empty(E + 1, dtype=torch.int32, device=DEVICE),
               block_expert_ptr=torch.empty(nb, dtype=torch.int32, device=DEVICE),
               block_start_ptr=torch.empty(nb, dtype=torch.int32, device=DEVICE))
    KernelLaunch("route_and_group", route_and_group_kernel, (1,), dict(
        partial_ptr=partials, b_ptr=torch.empty(0, device=DEVICE), weights_ptr=out["weights_ptr"],
        ids_ptr=out["ids_ptr"], num_tokens=T, sorted_pairs_ptr=out["sorted_pairs_ptr"],
        expert_offsets_ptr=out["expert_offsets_ptr"], block_expert_ptr=out["block_expert_ptr"],
        block_start_ptr=out["block_start_ptr"], num_blocks=nb),
        dict(NUM_EXPERTS=E, TOP_K=k, EXPERTS_POW2=16, SLOTS_POW2=2, SPLITS=1, HAS_BIAS=False, ROUND_LOGITS_BF16=False,
             BLOCK_T=4, SOFTMAX_OVER_ALL=False, GROUP_EXPERTS_POW2=8, BLOCK_M=block_m, CHUNK=16),
        num_warps=4, num_stages=1).launch()
    weights, ids = route(logits, k)
    assert torch.equal(out["ids_ptr"].cpu(), ids.int().cpu())
    torch.testing.assert_close(out["weights_ptr"].cpu(), weights.float().cpu())
    groups = group_by_expert(ids.int(), E, block_m)
    for name in ("sorted_pairs", "expert_offsets", "block_expert", "block_start"):
        assert torch.equal(out[f"{name}_ptr"].cpu(), getattr(groups, name).cpu()), name


@pytest.mark.parametrize("T,E,k,case", [(1, 8, 2, "random"), (4, 128, 4, "random"), (16, 8, 4, "random"),
                                         (17, 32, 4, "random"), (40, 128, 4, "random"), (64, 32, 4, "random"),
                                         (64, 128, 4, "random"), (33, 8, 1, "random"), (40, 16, 3, "odd_off"),
                                         (50, 8, 2, "one")])
@pytest.mark.parametrize("scatter", [True, False])
def test_few_token_router_launch_routes_and_groups_like_route_and_group_by_expert(T, E, k, case, scatter):
    """The few-token router launch: router, top-k routing per 16-token block, and the grouping (scattered
    from per-block counts: ``router_route_scatter``; sorted in the last block routed: ``router_route_group``)
    give the ids of ``route`` and exactly the groups and block map of ``group_by_expert``. Integer x and
    router weights plus a bias of e/1024 keep every logit exact and distinct (no near-ties)."""
    import triton

    from mxmoe.kernels.triton._launch import KernelLaunch
    from mxmoe.kernels.triton._routing_kernel import router_route_group_kernel, router_route_scatter_kernel

    H, block_m, split, gen = 256, 16, 64, torch.Generator().manual_seed(T * E + k)
    x = torch.randint(-3, 4, (T, H), generator=gen).float()
    w = torch.randint(-3, 4, (E, H), generator=gen).float()
    bias = torch.arange(E).float() / 1024
    if case == "odd_off":
        bias[1::2] -= 4096.0  # odd experts never chosen
    elif case == "one":
        bias[5] += 4096.0  # expert 5 takes every token
    max_tokens, blocks = 4 if T <= 4 else 64, -(-T // 16)
    router_pow2, pow2 = max(16, triton.next_power_of_2(E)), triton.next_power_of_2(E)
    nb = T * k // block_m + min(E, T * k)
    out = dict(weights_ptr=torch.empty(T, k), ids_ptr=torch.empty(T, k, dtype=torch.int32),
               sorted_pairs_ptr=torch.empty(T * k, dtype=torch.int32),
               expert_offsets_ptr=torch.empty(E + 1, dtype=torch.int32),
               block_expert_ptr=torch.empty(nb, dtype=torch.int32), block_start_ptr=torch.empty(nb, dtype=torch.int32))
    out = {name: t.to(DEVICE) for name, t in out.items()}
    args = dict(x_ptr=x.to(DEVICE), w_ptr=w.to(DEVICE),
                partial_ptr=torch.empty(H // split, T, router_pow2, device=DEVICE), num_tokens=T,
                b_ptr=bias.to(DEVICE), weights_ptr=out["weights_ptr"], ids_ptr=out["ids_ptr"],
                sorted_pairs_ptr=out["sorted_pairs_ptr"], expert_offsets_ptr=out["expert_offsets_ptr"],
                block_expert_ptr=out["block_expert_ptr"], block_start_ptr=out["block_start_ptr"], num_blocks=nb,
                counter_ptr=torch.zeros(blocks + 1, dtype=torch.int32, device=DEVICE),
                block_counts_ptr=torch.full((blocks, pow2), -7, dtype=torch.int32, device=DEVICE),
                ranks_ptr=torch.full((T * k,), -7, dtype=torch.int32, device=DEVICE))
    consts = dict(
        HIDDEN=H, NUM_EXPERTS=E, EXPERTS_POW2=router_pow2, H_PER_SPLIT=split, IEEE_FP32=True, ROUTER_BLOCK_T=16,
        BLOCK_H=split, TOP_K=k, SLOTS_POW2=triton.next_power_of_2(k), SPLITS=H // split, HAS_BIAS=True,
        ROUND_LOGITS_BF16=False, BLOCK_T=min(16, triton.next_power_of_2(max_tokens)), SOFTMAX_OVER_ALL=False,
        GROUP_EXPERTS_POW2=pow2, BLOCK_M=block_m)
    if scatter:
        kernel = router_route_scatter_kernel
        consts.update(TOKEN_BLOCKS_POW2=triton.next_power_of_2(-(-max_tokens // 16)),
                      LANES=min(1024, triton.next_power_of_2(max_tokens * k)))
    else:
        kernel = router_route_group_kernel
        consts.update(CHUNK=32)
        del args["block_counts_ptr"], args["ranks_ptr"]
    KernelLaunch("router_route", kernel, (blocks, H // split), args, consts, num_warps=8 if E >= 128 else 4,
                 num_stages=2).launch()
    weights, ids = reference_route(x @ w.t() + bias, k)
    assert torch.equal(out["ids_ptr"].cpu(), ids)
    torch.testing.assert_close(out["weights_ptr"].cpu(), weights, atol=1e-6, rtol=1e-5)
    if case == "one":
        assert bool((ids[:, 0] == 5).all())
    groups = group_by_expert(ids.to(DEVICE), E, block_m)
    for name in ("sorted_pairs", "expert_offsets", "block_expert", "block_start"):
        assert torch.equal(out[f"{name}_ptr"].cpu(), getattr(groups, name).cpu()), name


# ---------------------------------------------------------------- layout and configs

@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_layout_round_trip(layout):
    gen = torch.Generator().manual_seed(2)
    w, s, _ = random_mxfp4(3, 48, 96, bias=False, gen=gen, device="cpu")
    w2, s2 = layout.swizzle(w, s)
    assert w2.is_contiguous() and s2.is_contiguous()
    assert layout.logical_shape(w2) == (3, 48, 96)
    back_w, back_s = layout.unswizzle(w2, s2)
    assert torch.equal(back_w, w) and torch.equal(back_s, s)


@pytest.mark.parametrize("arch", [90, 100])
def test_choose_config_classes(arch):
    def cfg(T, N, K, gemm="glu", k=4, E=32):
        return choose_config(T, k, N, K, arch, gemm, num_experts=E)

    decode = cfg(1, 5760, 2880)
    prefill = cfg(2048, 5760, 2880)
    assert decode.BLOCK_M == 16 and prefill.BLOCK_M >= 64
    assert cfg(4, 5760, 2880).BLOCK_N < cfg(5, 5760, 2880).BLOCK_N
    for T in (1, 4, 5, 64, 65, 256, 257, 1024, 2048, 4096, 16384):  # both GEMMs of one forward must share BLOCK_M
        assert cfg(T, 5760, 2880).BLOCK_M == cfg(T, 2880, 2880, "combine").BLOCK_M
    if arch == 90:  # prefill's warp count is per GEMM (measured on the H100, docs/nvidia.md)
        assert cfg(2048, 5760, 2880, "glu").num_warps == 8
        assert cfg(2048, 2880, 2880, "combine").num_warps == 4
    # "large" (256-row tiles, grouped launch order) from 512 rows per expert: T*k/E >= 512
    assert cfg(4095, 5760, 2880).BLOCK_M == 128 and cfg(4095, 5760, 2880).GROUP_M == 0
    assert cfg(256, 5760, 2880).BLOCK_M == 32 and cfg(257, 5760, 2880).BLOCK_M == 64
    assert cfg(1024, 5760, 2880, E=128).BLOCK_M == 32
    large = cfg(4096, 5760, 2880)
    assert (large.BLOCK_M, large.GROUP_M) == (256, 4)
    assert cfg(4096, 5760, 2880, E=128).BLOCK_M == 128 and cfg(16384, 5760, 2880, E=128).BLOCK_M == 256
    with pytest.raises(ValueError, match="gemm"):
        cfg(4096, 2880, 2880, "w2")
    assert choose_config(1, 2, 64, 96, arch, num_experts=8).BLOCK_N == 32
    assert choose_config(2000, 2, 64, 96, arch, num_experts=8).BLOCK_N == 64  # clamped to the (tiny) N
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
    bounds = [limit for _, limit in gpt_oss_20b[:-1]]
    assert bounds == sorted(bounds)
    with pytest.raises(ValueError, match="num_experts"):
        shape_classes(0, 4)


# ---------------------------------------------------------------- the whole forward

PREFILL = TileConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)
TMA = TileConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2, W_TMA=True)
#: grouped launch order; 3 does not divide the number of row blocks, so the last group is partial
GROUPED = TileConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2, GROUP_M=3)
GROUPED_TMA = TileConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2, W_TMA=True, GROUP_M=2)
#: the w2 GEMM's K in three ranges (the Hopper path; other layouts ignore SPLIT_K)
SPLIT3 = TileConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2, SPLIT_K=3)

FORWARD_CASES = {
    # name: (T, E, k, H, I, options)
    "decode_t1": (1, 8, 2, 64, 64, dict()),
    "t3_k4_silu_concat_nobias_colmajor": (3, 8, 4, 96, 160, dict(
        activation="silu", interleaved=False, bias=False, layout=COL_MAJOR, routing="softmax_topk",
        renormalize=True)),
    "t17_k1": (17, 8, 1, 64, 96, dict()),
    "t17_softmax_topk": (17, 8, 2, 64, 96, dict(routing="softmax_topk", layout=COL_MAJOR)),
    "t64_k4_concat": (64, 8, 4, 64, 160, dict(interleaved=False)),
    "t64_prefill_tiles_colmajor": (64, 8, 2, 96, 96, dict(config=PREFILL, layout=COL_MAJOR)),
    "fp32_activations": (5, 8, 2, 64, 64, dict(dtype=torch.float32, activation="silu")),
    # TMA weight tiles: w2's N = H = 160 is not a multiple of BLOCK_N = 64 (the last tile's rows run into
    # the next expert, masked), neither K (160, 96) of BLOCK_K = 64 (the last tile reads zero codes).
    "t7_tma": (7, 8, 4, 160, 96, dict(config=TMA)),
    "t7_tma_concat_falls_back": (7, 8, 2, 96, 160, dict(config=TMA, interleaved=False)),
    "t40_grouped_launch_order": (40, 8, 2, 96, 96, dict(config=GROUPED)),
    "t40_grouped_launch_order_tma": (40, 8, 2, 96, 160, dict(config=GROUPED_TMA)),
    "t40_grouped_launch_order_colmajor": (40, 8, 4, 64, 96, dict(config=GROUPED, layout=COL_MAJOR)),
    # The Hopper decode layout (sm_90's): its own tiles per class, K (96, 160) not a multiple of BLOCK_K,
    # N = H = 96 not a multiple of BLOCK_N = 64 (a half-empty last tile of whole 16-row groups), the
    # concatenated gate/up order ([gate | up] tile halves), one token, the prefill and large tiles, fp32.
    "t1_hopper": (1, 8, 2, 96, 160, dict(layout=HOPPER)),
    "t17_hopper_k4_silu_concat": (17, 8, 4, 96, 160, dict(layout=HOPPER, activation="silu", interleaved=False)),
    "t64_hopper_prefill_tiles_nobias": (64, 8, 2, 64, 96, dict(layout=HOPPER, bias=False, config=TileConfig(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4))),
    "t40_hopper_grouped_launch_order_concat": (40, 8, 2, 96, 96, dict(layout=HOPPER, interleaved=False, config=GROUPED)),
    "t5_hopper_fp32_one_multiply": (5, 8, 2, 64, 64, dict(layout=HOPPER, dtype=torch.float32, wide_scales=False)),
    # TMA weight tiles on the Hopper path: N = H = 160 not a multiple of BLOCK_N = 64 (rows of the next
    # expert land in masked columns), K (160, 96) not of BLOCK_K = 64; the concatenated order falls back
    "t7_hopper_tma": (7, 8, 4, 160, 96, dict(layout=HOPPER, config=TMA)),
    "t7_hopper_tma_concat_falls_back": (7, 8, 2, 96, 160, dict(layout=HOPPER, config=TMA, interleaved=False)),
    # The tiled Hopper order (sm_90's since 2026-11-24): 64-row groups in 128-byte chunks along K. H = 96 leaves
    # a 32-row last group and K/2 = 48 one short chunk, K/2 = 160 a 32-byte last chunk (the general
    # address); H = 256 / I = 512 has whole groups and chunks in both GEMMs (the row + column address); the
    # gemv class splits the w2 GEMM's K in two, SPLIT3 in three (one 64-deep step each); a TMA config falls
    # back to plain loads (TMA reads rows); the prefill tile reads 32 bytes a row per step.
    "t1_hopper_tiled": (1, 8, 2, 96, 160, dict(layout=HOPPER_TILED)),
    "t3_hopper_tiled_k4_k_chunks": (3, 8, 4, 320, 160, dict(layout=HOPPER_TILED)),
    "t4_hopper_tiled_whole_groups_and_chunks": (4, 8, 4, 256, 512, dict(layout=HOPPER_TILED)),
    "t17_hopper_tiled_silu_concat": (17, 8, 4, 96, 320, dict(layout=HOPPER_TILED, activation="silu",
                                                             interleaved=False)),
    "t9_hopper_tiled_split3": (9, 8, 2, 96, 160, dict(layout=HOPPER_TILED, config=SPLIT3)),
    "t7_hopper_tiled_tma_falls_back": (7, 8, 4, 160, 96, dict(layout=HOPPER_TILED, config=TMA)),
    "t64_hopper_tiled_prefill_tiles": (64, 8, 2, 320, 96, dict(layout=HOPPER_TILED, config=TileConfig(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4))),
}


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_moe_forward_matches_reference(name):
    T, E, k, H, I, opts = FORWARD_CASES[name]
    opts = dict(opts)
    x, logits, weights = make_layer(T, E, H, I, bias=opts.pop("bias", True),
                                    dtype=opts.pop("dtype", torch.bfloat16), seed=T)
    run_and_compare(x, logits, weights, top_k=k, **opts)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_forward_all_tokens_on_one_expert(top_k):
    x, logits, weights = make_layer(20, 8, 64, 96, seed=3)
    logits[:, 5] += 100.0  # expert 5 takes every token (and slot 0); with k=1 seven experts are empty
    run_and_compare(x, logits, weights, top_k=top_k)


def test_moe_forward_with_unused_experts():
    x, logits, weights = make_layer(9, 8, 64, 64, seed=4)
    logits[:, 1::2] -= 100.0  # odd experts never chosen
    run_and_compare(x, logits, weights, top_k=2, layout=COL_MAJOR, config=PREFILL)


@pytest.mark.parametrize("wide_scales", [True, False])
def test_hopper_decode_every_code_and_scale(wide_scales):
    """The GEMMs' decode of the Hopper layout, value by value against the e2m1 x e8m0 definition: all 256
    bytes under every scale byte it promises to cover (the one-multiply form: 0..128; the two-multiply
    form: all, 255 giving NaN). Runs the inline-PTX decode on a GPU, its fp32 twin in the interpreter."""
    from mxmoe.kernels.triton.grouped_gemm import hopper_decode

    scales = torch.arange(0, 129 if not wide_scales else 256)
    n, k = 16 * len(scales), 512  # each 16-row group has one scale byte; every row holds all 256 bytes
    w = torch.arange(256, dtype=torch.uint8).repeat(n, k // 512)
    w = w[:, torch.randperm(k // 2, generator=torch.Generator().manual_seed(0))]
    s = scales.repeat_interleave(16)[:, None].expand(n, k // 32).to(torch.uint8).contiguous()
    stored = HOPPER.swizzle(w[None], s[None])[0][0]
    got = hopper_decode(stored.to(DEVICE), s.to(DEVICE), wide_scales=wide_scales).float().cpu()
    want = dequantize(w[None], s[None])[0]
    want[s.repeat_interleave(32, -1) == 255] = float("nan")  # e8m0 0xFF is NaN
    finite = torch.isfinite(want)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[finite], want[finite].bfloat16().float())  # bit-exact (every value is a bf16)
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_hopper_layout_needs_whole_row_groups():
    from mxmoe.kernels.triton.grouped_gemm import hopper_decode

    w = torch.zeros(1, 24, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="N a multiple of 16"):
        HOPPER.swizzle(w, torch.zeros(1, 24, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected uint8 values \[N, K/2\] and scales \[N, K/32\]"):
        hopper_decode(w[0], torch.zeros(24, 3, dtype=torch.uint8))


# ---------------------------------------------------------------- ahead-of-time compilation

AOT_SCRIPT = textwrap.dedent("""
    import json, sys
    from mxmoe.kernels.triton import aot_compile
    sizes = {arch: {name: len(cubin) for name, cubin in aot_compile(
                 arch, num_experts=8, top_k=2, hidden=64, intermediate=96).items()}
             for arch in (90, 100)}
    print(json.dumps(sizes))
""")


def test_aot_compile_gives_a_cubin_per_kernel():
    """Runs in a subprocess: AOT needs real (not interpreted) kernels. ~15 s on 2 cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in ("90", "100"):
        assert set(sizes[arch]) == {"route", "group_by_expert", "glu_gemm", "combine_gemm", "cast"}
        assert all(n > 0 for n in sizes[arch].values()), sizes


# ---------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", [ROW_MAJOR, COL_MAJOR, HOPPER, HOPPER_TILED], ids=lambda lt: lt.name)
@pytest.mark.parametrize("T", [1, 64, 1024, 4096])
def test_gpu_medium_shape(T, layout):
    x, logits, weights = make_layer(T, 32, 512, 768, seed=T)
    run_and_compare(x, logits, weights, top_k=4, layout=layout)
    run_and_compare(x, logits, weights, top_k=4, layout=layout, activation="silu", interleaved=False)


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_gpu_gpt_oss_20b_shape(T):
    x, logits, weights = make_layer(T, 32, 2880, 2880, seed=T)
    run_and_compare(x, logits, weights, top_k=4)
    run_and_compare(x, logits, weights, top_k=4, layout=HOPPER, wide_scales=False)
    run_and_compare(x, logits, weights, top_k=4, layout=HOPPER_TILED, wide_scales=False)


@pytest.mark.gpu
@gpu
def test_gpu_top2_combine_is_bitwise_deterministic():
    """fp32 atomics from 0: a + b == b + a, so with k <= 2 the combine does not depend on order."""
    x, logits, weights = make_layer(512, 32, 512, 512, seed=7)
    first = moe_forward(x, logits, *weights, top_k=2)
    assert all(torch.equal(first, moe_forward(x, logits, *weights, top_k=2)) for _ in range(5))
