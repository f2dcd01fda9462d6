"""NVIDIA (Triton) kernels for MXFP4 MoE layers: routing, grouping by expert, the two grouped
MXFP4 GEMMs with fused GLU / combine, and ahead-of-time compilation of all of them.

The compiler drives them through a kernel plan (:mod:`.kernel_plan`, built by
``mxmoe.compiler.triton_plan``, compiled by :func:`.aot.compile_plan`, run by
``mxmoe.runtime.triton_executor``); the ``route`` / ``group_by_expert`` / ``moe_forward`` functions
here launch the same kernels directly on tensors (tests, experiments)."""

from .aot import aot_compile
from .grouping import ExpertGroups, group_by_expert
from .layout import COL_MAJOR, HOPPER, HOPPER_TILED, LAYOUTS, ROW_MAJOR, WeightLayout
from .moe import moe_forward, plan_moe_forward
from .routing import route
from .tile_config import TileConfig, choose_config

__all__ = [
    "COL_MAJOR", "ExpertGroups", "HOPPER", "HOPPER_TILED", "LAYOUTS", "ROW_MAJOR", "TileConfig", "WeightLayout",
    "aot_compile", "choose_config", "group_by_expert", "moe_forward", "plan_moe_forward", "route",
]
