"""mxmoe-pad{M}: pad the K and N dims of every grouped matmul up to a multiple of M.

Matches ``mxmoe.grouped_matmul*`` ops whose K (= 2 x packed bytes) or N is not a multiple of M (for
``grouped_matmul_glu`` the intermediate size N/2 is padded, so gate/up pairs stay whole). Produces:

* the weight globals (``util.global`` + every ``util.global.load``) retyped to the padded shape, with
  ``mxmoe.padded_from`` (the original shape), ``mxmoe.pad_value`` (0 for values and biases, 127 =
  scale 1.0 for e8m0 scales) and, for a concatenated gate/up w13, ``mxmoe.pad_halves``: the parameter
  writer pads the stored arrays the same way, so padding costs nothing at run time;
* ``tensor.pad`` of the activation along K with zeros, and ``tensor.extract_slice`` of the result back
  to the logical N, so the op's users see the original types.

Padding never changes results: padded K columns multiply zero weights, padded rows produce zeros that
are sliced away (and GLU(0, 0) = 0 for both activations, so a padded GLU result feeds the next matmul
unsliced). Weights that are not globals are rejected
(padding them per call would cost a copy each run).
"""

from __future__ import annotations

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import OpView, shape

NAME = "mxmoe-pad"
PADDED_FROM, PAD_VALUE, PAD_HALVES = dialect.PADDED_FROM_ATTR, dialect.PAD_VALUE_ATTR, dialect.PAD_HALVES_ATTR


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _retype_global(module_op, gop: ir.Operation, new_shape: list[int], pad_value: int, halves: bool) -> None:
    old_t = ir.RankedTensorType(ir.TypeAttr(gop.attributes["type"]).value)
    old_shape = shape(old_t)
    if old_shape == new_shape:
        return
    new_t = ir.RankedTensorType.get(new_shape, old_t.element_type)
    name = dialect.py_attr(gop.attributes["sym_name"])
    loads = []

    def visit(op):
        if op.name == "util.global.load" and dialect.py_attr_symbol(op.attributes["global"]) == name:
            loads.append(op)
        return ir.WalkResult.ADVANCE

    module_op.walk(visit)
    for load in loads:  # check every reader before changing anything
        for use in load.results[0].uses:
            user = use.owner.operation if isinstance(use.owner, ir.OpView) else use.owner
            if not user.name.startswith("mxmoe."):
                raise dialect.VerifyError(f"{user.location}: weight global @{name} needs padding but is also read by "
                                          f"'{user.name}', which would see the padded shape")

    new = ir.Operation.parse(str(gop).replace(str(old_t), str(new_t)))
    ir.InsertionPoint(gop).insert(new)
    new.attributes[PADDED_FROM] = ir.DenseI64ArrayAttr.get(old_shape)
    new.attributes[PAD_VALUE] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), pad_value)
    if halves:
        new.attributes[PAD_HALVES] = ir.BoolAttr.get(True)
    gop.erase()
    for load in loads:
        with ir.InsertionPoint(load), load.location:
            nl = ir.Operation.create("util.global.load", results=[new_t], attributes={"global": load.attributes["global"]})
        load.results[0].replace_all_uses_with(nl.results[0])
        load.erase()


def _pad_weight(module_op, v: OpView, value: ir.Value, new_shape: list[int], pad_value: int, halves: bool = False):
    gop = dialect.global_of(module_op, value)
    if gop is None:
        v.fail("needs padding, but its weights are not util.global values (padding them per call would copy them every run)")
    _retype_global(module_op, gop, new_shape, pad_value, halves)


def _pad_activation(x: ir.Value, kk2: int) -> ir.Value:
    xt = ir.RankedTensorType(x.type)
    dims = shape(xt)
    if dims[-1] == kk2:
        return x
    unsliced = _padded_glu_result(x, kk2)
    if unsliced is not None:
        return unsliced
    high = [0] * (len(dims) - 1) + [kk2 - dims[-1]]
    new_t = ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size() if d is None else d for d in dims[:-1]] + [kk2],
                                    xt.element_type)
    el = str(xt.element_type)
    text = ("%p = tensor.pad %x low[" + ", ".join(["0"] * len(dims)) + "] high[" + ", ".join(map(str, high)) + "] {\n"
            + "^bb0(" + ", ".join(f"%i{i}: index" for i in range(len(dims))) + f"):\n  %z = arith.constant 0.0 : {el}\n"
            + f"  tensor.yield %z : {el}\n}} : {xt} to {new_t}")
    return _parse_into(text, {"%x": x}, new_t)


def _padded_glu_result(x: ir.Value, kk2: int) -> ir.Value | None:
    """The padded GLU matmul result ``x`` was sliced from, when it is exactly ``kk2`` wide.

    Its padded columns are zero (zero weights and bias give GLU(0, 0) = 0), so the next matmul can read
    it directly instead of padding the slice again.
    """
    sl = dialect.producer(x, "tensor.extract_slice")
    if sl is None:
        return None
    src = sl.operands[0]
    if dialect.producer(src, "mxmoe.grouped_matmul_glu") is None:
        return None
    src_dims, x_dims = shape(ir.RankedTensorType(src.type)), shape(ir.RankedTensorType(x.type))
    return src if src_dims[-1] == kk2 and src_dims[:-1] == x_dims[:-1] else None


def _parse_into(text: str, bindings: dict[str, ir.Value], result_type: ir.Type) -> ir.Value:
    """Parse a one-result op snippet at the current insertion point, binding named operands."""
    names = list(bindings)
    args = ", ".join(f"{n}: {bindings[n].type}" for n in names)
    fn = ir.Operation.parse(f"func.func private @snippet({args}) -> {result_type} {{\n{text}\nreturn %p : {result_type}\n}}")
    block = fn.regions[0].blocks[0]
    body_ops = [op.operation for op in block.operations][:-1]
    ip = ir.InsertionPoint.current
    for op in body_ops:
        op.move_before(ip.ref_operation) if ip.ref_operation is not None else ip.insert(op)
    for arg, n in zip(block.arguments, names):
        arg.replace_all_uses_with(bindings[n])
    result = body_ops[-1].results[0]
    fn.erase()
    return result


def _slice_text(new_type: ir.RankedTensorType, logical: list[int | None]) -> tuple[str, ir.RankedTensorType]:
    """Snippet slicing ``%x`` (padded) back to the ``logical`` shape, and the sliced type."""
    dims = shape(new_type)
    rank = len(dims)
    sizes = [f"%d{i}" if d is None else str(d) for i, d in enumerate(logical)]
    lines = [f"%c{i} = arith.constant {i} : index\n%d{i} = tensor.dim %x, %c{i} : {new_type}"
             for i, d in enumerate(logical) if d is None]
    out_t = ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size() if d is None else d for d in logical],
                                    new_type.element_type)
    lines.append(f"%p = tensor.extract_slice %x[{', '.join(['0'] * rank)}] [{', '.join(sizes)}] "
                 f"[{', '.join(['1'] * rank)}] : {new_type} to {out_t}")
    return "\n".join(lines), out_t


def make(option: str):
    try:
        multiple = int(option)
        assert multiple > 0 and multiple % 32 == 0
    except (ValueError, AssertionError):
        raise dialect.VerifyError(f"mxmoe-pad: the multiple must be a positive multiple of 32, got '{option}'") from None

    def run(module_op: ir.Operation) -> None:
        for op in dialect.walk_mxmoe(module_op):
            if op.name.startswith("mxmoe.grouped_matmul"):
                with op.location:
                    _pad_op(module_op, op, multiple)

    return run


def _pad_op(module_op: ir.Operation, op: ir.Operation, multiple: int) -> None:
    v = OpView(op)
    ts = v.operand_types()
    has_bias = v.attr("has_bias")
    glu = op.name == "mxmoe.grouped_matmul_glu"
    e, n_w, kh = shape(ts[2])
    # the logical K and N from the activation and the result: the weights may already be padded, by another op
    # reading the same globals (another entry point of the layer)
    kk = shape(ts[0])[-1]
    n_out = shape(ir.RankedTensorType(op.results[0].type))[-1]
    n = 2 * n_out if glu else n_out
    kk2 = _up(kk, multiple)
    n2 = 2 * _up(n // 2, multiple) if glu else _up(n, multiple)
    if (kk2, n2) == (kk, n):
        dialect.verify_op(op)
        return
    if (2 * kh, n_w) != (kk2, n2):
        dialect.verify_op(op)
        halves = glu and not v.attr("interleaved")
        _pad_weight(module_op, v, op.operands[2], [e, n2, kk2 // 2], 0, halves)
        _pad_weight(module_op, v, op.operands[3], [e, n2, kk2 // 32], 127, halves)
        if has_bias:
            _pad_weight(module_op, v, op.operands[4], [e, n2], 0, halves)
    with ir.InsertionPoint(op), op.location:
        op.operands[0] = _pad_activation(op.operands[0], kk2)
    old_t = ir.RankedTensorType(op.results[0].type)
    logical = shape(old_t)
    padded = list(logical)
    padded[-1] = n2 // 2 if glu else n2
    if padded == logical:
        dialect.verify_op(op)
        return
    new_t = ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size() if d is None else d for d in padded],
                                    old_t.element_type)
    # Re-create the op with the padded result type, then slice back for the old users.
    with ir.InsertionPoint(op), op.location:
        new_op = ir.Operation.create(op.name, results=[new_t], operands=list(op.operands),
                                     attributes={n_: op.attributes[n_] for n_ in op.attributes})
    with ir.InsertionPoint(op), op.location:
        text, out_t = _slice_text(new_t, logical)
        sliced = _parse_into(text, {"%x": new_op.results[0]}, out_t)
    op.results[0].replace_all_uses_with(sliced)
    op.erase()
    dialect.verify_op(new_op)
