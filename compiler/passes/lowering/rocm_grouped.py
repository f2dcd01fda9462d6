"""The matrix-core schedule of a grouped MXFP4 matmul, for weights in the row-major layout (the ROCm targets).

Row ``s = t*k + j`` of the grouped matmul is ``x[t] (or x[t, j]) @ dequant(w[ids[t, j]])^T (+ bias)``; a slot
whose id is -1 is 0 (no bias). IREE's GPU pipelines give a grouped matmul to the matrix cores (MFMA) only in
one form: a *contraction* ``linalg.generic`` whose operands are block arguments with static, intrinsic-aligned
inner dims (an expert read with ``tensor.extract`` inside the reduction body is vector FMAs at best and
"failed to distribute" at worst). So the slots are laid out in *row blocks*:

1. *blocks* (small integer generics on the device, no weight traffic): ``counts[e]`` slots per expert, each
   expert gets ``ceil(counts[e] / MB)`` blocks of ``MB`` rows, in expert order (``MB`` = 16, or 64 where the
   slots average 16 or more per expert: a host-side ``scf.if`` on T picks one of two compiled forms); ``pos[s]``
   is slot ``s``'s row in that layout (its block times MB plus its rank among the expert's slots), ``rows[p]``
   the activation row a block row reads (0 for an empty row), ``bexp[b]`` block ``b``'s expert. The number of
   blocks is the bound ``NB = m + (S - m) // MB`` (``S = T*k`` slots, ``m = min(E, S)``), computed on the host
   from T: no read back. Blocks past the ones the routing fills (duplicate or -1 ids, or experts with a partial
   block) repeat the last used expert, whose weights were just read.
2. *gather*: ``iree_linalg_ext.gather`` of the activation rows into ``[NB, MB, K/32, 32]`` and of each block's
   expert weights (packed bytes viewed as ``f4E2M1FN`` through ``iree_tensor_ext.bitcast``, scales as
   ``f8E8M0FNU``) into ``[NB, N, K/32, 32]`` / ``[NB, N, K/32]``.
3. *contraction* over ``(block, row, n, kb, kk)``, in one of two forms (:data:`ACTIVATIONS`):

   * ``"bf16"`` (default): a producer generic dequantizes the gathered weights to the compute type (bf16 for
     bf16 activations, f32 otherwise), exactly, with ``arith.scaling_extf`` (gfx950 has an instruction for it)
     or integer ops (:data:`DECODES`; gfx942); the contraction reads both as block arguments. IREE fuses the gathers, the decode and the contraction into one dispatch and feeds MFMA
     (``v_mfma_f32_*_bf16``); the dequantized weights only ever exist in registers.
   * ``"mxfp8"`` (gfx950's scaled MFMA): the activations are quantized per token to MXFP8 (e4m3 values, one
     e8m0 scale per 32, OCP MX rules: scale ``2^(floor(log2 amax) - 8)``, round to nearest even, saturated),
     the weights' e2m1 codes re-encoded to e4m3 with integer ops (exact: IREE 3.13 has no f8 x f4 scaled
     MMA, and ``arith.extf`` f4 -> f8 does not lower), and the contraction is the 4-input
     ``addf(out, mulf(scaling_extf(a, as), scaling_extf(w, ws)))`` form IREE maps to
     ``v_mfma_scale_f32_*_f8f6f4``: the scales go to the instruction as they are stored.

4. *unsort*: ``y[s] = out[pos[s]]`` (a gather of result rows), plus the expert's bias, 0 for an invalid slot,
   rounded to the activation type (the reference's rounding point); the caller applies the fused epilogue.

Work and weight traffic grow with the blocks the routing fills (at most ``NB``), never with E, and the
weights are never materialized dequantized. Everything is plain linalg / IREE linalg_ext, so the same IR
compiles for llvm-cpu (the tests check its numerics there).
"""

from __future__ import annotations

from mxmoe.compiler.passes.lowering import mxfp4
from mxmoe.compiler.passes.lowering.text import (Body, amap, empty, filled, from_f32_lines, generic, scf_if,
                                                 to_f32_lines, tt)

#: rows per block: the M of the MFMA tiles (16x16xK) IREE picks; smaller M is a matvec without MFMA
BLOCK_ROWS = 16
#: rows per block when the slots average at least LARGE_BLOCK_MIN_ROWS per expert (prefill): each block reads and
#: decodes its expert's whole weights, so larger blocks read them fewer times (at 16 rows an expert on average, about a
#: third fewer blocks than 16-row ones; the extra matrix work of the padding rows stays below the weight traffic and
#: the decode: benchmarks/amd_isa.py's roofline)
LARGE_BLOCK_ROWS = 64
LARGE_BLOCK_MIN_ROWS = 16
#: activation forms of the contraction (the pass option ``activations=``)
ACTIVATIONS = ("bf16", "mxfp8")
#: how the "bf16" form decodes the weights (the pass option ``decode=``): ``arith.scaling_extf`` (one hardware
#: instruction per two values where the target has it: gfx950's ``v_cvt_scalef32_pk_bf16_fp4``) or integer ops
#: and two multiplies (:func:`mxfp4.e2m1_scaled_lines`; gfx942, where scaling_extf expands to ~28 VALU ops a value)
DECODES = ("scaling_extf", "int")
#: e4m3's largest finite value and the exponent of the largest power of two below it (OCP MX: emax_elem)
E4M3_MAX = 448.0
E4M3_EMAX = 8


def compute_type(xel: str) -> str:
    """The element type the weights are dequantized to for MFMA: bf16 for bf16 activations (exact: an e2m1
    value times a power of two has 2 significant bits and bf16 has f32's exponent range), f32 for f16 and f32
    activations (f16 cannot hold every scaled weight)."""
    return "bf16" if xel == "bf16" else "f32"


def _idx(b: Body, value: int) -> str:
    return b.const(value, "index")


def _blocks(b: Body, ids_flat: str, S: str, e: int, k: int, x_rank: int, NB: str, mb: int) -> dict[str, str]:
    """The row-block layout of the slots (step 1 of the module docstring)."""
    vec, evec = tt([None], "i32"), tt([e], "i32")
    counts = generic(b, [(ids_flat, vec, amap(2, "d1"))], [(filled(b, [e], "i32", [], "0"), evec, amap(2, "d0"))],
                     ["parallel", "reduction"],
                     ["%ie = linalg.index 0 : index", "%e = arith.index_cast %ie : index to i32",
                      "%hit = arith.cmpi eq, %v, %e : i32", "%c = arith.extui %hit : i1 to i32",
                      "%r = arith.addi %o, %c : i32", "linalg.yield %r : i32"], [("%v", "i32"), ("%o", "i32")])
    # bstart[e] / bend[e]: the first block of expert e and one past its last
    ends = generic(b, [(counts, evec, amap(2, "d1"))],
                   [(filled(b, [e], "i32", [], "0"), evec, amap(2, "d0")), (filled(b, [e], "i32", [], "0"), evec, amap(2, "d0"))],
                   ["parallel", "reduction"],
                   ["%ia = linalg.index 0 : index", "%ib = linalg.index 1 : index",
                    f"%mbm1 = arith.constant {mb - 1} : i32", f"%mb = arith.constant {mb} : i32",
                    "%cr = arith.addi %c, %mbm1 : i32", "%nb = arith.divui %cr, %mb : i32", "%z = arith.constant 0 : i32",
                    "%below = arith.cmpi ult, %ib, %ia : index", "%upto = arith.cmpi ule, %ib, %ia : index",
                    "%vs = arith.select %below, %nb, %z : i32", "%ve = arith.select %upto, %nb, %z : i32",
                    "%r1 = arith.addi %o1, %vs : i32", "%r2 = arith.addi %o2, %ve : i32", "linalg.yield %r1, %r2 : i32, i32"],
                   [("%c", "i32"), ("%o1", "i32"), ("%o2", "i32")], nres=2)
    bstart, bend = ends + "#0", ends + "#1"
    # rank[s] = #{s' < s with the same id}
    rank = generic(b, [(ids_flat, vec, amap(2, "d0")), (ids_flat, vec, amap(2, "d1"))],
                   [(filled(b, [None], "i32", [S], "0"), vec, amap(2, "d0"))], ["parallel", "reduction"],
                   ["%ia = linalg.index 0 : index", "%ib = linalg.index 1 : index",
                    "%eq = arith.cmpi eq, %va, %vb : i32", "%bf = arith.cmpi ult, %ib, %ia : index",
                    "%hit = arith.andi %eq, %bf : i1", "%c = arith.extui %hit : i1 to i32",
                    "%r = arith.addi %o, %c : i32", "linalg.yield %r : i32"],
                   [("%va", "i32"), ("%vb", "i32"), ("%o", "i32")])
    # pos[s] = bstart[id] * mb + rank, -1 for an invalid slot
    pos = generic(b, [(ids_flat, vec, amap(1, "d0")), (rank, vec, amap(1, "d0"))],
                  [(empty(b, [None], "i32", [S]), vec, amap(1, "d0"))], ["parallel"],
                  ["%zi = arith.constant 0 : i32", f"%ei = arith.constant {e} : i32",
                   "%ge = arith.cmpi sge, %vi, %zi : i32", "%lt = arith.cmpi slt, %vi, %ei : i32",
                   "%valid = arith.andi %ge, %lt : i1", "%safe = arith.select %valid, %vi, %zi : i32",
                   "%ix = arith.index_cast %safe : i32 to index",
                     f"%bs = tensor.extract {bstart}[%ix] : {evec}", f"%mb = arith.constant {mb} : i32",
                     "%p0 = arith.muli %bs, %mb : i32", "%p1 = arith.addi %p0, %rk : i32", "%neg = arith.constant -1 : i32",
                     "%r = arith.select %valid, %p1, %neg : i32", "linalg.yield %r : i32"],
                  [("%vi", "i32"), ("%rk", "i32"), ("%o", "i32")])
    # the slot at block row p and its token row (0 where none): one table for every grouped matmul of the layer (the
    # second one's is CSE'd away), each taking the row of its x (the token where x is shared by the k slots)
    P = b.v(f"arith.muli {NB}, {_idx(b, mb)} : index", "P")
    # (the slot table is i64: two i32 zero-filled outputs would be one fill, which the GPU backend fails to bufferize)
    vec64 = tt([None], "i64")
    both = generic(b, [(pos, vec, amap(2, "d1"))], [(filled(b, [None], "i64", [P], "0"), vec64, amap(2, "d0")),
                                                     (filled(b, [None], "i32", [P], "0"), vec, amap(2, "d0"))],
                   ["parallel", "reduction"],
                   ["%ip = linalg.index 0 : index", "%is = linalg.index 1 : index", "%zero = arith.constant 0 : i32",
                    "%p = arith.index_cast %ip : index to i32", "%si = arith.index_cast %is : index to i32",
                    f"%kk = arith.constant {k} : i32", "%ti = arith.divui %si, %kk : i32",
                    "%hit = arith.cmpi eq, %ps, %p : i32", "%v = arith.select %hit, %si, %zero : i32",
                    "%v64 = arith.extui %v : i32 to i64", "%vt = arith.select %hit, %ti, %zero : i32",
                    "%r = arith.addi %o, %v64 : i64", "%rt = arith.addi %ot, %vt : i32", "linalg.yield %r, %rt : i64, i32"],
                   [("%ps", "i32"), ("%o", "i64"), ("%ot", "i32")], nres=2)
    rows, row_el = (both + "#1", "i32") if x_rank == 2 else (both + "#0", "i64")
    # bexp[b] = #{e : bend[e] <= min(b, total - 1)}: block b's expert; blocks past the filled ones get the last
    # used expert (the count stops below it), no used expert at all gives 0
    total = b.v(f"tensor.extract_slice {bend}[{e - 1}] [1] [1] : {evec} to {tt([], 'i32')}", "tot")
    bexp = generic(b, [(bend, evec, amap(2, "d1")), (total, tt([], "i32"), amap(2, ""))],
                   [(filled(b, [None], "i32", [NB], "0"), vec, amap(2, "d0"))], ["parallel", "reduction"],
                   ["%ib = linalg.index 0 : index", "%bi = arith.index_cast %ib : index to i32",
                    "%one = arith.constant 1 : i32", "%last = arith.subi %tot, %one : i32",
                    "%at = arith.minsi %bi, %last : i32", "%done = arith.cmpi sle, %be, %at : i32",
                    "%c = arith.extui %done : i1 to i32", "%r = arith.addi %o, %c : i32", "linalg.yield %r : i32"],
                   [("%be", "i32"), ("%tot", "i32"), ("%o", "i32")])
    rows2 = b.v(f"tensor.expand_shape {rows} [[0, 1]] output_shape [{NB}, {mb}] : {tt([None], row_el)} into "
                f"{tt([None, mb], row_el)}", "rows")
    return {"pos": pos, "rows": rows2, "rows_el": row_el, "bexp": bexp}


def _one_expert_blocks(b: Body, ids_flat: str, S: str, e: int, k: int, x_rank: int, NB: str, mb: int) -> dict[str, str]:
    """The layout for E = 1 (a shared expert): the slots in order, block b holds slots [b*mb, b*mb + mb); a slot
    whose id is not 0 is computed and dropped. No sort (and no reduction over a splat of constant ids, which
    IREE's CPU backend turns into a stack buffer of unknown size)."""
    vec = tt([None], "i32")
    pos = generic(b, [(ids_flat, vec, amap(1, "d0"))], [(empty(b, [None], "i32", [S]), vec, amap(1, "d0"))], ["parallel"],
                  ["%is = linalg.index 0 : index", "%si = arith.index_cast %is : index to i32", "%zi = arith.constant 0 : i32",
                   "%neg = arith.constant -1 : i32", "%valid = arith.cmpi eq, %vi, %zi : i32",
                   "%r = arith.select %valid, %si, %neg : i32", "linalg.yield %r : i32"], [("%vi", "i32"), ("%o", "i32")])
    P = b.v(f"arith.muli {NB}, {_idx(b, mb)} : index", "P")
    last = b.v(f"arith.index_cast {b.v(f'arith.subi {S}, {_idx(b, 1)} : index', 'last')} : index to i32", "last")
    src_row = ([f"%kk = arith.constant {k} : i32", "%row = arith.divui %sl, %kk : i32"] if x_rank == 2
               else ["%row = arith.addi %sl, %zero : i32"])
    rows = generic(b, [], [(empty(b, [None], "i32", [P]), vec, amap(1, "d0"))], ["parallel"],
                   ["%ip = linalg.index 0 : index", "%zero = arith.constant 0 : i32", "%p = arith.index_cast %ip : index to i32",
                    f"%sl = arith.minsi %p, {last} : i32", *src_row, "linalg.yield %row : i32"], [("%o", "i32")])
    rows2 = b.v(f"tensor.expand_shape {rows} [[0, 1]] output_shape [{NB}, {mb}] : {vec} into {tt([None, mb], 'i32')}",
                "rows")
    return {"pos": pos, "rows": rows2, "rows_el": "i32", "bexp": filled(b, [None], "i32", [NB], "0")}


def _gather(b: Body, src: str, src_dims: list, idx: str, idx_dims: list, el: str, dyn: list[str],
            idx_el: str = "i32") -> str:
    """``iree_linalg_ext.gather`` of whole slices of ``src`` along its dim 0 at the integer ``idx``."""
    out_dims = idx_dims + src_dims[1:]
    out_t = tt(out_dims, el)
    return b.v(f"iree_linalg_ext.gather dimension_map = [0] ins({src}, {idx} : {tt(src_dims, el)}, "
               f"{tt(idx_dims, idx_el)}) outs({empty(b, out_dims, el, dyn)} : {out_t}) -> {out_t}", "gth")


def _weights(b: Body, e: int, n: int, kb: int) -> tuple[str, str]:
    """``%w`` / ``%s`` as f4E2M1FN [E, N, KB, 32] / f8E8M0FNU [E, N, KB] views (no copy)."""
    w4 = b.v(f"tensor.expand_shape %w [[0], [1], [2, 3]] output_shape [{e}, {n}, {kb}, 16] : "
             f"{tt([e, n, kb * 16], 'i8')} into {tt([e, n, kb, 16], 'i8')}", "w")
    wf = b.v(f"iree_tensor_ext.bitcast {w4} : {tt([e, n, kb, 16], 'i8')} -> {tt([e, n, kb, 32], 'f4E2M1FN')}", "wf")
    sf = b.v(f"iree_tensor_ext.bitcast %s : {tt([e, n, kb], 'i8')} -> {tt([e, n, kb], 'f8E8M0FNU')}", "sf")
    return wf, sf


#: the e4m3 bytes of the e2m1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, magnitude code m in byte m
E4M3_OF_E2M1 = 0x4C4844403C383000


def _e2m1_to_e4m3_lines(f4: str, out: str) -> list[str]:
    """The same value as an f8E4M3FN (every e2m1 value is an e4m3 value): the magnitude's byte of the 64-bit constant
    :data:`E4M3_OF_E2M1` (one shift), the sign moved from bit 3 to bit 7."""
    return [
        f"%n4 = arith.bitcast {f4} : f4E2M1FN to i4", "%n = arith.extui %n4 : i4 to i64",
        "%k7 = arith.constant 7 : i64", "%k8 = arith.constant 8 : i64", "%k3 = arith.constant 3 : i64",
        "%k4 = arith.constant 4 : i64", "%kff = arith.constant 255 : i64",
        f"%lut = arith.constant {E4M3_OF_E2M1} : i64",
        "%mag = arith.andi %n, %k7 : i64", "%sh = arith.shli %mag, %k3 : i64", "%l = arith.shrui %lut, %sh : i64",
        "%code = arith.andi %l, %kff : i64", "%sgn = arith.andi %n, %k8 : i64", "%sg = arith.shli %sgn, %k4 : i64",
        "%wb64 = arith.ori %code, %sg : i64", "%wb = arith.trunci %wb64 : i64 to i8",
        f"{out} = arith.bitcast %wb : i8 to f8E4M3FN",
    ]


def _quantize_mxfp8(b: Body, xr: str, xel: str, R: str, kb: int) -> tuple[str, str]:
    """[R, KB, 32] activations -> (f8E4M3FN values [R, KB, 32], f8E8M0FNU scales [R, KB]), OCP MX rules."""
    x3t = tt([None, kb, 32], xel)
    amax = generic(b, [(xr, x3t, amap(3, "d0, d1, d2"))],
                   [(filled(b, [None, kb], "f32", [R], "0.0"), tt([None, kb], "f32"), amap(3, "d0, d1"))],
                   ["parallel", "parallel", "reduction"],
                   to_f32_lines("%xv", xel, "%xf") + ["%a = math.absf %xf : f32", "%r = arith.maximumf %o, %a : f32",
                                                      "linalg.yield %r : f32"], [("%xv", xel), ("%o", "f32")])
    # scale byte: the biased exponent of amax minus emax_elem, at least 0 (amax below 2^-119 or zero: 2^-127)
    scale = generic(b, [(amax, tt([None, kb], "f32"), amap(2, "d0, d1"))],
                    [(empty(b, [None, kb], "i8", [R]), tt([None, kb], "i8"), amap(2, "d0, d1"))], ["parallel", "parallel"],
                    ["%bits = arith.bitcast %a : f32 to i32", "%k23 = arith.constant 23 : i32",
                     "%kff = arith.constant 255 : i32", f"%kem = arith.constant {E4M3_EMAX} : i32",
                     "%z = arith.constant 0 : i32", "%ex0 = arith.shrui %bits, %k23 : i32", "%ex = arith.andi %ex0, %kff : i32",
                     "%sb0 = arith.subi %ex, %kem : i32", "%sb1 = arith.maxsi %sb0, %z : i32",
                     "%r = arith.trunci %sb1 : i32 to i8", "linalg.yield %r : i8"], [("%a", "f32"), ("%o", "i8")])
    # values: x / 2^(scale - 127), saturated to +-448, rounded to nearest even by truncf
    vals = generic(b, [(xr, x3t, amap(3, "d0, d1, d2")), (scale, tt([None, kb], "i8"), amap(3, "d0, d1"))],
                   [(empty(b, [None, kb, 32], "f8E4M3FN", [R]), tt([None, kb, 32], "f8E4M3FN"), amap(3, "d0, d1, d2"))],
                   ["parallel"] * 3,
                   to_f32_lines("%xv", xel, "%xf")
                   + ["%sq = arith.extui %sb : i8 to i32", "%k254 = arith.constant 254 : i32", "%k23 = arith.constant 23 : i32",
                      "%ie = arith.subi %k254, %sq : i32", "%ib = arith.shli %ie, %k23 : i32",
                      # 2^(127 - s): a normal f32 for every s in 0..254 except 0, where 2^127 is still normal
                      "%inv = arith.bitcast %ib : i32 to f32", "%y = arith.mulf %xf, %inv : f32",
                      f"%mx = arith.constant {E4M3_MAX} : f32", f"%mn = arith.constant {-E4M3_MAX} : f32",
                      "%ylo = arith.minimumf %y, %mx : f32", "%ysat = arith.maximumf %ylo, %mn : f32",
                      "%r = arith.truncf %ysat : f32 to f8E4M3FN", "linalg.yield %r : f8E4M3FN"],
                   [("%xv", xel), ("%sb", "i8"), ("%o", "f8E4M3FN")])
    sc = b.v(f"iree_tensor_ext.bitcast {scale} : {tt([None, kb], 'i8')}{{{R}}} -> {tt([None, kb], 'f8E8M0FNU')}{{{R}}}",
             "xs")
    return vals, sc


def grouped_matmul(b: Body, x: str, xt, k: int, e: int, n: int, kk: int, bias_t: str | None, T: str,
                   activations: str = "bf16", decode: str = "scaling_extf", round_to: str = "f32") -> str:
    """The [T, k, N] result of the grouped matmul (+bias; 0 for a slot whose id is not in [0, E)): f32 sums rounded
    once to ``round_to`` (the reference's rounding point).

    Blocks of :data:`BLOCK_ROWS` rows, or of :data:`LARGE_BLOCK_ROWS` when the slots average at least
    :data:`LARGE_BLOCK_MIN_ROWS` per expert (a host-side ``scf.if`` on T: each block reads and decodes its expert's
    weights, so larger blocks read them fewer times). Expects ``%ids``, ``%w``, ``%s`` (and ``%bias`` when
    ``bias_t``) in scope."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}")
    kb = kk // 32
    xel = str(xt.element_type)
    S = b.v(f"arith.muli {T}, {_idx(b, k)} : index", "S")
    ids_flat = b.v(f"tensor.collapse_shape %ids [[0, 1]] : {tt([None, k], 'i32')} into {tt([None], 'i32')}", "idf")
    # activation rows [R, KB, 32]: the tokens (x: T x K) or the slots (x: T x k x K)
    if xt.rank == 2:
        R, x2 = T, x
    else:
        R = S
        x2 = b.v(f"tensor.collapse_shape {x} [[0, 1], [2]] : {xt} into {tt([None, kk], xel)}", "xs")
    xr = b.v(f"tensor.expand_shape {x2} [[0], [1, 2]] output_shape [{R}, {kb}, 32] : {tt([None, kk], xel)} into "
             f"{tt([None, kb, 32], xel)}", "xr")
    rows = (xr, xel) if activations == "bf16" else _quantize_mxfp8(b, xr, xel, R, kb)
    wf, sf = _weights(b, e, n, kb)
    ys_t = tt([None, n], round_to)

    def blocked(bb: Body, mb: int) -> str:
        res = _blocked_matmul(bb, S, ids_flat, rows, xt.rank, k, e, n, kb, bias_t, wf, sf, activations, decode, mb,
                              round_to)
        return bb.v(f"flow.tensor.tie_shape {res} : {ys_t}{{{S}}}", "ys")

    large = b.v(f"arith.cmpi uge, {S}, {_idx(b, LARGE_BLOCK_MIN_ROWS * e)} : index", "large")
    res = scf_if(b, large, ys_t, lambda tb: blocked(tb, LARGE_BLOCK_ROWS), lambda eb: blocked(eb, BLOCK_ROWS), "ys")
    res = b.v(f"flow.tensor.tie_shape {res} : {ys_t}{{{S}}}", "ys")
    return b.v(f"tensor.expand_shape {res} [[0, 1], [2]] output_shape [{T}, {k}, {n}] : {ys_t} into "
               f"{tt([None, k, n], round_to)}", "y")


def _blocked_matmul(b: Body, S: str, ids_flat: str, rows: tuple[str, str], x_rank: int, k: int, e: int, n: int,
                    kb: int, bias_t: str | None, wf: str, sf: str, activations: str, decode: str, mb: int,
                    round_to: str) -> str:
    """[S, N] by slot, rounded to ``round_to``, through blocks of ``mb`` rows (steps 1-4 of the module docstring).
    ``rows``: the activation rows [R, KB, 32] and their type ("bf16" form), or the MXFP8 values and scales."""
    # NB = m + (S - m) / mb with m = min(E, S): enough blocks for any routing
    m = b.v(f"arith.minui {S}, {_idx(b, e)} : index", "m")
    rest = b.v(f"arith.subi {S}, {m} : index", "rest")
    NB = b.v(f"arith.addi {m}, {b.v(f'arith.divui {rest}, {_idx(b, mb)} : index', 'q')} : index", "NB")
    blk = (_blocks if e > 1 else _one_expert_blocks)(b, ids_flat, S, e, k, x_rank, NB, mb)
    gw = _gather(b, wf, [e, n, kb, 32], blk["bexp"], [None], "f4E2M1FN", [NB])
    gs = _gather(b, sf, [e, n, kb], blk["bexp"], [None], "f8E8M0FNU", [NB])
    out_t = tt([None, mb, n], "f32")
    acc = filled(b, [None, mb, n], "f32", [NB], "0.0")
    iters = ["parallel", "parallel", "parallel", "reduction", "reduction"]
    a_map, w_map, o_map = amap(5, "d0, d1, d3, d4"), amap(5, "d0, d2, d3, d4"), amap(5, "d0, d1, d2")
    w4t = tt([None, n, kb, 32], "f4E2M1FN")
    ident4 = amap(4, "d0, d1, d2, d3")
    if activations == "bf16":
        xr, xel = rows
        ct = compute_type(xel)
        xg = _gather(b, xr, [None, kb, 32], blk["rows"], [None, mb], xel, [NB], blk["rows_el"])
        wd = generic(b, [(gw, w4t, ident4), (gs, tt([None, n, kb], "f8E8M0FNU"), amap(4, "d0, d1, d2"))],
                     [(empty(b, [None, n, kb, 32], ct, [NB]), tt([None, n, kb, 32], ct), ident4)], ["parallel"] * 4,
                     ([f"%d = arith.scaling_extf %wv, %sv : f4E2M1FN, f8E8M0FNU to {ct}"] if decode == "scaling_extf"
                      else mxfp4.e8m0_value_lines("%sv", "%sf") + mxfp4.e2m1_scaled_lines("%wv", "%sf", "%d", ct))
                     + [f"linalg.yield %d : {ct}"],
                     [("%wv", "f4E2M1FN"), ("%sv", "f8E8M0FNU"), ("%o", ct)])
        conv = (lambda v, el, out: [f"{out} = arith.extf {v} : {el} to f32"] if el != "f32" else [])
        body = (conv("%xv", xel, "%xf") + conv("%wv", ct, "%wf")
                + [f"%p = arith.mulf {'%xf' if xel != 'f32' else '%xv'}, {'%wf' if ct != 'f32' else '%wv'} : f32",
                   "%r = arith.addf %o, %p : f32", "linalg.yield %r : f32"])
        mm = generic(b, [(xg, tt([None, mb, kb, 32], xel), a_map), (wd, tt([None, n, kb, 32], ct), w_map)],
                     [(acc, out_t, o_map)], iters, body, [("%xv", xel), ("%wv", ct), ("%o", "f32")])
    else:
        xq, xs = rows
        xg = _gather(b, xq, [None, kb, 32], blk["rows"], [None, mb], "f8E4M3FN", [NB], blk["rows_el"])
        xgs = _gather(b, xs, [None, kb], blk["rows"], [None, mb], "f8E8M0FNU", [NB], blk["rows_el"])
        w8 = generic(b, [(gw, w4t, ident4)],
                     [(empty(b, [None, n, kb, 32], "f8E4M3FN", [NB]), tt([None, n, kb, 32], "f8E4M3FN"), ident4)],
                     ["parallel"] * 4, _e2m1_to_e4m3_lines("%wv", "%r") + ["linalg.yield %r : f8E4M3FN"],
                     [("%wv", "f4E2M1FN"), ("%o", "f8E4M3FN")])
        mm = generic(b, [(xg, tt([None, mb, kb, 32], "f8E4M3FN"), a_map), (w8, tt([None, n, kb, 32], "f8E4M3FN"), w_map),
                         (xgs, tt([None, mb, kb], "f8E8M0FNU"), amap(5, "d0, d1, d3")),
                         (gs, tt([None, n, kb], "f8E8M0FNU"), amap(5, "d0, d2, d3"))],
                     [(acc, out_t, o_map)], iters,
                     ["%a = arith.scaling_extf %xv, %xsv : f8E4M3FN, f8E8M0FNU to f32",
                      "%c = arith.scaling_extf %wv, %wsv : f8E4M3FN, f8E8M0FNU to f32",
                      "%p = arith.mulf %a, %c : f32", "%r = arith.addf %o, %p : f32", "linalg.yield %r : f32"],
                     [("%xv", "f8E4M3FN"), ("%wv", "f8E4M3FN"), ("%xsv", "f8E8M0FNU"), ("%wsv", "f8E8M0FNU"), ("%o", "f32")])
    # unsort: the slot's block row, plus the bias; 0 for an invalid slot
    flat = b.v(f"tensor.collapse_shape {mm} [[0, 1], [2]] : {out_t} into {tt([None, n], 'f32')}", "flat")
    ins = [(blk["pos"], tt([None], "i32"), amap(2, "d0")), (ids_flat, tt([None], "i32"), amap(2, "d0"))]
    body = ["%z = arith.constant 0 : i32", "%fz = arith.constant 0.0 : f32", "%valid = arith.cmpi sge, %p, %z : i32",
            "%pc = arith.select %valid, %p, %z : i32", "%row = arith.index_cast %pc : i32 to index",
            "%n = linalg.index 1 : index", f"%y = tensor.extract {flat}[%row, %n] : {tt([None, n], 'f32')}"]
    if bias_t is None:
        body += ["%r = arith.select %valid, %y, %fz : f32"]
    else:
        bel = bias_t.rsplit("x", 1)[1].rstrip(">")
        body += ["%idc = arith.select %valid, %id, %z : i32", "%ei = arith.index_cast %idc : i32 to index",
                 f"%bv = tensor.extract %bias[%ei, %n] : {bias_t}",
                 *to_f32_lines("%bv", bel, "%bf"), "%yb = arith.addf %y, %bf : f32",
                 "%r = arith.select %valid, %yb, %fz : f32"]
    body += from_f32_lines("%r", round_to, "%rr") + [f"linalg.yield %rr : {round_to}"]
    return generic(b, ins, [(empty(b, [None, n], round_to, [S]), tt([None, n], round_to), amap(2, "d0, d1"))],
                   ["parallel", "parallel"], body, [("%p", "i32"), ("%id", "i32"), ("%o", round_to)])
