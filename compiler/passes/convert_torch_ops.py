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
    "torch.mxmoe.route": ("mxmoe.route", ("T", "top_k", "routing", "renormalize", "T?", "n_group", "topk_group",
                                          "scaling")),
    "torch.mxmoe.mxfp4_grouped_matmul": ("mxmoe.grouped_matmul", ("T", "T", "T", "T", "T?")),
    "torch.mxmoe.glu": ("mxmoe.glu", ("T", "activation", "alpha", "limit", "interleaved")),
    "torch.mxmoe.combine": ("mxmoe.combine", ("T", "T")),
    "torch.mxmoe.map_experts": ("mxmoe.map_experts", ("T", "T?", "num_global")),
    "torch.mxmoe.weight_rows": ("mxmoe.weight_rows", ("T", "T")),
}
#: trailing arguments a call may leave out (graphs exported before they existed): role -> the value it means then
_DEFAULTS = {"torch.mxmoe.route": {"T?": None, "n_group": 1, "topk_group": 1, "scaling": 1.0}}
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
    """The Python value of a ``torch.constant.{int,float,str,bool}``; ValueError naming what it is otherwise."""
    op = v.owner
    if isinstance(op, ir.OpView):
        op = op.operation
    if not isinstance(op, ir.Operation):
        raise ValueError("got a block argument")
    if op.name in ("torch.constant.int", "torch.constant.float", "torch.constant.str", "torch.constant.bool"):
        return dialect.py_attr(op.attributes["value"])
    raise ValueError(f"got the result of '{op.name}'")


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

    def fail(msg: str):
        raise VerifyError(f"{op.location}: {callee}: {msg}")

    defaults = _DEFAULTS.get(callee, {})
    if not len(roles) - len(defaults) <= len(op.operands) <= len(roles):
        fewest = len(roles) - len(defaults)
        fail(f"expects {fewest if not defaults else f'{fewest} to {len(roles)}'} arguments, got {len(op.operands)}")
    attrs = {role: defaults[role] for role in roles[len(op.operands):] if role != "T?"}
    roles = roles[:len(op.operands)]
    # Check every argument before creating anything: bad arguments are reported before the IR is touched.
    for i, (role, v) in enumerate(zip(roles, op.operands)):
        if role in ("T", "T?"):
            if str(v.type) == "!torch.none" and role == "T":
                fail(f"argument #{i} must be a tensor, got None")
            if str(v.type) != "!torch.none" and not _VTENSOR.fullmatch(str(v.type)):
                fail(f"argument #{i} must be a value tensor with known sizes and dtype, got {v.type}")
            continue
        try:
            attrs[role] = _constant(v)
        except ValueError as e:
            fail(f"argument '{role}' must be a compile-time constant, {e}")
    for role in ("alpha", "limit", "scaling"):
        if role in attrs:
            if isinstance(attrs[role], bool) or not isinstance(attrs[role], (int, float)):
                fail(f"argument '{role}' must be a number, got {attrs[role]!r}")
            attrs[role] = float(attrs[role])
    try:
        result_types = [builtin_type(r.type) for r in op.results]
        for v in op.operands:
            if _VTENSOR.fullmatch(str(v.type)):
                builtin_type(v.type)
    except VerifyError as e:
        fail(str(e))
    with ir.InsertionPoint(op), op.location:
        operands = []
        for role, v in zip(roles, op.operands):
            if role in ("T", "T?") and str(v.type) != "!torch.none":
                operands.append(_to_builtin(v))
        if name == "mxmoe.grouped_matmul":
            attrs["has_bias"] = len(operands) == 5
        if name == "mxmoe.map_experts":
            attrs["has_map"] = len(operands) == 2
        if name == "mxmoe.route":
            # the routing's optional attributes are written only where they differ from what their absence means
            if len(operands) == 2:
                attrs["has_score_bias"] = True
            for role, default in _DEFAULTS[callee].items():
                if role in attrs and attrs[role] == default:
                    del attrs[role]
        new = dialect.create(name, operands, result_types, attrs, loc=op.location)
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
                found.append(op)
        return ir.WalkResult.ADVANCE

    # Raise only after the walk: an exception inside a walk callback reaches the caller as a RuntimeError.
    module_op.walk(visit)
    for op in found:
        callee = dialect.py_attr(op.attributes["name"])
        if callee not in _SIGNATURES:
            raise VerifyError(f"{op.location}: unknown mxmoe custom op '{callee}' (known: {', '.join(_SIGNATURES)})")
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
