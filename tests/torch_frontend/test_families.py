"""Whole MoE blocks of transformers' common families as one mxmoe layer: ``convert(model)`` and
``MoE.from_transformers(block)`` (router + experts + shared expert), on tiny random models of Mixtral, Qwen2-MoE
(shared expert with its gate), Qwen3-MoE, OLMoE, DeepSeek-V3 (sigmoid routing with groups, a correction bias and
scaling, fp32 router, shared expert), GLM-4 MoE, Granite MoE, gpt-oss and Llama-4 (top-1 sigmoid weight on the input,
shared expert).

The experts' float weights are first set to MXFP4 values (so quantization is exact and the converted model computes
what transformers' eager model computes); the converted model's logits are compared with the eager model's (fp32),
the converted blocks are compiled (``layer`` and ``monolithic`` entries, both cpu lowerings) against the reference,
and a subset runs through ``torch.compile(backend="mxmoe")``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mxmoe
from mxmoe.compiler.targets import get_target
from mxmoe.core import mxfp4
from mxmoe.core.layouts import ROW_MAJOR
from mxmoe.core.reference import relative_error
from mxmoe.core.weights import MoEWeights
from mxmoe.torch_frontend import MoE, convert
from mxmoe.torch_frontend.families import experts_float_tensors, experts_spec, is_experts, quantize_experts_module

pytest.importorskip("transformers")

ROWMAJOR = get_target("cpu").replace(layout=ROW_MAJOR)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "granitemoe", "gpt_oss"]


def _tiny(family: str):
    from mxmoe.transformers.families import tiny_model

    model = tiny_model(family, randomize=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if is_experts(m):
                for n in ("gate_up_proj", "down_proj"):
                    p = getattr(m, n)
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
                _to_mxfp4_values(m)
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape, generator=g) * 0.05)
    model.set_experts_implementation("eager")
    return model


def _to_mxfp4_values(experts) -> None:
    """Replace the experts' floats by the MXFP4 values they quantize to (quantizing them again is then exact)."""
    spec = experts_spec(experts)
    fields, _ = quantize_experts_module(experts, spec)
    w = MoEWeights(spec.config(1), None, None, **fields)
    with torch.no_grad():
        for n, t in experts_float_tensors(w, spec).items():
            getattr(experts, n).copy_(t)


def _ids(t=11, seed=0):
    return torch.randint(3, 200, (1, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = _tiny(request.param)
    converted = copy.deepcopy(model)
    report = convert(converted)
    return request.param, model, converted, report


def test_convert_replaces_every_moe_block_and_matches_eager(family):
    name, model, converted, report = family
    assert report.replaced and not report.skipped, str(report)
    if name != "gpt_oss":  # (gpt-oss's own path reports float weights as quantized, exact or not)
        assert all(r.action == "mxfp4" for r in report.replaced), str(report)   # MXFP4 values: taken exactly
    ids = _ids()
    with torch.no_grad():
        ref, out = model(ids).logits, converted(ids).logits
    assert relative_error(out.numpy(), ref.numpy()) < 1e-5, name


#: (family, target) pairs compiled in the default suite; the rest of the matrix runs with -m slow
_QUICK = {("mixtral", "cpu"), ("qwen2_moe", "cpu-rowmajor"), ("deepseek_v3", "cpu"), ("deepseek_v3", "cpu-rowmajor"),
          ("gpt_oss", "cpu"), ("olmoe", "cpu-rowmajor")}


@pytest.mark.parametrize("fam, target", [
    pytest.param(f, t, marks=() if (f, t) in _QUICK else pytest.mark.slow) for f in FAMILIES
    for t in ("cpu", "cpu-rowmajor")])
def test_converted_blocks_compile_with_the_layer_and_monolithic_entries(fam, target):
    name = fam
    converted = copy.deepcopy(_tiny(fam))
    convert(converted)
    block = next(m for m in converted.modules() if isinstance(m, MoE))
    cfg = block.config
    layer = MoE(block.to_weights(), dtype=torch.bfloat16)
    cm = mxmoe.compile(layer, target=target if target == "cpu" else ROWMAJOR, entries=["layer", "monolithic"])
    for tokens in (1, 7, 33):
        x = torch.randn(tokens, cfg.hidden, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        logits = torch.randn(tokens, cfg.experts_routed, generator=torch.Generator().manual_seed(tokens + 1))
        logits = logits.to(torch.float32 if cfg.router_fp32 else torch.bfloat16)
        assert relative_error(cm.entry("monolithic")(x, logits).float().numpy(),
                              layer.monolithic(x, logits).float().numpy()) <= 2e-2, (name, tokens)
        out, ref = cm(x).float(), layer(x).float()
        rows = (out - ref).abs().amax(-1) / ref.abs().amax().clamp_min(1e-6)
        # a token whose router logits are within an ulp may pick another expert (docs/routing.md): at most one here
        assert int((rows > 2e-2).sum()) <= 1, (name, tokens, rows)


def test_from_transformers_builds_a_block(family):
    name, model, _, _ = family
    block = next(m for m in model.modules() if type(m).__name__ in {
        "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
        "DeepseekV3MoE", "Glm4MoeMoE", "GraniteMoeMoE", "GptOssMLP"})
    layer = MoE.from_transformers(block)
    x = torch.randn(2, 5, layer.config.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = block(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert relative_error(layer(x).numpy(), ref.numpy()) < 1e-5, name
    want = {"deepseek_v3": "sigmoid_topk", "glm4_moe": "sigmoid_topk", "gpt_oss": "topk_softmax",
            "granitemoe": "topk_softmax"}.get(name, "softmax_topk")
    assert layer.config.routing == want
    if name in ("deepseek_v3", "glm4_moe"):
        c = layer.config
        assert c.router_fp32 and c.score_bias and c.shared_intermediate and (c.n_group, c.topk_group) == (2, 1)


def test_llama4_block_top1_sigmoid_on_input_with_shared_expert():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from mxmoe.transformers.families import tiny_config

    cfg = tiny_config(Llama4TextConfig, num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=1,
                      intermediate_size_mlp=64)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(cfg).eval()
    for layer in model.model.layers:
        ex = getattr(layer.feed_forward, "experts", None)
        if ex is None:
            continue
        with torch.no_grad():
            for n in ("gate_up_proj", "down_proj"):   # [E, K, N], reduction along K: MXFP4 values
                p = getattr(ex, n)
                p.normal_(0, 0.15)
                q, s = mxfp4.quantize(p.transpose(1, 2).contiguous().numpy())
                p.copy_(torch.from_numpy(mxfp4.dequantize(q, s)).transpose(1, 2))
    ids = _ids(seed=4)
    converted = copy.deepcopy(model)
    report = convert(converted)
    assert [r.source for r in report.replaced] == ["Llama4TextMoe"]
    block = converted.model.layers[1].feed_forward
    assert block.config.routing == "topk_sigmoid" and block.config.apply_router_weight_on_input
    with torch.no_grad():
        ref, out = model(ids).logits, converted(ids).logits
    assert relative_error(out.numpy(), ref.numpy()) < 1e-5


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_torch_compile_runs_the_converted_blocks(name):
    """convert + torch.compile(backend="mxmoe"): every MoE region compiled (none left to the reference ops)."""
    from mxmoe.torch_frontend import backend

    model = _tiny(name)
    converted = copy.deepcopy(model)
    convert(converted)
    backend.reset()
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="mxmoe",
                             options={"fallback": "raise", "cache_dir": None, "rest": "eager"})
    for t in (11, 4):
        ids = _ids(t, seed=t)
        with torch.no_grad():
            ref, out = model(ids).logits, compiled(ids).logits
        assert relative_error(out.numpy(), ref.numpy()) < 1e-5
    assert backend.stats.compiled >= 1 and backend.stats.fallbacks == 0


def test_blocks_mxmoe_cannot_express_are_skipped_with_the_reason():
    model = _tiny("mixtral")
    model.model.layers[0].mlp.experts.act_fn = torch.nn.ReLU()
    report = convert(model)
    assert [r.name for r in report.replaced] == ["model.layers.1.mlp"]
    (skipped,) = report.skipped
    assert skipped.name == "model.layers.0.mlp" and "computes none of mxmoe's GLU activations" in skipped.reason
    with pytest.raises(ValueError, match="is not an MoE block convert"):
        MoE.from_transformers(model.model.layers[0].self_attn)
