"""Conversion between mxmoe weights and transformers' gpt-oss MoE modules.

transformers holds gate_up_proj as ``[E, H, 2I]`` (gate/up interleaved on the last axis) and
down_proj as ``[E, I, H]``: the transposes of our w13 ``[E, 2I, H]`` and w2 ``[E, H, I]``.
transformers is imported lazily: it is a test/conversion dependency, not a runtime one.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mxmoe.core.config import MoEConfig
from mxmoe.core.weights import MoEWeights


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def is_gpt_oss_mlp(module: nn.Module) -> bool:
    return hasattr(module, "router") and hasattr(module, "experts") and hasattr(module.router, "top_k") and (
        hasattr(module.experts, "gate_up_proj") or hasattr(module.experts, "gate_up_proj_blocks"))


def weights_from_gpt_oss_mlp(mlp: nn.Module) -> tuple[MoEWeights, torch.dtype]:
    """MoEWeights from a ``GptOssMLP``: float experts are quantized, MXFP4 blocks/scales taken as is."""
    if not is_gpt_oss_mlp(mlp):
        raise ValueError(f"expected a transformers GptOssMLP (router + experts), got {type(mlp).__name__}")
    router, experts = mlp.router, mlp.experts
    e, h = router.weight.shape
    cfg = MoEConfig(
        num_experts=int(e), top_k=int(router.top_k), hidden=int(h), intermediate=int(experts.intermediate_size),
        routing="topk_softmax", activation="swiglu_oai",
        swiglu_alpha=float(getattr(experts, "alpha", 1.702)), swiglu_limit=float(getattr(experts, "limit", 7.0)),
        interleaved=True, bias=True, router_bias=getattr(router, "bias", None) is not None,
    )
    rb = None if router.bias is None else _np(router.bias)
    if hasattr(experts, "gate_up_proj_blocks"):  # already MXFP4 (HF checkpoint layout)
        blocks = experts.gate_up_proj_blocks
        w = MoEWeights(
            config=cfg, router_weight=_np(router.weight), router_bias=rb,
            w13=blocks.reshape(e, blocks.shape[1], -1).cpu().numpy(),
            w13_scale=experts.gate_up_proj_scales.cpu().numpy(),
            w13_bias=_np(experts.gate_up_proj_bias),
            w2=experts.down_proj_blocks.reshape(e, h, -1).cpu().numpy(),
            w2_scale=experts.down_proj_scales.cpu().numpy(),
            w2_bias=_np(experts.down_proj_bias),
        )
        return w, router.weight.dtype
    w = MoEWeights.from_float(
        cfg, _np(router.weight), rb,
        _np(experts.gate_up_proj).transpose(0, 2, 1), _np(experts.gate_up_proj_bias),
        _np(experts.down_proj).transpose(0, 2, 1), _np(experts.down_proj_bias),
    )
    return w, experts.gate_up_proj.dtype


def gpt_oss_mlp_from_weights(weights: MoEWeights, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers ``GptOssMLP`` with ``weights`` dequantized (gpt-oss semantics only)."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    c = weights.config
    if c.routing != "topk_softmax" or c.activation != "swiglu_oai" or not c.interleaved:
        raise ValueError("to_transformers: only the gpt-oss variant (topk_softmax, swiglu_oai, interleaved) exists there")
    hf = GptOssConfig(hidden_size=c.hidden, intermediate_size=c.intermediate, num_local_experts=c.num_experts,
                      num_experts_per_tok=c.top_k, swiglu_limit=c.swiglu_limit)
    mlp = GptOssMLP(hf)
    w13, w2 = weights.dequantized()
    zeros = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    with torch.no_grad():
        mlp.router.weight.copy_(torch.from_numpy(weights.router_weight))
        mlp.router.bias.copy_(torch.from_numpy(weights.router_bias if weights.router_bias is not None
                                               else zeros(c.num_experts)))
        mlp.experts.gate_up_proj.copy_(torch.from_numpy(np.ascontiguousarray(w13.transpose(0, 2, 1))))
        mlp.experts.gate_up_proj_bias.copy_(torch.from_numpy(
            weights.w13_bias if weights.w13_bias is not None else zeros(c.num_experts, 2 * c.intermediate)))
        mlp.experts.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(w2.transpose(0, 2, 1))))
        mlp.experts.down_proj_bias.copy_(torch.from_numpy(
            weights.w2_bias if weights.w2_bias is not None else zeros(c.num_experts, c.hidden)))
        mlp.experts.alpha = c.swiglu_alpha
    return mlp.to(dtype)
