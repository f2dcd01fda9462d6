"""Token grouping: (token, slot) pairs sorted by expert, without reading anything back to the host.

Every size here is a static bound from (T, k, E, BLOCK_M), so launch grids never wait on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ._grouping_kernel import group_by_expert_kernel
from ._launch import KernelLaunch


@dataclass(frozen=True)
class ExpertGroups:
    """Pairs grouped by expert, padded per expert to BLOCK_M rows for the grouped GEMMs.

    ``sorted_pairs[r]`` is the flat pair index t*k + j of sorted row r (rows [offsets[e],
    offsets[e+1]) belong to expert e). Block b of the padded row space covers sorted rows
    ``block_start[b] + [0, BLOCK_M)`` clipped to its expert's end; ``block_expert[b] == -1``
    marks a block past the last group (its programs exit at once).
    """

    sorted_pairs: torch.Tensor  # [T*k] int32
    expert_offsets: torch.Tensor  # [E+1] int32
    block_expert: torch.Tensor  # [num_blocks] int32
    block_start: torch.Tensor  # [num_blocks] int32
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e cdiv(count_e, BLOCK_M): each non-empty expert adds at most one
    partial block, and at most min(E, T*k) experts are non-empty."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def plan_grouping(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[KernelLaunch, ExpertGroups]:
    """Describe the grouping launch for ids [T, k] (int32)."""
    num_pairs = ids.numel()
    device = ids.device
    nb = max_blocks(num_pairs, num_experts, block_m)
    groups = ExpertGroups(
        sorted_pairs=torch.empty(num_pairs, dtype=torch.int32, device=device),
        expert_offsets=torch.empty(num_experts + 1, dtype=torch.int32, device=device),
        block_expert=torch.empty(nb, dtype=torch.int32, device=device),
        block_start=torch.empty(nb, dtype=torch.int32, device=device),
        block_m=block_m)
    experts_pow2 = triton.next_power_of_2(num_experts)
    launch = KernelLaunch(
        "group_by_expert", group_by_expert_kernel, (1,),
        dict(ids_ptr=ids, sorted_pairs_ptr=groups.sorted_pairs, expert_offsets_ptr=groups.expert_offsets,
             block_expert_ptr=groups.block_expert, block_start_ptr=groups.block_start,
             num_pairs=num_pairs, num_blocks=nb),
        dict(NUM_EXPERTS=num_experts, EXPERTS_POW2=experts_pow2, BLOCK_M=block_m,
             CHUNK=max(16, min(256, 8192 // experts_pow2))),
        num_warps=8, num_stages=1, dynamic_ints=frozenset({"num_pairs", "num_blocks"}))
    return launch, groups


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    launch, groups = plan_grouping(ids.to(torch.int32).contiguous(), num_experts, block_m)
    launch.launch()
    return groups
