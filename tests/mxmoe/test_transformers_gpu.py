"""The families on a CUDA GPU (skipped without one; they need the compiler's IREE bindings on the GPU machine too):
tiny random models of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and gpt-oss through mxmoe's experts
implementation (the ``modular`` entry on the Triton path) and through ``convert`` + ``torch.compile(backend="mxmoe")``
(whole blocks with their routers), against transformers' eager model holding the dequantized weights.

The models are fp32; the cuda target's kernels take bf16 operands (fp32 accumulation), as docs/transformers.md says,
so logits are compared at bf16's tolerance, and greedy generation must agree wherever the eager model's choice is
decisive (its top two logits further apart than that tolerance).
"""

from __future__ import annotations


import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _tiny(family: str, compiler: bool = True):
    """The family's tiny model on the GPU. ``compiler``: the test compiles (the torch.compile backend); else the
    experts' modules may come from ``$MXMOE_TEMPLATES`` (tests/write_gpu_modules.py writes them)."""
    import os

    from mxmoe.engine import TEMPLATES_ENV, _has_compiler

    if not _has_compiler() and (compiler or not os.environ.get(TEMPLATES_ENV)):
        pytest.skip("the compiler's IREE bindings are not on this GPU machine"
                    + ("" if compiler else f" and ${TEMPLATES_ENV} is not set"))
    pytest.importorskip("transformers")
    from mxmoe.transformers.families import tiny_model

    return tiny_model(family).cuda()


def write_templates() -> None:
    """The experts' compiled templates of every family's tiny model for cuda:sm_90, into ``$MXMOE_TEMPLATES`` (on a
    machine with the compiler, for tests/write_gpu_modules.py)."""
    import mxmoe.transformers as mt
    from mxmoe.transformers.families import tiny_model

    for family in FAMILIES:
        mt.quantize_experts(tiny_model(family), target="cuda:sm_90", bind=False, progress=False)
        print(f"transformers templates {family}", flush=True)


#: logits of a tiny fp32 model whose experts run with bf16 operands, relative to the eager model's (as the CPU
#: test of the same regions under the interpreter, tests/mxmoe/test_transformers.py)
BF16_OPERANDS = 2e-2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _greedy_agrees(model, run, prompt, new_tokens=8) -> None:
    """Greedy generation by the eager model; ``run(ids)`` (mxmoe's logits) must pick the same next token at every
    step where the eager model's top two logits are further apart than twice the tolerance (in these tiny random
    models 1 to 6 of 8 steps, measured on the CPU)."""
    model.set_experts_implementation("eager")
    gen = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    ref = model(gen[:, :-1]).logits[0, prompt.shape[1] - 1:].float()
    out = run(gen[:, :-1])[0, prompt.shape[1] - 1:].float()
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * BF16_OPERANDS * ref.abs().max()
    assert bool(decisive.any()), "no decisive step: the check would mean nothing"
    want = gen[0, prompt.shape[1]:]
    assert torch.equal(out.argmax(-1)[decisive], want[decisive])


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_implementation_on_cuda(family):
    import mxmoe.transformers as mt

    model = _tiny(family, compiler=False)
    report = mt.quantize_experts(model)
    assert report.modules and report.target.startswith("cuda:sm_")
    mt.dequantize_experts(model)
    ids = torch.randint(3, 200, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref = model(ids).logits
        model.set_experts_implementation("mxmoe")
        out = model(ids).logits
        assert _rel(out, ref) < BF16_OPERANDS

        def run(seq):
            model.set_experts_implementation("mxmoe")
            try:
                return model(seq).logits
            finally:
                model.set_experts_implementation("eager")

        _greedy_agrees(model, run, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_and_torch_compile_on_cuda(family, convert_and_compile):
    from mxmoe.torch_frontend import backend

    model, compiled, report = convert_and_compile(_tiny(family))
    for t in (12, 5):
        ids = torch.randint(3, 200, (1, t), device="cuda", generator=torch.Generator("cuda").manual_seed(t))
        with torch.no_grad():
            assert _rel(compiled(ids).logits, model(ids).logits) < BF16_OPERANDS
            _greedy_agrees(model, lambda seq: compiled(seq).logits, ids)
    assert backend.stats.fallbacks == 0 and backend.stats.regions >= len(report.replaced)
