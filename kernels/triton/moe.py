"""The MoE layer forward, composed from the routing, grouping and grouped-GEMM kernels.

No step reads a device value back to the host: every buffer size and launch grid follows from
(T, k, E, H, I) and the tile config, so the forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._launch import KernelLaunch
from .grouped_gemm import plan_cast, plan_combine_gemm, plan_glu_gemm
from .grouping import plan_grouping
from .layout import ROW_MAJOR, WeightLayout
from .routing import plan_routing
from .tile_config import TileConfig, choose_config


@dataclass(frozen=True)
class MoEPlan:
    """The forward's launches in order, and the buffers the caller sees."""

    launches: tuple[KernelLaunch, ...]
    accumulator: torch.Tensor  # [T, H] fp32, must be zeroed before the launches run
    out: torch.Tensor  # [T, H] in x.dtype (the accumulator itself when x is fp32)


def device_arch(device: torch.device) -> int:
    """Compute capability as an int (90 = Hopper, 100 = Blackwell); 90 off-GPU (interpreter)."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def plan_moe_forward(x, logits, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, *, top_k: int,
                     routing: str = "topk_softmax", renormalize: bool = False,
                     activation: str = "swiglu_oai", alpha: float = 1.702, limit: float = 7.0,
                     interleaved: bool = True, layout: WeightLayout = ROW_MAJOR,
                     config: TileConfig | None = None, arch: int | None = None,
                     wide_scales: bool = True) -> MoEPlan:
    """Allocate the forward's buffers and describe its launches (see :func:`moe_forward`)."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"activations must be bf16 or fp32, got {x.dtype}")
    x = x.contiguous()
    num_tokens, hidden = x.shape
    num_experts = logits.shape[1]
    intermediate = layout.logical_shape(w13)[1] // 2
    arch = device_arch(x.device) if arch is None else arch
    cfg13 = config or choose_config(num_tokens, top_k, 2 * intermediate, hidden, arch, num_experts=num_experts,
                                    hopper=layout.hopper)
    cfg2 = config or choose_config(num_tokens, top_k, hidden, intermediate, arch, gemm="combine",
                                   num_experts=num_experts, hopper=layout.hopper)

    route, routing_weights, ids = plan_routing(logits, top_k, routing, renormalize)
    group, groups = plan_grouping(ids, num_experts, cfg13.BLOCK_M)
    glu, act = plan_glu_gemm(x, groups, w13, w13_scale, w13_bias, top_k=top_k, layout=layout,
                             config=cfg13, activation=activation, alpha=alpha, limit=limit,
                             interleaved=interleaved, wide_scales=wide_scales)
    acc = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)
    combine = plan_combine_gemm(act, groups, routing_weights, w2, w2_scale, w2_bias, acc,
                                top_k=top_k, layout=layout, config=cfg2, wide_scales=wide_scales)
    launches = [route, group, glu, combine]
    out = acc
    if x.dtype != torch.float32:
        out = torch.empty_like(x)
        launches.append(plan_cast(acc, out))
    return MoEPlan(tuple(launches), acc, out)


def moe_forward(x: torch.Tensor, logits: torch.Tensor,
                w13: torch.Tensor, w13_scale: torch.Tensor, w13_bias: torch.Tensor | None,
                w2: torch.Tensor, w2_scale: torch.Tensor, w2_bias: torch.Tensor | None, *,
                top_k: int, routing: str = "topk_softmax", renormalize: bool = False,
                activation: str = "swiglu_oai", alpha: float = 1.702, limit: float = 7.0,
                interleaved: bool = True, layout: WeightLayout = ROW_MAJOR,
                config: TileConfig | None = None, wide_scales: bool = True) -> torch.Tensor:
    """MoE layer output [T, H] in x.dtype for x [T, H] and router logits [T, E].

    Weights are MXFP4 in ``layout`` (``layout.swizzle`` of the checkpoint tensors; the default
    ROW_MAJOR is the checkpoint's own order). ``config`` overrides ``choose_config`` for both GEMMs.
    ``wide_scales=False`` (HOPPER layout) promises every scale byte is <= 128 (see ``plan_glu_gemm``).
    """
    plan = plan_moe_forward(x, logits, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias,
                            top_k=top_k, routing=routing, renormalize=renormalize,
                            activation=activation, alpha=alpha, limit=limit,
                            interleaved=interleaved, layout=layout, config=config, wide_scales=wide_scales)
    plan.accumulator.zero_()
    for launch in plan.launches:
        launch.launch()
    return plan.out
