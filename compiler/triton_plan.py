"""Triton branch of the pipeline: fused mxmoe ops -> a kernel plan (plain data, see runtime kernel_plan).

Runs after ``mxmoe_pipeline``. It matches one MoE layer in ``@main``: the router ``torch.aten.linear``
on the entry tensor, ``mxmoe.route`` on its logits, ``mxmoe.grouped_matmul_glu`` and
``mxmoe.grouped_matmul_combine`` on the route's ids/weights, and the combine's result returned; the
weights are parameter-backed ``util.global`` values. Around them only bridging ops
(``torch_c.*_builtin_tensor``, constants, a ``reshape``/``view`` that keeps the hidden dim) may appear.
Any other op is an error that names it: the Triton path has no kernels for it, and it is never
silently dropped.

It produces the kernel plan: kernels with their specialization constants, per shape class (gemv /
decode / mid / prefill / large, from ``mxmoe.kernels.triton.tile_config``) the tile configs, launch order and grids
as expressions of the token count ``T``, the scratch buffers, and which util.global parameter feeds
which kernel argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import VerifyError, shape
from mxmoe.compiler.targets import Target
from mxmoe.core.swizzle import HOPPER_MAX_FAST_SCALE
from mxmoe.kernels.triton.grouped_gemm import CAST_BLOCK
from mxmoe.kernels.triton.kernel_plan import PLAN_FORMAT, validate
from mxmoe.kernels.triton.layout import LAYOUTS
from mxmoe.kernels.triton.tile_config import (GEMV_MAX_TOKENS, class_config, fused_cast, is_few_tokens,
                                                      shape_classes, use_tma)

#: Ops that only move values between the torch and builtin worlds, or give constants/shapes.
_GLUE = {"torch.constant.int", "torch.constant.float", "torch.constant.str", "torch.constant.bool",
         "torch.constant.none", "torch.prim.ListConstruct", "torch.aten.size.int",
         "torch_c.to_builtin_tensor", "torch_c.from_builtin_tensor", "util.global.load", "func.return"}
_RESHAPES = {"torch.aten.reshape", "torch.aten.view"}
_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "i8": "uint8", "ui8": "uint8",
           "si32": "int32", "i32": "int32"}
_UNFUSED = {"mxmoe.grouped_matmul", "mxmoe.glu", "mxmoe.combine"}
#: (token, slot) pairs per program of the parallel grouping kernels
GROUP_CHUNK = 1024
#: tokens per router program in the few-token classes (also one routing counter per such block)
FEW_TOKEN_ROUTER_BLOCK = 16
#: H per router program in the few-token classes, loaded in one step. H100, gpt-oss, 2026-11-24 (the router
#: launch alone, CUPTI): 256 in four 64-wide steps 9.7 us at 1 token; one 256-wide step 8.0; 128 8.0; 64 8.1
#: (all with the grouping below still at CHUNK 256).
FEW_TOKEN_ROUTER_H = 128


def few_token_group_chunk(max_pairs: int, experts_pow2: int) -> int:
    """(token, slot) pairs per step where one program sorts all pairs inside ``router_route_group``: the
    class's largest pair count, at most 4096 one-hot entries a step. Each step is a [CHUNK, experts] one-hot
    with a column scan, so a chunk far past the pairs there are is wasted work on the launch's critical path:
    on the H100 the gemv-class router launch (gpt-oss-20b, 1 token, 128-wide H steps) took 8.0 us at CHUNK 256
    and 4.9 at 16 (120b, 8 warps: 9.4 at 64 and 6.9 at 16); for 5-64 tokens CHUNK 128 (20b) / 32 (120b) were
    the best of 16-256 at 8, 16, 33 and 64 tokens (20b 9.9 -> 6.6 us at 8 tokens, 120b 18.5 -> 10.1, counting
    the 128-wide H steps too)."""
    return max(16, min(_pow2(max_pairs), 4096 // experts_pow2))


def few_token_scatter(max_tokens: int, experts_pow2: int) -> bool:
    """Whether a few-token class's router launch groups from per-block counts (``router_route_scatter``)
    rather than sorting all pairs in the last block routed (``router_route_group``): the decode class with
    128+ experts. H100, 2026-11-24 ~18:45 (router launch, CUPTI; forwards in two interleaved rounds): for
    gpt-oss-120b at 64 tokens the launch took 10.0 instead of 23.1 us (forward 581 -> 567 us uniform,
    350 -> 338 skewed; 33 tokens 2-3% faster, 8 tokens 9.5 -> 8.5 us); for gpt-oss-20b (32 experts, whose
    [128, 32] sort steps are cheap) the forward was level at 33-64 tokens and ~1 us slower at 8-17 (the
    counts' global round trips), and at 1-4 tokens (one block of at most 16 pairs) sorting is cheaper for
    both models (120b: 6.9 vs 7.1 us)."""
    return max_tokens > GEMV_MAX_TOKENS and experts_pow2 >= 128


class TritonPlanError(ValueError):
    """The module cannot be run by the Triton path; the message says what to change."""


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer as the Triton kernels see it (dims, semantics, and the globals holding its weights)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    routing: str
    renormalize: bool
    activation: str
    alpha: float
    limit: float
    interleaved: bool
    dtype: str                   # activation dtype: "bfloat16" | "float32"
    layout: str
    router_weight: str           # global names
    router_bias: str | None
    w13: str
    w13_scale: str
    w13_bias: str | None
    w2: str
    w2_scale: str
    w2_bias: str | None


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


def _global(v: ir.Value, what: str) -> str:
    op = _op(_source(v))
    if op is None or op.name != "util.global.load":
        raise TritonPlanError(f"{what} must be a module weight (a util.global parameter); got a computed value")
    return dialect.py_attr_symbol(op.attributes["global"])


def _optional_global(v: ir.Value, what: str) -> str | None:
    op = _op(v)
    if op is not None and op.name == "torch.constant.none":
        return None
    return _global(v, what)


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


def match_layer(module_op: ir.Operation) -> MoELayer:
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
    if len(layouts) != 1 or next(iter(layouts)) not in LAYOUTS:
        raise TritonPlanError(f"weight layout {sorted(map(str, layouts))} is not one the Triton kernels read "
                              f"(known: {', '.join(LAYOUTS)})")
    has_b13 = dialect.py_attr(glu.attributes["has_bias"])
    return MoELayer(
        num_experts=e, top_k=dialect.py_attr(route.attributes["top_k"]), hidden=hidden, intermediate=intermediate,
        routing=dialect.py_attr(route.attributes["routing"]),
        renormalize=dialect.py_attr(route.attributes["renormalize"]),
        activation=dialect.py_attr(glu.attributes["activation"]),
        alpha=float(dialect.py_attr(glu.attributes["alpha"])), limit=float(dialect.py_attr(glu.attributes["limit"])),
        interleaved=dialect.py_attr(glu.attributes["interleaved"]), dtype=dtype, layout=next(iter(layouts)),
        router_weight=_global(linear.operands[1], "the router weight"),
        router_bias=_optional_global(linear.operands[2], "the router bias"),
        w13=_global(glu.operands[2], "w13"), w13_scale=_global(glu.operands[3], "w13_scale"),
        w13_bias=_global(glu.operands[4], "w13_bias") if has_b13 else None,
        w2=_global(comb.operands[2], "w2"), w2_scale=_global(comb.operands[3], "w2_scale"),
        w2_bias=_global(comb.operands[4], "w2_bias") if has_b2 else None)


# ------------------------------------------------------------------------------- building the plan
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _global_types(module_op: ir.Operation) -> dict[str, tuple[list[int], str]]:
    out = {}
    for op in module_op.regions[0].blocks[0].operations:
        op = op.operation
        if op.name == "util.global":
            t = ir.RankedTensorType(ir.TypeAttr(op.attributes["type"]).value)
            el = str(t.element_type)
            out[dialect.py_attr(op.attributes["sym_name"])] = (shape(t), _DTYPES.get(el, el))
    return out


def _arg(name: str, bind: str, ref: str | None = None, **extra) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "bind": bind}
    if ref is not None:
        d["ref"] = ref
    d.update(extra)
    return d


def _weight_arg(name: str, glob: str | None) -> dict[str, Any]:
    return _arg(name, "param", glob) if glob is not None else _arg(name, "none", dtype="float32")


def _config_dict(cfg) -> dict[str, int | bool]:
    return {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "BLOCK_K": cfg.BLOCK_K,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "W_TMA": cfg.W_TMA, "GROUP_M": cfg.GROUP_M,
            "SPLIT_K": cfg.SPLIT_K}


def build_plan(layer: MoELayer, target: Target, global_types: dict[str, tuple[list[int], str]]) -> dict[str, Any]:
    """The kernel plan of ``layer`` for ``target`` (see ``mxmoe.kernels.triton.kernel_plan``)."""
    arch = int(target.arch.removeprefix("sm_"))
    E, k, H, I = layer.num_experts, layer.top_k, layer.hidden, layer.intermediate
    k_contiguous, hopper, tiled = (getattr(LAYOUTS[layer.layout], f) for f in ("k_contiguous", "hopper", "tiled"))
    experts_pow2 = _pow2(E)

    params = {}
    roles = {"router_weight": "router_weight", "router_bias": "router_bias", "w13": "values",
             "w13_scale": "scales", "w13_bias": "bias", "w2": "values", "w2_scale": "scales", "w2_bias": "bias"}
    for field_name, role in roles.items():
        glob = getattr(layer, field_name)
        if glob is None:
            continue
        shp, dt = global_types[glob]
        params[glob] = {"role": role, "operand": field_name, "shape": shp, "dtype": dt}

    buffers = {
        "router_partials": {"dtype": "float32", "shape": ["RS", "T", max(16, experts_pow2)]},
        "routing_weights": {"dtype": "float32", "shape": ["T", k]},
        "expert_ids": {"dtype": "int32", "shape": ["T", k]},
        "sorted_pairs": {"dtype": "int32", "shape": [f"T * {k}"]},
        "chunk_counts": {"dtype": "int32", "shape": ["NC", experts_pow2]},
        "chunk_offsets": {"dtype": "int32", "shape": ["NC", experts_pow2]},
        "expert_offsets": {"dtype": "int32", "shape": [E + 1]},
        "block_expert": {"dtype": "int32", "shape": ["NB"]},
        "block_start": {"dtype": "int32", "shape": ["NB"]},
        "activations": {"dtype": "bfloat16", "shape": [f"T * {k}", I]},
        # the few-token classes' router counts its programs here (router_route_group / _scatter)
        "route_counter": {"dtype": "int32", "shape": [f"cdiv(T, {FEW_TOKEN_ROUTER_BLOCK}) + 1"], "init": "zeros"},
        # ... and with router_route_scatter each routed token block counts its pairs per expert, with their
        # ranks in the block
        "block_pair_counts": {"dtype": "int32", "shape": [f"cdiv(T, {FEW_TOKEN_ROUTER_BLOCK})", experts_pow2]},
        "pair_ranks": {"dtype": "int32", "shape": [f"T * {k}"]},
        # the gemv class fuses the cast into the combine, which counts its programs per column tile in an
        # extra row (zeroed with the sums); see combine_gemm_kernel
        "accumulator": {"dtype": "float32", "shape": ["T" if layer.dtype == "float32" else "T + 1", H],
                        "init": "zeros"},
    }
    if layer.dtype != "float32":
        buffers["output"] = {"dtype": layer.dtype, "shape": ["T", H]}

    kernels: dict[str, dict[str, Any]] = {}

    def add_kernel(entry: str, kernel: str, args: list, constexprs: dict, num_warps: int, num_stages: int) -> str:
        spec = {"kernel": kernel, "constexprs": constexprs, "num_warps": num_warps, "num_stages": num_stages,
                "args": args}
        for name, existing in kernels.items():  # classes whose tiles coincide share one kernel (one cubin)
            if existing == spec:
                return name
        kernels[entry] = spec
        return entry

    router_ep2 = max(16, experts_pow2)  # tl.dot needs N >= 16
    route_block_t = max(1, min(64, 4096 // router_ep2))

    def router_launches(cls_name: str, max_tokens: int | None, bm: int) -> tuple[list, int]:
        """(launches, splits) of the router and routing for a shape class: few tokens split the router
        weight's H across programs to stream it at bandwidth, and the same launch routes each token block
        in its last router program and groups all pairs in the last block routed (``router_route_group``);
        many tokens don't split, and route and group in their own launches."""
        few = is_few_tokens(max_tokens)
        if few:
            block_t, h_per_split = FEW_TOKEN_ROUTER_BLOCK, min(H, FEW_TOKEN_ROUTER_H)
            block_h = max(16, _pow2(h_per_split))  # each program loads its slice at once
        else:
            block_t, h_per_split = 64, H
            block_h = max(16, min(64, _pow2(h_per_split)))
        splits = -(-H // h_per_split)
        router_args = [
            _arg("x_ptr", "input"), _arg("w_ptr", "param", layer.router_weight),
            _arg("partial_ptr", "buffer", "router_partials"), _arg("num_tokens", "expr", expr="T", type="i32")]
        router_consts = dict(HIDDEN=H, NUM_EXPERTS=E, EXPERTS_POW2=router_ep2, H_PER_SPLIT=h_per_split,
                             IEEE_FP32=layer.dtype == "float32", BLOCK_T=block_t, BLOCK_H=block_h)
        route_consts = dict(NUM_EXPERTS=E, TOP_K=k, EXPERTS_POW2=router_ep2, SLOTS_POW2=_pow2(k), SPLITS=splits,
                            HAS_BIAS=layer.router_bias is not None, ROUND_LOGITS_BF16=layer.dtype == "bfloat16",
                            BLOCK_T=route_block_t,
                            SOFTMAX_OVER_ALL=layer.routing == "softmax_topk" and not layer.renormalize)
        if few:  # router, routing and grouping: one launch; 8 warps for 128+ experts (the routing program's
            # [16, 128] top-k and the one-hot grouping): gpt-oss-120b at 8 tokens 17.0 -> 10.8 us on the H100
            fused_args = router_args + [
                _weight_arg("b_ptr", layer.router_bias), _arg("weights_ptr", "buffer", "routing_weights"),
                _arg("ids_ptr", "buffer", "expert_ids")] + group_args[1:-2] + [
                _arg("num_blocks", "expr", expr="NB", type="i32"), _arg("counter_ptr", "buffer", "route_counter")]
            fused_consts = {**router_consts, **route_consts, "ROUTER_BLOCK_T": block_t,
                            "BLOCK_T": min(_pow2(max_tokens), block_t), "GROUP_EXPERTS_POW2": experts_pow2,
                            "BLOCK_M": bm}
            warps = 8 if router_ep2 >= 128 else 4
            if few_token_scatter(max_tokens, experts_pow2):
                fused = add_kernel(f"router_route_scatter.{cls_name}", "router_route_scatter", fused_args + [
                    _arg("block_counts_ptr", "buffer", "block_pair_counts"),
                    _arg("ranks_ptr", "buffer", "pair_ranks")],
                    {**fused_consts, "TOKEN_BLOCKS_POW2": _pow2(-(-max_tokens // block_t)),
                     "LANES": min(1024, _pow2(max_tokens * k))}, warps, 2)
            else:
                fused = add_kernel(f"router_route_group.{cls_name}", "router_route_group", fused_args,
                                   {**fused_consts, "CHUNK": few_token_group_chunk(max_tokens * k, experts_pow2)},
                                   warps, 2)
            return [{"kernel": fused, "grid": [f"cdiv(T, {block_t})", "RS"]}], splits
        gemm = add_kernel(f"router_gemm.{cls_name}", "router_gemm", router_args, router_consts, 4, 2)
        route = add_kernel(f"route.{cls_name}", "route_partials", [
            _arg("partial_ptr", "buffer", "router_partials"), _weight_arg("b_ptr", layer.router_bias),
            _arg("weights_ptr", "buffer", "routing_weights"), _arg("ids_ptr", "buffer", "expert_ids"),
            _arg("num_tokens", "expr", expr="T", type="i32")], route_consts, 4, 1)
        return [{"kernel": gemm, "grid": [f"cdiv(T, {block_t})", "RS"]},
                {"kernel": route, "grid": [f"cdiv(T, {route_block_t})"]}], splits

    pairs = f"T * {k}"
    group_args = [
        _arg("ids_ptr", "buffer", "expert_ids"), _arg("sorted_pairs_ptr", "buffer", "sorted_pairs"),
        _arg("expert_offsets_ptr", "buffer", "expert_offsets"), _arg("block_expert_ptr", "buffer", "block_expert"),
        _arg("block_start_ptr", "buffer", "block_start"), _arg("num_pairs", "expr", expr=pairs, type="i32"),
        _arg("num_blocks", "expr", expr="NB", type="i32")]
    sorted_args = [_arg("sorted_pairs_ptr", "buffer", "sorted_pairs"),
                   _arg("expert_offsets_ptr", "buffer", "expert_offsets"),
                   _arg("block_expert_ptr", "buffer", "block_expert"), _arg("block_start_ptr", "buffer", "block_start")]
    glu_args = [_arg("x_ptr", "input"), _arg("w_ptr", "param", layer.w13), _arg("s_ptr", "param", layer.w13_scale),
                _weight_arg("bias_ptr", layer.w13_bias), _arg("act_ptr", "buffer", "activations")] + sorted_args
    comb_args = [_arg("act_ptr", "buffer", "activations"), _arg("w_ptr", "param", layer.w2),
                 _arg("s_ptr", "param", layer.w2_scale), _weight_arg("bias_ptr", layer.w2_bias),
                 _arg("routing_weights_ptr", "buffer", "routing_weights"),
                 _arg("out_ptr", "buffer", "accumulator")] + sorted_args + [
        _arg("cast_ptr", "buffer", "output") if layer.dtype != "float32" else _arg("cast_ptr", "none", dtype="float32"),
        _arg("num_tokens", "expr", expr="T", type="i32")]
    cast = None
    if layer.dtype != "float32":
        cast = add_kernel("cast", "cast", [
            _arg("src_ptr", "buffer", "accumulator"), _arg("dst_ptr", "buffer", "output"),
            _arg("numel", "expr", expr=f"T * {H}", type="i64")], {"BLOCK": CAST_BLOCK}, 4, 1)

    classes = []
    for cls_name, max_tokens in shape_classes(E, k):
        c13 = class_config(cls_name, 2 * I, H, arch, hopper=hopper)
        c2 = class_config(cls_name, H, I, arch, gemm="combine", hopper=hopper)
        bm = c13.BLOCK_M
        # Upper bound on sum_e cdiv(count_e, BLOCK_M): each non-empty expert adds at most one
        # partial block, and at most min(E, T*k) experts are non-empty.
        nb = f"{pairs} // {bm} + min({E}, {pairs})"
        sub = max(16, min(256, 8192 // experts_pow2))
        if is_few_tokens(max_tokens):  # few pairs: the routing launch groups them too (router_route_group / _scatter)
            grouping = []
        else:  # many pairs: per-chunk histograms, one scan, a parallel scatter (same result)
            hist = add_kernel("chunk_histogram", "chunk_histogram", [
                _arg("ids_ptr", "buffer", "expert_ids"), _arg("chunk_counts_ptr", "buffer", "chunk_counts"),
                _arg("num_pairs", "expr", expr=pairs, type="i32")],
                dict(EXPERTS_POW2=experts_pow2, CHUNK=GROUP_CHUNK, SUB=sub), 4, 1)
            scan = add_kernel(f"chunk_scan.{cls_name}", "chunk_scan", [
                _arg("chunk_counts_ptr", "buffer", "chunk_counts"), _arg("chunk_offsets_ptr", "buffer", "chunk_offsets"),
                _arg("expert_offsets_ptr", "buffer", "expert_offsets"),
                _arg("block_expert_ptr", "buffer", "block_expert"), _arg("block_start_ptr", "buffer", "block_start"),
                _arg("num_chunks", "expr", expr="NC", type="i32"), _arg("num_blocks", "expr", expr="NB", type="i32")],
                dict(NUM_EXPERTS=E, EXPERTS_POW2=experts_pow2, BLOCK_M=bm, SUB=sub), 8, 1)
            scatter = add_kernel("chunk_scatter", "chunk_scatter", [
                _arg("ids_ptr", "buffer", "expert_ids"), _arg("chunk_offsets_ptr", "buffer", "chunk_offsets"),
                _arg("sorted_pairs_ptr", "buffer", "sorted_pairs"), _arg("num_pairs", "expr", expr=pairs, type="i32")],
                dict(EXPERTS_POW2=experts_pow2, CHUNK=GROUP_CHUNK, SUB=sub), 4, 1)
            grouping = [{"kernel": hist, "grid": ["NC"]}, {"kernel": scan, "grid": [1]},
                        {"kernel": scatter, "grid": ["NC"]}]
        # The N-contiguous layout needs num_stages=1 on Hopper (see grouped_gemm._pipeline_stages).
        glu = add_kernel(f"glu_gemm.{cls_name}", "glu_gemm", glu_args, dict(
            HIDDEN=H, INTERMEDIATE=I, TOP_K=k, HAS_BIAS=layer.w13_bias is not None,
            INTERLEAVED=layer.interleaved, SWIGLU_OAI=layer.activation == "swiglu_oai",
            ALPHA=layer.alpha, LIMIT=layer.limit, K_CONTIGUOUS=k_contiguous,
            BLOCK_M=bm, BLOCK_N=c13.BLOCK_N, BLOCK_K=c13.BLOCK_K,
            W_TMA=use_tma(c13, k_contiguous, layer.interleaved, tiled), NUM_EXPERTS=E, GROUP_M=c13.GROUP_M,
            W_HOPPER=hopper, WIDE_SCALES=True, W_TILES=tiled),
            c13.num_warps, c13.num_stages if k_contiguous else 1)
        # the gemv class: the combine's last program per column tile casts it (one launch fewer)
        fuse_cast = cast is not None and fused_cast(max_tokens)
        comb = add_kernel(f"combine_gemm.{cls_name}", "combine_gemm", comb_args, dict(
            HIDDEN=H, INTERMEDIATE=I, TOP_K=k, HAS_BIAS=layer.w2_bias is not None, K_CONTIGUOUS=k_contiguous,
            BLOCK_M=bm, BLOCK_N=c2.BLOCK_N, BLOCK_K=c2.BLOCK_K,
            W_TMA=use_tma(c2, k_contiguous, tiled=tiled), NUM_EXPERTS=E, GROUP_M=c2.GROUP_M,
            W_HOPPER=hopper, WIDE_SCALES=True, FUSED_CAST=fuse_cast, W_TILES=tiled, SPLIT_K=c2.SPLIT_K),
            c2.num_warps, c2.num_stages if k_contiguous else 1)
        routing, splits = router_launches(cls_name, max_tokens, bm)
        launches = [
            *routing,
            *grouping,
            {"kernel": glu, "grid": ["NB", f"cdiv({2 * I}, {c13.BLOCK_N})"]},
            {"kernel": comb, "grid": ["NB", f"cdiv({H}, {c2.BLOCK_N})", c2.SPLIT_K]},
        ]
        if cast is not None and not fuse_cast:
            launches.append({"kernel": cast, "grid": [f"cdiv(T * {H}, {CAST_BLOCK})"]})
        classes.append({"name": cls_name, "max_tokens": max_tokens, "vars": {"NB": nb, "RS": splits, "NC": f"cdiv({pairs}, {GROUP_CHUNK})"},
                        "tiles": {"w13": _config_dict(c13), "w2": _config_dict(c2)}, "launches": launches})

    output = "output" if layer.dtype != "float32" else "accumulator"
    used = {a["ref"] for spec in kernels.values() for a in spec["args"] if a["bind"] == "buffer"} | {output}
    buffers = {name: b for name, b in buffers.items() if name in used}  # e.g. no block counts without a scatter
    plan = {
        "format": PLAN_FORMAT,
        "target": target.name,
        "arch": arch,
        "layer": {"num_experts": E, "top_k": k, "hidden": H, "intermediate": I, "routing": layer.routing,
                  "renormalize": layer.renormalize, "activation": layer.activation, "alpha": layer.alpha,
                  "limit": layer.limit, "interleaved": layer.interleaved, "dtype": layer.dtype,
                  "layout": layer.layout},
        "input": {"name": "x", "dtype": layer.dtype, "hidden": H},
        "parameters": params,
        "buffers": buffers,
        "kernels": kernels,
        "classes": classes,
        "output": {"buffer": output},
    }
    validate(plan)
    return plan


def fit_scale_range(plan: dict[str, Any], scales: dict[str, Any]) -> None:
    """Let the Hopper decode multiply once per value pair (``WIDE_SCALES=False``) when every scale byte
    of the layer is <= 128 (the factor 2^126 * 2^(s-127) is then a finite bf16); ``scales`` maps the
    plan's scale globals to their stored arrays. A layer with a larger scale (weights past +-12) or a NaN
    scale (255) keeps the two-multiply decode, which is exact for every scale. The executor refuses
    weights that break the promise."""
    names = [g for g, spec in plan["parameters"].items() if spec["role"] == "scales"]
    wide = any(int(scales[g].max(initial=0)) > HOPPER_MAX_FAST_SCALE for g in names)
    for entry in plan["kernels"].values():
        if entry["constexprs"].get("W_HOPPER"):
            entry["constexprs"]["WIDE_SCALES"] = wide


def plan_triton(module: ir.Module, target: Target) -> dict[str, Any]:
    """Kernel plan for ``module`` (already through ``mxmoe_pipeline``) on Triton target ``target``."""
    if target.backend != "triton":
        raise ValueError(f"{target.name} is not a Triton target")
    with module.context:
        try:
            layer = match_layer(module.operation)
        except VerifyError as e:
            raise TritonPlanError(str(e)) from None
        return build_plan(layer, target, _global_types(module.operation))
