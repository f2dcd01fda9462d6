"""Set-up shared by the transformers tests on the CPU and on the GPU."""

import copy

import pytest


@pytest.fixture
def convert_and_compile():
    """``make(model, **options)`` -> (the model, its converted copy under ``torch.compile(backend="mxmoe")``,
    convert's report). The model's experts are quantized and written back as their MXFP4 values first, so the eager
    model and the converted one compute with the same weights; the backend starts from a clean state."""
    import torch

    import mxmoe.transformers as mt
    from mxmoe.torch_frontend import backend, convert

    def make(model, **options):
        mt.quantize_experts(model, compile=False)
        mt.dequantize_experts(model)
        model.set_experts_implementation("eager")
        converted = copy.deepcopy(model)
        report = convert(converted)
        assert report.replaced and not report.skipped, str(report)
        backend.reset()
        torch._dynamo.reset()
        compiled = torch.compile(converted, backend="mxmoe",
                                 options={"fallback": "raise", "cache_dir": None, **options})
        return model, compiled, report

    return make
