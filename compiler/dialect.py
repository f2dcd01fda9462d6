"""The mxmoe dialect: op schemas, verifiers and builders, in one place.

This IREE build has no IRDL, so mxmoe ops are *unregistered* MLIR ops (generic form,
``"mxmoe.route"(...) {...}``) whose contract lives here, in Python. Every pass builds ops through
:func:`create` and checks them through :func:`verify_op`, so the schema cannot drift between passes.

Ops (``T`` is the dynamic token count, ``k`` the experts per token, weights are packed MXFP4 bytes as i8)::

  mxmoe.route(logits: T x E x f[, score_bias: E x f32])  -> (weights: T x k x f32, ids: T x k x i32)
      {top_k, routing, renormalize; optional: has_score_bias (false), n_group (1), topk_group (1), scaling (1.0)}
      (docs/routing.md; score_bias, n_group and topk_group are "sigmoid_topk"'s)
  mxmoe.grouped_matmul(x, ids, w, w_scale[, bias])       -> T x k x N x f
      x: T x K x f (shared by the k slots) or T x k x K x f; w: E x N x K/2 x i8; w_scale: E x N x K/32 x i8;
      bias: E x N x f. fp32 accumulation, rounded to x's element type.  {has_bias}
  mxmoe.glu(h: ... x 2I x f)                              -> ... x I x f  {activation, alpha, limit, interleaved}
  mxmoe.combine(y: T x k x H x f, weights: T x k x f32)   -> T x H x f
  mxmoe.grouped_matmul_glu(...)      fused by `mxmoe-fuse`: grouped_matmul followed by glu (glu attrs)
  mxmoe.grouped_matmul_combine(x, ids, w, w_scale[, bias], weights) -> T x H x f
      fused by `mxmoe-fuse`: grouped_matmul followed by combine
  mxmoe.map_experts(ids: T x k x i32|i64[, map: G x i32]) -> T x k x i32   {num_global, has_map}
      global expert ids -> this layer's; -1 for another rank's expert or an id outside [0, G)
  mxmoe.weight_rows(x: T x H x f, weights: T x k x f32) -> T x k x H x f
      the routing weight (rounded to f) times the token, rounded to f (router weight on input)

A grouped matmul's row whose id is -1 is 0 (no bias): that slot adds nothing to the combine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from iree.compiler import ir

from mxmoe.core.config import ACTIVATIONS, MXFP4_BLOCK, RENORMALIZABLE, ROUTINGS

#: Attributes the passes record on weight globals and grouped matmuls (``compiler.parameters`` reads them back as
#: each weight's stored form): its layout (mxmoe-assign-layout), its role in a matmul, and how it was padded
#: (mxmoe-pad: the logical shape, the fill value, and whether the gate and up halves were padded apart).
LAYOUT_ATTR = "mxmoe.layout"
ROLE_ATTR = "mxmoe.weight_role"
PADDED_FROM_ATTR = "mxmoe.padded_from"
PAD_VALUE_ATTR = "mxmoe.pad_value"
PAD_HALVES_ATTR = "mxmoe.pad_halves"

DYN = ir.ShapedType.get_dynamic_size() if hasattr(ir.ShapedType, "get_dynamic_size") else -9223372036854775808


class VerifyError(ValueError):
    """An mxmoe op broke its contract; the message starts with the op's location."""


@dataclass(frozen=True)
class OpSchema:
    name: str
    attrs: dict[str, type]
    verify: Callable[["OpView"], None]
    summary: str
    #: attributes an op may leave out: name -> (type, the value it means then)
    optional: dict[str, tuple[type, object]] = field(default_factory=dict)
    #: the operands (by index; negative from the end) whose leading dim is the token count, as is every result's
    tokens: tuple[int, ...] = (0,)


class OpView:
    """Typed access to a generic mxmoe op: attributes as Python values, operand types as shapes."""

    def __init__(self, op: ir.Operation):
        self.op = op
        self.name = op.name

    def attr(self, name: str):
        if name not in self.op.attributes:
            schema = SCHEMAS.get(self.name)
            if schema is not None and name in schema.optional:
                return schema.optional[name][1]
            self.fail(f"missing attribute '{name}'")
        try:
            return py_attr(self.op.attributes[name])
        except TypeError:
            self.fail(f"attribute '{name}' must be a bool, integer, float or string, got {self.op.attributes[name]}")

    def operand_types(self) -> list[ir.RankedTensorType]:
        out = []
        for i, v in enumerate(self.op.operands):
            if not isinstance(v.type, ir.RankedTensorType):
                self.fail(f"operand #{i} must be a ranked tensor, got {v.type}")
            out.append(ir.RankedTensorType(v.type))
        return out

    def result_types(self) -> list[ir.RankedTensorType]:
        out = []
        for i, r in enumerate(self.op.results):
            if not isinstance(r.type, ir.RankedTensorType):
                self.fail(f"result #{i} must be a ranked tensor, got {r.type}")
            out.append(ir.RankedTensorType(r.type))
        return out

    def fail(self, msg: str):
        raise VerifyError(f"{self.op.location}: '{self.name}' op {msg}")


def py_attr(a: ir.Attribute):
    for cls in (ir.BoolAttr, ir.IntegerAttr, ir.FloatAttr, ir.StringAttr):
        if isinstance(a, cls):
            return a.value
    raise TypeError(f"unsupported attribute {a}")


def py_attr_symbol(a: ir.Attribute) -> str:
    """The name a FlatSymbolRefAttr (``@name``) refers to."""
    return ir.FlatSymbolRefAttr(a).value


def producer(value: ir.Value, name: str) -> ir.Operation | None:
    """The op that defines ``value`` when it is a ``name`` op; None for a block argument or any other op."""
    owner = value.owner
    owner = owner.operation if isinstance(owner, ir.OpView) else owner
    return owner if isinstance(owner, ir.Operation) and owner.name == name else None


def global_of(module_op: ir.Operation, value: ir.Value) -> ir.Operation | None:
    """The ``util.global`` whose ``util.global.load`` produced ``value``; None for any other value."""
    owner = producer(value, "util.global.load")
    if owner is None:
        return None
    name = py_attr_symbol(owner.attributes["global"])
    for op in module_op.regions[0].blocks[0].operations:
        op = op.operation
        if op.name == "util.global" and py_attr(op.attributes["sym_name"]) == name:
            return op
    return None


def make_attr(value) -> ir.Attribute:
    if isinstance(value, bool):
        return ir.BoolAttr.get(value)
    if isinstance(value, int):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
    if isinstance(value, float):
        return ir.FloatAttr.get(ir.F32Type.get(), value)
    if isinstance(value, str):
        return ir.StringAttr.get(value)
    raise TypeError(f"cannot make an attribute from {value!r}")


def shape(t: ir.RankedTensorType) -> list[int | None]:
    return [None if t.is_dynamic_dim(i) else t.shape[i] for i in range(t.rank)]


def _is_float(t: ir.Type) -> bool:
    return isinstance(t, (ir.F32Type, ir.BF16Type, ir.F16Type))


def _is_int(t: ir.Type, width: int) -> bool:
    return isinstance(t, ir.IntegerType) and ir.IntegerType(t).width == width


def _same(a, b) -> bool:
    return a is None or b is None or a == b


# ------------------------------------------------------------------------------------ verifiers
def _verify_route(v: OpView) -> None:
    has_bias = v.attr("has_score_bias")
    ts = _n_operands(v, 1 + int(has_bias))
    logits = ts[0]
    if logits.rank != 2 or not _is_float(logits.element_type):
        v.fail(f"logits must be a rank-2 float tensor, got {logits}")
    k, routing, renorm = v.attr("top_k"), v.attr("routing"), v.attr("renormalize")
    n_group, topk_group, scaling = v.attr("n_group"), v.attr("topk_group"), v.attr("scaling")
    e = shape(logits)[1]
    if e is None:
        v.fail(f"logits must have a static number of experts, got {logits}")
    if not 0 < k <= e:
        v.fail(f"top_k={k} must be in 1..{e} (the number of experts)")
    if routing not in ROUTINGS:
        v.fail(f"routing must be one of {ROUTINGS}, got '{routing}'")
    if renorm and routing not in RENORMALIZABLE:
        v.fail(f"renormalize applies to routing {' or '.join(RENORMALIZABLE)}, not '{routing}'")
    if has_bias:
        if routing != "sigmoid_topk":
            v.fail(f"a score bias applies to routing 'sigmoid_topk', not '{routing}'")
        if shape(ts[1]) != [e] or not isinstance(ts[1].element_type, ir.F32Type):
            v.fail(f"score_bias must be {e} x f32, got {ts[1]}")
    if (n_group, topk_group) != (1, 1):
        if routing != "sigmoid_topk":
            v.fail(f"n_group/topk_group apply to routing 'sigmoid_topk', not '{routing}'")
        if n_group <= 0 or e % n_group or e // n_group < 2:
            v.fail(f"n_group={n_group} must divide the {e} experts into groups of 2 or more")
        if not 0 < topk_group <= n_group or k > topk_group * (e // n_group):
            v.fail(f"topk_group={topk_group} must be in 1..{n_group} and its groups hold top_k={k} experts")
    if not scaling > 0:
        v.fail(f"scaling must be positive, got {scaling}")
    res = _n_results(v, 2)
    if shape(res[0])[1:] != [k] or shape(res[1])[1:] != [k]:
        v.fail(f"results must be (T x {k} x f32, T x {k} x i32)")
    _same_tokens(v, logits, *res)
    if not isinstance(res[0].element_type, ir.F32Type) or not _is_int(res[1].element_type, 32):
        v.fail("results must be f32 weights and i32 ids")


def _matmul_operands(v: OpView, extra: int = 0):
    has_bias = v.attr("has_bias")
    ts = _n_operands(v, 4 + int(has_bias) + extra)
    x, ids, w, ws = ts[:4]
    bias = ts[4] if has_bias else None
    if not (_is_int(w.element_type, 8) and _is_int(ws.element_type, 8)):
        v.fail(f"w and w_scale must be i8 (packed MXFP4 / e8m0), got {w.element_type} and {ws.element_type}")
    if w.rank != 3 or ws.rank != 3:
        v.fail("w must be E x N x K/2 and w_scale E x N x K/32")
    e, n, kh = shape(w)
    if None in (e, n, kh):
        v.fail("weights must have static shapes")
    kk = 2 * kh
    if kk % MXFP4_BLOCK or shape(ws) != [e, n, kk // MXFP4_BLOCK]:
        v.fail(f"w_scale must be {e} x {n} x {kk // MXFP4_BLOCK} for w {e} x {n} x {kh} (K={kk} in blocks of 32)")
    if not _is_float(x.element_type) or x.rank not in (2, 3) or not _same(shape(x)[-1], kk):
        v.fail(f"x must be T x {kk} or T x k x {kk} float, got {x}")
    if ids.rank != 2 or not _is_int(ids.element_type, 32):
        v.fail(f"ids must be T x k x i32, got {ids}")
    if x.rank == 3 and not _same(shape(x)[1], shape(ids)[1]):
        v.fail(f"x {x} and ids {ids} disagree on k")
    _same_tokens(v, x, ids)
    if bias is not None and (shape(bias) != [e, n] or not _is_float(bias.element_type)):
        v.fail(f"bias must be {e} x {n} float, got {bias}")
    return x, ids, w, ws, bias, ts[4 + int(has_bias):]


def _verify_glu_attrs(v: OpView) -> None:
    if v.attr("activation") not in ACTIVATIONS:
        v.fail(f"activation must be one of {ACTIVATIONS}, got '{v.attr('activation')}'")
    v.attr("alpha"), v.attr("limit"), v.attr("interleaved")


def _verify_grouped_matmul(v: OpView) -> None:
    x, ids, w, _, _, _ = _matmul_operands(v)
    (r,) = _n_results(v, 1)
    if shape(r)[1:] != [shape(ids)[1], shape(w)[1]] or r.element_type != x.element_type:
        v.fail(f"result must be T x {shape(ids)[1]} x {shape(w)[1]} x {x.element_type}, got {r}")
    _same_tokens(v, ids, r)


def _verify_grouped_matmul_glu(v: OpView) -> None:
    x, ids, w, _, _, _ = _matmul_operands(v)
    _verify_glu_attrs(v)
    n = shape(w)[1]
    if n % 2:
        v.fail(f"N={n} must be even (gate and up)")
    (r,) = _n_results(v, 1)
    if shape(r)[1:] != [shape(ids)[1], n // 2] or r.element_type != x.element_type:
        v.fail(f"result must be T x {shape(ids)[1]} x {n // 2} x {x.element_type}, got {r}")
    _same_tokens(v, ids, r)


def _verify_grouped_matmul_combine(v: OpView) -> None:
    x, ids, w, _, _, (weights,) = _matmul_operands(v, extra=1)
    if weights.rank != 2 or shape(weights)[1:] != shape(ids)[1:] or not isinstance(weights.element_type, ir.F32Type):
        v.fail(f"weights must be T x k x f32 like ids, got {weights}")
    (r,) = _n_results(v, 1)
    if r.rank != 2 or shape(r)[1:] != [shape(w)[1]] or r.element_type != x.element_type:
        v.fail(f"result must be T x {shape(w)[1]} x {x.element_type}, got {r}")
    _same_tokens(v, ids, weights, r)


def _verify_map_experts(v: OpView) -> None:
    has_map = v.attr("has_map")
    ts = _n_operands(v, 1 + int(has_map))
    ids = ts[0]
    g = v.attr("num_global")
    if ids.rank != 2 or not (_is_int(ids.element_type, 32) or _is_int(ids.element_type, 64)):
        v.fail(f"ids must be T x k x i32 or i64, got {ids}")
    if g <= 0:
        v.fail(f"num_global must be positive, got {g}")
    if has_map and (shape(ts[1]) != [g] or not _is_int(ts[1].element_type, 32)):
        v.fail(f"map must be {g} x i32, got {ts[1]}")
    (r,) = _n_results(v, 1)
    if shape(r)[1:] != shape(ids)[1:] or not _is_int(r.element_type, 32):
        v.fail(f"result must be T x {shape(ids)[1]} x i32, got {r}")
    _same_tokens(v, ids, r)


def _verify_weight_rows(v: OpView) -> None:
    x, weights = _n_operands(v, 2)
    if x.rank != 2 or not _is_float(x.element_type):
        v.fail(f"x must be T x H float, got {x}")
    if weights.rank != 2 or not isinstance(weights.element_type, ir.F32Type):
        v.fail(f"weights must be T x k x f32, got {weights}")
    (r,) = _n_results(v, 1)
    if shape(r)[1:] != [shape(weights)[1], shape(x)[1]] or r.element_type != x.element_type:
        v.fail(f"result must be T x {shape(weights)[1]} x {shape(x)[1]} x {x.element_type}, got {r}")
    _same_tokens(v, x, weights, r)


def _verify_glu(v: OpView) -> None:
    (h,) = _n_operands(v, 1)
    _verify_glu_attrs(v)
    if h.rank == 0 or not _is_float(h.element_type):
        v.fail(f"input must be a float tensor of rank >= 1, got {h}")
    last = shape(h)[-1]
    if last is None or last % 2:
        v.fail(f"last dim must be static and even (gate and up), got {h}")
    (r,) = _n_results(v, 1)
    if shape(r)[:-1] != shape(h)[:-1] or shape(r)[-1] != last // 2 or r.element_type != h.element_type:
        v.fail(f"result must halve the last dim of {h}, got {r}")


def _verify_combine(v: OpView) -> None:
    y, weights = _n_operands(v, 2)
    if y.rank != 3 or weights.rank != 2 or not _same(shape(y)[1], shape(weights)[1]):
        v.fail(f"expects y T x k x H and weights T x k, got {y} and {weights}")
    if not _is_float(y.element_type) or not isinstance(weights.element_type, ir.F32Type):
        v.fail(f"expects float y and f32 weights, got {y} and {weights}")
    (r,) = _n_results(v, 1)
    if r.rank != 2 or shape(r)[1:] != shape(y)[2:] or r.element_type != y.element_type:
        v.fail(f"result must be T x {shape(y)[2]} x {y.element_type}, got {r}")
    _same_tokens(v, y, weights, r)


def _n_operands(v: OpView, n: int) -> list[ir.RankedTensorType]:
    ts = v.operand_types()
    if len(ts) != n:
        v.fail(f"expects {n} operands, got {len(ts)}")
    return ts


def _n_results(v: OpView, n: int) -> list[ir.RankedTensorType]:
    ts = v.result_types()
    if len(ts) != n:
        v.fail(f"expects {n} results, got {len(ts)}")
    return ts


def _same_tokens(v: OpView, *ts: ir.RankedTensorType) -> None:
    """All of ``ts`` agree on the token count T (their leading dim), where it is static."""
    dims = [shape(t)[0] for t in ts if t.rank]
    static = {d for d in dims if d is not None}
    if len(static) > 1:
        v.fail(f"operands and results disagree on the token count: {', '.join(str(t) for t in ts)}")


_GLU_ATTRS = {"activation": str, "alpha": float, "limit": float, "interleaved": bool}
SCHEMAS: dict[str, OpSchema] = {s.name: s for s in (
    OpSchema("mxmoe.route", {"top_k": int, "routing": str, "renormalize": bool}, _verify_route,
             "top-k expert selection and mixing weights",
             optional={"has_score_bias": (bool, False), "n_group": (int, 1), "topk_group": (int, 1),
                       "scaling": (float, 1.0)}),
    OpSchema("mxmoe.grouped_matmul", {"has_bias": bool}, _verify_grouped_matmul,
             "per (token, slot) MXFP4 matmul with the routed expert", tokens=(0, 1)),
    OpSchema("mxmoe.glu", dict(_GLU_ATTRS), _verify_glu, "gated activation of a fused gate/up projection"),
    OpSchema("mxmoe.combine", {}, _verify_combine, "weighted sum of a token's k expert outputs", tokens=(0, 1)),
    OpSchema("mxmoe.grouped_matmul_glu", {"has_bias": bool, **_GLU_ATTRS}, _verify_grouped_matmul_glu,
             "grouped_matmul with the glu fused into its epilogue", tokens=(0, 1)),
    OpSchema("mxmoe.grouped_matmul_combine", {"has_bias": bool}, _verify_grouped_matmul_combine,
             "grouped_matmul with routing weight and combine fused into its epilogue", tokens=(0, 1, -1)),
    OpSchema("mxmoe.map_experts", {"num_global": int, "has_map": bool}, _verify_map_experts,
             "global expert ids to this layer's (-1: not here)"),
    OpSchema("mxmoe.weight_rows", {}, _verify_weight_rows, "routing weight applied to the token before the experts",
             tokens=(0, 1)),
)}


def is_mxmoe(op) -> bool:
    return op.name.startswith("mxmoe.")


def verify_op(op: ir.Operation) -> None:
    schema = SCHEMAS.get(op.name)
    v = OpView(op)
    if schema is None:
        v.fail(f"is not an op of the mxmoe dialect (known: {', '.join(sorted(SCHEMAS))})")
    for name, ty in {**schema.attrs, **{n: t for n, (t, _) in schema.optional.items()}}.items():
        val = v.attr(name)
        if ty is float and isinstance(val, int) and not isinstance(val, bool):
            continue
        if not isinstance(val, ty) or (ty is int and isinstance(val, bool)):
            v.fail(f"attribute '{name}' must be {ty.__name__}, got {val!r}")
    schema.verify(v)


def create(name: str, operands: Sequence[ir.Value], result_types: Sequence[ir.Type], attrs: dict,
           loc: ir.Location | None = None) -> ir.Operation:
    """Build an mxmoe op at the current insertion point and verify it."""
    if name not in SCHEMAS:
        raise KeyError(f"unknown mxmoe op {name}")
    op = ir.Operation.create(name, results=list(result_types), operands=list(operands),
                             attributes={k: make_attr(v) for k, v in attrs.items()}, loc=loc)
    verify_op(op)
    return op


def _token_dynamic(t: ir.Type) -> ir.Type | None:
    """``t`` with its leading (token) dim made dynamic; None where it has none to generalise (rank < 2, dynamic)."""
    t = ir.RankedTensorType(t)
    if t.rank < 2 or t.is_dynamic_dim(0):
        return None
    return ir.RankedTensorType.get([DYN, *t.shape[1:]], t.element_type, t.encoding)


def _opaque_tokens(v: ir.Value, dyn: ir.Type) -> ir.Value:
    """``v`` as ``dyn`` through a token count iree-compile cannot see (an optimization barrier on the constant T):
    a plain ``tensor.cast`` would fold back to static shapes, and iree-compile mishandles some of those (a cast
    constant operand, a routing weight of ones, becomes a constant of dynamic type; unit-dim folding at T = 1
    breaks the row-major lowering's gathers). So the lowered code is the dynamic program's."""
    t = ir.IntegerAttr.get(ir.IndexType.get(), ir.RankedTensorType(v.type).shape[0])
    tokens = ir.Operation.create("arith.constant", results=[ir.IndexType.get()], attributes={"value": t}).result
    tokens = ir.Operation.create("util.optimization_barrier", results=[tokens.type], operands=[tokens]).result
    return ir.Operation.create("flow.tensor.reshape", results=[dyn], operands=[v, tokens],
                               attributes={"operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, 0, 1])}).result


def generalize_tokens(op: ir.Operation) -> ir.Operation:
    """``op`` with a dynamic token count: a program exported with static shapes (``torch.export`` without
    ``dynamic_shapes``) has ops of a fixed T, which lowerings written for any T then also serve. The token
    operands are reshaped to ``?`` (``_opaque_tokens``) and the results cast back, so the ops around it keep their
    types. For the IREE lowerings only (``flow`` and ``util`` ops). Returns ``op`` itself when T is dynamic."""
    schema = SCHEMAS[op.name]
    n = len(op.operands)
    token_ids = {i % n for i in schema.tokens if -n <= i < n}
    operands, changed = list(op.operands), False
    with ir.InsertionPoint(op), op.location:
        for i in sorted(token_ids):
            dyn = _token_dynamic(operands[i].type)
            if dyn is not None:
                operands[i] = _opaque_tokens(operands[i], dyn)
                changed = True
        result_types = [_token_dynamic(r.type) or r.type for r in op.results]
        if not changed and all(t == r.type for t, r in zip(result_types, op.results)):
            return op
        new = ir.Operation.create(op.name, results=result_types, operands=operands,
                                  attributes={name: op.attributes[name] for name in op.attributes})
        for old, res in zip(op.results, new.results):
            back = res if res.type == old.type else ir.Operation.create(
                "tensor.cast", results=[old.type], operands=[res]).result
            old.replace_all_uses_with(back)
    op.erase()
    verify_op(new)
    return new


def walk_mxmoe(root: ir.Operation) -> list[ir.Operation]:
    """All mxmoe ops under ``root``, in program order (collected first so callers may rewrite)."""
    found: list[ir.Operation] = []

    def visit(op):
        if is_mxmoe(op):
            found.append(op.opview.operation if hasattr(op, "opview") else op)
        return ir.WalkResult.ADVANCE

    root.walk(visit)
    return found
