"""Triton branch of the pipeline: the fused MoE layer in the IR -> the kernels' planner.

Runs after ``mxmoe_pipeline``. It matches one MoE layer in ``@main``: the router ``torch.aten.linear``
on the entry tensor, ``mxmoe.route`` on its logits, ``mxmoe.grouped_matmul_glu`` and
``mxmoe.grouped_matmul_combine`` on the route's ids/weights, and the combine's result returned; the
weights are parameter-backed ``util.global`` values. Around them only bridging ops
(``torch_c.*_builtin_tensor``, constants, a ``reshape``/``view`` that keeps the hidden dim) may appear.
Any other op is an error that names it: the Triton path has no kernels for it, and it is never
silently dropped.

What it found is a :class:`~mxmoe.kernels.triton.planner.LayerSpec` (dims, semantics, and the globals holding
the weights with their stored shapes); :func:`~mxmoe.kernels.triton.planner.plan_layer` turns that into the
kernel plan. This is the only place of the Triton path that reads MLIR.
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import VerifyError, shape
from mxmoe.compiler.targets import Target
from mxmoe.kernels.triton.kernel_plan import KernelPlan, PlanError
from mxmoe.kernels.triton.planner import LayerSpec, StoredWeight, kernel_layout, plan_layer

#: Ops that only move values between the torch and builtin worlds, or give constants/shapes.
_GLUE = {"torch.constant.int", "torch.constant.float", "torch.constant.str", "torch.constant.bool",
         "torch.constant.none", "torch.prim.ListConstruct", "torch.aten.size.int",
         "torch_c.to_builtin_tensor", "torch_c.from_builtin_tensor", "util.global.load", "func.return"}
_RESHAPES = {"torch.aten.reshape", "torch.aten.view"}
_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "i8": "uint8", "ui8": "uint8",
           "si32": "int32", "i32": "int32"}
_UNFUSED = {"mxmoe.grouped_matmul", "mxmoe.glu", "mxmoe.combine"}


class TritonPlanError(ValueError):
    """The module cannot be run by the Triton path; the message says what to change."""


# ------------------------------------------------------------------------------ matching the IR
def _op(x) -> ir.Operation | None:
    o = x.owner if isinstance(x, ir.Value) else x
    if isinstance(o, ir.OpView):
        o = o.operation
    return o if isinstance(o, ir.Operation) else None


def _source(v: ir.Value) -> ir.Value:
    """Follow bridges and hidden-dim-preserving reshapes back to the value they carry."""
    while True:
        op = _op(v)
        if op is None:
            return v
        if op.name in ("torch_c.to_builtin_tensor", "torch_c.from_builtin_tensor"):
            v = op.operands[0]
        elif op.name in _RESHAPES and _last_dim(op.operands[0]) == _last_dim(op.results[0]) is not None:
            v = op.operands[0]
        else:
            return v


def _last_dim(v: ir.Value) -> int | None:
    text = str(v.type)
    if text.startswith("!torch.vtensor<["):
        dims = text[len("!torch.vtensor<["):text.index("]")].split(",")
        d = dims[-1].strip()
        return int(d) if d.lstrip("-").isdigit() and int(d) >= 0 else None
    if isinstance(v.type, ir.RankedTensorType):
        return shape(ir.RankedTensorType(v.type))[-1]
    return None


def _element(v: ir.Value) -> str:
    text = str(v.type)
    if text.startswith("!torch.vtensor<"):
        el = text.rsplit(",", 1)[1].rstrip(">")
    else:
        el = str(ir.RankedTensorType(v.type).element_type)
    return _DTYPES.get(el, el)


def _global_types(module_op: ir.Operation) -> dict[str, tuple[list[int], str]]:
    out = {}
    for op in module_op.regions[0].blocks[0].operations:
        op = op.operation
        if op.name == "util.global":
            t = ir.RankedTensorType(ir.TypeAttr(op.attributes["type"]).value)
            el = str(t.element_type)
            out[dialect.py_attr(op.attributes["sym_name"])] = (shape(t), _DTYPES.get(el, el))
    return out


def _global(v: ir.Value, what: str) -> str:
    op = _op(_source(v))
    if op is None or op.name != "util.global.load":
        raise TritonPlanError(f"{what} must be a module weight (a util.global parameter); got a computed value")
    return dialect.py_attr_symbol(op.attributes["global"])


def _is_none(v: ir.Value) -> bool:
    op = _op(v)
    return op is not None and op.name == "torch.constant.none"


def _func(module_op: ir.Operation) -> ir.Operation:
    funcs = [op.operation for op in module_op.regions[0].blocks[0].operations if op.operation.name == "func.func"]
    public = [f for f in funcs if "sym_visibility" not in f.attributes]
    if len(public) != 1:
        raise TritonPlanError(f"the Triton path needs exactly one entry function, found {len(public)}")
    return public[0]


def _body_ops(func: ir.Operation) -> list[ir.Operation]:
    found = []

    def visit(op):
        if op.name != "func.func":
            found.append(op.opview.operation if hasattr(op, "opview") else op)
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    return found


def _refuse_other_ops(ops: list[ir.Operation]) -> None:
    allowed = _GLUE | _RESHAPES | {"torch.aten.linear", "mxmoe.route", "mxmoe.grouped_matmul_glu",
                                   "mxmoe.grouped_matmul_combine"}
    other: dict[str, int] = {}
    for op in ops:
        if op.name not in allowed:
            other[op.name] = other.get(op.name, 0) + 1
    if other:
        listed = ", ".join(f"{n}" + (f" (x{c})" if c > 1 else "") for n, c in sorted(other.items()))
        raise TritonPlanError(
            "the Triton path runs a bare MoE layer (router linear + mxmoe ops); this graph also has ops it "
            f"has no kernels for: {listed}. Compile the MoE layer on its own, or use an IREE target")


def _one(ops: list[ir.Operation], name: str) -> ir.Operation:
    found = [op for op in ops if op.name == name]
    if len(found) != 1:
        raise TritonPlanError(f"the Triton path runs exactly one MoE layer: expected one '{name}', found {len(found)}")
    return found[0]


def _same(a: ir.Value, b: ir.Value) -> bool:
    return _source(a) == _source(b)


def match_layer(module_op: ir.Operation) -> LayerSpec:
    """Find the MoE layer in ``module_op`` (after mxmoe_pipeline) or raise :class:`TritonPlanError`."""
    func = _func(module_op)
    ops = _body_ops(func)
    unfused = sorted({op.name for op in ops if op.name in _UNFUSED})
    if unfused:
        raise TritonPlanError(f"the Triton path needs fused grouped matmuls, but {', '.join(unfused)} remain "
                              "after mxmoe-fuse")
    _refuse_other_ops(ops)
    linear = _one(ops, "torch.aten.linear")
    route = _one(ops, "mxmoe.route")
    glu = _one(ops, "mxmoe.grouped_matmul_glu")
    comb = _one(ops, "mxmoe.grouped_matmul_combine")
    for op in (route, glu, comb):
        dialect.verify_op(op)

    entry = func.regions[0].blocks[0]
    if len(entry.arguments) != 1:
        raise TritonPlanError(f"the Triton path's entry takes one tensor (the hidden states), this one takes "
                              f"{len(entry.arguments)}")
    x = entry.arguments[0]
    if not _same(linear.operands[0], x):
        raise TritonPlanError("the router linear must read the entry's hidden states")
    if not _same(route.operands[0], linear.results[0]):
        raise TritonPlanError("mxmoe.route must read the router linear's logits")
    if not _same(glu.operands[0], x) or not _same(glu.operands[1], route.results[1]):
        raise TritonPlanError("the w13 grouped matmul must read the hidden states and the route's ids")
    has_b2 = dialect.py_attr(comb.attributes["has_bias"])
    if (not _same(comb.operands[0], glu.results[0]) or not _same(comb.operands[1], route.results[1])
            or not _same(comb.operands[-1], route.results[0])):
        raise TritonPlanError("the w2 grouped matmul must read the GLU output and the route's ids and weights")
    returns = [op for op in ops if op.name == "func.return"]
    if len(returns) != 1 or len(returns[0].operands) != 1 or not _same(returns[0].operands[0], comb.results[0]):
        raise TritonPlanError("the entry must return the MoE layer's output (and nothing else)")

    dtype = _element(x)
    if dtype not in ("bfloat16", "float32"):
        raise TritonPlanError(f"cuda targets take bf16 or fp32 hidden states, this module's are {dtype}")
    if _element(linear.operands[1]) != dtype:
        raise TritonPlanError(f"the router weight ({_element(linear.operands[1])}) must have the hidden states' dtype ({dtype})")
    e, n13, kh13 = shape(ir.RankedTensorType(glu.operands[2].type))
    e2, n2, kh2 = shape(ir.RankedTensorType(comb.operands[2].type))
    hidden, intermediate = 2 * kh13, n13 // 2
    if (e2, n2, 2 * kh2) != (e, hidden, intermediate):
        raise TritonPlanError(f"w13 {[e, n13, kh13]} and w2 {[e2, n2, kh2]} do not form one layer")
    if _last_dim(x) != hidden:
        raise TritonPlanError(f"hidden states of width {_last_dim(x)} do not match the weights' H={hidden}; "
                              "the Triton path does not pad activations")
    layouts = {dialect.py_attr(op.attributes["mxmoe.layout"]) if "mxmoe.layout" in op.attributes else None
               for op in (glu, comb)}
    try:
        if len(layouts) != 1:
            raise PlanError(f"the grouped matmuls' weight layouts {sorted(map(str, layouts))} differ")
        kernel_layout(next(iter(layouts)))
    except PlanError as e:
        raise TritonPlanError(str(e)) from None
    types = _global_types(module_op)

    def weight(v: ir.Value, what: str) -> StoredWeight:
        name = _global(v, what)
        shp, dt = types[name]
        return StoredWeight(name, tuple(shp), dt)

    has_b13 = dialect.py_attr(glu.attributes["has_bias"])
    return LayerSpec(
        num_experts=e, top_k=dialect.py_attr(route.attributes["top_k"]), hidden=hidden, intermediate=intermediate,
        routing=dialect.py_attr(route.attributes["routing"]),
        renormalize=dialect.py_attr(route.attributes["renormalize"]),
        activation=dialect.py_attr(glu.attributes["activation"]),
        alpha=float(dialect.py_attr(glu.attributes["alpha"])), limit=float(dialect.py_attr(glu.attributes["limit"])),
        interleaved=dialect.py_attr(glu.attributes["interleaved"]), dtype=dtype, layout=next(iter(layouts)),
        router_weight=weight(linear.operands[1], "the router weight"),
        router_bias=None if _is_none(linear.operands[2]) else weight(linear.operands[2], "the router bias"),
        w13=weight(glu.operands[2], "w13"), w13_scale=weight(glu.operands[3], "w13_scale"),
        w13_bias=weight(glu.operands[4], "w13_bias") if has_b13 else None,
        w2=weight(comb.operands[2], "w2"), w2_scale=weight(comb.operands[3], "w2_scale"),
        w2_bias=weight(comb.operands[4], "w2_bias") if has_b2 else None)


def plan_triton(module: ir.Module, target: Target, *, deterministic: bool = False,
                batch_invariant: bool = False, activations: str = "bf16") -> KernelPlan:
    """Kernel plan for ``module`` (already through ``mxmoe_pipeline``) on Triton target ``target``."""
    if target.backend != "triton":
        raise ValueError(f"{target.name} is not a Triton target")
    with module.context:
        try:
            layer = match_layer(module.operation)
        except VerifyError as e:
            raise TritonPlanError(str(e)) from None
    return plan_layer(layer, int(target.arch.removeprefix("sm_")), target.name, deterministic=deterministic,
                      batch_invariant=batch_invariant, activations=activations)
