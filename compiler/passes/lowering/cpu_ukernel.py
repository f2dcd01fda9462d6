"""The cpu lowering's microkernel form of the grouped matvec: one IREE dispatch of a hand-written C kernel.

Used by :mod:`cpu_grouped` at every token count when the microkernel object was built
(``mxmoe.compiler.ukernels``) and the activations are bf16 or f16. Three pieces of IR:

* :func:`quantize_rows`: linalg generics that turn the gathered f32 activation rows into int16 with one
  power-of-two scale per 32-value block (``q = round(x * 2^(14 - E))``, ``E`` the block maximum's binary
  exponent clamped to [-100, 127]: every bf16 value within 2^7 of its block's largest is exact, smaller
  ones are rounded to a multiple of 2^(E-14); a non-finite block makes its scale NaN), laid out in the
  order the kernel's decode produces weights (see ``compiler/ukernels/mxfp4_matvec.c``).
* :func:`matvec_dispatch`: a ``flow.dispatch`` over (output tiles, used-expert slots); each workgroup
  reads its expert's id, first row and row count from the packed ``info`` table on the device, so all
  used experts run in one dispatch with no host loop and no read back.
* :func:`executable_text`: the ``stream.executable`` whose function calls the C symbol, with the object
  file attached (``hal.executable.objects``) so ``iree-compile`` links it into the module.
"""

from __future__ import annotations

from mxmoe.compiler.passes.lowering.text import Body, amap, empty, generic, tt
from mxmoe.compiler.ukernels import MATVEC_SYMBOL

#: outputs per workgroup (a multiple of 32, like the padded N)
TILE_N = 64
#: int16 activations are 2^14 x the block maximum's power of two at most: |q| < 2^15
Q_BITS = 14
#: block exponents are clamped to [E_MIN, 127], so 2^(14 - E) and 2^(E - 14) stay normal f32
E_MIN = -100
#: activation types the int16 rounding is invisible for (2^-15 of a block's largest, below their resolution)
ACTIVATION_TYPES = ("bf16", "f16")
#: the C kernel's bias kinds
BIAS_KINDS = {None: 0, "bf16": 1, "f32": 2, "f16": 3}


def pairs(kk: int) -> int:
    """Block pairs per row (the kernel decodes two 32-value blocks per step; an odd last block is padded)."""
    return (kk // 32 + 1) // 2


def _exponent_lines(m: str, out: str) -> list[str]:
    """Block maximum ``m`` (f32, >= 0) -> clamped binary exponent ``out`` (i32) and ``{out}_ok`` (finite)."""
    return [f"{out}_b = arith.bitcast {m} : f32 to i32", f"{out}_k23 = arith.constant 23 : i32",
            f"{out}_kff = arith.constant 255 : i32", f"{out}_s = arith.shrui {out}_b, {out}_k23 : i32",
            f"{out}_e = arith.andi {out}_s, {out}_kff : i32", f"{out}_ok = arith.cmpi ne, {out}_e, {out}_kff : i32",
            f"{out}_k127 = arith.constant 127 : i32", f"{out}_u = arith.subi {out}_e, {out}_k127 : i32",
            f"{out}_lo = arith.constant {E_MIN} : i32", f"{out}_hi = arith.constant 127 : i32",
            f"{out}_c = arith.maxsi {out}_u, {out}_lo : i32", f"{out} = arith.minsi {out}_c, {out}_hi : i32"]


def _pow2_lines(exp: str, out: str) -> list[str]:
    """``out`` = 2^exp as f32 for a normal-range i32 ``exp``."""
    return [f"{out}_k127 = arith.constant 127 : i32", f"{out}_k23 = arith.constant 23 : i32",
            f"{out}_b = arith.addi {exp}, {out}_k127 : i32", f"{out}_s = arith.shli {out}_b, {out}_k23 : i32",
            f"{out} = arith.bitcast {out}_s : i32 to f32"]


def quantize_rows(b: Body, xg: str, S: str, kk: int) -> tuple[str, str]:
    """xg [S, kk] f32 -> (xq [S, 64 * np] i16, xs [S, 8 * np] f32) in the kernel's order (np = pairs(kk))."""
    nb, np_ = kk // 32, pairs(kk)
    x3t = tt([None, nb, 32], "f32")
    x3 = b.v(f"tensor.expand_shape {xg} [[0], [1, 2]] output_shape [{S}, {nb}, 32] : {tt([None, kk], 'f32')} into {x3t}", "x")
    z = b.const("0.0", "f32")
    m0 = b.v(f"linalg.fill ins({z} : f32) outs({empty(b, [None, nb], 'f32', [S])} : {tt([None, nb], 'f32')}) -> "
             f"{tt([None, nb], 'f32')}", "f")
    # block maxima of |x| (maximumf propagates NaN, so a NaN block is seen as non-finite below)
    bmax = generic(b, [(x3, x3t, amap(3, "d0, d1, d2"))], [(m0, tt([None, nb], "f32"), amap(3, "d0, d1"))],
                   ["parallel", "parallel", "reduction"],
                   ["%a = math.absf %v : f32", "%r = arith.maximumf %o, %a : f32", "linalg.yield %r : f32"],
                   [("%v", "f32"), ("%o", "f32")])
    bt, xt = tt([None, nb], "f32"), tt([None, kk], "f32")
    # xq[p, pair, j, lane, i] = q(x[p, (2 pair + lane) * 32 + 8 j + i])
    qdims = [None, np_, 4, 2, 8]
    q = generic(b, [], [(empty(b, qdims, "i16", [S]), tt(qdims, "i16"), amap(5, "d0, d1, d2, d3, d4"))],
                ["parallel"] * 5,
                ["%p = linalg.index 0 : index", "%pr = linalg.index 1 : index", "%j = linalg.index 2 : index",
                 "%ln = linalg.index 3 : index", "%i = linalg.index 4 : index",
                 "%k2 = arith.constant 2 : index", "%k8 = arith.constant 8 : index", "%k32 = arith.constant 32 : index",
                 f"%knb = arith.constant {nb} : index", f"%klast = arith.constant {nb - 1} : index",
                 "%pr2 = arith.muli %pr, %k2 : index", "%blk = arith.addi %pr2, %ln : index",
                 "%in = arith.cmpi ult, %blk, %knb : index", "%bc = arith.minui %blk, %klast : index",
                 "%col0 = arith.muli %bc, %k32 : index", "%j8 = arith.muli %j, %k8 : index",
                 "%col1 = arith.addi %col0, %j8 : index", "%col = arith.addi %col1, %i : index",
                 f"%v = tensor.extract {xg}[%p, %col] : {xt}", f"%m = tensor.extract {bmax}[%p, %bc] : {bt}"]
                + _exponent_lines("%m", "%ex")
                + [f"%k14 = arith.constant {Q_BITS} : i32", "%nex = arith.subi %k14, %ex : i32"] + _pow2_lines("%nex", "%f")
                + ["%sv = arith.mulf %v, %f : f32", "%rv = math.roundeven %sv : f32",
                   "%qmax = arith.constant 32767.0 : f32", "%qmin = arith.constant -32767.0 : f32",
                   "%qc = arith.minimumf %rv, %qmax : f32", "%qcc = arith.maximumf %qc, %qmin : f32",
                   "%qi = arith.fptosi %qcc : f32 to i16", "%ok = arith.andi %in, %ex_ok : i1",
                   "%zero = arith.constant 0 : i16", "%r = arith.select %ok, %qi, %zero : i16", "linalg.yield %r : i16"],
                [("%o", "i16")])
    # xs[p, pair, lane, i] = 2^(E - 14) of block 2 pair + lane (NaN for a non-finite block, 0 past the last)
    sdims = [None, np_, 2, 4]
    s = generic(b, [], [(empty(b, sdims, "f32", [S]), tt(sdims, "f32"), amap(4, "d0, d1, d2, d3"))],
                ["parallel"] * 4,
                ["%p = linalg.index 0 : index", "%pr = linalg.index 1 : index", "%ln = linalg.index 2 : index",
                 "%k2 = arith.constant 2 : index", f"%knb = arith.constant {nb} : index",
                 f"%klast = arith.constant {nb - 1} : index",
                 "%pr2 = arith.muli %pr, %k2 : index", "%blk = arith.addi %pr2, %ln : index",
                 "%in = arith.cmpi ult, %blk, %knb : index", "%bc = arith.minui %blk, %klast : index",
                 f"%m = tensor.extract {bmax}[%p, %bc] : {bt}"]
                + _exponent_lines("%m", "%ex")
                + [f"%k14 = arith.constant {Q_BITS} : i32", "%e2 = arith.subi %ex, %k14 : i32"] + _pow2_lines("%e2", "%f")
                + ["%nan = arith.constant 0x7FC00000 : f32", "%fz = arith.constant 0.0 : f32",
                   "%fv = arith.select %ex_ok, %f, %nan : f32", "%r = arith.select %in, %fv, %fz : f32",
                   "linalg.yield %r : f32"],
                [("%o", "f32")])
    xq = b.v(f"tensor.collapse_shape {q} [[0], [1, 2, 3, 4]] : {tt(qdims, 'i16')} into {tt([None, 64 * np_], 'i16')}", "xq")
    xs = b.v(f"tensor.collapse_shape {s} [[0], [1, 2, 3]] : {tt(sdims, 'f32')} into {tt([None, 8 * np_], 'f32')}", "xs")
    return xq, xs


def _bias_kind(bias_el: str | None) -> int:
    if bias_el not in BIAS_KINDS:
        raise ValueError(f"cpu microkernel: bias element type {bias_el} is not supported (bf16, f16, f32)")
    return BIAS_KINDS[bias_el]


def matvec_dispatch(b: Body, exe: str, xq: str, xs: str, e: int, n: int, kk: int, bias: tuple[str, str] | None,
                    info: str, nused: str, S: str) -> str:
    """[S, n] f32 rows in expert order (bias added) from one dispatch of ``@exe::@exe``.

    Expects ``%w`` and ``%s`` in scope; ``info`` [e] i64 and ``nused`` (0-d i32) from the slot sort.
    """
    np_ = pairs(kk)
    if bias is None:
        bias_v = b.v("arith.constant dense<0.0> : tensor<1xf32>", "nob")
        bias_t = tt([1], "f32")
    else:
        bias_v, bias_t = bias[0], tt([e, n], bias[1])
    nu1 = b.v(f"tensor.expand_shape {nused} [] output_shape [1] : {tt([], 'i32')} into {tt([1], 'i32')}", "nu")
    types = [f"{tt([None, 64 * np_], 'i16')}{{{S}}}", f"{tt([None, 8 * np_], 'f32')}{{{S}}}",
             tt([e, n, kk // 2], "i8"), tt([e, n, kk // 32], "i8"), bias_t, tt([e], "i64"), tt([1], "i32"), "index"]
    return b.v(f"flow.dispatch @{exe}::@{exe}[{S}]({xq}, {xs}, %w, %s, {bias_v}, {info}, {nu1}, {S}) : "
               f"({', '.join(types)}) -> {tt([None, n], 'f32')}{{{S}}}", "ys")


def executable_text(exe: str, obj: str, e: int, n: int, kk: int, bias_el: str | None) -> str:
    """The ``stream.executable`` that :func:`matvec_dispatch` calls, linking ``obj`` (the built C kernel)."""
    np_, nb = pairs(kk), kk // 32
    kind = _bias_kind(bias_el)
    bias_el = bias_el or "f32"
    bias_len = e * n if kind else 1
    tiles = -(-n // TILE_N)
    memrefs = [("xq", "i16", None), ("xs", "f32", None), ("w", "i8", e * n * kk // 2), ("s", "i8", e * n * nb),
               ("bias", bias_el, bias_len), ("info", "i64", e), ("nused", "i32", 1), ("out", "f32", None)]
    lines = ["%c0 = arith.constant 0 : index", "%tile = hal.interface.workgroup.id[0] : index",
             "%u = hal.interface.workgroup.id[1] : index",
             f"%nxq = arith.muli %S, %c{64 * np_} : index", f"%nxs = arith.muli %S, %c{8 * np_} : index",
             f"%nout = arith.muli %S, %c{n} : index"]
    consts = sorted(({64 * np_, 8 * np_, n, kk, kind, TILE_N} | {size for _, _, size in memrefs if size}) - {0})
    lines[1:1] = [f"%c{v} = arith.constant {v} : index" for v in consts]
    dyn = {"xq": "%nxq", "xs": "%nxs", "out": "%nout"}
    for name, el, size in memrefs:
        lines.append(f"%m_{name} = stream.binding.subspan %b_{name}[%c0] : !stream.binding -> memref<?x{el}>"
                     f"{{{dyn.get(name, f'%c{size}')}}}")
    mtypes = ", ".join(f"memref<?x{el}>" for _, el, _ in memrefs)
    lines.append(f"func.call @{MATVEC_SYMBOL}({', '.join(f'%m_{m}' for m, _, _ in memrefs)}, %c{n}, %c{kk}, %c{kind}, "
                 f"%c{TILE_N}, %tile, %u) : ({mtypes}, index, index, index, index, index, index) -> ()")
    bindings = ", ".join(f"%b_{m}: !stream.binding" for m, _, _ in memrefs)
    body = "\n        ".join(lines)
    return f"""stream.executable private @{exe} attributes {{
  hal.executable.objects = #hal.executable.objects<{{
    #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{obj}"}}>]
  }}>
}} {{
  stream.executable.export public @{exe} workgroups(%S: index) -> (index, index, index) {{
    %tiles = arith.constant {tiles} : index
    %e = arith.constant {e} : index
    %slots = arith.minui %S, %e : index
    %one = arith.constant 1 : index
    stream.return %tiles, %slots, %one : index, index, index
  }}
  builtin.module {{
    func.func private @{MATVEC_SYMBOL}({mtypes}, index, index, index, index, index, index) attributes {{hal.import.static}}
    func.func @{exe}({bindings}, %S: index) {{
        {body}
        return
    }}
  }}
}}"""
