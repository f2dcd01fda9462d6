"""The cpu lowering's microkernel form of a grouped matmul: two IREE dispatches of hand-written C.

Used by :mod:`cpu_grouped` at every token count when the microkernel object was built
(``mxmoe.kernels.cpu``) and the activations are bf16 or f16. Pieces of IR:

* :func:`group_dispatch`: the C grouping (``mxmoe_group_slots``, one workgroup, O(slots + experts)):
  ``order`` (sorted position -> slot: each expert's slots in slot order, the slots whose id is outside
  [0, E) last), the work items (each used expert's rows cut into pieces of at most :func:`row_chunk`) and the
  counts (work items, valid slots).
* :func:`quantize_dispatch`: the C quantizer (``mxmoe_mxfp4_quantize_rows``) reads each sorted row's
  activations straight from the op's input (row ``order[p] / div``) and writes them as int16 with one
  power-of-two scale per 32-value block, in the order the matvec's decode produces weights (the format
  is described in ``kernels/cpu/mxfp4_matvec.c``); a few rows per workgroup.
* :func:`matvec_dispatch`: a ``flow.dispatch`` over (output tiles, work items + 1); each workgroup
  reads its item's expert id, first row and row count from the ``info`` table on the device, so all
  used experts run in one dispatch with no host loop and no read back (the last row of workgroups writes
  the zero rows of the slots with no expert). It writes each row back to its slot (``order``), so the
  result is in token order and what follows (GLU, combine) needs no gather.
* :func:`executable_text`: the ``stream.executable`` whose function calls a C symbol, with the object
  file attached (``hal.executable.objects``) so ``iree-compile`` links it into the module.

The int8 forms (weights in the ``cpu-mxfp4-rows16`` layout, the cpu target's ``activations="mxint8"`` or
``"mxint16"``) have the same three dispatches with other symbols and activation buffers (``form=1`` or ``2``, the
int8 planes per row): the quantizer writes each row as ``form`` int8 rows (``[S, form K]`` int8 and
``[S, form 2 K/32]`` f32 words: per plane the block scales, then the int32 offset corrections), and the matmul reads
them with the rows16 weights, adding a row's planes (``kernels/cpu/mxint8_rows16.c``). The bf16 form of the rows16
layout (``form=BF16_ROWS16``: bf16 layers on AMX hosts) packs the bf16 rows themselves, permuted per block and stored
block-major (``[S, K]`` i16; the xs buffer is one unused word a row), for a matmul on AMX tiles
(``kernels/cpu/bf16_rows16.c``).
"""

from __future__ import annotations

import re
import struct

from mxmoe.compiler.passes.lowering.text import Body, tt
from mxmoe.kernels.cpu import (BF16_ROWS16_PACK_SYMBOL, BF16_ROWS16_SYMBOL, GROUP_SYMBOL, MATVEC_SYMBOL,
                               MXINT8_QUANTIZE_SYMBOL, MXINT16_QUANTIZE_SYMBOL, QUANTIZE_SYMBOL, ROWS16_SYMBOL,
                               ROWS16X2_SYMBOL)

#: outputs per matvec workgroup (a multiple of 32, like the padded N)
TILE_N = 64
#: outputs per workgroup of the int8 form's matmul (a multiple of its 16-row groups). gpt-oss-20b, 2 threads,
#: fastest of 45 calls at T = 1 / 4 / 8 / 64: 64 -> 1.40 / 5.55 / 9.62 / 26.6 ms, 128 -> 1.28 / 5.43 / 9.37 / 26.3,
#: 256 -> 1.36 / 5.37 / 9.12 / 26.1 (2026-11-27): 128 keeps twice 256's workgroups for machines with more cores
TILE_N_INT8 = 128
#: activation rows per quantizer workgroup, at least; with many rows, enough per workgroup that there are
#: at most QUANTIZE_GROUPS workgroups (each costs ~1 us of IREE's task system)
QUANTIZE_ROWS = 4
QUANTIZE_GROUPS = 256
#: at most this many rows of one expert per work item (mxmoe_group_slots cuts each expert's rows into items
#: of equal size): many tokens on one expert spread over the workers, and an item's rows stay in cache
#: while each output reads them (the kernels hold up to 64: MAX_ITEM_ROWS)
ROW_CHUNK = 64
#: the same for the AMX form of bf16 layers (BF16R16_MAX_ROWS), whose items decode their weights once whatever their
#: rows: with 64, an expert of 65-128 rows was two items that each decoded the whole expert
ROW_CHUNK_BF16_ROWS16 = 128
#: the rows16 layout's int8 activation forms -> their ``form`` (below): int8 planes per activation row (0: the
#: blocksplit layout's form)
PLANES = {"mxint8": 1, "mxint16": 2}
#: the ``form`` of the rows16 layout's bf16 activations (the AMX form of bf16 layers)
BF16_ROWS16 = 3


def row_chunk(form: int) -> int:
    """The most rows of one expert in a work item of the matmul of ``form``."""
    return ROW_CHUNK_BF16_ROWS16 if form == BF16_ROWS16 else ROW_CHUNK


#: per form: the quantizer's and the matmul's symbols
_SYMBOLS = {0: (QUANTIZE_SYMBOL, MATVEC_SYMBOL), 1: (MXINT8_QUANTIZE_SYMBOL, ROWS16_SYMBOL),
            2: (MXINT16_QUANTIZE_SYMBOL, ROWS16X2_SYMBOL), BF16_ROWS16: (BF16_ROWS16_PACK_SYMBOL, BF16_ROWS16_SYMBOL)}
#: activation types the int16 rounding is invisible for (2^-15 of a block's largest, below their resolution)
ACTIVATION_TYPES = ("bf16", "f16")
#: the C kernels' element kinds (activations and biases)
KINDS = {None: 0, "bf16": 1, "f32": 2, "f16": 3}
#: GLU activation -> the code of the matmul's GLU epilogue (``kernels/cpu/glu_epilogue.c``); a w13 matmul with
#: one of these writes the GLU's result itself (:func:`applies_glu`), the others keep the GLU generic
GLU_CODES = {"swiglu_oai": 1, "silu": 2, "silu_clamped": 3, "gelu_tanh": 4}
#: the epilogue's output tiles hold whole runs of 8 (gate, up) pairs in either gate/up order: n a multiple of this
#: (the cpu target pads I to a multiple of 32, so every padded w13 qualifies)
GLU_MULTIPLE = 32


def pairs(kk: int) -> int:
    """Block pairs per row (the kernel decodes two 32-value blocks per step; an odd last block is padded)."""
    return (kk // 32 + 1) // 2


def xq_width(kk: int) -> int:
    """int16 activations per quantized row: 64 per block pair."""
    return 64 * pairs(kk)


def xs_width(kk: int) -> int:
    """Block scales per quantized row, padded to a multiple of 8 (the kernel reads 4 pairs' scales at once)."""
    return -(-(kk // 32) // 8) * 8


def info_size(b: Body, e: int, S: str, form: int = 0) -> str:
    """Entries of the work-item table: 2 (e + S / row_chunk(form))."""
    chunk = b.const(row_chunk(form), "index")
    whole = b.v(f"arith.divui {S}, {chunk} : index", "ni")
    items = b.v(f"arith.addi {whole}, {b.const(e, 'index')} : index", "ni")
    return b.v(f"arith.muli {items}, {b.const(2, 'index')} : index", "ni")


def group_dispatch(b: Body, exe: str, ids: str, e: int, S: str, form: int = 0) -> tuple[str, str, str, str]:
    """(order [S] i32, info [ni] i64, counts [2] i32, ni) of the slots' expert ids ``ids`` [S] i32, in work items
    of at most ``row_chunk(form)`` rows."""
    ni = info_size(b, e, S, form)
    res = b.v(f"flow.dispatch @{exe}::@{exe}[{S}]({ids}, {S}) : ({tt([None], 'i32')}{{{S}}}, index) -> "
              f"({tt([None], 'i32')}{{{S}}}, {tt([None], 'i64')}{{{ni}}}, {tt([2], 'i32')})", "grp", nres=3)
    return f"{res}#0", f"{res}#1", f"{res}#2", ni


def act_buffers(kk: int, form: int) -> tuple[tuple[str, int], int]:
    """((element type, width) of the quantized activation rows, width of their f32 scale rows)."""
    if form == BF16_ROWS16:
        return ("i16", kk), 1
    return (("i8", form * kk), form * 2 * (kk // 32)) if form else (("i16", xq_width(kk)), xs_width(kk))


def quantize_dispatch(b: Body, exe: str, x: str, x_el: str, R: str, order: str, counts: str, S: str,
                      kk: int, form: int = 0, info: tuple[str, str] | None = None) -> tuple[str, str]:
    """(xq [S, xq_width] i16, xs [S, xs_width] f32) (int8 forms: [S, form kk] i8, [S, form 2 kk / 32] f32;
    BF16_ROWS16: [S, kk] i16, [S, 1] f32): sorted
    row p < nvalid quantized from ``x`` [R, kk] (``x_el``) row ``order[p] / div`` (``div`` is baked into ``@exe``,
    see :func:`quantize_executable_text`). BF16_ROWS16 packs each work item's rows together: ``info`` is (the work-item
    table, its size) from :func:`group_dispatch`."""
    (q_el, q_w), s_w = act_buffers(kk, form)
    items, items_t = "", ""
    if form == BF16_ROWS16:
        if info is None:
            raise ValueError("cpu microkernel: the bf16 rows16 packer needs the work-item table")
        items, items_t = f"{info[0]}, ", f"{tt([None], 'i64')}{{{info[1]}}}, "
    res = b.v(f"flow.dispatch @{exe}::@{exe}[{S}]({x}, {order}, {counts}, {items}{R}, {S}) : "
              f"({tt([None, kk], x_el)}{{{R}}}, {tt([None], 'i32')}{{{S}}}, {tt([2], 'i32')}, {items_t}index, index) -> "
              f"({tt([None, q_w], q_el)}{{{S}}}, {tt([None, s_w], 'f32')}{{{S}}})", "xq", nres=2)
    return f"{res}#0", f"{res}#1"


def _kind(el: str | None, what: str) -> int:
    if el not in KINDS:
        raise ValueError(f"cpu microkernel: {what} element type {el} is not supported (bf16, f16, f32)")
    return KINDS[el]


def applies_glu(activation: str, n: int) -> bool:
    """Whether the matvec of a w13 of ``n`` rows applies the GLU ``activation`` itself (its epilogue)."""
    return activation in GLU_CODES and n % GLU_MULTIPLE == 0


def gate_up_order(deinterleave: bool, glu: tuple | None) -> int:
    """The matmul's ``pairs`` argument: 0 outputs in order, 1 interleaved gate/up rows (written as halves, or
    the GLU of their pairs), 2 gate/up rows in halves whose GLU the epilogue takes pair by pair."""
    return 1 if deinterleave else 2 if glu else 0


def glu_scalars(glu: tuple[str, float, float] | None, out_el: str) -> list[int]:
    """The matmul's epilogue arguments: the GLU code, the bits of its f32 alpha and limit, the output kind (all
    zero / f32 without a GLU). ``glu``: (activation, alpha, limit) of a fused GLU."""
    if glu is None:
        return [0, 0, 0, KINDS["f32"]]
    act, alpha, limit = glu
    if act not in GLU_CODES:
        raise ValueError(f"cpu microkernel: no GLU epilogue for activation '{act}' (has {', '.join(GLU_CODES)})")
    bits = [struct.unpack("<I", struct.pack("<f", float(val)))[0] for val in (alpha, limit)]
    return [GLU_CODES[act], *bits, _kind(out_el, "GLU output")]


def out_type(n: int, glu: tuple | None, out_el: str, S: str) -> str:
    """The matmul's result: [S, n] f32, or with a fused GLU [S, n / 2] of the activation type ``out_el``."""
    return f"{tt([None, n // 2], out_el)}{{{S}}}" if glu else f"{tt([None, n], 'f32')}{{{S}}}"


def matvec_dispatch(b: Body, exe: str, xq: str, xs: str, e: int, n: int, kk: int, bias: tuple[str, str] | None,
                    info: str, ni: str, counts: str, order: str, S: str, form: int = 0,
                    glu: tuple[str, float, float] | None = None, out_el: str = "f32") -> str:
    """[S, n] f32 by slot (bias added; zero rows for the slots with no expert) from one dispatch of
    ``@exe::@exe``; with ``glu`` (activation, alpha, limit: the executable's epilogue) the GLU of it,
    [S, n / 2] of ``out_el``.

    Expects ``%w`` and ``%s`` in scope; ``info`` [ni] i64, ``counts`` [2] i32 and ``order`` [S] i32 from
    :func:`group_dispatch`.
    """
    if bias is None:
        bias_v = b.v("arith.constant dense<0.0> : tensor<1xf32>", "nob")
        bias_t = tt([1], "f32")
    else:
        bias_v, bias_t = bias[0], tt([e, n], bias[1])
    (q_el, q_w), s_w = act_buffers(kk, form)
    types = [f"{tt([None, q_w], q_el)}{{{S}}}", f"{tt([None, s_w], 'f32')}{{{S}}}",
             tt([e, n, kk // 2], "i8"), tt([e, n, kk // 32], "i8"), bias_t, f"{tt([None], 'i64')}{{{ni}}}", tt([2], "i32"),
             f"{tt([None], 'i32')}{{{S}}}", "index"]
    return b.v(f"flow.dispatch @{exe}::@{exe}[{S}]({xq}, {xs}, %w, %s, {bias_v}, {info}, {counts}, {order}, {S}) : "
               f"({', '.join(types)}) -> {out_type(n, glu, out_el, S)}", "ys")


def _executable(exe: str, obj: str, symbol: str, params: str, memrefs: list[tuple[str, str, str]],
                scalars: list[str], prelude: list[str], grid: list[str]) -> str:
    """A ``stream.executable`` @exe whose one function binds ``memrefs`` (name, element type, size SSA
    or constant), then calls ``symbol`` on them and ``scalars``; ``params`` are the dispatch's index
    operands, ``grid`` the lines of its workgroup count (ending in ``stream.return``). Every ``%c<N>``
    the body names (binding offset 0, sizes, scalars, prelude) is defined as the index constant N."""
    used = " ".join([*prelude, *scalars, *(size for _, _, size in memrefs), "%c0"])
    consts = sorted({int(v) for v in re.findall(r"%c(\d+)\b", used)})
    lines = [f"%c{v} = arith.constant {v} : index" for v in consts] + prelude
    for name, el, size in memrefs:
        lines.append(f"%m_{name} = stream.binding.subspan %b_{name}[%c0] : !stream.binding -> memref<?x{el}>{{{size}}}")
    mtypes = ", ".join(f"memref<?x{el}>" for _, el, _ in memrefs)
    stypes = ", ".join("index" for _ in scalars)
    lines.append(f"func.call @{symbol}({', '.join(f'%m_{m}' for m, _, _ in memrefs)}, {', '.join(scalars)}) : "
                 f"({mtypes}, {stypes}) -> ()")
    bindings = ", ".join(f"%b_{m}: !stream.binding" for m, _, _ in memrefs)
    body = "\n        ".join(lines)
    grid_s = "\n    ".join(grid)
    return f"""stream.executable private @{exe} attributes {{
  hal.executable.objects = #hal.executable.objects<{{
    #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{obj}"}}>]
  }}>
}} {{
  stream.executable.export public @{exe} workgroups(%S: index) -> (index, index, index) {{
    {grid_s}
  }}
  builtin.module {{
    func.func private @{symbol}({mtypes}, {stypes}) attributes {{hal.import.static}}
    func.func @{exe}({bindings}, {params}) {{
        {body}
        return
    }}
  }}
}}"""


def _info_lines(e: int, form: int) -> list[str]:
    """%ni = 2 (e + S / row_chunk(form)) inside an executable's function (as :func:`info_size`)."""
    return [f"%ni0 = arith.divui %S, %c{row_chunk(form)} : index", f"%ni1 = arith.addi %ni0, %c{e} : index",
            "%ni = arith.muli %ni1, %c2 : index"]


def group_executable_text(exe: str, obj: str, e: int, form: int = 0) -> str:
    """The executable :func:`group_dispatch` calls: one workgroup."""
    memrefs = [("ids", "i32", "%S"), ("order", "i32", "%S"), ("info", "i64", "%ni"), ("counts", "i32", "%c2")]
    grid = ["%one = arith.constant 1 : index", "stream.return %one, %one, %one : index, index, index"]
    return _executable(exe, obj, GROUP_SYMBOL, "%S: index", memrefs, ["%S", f"%c{e}", f"%c{row_chunk(form)}"],
                       _info_lines(e, form), grid)


def _quantize_rows_lines(out: str, pre: str = "") -> list[str]:
    """``out`` = activation rows per quantizer workgroup: max(QUANTIZE_ROWS, ceil(S / QUANTIZE_GROUPS))."""
    return [f"%{pre}g1 = arith.constant {QUANTIZE_GROUPS - 1} : index", f"%{pre}g = arith.constant {QUANTIZE_GROUPS} : index",
            f"%{pre}r = arith.constant {QUANTIZE_ROWS} : index", f"%{pre}su = arith.addi %S, %{pre}g1 : index",
            f"%{pre}per = arith.divui %{pre}su, %{pre}g : index", f"{out} = arith.maxui %{pre}per, %{pre}r : index"]


def quantize_executable_text(exe: str, obj: str, kk: int, x_el: str, div: int, form: int = 0, e: int = 0) -> str:
    """The executable :func:`quantize_dispatch` calls: row ``order[p] / div`` of x, QUANTIZE_ROWS per workgroup
    (BF16_ROWS16 also binds the work-item table of ``e`` experts)."""
    kind = _kind(x_el, "activation")
    (q_el, q_w), s_w = act_buffers(kk, form)
    items = [("info", "i64", "%ni")] if form == BF16_ROWS16 else []
    memrefs = [("x", x_el, "%nx"), ("order", "i32", "%S"), ("counts", "i32", "%c2"), *items, ("xq", q_el, "%nxq"),
               ("xs", "f32", "%nxs")]
    prelude = ["%wg = hal.interface.workgroup.id[0] : index", f"%nx = arith.muli %R, %c{kk} : index",
               f"%nxq = arith.muli %S, %c{q_w} : index", f"%nxs = arith.muli %S, %c{s_w} : index"
               ] + _quantize_rows_lines("%rpw") + (_info_lines(e, form) if items else [])
    grid = _quantize_rows_lines("%rows") + [
        "%one = arith.constant 1 : index", "%r1 = arith.subi %rows, %one : index", "%up = arith.addi %S, %r1 : index",
        "%groups = arith.divui %up, %rows : index", "stream.return %groups, %one, %one : index, index, index"]
    scalars = [f"%c{kk}", f"%c{div}", f"%c{kind}", "%rpw", "%wg"] + (["%S"] if form == BF16_ROWS16 else [])
    return _executable(exe, obj, _SYMBOLS[form][0], "%R: index, %S: index", memrefs, scalars, prelude, grid)


def executable_text(exe: str, obj: str, e: int, n: int, kk: int, x_el: str, bias_el: str | None,
                    deinterleave: bool = False, form: int = 0, glu: tuple[str, float, float] | None = None) -> str:
    """The executable :func:`matvec_dispatch` calls, linking ``obj`` (the built C kernels). ``deinterleave``:
    output column o goes to o / 2 (even o) or n / 2 + o / 2 (odd o), interleaved gate/up rows to halves.
    ``form``: 0 the blocksplit matmul; the rows16 matmul of rows of that many int8 planes, or of bf16 rows
    (BF16_ROWS16); n a multiple of 16 for rows16 (the layout's row groups).
    ``glu``: (activation, alpha, limit) of the GLU the kernel applies to gate/up rows, interleaved (with
    ``deinterleave``) or in halves (without), writing [S, n / 2] of ``x_el`` (the layer's activation type) instead
    of [S, n] f32."""
    if deinterleave and n % 2:
        raise ValueError(f"cpu microkernel: cannot deinterleave an odd number of outputs ({n})")
    if glu and n % GLU_MULTIPLE:
        raise ValueError(f"cpu microkernel: the GLU epilogue needs outputs in multiples of {GLU_MULTIPLE}, got {n}")
    if form and n % 16:
        raise ValueError(f"cpu microkernel: the rows16 layout needs outputs in groups of 16, got {n}")
    nb = kk // 32
    kind = _kind(bias_el, "bias")
    bias_len = e * n if kind else 1
    (q_el, q_w), s_w = act_buffers(kk, form)
    memrefs = [("xq", q_el, "%nxq"), ("xs", "f32", "%nxs"), ("w", "i8", f"%c{e * n * kk // 2}"),
               ("s", "i8", f"%c{e * n * nb}"), ("bias", bias_el or "f32", f"%c{bias_len}"),
               ("info", "i64", "%ni"), ("counts", "i32", "%c2"), ("order", "i32", "%S"),
               ("out", x_el if glu else "f32", "%nout")]
    prelude = ["%tile = hal.interface.workgroup.id[0] : index", "%u = hal.interface.workgroup.id[1] : index",
               f"%nxq = arith.muli %S, %c{q_w} : index", f"%nxs = arith.muli %S, %c{s_w} : index",
               f"%nout = arith.muli %S, %c{n // 2 if glu else n} : index"] + _info_lines(e, form)
    # a workgroup row per possible work item (at most min(S, e) + S / row_chunk: an expert's rows make at
    # most one more item than whole chunks), and one more that zeroes the rows of slots with no expert
    tile_n = TILE_N_INT8 if form in PLANES.values() else TILE_N
    grid = [f"%tiles = arith.constant {-(-n // tile_n)} : index", f"%e = arith.constant {e} : index",
            f"%chunk = arith.constant {row_chunk(form)} : index", "%one = arith.constant 1 : index",
            "%used = arith.minui %S, %e : index", "%whole = arith.divui %S, %chunk : index",
            "%items = arith.addi %used, %whole : index", "%slots = arith.addi %items, %one : index",
            "stream.return %tiles, %slots, %one : index, index, index"]
    act = [] if form else [f"%c{_kind(x_el, 'activation')}"]  # the rows16 matmuls read one activation form
    return _executable(exe, obj, _SYMBOLS[form][1], "%S: index", memrefs,
                       ["%S", f"%c{n}", f"%c{kk}", *act, f"%c{kind}", f"%c{gate_up_order(deinterleave, glu)}",
                        f"%c{tile_n}", "%tile", "%u", *(f"%c{v}" for v in glu_scalars(glu, x_el))], prelude, grid)


def executables(fname: str, obj: str, e: int, n: int, kk: int, x_el: str, div: int, bias_el: str | None,
                deinterleave: bool, form: int = 0, glu: tuple[str, float, float] | None = None
                ) -> tuple[tuple[str, str, str], list[str]]:
    """The names (group, quantize, matvec) and texts of the three executables one grouped matmul
    (function ``fname``) dispatches; ``form``: the activation form (:data:`PLANES`, :data:`BF16_ROWS16`); ``glu``: the matvec's GLU
    epilogue (:func:`executable_text`)."""
    names = (f"{fname}_group", f"{fname}_quantize", f"{fname}_ukernel")
    return names, [group_executable_text(names[0], obj, e, form),
                   quantize_executable_text(names[1], obj, kk, x_el, div, form, e),
                   executable_text(names[2], obj, e, n, kk, x_el, bias_el, deinterleave, form, glu)]
