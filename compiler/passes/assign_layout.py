"""mxmoe-assign-layout: record on every grouped matmul the weight layout its target's lowering reads.

Matches ``mxmoe.grouped_matmul*`` ops and sets ``mxmoe.layout`` (a string naming a layout in
``mxmoe.runtime.layouts``) from the target. The artifact writer transforms the weights with that
layout at compile time and stores its name in the manifest, so the runtime never guesses. An op
that already carries a different layout than the target wants is rejected.
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import OpView

NAME = "mxmoe-assign-layout"
ATTR = "mxmoe.layout"


def make(layout: str):
    def run(module_op: ir.Operation) -> None:
        for op in dialect.walk_mxmoe(module_op):
            if not op.name.startswith("mxmoe.grouped_matmul"):
                continue
            if ATTR in op.attributes:
                have = dialect.py_attr(op.attributes[ATTR])
                if have != layout:
                    OpView(op).fail(f"already has weight layout '{have}', but the target needs '{layout}'")
            op.attributes[ATTR] = ir.StringAttr.get(layout)

    return run
