"""The cpu lowering's microkernel form of a grouped matmul: two IREE dispatches of hand-written C.

Used by :mod:`cpu_grouped` at every token count when the microkernel object was built
(``mxmoe.kernels.cpu``) and the activations are bf16 or f16. Pieces of IR:

* :func:`quantize_dispatch`: the C quantizer (``mxmoe_mxfp4_quantize_rows``) reads each sorted row's
  activations straight from the op's input (row ``order[p] / div``) and writes them as int16 with one
  power-of-two scale per 32-value block, in the order the matvec's decode produces weights (the format
  is described in ``kernels/cpu/mxfp4_matvec.c``); a few rows per workgroup.
* :func:`matvec_dispatch`: a ``flow.dispatch`` over (output tiles, used-expert slots); each workgroup
  reads its expert's id, first row and row count from the packed ``info`` table on the device, so all
  used experts run in one dispatch with no host loop and no read back. It writes each row back to its
  slot (``order``), so the result is in token order and what follows (GLU, combine) needs no gather.
* :func:`executable_text`: the ``stream.executable`` whose function calls a C symbol, with the object
  file attached (``hal.executable.objects``) so ``iree-compile`` links it into the module.
"""

from __future__ import annotations

import re

from mxmoe.compiler.passes.lowering.text import Body, tt
from mxmoe.kernels.cpu import MATVEC_SYMBOL, QUANTIZE_SYMBOL

#: outputs per matvec workgroup (a multiple of 32, like the padded N)
TILE_N = 64
#: activation rows per quantizer workgroup
QUANTIZE_ROWS = 4
#: activation types the int16 rounding is invisible for (2^-15 of a block's largest, below their resolution)
ACTIVATION_TYPES = ("bf16", "f16")
#: the C kernels' element kinds (activations and biases)
KINDS = {None: 0, "bf16": 1, "f32": 2, "f16": 3}


def pairs(kk: int) -> int:
    """Block pairs per row (the kernel decodes two 32-value blocks per step; an odd last block is padded)."""
    return (kk // 32 + 1) // 2


def xq_width(kk: int) -> int:
    """int16 activations per quantized row: 64 per block pair."""
    return 64 * pairs(kk)


def xs_width(kk: int) -> int:
    """Block scales per quantized row, padded to a multiple of 8 (the kernel reads 4 pairs' scales at once)."""
    return -(-(kk // 32) // 8) * 8


def quantize_dispatch(b: Body, exe: str, x: str, x_el: str, R: str, order: str, S: str, kk: int) -> tuple[str, str]:
    """(xq [S, xq_width] i16, xs [S, xs_width] f32): sorted row p quantized from ``x`` [R, kk] (``x_el``)
    row ``order[p] / div`` (``div`` is baked into ``@exe``, see :func:`quantize_executable_text`)."""
    res = b.v(f"flow.dispatch @{exe}::@{exe}[{S}]({x}, {order}, {R}, {S}) : ({tt([None, kk], x_el)}{{{R}}}, "
              f"{tt([None], 'i32')}{{{S}}}, index, index) -> ({tt([None, xq_width(kk)], 'i16')}{{{S}}}, "
              f"{tt([None, xs_width(kk)], 'f32')}{{{S}}})", "xq", nres=2)
    return f"{res}#0", f"{res}#1"


def _kind(el: str | None, what: str) -> int:
    if el not in KINDS:
        raise ValueError(f"cpu microkernel: {what} element type {el} is not supported (bf16, f16, f32)")
    return KINDS[el]


def matvec_dispatch(b: Body, exe: str, xq: str, xs: str, e: int, n: int, kk: int, bias: tuple[str, str] | None,
                    info: str, nused: str, order: str, S: str) -> str:
    """[S, n] f32 by slot (bias added) from one dispatch of ``@exe::@exe``.

    Expects ``%w`` and ``%s`` in scope; ``info`` [e] i64, ``nused`` (0-d i32) and ``order`` [S] i32 from
    the slot sort.
    """
    if bias is None:
        bias_v = b.v("arith.constant dense<0.0> : tensor<1xf32>", "nob")
        bias_t = tt([1], "f32")
    else:
        bias_v, bias_t = bias[0], tt([e, n], bias[1])
    nu1 = b.v(f"tensor.expand_shape {nused} [] output_shape [1] : {tt([], 'i32')} into {tt([1], 'i32')}", "nu")
    types = [f"{tt([None, xq_width(kk)], 'i16')}{{{S}}}", f"{tt([None, xs_width(kk)], 'f32')}{{{S}}}",
             tt([e, n, kk // 2], "i8"), tt([e, n, kk // 32], "i8"), bias_t, tt([e], "i64"), tt([1], "i32"),
             f"{tt([None], 'i32')}{{{S}}}", "index"]
    return b.v(f"flow.dispatch @{exe}::@{exe}[{S}]({xq}, {xs}, %w, %s, {bias_v}, {info}, {nu1}, {order}, {S}) : "
               f"({', '.join(types)}) -> {tt([None, n], 'f32')}{{{S}}}", "ys")


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


def quantize_executable_text(exe: str, obj: str, kk: int, x_el: str, div: int) -> str:
    """The executable :func:`quantize_dispatch` calls: row ``order[p] / div`` of x, QUANTIZE_ROWS per workgroup."""
    kind = _kind(x_el, "activation")
    memrefs = [("x", x_el, "%nx"), ("order", "i32", "%S"), ("xq", "i16", "%nxq"), ("xs", "f32", "%nxs")]
    prelude = ["%wg = hal.interface.workgroup.id[0] : index", f"%nx = arith.muli %R, %c{kk} : index",
               f"%nxq = arith.muli %S, %c{xq_width(kk)} : index", f"%nxs = arith.muli %S, %c{xs_width(kk)} : index"]
    grid = [f"%rows = arith.constant {QUANTIZE_ROWS} : index", "%one = arith.constant 1 : index",
            "%r1 = arith.subi %rows, %one : index", "%up = arith.addi %S, %r1 : index",
            "%groups = arith.divui %up, %rows : index", "stream.return %groups, %one, %one : index, index, index"]
    return _executable(exe, obj, QUANTIZE_SYMBOL, "%R: index, %S: index", memrefs,
                       [f"%c{kk}", f"%c{div}", f"%c{kind}", f"%c{QUANTIZE_ROWS}", "%S", "%wg"], prelude, grid)


def executable_text(exe: str, obj: str, e: int, n: int, kk: int, bias_el: str | None, deinterleave: bool = False) -> str:
    """The executable :func:`matvec_dispatch` calls, linking ``obj`` (the built C kernels). ``deinterleave``:
    output column o goes to o / 2 (even o) or n / 2 + o / 2 (odd o), interleaved gate/up rows to halves."""
    if deinterleave and n % 2:
        raise ValueError(f"cpu microkernel: cannot deinterleave an odd number of outputs ({n})")
    nb = kk // 32
    kind = _kind(bias_el, "bias")
    bias_len = e * n if kind else 1
    memrefs = [("xq", "i16", "%nxq"), ("xs", "f32", "%nxs"), ("w", "i8", f"%c{e * n * kk // 2}"),
               ("s", "i8", f"%c{e * n * nb}"), ("bias", bias_el or "f32", f"%c{bias_len}"), ("info", "i64", f"%c{e}"),
               ("nused", "i32", "%c1"), ("order", "i32", "%S"), ("out", "f32", "%nout")]
    prelude = ["%tile = hal.interface.workgroup.id[0] : index", "%u = hal.interface.workgroup.id[1] : index",
               f"%nxq = arith.muli %S, %c{xq_width(kk)} : index", f"%nxs = arith.muli %S, %c{xs_width(kk)} : index",
               f"%nout = arith.muli %S, %c{n} : index"]
    grid = [f"%tiles = arith.constant {-(-n // TILE_N)} : index", f"%e = arith.constant {e} : index",
            "%slots = arith.minui %S, %e : index", "%one = arith.constant 1 : index",
            "stream.return %tiles, %slots, %one : index, index, index"]
    return _executable(exe, obj, MATVEC_SYMBOL, "%S: index", memrefs,
                       [f"%c{n}", f"%c{kk}", f"%c{kind}", f"%c{int(deinterleave)}", f"%c{TILE_N}", "%tile", "%u"],
                       prelude, grid)
