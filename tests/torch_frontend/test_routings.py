"""The routings and activations of the common MoE families (docs/routing.md): DeepSeek-V3's sigmoid scores with a
correction bias, group-limited choice and a scaling factor ("sigmoid_topk", with the router in fp32); Llama-4's top-1
with its sigmoid weight on the input ("topk_sigmoid"); a scaling factor on the softmax routings; the GELU and clamped
SiLU GLUs. Each is checked against transformers' own router where it has one, between the torch and numpy
references, and compiled on the cpu target (its blocksplit layout and the row-major one) against the reference at
awkward shapes (12 experts in groups of 3, H 96, I 160; 1, 5 and 37 tokens).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mxmoe
from mxmoe.compiler.targets import get_target
from mxmoe.core.config import MoEConfig
from mxmoe.core.layouts import ROW_MAJOR
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.core.weights import MoEWeights
from mxmoe.torch_frontend import MoE, ops

BF16 = ml_dtypes.bfloat16
TARGETS = {"cpu": "cpu", "cpu-rowmajor": get_target("cpu").replace(layout=ROW_MAJOR)}
TOL = 2e-2

#: layers of each routing (awkward shapes: 12 experts, H 96, I 160)
ROUTING_CASES = {
    "deepseek-v3": dict(routing="sigmoid_topk", top_k=3, n_group=4, topk_group=2, score_bias=True, renormalize=True,
                        routed_scaling_factor=2.5, router_fp32=True, router_bias=False),
    "sigmoid-plain": dict(routing="sigmoid_topk", top_k=2, router_fp32=True, router_bias=False),
    "sigmoid-bf16-router": dict(routing="sigmoid_topk", top_k=3, n_group=3, topk_group=2, score_bias=True),
    "llama-4": dict(routing="topk_sigmoid", top_k=1, apply_router_weight_on_input=True, router_bias=False),
    "scaled-softmax": dict(routing="softmax_topk", top_k=2, renormalize=True, routed_scaling_factor=1.75),
}
ACTIVATION_CASES = {
    "gelu": dict(activation="gelu"),
    "gelu-tanh": dict(activation="gelu_tanh", interleaved=True),
    "silu-clamped": dict(activation="silu_clamped", swiglu_limit=0.75),
}


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=12, top_k=2, hidden=96, intermediate=160, activation="silu", interleaved=False, bias=False)
    base.update(kw)
    return MoEConfig(**base)


def _x(t: int, h: int = 96, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _sorted_by_id(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


# ------------------------------------------------------------------------------ against transformers' routers
@pytest.mark.parametrize("n_group, topk_group, norm", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_sigmoid_topk_is_deepseek_v3s_router(n_group, topk_group, norm):
    """Same experts and weights as ``DeepseekV3TopkRouter`` on fp32 logits without near ties (HF's topk order is
    unspecified: compared as sets)."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=6, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 64, generator=g) / 8)
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.05)
    x = torch.randn(50, 64, generator=g)
    logits, hf_w, hf_ids = router(x)
    w, ids = ops.route(logits, 6, "sigmoid_topk", norm, router.e_score_correction_bias, n_group, topk_group, 2.5)
    hw, hi = _sorted_by_id(hf_w, hf_ids)
    mw, mi = _sorted_by_id(w, ids.long())
    assert torch.equal(hi, mi)
    torch.testing.assert_close(mw, hw, rtol=1e-6, atol=1e-7)


def test_topk_sigmoid_is_llama4s_router():
    """``Llama4Router``: top-1 of the logits, weight sigmoid(logit) (HF rounds it to the logits' dtype, as the
    token scaling on input does here)."""
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    router = Llama4Router(Llama4TextConfig(hidden_size=64, num_local_experts=16, num_experts_per_tok=1))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 64, generator=g) / 8)
    x = torch.randn(40, 64, generator=g).bfloat16()
    router = router.bfloat16()
    scores, logits = router(x)
    w, ids = ops.route(logits, 1, "topk_sigmoid", False)
    hf_ids = scores.float().argmax(-1)
    assert torch.equal(ids[:, 0].long(), hf_ids)
    assert torch.equal(w[:, 0].bfloat16(), scores.gather(1, hf_ids[:, None])[:, 0])


# ------------------------------------------------------------------------------ ties and groups
def test_sigmoid_topk_ties_go_to_the_lower_index_of_experts_and_groups():
    """Equal choice values pick the lower expert; equal group scores pick the lower group."""
    logits = torch.zeros(3, 8)
    # token 0: experts 1 and 6 tie for the second place (after 3)
    logits[0] = torch.tensor([-4.0, 1.0, -4.0, 3.0, -4.0, -4.0, 1.0, -4.0])
    # token 1: groups {0,1} and {4,5} tie (same two values), group {2,3} is best: topk_group 2 -> groups 1 and 0
    logits[1] = torch.tensor([2.0, 1.0, 5.0, 4.0, 1.0, 2.0, -3.0, -3.0])
    # token 2: all equal: the first experts of the first groups
    w, ids = ops.route(logits, 2, "sigmoid_topk", False, None, 4, 2, 1.0)
    assert ids[0].tolist() == [3, 1]
    assert ids[1].tolist() == [2, 3]
    assert ids[2].tolist() == [0, 1]
    _, ids3 = ops.route(logits[1:2], 4, "sigmoid_topk", False, None, 4, 2, 1.0)
    assert ids3[0].tolist() == [2, 3, 0, 1]             # group {4,5} lost the tie to group {0,1}
    np_w, np_ids = __import__("mxmoe.core.reference", fromlist=["route"]).route(
        logits.numpy(), _cfg(num_experts=8, routing="sigmoid_topk", n_group=4, topk_group=2))
    assert np.array_equal(np_ids, ids.numpy()) and np.array_equal(np_w, w.numpy())


@pytest.fixture(scope="module")
def tie_layers():
    """Layers whose experts compute very different things, for the exact-tie logits above (monolithic entry)."""
    cfg = _cfg(num_experts=8, top_k=2, routing="sigmoid_topk", n_group=4, topk_group=2, router_fp32=True,
               router=False, router_bias=False)
    layer = MoE.random(cfg, seed=5)
    return layer, {name: mxmoe.compile(layer, target=t, entries=["monolithic"]) for name, t in TARGETS.items()}


@pytest.mark.parametrize("target", list(TARGETS))
def test_compiled_sigmoid_topk_breaks_ties_like_the_reference(tie_layers, target):
    layer, compiled = tie_layers
    base = torch.tensor([[-4.0, 1.0, -4.0, 3.0, -4.0, -4.0, 1.0, -4.0], [2.0, 1.0, 5.0, 4.0, 1.0, 2.0, -3.0, -3.0],
                         [0.0] * 8])
    logits = base.repeat(7, 1)[:19]
    x = _x(19, seed=3)
    out = compiled[target](x, logits)
    ref = layer.monolithic(x, logits)
    assert relative_error(out.float().numpy(), ref.float().numpy()) <= TOL


# ------------------------------------------------------------------------------ references
@pytest.mark.parametrize("case", list(ROUTING_CASES) + list(ACTIVATION_CASES))
def test_the_torch_reference_is_the_numpy_reference(case):
    kw = {**ROUTING_CASES.get(case, {}), **ACTIVATION_CASES.get(case, {})}
    layer = MoE.random(_cfg(**kw), seed=2)
    x = _x(23, seed=4)
    out, ref = layer(x).float().numpy(), numpy_reference(layer.to_weights(), x.float().numpy(), BF16)
    if case in ROUTING_CASES:
        assert np.array_equal(out, ref)
    else:  # numpy's exp/erf/tanh differ from torch's in the last f32 bit now and then: one bf16 step at most
        assert relative_error(out, ref) <= 2 ** -7


def test_score_bias_is_held_in_fp32():
    layer = MoE.random(_cfg(routing="sigmoid_topk", score_bias=True), seed=0)
    bias = layer.score_bias.clone()
    layer = layer.to(torch.float16)
    assert layer.score_bias.dtype == torch.float32 and torch.equal(layer.score_bias, bias)
    assert layer.dtype == torch.float16


# ------------------------------------------------------------------------------ compiled
@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return request.param


@pytest.fixture(scope="module", params=list(ROUTING_CASES))
def routed(request, target):
    layer = MoE.random(_cfg(**ROUTING_CASES[request.param]), seed=7)
    return request.param, layer, mxmoe.compile(layer, target=TARGETS[target], entries=["layer", "monolithic"])


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_compiled_routings_match_the_reference(routed, tokens, near_tie_tokens):
    name, layer, cm = routed
    cfg = layer.config
    x = _x(tokens, seed=tokens)
    logits = torch.randn(tokens, cfg.experts_routed, generator=torch.Generator().manual_seed(tokens))
    logits = logits.to(torch.float32 if cfg.router_fp32 else torch.bfloat16)
    out, ref = cm.entry("monolithic")(x, logits), layer.monolithic(x, logits)
    assert relative_error(out.float().numpy(), ref.float().numpy()) <= TOL, "monolithic"
    out, ref = cm(x).float(), layer(x).float()
    # the compiled router sums in its own order: where two experts' logits are within an ulp the pick may differ
    router_logits = (F.linear(x.float(), layer.router_weight.float()) if cfg.router_fp32
                     else F.linear(x, layer.router_weight, layer.router_bias))
    keep = ~near_tie_tokens(router_logits, cfg.top_k) if cfg.routing == "topk_sigmoid" else torch.ones(tokens, dtype=bool)
    if not cfg.router_fp32 and cfg.routing == "sigmoid_topk":
        # a bf16 logit one ulp off moves its sigmoid score, and with a bias any pair of experts may compete
        srt = router_logits.float().sort(dim=-1).values
        ulp = torch.exp2(torch.floor(torch.log2(srt.abs().clamp_min(1e-30))) - 7)
        keep &= ~((srt[:, 1:] - srt[:, :-1]) <= 2 * ulp[:, 1:]).any(dim=-1)
    if keep.any():
        assert relative_error(out[keep].numpy(), ref[keep].numpy()) <= TOL, f"layer ({name})"


@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
def test_compiled_activations_match_the_reference(case, target):
    layer = MoE.random(_cfg(**ACTIVATION_CASES[case]), seed=8)
    cm = mxmoe.compile(layer, target=TARGETS[target], entries=["monolithic"])
    for tokens in (1, 6, 37):
        x = _x(tokens, seed=tokens)
        logits = _x(tokens, 12, seed=50 + tokens)
        err = relative_error(cm(x, logits).float().numpy(), layer.monolithic(x, logits).float().numpy())
        assert err <= TOL, (case, tokens, err)


@pytest.mark.parametrize("routing, kw", [("topk_softmax", {}), ("softmax_topk", {}),
                                         ("sigmoid_topk", {"renormalize": True}), ("topk_sigmoid", {})])
def test_a_layer_of_one_expert(routing, kw, target):
    """E = 1 (a dense MLP as an MoE layer): every routing picks that expert. The lowering emits no arg-max for it:
    IREE's arg-max microkernel failed to lower a reduction of one (iree-compile errored on every such layer)."""
    layer = MoE.random(_cfg(num_experts=1, top_k=1, routing=routing, **kw), seed=10)
    cm = mxmoe.compile(layer, target=TARGETS[target])
    for tokens in (1, 5):
        x = _x(tokens, seed=tokens)
        assert relative_error(cm(x).float().numpy(), layer(x).float().numpy()) <= TOL, (routing, tokens)


def test_weight_on_input_with_shared_expert_on_the_rowmajor_lowering():
    """Llama-4's whole block: top-1 sigmoid weight on the input, plus a shared expert (bf16 linears)."""
    layer = MoE.random(_cfg(routing="topk_sigmoid", top_k=1, apply_router_weight_on_input=True, router_bias=False,
                            shared_intermediate=160, shared_format="bf16"), seed=9)
    cm = mxmoe.compile(layer, target=TARGETS["cpu-rowmajor"], entries=["monolithic"])
    for tokens in (1, 9):
        x = _x(tokens, seed=tokens)
        logits = _x(tokens, 12, seed=tokens + 1)
        assert relative_error(cm(x, logits).float().numpy(), layer.monolithic(x, logits).float().numpy()) <= TOL


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kw, match", [
    (dict(routing="softmax_topk", n_group=2, topk_group=1), "apply to routing 'sigmoid_topk' only"),
    (dict(routing="sigmoid_topk", n_group=5), "must divide the 12 experts routed over into groups of 2 or more"),
    (dict(routing="sigmoid_topk", n_group=4, topk_group=5), "topk_group=5 exceeds n_group=4"),
    (dict(routing="sigmoid_topk", top_k=4, n_group=4, topk_group=1), "top_k=4 exceeds the 3 experts"),
    (dict(routing="topk_softmax", score_bias=True), "score_bias .* applies to routing 'sigmoid_topk' only"),
    (dict(routing="topk_sigmoid", renormalize=True), "renormalize only applies to routing"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a positive finite number"),
    (dict(activation="relu2"), "activation must be one of"),
])
def test_bad_routing_configs_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_score_bias_weight_is_checked():
    cfg = _cfg(routing="sigmoid_topk", score_bias=True)
    w = MoEWeights.random(cfg)
    w.score_bias = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"score_bias: expected shape \(12,\) float32"):
        w.validate()


@pytest.mark.parametrize("kw, table, name, what", [
    (dict(routing="sigmoid_topk", n_group=4, topk_group=2), "ROUTINGS", "sigmoid_topk", "routing 'sigmoid_topk'"),
    (dict(activation="gelu_tanh"), "ACTIVATIONS", "gelu_tanh", "activation 'gelu_tanh'"),
])
def test_the_triton_path_refuses_what_its_kernels_do_not_implement(kw, table, name, what, monkeypatch):
    """Never another routing or activation than the layer's: cuda targets refuse, at compile time, what the Triton
    kernels' tables (``mxmoe.kernels.triton.planner``) lack. Today they hold every routing and activation, so one is
    taken out of its table here to see the refusal."""
    from mxmoe.kernels.triton import planner

    monkeypatch.setattr(planner, table, {k: v for k, v in getattr(planner, table).items() if k != name})
    layer = MoE.random(_cfg(**kw), seed=0)
    with pytest.raises(NotImplementedError, match=f"target cuda:sm_90: {what} is not built for the Triton path"):
        mxmoe.compile(layer, target="cuda:sm_90", interpret=True)
