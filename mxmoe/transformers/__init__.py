"""mxmoe for transformers' MoE families (docs/transformers.md).

``import mxmoe.transformers`` registers ``"mxmoe"`` in transformers' ``ExpertsInterface``, so that::

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mxmoe")   # or
    model.set_experts_implementation("mxmoe")

runs every supported family's experts through mxmoe (the family's own router stays in torch). Their float weights
are quantized to MXFP4 on first use, or up front (with a report) by :func:`quantize_experts`;
:func:`dequantize_experts` writes the exact dequantized floats back. ``mxmoe.convert(model)`` goes further for the
common families: router, experts and shared expert of each MoE block become one compiled mxmoe layer.

``python -m mxmoe.transformers --families`` checks every family of the installed transformers (docs/transformers.md
has the table).
"""

from __future__ import annotations

from mxmoe.transformers.experts import (ExpertsReport, QuantizedExperts, SkippedModule, dequantize_experts,
                                        mxmoe_experts_forward, quantize_experts)

__all__ = ["register", "quantize_experts", "dequantize_experts", "mxmoe_experts_forward", "ExpertsReport",
           "QuantizedExperts", "SkippedModule", "IMPLEMENTATION"]

#: the name transformers knows mxmoe's experts implementation by
IMPLEMENTATION = "mxmoe"


#: the first transformers whose models accept an experts implementation registered by name (5.0 - 5.6 check
#: against a fixed list); docs/transformers.md says which versions are tested
MIN_TRANSFORMERS = (5, 7)


def register() -> None:
    """Register ``"mxmoe"`` in transformers' ExpertsInterface (done on import; a clear ImportError on a transformers
    whose models cannot take it)."""
    import transformers

    release = tuple(int(p) for p in transformers.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        ExpertsInterface = None
    if ExpertsInterface is None or release < MIN_TRANSFORMERS:
        raise ImportError(f"mxmoe.transformers needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (its "
                          f"models take experts implementations registered by name); installed: "
                          f"{transformers.__version__}. mxmoe.convert(model) works without it")
    ExpertsInterface.register(IMPLEMENTATION, mxmoe_experts_forward)


register()
