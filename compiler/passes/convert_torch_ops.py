"""mxmoe-convert-torch-ops: ``torch.operator "torch.mxmoe.*"`` -> mxmoe dialect ops on builtin tensors.

Matches the custom-op calls torch.export left in the graph (one per ``mxmoe::`` op), reads their
scalar arguments from the ``torch.constant.*`` ops that feed them into attributes, and bridges
tensor operands and results with ``torch_c.to_builtin_tensor`` / ``torch_c.from_builtin_tensor``.
A weight that came from a global through ``from_builtin_tensor`` is used directly (the bridge,
once unused, is erased). Every other
torch op is left alone for IREE's torch input pipeline. A custom-op call whose scalar arguments are
not constants is rejected with a diagnostic naming the argument.
"""

from __future__ import annotations

import re

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import VerifyError

NAME = "mxmoe-convert-torch-ops"

# torch custom op -> (mxmoe op, operand roles). "T" tensor, "T?" optional tensor, else an attribute name.
_SIGNATURES = {
    "torch.mxmoe.route": ("mxmoe.route", ("T", "top_k", "routing", "renormalize")),
    "torch.mxmoe.mxfp4_grouped_matmul": ("mxmoe.grouped_matmul", ("T", "T", "T", "T", "T?")),
    "torch.mxmoe.glu": ("mxmoe.glu", ("T", "activation", "alpha", "limit", "interleaved")),
    "torch.mxmoe.combine": ("mxmoe.combine", ("T", "T")),
}
_ELEMENTS = {"ui8": "i8", "si8": "i8", "si32": "i32", "si64": "i64", "bf16": "bf16", "f16": "f16", "f32": "f32",
             "i1": "i1"}
_VTENSOR = re.compile(r"!torch\.vtensor<\[([^\]]*)\],(\w+)>")


def builtin_type(t: ir.Type) -> ir.Type:
    m = _VTENSOR.fullmatch(str(t))
    if not m or m.group(2) not in _ELEMENTS:
        raise VerifyError(f"cannot map {t} to a builtin tensor type")
    dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
    dims = ["?" if d in ("?", "-1") else d for d in dims]
    return ir.Type.parse(f"tensor<{'x'.join(dims + [_ELEMENTS[m.group(2)]])}>")


def _constant(v: ir.Value):
    op = v.owner
    if not isinstance(op, ir.Operation):
        op = getattr(op, "operation", op)
    if op.name == "torch.constant.none":
        return None
    if op.name in ("torch.constant.int", "torch.constant.float", "torch.constant.str", "torch.constant.bool"):
        return dialect.py_attr(op.attributes["value"])
    raise VerifyError(f"{op.location}: expected a torch constant, got '{op.name}'")


def _to_builtin(v: ir.Value) -> ir.Value:
    owner = v.owner
    if isinstance(owner, ir.OpView):
        owner = owner.operation
    if isinstance(owner, ir.Operation) and owner.name == "torch_c.from_builtin_tensor":
        return owner.operands[0]
    return ir.Operation.create("torch_c.to_builtin_tensor", results=[builtin_type(v.type)], operands=[v]).result


def convert_op(op: ir.Operation) -> None:
    callee = dialect.py_attr(op.attributes["name"])
    name, roles = _SIGNATURES[callee]
    if len(op.operands) != len(roles):
        raise VerifyError(f"{op.location}: {callee} expects {len(roles)} arguments, got {len(op.operands)}")
    with ir.InsertionPoint(op), op.location:
        operands, attrs = [], {}
        for role, v in zip(roles, op.operands):
            if role in ("T", "T?"):
                if role == "T?" and str(v.type) == "!torch.none":
                    continue
                operands.append(_to_builtin(v))
            else:
                try:
                    attrs[role] = _constant(v)
                except VerifyError as e:
                    raise VerifyError(f"{e} for argument '{role}' of {callee} (scalars must be compile-time constants)")
        if name == "mxmoe.grouped_matmul":
            attrs["has_bias"] = len(operands) == 5
        if name == "mxmoe.glu":
            attrs["alpha"], attrs["limit"] = float(attrs["alpha"]), float(attrs["limit"])
        new = dialect.create(name, operands, [builtin_type(r.type) for r in op.results], attrs, loc=op.location)
        for old, res in zip(op.results, new.results):
            back = ir.Operation.create("torch_c.from_builtin_tensor", results=[old.type], operands=[res]).result
            old.replace_all_uses_with(back)
    op.erase()


def run(module_op: ir.Operation) -> None:
    found = []

    def visit(op):
        if op.name == "torch.operator":
            callee = dialect.py_attr(op.attributes["name"])
            if callee.startswith("torch.mxmoe."):
                if callee not in _SIGNATURES:
                    raise VerifyError(f"{op.location}: unknown mxmoe custom op '{callee}'")
                found.append(op)
        return ir.WalkResult.ADVANCE

    module_op.walk(visit)
    for op in found:
        convert_op(op)
    _erase_dead_bridges(module_op)


def _erase_dead_bridges(module_op: ir.Operation) -> None:
    """Drop ``from_builtin_tensor`` ops left unused once mxmoe ops read a global's value directly."""
    dead = []

    def visit(op):
        if op.name == "torch_c.from_builtin_tensor" and not list(op.results[0].uses):
            dead.append(op)
        return ir.WalkResult.ADVANCE

    module_op.walk(visit)
    for op in dead:
        op.erase()
