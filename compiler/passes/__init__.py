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

def _no_option(module, opt: str | None) -> Callable:
    if opt is not None:
        raise VerifyError(f"pass '{module.NAME}' takes no option, got '{{{opt}}}'")
    return module.run


#: name -> factory(option string or None) -> pass callable(module_op)
REGISTRY: dict[str, Callable[[str | None], Callable]] = {
    convert_torch_ops.NAME: lambda opt: _no_option(convert_torch_ops, opt),
    verify.NAME: lambda opt: _no_option(verify, opt),
    fuse.NAME: lambda opt: _no_option(fuse, opt),
    pad.NAME: lambda opt: pad.make(opt or "32"),
    assign_layout.NAME: lambda opt: assign_layout.make(opt or "mxfp4-rowmajor"),
    lower_to_linalg.NAME: lower_to_linalg.make,
}

DESCRIPTIONS = {m.NAME: (m.__doc__ or "").strip().split("\n")[0] for m in
                (convert_torch_ops, verify, fuse, pad, assign_layout, lower_to_linalg)}


def parse_pipeline(spec: str) -> list[tuple[str, str | None]]:
    """``"a,b{opt},c{x=1,y=2}"`` -> [("a", None), ("b", "opt"), ("c", "x=1,y=2")]; upstream passes pass through.

    Commas inside braces belong to the option; unbalanced braces are an error.
    """
    items, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            raise VerifyError(f"pass pipeline '{spec}': unbalanced '}}'")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise VerifyError(f"pass pipeline '{spec}': unbalanced '{{'")
    items.append(cur)
    out = []
    for item in filter(None, (s.strip() for s in items)):
        name, brace, opt = item.partition("{")
        if brace and not opt.endswith("}"):
            raise VerifyError(f"pass pipeline '{spec}': text after the option of '{name}'")
        out.append((name.strip(), opt[:-1] if brace else None))
    return out


def _add_upstream(pm, name: str, opt: str | None) -> None:
    """Add an upstream MLIR pass, naming the problem when it is unknown or its option is bad."""
    try:
        pm.add(name if opt is None else f"{name}{{{opt}}}")
    except (ValueError, ir.MLIRError) as e:
        if opt is not None:
            try:
                passmanager.PassManager("builtin.module").add(name)
            except (ValueError, ir.MLIRError):
                pass
            else:
                raise VerifyError(f"bad option '{{{opt}}}' for pass '{name}': {str(e).strip()}") from None
        raise VerifyError(f"unknown pass '{name}' (mxmoe passes: {', '.join(REGISTRY)}; or an upstream MLIR pass)") from None


def check_pipeline(pipeline: list[tuple[str, str | None]] | str) -> list[tuple[str, str | None]]:
    """Parse and check a pipeline without running it: unknown passes and bad options raise VerifyError."""
    from mxmoe.compiler.context import new_context

    if isinstance(pipeline, str):
        pipeline = parse_pipeline(pipeline)
    with new_context():
        pm = passmanager.PassManager("builtin.module")
        for name, opt in pipeline:
            if name in REGISTRY:
                REGISTRY[name](opt)
            else:
                _add_upstream(pm, name, opt)
    return pipeline


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
                _add_upstream(pm, name, opt)
        try:
            pm.run(module.operation)
        except Exception as e:
            if errors:
                raise errors[0] from None
            raise VerifyError(f"pass pipeline failed: {e}") from None
        if errors:
            raise errors[0]
