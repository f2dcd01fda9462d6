"""The torch side of mxmoe: custom ops, the reference MoE layer, capture with torch.export."""

from mxmoe.config import MoEConfig
from mxmoe.torch_frontend import ops
from mxmoe.torch_frontend.capture import capture
from mxmoe.torch_frontend.moe import MoE

__all__ = ["MoE", "MoEConfig", "capture", "ops"]
