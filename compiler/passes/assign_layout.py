"""mxmoe-assign-layout: record on every grouped matmul the weight layout its target's lowering reads.

Matches ``mxmoe.grouped_matmul*`` ops and sets ``mxmoe.layout`` (a string naming a layout in
``mxmoe.core.layouts``) from the target, on the op and on the ``util.global`` of each of its weights, with
``mxmoe.weight_role`` ("values", "scales", "bias") on the global. The compiler transforms the stored
weights with that layout at compile time and the artifact's manifest records it, so the runtime never
guesses. An op or a weight global that already carries a different layout is rejected.

Option: ``LAYOUT``, or ``LAYOUT,ELEM=OTHER,...``: ops whose activations (operand 0) have element type ELEM get
OTHER (the cpu target on AMX hosts keeps bf16 layers' weights in ``cpu-mxfp4-rows16``, the others in its
blocksplit layout).
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import OpView
from mxmoe.core.layouts import known_layouts

NAME = "mxmoe-assign-layout"
ATTR, ROLE = dialect.LAYOUT_ATTR, dialect.ROLE_ATTR
#: operand index -> role of the weight it carries, for every grouped matmul form (bias only with has_bias)
ROLES = {2: "values", 3: "scales", 4: "bias"}


def _parse(option: str) -> tuple[str, dict[str, str]]:
    """(default layout, {activation element type: layout}) of the pass option."""
    default, *rest = (part.strip() for part in option.split(","))
    by_type = {}
    for item in rest:
        elem, eq, layout = (part.strip() for part in item.partition("="))
        if not eq or not elem or not layout:
            raise dialect.VerifyError(f"mxmoe-assign-layout: bad option item '{item}' (expected ELEM=LAYOUT)")
        by_type[elem] = layout
    for layout in (default, *by_type.values()):
        if layout not in known_layouts():
            raise dialect.VerifyError(f"mxmoe-assign-layout: unknown layout '{layout}' "
                                      f"(known: {', '.join(known_layouts())})")
    return default, by_type


def make(option: str):
    default, by_type = _parse(option)

    def run(module_op: ir.Operation) -> None:
        for op in dialect.walk_mxmoe(module_op):
            if not op.name.startswith("mxmoe.grouped_matmul"):
                continue
            dialect.verify_op(op)  # a malformed op gets its diagnostic, not a KeyError/IndexError below
            layout = by_type.get(str(ir.RankedTensorType(op.operands[0].type).element_type), default)
            if ATTR in op.attributes:
                have = dialect.py_attr(op.attributes[ATTR])
                if have != layout:
                    OpView(op).fail(f"already has weight layout '{have}', but the target needs '{layout}'")
            op.attributes[ATTR] = ir.StringAttr.get(layout)
            for index, role in ROLES.items():
                if role == "bias" and not dialect.py_attr(op.attributes["has_bias"]):
                    continue
                gop = dialect.global_of(module_op, op.operands[index])
                if gop is None:
                    continue
                if ATTR in gop.attributes and dialect.py_attr(gop.attributes[ATTR]) != layout:
                    OpView(op).fail(f"weight global {dialect.py_attr(gop.attributes['sym_name'])} is already stored "
                                    f"in layout '{dialect.py_attr(gop.attributes[ATTR])}', but this op needs '{layout}'")
                gop.attributes[ATTR] = ir.StringAttr.get(layout)
                gop.attributes[ROLE] = ir.StringAttr.get(role)

    return run
