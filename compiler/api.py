"""``mxmoe.compile``: nn.Module or ExportedProgram -> a compiled, callable module for a target."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from mxmoe.compiler.compiled import CompiledModule  # noqa: F401  (re-exported: mxmoe.compiler.api.CompiledModule)
from mxmoe.compiler.context import new_context
from mxmoe.compiler.importer import import_programs
from mxmoe.compiler.parameters import store_parameters, stored_forms
from mxmoe.compiler.passes import run_passes
from mxmoe.compiler.targets import Target, get_target
from mxmoe.core.bridge import dtype_name
from mxmoe.core.signature import EntrySignature, TensorSpec



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
