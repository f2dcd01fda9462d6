"""The Triton branch: each entry function's fused MoE layer in the IR -> the kernels' planner.

Runs on the module its cuda target's passes (``CudaTarget.passes``: convert, verify, fuse, pad, assign the layout)
left. It matches one MoE layer entry in each public function (docs/interface.md): the ``layer`` entry (the router
``torch.aten.linear`` on the entry tensor, or on its fp32 cast for an fp32 router, ``mxmoe.route`` on its logits,
with the correction bias as its second operand), the ``monolithic`` one (``mxmoe.route`` on the entry's logits), the
``modular`` one (the entry's weights and ids through ``mxmoe.map_experts``), then ``mxmoe.grouped_matmul_glu`` and
``mxmoe.grouped_matmul_combine`` on the ids and weights, with an expert map (``mxmoe.map_experts`` after the route),
router weight on input (``mxmoe.weight_rows`` into the w13 matmul, ``aten.ones_like`` weights into the combine) and
a shared expert: MXFP4 (grouped matmuls on ``aten.new_zeros`` ids with ``aten.new_ones`` or
``sigmoid(linear(x, gate))`` weights) or bf16 (``linear``, ``mxmoe.glu``, ``linear``, optionally times the fp32
sigmoid gate), ``aten.add`` to the routed output; or alone (the ``shared`` entry). The weights are
parameter-backed ``util.global`` values. Around them only bridging ops (``torch_c.*_builtin_tensor``, constants, a
``reshape``/``view`` that keeps the hidden dim, export's dtype asserts, a cast to the dtype a value already has) may
appear. Any other op, or one of those ops in another role, is an error that names it: the Triton path has no kernels
for it, and it is never silently dropped.

What it found is a :class:`~mxmoe.kernels.triton.planner.LayerSpec` (dims, semantics, and the globals holding
the weights with their stored shapes); :func:`~mxmoe.kernels.triton.planner.plan_layer` turns that into the
kernel plan. This is the only place of the Triton path that reads MLIR.
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import VerifyError, shape
from mxmoe.compiler.targets import Target
from mxmoe.core.layouts import ROW_MAJOR
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
        elif _identity_cast(op):
            v = op.operands[0]
        else:
            return v


def _identity_cast(op: ir.Operation) -> bool:
    """An ``aten.to.dtype`` to the dtype it already has (an fp32 layer's ``x.float()``): no work."""
    return op.name == "torch.aten.to.dtype" and str(op.operands[0].type) == str(op.results[0].type)


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


def _funcs(module_op: ir.Operation) -> list[ir.Operation]:
    funcs = [op.operation for op in module_op.regions[0].blocks[0].operations if op.operation.name == "func.func"]
    public = [f for f in funcs if "sym_visibility" not in f.attributes]
    if not public:
        raise TritonPlanError("the Triton path needs an entry function, found none")
    return public


def _body_ops(func: ir.Operation) -> list[ir.Operation]:
    found = []

    def visit(op):
        if op.name != "func.func":
            found.append(op.opview.operation if hasattr(op, "opview") else op)
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    return found


#: ops the matcher may meet besides the glue: each must be part of the MoE layer it matches (else: refused)
_LAYER_OPS = {"torch.aten.linear", "mxmoe.route", "mxmoe.grouped_matmul_glu", "mxmoe.grouped_matmul_combine",
              "mxmoe.map_experts", "mxmoe.weight_rows", "torch.aten.ones_like", "torch.aten.new_zeros",
              "torch.aten.new_ones", "torch.aten.to.dtype", "torch.aten.sigmoid", "torch.aten.add.Tensor",
              "torch.aten._assert_tensor_metadata", "mxmoe.glu", "torch.aten.select.int", "torch.aten.mul.Tensor"}


def _refuse_other_ops(ops: list[ir.Operation], matched: set) -> None:
    other: dict[str, int] = {}
    for op in ops:
        if op.name in _GLUE | _RESHAPES or op.name == "torch.constant.device":
            continue
        if op.name == "torch.aten._assert_tensor_metadata" or _identity_cast(op):
            continue  # torch.export's check of a tensor's dtype (e.g. the modular weights'), a no-op cast: no work
        if _key(op) not in matched:
            other[op.name] = other.get(op.name, 0) + 1
    if other:
        listed = ", ".join(f"{n}" + (f" (x{c})" if c > 1 else "") for n, c in sorted(other.items()))
        raise TritonPlanError(
            "the Triton path runs a bare MoE layer (router linear + mxmoe ops); this graph also has ops it "
            f"has no kernels for: {listed}. Compile the MoE layer on its own, or use an IREE target")


def _key(op) -> int:
    o = _op(op)
    return hash(o) if o is not None else id(op)


def _same(a: ir.Value, b: ir.Value) -> bool:
    return _source(a) == _source(b)


def _producer(v: ir.Value, name: str | tuple[str, ...]) -> ir.Operation | None:
    """The op of kind ``name`` that (through bridges and reshapes) produces ``v``, or None."""
    op = _op(_source(v))
    names = (name,) if isinstance(name, str) else name
    return op if op is not None and op.name in names else None


def _before(v: ir.Value, name: str, matched: set) -> ir.Value:
    """``v`` before the op of kind ``name`` that produces it (recorded in ``matched``), or ``v`` if none does."""
    op = _producer(v, name)
    if op is not None:
        matched.add(_key(op))
        return op.operands[0]
    return v


def _to_f32(v: ir.Value, matched: set) -> ir.Value:
    """``v`` before a ``.float()`` (an aten.to.dtype, as the reference casts fp32 weights to fp32)."""
    return _before(v, "torch.aten.to.dtype", matched)


def match_layer(module_op: ir.Operation, func: ir.Operation | None = None) -> LayerSpec:
    """Find the MoE layer entry in ``func`` (the module's one public function by default; after the passes) or
    raise :class:`TritonPlanError`. The entries of docs/interface.md: ``layer`` (router linear on x, route),
    ``monolithic`` (route on the engine's logits), ``modular`` (the engine's weights and ids through map_experts),
    ``shared`` (the shared expert alone); with an expert map (map_experts), router weight on input (weight_rows, the
    combine's weights ones_like) and a shared expert (MXFP4: grouped matmuls on new_zeros ids with a sigmoid gate
    or new_ones weights; bf16: :func:`_match_dense_shared`; added to the routed output)."""
    if func is None:
        funcs = _funcs(module_op)
        if len(funcs) != 1:
            raise TritonPlanError(f"the Triton path needs exactly one entry function, found {len(funcs)}")
        func = funcs[0]
    ops = _body_ops(func)
    unfused = sorted({op.name for op in ops if op.name in _UNFUSED  # a glu on a linear: the bf16 shared expert's
                      and not (op.name == "mxmoe.glu" and _producer(op.operands[0], "torch.aten.linear") is not None)})
    if unfused:
        raise TritonPlanError(f"the Triton path needs fused grouped matmuls, but {', '.join(unfused)} remain "
                              "after mxmoe-fuse")
    foreign = [op for op in ops if op.name not in _GLUE | _RESHAPES | _LAYER_OPS and op.name != "torch.constant.device"]
    if foreign:
        _refuse_other_ops(foreign, set())
    args = list(func.regions[0].blocks[0].arguments)
    x = args[0]
    matched: set = set()

    def arg_index(v: ir.Value) -> int | None:
        src = _source(v)
        return next((i for i, a in enumerate(args) if a == src), None)

    glus = [op for op in ops if op.name == "mxmoe.grouped_matmul_glu"]
    combs = [op for op in ops if op.name == "mxmoe.grouped_matmul_combine"]
    for op in glus + combs:
        dialect.verify_op(op)

    def is_shared(op) -> bool:
        return _producer(op.operands[1], "torch.aten.new_zeros") is not None

    routed_glu = [op for op in glus if not is_shared(op)]
    routed_comb = [op for op in combs if not is_shared(op)]
    shared_glu = [op for op in glus if is_shared(op)]
    shared_comb = [op for op in combs if is_shared(op)]
    for what, found in (("routed w13 grouped matmul", routed_glu), ("routed w2 grouped matmul", routed_comb),
                        ("shared-expert w13 grouped matmul", shared_glu),
                        ("shared-expert w2 grouped matmul", shared_comb)):
        if len(found) > 1:
            raise TritonPlanError(f"the Triton path runs exactly one MoE layer: found {len(found)} {what}s")
    dense_glus = [op for op in ops if op.name == "mxmoe.glu"]
    if len(dense_glus) > 1 or (dense_glus and shared_glu):
        raise TritonPlanError("the Triton path runs exactly one MoE layer: found more than one shared expert")
    if len(routed_glu) != len(routed_comb) or len(shared_glu) != len(shared_comb) or not (
            routed_glu or shared_glu or dense_glus):
        raise TritonPlanError("the Triton path needs a MoE layer's two grouped matmuls (w13 with its GLU, w2 with "
                              "the combine)")
    types = _global_types(module_op)

    def weight(v: ir.Value, what: str) -> StoredWeight:
        name = _global(v, what)
        shp, dt = types[name]
        return StoredWeight(name, tuple(shp), dt)

    dtype = _element(x)
    if dtype not in ("bfloat16", "float32"):
        raise TritonPlanError(f"cuda targets take bf16 or fp32 hidden states, this module's are {dtype}")
    fields: dict = {}
    kind = "shared"
    result = None
    if routed_glu:
        glu, comb = routed_glu[0], routed_comb[0]
        matched |= {_key(glu), _key(comb)}
        ids = glu.operands[1]
        if not _same(comb.operands[1], ids):
            raise TritonPlanError("the w2 grouped matmul must read the w13 grouped matmul's expert ids")
        # the ids: the route's, or the engine's (modular), through map_experts with expert parallelism
        mapping = _producer(ids, "mxmoe.map_experts")
        if mapping is not None:
            matched.add(_key(mapping))
            ids = mapping.operands[0]
            if dialect.py_attr(mapping.attributes["has_map"]):
                fields["expert_map"] = weight(mapping.operands[1], "the expert map")
            fields["global_experts"] = int(dialect.py_attr(mapping.attributes["num_global"]))
        route = _producer(ids, "mxmoe.route")
        if route is not None:
            dialect.verify_op(route)
            matched.add(_key(route))
            weights = route.results[0]
            linear = _producer(route.operands[0], "torch.aten.linear")
            if linear is not None:
                kind = "layer"
                matched.add(_key(linear))
                if not _same(_to_f32(linear.operands[0], matched), x):
                    raise TritonPlanError("the router linear must read the entry's hidden states")
                # an fp32 router (router_fp32): x.float() @ fp32 weights, logits not rounded
                fields["router_fp32"] = _element(linear.operands[0]) == "float32" != dtype
                if _element(linear.operands[1]) != ("float32" if fields["router_fp32"] else dtype):
                    raise TritonPlanError(f"the router weight ({_element(linear.operands[1])}) must have the router "
                                          f"input's dtype ({_element(linear.operands[0])})")
                fields["router_weight"] = weight(linear.operands[1], "the router weight")
                if not _is_none(linear.operands[2]):
                    fields["router_bias"] = weight(linear.operands[2], "the router bias")
                routed_over = fields["router_weight"].shape[0]
            elif arg_index(route.operands[0]) == 1 and len(args) == 2:
                kind = "monolithic"
                fields["router_fp32"] = _element(route.operands[0]) == "float32" != dtype
                if _element(route.operands[0]) not in (dtype, "float32"):
                    raise TritonPlanError(f"the router logits ({_element(route.operands[0])}) must have the hidden "
                                          f"states' dtype ({dtype}) or be fp32")
                routed_over = _last_dim(route.operands[0])
            else:
                raise TritonPlanError("mxmoe.route must read the router linear's logits or the entry's router logits")
            v = dialect.OpView(route)
            fields.update(top_k=v.attr("top_k"), routing=v.attr("routing"), renormalize=v.attr("renormalize"),
                          n_group=v.attr("n_group"), topk_group=v.attr("topk_group"), scaling=float(v.attr("scaling")))
            if v.attr("has_score_bias"):
                fields["score_bias"] = weight(route.operands[1], "the routing's correction bias")
            if routed_over is not None and routed_over != fields.get("global_experts", routed_over):
                raise TritonPlanError("the router's experts and the expert map's disagree")
            fields.setdefault("global_experts", routed_over)
        elif arg_index(ids) == 2 and len(args) == 3 and mapping is not None:
            kind = "modular"
            weights = _to_f32(args[1], matched)
            fields.update(top_k=_last_dim(args[2]), routing="topk_softmax", renormalize=False)
        else:
            raise TritonPlanError("the grouped matmuls' expert ids must come from mxmoe.route or the entry's ids")
        # router weight on input: the w13 GEMM reads weight_rows(x, w), the combine weights 1
        glu_in = glu.operands[0]
        rows = _producer(glu_in, "mxmoe.weight_rows")
        comb_w = comb.operands[-1]
        if rows is not None:
            matched.add(_key(rows))
            ones = _producer(comb_w, "torch.aten.ones_like")
            if ones is None or not _same(_to_f32(rows.operands[1], matched), weights) or not _same(rows.operands[0], x):
                raise TritonPlanError("router weight on input: weight_rows must scale the hidden states by the routing "
                                      "weights, and the combine must take weights of 1 (ones_like)")
            matched.add(_key(ones))
            fields["weight_on_input"] = True
        else:
            if not _same(glu_in, x):
                raise TritonPlanError("the w13 grouped matmul must read the hidden states")
            if not _same(_to_f32(comb_w, matched), weights):
                raise TritonPlanError("the w2 grouped matmul must read the routing weights")
        if not _same(comb.operands[0], glu.results[0]):
            raise TritonPlanError("the w2 grouped matmul must read the GLU output")
        e, n13, kh13 = shape(ir.RankedTensorType(glu.operands[2].type))
        e2, n2, kh2 = shape(ir.RankedTensorType(comb.operands[2].type))
        hidden, intermediate = 2 * kh13, n13 // 2
        if (e2, n2, 2 * kh2) != (e, hidden, intermediate):
            raise TritonPlanError(f"w13 {[e, n13, kh13]} and w2 {[e2, n2, kh2]} do not form one layer")
        has_b13 = dialect.py_attr(glu.attributes["has_bias"])
        has_b2 = dialect.py_attr(comb.attributes["has_bias"])
        fields.update(
            num_experts=e, hidden=hidden, intermediate=intermediate,
            activation=dialect.py_attr(glu.attributes["activation"]),
            alpha=float(dialect.py_attr(glu.attributes["alpha"])),
            limit=float(dialect.py_attr(glu.attributes["limit"])),
            interleaved=dialect.py_attr(glu.attributes["interleaved"]),
            w13=weight(glu.operands[2], "w13"), w13_scale=weight(glu.operands[3], "w13_scale"),
            w13_bias=weight(glu.operands[4], "w13_bias") if has_b13 else None,
            w2=weight(comb.operands[2], "w2"), w2_scale=weight(comb.operands[3], "w2_scale"),
            w2_bias=weight(comb.operands[4], "w2_bias") if has_b2 else None)
        result = comb.results[0]
    layouts = {dialect.py_attr(op.attributes["mxmoe.layout"]) if "mxmoe.layout" in op.attributes else None
               for op in glus + combs}
    if shared_glu:
        sglu, scomb = shared_glu[0], shared_comb[0]
        zeros = _producer(sglu.operands[1], "torch.aten.new_zeros")
        matched |= {_key(sglu), _key(scomb), _key(zeros)}
        if not _same(scomb.operands[1], sglu.operands[1]) or not _same(scomb.operands[0], sglu.results[0]):
            raise TritonPlanError("the shared expert's w2 grouped matmul must read its w13 matmul's output and ids")
        if not _same(sglu.operands[0], x):
            raise TritonPlanError("the shared expert must read the hidden states")
        if dialect.py_attr(sglu.attributes["has_bias"]) or dialect.py_attr(scomb.attributes["has_bias"]):
            raise TritonPlanError("the Triton path runs a shared expert without biases")
        if dialect.py_attr(sglu.attributes["interleaved"]):
            raise TritonPlanError("the Triton path runs a shared expert with gate rows then up rows")
        gate_w = scomb.operands[-1]
        ones = _producer(gate_w, "torch.aten.new_ones")
        sig = _producer(gate_w, "torch.aten.sigmoid")
        if ones is not None:
            matched.add(_key(ones))
        elif sig is not None:
            matched.add(_key(sig))
            lin = _producer(_to_f32(sig.operands[0], matched), "torch.aten.linear")
            if lin is None or not _same(lin.operands[0], x) or not _is_none(lin.operands[2]):
                raise TritonPlanError("the shared expert's gate must be sigmoid(linear(x, gate weight))")
            matched.add(_key(lin))
            fields["shared_gate"] = True
            fields["shared_gate_weight"] = weight(lin.operands[1], "the shared expert's gate weight")
        else:
            raise TritonPlanError("the shared expert's combine weight must be 1 or its sigmoid gate")
        _, n13s, kh13s = shape(ir.RankedTensorType(sglu.operands[2].type))
        shared_out, shared_glu_op, shared_hidden = scomb.results[0], sglu, 2 * kh13s
        fields.update(shared_intermediate=n13s // 2,
                      shared_w13=weight(sglu.operands[2], "shared_w13"),
                      shared_w13_scale=weight(sglu.operands[3], "shared_w13_scale"),
                      shared_w2=weight(scomb.operands[2], "shared_w2"),
                      shared_w2_scale=weight(scomb.operands[3], "shared_w2_scale"))
    elif dense_glus:
        shared_out, shared_glu_op, shared_hidden = _match_dense_shared(ops, dense_glus[0], x, matched, weight, fields)
    if shared_glu or dense_glus:
        if routed_glu:
            add = next((op for op in ops if op.name == "torch.aten.add.Tensor"
                        and {_source(op.operands[0]), _source(op.operands[1])} ==
                        {_source(result), _source(shared_out)}), None)
            if add is None:
                raise TritonPlanError("the shared expert's output must be added to the routed experts' output")
            matched.add(_key(add))
            result = add.results[0]
        else:
            result = shared_out
            v = dialect.OpView(shared_glu_op)
            fields.update(num_experts=1, top_k=1, hidden=shared_hidden, intermediate=fields["shared_intermediate"],
                          routing="topk_softmax", renormalize=False, activation=v.attr("activation"),
                          alpha=float(v.attr("alpha")), limit=float(v.attr("limit")), interleaved=False,
                          w13=None, w13_scale=None, w2=None, w2_scale=None)
        if routed_glu and dialect.OpView(shared_glu_op).attr("activation") != fields["activation"]:
            raise TritonPlanError("the Triton path runs a shared expert with the routed experts' activation")
    returns = [op for op in ops if op.name == "func.return"]
    if len(returns) != 1 or len(returns[0].operands) != 1 or not _same(returns[0].operands[0], result):
        _refuse_other_ops(ops, matched)
        raise TritonPlanError("the entry must return the MoE layer's output (and nothing else)")
    _refuse_other_ops(ops, matched)
    if fields["hidden"] != _last_dim(x):
        raise TritonPlanError(f"hidden states of width {_last_dim(x)} do not match the weights' H={fields['hidden']}; "
                              "the Triton path does not pad activations")
    if not layouts:  # the bf16 shared expert alone: no MXFP4 weights to lay out
        layouts = {ROW_MAJOR.name}
    try:
        if len(layouts) != 1:
            raise PlanError(f"the grouped matmuls' weight layouts {sorted(map(str, layouts))} differ")
        kernel_layout(next(iter(layouts)))
    except PlanError as e:
        raise TritonPlanError(str(e)) from None
    fields.setdefault("router_weight", None)
    if fields.get("global_experts") == fields["num_experts"] and "expert_map" not in fields:
        fields["global_experts"] = 0
    try:
        return LayerSpec(entry=kind, dtype=dtype, layout=next(iter(layouts)), **fields)
    except PlanError as e:
        raise TritonPlanError(str(e)) from None


def _selected(v: ir.Value, matched: set) -> ir.Value:
    """``v`` before ``select(0, 0)`` (the engine-shaped [1, N, K] weight of a shared expert, read as [N, K])."""
    return _before(v, "torch.aten.select.int", matched)


def _match_dense_shared(ops, glu, x, matched: set, weight, fields: dict) -> tuple[ir.Value, ir.Operation, int]:
    """A shared expert in the activation dtype (shared_format="bf16"): ``linear(x, w13)``, ``mxmoe.glu``,
    ``linear(., w2)``, optionally times ``sigmoid(linear(x, gate))`` in fp32 and cast back. Fills ``fields``;
    returns (its output, the glu op, H)."""
    lin1 = _producer(glu.operands[0], "torch.aten.linear")
    if lin1 is None or not _same(lin1.operands[0], x) or not _is_none(lin1.operands[2]):
        raise TritonPlanError("a bf16 shared expert's first linear layer must read the hidden states, without bias")
    lin2 = [op for op in ops if op.name == "torch.aten.linear" and _same(op.operands[0], glu.results[0])]
    if len(lin2) != 1 or not _is_none(lin2[0].operands[2]):
        raise TritonPlanError("a bf16 shared expert's GLU output must feed one linear layer without bias")
    lin2 = lin2[0]
    if dialect.OpView(glu).attr("interleaved"):
        raise TritonPlanError("the Triton path runs a shared expert with gate rows then up rows")
    matched |= {_key(glu), _key(lin1), _key(lin2)}
    w13 = weight(_selected(lin1.operands[1], matched), "shared_w13")
    w2 = weight(_selected(lin2.operands[1], matched), "shared_w2")
    out = lin2.results[0]
    mul = [op for op in ops if op.name == "torch.aten.mul.Tensor" and _same(_to_f32(op.operands[0], set()), out)]
    if mul:
        mul = mul[0]
        _to_f32(mul.operands[0], matched)
        sig = _producer(mul.operands[1], "torch.aten.sigmoid")
        lin = None if sig is None else _producer(_to_f32(sig.operands[0], matched), "torch.aten.linear")
        if lin is None or not _same(lin.operands[0], x) or not _is_none(lin.operands[2]):
            raise TritonPlanError("the shared expert's gate must be sigmoid(linear(x, gate weight))")
        cast = [op for op in ops if op.name == "torch.aten.to.dtype" and _same(op.operands[0], mul.results[0])]
        if len(cast) != 1:
            raise TritonPlanError("a gated bf16 shared expert's output must be cast back to the activation dtype")
        matched |= {_key(mul), _key(sig), _key(lin), _key(cast[0])}
        fields.update(shared_gate=True, shared_gate_weight=weight(lin.operands[1], "the shared expert's gate weight"))
        out = cast[0].results[0]
    n13, h = w13.shape[-2:]
    fields.update(shared_intermediate=n13 // 2, shared_w13=w13, shared_w2=w2, shared_format="bf16")
    return out, glu, h


def plan_triton(module: ir.Module, target: Target, *, deterministic: bool = False,
                batch_invariant: bool = False, activations: str = "bf16") -> KernelPlan:
    """Kernel plan for ``module`` (already through the target's passes, one entry function) on Triton target
    ``target``."""
    plans = plan_entries(module, target, deterministic=deterministic, batch_invariant=batch_invariant,
                         activations=activations)
    if len(plans) != 1:
        raise TritonPlanError(f"the Triton path needs exactly one entry function, found {len(plans)}")
    return next(iter(plans.values()))


def plan_entries(module: ir.Module, target: Target, *, deterministic: bool = False, batch_invariant: bool = False,
                 activations: str = "bf16") -> dict[str, KernelPlan]:
    """A kernel plan per entry function of ``module`` (by function name, in the module's order), over the same
    weight globals. ``activations``: the plans' activation form (``plan_layer``)."""
    if target.backend != "triton":
        raise ValueError(f"{target.name} is not a Triton target")
    plans = {}
    with module.context:
        funcs = _funcs(module.operation)
        for func in funcs:
            name = dialect.py_attr(func.attributes["sym_name"])
            try:
                layer = match_layer(module.operation, func)
                plans[name] = plan_layer(layer, int(target.arch.removeprefix("sm_")), target.name,
                                         deterministic=deterministic, batch_invariant=batch_invariant,
                                         activations=activations)
            except VerifyError as e:
                raise TritonPlanError(str(e)) from None
            except (TritonPlanError, PlanError) as e:
                raise TritonPlanError(f"entry {name}: {e}" if len(funcs) > 1 else str(e)) from None
    return plans
