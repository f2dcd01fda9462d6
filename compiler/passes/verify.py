"""mxmoe-verify: check every mxmoe op against its schema (mxmoe.compiler.dialect).

Matches all ``mxmoe.*`` ops; produces nothing. Fails with a diagnostic naming the op, its location
and the broken rule (operand shapes and element types, attributes, unknown op names).
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect

NAME = "mxmoe-verify"


def run(module_op: ir.Operation) -> None:
    for op in dialect.walk_mxmoe(module_op):
        dialect.verify_op(op)
