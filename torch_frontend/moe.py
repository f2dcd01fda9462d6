"""``MoE``: the reference MXFP4 MoE layer, written with the mxmoe custom ops.

Its forward is the plain-torch reference every compiled path is checked against, and the graph
torch.export captures from it is what the compiler consumes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mxmoe.core.config import MoEConfig, preset
from mxmoe.torch_frontend import ops
from mxmoe.torch_frontend.mxfp4 import dequantize
from mxmoe.core.weights import MoEWeights

_WEIGHT_NAMES = ("w13", "w13_scale", "w2", "w2_scale")
_FLOAT_NAMES = ("router_weight", "router_bias", "w13_bias", "w2_bias")


class MoE(nn.Module):
    """A gpt-oss-style MoE layer with MXFP4 expert weights held as uint8 buffers.

    Router weights and biases are held in the activation dtype (as gpt-oss checkpoints do); the
    custom ops add biases in fp32. Input ``[T, H]`` or ``[B, S, H]``; output has the same shape.
    """

    def __init__(self, weights: MoEWeights, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"MoE: expected MoEWeights, got {type(weights).__name__} (build them with MoEWeights(...), "
                            "MoEWeights.from_numpy_dict(config, tensors) or MoE.random(config))")
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"MoE: activation dtype must be bfloat16, float16 or float32, got {dtype}")
        self.config: MoEConfig = weights.config
        for name in _WEIGHT_NAMES:
            self.register_buffer(name, torch.from_numpy(np.ascontiguousarray(getattr(weights, name))))
        for name in _FLOAT_NAMES:
            v = getattr(weights, name)
            t = None if v is None else torch.from_numpy(np.asarray(v, dtype=np.float32)).to(dtype)
            self.register_buffer(name, t)

    # ------------------------------------------------------------------------------- construction
    @classmethod
    def random(cls, config: MoEConfig | str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> "MoE":
        """A layer with random MXFP4 weights (never all zero); ``config`` may be a preset name."""
        if isinstance(config, str):
            config = preset(config)
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE.random: expected a MoEConfig or a preset name, got {type(config).__name__}")
        return cls(MoEWeights.random(config, seed=seed), dtype=dtype)

    @classmethod
    def from_transformers(cls, mlp: nn.Module, dtype: Optional[torch.dtype] = None) -> "MoE":
        """Build from a transformers ``GptOssMLP`` (float weights are quantized to MXFP4 here)."""
        from mxmoe.torch_frontend.transformers_compat import weights_from_gpt_oss_mlp

        weights, src_dtype = weights_from_gpt_oss_mlp(mlp)
        return cls(weights, dtype=dtype or src_dtype)

    @classmethod
    def from_hf_checkpoint(cls, path: str, layer: int, dtype: torch.dtype = torch.bfloat16) -> "MoE":
        """Build from layer ``layer`` of an HF gpt-oss checkpoint directory (MXFP4 blocks/scales)."""
        from mxmoe.core.checkpoint import read_hf_gpt_oss

        return cls(read_hf_gpt_oss(path, layer), dtype=dtype)

    def to_weights(self) -> MoEWeights:
        """The layer's weights as numpy (biases as fp32), e.g. to write a checkpoint or compile."""
        d = {n: getattr(self, n).cpu().numpy() for n in _WEIGHT_NAMES}
        for n in _FLOAT_NAMES:
            v = getattr(self, n)
            d[n] = None if v is None else v.detach().float().cpu().numpy()
        return MoEWeights(config=self.config, **d)

    def to_transformers(self) -> nn.Module:
        """A transformers ``GptOssMLP`` holding this layer's dequantized weights (for parity checks)."""
        from mxmoe.torch_frontend.transformers_compat import gpt_oss_mlp_from_weights

        return gpt_oss_mlp_from_weights(self.to_weights(), dtype=self.router_weight.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.router_weight.dtype

    def dequantized_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in fp32."""
        return dequantize(self.w13, self.w13_scale), dequantize(self.w2, self.w2_scale)

    # ------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_routing(x)[0]

    def forward_with_routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output (``x``'s shape) and each token's top-k routing weights ``[T, k]`` (fp32)."""
        cfg = self.config
        name = type(self).__name__
        if x.shape[-1] != cfg.hidden or x.dim() not in (2, 3):
            raise ValueError(f"{name}: input must be [T, {cfg.hidden}] or [B, S, {cfg.hidden}], got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name}: input dtype {x.dtype} does not match the layer's dtype {self.dtype}")
        tokens = x.reshape(-1, cfg.hidden)
        logits = F.linear(tokens, self.router_weight, self.router_bias)
        weights, ids = ops.route(logits, cfg.top_k, cfg.routing, cfg.renormalize)
        h = ops.mxfp4_grouped_matmul(tokens, ids, self.w13, self.w13_scale, self.w13_bias)
        a = ops.glu(h, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.interleaved)
        y = ops.mxfp4_grouped_matmul(a, ids, self.w2, self.w2_scale, self.w2_bias)
        return ops.combine(y, weights).reshape(x.shape), weights

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={c.num_experts}, top_k={c.top_k}, hidden={c.hidden}, intermediate={c.intermediate}, "
                f"routing={c.routing}, activation={c.activation}, dtype={self.dtype}")
