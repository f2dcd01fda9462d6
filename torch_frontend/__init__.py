"""The torch side of mxmoe: custom ops, the reference MoE layer, capture with torch.export."""

from mxmoe.core.config import MoEConfig
from mxmoe.torch_frontend import ops
from mxmoe.torch_frontend.capture import capture, load_program
from mxmoe.torch_frontend.convert import ConversionReport, GptOssMoE, convert
from mxmoe.torch_frontend.moe import MoE

__all__ = ["MoE", "MoEConfig", "capture", "load_program", "ops", "convert", "ConversionReport", "GptOssMoE"]


def _register_backend_if_dynamo_loaded() -> None:
    # torch.compile(backend="mxmoe") finds the backend through the torch_dynamo_backends entry point; when
    # dynamo is already imported, also register it now (importing dynamo ourselves would cost ~1 s).
    import sys

    if "torch._dynamo" in sys.modules:
        from mxmoe.torch_frontend.backend import register

        register()


_register_backend_if_dynamo_loaded()
