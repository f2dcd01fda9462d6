"""mxmoe as transformers' experts implementation (``import mxmoe.transformers``): registration, loading with
``experts_implementation="mxmoe"``, ``quantize_experts`` and its report, ``dequantize_experts`` (exact floats back),
what happens to the float weights, the expert-parallel sentinel, padded sizes, bf16, and the one-line errors for
what mxmoe does not run; the families script on a subset (the whole table: docs/transformers.md).

Tiny random models in fp32 (logits compared to the eager model holding the dequantized weights, greedy generation
identical) and bf16 (a tolerance for the cpu microkernel's int16 activations).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mxmoe.transformers as mt
from mxmoe.torch_frontend.families import Unsupported, experts_spec
from mxmoe.transformers.experts import mxmoe_experts_forward, quantized_state

pytest.importorskip("transformers.integrations.moe")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402



def _mixtral(hidden=64, intermediate=96, experts=8, k=2, dtype=torch.float32, seed=0) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=experts,
                        num_experts_per_tok=k, max_position_embeddings=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MixtralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) / hidden ** 0.5)
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) / intermediate ** 0.5)
    return model.to(dtype)


def _ids(t=10, seed=0):
    return torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(seed))


def _logits(model, impl, ids):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_import_registers_the_implementation():
    assert ALL_EXPERTS_FUNCTIONS["mxmoe"] is mxmoe_experts_forward


def test_quantize_then_dequantize_matches_eager_and_greedy_generation():
    model = _mixtral()
    report = mt.quantize_experts(model)
    assert [m.name for m in report.modules] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    m = report.modules[0]
    assert (m.cls, m.num_experts, m.hidden, m.intermediate, m.activation, m.layout, m.bias) == (
        "MixtralExperts", 8, 64, 96, "silu", "concatenated", False)
    # fp32 floats [8, 192, 64] + [8, 64, 96]; MXFP4 4.25 bits a value
    assert m.bytes_before == 4 * 8 * (192 * 64 + 64 * 96)
    assert m.bytes_after == 8 * (192 * 64 + 64 * 96) * 17 // 32
    assert not m.exact and 0 < m.max_rel_error < 0.3
    assert len(report.shapes) == 1 and report.shapes[0]["modules"] == 2 and report.target == "cpu"
    assert "2 experts modules to MXFP4 for target cpu" in str(report)
    mt.dequantize_experts(model)
    ids = _ids()
    ref, out = _logits(model, "eager", ids), _logits(model, "mxmoe", ids)
    assert _rel(out, ref) < 1e-5
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
        model.set_experts_implementation("eager")
        assert torch.equal(gen, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_dequantized_weights_are_exact_and_requantize_exactly():
    model = _mixtral(seed=3)
    mt.quantize_experts(model, compile=False)
    mt.dequantize_experts(model)
    ex = model.model.layers[0].mlp.experts
    w = quantized_state(ex).weights(2)
    w13, w2 = w.dequantized()
    assert torch.equal(ex.gate_up_proj, torch.from_numpy(w13))
    assert torch.equal(ex.down_proj, torch.from_numpy(w2))
    again = mt.quantize_experts(model, compile=False)   # floats that are MXFP4 values: taken as they are
    assert all(m.exact and m.max_rel_error == 0 for m in again.modules)
    assert np.array_equal(quantized_state(ex).fields["w13"], w.w13)


def test_loading_with_experts_implementation_mxmoe_quantizes_on_first_use(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _mixtral(seed=4)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="mxmoe").eval()
    ids = _ids(seed=1)
    with torch.no_grad():
        out = loaded(ids).logits.float()
    ex = loaded.model.layers[1].mlp.experts
    assert quantized_state(ex) is not None and not hasattr(ex, "gate_up_proj")
    mt.dequantize_experts(loaded)
    assert _rel(out, _logits(loaded, "eager", ids)) < 1e-5


def test_float_weights_are_gone_and_named():
    model = _mixtral(seed=5)
    mt.quantize_experts(model, compile=False)
    ex = model.model.layers[0].mlp.experts
    with pytest.raises(AttributeError, match=r"MixtralExperts 'model.layers.0.mlp.experts': its float weights "
                                             r"\(gate_up_proj\) were replaced by MXFP4"):
        ex.gate_up_proj
    assert type(ex).__name__ == "MixtralExperts" and isinstance(ex, type(ex).__mro__[1])
    with pytest.raises(RuntimeError, match="hold MXFP4 weights only .*dequantize_experts"):
        model.state_dict()
    mt.dequantize_experts(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    kept = mt.quantize_experts(model, keep_float=True, compile=False)
    assert all(m.action == "quantized" for m in kept.modules) and hasattr(ex, "gate_up_proj")


def test_padded_sizes_and_a_single_expert_per_token():
    """H 48 and I 40 (not multiples of the MXFP4 block): zero-padded, sliced back."""
    model = _mixtral(hidden=48, intermediate=40, experts=4, k=1, seed=6)
    mt.quantize_experts(model)
    mt.dequantize_experts(model)
    ids = _ids(13, seed=2)
    assert _rel(_logits(model, "mxmoe", ids), _logits(model, "eager", ids)) < 1e-5


def test_bf16_on_the_cpu_microkernel():
    model = _mixtral(dtype=torch.bfloat16, seed=7)
    mt.quantize_experts(model)
    mt.dequantize_experts(model)
    ids = _ids(16, seed=3)
    assert _rel(_logits(model, "mxmoe", ids), _logits(model, "eager", ids)) < 5e-2


@pytest.mark.parametrize("form,lo,hi", [("mxint8", 1e-3, 5e-2), ("mxint16", 0.0, 1e-2), ("bf16", 0.0, 1e-2)])
def test_a_target_object_picks_a_cpu_activation_form(form, lo, hi):
    """``target`` may be a target with its options: the cpu target's MXINT8 form runs each experts call at MXINT8's
    error (~2%) against eager with the dequantized weights (logits can move more: a later router near a tie); the
    two-plane form (mxint16) at the bf16 form's (measured: both 8.6e-3 here, eager rounding its GLU in bf16 steps)."""
    from mxmoe.compiler.targets import get_target

    model = _mixtral(dtype=torch.bfloat16, seed=7)
    report = mt.quantize_experts(model, target=get_target("cpu").with_activations(form))
    assert quantized_state(model.model.layers[0].mlp.experts).target.activations == form, report
    mt.dequantize_experts(model)
    ex = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=g)
    y = mxmoe_experts_forward(ex, x, ids, w)
    model.set_experts_implementation("eager")
    err = _rel(y.float(), ex(x, ids, w).float())
    assert lo < err < hi, err  # mxint8: above the bf16 form's rounding, the activations were quantized


def test_expert_parallel_sentinel_contributes_nothing():
    """transformers marks a pair routed to another rank's expert with id E: it adds nothing (the cpu target's
    default blocksplit lowering)."""
    model = _mixtral(seed=8)
    mt.quantize_experts(model)
    mt.dequantize_experts(model)
    ex = model.model.layers[0].mlp.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 8], [8, 8], [3, 1], [8, 2], [5, 6], [7, 8]])
    w = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    out = mxmoe_experts_forward(ex, x, ids, w)
    ref = type(ex).__mro__[0].forward.__wrapped__(ex, x, ids, w)   # the eager loop (skips expert_idx == E)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not out[1].any()


def _experts_of(family_cls_path: str, config_cls_path: str, **cfg):
    import importlib

    mod, cls = family_cls_path.rsplit(".", 1)
    cmod, ccls = config_cls_path.rsplit(".", 1)
    config = getattr(importlib.import_module(cmod), ccls)(**cfg)
    return getattr(importlib.import_module(mod), cls)(config)


def test_unsupported_experts_are_named_with_the_reason():
    nemotron = _experts_of("transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts",
                           "transformers.models.nemotron_h.configuration_nemotron_h.NemotronHConfig",
                           hidden_size=64, moe_intermediate_size=32, n_routed_experts=4)
    with pytest.raises(Unsupported, match=r"^NemotronHExperts 'a.b': non-gated experts \(up_proj, then "
                                          r"ReLUSquaredActivation\): mxmoe's experts are GLUs"):
        experts_spec(nemotron, "a.b")
    model = _mixtral(seed=9)
    ex = model.model.layers[0].mlp.experts
    ex.act_fn = torch.nn.ReLU()
    with pytest.raises(Unsupported, match=r"its gate \(act_fn\(gate\) \* up with act_fn ReLU\) computes none of "
                                          r"mxmoe's GLU activations"):
        experts_spec(ex)
    report = mt.quantize_experts(model, compile=False)
    assert [(s.name, s.reason.split(" (")[0]) for s in report.skipped] == [("model.layers.0.mlp.experts", "its gate")]
    assert [m.name for m in report.modules] == ["model.layers.1.mlp.experts"]
    meta = _mixtral(seed=10)
    meta.model.layers[0].mlp.experts.to("meta")
    with pytest.raises(Unsupported, match="gate_up_proj is on the meta device"):
        experts_spec(meta.model.layers[0].mlp.experts)


def test_first_use_of_an_unsupported_module_raises_naming_it():
    model = _mixtral(seed=11)
    model.model.layers[0].mlp.experts.act_fn = torch.nn.ReLU()
    model.set_experts_implementation("mxmoe")
    with pytest.raises(Unsupported, match=r"MixtralExperts: its gate .* \(experts_implementation='mxmoe'\)"):
        with torch.no_grad():
            model(_ids())


def test_gates_of_other_families_are_recognised():
    """gpt-oss (interleaved, transposed, biases, clamped SwiGLU) and DeepSeek-V4 (clamped SiLU)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = GptOssExperts(GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, swiglu_limit=5.0))
    spec = experts_spec(g)
    assert (spec.activation, spec.swiglu_limit, spec.interleaved, spec.transposed, spec.bias) == (
        "swiglu_oai", 5.0, True, True, True)
    v4 = _experts_of("transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts",
                     "transformers.models.deepseek_v4.configuration_deepseek_v4.DeepseekV4Config",
                     hidden_size=64, intermediate_size=32, n_routed_experts=4, swiglu_limit=3.0)
    spec = experts_spec(v4)
    assert (spec.activation, spec.swiglu_limit, spec.interleaved) == ("silu_clamped", 3.0, False)


def test_the_families_script_on_a_subset():
    from mxmoe.transformers.__main__ import main
    from mxmoe.transformers.families import check_families, format_table, moe_families

    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= set(moe_families())
    results = {r.family: r for r in check_families(["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "muse_spark"])}
    for fam in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"):
        r = results[fam]
        assert r.status == "works", (fam, r.reason)
        assert r.rel_error < 1e-4 and r.generation_equal
    assert results["muse_spark"].status == "unsupported"
    assert "has_post_expert_norm" in results["muse_spark"].reason
    table = format_table(list(results.values()))
    assert "| mixtral | works | MixtralForCausalLM | MixtralExperts (silu, concatenated) |" in table
    assert main(["--families", "olmoe"]) == 0
    assert main(["--families", "not_a_family"]) == 2


#: logits of a tiny fp32 model whose experts run with bf16 operands (the cuda target's kernels), relative to the
#: eager model's: bf16's 2^-8 rounding of the activations, through two decoder layers
BF16_OPERANDS = 2e-2


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_converted_blocks_are_one_triton_region_each(family, monkeypatch, convert_and_compile):
    """``convert`` + ``torch.compile`` on a cuda model: each converted block, with its bf16 shared expert and that
    expert's sigmoid gate (Qwen2-MoE) or an fp32 layer's no-op ``x.float()`` before its fp32 router (DeepSeek-V3),
    is one region the Triton path runs. Here on the CPU with the kernels under the interpreter; the H100 test is
    tests/mxmoe/test_transformers_gpu.py."""
    pytest.importorskip("triton")
    from mxmoe.compiler import api as compiler_api
    from mxmoe.torch_frontend import backend as B
    from mxmoe.transformers.families import tiny_model

    monkeypatch.setattr(B, "target_for", lambda device: "cuda:sm_90")
    real = compiler_api.compile_program
    monkeypatch.setattr(compiler_api, "compile_program",
                        lambda ep, target, **kw: real(ep, target=target, interpret=True))
    model, f, report = convert_and_compile(tiny_model(family), rest="eager")
    ids = _ids(12, seed=3)
    with torch.no_grad():
        rel = _rel(f(ids).logits.float(), model(ids).logits.float())
    assert rel < BF16_OPERANDS
    assert B.stats.regions == len(report.replaced) and B.stats.fallbacks == 0, B.stats
