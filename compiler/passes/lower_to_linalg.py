"""mxmoe-lower-to-linalg: mxmoe ops -> ``func.call``s of private linalg/tensor/arith functions.

Each mxmoe op becomes a call to a private function (one per distinct op signature, named after it)
whose body is plain linalg on tensors, so IREE (or any MLIR pipeline) compiles it for the target and
inlines it. The token count stays dynamic.

* route: softmax (when first) and k rounds of a deterministic arg-max reduction (ties go to the
  lower expert index, independent of reduction order), masking each winner before the next round.
* grouped_matmul (+glu / +combine), by the op's ``mxmoe.layout``:

  - ``cpu-mxfp4-blocksplit`` (the cpu target): the grouped schedule of ``lowering/cpu_grouped.py``:
    slots sorted by expert on the device; then, with the pass option ``ukernel=PATH``, one dispatch of
    the C microkernel for every used expert (``lowering/cpu_ukernel.py``; bf16/f16 activations), else a
    host loop over the experts the routing actually picked, each expert's weights an ``extract_slice``
    of the parameter read once, the decode fused into a vectorized lane matvec (few rows) or done once
    per expert before a contraction (many rows).
  - ``cpu-mxfp4-rows16`` (the cpu target with ``activations="mxint8"`` or ``"mxint16"``): the same dispatches
    of the C microkernel's int8 forms (MXINT8 activations, or 15-bit ones as two int8 planes with the pass option
    ``activations=mxint16``; 16 output rows per ``vpdpbusd``), every activation type; or, with the pass option
    ``activations=bf16`` (the cpu target's bf16 layers on AMX hosts), its bf16 form: exact bf16 activations against
    weights decoded into AMX B tiles (``kernels/cpu/bf16_rows16.c``), bf16 layers only. It needs ``ukernel=PATH``
    (no linalg form reads this layout).
  - ``mxfp4-rowmajor`` (the ROCm targets; also an op without the attribute): the row-block schedule of
    ``lowering/rocm_grouped.py``: slots laid out by expert in blocks of 16 rows on the device, the activation
    rows and each block's expert weights gathered (``iree_linalg_ext.gather``; packed bytes viewed as
    ``f4E2M1FN``, scales as ``f8E8M0FNU``), the weights decoded by an all-parallel generic and multiplied by a
    contraction generic whose operands are block arguments: the form IREE's GPU pipelines give to the matrix
    cores (MFMA; with the pass option ``activations=mxfp8``, gfx950's scaled MFMA). The option ``decode=``
    picks ``arith.scaling_extf`` or an integer decode (docs/amd.md).

  Either way work and weight traffic grow with tokens x top_k (at most the experts picked), never with
  the number of experts, and no dequantized weight tensor of all experts is ever materialized.
* glu / combine: elementwise / reduction generics. Fused forms keep the reference's rounding points
  (the matmul result is rounded to the activation type before the epilogue), so they agree with the
  unfused ops bit for bit on the same backend.

A weight in any other layout (e.g. a Triton one) is rejected with a diagnostic naming the supported ones.
"""

from __future__ import annotations

import hashlib

from iree.compiler import ir

from mxmoe.compiler import dialect
from mxmoe.compiler.dialect import OpView, VerifyError, shape
from mxmoe.compiler.passes.lowering import cpu_grouped, cpu_ukernel, rocm_grouped
from mxmoe.compiler.passes.lowering.router_once import round_router_once
from mxmoe.compiler.passes.lowering.text import (Body, amap, empty, filled, from_f32_lines, generic, round_to,
                                                 to_f32_lines, tt)

NAME = "mxmoe-lower-to-linalg"


# ------------------------------------------------------------------------------------ text helpers
_tt, _Body, _map, _generic = tt, Body, amap, generic
_to_f32_lines, _from_f32_lines, _empty, _filled, _round = to_f32_lines, from_f32_lines, empty, filled, round_to


# ----------------------------------------------------------------------------------------- route
def _route_func(fname: str, v: OpView) -> str:
    """The routing contract (docs/routing.md): choose on f32 values (logits, softmax probabilities, or sigmoid
    scores plus the correction bias, limited to the chosen groups), k rounds of a deterministic arg-max (ties to
    the lower index), then the weights of the chosen experts."""
    ts = v.operand_types()
    lt = ts[0]
    t_, e = shape(lt)
    el = str(lt.element_type)
    k, routing, renorm = v.attr("top_k"), v.attr("routing"), v.attr("renormalize")
    has_bias, n_group, topk_group, scaling = (v.attr("has_score_bias"), v.attr("n_group"), v.attr("topk_group"),
                                              v.attr("scaling"))
    b = _Body()
    c0 = b.const(0, "index")
    T = b.v(f"tensor.dim %logits, {c0} : {_tt([None, e], el)}", "T")
    id2 = _map(2, "d0, d1")
    # logits -> f32. bf16 logits are rounded again on the bits as they are read: fused with the router's f32 matmul,
    # IREE folds its truncf with this extf, and the route then chose on unrounded logits (the contract compares
    # rounded ones: exactly equal bf16 logits went to the higher expert when its f32 sum was larger)
    read = (_to_f32_lines("%a", el, "%x") + _input_lines("%x", "f32", "%r", "bf16") if el == "bf16"
            else _to_f32_lines("%a", el, "%r"))
    src = _generic(b, [("%logits", _tt([None, e], el), id2)], [(_empty(b, [None, e], "f32", [T]), _tt([None, e], "f32"), id2)],
                   ["parallel", "parallel"], read + ["linalg.yield %r : f32"], [("%a", el), ("%o", "f32")])
    scores = None
    if routing == "softmax_topk":
        src = _softmax(b, src, [None, e], T)
    elif routing == "sigmoid_topk":
        scores = src = _sigmoid(b, src, [None, e], T)
        if has_bias:
            src = _generic(b, [(scores, _tt([None, e], "f32"), id2), ("%score_bias", _tt([e], "f32"), _map(2, "d1"))],
                           [(_empty(b, [None, e], "f32", [T]), _tt([None, e], "f32"), id2)], ["parallel", "parallel"],
                           ["%r = arith.addf %a, %c : f32", "linalg.yield %r : f32"],
                           [("%a", "f32"), ("%c", "f32"), ("%o", "f32")])
        if n_group > 1 and topk_group < n_group:
            src = _group_limit(b, src, e, n_group, topk_group, T)
    vals, ids, _ = _arg_max_rounds(b, src, e, k, T)
    if routing == "topk_softmax":
        weights = _softmax(b, vals, [None, k], T)
    elif routing == "topk_sigmoid":
        weights = _sigmoid(b, vals, [None, k], T)
    elif routing == "sigmoid_topk":
        # the chosen experts' sigmoid scores (the values chosen on are the scores themselves without a bias)
        weights = _gather_rows(b, scores, e, ids, k, T) if has_bias else vals
        if renorm:
            weights = _normalize_slots(b, weights, k, T, eps="1.000000e-20")
    elif renorm:
        weights = _normalize(b, vals, [None, k], T)
    else:
        weights = vals
    if scaling != 1.0:
        weights = _generic(b, [(weights, _tt([None, k], "f32"), id2)],
                           [(_empty(b, [None, k], "f32", [T]), _tt([None, k], "f32"), id2)], ["parallel", "parallel"],
                           [f"%f = arith.constant {float(scaling)!r} : f32", "%r = arith.mulf %a, %f : f32",
                            "linalg.yield %r : f32"], [("%a", "f32"), ("%o", "f32")])
    b.raw(f"return {weights}, {ids} : {_tt([None, k], 'f32')}, {_tt([None, k], 'i32')}")
    args = f"%logits: {_tt([None, e], el)}" + (f", %score_bias: {_tt([e], 'f32')}" if has_bias else "")
    return (f"func.func private @{fname}({args}) -> ({_tt([None, k], 'f32')}, {_tt([None, k], 'i32')}) {{\n  "
            + "\n  ".join(b.lines) + "\n}")


def _arg_max_rounds(b: _Body, src: str, e: int, k: int, T: str) -> tuple[str, str, str]:
    """k rounds of a row arg-max over ``src`` [T, e] f32 (ties to the lower index, whatever the reduction order),
    each round's winner masked to -inf before the next: (values [T, k], indices [T, k] i32, ``src`` with all k
    winners masked)."""
    if e == 1:  # the one expert wins (IREE's arg-max microkernel fails to lower a reduction of extent 1)
        return src, _filled(b, [None, 1], "i32", [T], "0"), src
    id2, row = _map(2, "d0, d1"), _map(2, "d0")
    vals = _empty(b, [None, k], "f32", [T])
    ids = _empty(b, [None, k], "i32", [T])
    masked = src
    for j in range(k):
        vmax = _filled(b, [None], "f32", [T], "0xFF800000")
        imax = _filled(b, [None], "i32", [T], str(e))
        red = _generic(
            b, [(masked, _tt([None, e], "f32"), id2)],
            [(vmax, _tt([None], "f32"), row), (imax, _tt([None], "i32"), row)], ["parallel", "reduction"],
            ["%ix = linalg.index 1 : index", "%ei = arith.index_cast %ix : index to i32",
             "%gt = arith.cmpf ogt, %a, %bv : f32", "%eq = arith.cmpf oeq, %a, %bv : f32",
             "%lo = arith.cmpi slt, %ei, %bi : i32", "%tie = arith.andi %eq, %lo : i1", "%take = arith.ori %gt, %tie : i1",
             "%nv = arith.select %take, %a, %bv : f32", "%ni = arith.select %take, %ei, %bi : i32",
             "linalg.yield %nv, %ni : f32, i32"],
            [("%a", "f32"), ("%bv", "f32"), ("%bi", "i32")], nres=2)
        rv, ri = red + "#0", red + "#1"
        vals = b.v(f"tensor.insert_slice {rv} into {vals}[0, {j}] [{T}, 1] [1, 1] : {_tt([None], 'f32')} into {_tt([None, k], 'f32')}", "ins")
        ids = b.v(f"tensor.insert_slice {ri} into {ids}[0, {j}] [{T}, 1] [1, 1] : {_tt([None], 'i32')} into {_tt([None, k], 'i32')}", "ins")
        masked = _mask_column(b, masked, ri, e, T) if j + 1 < k else masked
    return vals, ids, masked


def _mask_column(b: _Body, src: str, winner: str, n: int, T: str) -> str:
    """``src`` [T, n] f32 with each row's ``winner`` [T] i32 column set to -inf."""
    id2, row = _map(2, "d0, d1"), _map(2, "d0")
    return _generic(
        b, [(src, _tt([None, n], "f32"), id2), (winner, _tt([None], "i32"), row)],
        [(_empty(b, [None, n], "f32", [T]), _tt([None, n], "f32"), id2)], ["parallel", "parallel"],
        ["%ix = linalg.index 1 : index", "%ei = arith.index_cast %ix : index to i32",
         "%hit = arith.cmpi eq, %ei, %w : i32", "%ninf = arith.constant 0xFF800000 : f32",
         "%r = arith.select %hit, %ninf, %a : f32", "linalg.yield %r : f32"],
        [("%a", "f32"), ("%w", "i32"), ("%o", "f32")])


def _group_limit(b: _Body, src: str, e: int, n_group: int, topk_group: int, T: str) -> str:
    """``src`` [T, e] with the experts outside the ``topk_group`` best of ``n_group`` groups (consecutive experts)
    at -inf; a group's score is the sum of its two largest values, ties of groups to the lower group index."""
    m = e // n_group
    g3 = [None, n_group, m]
    grouped = b.v(f"tensor.expand_shape {src} [[0], [1, 2]] output_shape [{T}, {n_group}, {m}] : "
                  f"{_tt([None, e], 'f32')} into {_tt(g3, 'f32')}", "grp")
    m1 = _filled(b, [None, n_group], "f32", [T], "0xFF800000")
    m2 = _filled(b, [None, n_group], "f32", [T], "0xFF800000")
    # the two largest values of each group: a tie with the largest is the second largest (order-independent)
    top2 = _generic(b, [(grouped, _tt(g3, "f32"), _map(3, "d0, d1, d2"))],
                    [(m1, _tt([None, n_group], "f32"), _map(3, "d0, d1")),
                     (m2, _tt([None, n_group], "f32"), _map(3, "d0, d1"))], ["parallel", "parallel", "reduction"],
                    ["%gt = arith.cmpf ogt, %a, %b1 : f32", "%n1 = arith.select %gt, %a, %b1 : f32",
                     "%gt2 = arith.cmpf ogt, %a, %b2 : f32", "%mx2 = arith.select %gt2, %a, %b2 : f32",
                     "%n2 = arith.select %gt, %b1, %mx2 : f32", "linalg.yield %n1, %n2 : f32, f32"],
                    [("%a", "f32"), ("%b1", "f32"), ("%b2", "f32")], nres=2)
    id2 = _map(2, "d0, d1")
    gscore = _generic(b, [(top2 + "#0", _tt([None, n_group], "f32"), id2), (top2 + "#1", _tt([None, n_group], "f32"), id2)],
                      [(_empty(b, [None, n_group], "f32", [T]), _tt([None, n_group], "f32"), id2)],
                      ["parallel", "parallel"], ["%r = arith.addf %a, %c : f32", "linalg.yield %r : f32"],
                      [("%a", "f32"), ("%c", "f32"), ("%o", "f32")])
    # after topk_group masked arg-max rounds the chosen groups are exactly those at -inf (group scores are finite)
    _, _, gmasked = _arg_max_rounds_masking_all(b, gscore, n_group, topk_group, T)
    out = _generic(b, [(grouped, _tt(g3, "f32"), _map(3, "d0, d1, d2")),
                       (gmasked, _tt([None, n_group], "f32"), _map(3, "d0, d1"))],
                   [(_empty(b, g3, "f32", [T]), _tt(g3, "f32"), _map(3, "d0, d1, d2"))], ["parallel"] * 3,
                   ["%ninf = arith.constant 0xFF800000 : f32", "%chosen = arith.cmpf oeq, %g, %ninf : f32",
                    "%r = arith.select %chosen, %a, %ninf : f32", "linalg.yield %r : f32"],
                   [("%a", "f32"), ("%g", "f32"), ("%o", "f32")])
    return b.v(f"tensor.collapse_shape {out} [[0], [1, 2]] : {_tt(g3, 'f32')} into {_tt([None, e], 'f32')}", "ungrp")


def _arg_max_rounds_masking_all(b: _Body, src: str, n: int, rounds: int, T: str):
    """:func:`_arg_max_rounds` with the last winner masked too (the mask is the result wanted)."""
    vals, ids, masked = _arg_max_rounds(b, src, n, rounds, T)
    last = b.v(f"tensor.extract_slice {ids}[0, {rounds - 1}] [{T}, 1] [1, 1] : {_tt([None, rounds], 'i32')} to "
               f"{_tt([None], 'i32')}", "last")
    return vals, ids, _mask_column(b, masked, last, n, T)


def _sigmoid(b: _Body, src: str, dims, T: str) -> str:
    """1 / (1 + exp(-x)) in f32, elementwise (as the references write it)."""
    id2 = _map(2, "d0, d1")
    return _generic(b, [(src, _tt(dims, "f32"), id2)], [(_empty(b, dims, "f32", [T]), _tt(dims, "f32"), id2)],
                    ["parallel", "parallel"],
                    ["%one = arith.constant 1.0 : f32", "%n = arith.negf %a : f32", "%x = math.exp %n : f32",
                     "%d = arith.addf %x, %one : f32", "%r = arith.divf %one, %d : f32", "linalg.yield %r : f32"],
                    [("%a", "f32"), ("%o", "f32")])


def _gather_rows(b: _Body, src: str, e: int, ids: str, k: int, T: str) -> str:
    """out[t, j] = src[t, ids[t, j]] (src [T, e] f32, ids [T, k] i32)."""
    id2 = _map(2, "d0, d1")
    return _generic(b, [(ids, _tt([None, k], "i32"), id2)], [(_empty(b, [None, k], "f32", [T]), _tt([None, k], "f32"), id2)],
                    ["parallel", "parallel"],
                    ["%t = linalg.index 0 : index", "%ix = arith.index_cast %i : i32 to index",
                     f"%r = tensor.extract {src}[%t, %ix] : {_tt([None, e], 'f32')}", "linalg.yield %r : f32"],
                    [("%i", "i32"), ("%o", "f32")])


def _normalize_slots(b: _Body, src: str, k: int, T: str, eps: str) -> str:
    """src[t, j] / (sum_j src[t, j] + eps): the sum in slot order j = 0.. from 0.0 (the references' order), one
    parallel generic over the k columns (no reduction whose order the compiler picks)."""
    row, one, id2 = _map(2, "d0"), _map(1, "d0"), _map(2, "d0, d1")
    cols = [b.v(f"tensor.extract_slice {src}[0, {j}] [{T}, 1] [1, 1] : {_tt([None, k], 'f32')} to {_tt([None], 'f32')}",
                "wj") for j in range(k)]
    body = ["%s0 = arith.constant 0.0 : f32"] + [f"%s{j + 1} = arith.addf %s{j}, %col{j} : f32" for j in range(k)]
    body += [f"%eps = arith.constant {eps} : f32", f"%r = arith.addf %s{k}, %eps : f32", "linalg.yield %r : f32"]
    sm = _generic(b, [(c, _tt([None], "f32"), one) for c in cols], [(_empty(b, [None], "f32", [T]), _tt([None], "f32"), one)],
                  ["parallel"], body, [(f"%col{j}", "f32") for j in range(k)] + [("%o", "f32")])
    return _generic(b, [(src, _tt([None, k], "f32"), id2), (sm, _tt([None], "f32"), row)],
                    [(_empty(b, [None, k], "f32", [T]), _tt([None, k], "f32"), id2)], ["parallel", "parallel"],
                    ["%r = arith.divf %a, %s : f32", "linalg.yield %r : f32"], [("%a", "f32"), ("%s", "f32"), ("%o", "f32")])


def _row_reduce(b: _Body, src: str, n: int, T: str, init: str, combine: str) -> str:
    acc = _filled(b, [None], "f32", [T], init)
    return _generic(b, [(src, _tt([None, n], "f32"), _map(2, "d0, d1"))], [(acc, _tt([None], "f32"), _map(2, "d0"))],
                    ["parallel", "reduction"], [f"%r = {combine} %a, %o : f32", "linalg.yield %r : f32"],
                    [("%a", "f32"), ("%o", "f32")])


def _softmax(b: _Body, src: str, dims, T: str) -> str:
    n = dims[1]
    id2, row = _map(2, "d0, d1"), _map(2, "d0")
    mx = _row_reduce(b, src, n, T, "0xFF800000", "arith.maximumf")
    ex = _generic(b, [(src, _tt(dims, "f32"), id2), (mx, _tt([None], "f32"), row)],
                  [(_empty(b, dims, "f32", [T]), _tt(dims, "f32"), id2)], ["parallel", "parallel"],
                  ["%d = arith.subf %a, %m : f32", "%r = math.exp %d : f32", "linalg.yield %r : f32"],
                  [("%a", "f32"), ("%m", "f32"), ("%o", "f32")])
    return _normalize(b, ex, dims, T)


def _normalize(b: _Body, src: str, dims, T: str) -> str:
    id2, row = _map(2, "d0, d1"), _map(2, "d0")
    sm = _row_reduce(b, src, dims[1], T, "0.0", "arith.addf")
    return _generic(b, [(src, _tt(dims, "f32"), id2), (sm, _tt([None], "f32"), row)],
                    [(_empty(b, dims, "f32", [T]), _tt(dims, "f32"), id2)], ["parallel", "parallel"],
                    ["%r = arith.divf %a, %s : f32", "linalg.yield %r : f32"], [("%a", "f32"), ("%s", "f32"), ("%o", "f32")])


# -------------------------------------------------------------------------------- grouped matmul
def _input_lines(v: str, el_in: str, out: str, rounded_to: str | None) -> list[str]:
    """An epilogue's input ``v`` as f32 ``out``; ``rounded_to``: an f32 input first rounded to that type (the
    reference's rounding point), so that the rounding fuses into the epilogue instead of a pass of its own."""
    if rounded_to is None:
        return _to_f32_lines(v, el_in, out)
    if rounded_to == "bf16":
        # round to nearest even on the bits: IREE's bf16 emulation folds an extf(truncf(x)) pair away
        return [f"{out}_b = arith.bitcast {v} : f32 to i32", f"{out}_k16 = arith.constant 16 : i32",
                f"{out}_k1 = arith.constant 1 : i32", f"{out}_kh = arith.constant 32767 : i32",
                f"{out}_km = arith.constant -65536 : i32", f"{out}_s = arith.shrui {out}_b, {out}_k16 : i32",
                f"{out}_l = arith.andi {out}_s, {out}_k1 : i32", f"{out}_a = arith.addi {out}_b, {out}_kh : i32",
                f"{out}_a2 = arith.addi {out}_a, {out}_l : i32", f"{out}_m = arith.andi {out}_a2, {out}_km : i32",
                f"{out}_f = arith.bitcast {out}_m : i32 to f32", f"{out}_nan = arith.cmpf uno, {v}, {v} : f32",
                f"{out} = arith.select {out}_nan, {v}, {out}_f : f32"]
    return [f"{out}_r = arith.truncf {v} : f32 to {rounded_to}", f"{out} = arith.extf {out}_r : {rounded_to} to f32"]


def _glu_apply(b: _Body, h: str, dims_in: list, el_in: str, el_out: str, T: str, act: str, alpha: float, limit: float,
               interleaved: bool, rounded_to: str | None = None) -> str:
    """glu over the last dim of ``h`` (type el_in, already rounded as the reference does, or f32 rounded to
    ``rounded_to`` on the way in) -> el_out tensor."""
    r = len(dims_in)
    i = dims_in[-1] // 2
    out_dims = dims_in[:-1] + [i]

    def half(which: int) -> str:
        # gate (0) / up (1) as its own [..., i] tensor, so the generic below has identity maps only
        # (a constant index in an indexing map makes IREE's CPU codegen fall back to scalar code)
        first, step = (which, 2) if interleaved else (which * i, 1)
        offs = ", ".join(["0"] * (r - 1) + [str(first)])
        sizes = ", ".join([T] + [str(d) for d in dims_in[1:-1]] + [str(i)])
        strides = ", ".join(["1"] * (r - 1) + [str(step)])
        return b.v(f"tensor.extract_slice {h}[{offs}] [{sizes}] [{strides}] : {_tt(dims_in, el_in)} to "
                   f"{_tt(out_dims, el_in)}", "gu")

    gate, up = half(0), half(1)
    body = (_input_lines("%g0", el_in, "%g1", rounded_to) + _input_lines("%u0", el_in, "%u1", rounded_to)
            + ["%one = arith.constant 1.0 : f32"])
    if act == "swiglu_oai":
        body += [f"%lim = arith.constant {float(limit)!r} : f32", f"%nlim = arith.constant {-float(limit)!r} : f32",
                 f"%alpha = arith.constant {float(alpha)!r} : f32",
                 "%g = arith.minimumf %g1, %lim : f32", "%u2 = arith.minimumf %u1, %lim : f32", "%u = arith.maximumf %u2, %nlim : f32",
                 "%z = arith.mulf %g, %alpha : f32", "%nz = arith.negf %z : f32", "%ez = math.exp %nz : f32",
                 "%den = arith.addf %ez, %one : f32", "%sig = arith.divf %one, %den : f32", "%glu = arith.mulf %g, %sig : f32",
                 "%up1 = arith.addf %u, %one : f32", "%res = arith.mulf %up1, %glu : f32"]
    elif act in ("gelu", "gelu_tanh"):
        body += ["%half = arith.constant 0.5 : f32", "%hx = arith.mulf %g1, %half : f32"]
        if act == "gelu":  # x/2 * (1 + erf(x / sqrt(2)))
            body += [f"%rs2 = arith.constant {1 / 2 ** 0.5!r} : f32", "%z = arith.mulf %g1, %rs2 : f32",
                     "%t = math.erf %z : f32"]
        else:  # x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
            body += [f"%beta = arith.constant {(2 / 3.141592653589793) ** 0.5!r} : f32",
                     "%kap = arith.constant 0.044715 : f32", "%x2 = arith.mulf %g1, %g1 : f32",
                     "%x3 = arith.mulf %x2, %g1 : f32", "%kx3 = arith.mulf %x3, %kap : f32",
                     "%in0 = arith.addf %g1, %kx3 : f32", "%in = arith.mulf %in0, %beta : f32", "%t = math.tanh %in : f32"]
        body += ["%t1 = arith.addf %t, %one : f32", "%glu = arith.mulf %hx, %t1 : f32", "%res = arith.mulf %u1, %glu : f32"]
    else:  # silu, silu_clamped
        if act == "silu_clamped":
            body += [f"%lim = arith.constant {float(limit)!r} : f32", f"%nlim = arith.constant {-float(limit)!r} : f32",
                     "%g = arith.minimumf %g1, %lim : f32", "%u2 = arith.minimumf %u1, %lim : f32",
                     "%u = arith.maximumf %u2, %nlim : f32"]
            g, u = "%g", "%u"
        else:
            g, u = "%g1", "%u1"
        body += [f"%nz = arith.negf {g} : f32", "%ez = math.exp %nz : f32", "%den = arith.addf %ez, %one : f32",
                 f"%sig = arith.divf %one, %den : f32", f"%glu = arith.mulf {g}, %sig : f32",
                 f"%res = arith.mulf {u}, %glu : f32"]
    body += _from_f32_lines("%res", el_out, "%out") + [f"linalg.yield %out : {el_out}"]
    ident = _map(r, ", ".join(f"d{d}" for d in range(r)))
    return _generic(b, [(gate, _tt(out_dims, el_in), ident), (up, _tt(out_dims, el_in), ident)],
                    [(_empty(b, out_dims, el_out, [T]), _tt(out_dims, el_out), ident)], ["parallel"] * r, body,
                    [("%g0", el_in), ("%u0", el_in), ("%o", el_out)])


def _combine_apply(b: _Body, y: str, ydims: list, yel: str, weights: str, T: str, rounded_to: str | None = None) -> str:
    """sum_j y[:, j] * weights[:, j] in f32 (y of ``yel``, or f32 rounded to ``rounded_to`` on the way in), in
    order j = 0.. from 0.0, rounded to the activation type: one parallel
    generic over the k slices y[:, j] (the same sum as a reduction over j, which IREE tiles as a strided
    matvec; constant indices in the maps instead of slices make its CPU codegen scalar)."""
    _, k, h = ydims
    ident, row = _map(2, "d0, d1"), _map(2, "d0")
    ins = [(b.v(f"tensor.extract_slice {y}[0, {j}, 0] [{T}, 1, {h}] [1, 1, 1] : {_tt(ydims, yel)} to {_tt([None, h], yel)}",
                "yj"), _tt([None, h], yel), ident) for j in range(k)]
    ins += [(b.v(f"tensor.extract_slice {weights}[0, {j}] [{T}, 1] [1, 1] : {_tt([None, k], 'f32')} to {_tt([None], 'f32')}",
                 "wj"), _tt([None], "f32"), row) for j in range(k)]
    body = ["%acc0 = arith.constant 0.0 : f32"]
    for j in range(k):
        body += _input_lines(f"%y{j}", yel, f"%yf{j}", rounded_to)
        body += [f"%p{j} = arith.mulf %yf{j}, %w{j} : f32", f"%acc{j + 1} = arith.addf %acc{j}, %p{j} : f32"]
    body += [f"linalg.yield %acc{k} : f32"]
    out = _empty(b, [None, h], "f32", [T])
    red = _generic(b, ins, [(out, _tt([None, h], "f32"), _map(2, "d0, d1"))], ["parallel", "parallel"], body,
                   [(f"%y{j}", yel) for j in range(k)] + [(f"%w{j}", "f32") for j in range(k)] + [("%o", "f32")])
    return _round(b, red, [None, h], rounded_to or yel, [T])


def _matmul_func(fname: str, v: OpView, ukernel: str | None = None, activations: str | None = None,
                 decode: str = "scaling_extf") -> list[str]:
    """The private function (and, with a cpu ``ukernel`` object, the microkernel's executable before it)."""
    ts = v.operand_types()
    has_bias = v.attr("has_bias")
    x, ids, w, s = ts[:4]
    e, n, kh = shape(w)
    kk = 2 * kh
    k = shape(ids)[1]
    xel = str(x.element_type)
    args = [f"%x: {x}", f"%ids: {ids}", f"%w: {w}", f"%s: {s}"]
    bias_t = str(ts[4]) if has_bias else None
    if has_bias:
        args.append(f"%bias: {bias_t}")
    b = _Body()
    c0 = b.const(0, "index")
    T = b.v(f"tensor.dim %x, {c0} : {x}", "T")
    extra = []
    interleaved = v.attr("interleaved") if v.name == "mxmoe.grouped_matmul_glu" else None
    glu = None  # (activation, alpha, limit) where the cpu microkernel applies the GLU
    y_el, rounded_to = xel, None  # the matmul result's type, and the rounding still to apply to it
    if activations in cpu_ukernel.PLANES and _layout(v) != cpu_grouped.ROWS16_LAYOUT:
        v.fail(f"activations='{activations}' needs the weight layout '{cpu_grouped.ROWS16_LAYOUT}', got '{_layout(v)}'")
    if _layout(v) in (cpu_grouped.LAYOUT, cpu_grouped.ROWS16_LAYOUT):
        bias = ("%bias", str(ts[4].element_type)) if has_bias else None
        # the rows16 layout's activation form: mxint8 unless the option asks for mxint16, or for bf16 (the AMX form)
        form = 0
        if _layout(v) == cpu_grouped.ROWS16_LAYOUT:
            form = cpu_ukernel.BF16_ROWS16 if activations == "bf16" else cpu_ukernel.PLANES.get(activations, 1)
        if form and ukernel is None:
            v.fail(f"weight layout '{cpu_grouped.ROWS16_LAYOUT}' (activations='mxint8' / 'mxint16' / 'bf16') is read by "
                   f"the cpu microkernel only: pass {NAME}{{ukernel=PATH}}")
        if form == cpu_ukernel.BF16_ROWS16 and xel != "bf16":
            v.fail(f"weight layout '{cpu_grouped.ROWS16_LAYOUT}' with activations='bf16' reads bf16 activations, got "
                   f"{xel} (the cpu target keeps other layers' weights blocksplit)")
        # int16 activations are below bf16/f16 resolution, not f32's: f32 layers keep the exact linalg matvec
        # (the int8 forms quantize every activation type: that is what they are asked for)
        if ukernel is not None and (form or xel in cpu_ukernel.ACTIVATION_TYPES):
            # the kernel stores interleaved gate/up outputs as halves: the GLU then reads unit-stride rows; or it
            # applies the GLU itself (its epilogue has the activation), rounding where the reference rounds
            deinterleave = bool(interleaved)
            interleaved = interleaved and not deinterleave
            if v.name == "mxmoe.grouped_matmul_glu" and cpu_ukernel.applies_glu(v.attr("activation"), n):
                glu = (v.attr("activation"), v.attr("alpha"), v.attr("limit"))
            exes, texts = cpu_ukernel.executables(fname, ukernel, e, n, kk, xel, k if x.rank == 2 else 1,
                                                  bias[1] if bias else None, deinterleave, form, glu)
            extra += texts
            ys = cpu_grouped.grouped_matmul_ukernel(b, "%x", x, k, e, n, kk, bias, T, exes, form, glu)
            # f32 [T, k, n] by slot; the epilogue rounds each value to xel as it reads it (no pass of its own).
            # With the kernel's GLU: [T, k, n / 2] of xel, the op's result
            ny, yel = (n // 2, xel) if glu else (n, "f32")
            y = b.v(f"tensor.expand_shape {ys} [[0, 1], [2]] output_shape [{T}, {k}, {ny}] : "
                          f"{_tt([None, ny], yel)} into {_tt([None, k, ny], yel)}", "y")
            y_el, rounded_to = "f32", (xel if xel != "f32" else None)  # an f32 layer has nothing to round
        else:
            ys, pos = cpu_grouped.grouped_matmul_rows(b, "%x", x, k, e, n, kk, bias, T)
            y = cpu_grouped.unsort_rounded(b, ys, pos, k, n, xel, T)
    else:
        # rounded to xel by slot inside each block-size branch (where it fuses into the read back)
        y = rocm_grouped.grouped_matmul(b, "%x", x, k, e, n, kk, bias_t, T, activations or rocm_grouped.ACTIVATIONS[0],
                                        decode, round_to=xel)
    if v.name == "mxmoe.grouped_matmul":
        result, rt = _round(b, y, [None, k, n], xel, [T]) if rounded_to else y, _tt([None, k, n], xel)
    elif v.name == "mxmoe.grouped_matmul_glu" and glu:
        result, rt = y, _tt([None, k, n // 2], xel)
    elif v.name == "mxmoe.grouped_matmul_glu":
        result = _glu_apply(b, y, [None, k, n], y_el, xel, T, v.attr("activation"), v.attr("alpha"),
                            v.attr("limit"), interleaved, rounded_to)
        rt = _tt([None, k, n // 2], xel)
    else:  # grouped_matmul_combine
        args.append(f"%weights: {ts[-1]}")
        result = _combine_apply(b, y, [None, k, n], y_el, "%weights", T, rounded_to)
        rt = _tt([None, n], xel)
    b.raw(f"return {result} : {rt}")
    return extra + [f"func.func private @{fname}({', '.join(args)}) -> {rt} {{\n  " + "\n  ".join(b.lines) + "\n}"]


def _glu_func(fname: str, v: OpView) -> str:
    (h,) = v.operand_types()
    dims = shape(h)
    el = str(h.element_type)
    b = _Body()
    c0 = b.const(0, "index")
    T = b.v(f"tensor.dim %h, {c0} : {h}", "T")
    out = _glu_apply(b, "%h", dims, el, el, T, v.attr("activation"), v.attr("alpha"), v.attr("limit"), v.attr("interleaved"))
    rt = v.result_types()[0]
    b.raw(f"return {out} : {rt}")
    return f"func.func private @{fname}(%h: {h}) -> {rt} {{\n  " + "\n  ".join(b.lines) + "\n}"


def _combine_func(fname: str, v: OpView) -> str:
    y, wt = v.operand_types()
    b = _Body()
    c0 = b.const(0, "index")
    T = b.v(f"tensor.dim %y, {c0} : {y}", "T")
    out = _combine_apply(b, "%y", shape(y), str(y.element_type), "%weights", T)
    rt = v.result_types()[0]
    b.raw(f"return {out} : {rt}")
    return f"func.func private @{fname}(%y: {y}, %weights: {wt}) -> {rt} {{\n  " + "\n  ".join(b.lines) + "\n}"


def _map_experts_func(fname: str, v: OpView) -> str:
    """local[t, j] = map[ids[t, j]] (or the id itself without a map); -1 where the id is outside [0, num_global)
    or its expert is not this layer's."""
    ts = v.operand_types()
    ids = ts[0]
    _, k = shape(ids)
    iel, g = str(ids.element_type), v.attr("num_global")
    has_map = v.attr("has_map")
    args = [f"%ids: {ids}"] + ([f"%map: {ts[1]}"] if has_map else [])
    b = _Body()
    c0 = b.const(0, "index")
    T = b.v(f"tensor.dim %ids, {c0} : {ids}", "T")
    ident = _map(2, "d0, d1")
    wide = [f"%i = arith.extsi %a : {iel} to i64"] if iel != "i64" else []  # i64 ids are the block argument
    body = (wide + [
        f"%gmax = arith.constant {g} : i64", "%z = arith.constant 0 : i64",
        "%ge = arith.cmpi sge, %i, %z : i64", "%lt = arith.cmpi slt, %i, %gmax : i64", "%valid = arith.andi %ge, %lt : i1",
        "%safe = arith.select %valid, %i, %z : i64", "%neg = arith.constant -1 : i32"])
    if has_map:
        body += ["%ix = arith.index_cast %safe : i64 to index", f"%local = tensor.extract %map[%ix] : {ts[1]}"]
    else:
        body += ["%local = arith.trunci %safe : i64 to i32"]
    body += ["%r = arith.select %valid, %local, %neg : i32", "linalg.yield %r : i32"]
    out = _generic(b, [("%ids", str(ids), ident)], [(_empty(b, [None, k], "i32", [T]), _tt([None, k], "i32"), ident)],
                   ["parallel", "parallel"], body, [("%i" if iel == "i64" else "%a", iel), ("%o", "i32")])
    b.raw(f"return {out} : {_tt([None, k], 'i32')}")
    return (f"func.func private @{fname}({', '.join(args)}) -> {_tt([None, k], 'i32')} {{\n  " + "\n  ".join(b.lines)
            + "\n}")


def _weight_rows_func(fname: str, v: OpView) -> str:
    """out[t, j, :] = x[t, :] * round(weights[t, j]), rounded to x's type (the weight is rounded to it first)."""
    x, wt = v.operand_types()
    _, h = shape(x)
    _, k = shape(wt)
    el = str(x.element_type)
    b = _Body()
    c0 = b.const(0, "index")
    T = b.v(f"tensor.dim %x, {c0} : {x}", "T")
    out_dims = [None, k, h]
    # the weight rounded to x's type on the bits (IREE folds a truncf/extf pair away)
    body = (_to_f32_lines("%xv", el, "%xf") + _input_lines("%wv", "f32", "%wf", None if el == "f32" else el)
            + ["%p = arith.mulf %xf, %wf : f32"] + _from_f32_lines("%p", el, "%r") + [f"linalg.yield %r : {el}"])
    out = _generic(b, [("%x", str(x), _map(3, "d0, d2")), ("%weights", str(wt), _map(3, "d0, d1"))],
                   [(_empty(b, out_dims, el, [T]), _tt(out_dims, el), _map(3, "d0, d1, d2"))], ["parallel"] * 3, body,
                   [("%xv", el), ("%wv", "f32"), ("%o", el)])
    b.raw(f"return {out} : {_tt(out_dims, el)}")
    return (f"func.func private @{fname}(%x: {x}, %weights: {wt}) -> {_tt(out_dims, el)} {{\n  " + "\n  ".join(b.lines)
            + "\n}")


_EMITTERS = {
    "mxmoe.route": _route_func,
    "mxmoe.glu": _glu_func,
    "mxmoe.combine": _combine_func,
    "mxmoe.map_experts": _map_experts_func,
    "mxmoe.weight_rows": _weight_rows_func,
}


def _emit(fname: str, v: OpView, ukernel: str | None, activations: str | None, decode: str) -> list[str]:
    """Texts of the module-level ops that lower ``v`` (a function, after the executable it dispatches)."""
    if v.name.startswith("mxmoe.grouped_matmul"):
        return _matmul_func(fname, v, ukernel, activations, decode)
    return [_EMITTERS[v.name](fname, v)]

LAYOUT_ATTR = dialect.LAYOUT_ATTR
ROW_MAJOR = "mxfp4-rowmajor"
SUPPORTED_LAYOUTS = (ROW_MAJOR, cpu_grouped.LAYOUT, cpu_grouped.ROWS16_LAYOUT)


def _layout(v: OpView) -> str:
    """The op's weight layout (an op without the attribute is read as row-major)."""
    return dialect.py_attr(v.op.attributes[LAYOUT_ATTR]) if LAYOUT_ATTR in v.op.attributes else ROW_MAJOR


def _check_layout(v: OpView) -> None:
    if v.name.startswith("mxmoe.grouped_matmul"):
        layout = _layout(v)
        if layout not in SUPPORTED_LAYOUTS:
            v.fail(f"weight layout '{layout}' has no linalg lowering (supported: {', '.join(SUPPORTED_LAYOUTS)})")


def _signature_key(op: ir.Operation) -> str:
    # the layout is part of the key: it selects the lowering strategy
    text = op.name + "|" + "|".join(str(o.type) for o in op.operands) + "|" + "|".join(
        f"{n}={op.attributes[n]}" for n in op.attributes)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def make(option: str | None):
    """Options (comma-separated): ``ukernel=PATH``: link the cpu microkernel object at PATH (``mxmoe.kernels.cpu``) and
    use it for the blocksplit layout's grouped matmuls with bf16/f16 activations and for the rows16 layout's (which
    reads it only); without it the pass emits linalg only. ``activations=bf16|mxfp8`` and ``decode=scaling_extf|int``:
    the row-major layout's contraction form and weight decode (``lowering/rocm_grouped.py``);
    ``activations=mxint8|mxint16|bf16``: the rows16 layout's activation form (mxint8 when not given; bf16: the AMX
    form of bf16 layers, ``kernels/cpu/bf16_rows16.c``)."""
    ukernel, forms = None, {"activations": None, "decode": rocm_grouped.DECODES[0]}
    choices = {"activations": (*rocm_grouped.ACTIVATIONS, *cpu_ukernel.PLANES), "decode": rocm_grouped.DECODES}
    expected = "'ukernel=PATH' or " + ",".join(f"'{key}={'|'.join(vals)}'" for key, vals in choices.items())
    for item in option.split(",") if option else ():
        key, eq, value = (part.strip() for part in item.partition("="))
        if key == "ukernel":
            if not eq or not value:
                raise VerifyError(f"pass '{NAME}': unknown option '{{{option}}}' (expected {expected})")
            if '"' in value or "\\" in value:
                raise VerifyError(f"pass '{NAME}': the ukernel path may not contain quotes or backslashes: {value}")
            ukernel = value
            continue
        if key not in choices or not eq:
            raise VerifyError(f"pass '{NAME}': unknown option '{{{option}}}' (expected {expected})")
        if value not in choices[key]:
            raise VerifyError(f"pass '{NAME}': {key} must be one of {', '.join(choices[key])}, got '{value}'")
        forms[key] = value
    return lambda module_op: run(module_op, ukernel, **forms)


def run(module_op: ir.Operation, ukernel: str | None = None, activations: str | None = None,
        decode: str = "scaling_extf") -> None:
    module_body = module_op.regions[0].blocks[0]
    emitted: set[str] = set()
    for op in dialect.walk_mxmoe(module_op):
        dialect.verify_op(op)
        if op.name == "mxmoe.route":
            round_router_once(op)  # before generalize_tokens, which puts a reshape between the router and the route
        op = dialect.generalize_tokens(op)  # the emitters write functions of any T
        v = OpView(op)
        _check_layout(v)
        fname = op.name.replace(".", "_") + "_" + _signature_key(op)
        if fname not in emitted:
            for text in _emit(fname, v, ukernel, activations, decode):
                try:
                    parsed = ir.Operation.parse(text)
                except Exception as exc:  # a bug in the emitter, not bad user input
                    raise VerifyError(f"{op.location}: internal error lowering '{op.name}': {exc}\n{text}") from exc
                ir.InsertionPoint(module_body).insert(parsed)
            emitted.add(fname)
        with ir.InsertionPoint(op), op.location:
            call = ir.Operation.create("func.call", results=[r.type for r in op.results], operands=list(op.operands),
                                       attributes={"callee": ir.FlatSymbolRefAttr.get(fname)})
        for old, new in zip(op.results, call.results):
            old.replace_all_uses_with(new)
        op.erase()
