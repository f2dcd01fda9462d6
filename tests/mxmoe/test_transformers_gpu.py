"""The families on a CUDA GPU (skipped without one; they need the compiler's IREE bindings on the GPU machine too):
tiny random models of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and gpt-oss through mxmoe's experts
implementation (the ``modular`` entry on the Triton path) and through ``convert`` + ``torch.compile(backend="mxmoe")``
(whole blocks with their routers), against transformers' eager model holding the dequantized weights.

The Triton path's modular entry and the DeepSeek / Llama-4 routings come with the Triton planner's next steps
(docs/interface.md, docs/transformers.md): until then these fail with the one-line errors that name what is not built.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _tiny(family: str):
    pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings are not on this GPU machine")
    pytest.importorskip("transformers")
    from mxmoe.transformers.families import tiny_model

    return tiny_model(family).cuda()


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_implementation_on_cuda(family):
    import mxmoe.transformers as mt

    model = _tiny(family)
    report = mt.quantize_experts(model)
    assert report.modules and report.target.startswith("cuda:sm_")
    mt.dequantize_experts(model)
    ids = torch.randint(3, 200, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref = model(ids).logits
        model.set_experts_implementation("mxmoe")
        out = model(ids).logits
        assert _rel(out, ref) < 1e-4
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
        model.set_experts_implementation("eager")
        assert torch.equal(gen, model.generate(ids, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_and_torch_compile_on_cuda(family):
    import mxmoe.transformers as mt
    from mxmoe.torch_frontend import backend, convert

    model = _tiny(family)
    mt.quantize_experts(model, compile=False)
    mt.dequantize_experts(model)     # MXFP4 values: converting quantizes them exactly
    model.set_experts_implementation("eager")
    converted = copy.deepcopy(model)
    report = convert(converted)
    assert report.replaced and not report.skipped, str(report)
    backend.reset()
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="mxmoe", options={"fallback": "raise", "cache_dir": None})
    for t in (12, 5):
        ids = torch.randint(3, 200, (1, t), device="cuda", generator=torch.Generator("cuda").manual_seed(t))
        with torch.no_grad():
            assert _rel(compiled(ids).logits, model(ids).logits) < 1e-4
    assert backend.stats.fallbacks == 0
