"""Helpers that write linalg/tensor/arith IR as text (parsed back by the pass with ``ir.Operation.parse``)."""

from __future__ import annotations


def tt(dims, el: str) -> str:
    """``tensor<...>`` type text; None in ``dims`` is a dynamic size."""
    return "tensor<" + "x".join(["?" if d is None else str(d) for d in dims] + [el]) + ">"


class Body:
    """Accumulates MLIR lines with fresh SSA names."""

    def __init__(self):
        self.lines: list[str] = []
        self.n = 0

    def v(self, expr: str, prefix: str = "v", nres: int = 1) -> str:
        self.n += 1
        name = f"%{prefix}{self.n}"
        self.lines.append(f"{name}{'' if nres == 1 else f':{nres}'} = {expr}")
        return name

    def raw(self, line: str) -> None:
        self.lines.append(line)

    def const(self, value, ty: str) -> str:
        return self.v(f"arith.constant {value} : {ty}", "c")


def scf_if(b: Body, cond: str, ty: str, then, otherwise, prefix: str = "if") -> str:
    """``scf.if cond -> (ty)``; ``then``/``otherwise`` take a fresh Body (numbering continued from ``b``, so
    names stay unique), write their branch into it and return the value the branch yields."""
    tb = Body()
    tb.n = b.n
    tv = then(tb)
    eb = Body()
    eb.n = tb.n
    ev = otherwise(eb)
    b.n = eb.n
    return b.v(f"scf.if {cond} -> ({ty}) {{\n    " + "\n    ".join(tb.lines) + f"\n    scf.yield {tv} : {ty}\n  }} else {{\n    "
               + "\n    ".join(eb.lines) + f"\n    scf.yield {ev} : {ty}\n  }}", prefix)


def amap(ndims: int, exprs: str) -> str:
    ds = ", ".join(f"d{i}" for i in range(ndims))
    return f"affine_map<({ds}) -> ({exprs})>"


def generic(b: Body, ins: list[tuple[str, str, str]], outs: list[tuple[str, str, str]], iters: list[str],
            body: list[str], block_args: list[tuple[str, str]], nres: int = 1, attrs: str = "") -> str:
    """ins/outs: (value, type, affine map); body lines use the block arg names given."""
    maps = ", ".join(m for _, _, m in ins + outs)
    it = ", ".join(f'"{i}"' for i in iters)
    ins_s = ", ".join(v for v, _, _ in ins)
    ins_t = ", ".join(t for _, t, _ in ins)
    outs_s = ", ".join(v for v, _, _ in outs)
    outs_t = ", ".join(t for _, t, _ in outs)
    args = ", ".join(f"{n}: {t}" for n, t in block_args)
    res_t = ", ".join(t for _, t, _ in outs)
    res_t = res_t if len(outs) == 1 else f"({res_t})"
    text = (f"linalg.generic {{indexing_maps = [{maps}], iterator_types = [{it}]}} "
            + (f"ins({ins_s} : {ins_t}) " if ins else "")
            + f"outs({outs_s} : {outs_t}) " + (f"attrs = {{{attrs}}} " if attrs else "")
            + f"{{\n^bb0({args}):\n    " + "\n    ".join(body) + f"\n  }} -> {res_t}")
    return b.v(text, "g", nres)


def _f32_identity(v: str, out: str) -> list[str]:
    """``out = v`` under a fresh SSA name: ``v + -0.0`` is ``v`` for every input (LLVM folds it away; a
    ``maximumf v, v`` stays as a NaN check + blend per vector in the generated code)."""
    return [f"{out}_nz = arith.constant -0.0 : f32", f"{out} = arith.addf {v}, {out}_nz : f32"]


def to_f32_lines(v: str, el: str, out: str) -> list[str]:
    if el == "f32":
        return _f32_identity(v, out)
    return [f"{out} = arith.extf {v} : {el} to f32"]


def from_f32_lines(v: str, el: str, out: str) -> list[str]:
    if el == "f32":
        return _f32_identity(v, out)
    return [f"{out} = arith.truncf {v} : f32 to {el}"]


def empty(b: Body, dims, el: str, dyn: list[str]) -> str:
    return b.v(f"tensor.empty({', '.join(dyn)}) : {tt(dims, el)}", "e")


def filled(b: Body, dims, el: str, dyn: list[str], value: str) -> str:
    e = empty(b, dims, el, dyn)
    c = b.const(value, el)
    return b.v(f"linalg.fill ins({c} : {el}) outs({e} : {tt(dims, el)}) -> {tt(dims, el)}", "f")


def round_to(b: Body, src: str, dims, el: str, dyn: list[str]) -> str:
    """f32 tensor -> el tensor (elementwise truncf), or src itself when el is f32."""
    if el == "f32":
        return src
    n = len(dims)
    ident = amap(n, ", ".join(f"d{i}" for i in range(n)))
    out = empty(b, dims, el, dyn)
    return generic(b, [(src, tt(dims, "f32"), ident)], [(out, tt(dims, el), ident)], ["parallel"] * n,
                   [f"%r = arith.truncf %a : f32 to {el}", f"linalg.yield %r : {el}"], [("%a", "f32"), ("%o", el)])
