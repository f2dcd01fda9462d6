"""``mxmoe.compile``: nn.Module or ExportedProgram -> a compiled, callable module for a target."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from mxmoe.compiler.context import new_context
from mxmoe.compiler.importer import import_program
from mxmoe.compiler.parameters import store_parameters, stored_forms
from mxmoe.compiler.pipeline import run_for_target
from mxmoe.compiler.targets import Target, get_target
from mxmoe.core.bridge import dtype_name, to_torch
from mxmoe.core.stored_form import StoredForm
from mxmoe.core.signature import TensorSpec, check_inputs



def signature_of(ep: torch.export.ExportedProgram) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Input/output specs of an exported program's user-facing entry (dynamic dims as None)."""
    def spec(name: str, val) -> TensorSpec:
        try:
            dtype = dtype_name(val.dtype)
        except ValueError:
            raise ValueError(f"entry tensor '{name}' has unsupported dtype {val.dtype}") from None
        dims = tuple(int(d) if isinstance(d, int) or str(d).isdigit() else None for d in val.shape)
        bounds = tuple(None if s is not None else _upper_bound(ep, d) for s, d in zip(dims, val.shape))
        return TensorSpec(name, dtype, dims, bounds if any(b is not None for b in bounds) else None)

    user_inputs = ep.graph_signature.user_inputs
    nodes = {n.name: n for n in ep.graph.nodes}
    ins = [spec(n, nodes[n].meta["val"]) for n in user_inputs]
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outs = [spec(f"out{i}", a.meta["val"]) for i, a in enumerate(out_node.args[0])]
    return ins, outs


def _upper_bound(ep: torch.export.ExportedProgram, dim) -> int | None:
    """The export-time upper bound of a symbolic dim (None where unbounded or not a plain symbol)."""
    try:
        vr = ep.range_constraints.get(dim.node.expr)
        return int(vr.upper) if vr is not None and vr.upper.is_finite else None
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass
class CompiledModule:
    """A module compiled for one target, runnable in this process.

    Call it with torch tensors (returns torch tensors) or numpy arrays (returns numpy). Float inputs
    are cast to the entry's dtype; shapes and dtypes are checked against ``inputs``.
    """

    target: Target
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    vmfb: bytes | None
    parameters: dict[str, np.ndarray]
    mlir: str
    timings: dict[str, float] = field(default_factory=dict)
    #: per weight global: how the stored array was made from the logical one (padding, layout)
    stored_forms: dict[str, StoredForm] = field(default_factory=dict)
    #: what was compiled, when known: {"kind": "moe", "config": ..., "parameters": {field: global}} for an MoE layer
    model: dict | None = None
    #: Triton targets: the kernel plan (plain data), {plan kernel name: cubin}, and whether calls run
    #: the plan's kernels under Triton's interpreter on the CPU instead of on a GPU
    kernel_plan: dict | None = None
    binaries: dict[str, bytes] = field(default_factory=dict)
    interpret: bool = False
    _executor: Any = None

    def save(self, path, weights: str = "embedded", **options) -> dict:
        """Write this module as one mxmoe artifact file (docs/artifact-format.md); returns its manifest."""
        from mxmoe.runtime.artifact import save_compiled

        return save_compiled(self, path, weights=weights, **options)

    def executor(self):
        if self._executor is None and self.target.backend == "triton":
            from mxmoe.runtime.triton_executor import TritonExecutor

            self._executor = TritonExecutor(self.kernel_plan, self.parameters, self.binaries,
                                            mode="interpret" if self.interpret else "auto")
        if self._executor is None:
            if not self.target.runnable_here:
                raise RuntimeError(f"target {self.target.name} cannot run on this machine (compiled for {self.target.arch})")
            from mxmoe.runtime.iree_executor import IreeExecutor

            self._executor = IreeExecutor(self.vmfb, self.parameters)
        return self._executor

    def __call__(self, *args):
        if self.target.backend == "triton":
            if len(args) != 1:
                raise ValueError(f"expected 1 input ({self.inputs[0].describe()}), got {len(args)}")
            return self.executor()(args[0])
        arrays, any_torch = check_inputs(self.inputs, args)
        outs = self.executor()(*arrays)
        if any_torch:
            outs = [to_torch(o) for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def compile_program(ep: torch.export.ExportedProgram, target: str | Target = "cpu", *,
                    extra_flags: Sequence[str] | None = None, interpret: bool = False, model: dict | None = None,
                    timings: dict[str, float] | None = None) -> CompiledModule:
    """Compile an ``ExportedProgram`` (mxmoe custom ops inside, token dims dynamic) for ``target``.

    ``interpret=True`` (cuda targets only): skip the cubins; the module runs the plan's Triton kernels
    under Triton's interpreter on CPU tensors. ``model`` describes the layer for reference checks (see
    ``mxmoe.core.weights.moe_model_info``). ``mxmoe.compile`` (which also takes an ``nn.Module``) calls this.
    """
    tgt = get_target(target)
    if interpret and tgt.backend != "triton":
        raise ValueError(f"interpret=True applies to cuda targets only, not {tgt.name}")
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(f"compile: expected a torch.export.ExportedProgram, got {type(ep).__name__}")
    timings = {} if timings is None else timings
    ins, outs = signature_of(ep)

    t0 = time.perf_counter()
    ctx = new_context()
    imported = import_program(ep, context=ctx)
    timings["import_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    run_for_target(imported.module, tgt)
    forms = stored_forms(imported.module.operation)
    parameters = store_parameters(forms, imported.parameters)
    mlir = str(imported.module)
    timings["passes_s"] = time.perf_counter() - t0

    vmfb, kernel_plan, binaries = None, None, {}
    if tgt.backend == "iree":
        from mxmoe.compiler.iree_backend import compile_to_vmfb

        t0 = time.perf_counter()
        vmfb = compile_to_vmfb(mlir, tgt, list(extra_flags or []))
        timings["iree_compile_s"] = time.perf_counter() - t0
    else:
        from mxmoe.compiler.triton_backend import compile_triton

        kernel_plan, binaries = compile_triton(imported.module, parameters, tgt, interpret=interpret,
                                               timings=timings)
    return CompiledModule(tgt, ins, outs, vmfb, parameters, mlir, timings, stored_forms=forms, model=model,
                          kernel_plan=kernel_plan, binaries=binaries, interpret=interpret)
