"""mxmoe-fuse: fold epilogues into the grouped matmuls that feed them.

* ``grouped_matmul`` whose only user is a ``glu`` -> ``grouped_matmul_glu`` (bias was already an
  operand; the activation moves into the matmul's epilogue).
* ``grouped_matmul`` whose only user is ``combine`` (as its ``y``) -> ``grouped_matmul_combine``
  taking the routing weights: the routing-weight multiply and the sum over k happen in the epilogue,
  so the [T, k, H] expert outputs never need to exist as a tensor.

A matmul with more than one user is left alone (fusing would recompute it).
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect

NAME = "mxmoe-fuse"


def _only_user(value: ir.Value):
    users = [u.owner for u in value.uses]
    if len(users) != 1:
        return None
    u = users[0]
    return u.operation if isinstance(u, ir.OpView) else u


def _attrs(op: ir.Operation) -> dict:
    return {n: dialect.py_attr(op.attributes[n]) for n in op.attributes if not n.startswith("mxmoe.")}


def run(module_op: ir.Operation) -> None:
    # Collect the matmuls up front: a fusion erases the matmul and its user, and a handle to an erased
    # op must never be touched again (the bindings do not invalidate other handles to it).
    matmuls = [op for op in dialect.walk_mxmoe(module_op) if op.name == "mxmoe.grouped_matmul"]
    for op in matmuls:
        user = _only_user(op.results[0])
        if user is None:
            continue
        attrs = _attrs(op)
        extra = {n: op.attributes[n] for n in op.attributes if n.startswith("mxmoe.")}
        if user.name == "mxmoe.glu":
            name, operands = "mxmoe.grouped_matmul_glu", list(op.operands)
            attrs.update(_attrs(user))
        elif user.name == "mxmoe.combine" and user.operands[0] == op.results[0]:
            name, operands = "mxmoe.grouped_matmul_combine", list(op.operands) + [user.operands[1]]
        else:
            continue
        with ir.InsertionPoint(user), user.location:
            fused = dialect.create(name, operands, [user.results[0].type], attrs, loc=user.location)
        for k, a in extra.items():
            fused.attributes[k] = a
        user.results[0].replace_all_uses_with(fused.results[0])
        user.erase()
        op.erase()
