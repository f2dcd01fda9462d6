"""The router's logits rounded once on the IREE targets (docs/routing.md: ``round_A(sum x w + b)``).

torch exports a bf16 router as ``aten.linear`` in bf16, and IREE lowers that to a matmul rounded to bf16 followed
by the bias added and rounded again: two roundings, which put a logit one ulp off the contract's in a good share
of tokens and so moved near-tied tokens to other experts than the reference's. Rewritten here, before the route is
lowered, as the same linear on fp32 casts (bf16 and f16 products are exact in fp32) and one cast of its result
back to the activation type. The Triton path never sees this rewrite: its router kernels round once themselves.
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler.dialect import producer

#: torch's ScalarType codes of the activation types this applies to (c10/core/ScalarType.h)
_CODES = {"bf16": 15, "f16": 5}
_F32 = 6


def _element(t: ir.Type) -> str:
    """The element type of a ``!torch.vtensor<[...],el>``."""
    return str(t).rsplit(",", 1)[-1].rstrip(">")


def _with_element(t: ir.Type, el: str) -> ir.Type:
    text = str(t)
    return ir.Type.parse(text[: text.rindex(",") + 1] + el + ">")


def _const(name: str, ty: str, value=None) -> ir.Value:
    attrs = {} if value is None else {"value": value}
    return ir.Operation.create(f"torch.constant.{name}", results=[ir.Type.parse(ty)], attributes=attrs).result


def _to(v: ir.Value, code: int, el: str) -> ir.Value:
    """``torch.aten.to.dtype`` of ``v`` to ScalarType ``code`` (element ``el``)."""
    dtype = _const("int", "!torch.int", ir.IntegerAttr.get(ir.IntegerType.get_signless(64), code))
    false = _const("bool", "!torch.bool", ir.BoolAttr.get(False))
    none = _const("none", "!torch.none")
    return ir.Operation.create("torch.aten.to.dtype", results=[_with_element(v.type, el)],
                               operands=[v, dtype, false, false, none]).result


def round_router_once(route: ir.Operation) -> None:
    """Rewrite the bf16/f16 ``aten.linear`` whose logits ``route`` reads (through ``torch_c.to_builtin_tensor``)
    into one rounding; anything else (an fp32 router, logits from an entry argument) is left as it is."""
    bridge = producer(route.operands[0], "torch_c.to_builtin_tensor")
    linear = None if bridge is None else producer(bridge.operands[0], "torch.aten.linear")
    if linear is None:
        return
    el = _element(linear.results[0].type)
    if el not in _CODES:
        return
    with ir.InsertionPoint(linear), linear.location:
        x, w, b = linear.operands
        operands = [_to(x, _F32, "f32"), _to(w, _F32, "f32"),
                    b if str(b.type) == "!torch.none" else _to(b, _F32, "f32")]
        wide = ir.Operation.create("torch.aten.linear", results=[_with_element(linear.results[0].type, "f32")],
                                   operands=operands).result
        linear.results[0].replace_all_uses_with(_to(wide, _CODES[el], el))
    linear.erase()
