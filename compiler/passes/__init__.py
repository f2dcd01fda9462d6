"""mxmoe's MLIR passes: Python-defined passes run by MLIR's PassManager, one module each.

Each pass module has ``NAME`` and a ``run(module_op)`` (or a ``make(option)`` factory for passes
with an option); its docstring says what it matches and what it produces. Passes raise
:class:`~mxmoe.compiler.dialect.VerifyError` with a location-prefixed message; :func:`run_passes`
re-raises it after the PassManager stops, so callers see the diagnostic, not a generic failure.
"""

from __future__ import annotations

from typing import Callable

from iree.compiler import ir, passmanager

from mxmoe.compiler.dialect import VerifyError
from mxmoe.compiler.passes import assign_layout, convert_torch_ops, fuse, lower_to_linalg, pad, verify

#: name -> factory(option string or None) -> pass callable(module_op)
REGISTRY: dict[str, Callable[[str | None], Callable]] = {
    convert_torch_ops.NAME: lambda opt: convert_torch_ops.run,
    verify.NAME: lambda opt: verify.run,
    fuse.NAME: lambda opt: fuse.run,
    pad.NAME: lambda opt: pad.make(opt or "32"),
    assign_layout.NAME: lambda opt: assign_layout.make(opt or "mxfp4-rowmajor"),
    lower_to_linalg.NAME: lambda opt: lower_to_linalg.run,
}

DESCRIPTIONS = {m.NAME: (m.__doc__ or "").strip().split("\n")[0] for m in
                (convert_torch_ops, verify, fuse, pad, assign_layout, lower_to_linalg)}


def parse_pipeline(spec: str) -> list[tuple[str, str | None]]:
    """``"a,b{opt},c"`` -> [("a", None), ("b", "opt"), ("c", None)]; upstream passes pass through."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, opt = item.partition("{")
        out.append((name, opt.rstrip("}") or None if opt else None))
    return out


def run_passes(module: ir.Module, pipeline: list[tuple[str, str | None]] | str) -> None:
    """Run mxmoe passes (and upstream ones such as ``canonicalize``/``cse``) on ``module`` in place."""
    if isinstance(pipeline, str):
        pipeline = parse_pipeline(pipeline)
    errors: list[Exception] = []
    with module.context:
        pm = passmanager.PassManager("builtin.module")
        for name, opt in pipeline:
            if name in REGISTRY:
                fn = REGISTRY[name](opt)

                def wrapped(op, pass_, fn=fn):
                    try:
                        fn(op.operation if hasattr(op, "operation") else op)
                    except Exception as e:  # re-raised below, with its own traceback
                        errors.append(e)
                        pass_.signal_pass_failure()

                pm.add(wrapped, name=name, argument=name)
            else:
                try:
                    pm.add(name if opt is None else f"{name}{{{opt}}}")
                except ValueError:
                    raise VerifyError(f"unknown pass '{name}' (mxmoe passes: {', '.join(REGISTRY)})") from None
        try:
            pm.run(module.operation)
        except Exception as e:
            if errors:
                raise errors[0] from None
            raise VerifyError(f"pass pipeline failed: {e}") from None
        if errors:
            raise errors[0]
