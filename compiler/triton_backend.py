"""From a module through its cuda target's passes (``CudaTarget.passes``) to what runs on NVIDIA: kernel plans,
cubins, weights.

``compile_triton`` plans the kernels of every entry function (:mod:`mxmoe.compiler.triton_plan` matches each entry's
layer, :mod:`mxmoe.kernels.triton.planner` plans it; one plan per entry over the same weights), then compiles every
plan kernel ahead of time with ``triton.compile`` for the target's arch (no GPU needed). The weights were
already padded and put into the layout the passes assigned (``mxmoe.compiler.parameters``); the plan
names which of them feed which kernel argument. With ``interpret=True`` the cubins are skipped: the
module will run the same plan's kernels under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

import numpy as np
from iree.compiler import ir

from mxmoe.compiler.targets import Target
from mxmoe.compiler.triton_plan import plan_entries
from mxmoe.kernels.triton.planner import fit_scale_range


def compile_triton(module: ir.Module, parameters: Mapping[str, np.ndarray], target: Target, *,
                   interpret: bool = False, timings: dict[str, float] | None = None, deterministic: bool = False,
                   batch_invariant: bool = False,
                   activations: str = "bf16") -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, bytes]]]:
    """({entry: kernel plan}, {entry: {plan kernel name: cubin}}) for ``module``, one plan per entry function (in the
    module's order) over the same weights; cubins are empty with ``interpret``, and a kernel that two entries'
    plans share is compiled once. ``deterministic`` / ``batch_invariant`` / ``activations``: the plans' options
    (``mxmoe.kernels.triton.kernel_plan.PlanOptions``)."""
    timings = timings if timings is not None else {}
    t0 = time.perf_counter()
    plans = plan_entries(module, target, deterministic=deterministic, batch_invariant=batch_invariant,
                         activations=activations)
    for entry, plan in plans.items():
        missing = sorted(set(plan.parameters) - set(parameters))
        if missing:
            raise ValueError(f"no array for weight global(s) {', '.join(missing)}")
        for name, spec in plan.parameters.items():
            if list(parameters[name].shape) != list(spec.shape):
                raise ValueError(f"weight '{name}': stored shape {list(parameters[name].shape)} differs from the "
                                 f"plan's {list(spec.shape)}")
        plans[entry] = fit_scale_range(plan, parameters)
    timings["triton_plan_s"] = time.perf_counter() - t0
    binaries: dict[str, dict[str, bytes]] = {entry: {} for entry in plans}
    if not interpret:
        from mxmoe.kernels.triton.aot import compile_plan

        t0 = time.perf_counter()
        cache: dict = {}
        for entry, plan in plans.items():
            binaries[entry], meta = compile_plan(plan, cache=cache)
            plans[entry] = dataclasses.replace(plan, cubins=meta)
        timings["triton_compile_s"] = time.perf_counter() - t0
    return {entry: plan.to_dict() for entry, plan in plans.items()}, binaries
