"""The MLIR context mxmoe works in: IREE's dialects plus unregistered (mxmoe) ops."""

from __future__ import annotations

from iree.compiler import ir


def new_context() -> ir.Context:
    ctx = ir.Context()
    # mxmoe ops are generic ops whose schema lives in mxmoe.compiler.dialect (no IRDL in this build).
    ctx.allow_unregistered_dialects = True
    return ctx


def parse_module(text: str, context: ir.Context | None = None) -> ir.Module:
    ctx = context or new_context()
    with ctx, ir.Location.unknown():
        return ir.Module.parse(text)
