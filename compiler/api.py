"""``mxmoe.compile``: nn.Module or ExportedProgram -> a compiled, callable module for a target."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from mxmoe.compiler.context import new_context
from mxmoe.compiler.importer import import_programs
from mxmoe.compiler.parameters import store_parameters, stored_forms
from mxmoe.compiler.passes import run_passes
from mxmoe.compiler.targets import Target, get_target
from mxmoe.core.bridge import dtype_name
from mxmoe.core.signature import EntrySignature, TensorSpec
from mxmoe.core.stored_form import StoredForm
from mxmoe.runtime.artifact import save_module
from mxmoe.runtime.code import IreeCode, TritonCode
from mxmoe.runtime.module import EntryPoints



def signature_of(ep: torch.export.ExportedProgram, name: str = "main") -> EntrySignature:
    """The signature of an exported program's user-facing entry (dynamic dims as None)."""
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
    return EntrySignature(name, tuple(ins), tuple(outs))


def _upper_bound(ep: torch.export.ExportedProgram, dim) -> int | None:
    """The export-time upper bound of a symbolic dim (None where unbounded or not a plain symbol)."""
    try:
        vr = ep.range_constraints.get(dim.node.expr)
        return int(vr.upper) if vr is not None and vr.upper.is_finite else None
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass
class CompiledModule:
    """A module compiled for one target, runnable in this process and savable as an artifact.

    Call it with torch tensors (returns torch tensors) or numpy arrays (returns numpy). Float inputs
    are cast to the entry's dtype; shapes and dtypes are checked against ``inputs``.
    """

    target: Target
    #: its entry points (the default first): ``cm(...)`` runs the first, ``cm.entry(name)`` any
    entries: list[EntrySignature]
    #: what the target compiled (``mxmoe.runtime.code``: IreeCode or TritonCode)
    code: IreeCode | TritonCode
    #: the stored arrays by parameter name (padded, in the target's layout); empty in a template without weights
    parameters: dict[str, np.ndarray]
    mlir: str
    #: each parameter's stored name, dtype and shape (kept when the arrays are not)
    parameter_specs: list[TensorSpec] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: per weight global: how the stored array was made from the logical one (padding, layout)
    stored_forms: dict[str, StoredForm] = field(default_factory=dict)
    #: what was compiled, when known: {"kind": "moe", "config": ..., "parameters": {field: global}} for an MoE layer
    model: dict | None = None
    _bound: EntryPoints | None = None

    @property
    def entry_names(self) -> list[str]:
        """The entries' names, the default first (as a loaded artifact's module lists them)."""
        return [e.name for e in self.entries]

    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self.entries[0].inputs)

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self.entries[0].outputs)

    # the code's parts under the names callers know them by
    @property
    def vmfb(self) -> bytes | None:
        return getattr(self.code, "vmfb", None)

    @property
    def kernel_plan(self) -> dict | None:
        return getattr(self.code, "plan", None)

    @property
    def binaries(self) -> dict[str, bytes]:
        return getattr(self.code, "binaries", {})

    @property
    def interpret(self) -> bool:
        return getattr(self.code, "interpret", False)

    def without_weights(self) -> "CompiledModule":
        """A copy that holds no parameters (the torch.compile backend binds each layer's own)."""
        return dataclasses.replace(self, parameters={}, _bound=None)

    def with_parameters(self, parameters: dict[str, np.ndarray]) -> "CompiledModule":
        return dataclasses.replace(self, parameters=parameters, _bound=None)

    def save(self, path, weights: str = "embedded", **options) -> dict:
        """Write this module as one mxmoe artifact file (docs/artifact-format.md); returns its manifest."""
        options.setdefault("model", self.model)
        return save_module(path, target=self.target.record(self.code, self.mlir), code=self.code, entries=self.entries,
                           parameter_specs=self.parameter_specs,
                           parameters=self.parameters or None, stored_forms=self.stored_forms, weights=weights,
                           timings=self.timings, **options)

    def bound(self) -> EntryPoints:
        """This module with its parameters bound to an executor on this machine (made once)."""
        if self._bound is None:
            record = self.target.record(self.code, self.mlir)
            self.code.check_runnable(record)  # TargetUnavailableError (a RuntimeError) naming what is missing
            self._bound = EntryPoints(self.entries, self.code, self.code.executor(self.parameters, record),
                                      weight_bytes=sum(p.static_nbytes() for p in self.parameter_specs))
        return self._bound

    def executor(self):
        return self.bound().executor

    def entry(self, name: str):
        """Entry point ``name`` (e.g. "modular") as a callable module."""
        return self.bound().entry(name)

    def __call__(self, *args):
        return self.bound()(*args)


def compile_program(program, target: str | Target = "cpu", *,
                    extra_flags: Sequence[str] | None = None, interpret: bool = False, model: dict | None = None,
                    timings: dict[str, float] | None = None, deterministic: bool | None = None,
                    batch_invariant: bool = False, activations: str | None = None) -> CompiledModule:
    """Compile an ``ExportedProgram`` (mxmoe custom ops inside, token dims dynamic) for ``target``; or several, as
    ``{entry name: ExportedProgram}``, into one module whose entries share one set of weights (the first is the
    default).

    ``activations``: the form the expert GEMMs take the activations in, where the target has more than one
    ("mxfp8" on rocm:gfx950: its scaled MFMA, docs/amd.md); default: as the layer has them.
    ``interpret=True`` (cuda targets only): skip the cubins; the module runs the plan's Triton kernels
    under Triton's interpreter on CPU tensors. ``deterministic=True``: the same input gives the same output bits
    on every call (None: the target's default; the cuda and cpu targets are deterministic unless told
    ``deterministic=False``); ``batch_invariant=True`` (implies it): a token's output bits do not depend on the other tokens of
    its batch (docs/routing.md; what each target does for them, and what it records, is the target's). ``model`` describes the layer for reference checks (see
    ``mxmoe.core.weights.moe_model_info``). ``mxmoe.compile`` (which also takes an ``nn.Module``) calls this.
    """
    tgt = get_target(target)
    if activations is not None:
        tgt = tgt.with_activations(activations)
    tgt.check_options(extra_flags=list(extra_flags or []), interpret=interpret)
    numerics = tgt.numerics_options(deterministic=None if deterministic is None else bool(deterministic),
                                    batch_invariant=bool(batch_invariant))
    programs = program if isinstance(program, dict) else {"main": program}
    for name, ep in programs.items():
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"compile: expected a torch.export.ExportedProgram, got {type(ep).__name__}"
                            + (f" for entry {name!r}" if len(programs) > 1 else ""))
    tgt.check_entries(list(programs))
    timings = {} if timings is None else timings
    entries = [signature_of(ep, name) for name, ep in programs.items()]

    t0 = time.perf_counter()
    ctx = new_context()
    imported = import_programs(programs, context=ctx)
    timings["import_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    run_passes(imported.module, tgt.passes())
    forms = stored_forms(imported.module.operation)
    parameters = store_parameters(forms, imported.parameters)
    mlir = str(imported.module)
    timings["passes_s"] = time.perf_counter() - t0

    code = tgt.compile(imported.module, parameters, extra_flags=list(extra_flags or []), interpret=interpret,
                       timings=timings, default_entry=entries[0].name, **numerics)
    specs = [TensorSpec(name, dtype_name(a.dtype), tuple(a.shape)) for name, a in parameters.items()]
    return CompiledModule(tgt, entries, code, parameters, mlir, specs, timings, stored_forms=forms, model=model)
