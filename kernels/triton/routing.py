"""Router: logits [T, E] -> top-k expert ids and their weights, in one kernel over tokens."""

from __future__ import annotations

import torch
import triton

from ._launch import KernelLaunch
from ._routing_kernel import route_kernel

ROUTINGS = ("topk_softmax", "softmax_topk")


def plan_routing(logits: torch.Tensor, top_k: int, routing: str = "topk_softmax",
                 renormalize: bool = False) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """Describe the routing launch; returns (launch, weights [T, k] fp32, ids [T, k] int32)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if renormalize and routing != "softmax_topk":
        raise ValueError("renormalize only applies to routing='softmax_topk'")
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
    logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    block_t = max(1, min(64, 4096 // experts_pow2))
    launch = KernelLaunch(
        "route", route_kernel, (triton.cdiv(num_tokens, block_t),),
        dict(logits_ptr=logits, weights_ptr=weights, ids_ptr=ids, num_tokens=num_tokens),
        dict(NUM_EXPERTS=num_experts, TOP_K=top_k, EXPERTS_POW2=experts_pow2,
             SLOTS_POW2=triton.next_power_of_2(top_k), BLOCK_T=block_t,
             SOFTMAX_OVER_ALL=routing == "softmax_topk" and not renormalize),
        num_warps=4, num_stages=1, dynamic_ints=frozenset({"num_tokens"}))
    return launch, weights, ids


def route(logits: torch.Tensor, top_k: int, routing: str = "topk_softmax",
          renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int32), slots sorted by descending logit, ties -> lower id."""
    launch, weights, ids = plan_routing(logits, top_k, routing, renormalize)
    launch.launch()
    return weights, ids
