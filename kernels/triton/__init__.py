"""NVIDIA (Triton) kernels for MXFP4 MoE layers: routing, grouping by expert, the two grouped MXFP4 GEMMs
with fused GLU / combine, their planner, and ahead-of-time compilation.

:func:`.planner.plan_layer` turns a layer (:class:`.planner.LayerSpec`) into a :class:`.kernel_plan.KernelPlan`
(which kernels, constants, tiles and grids per token-count class); :func:`.aot.compile_plan` compiles its
kernels to cubins, ``mxmoe.runtime.triton_executor`` runs it. The compiler builds a LayerSpec from the IR
(``mxmoe.compiler.triton_plan``); tests build them directly. The planner and the plan import neither torch
nor triton.
"""

from .kernel_plan import KernelPlan, PlanError
from .planner import LayerSpec, StoredWeight, fit_scale_range, plan_layer

__all__ = ["KernelPlan", "LayerSpec", "PlanError", "StoredWeight", "fit_scale_range", "plan_layer"]
