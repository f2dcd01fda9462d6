"""The CPU schedule of a grouped MXFP4 matmul, for weights in the ``cpu-mxfp4-blocksplit`` layout.

Row ``s = t*k + j`` of the grouped matmul is ``x[t] (or x[t, j]) @ dequant(w[ids[t, j]])^T (+ bias)``.
Instead of gathering weight bytes per row (what a ``tensor.extract`` inside one big generic does), the
rows are grouped by expert so that each used expert's weights are read once:

1. *sort* (on the device, small generics): ``pos[s]`` = rank of ``(ids[s], s)`` among all slots,
   ``order[p]`` its inverse, ``counts[e]`` / ``offsets[e]`` per expert and the list of used experts.
   These are O(slots^2) and O(slots x E) integer compares: microseconds at 1 token, about a millisecond
   at 2048 slots; never any weight traffic.
2. with the C microkernel linked (the cpu target's default, :mod:`cpu_ukernel`,
   :func:`grouped_matmul_ukernel`): a C quantizer reads row ``order[p] / k`` of x itself and writes it as
   int16 per 32-value block, and *one dispatch* of the matvec computes every used expert's rows (the
   expert table read on the device) and writes each row back to its slot: the result is in token order,
   steps 3-4 do not apply. Otherwise (:func:`grouped_matmul_rows`):
3. *gather*: ``xs[p] = x[order[p] / k]``: the activations in expert order (contiguous row copies), as f32
   rows read by both kernels below (``MATVEC_F32_ROWS``, ``MATMUL_F32_ROWS``); then, the microkernel
   absent (no C compiler, ``MXMOE_CPU_UKERNEL=0``, f32 activations):
   a *loop over the used experts* (``scf.for`` on the host, trip count = number of distinct experts the
   routing picked, so an expert no token chose costs nothing; each used expert has one packed i64,
   ``id | offset << 16 | rows << 40``: up to ``READBACK_ALL_SLOTS`` slots and ``SMALL_ROWS`` tokens all
   of them are read back before the loop and each iteration picks its own on the host, so the host never
   waits on the device between experts; above, each iteration reads its id, offset and rows back, which
   also keeps one expert's work in flight at a time): the expert's weights are a
   ``tensor.extract_slice`` of the parameter at a dynamic offset (no copy, no byte gather) and its rows
   a slice of ``xs``. Two kernels, picked per expert from its row count:

   * few rows (``count <= SMALL_ROWS``): a *block matvec* (``MATVEC_FORM = "block"``): one linalg.generic
     over ``(row, out, nibble half, byte, block)`` whose body decodes the e2m1 nibble (as f16 bits, one
     hardware conversion) and e8m0 scale and accumulates ``x * w`` (x: rows gathered once as f32)
     into 32 f32 partial sums per output (one whole
     32-value block per reduction step, all other dims parallel, so the inner loop is plain SIMD with no
     horizontal reduction); a second generic sums the partials. Nothing dequantized is ever written to
     memory. Its tile sizes are pinned with ``compilation_info``. ``MATVEC_FORM = "lanes8"`` selects the
     first version (8 lanes, the block's 2 x 2 vectors as inner reduction loops).
   * many rows: the expert's weights are decoded once to f32 (an elementwise generic) and multiplied
     with a contraction generic that IREE tiles and vectorizes as a matmul: decode cost amortized over
     the rows. ``DECODE_FOR_MATMUL`` picks the decode: the integer one (default, faster here) or
     ``arith.scaling_extf`` on ``iree_tensor_ext.bitcast`` f4E2M1FN / f8E8M0FNU views of the bytes,
     read in storage order with the activations gathered in the matching order (docs/cpu.md has the
     measurements).

4. *unsort*: ``y[t, j] = ys[pos[t*k + j]]`` rounded to the activation type, then the fused epilogue
   (GLU, or routing weights + combine) as in the reference.

The blocksplit layout stores, in each 16-byte run of a row (one 32-value MXFP4 block), value ``b`` in
the low nibble and value ``b + 16`` in the high nibble of byte ``b``, so that both nibble planes of 8
consecutive bytes line up with 8 consecutive activations; scales and biases are row-major.
"""

from __future__ import annotations

from mxmoe.compiler.passes.lowering import cpu_ukernel, mxfp4
from mxmoe.compiler.passes.lowering.text import Body, amap, empty, filled, generic, scf_if, to_f32_lines, tt

LAYOUT = "cpu-mxfp4-blocksplit"
#: the int8-activation forms' layout (activations="mxint8" / "mxint16"): only the C microkernel reads it
ROWS16_LAYOUT = "cpu-mxfp4-rows16"
#: an expert with at most this many routed rows uses the small-row matvec; more rows use decode + matmul
#: (with the f16-decode matvec, 32 beat 8 by 25-30% at 64-128 tokens and tied at 32 and 256; docs/cpu.md)
SMALL_ROWS = 32
#: lanes of the "lanes8" matvec (f32 accumulators per output row): one AVX2 vector
LANES = 8
#: "int" (bit-twiddling decode) or "scaling_extf" (arith.scaling_extf on bitcast f4/f8 views) for the
#: decode-once kernel; see docs/cpu.md for the measurements behind the default.
DECODE_FOR_MATMUL = "int"
#: decode of the "lanes8" matvec (the "block" form's is ``BLOCK_DECODE``): "signmag" (one variable shift puts the nibble's sign bit at bit 31, the
#: magnitude is taken from the same word, ``min`` as a compare + select so it lowers to one ``vminps``)
#: or "int" (the first version: :func:`mxfp4.code_value_lines`, whose ``arith.minimumf`` costs a NaN
#: check and a blend per vector). Both exact; docs/cpu.md has the measurements.
MATVEC_DECODE = "signmag"
#: outputs per vector tile of the "lanes8" matvec (4 rows x 8 lanes)
MATVEC_VECTOR_ROWS = 4
#: vector tile of the "lanes8" matvec's (K/32, 2, 2) reduction dims ((1, 2, 2) measured 4x slower)
MATVEC_REDUCTION_TILE = (1, 1, 1)
#: "block" (a whole 32-value block per step: parallel (row, out, nibble half, 16 bytes), reduction over
#: the blocks only, 32 f32 partial sums per output) or "lanes8" (the first version: 8 lanes, the block's
#: 2 x 2 vectors as inner reduction loops)
MATVEC_FORM = "block"
#: above ``READBACK_ALL_SLOTS`` slots, "separate": the host loop reads each used expert's id, then its
#: offset and rows back (three dependent i32 reads, so an iteration starts once the previous one's work is
#: done); "packed": one i64 per expert (more iterations in flight, a little faster, but IREE 3.13's
#: local-task device then keeps 100-250 MB per call at gpt-oss size, without bound: docs/cpu.md)
LOOP_READBACK = "separate"
#: at most this many slots (T*k), and at most ``SMALL_ROWS`` tokens (so every expert takes the matvec):
#: the used experts' packed entries are read back before the expert loop
#: and the loop picks its entry on the host (no wait on the device between experts); above, one read back
#: per iteration, which also bounds how much work (and how many decoded f32 experts) is queued at once
READBACK_ALL_SLOTS = 64
#: how many entries that form reads back before the loop (later ones, only with more used experts than
#: this, are read in their iteration): iree-compile time grows fast with it (gpt-oss-120b, E = 128:
#: 3.6 s for the module without the form, 7.9 s with 32 entries, 20.5 s with 64, 156 s with 128)
READBACK_ENTRIES = 32
#: outputs per vector tile of the "block" form (each takes 4 ymm accumulators; 2 or 4 measured 3x slower)
BLOCK_VECTOR_ROWS = 1
#: vector tile of its (nibble half, byte) dims
BLOCK_VECTOR_TILE = (2, 16)
#: nibble decode of the "block" form: "f16" (:func:`mxfp4.f16_nibble_value_lines`: i16 bit ops and one
#: ``vcvtph2ps`` per 8 values) or "signmag" (the previous one, f32 bit ops); docs/cpu.md has the figures
BLOCK_DECODE = "f16"
#: the matvec reads activations gathered as f32 rows (one conversion per activation, not one per output row)
MATVEC_F32_ROWS = True
#: the decode-once contraction reads the same f32 rows (with the integer decode), so no bf16 copy is gathered
MATMUL_F32_ROWS = True
#: slots per chunk of the linalg grouping (:func:`_sort_slots`): each slot is compared with the earlier
#: slots of its chunk, and the per-chunk counts are scanned over the chunks
SORT_CHUNK = 64


def _matvec_config(n: int) -> str:
    """Pinned tiles for the lane matvec (IREE's default for it is 3-5x slower); none when N is not a
    multiple of 32 (the target's padding normally guarantees it), so odd shapes get IREE's default."""
    if n % 32:
        return ""
    rows = 64 if n % 64 == 0 else 32
    return ("compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [1, {rows}, {LANES}, 0, 0, 0], vector_common_parallel = [1, {MATVEC_VECTOR_ROWS}, {LANES}, 0, 0, 0], "
            f"vector_reduction = [0, 0, 0, {', '.join(map(str, MATVEC_REDUCTION_TILE))}]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def _block_config(n: int) -> str:
    if n % 32:
        return ""
    rows = 64 if n % 64 == 0 else 32
    return ("compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [1, {rows}, 2, 16, 0], vector_common_parallel = [1, {BLOCK_VECTOR_ROWS}, {BLOCK_VECTOR_TILE[0]}, {BLOCK_VECTOR_TILE[1]}, 0], "
            "vector_reduction = [0, 0, 0, 0, 1]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def _block_matvec(b: Body, xe: str, xel: str, we: str, se: str, init: str, cnt: str, n: int, kk: int) -> str:
    """[cnt, n] f32 = init + xe[cnt, kk] @ dequant(we)^T, one 32-value block per reduction step.

    Iteration space ``(m, n, h, i, kb)``: value ``kb*32 + 16h + i`` is nibble ``h`` of byte ``kb*16 + i``
    (the blocksplit layout), so all dims but ``kb`` are parallel and vectorize without any reduction
    inside a block: 32 f32 partial sums (4 ymm) per output row, summed by a second generic.
    """
    kb = kk // 32
    x4t = tt([None, kb, 2, 16], xel)
    x4 = b.v(f"tensor.expand_shape {xe} [[0], [1, 2, 3]] output_shape [{cnt}, {kb}, 2, 16] : "
             f"{tt([None, kk], xel)} into {x4t}", "x")
    w3t = tt([n, kb, 16], "i8")
    w3 = b.v(f"tensor.expand_shape {we} [[0], [1, 2]] output_shape [{n}, {kb}, 16] : "
             f"{tt([n, kk // 2], 'i8')} into {w3t}", "w")
    pt = tt([None, n, 2, 16], "f32")
    part0 = filled(b, [None, n, 2, 16], "f32", [cnt], "0.0")
    f16 = BLOCK_DECODE == "f16"
    dec = (mxfp4.f16_nibble_value_lines if f16 else mxfp4.signmag_nibble_value_lines)("%wb", "%h", "%wv")
    # The product is an fma with a zero addend, then added: a plain mulf + addf is recognized as a
    # contraction, whose unit reduction dim MLIR lowers element by element (LLVM re-vectorizes most of it,
    # with scalar stragglers); an fma as the combiner is not recognized as a reduction (nothing vectorizes).
    # ``nsz`` (the sign of a zero product may be ignored) lets LLVM fold fma(a, b, 0) + acc into one fma.
    body = (["%h = linalg.index 2 : index"] + dec
            + mxfp4.scale_lines("%sb", "%sv") + to_f32_lines("%xv", xel, "%xf")
            + ["%ws = arith.mulf %wv, %sv : f32", "%z = arith.constant 0.0 : f32",
               "%p = math.fma %ws, %xf, %z fastmath<nsz,contract> : f32",
               "%r = arith.addf %acc, %p fastmath<nsz,contract> : f32", "linalg.yield %r : f32"])
    part = generic(b, [(x4, x4t, amap(5, "d0, d4, d2, d3")), (w3, w3t, amap(5, "d1, d4, d3")),
                       (se, tt([n, kb], "i8"), amap(5, "d1, d4"))],
                   [(part0, pt, amap(5, "d0, d1, d2, d3"))],
                   ["parallel", "parallel", "parallel", "parallel", "reduction"], body,
                   [("%xv", xel), ("%wb", "i8"), ("%sb", "i8"), ("%acc", "f32")], attrs=_block_config(n))
    # the f16 decode's partial sums carry 2^-14: multiplied back here, once per partial
    total = ([f"%k = arith.constant {mxfp4.F16_NIBBLE_SCALE} : f32", "%as = arith.mulf %a, %k : f32",
              "%r = arith.addf %as, %o : f32"] if f16 else ["%r = arith.addf %a, %o : f32"])
    return generic(b, [(part, pt, amap(4, "d0, d1, d2, d3"))],
                   [(init, tt([None, n], "f32"), amap(4, "d0, d1"))], ["parallel", "parallel", "reduction", "reduction"],
                   total + ["linalg.yield %r : f32"], [("%a", "f32"), ("%o", "f32")])


def _lane_matvec(b: Body, xe: str, xel: str, we: str, se: str, init: str, cnt: str, n: int, kk: int) -> str:
    """[cnt, n] f32 = init + xe[cnt, kk] @ dequant(we)^T with the decode in the inner loop."""
    if MATVEC_FORM == "block":
        return _block_matvec(b, xe, xel, we, se, init, cnt, n, kk)
    kb, i1 = kk // 32, 16 // LANES
    x5t = tt([None, kb, 2, i1, LANES], xel)
    x5 = b.v(f"tensor.expand_shape {xe} [[0], [1, 2, 3, 4]] output_shape [{cnt}, {kb}, 2, {i1}, {LANES}] : "
             f"{tt([None, kk], xel)} into {x5t}", "x")
    w4t = tt([n, kb, i1, LANES], "i8")
    w4 = b.v(f"tensor.expand_shape {we} [[0], [1, 2, 3]] output_shape [{n}, {kb}, {i1}, {LANES}] : "
             f"{tt([n, kk // 2], 'i8')} into {w4t}", "w")
    part0 = filled(b, [None, n, LANES], "f32", [cnt], "0.0")
    if MATVEC_DECODE == "signmag":
        dec = mxfp4.signmag_nibble_value_lines("%wb", "%h", "%wv")
    else:
        dec = mxfp4.nibble_lines("%wb", "%h", "%q") + mxfp4.code_value_lines("%q", "%wv")
    body = (dec + mxfp4.scale_lines("%sb", "%sv")
            + to_f32_lines("%xv", xel, "%xf")
            + ["%ws = arith.mulf %wv, %sv : f32", "%p = arith.mulf %ws, %xf : f32", "%r = arith.addf %acc, %p : f32",
               "linalg.yield %r : f32"])
    body = ["%h = linalg.index 5 : index"] + body
    part = generic(b, [(x5, x5t, amap(6, "d0, d3, d5, d4, d2")), (w4, w4t, amap(6, "d1, d3, d4, d2")),
                       (se, tt([n, kb], "i8"), amap(6, "d1, d3"))],
                   [(part0, tt([None, n, LANES], "f32"), amap(6, "d0, d1, d2"))],
                   ["parallel", "parallel", "parallel", "reduction", "reduction", "reduction"], body,
                   [("%xv", xel), ("%wb", "i8"), ("%sb", "i8"), ("%acc", "f32")], attrs=_matvec_config(n))
    return generic(b, [(part, tt([None, n, LANES], "f32"), amap(3, "d0, d1, d2"))],
                   [(init, tt([None, n], "f32"), amap(3, "d0, d1"))], ["parallel", "parallel", "reduction"],
                   ["%r = arith.addf %a, %o : f32", "linalg.yield %r : f32"], [("%a", "f32"), ("%o", "f32")])


def _decode_expert(b: Body, we: str, se: str, n: int, kk: int) -> str:
    """[n, kk/32, 32] f32 dequantized weights of one expert.

    ``scaling_extf``: ``iree_tensor_ext.bitcast`` of the bytes to ``f4E2M1FN`` and of the scales to
    ``f8E8M0FNU``, decoded with ``arith.scaling_extf`` in *storage* order (position ``2b + h`` of a
    block is value ``b + 16h``; the activations are gathered in that order to match, see
    :func:`_gather_rows`). ``int``: the integer decode, written in *value* order.
    """
    kb = kk // 32
    if DECODE_FOR_MATMUL == "scaling_extf":
        out_t = tt([n, kb, 32], "f32")
        ident = amap(3, "d0, d1, d2")
        f4 = b.v(f"iree_tensor_ext.bitcast {we} : {tt([n, kk // 2], 'i8')} -> {tt([n, kk], 'f4E2M1FN')}", "f4")
        f4x = b.v(f"tensor.expand_shape {f4} [[0], [1, 2]] output_shape [{n}, {kb}, 32] : "
                  f"{tt([n, kk], 'f4E2M1FN')} into {tt([n, kb, 32], 'f4E2M1FN')}", "f4")
        f8 = b.v(f"iree_tensor_ext.bitcast {se} : {tt([n, kb], 'i8')} -> {tt([n, kb], 'f8E8M0FNU')}", "f8")
        return generic(b, [(f4x, tt([n, kb, 32], "f4E2M1FN"), ident), (f8, tt([n, kb], "f8E8M0FNU"), amap(3, "d0, d1"))],
                       [(empty(b, [n, kb, 32], "f32", []), out_t, ident)], ["parallel"] * 3,
                       mxfp4.scaling_extf_lines("%a", "%sc8", "%r") + ["linalg.yield %r : f32"],
                       [("%a", "f4E2M1FN"), ("%sc8", "f8E8M0FNU"), ("%o", "f32")])
    else:
        out_t = tt([n, kb, 2, 16], "f32")
        w3 = b.v(f"tensor.expand_shape {we} [[0], [1, 2]] output_shape [{n}, {kb}, 16] : "
                 f"{tt([n, kk // 2], 'i8')} into {tt([n, kb, 16], 'i8')}", "w")
        dec = generic(b, [(w3, tt([n, kb, 16], "i8"), amap(4, "d0, d1, d3")), (se, tt([n, kb], "i8"), amap(4, "d0, d1"))],
                      [(empty(b, [n, kb, 2, 16], "f32", []), out_t, amap(4, "d0, d1, d2, d3"))], ["parallel"] * 4,
                      ["%h = linalg.index 2 : index"] + mxfp4.nibble_lines("%wb", "%h", "%q")
                      + mxfp4.code_value_lines("%q", "%wv") + mxfp4.scale_lines("%sb", "%sv")
                      + ["%r = arith.mulf %wv, %sv : f32", "linalg.yield %r : f32"],
                      [("%wb", "i8"), ("%sb", "i8"), ("%o", "f32")])
    return b.v(f"tensor.collapse_shape {dec} [[0], [1], [2, 3]] : {out_t} into {tt([n, kb, 32], 'f32')}", "d")


def _decoded_matmul(b: Body, xe: str, xel: str, we: str, se: str, init: str, cnt: str, n: int, kk: int) -> str:
    """``xe`` must be in the order :func:`_decode_expert` produces (see ``needs_storage_order``)."""
    kb = kk // 32
    wd = _decode_expert(b, we, se, n, kk)
    x3t = tt([None, kb, 32], xel)
    x3 = b.v(f"tensor.expand_shape {xe} [[0], [1, 2]] output_shape [{cnt}, {kb}, 32] : {tt([None, kk], xel)} into {x3t}", "x")
    return generic(b, [(x3, x3t, amap(4, "d0, d2, d3")), (wd, tt([n, kb, 32], "f32"), amap(4, "d1, d2, d3"))],
                   [(init, tt([None, n], "f32"), amap(4, "d0, d1"))], ["parallel", "parallel", "reduction", "reduction"],
                   to_f32_lines("%xv", xel, "%xf") + ["%p = arith.mulf %xf, %wv : f32", "%r = arith.addf %o, %p : f32",
                                                      "linalg.yield %r : f32"],
                   [("%xv", xel), ("%wv", "f32"), ("%o", "f32")])


def _gather_rows(b: Body, x: str, xt, order: str, k: int, kk: int, S: str, storage_order: bool,
                 f32: bool = False) -> str:
    """[S, kk] activations in expert order: row p is x[order[p] / k] (x: T x K) or x[order[p]] (T x k x K
    flattened). With ``storage_order`` each 32-block is permuted so position ``2b + h`` holds element
    ``b + 16h``, the order of the f4 elements of the blocksplit bytes. ``f32``: converted to f32 (exact)
    on the way, so that a kernel reading each row many times does not convert it each time."""
    xel = str(xt.element_type)
    oel = "f32" if f32 else xel
    if xt.rank == 2:
        src, src_t = x, str(xt)
        row = ["%sx = arith.index_cast %o32 : i32 to index", f"%kk = arith.constant {k} : index",
               "%row = arith.divui %sx, %kk : index"]
    else:
        src_t = tt([None, kk], xel)
        src = b.v(f"tensor.collapse_shape {x} [[0, 1], [2]] : {xt} into {src_t}", "xf")
        row = ["%row = arith.index_cast %o32 : i32 to index"]
    if not storage_order:
        col = ["%col = linalg.index 1 : index"]
    else:
        col = ["%c = linalg.index 1 : index","%k32 = arith.constant 32 : index", "%k16 = arith.constant 16 : index", "%k2 = arith.constant 2 : index",
                "%p = arith.remui %c, %k32 : index", "%base = arith.subi %c, %p : index",
                "%hb = arith.remui %p, %k2 : index", "%bb = arith.divui %p, %k2 : index",
                "%h16 = arith.muli %hb, %k16 : index", "%off = arith.addi %h16, %bb : index",
                "%col = arith.addi %base, %off : index"]
    body = row + col + [f"%e = tensor.extract {src}[%row, %col] : {src_t}"]
    body += (to_f32_lines("%e", xel, "%r") + ["linalg.yield %r : f32"]) if f32 else [f"linalg.yield %e : {xel}"]
    return generic(b, [(order, tt([None], "i32"), amap(2, "d0"))],
                   [(empty(b, [None, kk], oel, [S]), tt([None, kk], oel), amap(2, "d0, d1"))], ["parallel", "parallel"],
                   body, [("%o32", "i32"), ("%out", oel)])


def _sort_slots(b: Body, ids_flat: str, S: str, e: int) -> dict[str, str]:
    """Device-side grouping of slots by expert in O(slots x (E + SORT_CHUNK)) work; returns the SSA names of
    the small index tensors.

    A slot's *bucket* is its expert id, or ``e`` for an id outside [0, e) (a slot with no expert: sorted
    after every valid slot, never computed). The slots are cut into chunks of ``SORT_CHUNK``:
    ``chunk_counts[c, b]`` (slots of chunk c in bucket b), an exclusive scan of it over the chunks
    (``iree_linalg_ext.scan``), the bucket totals and their prefix sum ``offsets``, and each slot's rank among
    the earlier slots of its chunk in its bucket give ``pos[s] = offsets[b] + prefix[c, b] + rank`` (a stable
    counting sort); ``order`` is its inverse, written with ``iree_linalg_ext.scatter``. (The previous form
    compared every pair of slots: O(slots^2), 0.1 s at 8192 slots and minutes at a million.)
    """
    C, nb = SORT_CHUNK, e + 1
    vec, evec, bvec = tt([None], "i32"), tt([e], "i32"), tt([nb], "i32")
    ct = tt([None, nb], "i32")
    # bucket of each slot, padded to whole chunks with e + 1 (a bucket no slot has)
    bk = generic(b, [(ids_flat, vec, amap(1, "d0"))], [(empty(b, [None], "i32", [S]), vec, amap(1, "d0"))],
                 ["parallel"], [f"%ke = arith.constant {e} : i32", "%ok = arith.cmpi ult, %v, %ke : i32",
                                "%r = arith.select %ok, %v, %ke : i32", "linalg.yield %r : i32"],
                 [("%v", "i32"), ("%o", "i32")])
    cm1 = b.const(C - 1, "index")
    nch = b.v(f"arith.divui {b.v(f'arith.addi {S}, {cm1} : index', 'n')}, {b.const(C, 'index')} : index", "nch")
    padded = b.v(f"arith.muli {nch}, {b.const(C, 'index')} : index", "np")
    high = b.v(f"arith.subi {padded}, {S} : index", "hi")
    bkp = b.v(f"tensor.pad {bk} low[0] high[{high}] {{\n  ^bb0(%pi: index):\n    tensor.yield {b.const(e + 1, 'i32')} : i32\n  }} : "
              f"{vec} to {vec}", "bkp")
    bk2t = tt([None, C], "i32")
    bk2 = b.v(f"tensor.expand_shape {bkp} [[0, 1]] output_shape [{nch}, {C}] : {vec} into {bk2t}", "bk")
    # chunk_counts[c, b] = #{i : bk2[c, i] == b}
    counts_c = generic(b, [(bk2, bk2t, amap(3, "d0, d2"))], [(filled(b, [None, nb], "i32", [nch], "0"), ct, amap(3, "d0, d1"))],
                       ["parallel", "parallel", "reduction"],
                       ["%ib = linalg.index 1 : index", "%bi = arith.index_cast %ib : index to i32",
                        "%hit = arith.cmpi eq, %v, %bi : i32", "%ci = arith.extui %hit : i1 to i32",
                        "%r = arith.addi %o, %ci : i32", "linalg.yield %r : i32"], [("%v", "i32"), ("%o", "i32")])
    # prefix[c, b] = sum of chunk_counts[c' < c, b]
    z = b.const(0, "i32")
    acc = b.v(f"linalg.fill ins({z} : i32) outs({empty(b, [nb], 'i32', [])} : {bvec}) -> {bvec}", "f")
    scan = b.v(f"iree_linalg_ext.scan dimension(0) inclusive(false) ins({counts_c} : {ct}) "
               f"outs({empty(b, [None, nb], 'i32', [nch])}, {acc} : {ct}, {bvec}) {{\n  ^bb0(%sa: i32, %sb: i32):\n"
               f"    %ss = arith.addi %sa, %sb : i32\n    iree_linalg_ext.yield %ss : i32\n  }} -> {ct}, {bvec}", "scan", nres=2)
    prefix = scan + "#0"
    # bucket totals, and offsets[b] = the totals of the buckets below b
    totals = generic(b, [(counts_c, ct, amap(2, "d1, d0"))], [(filled(b, [nb], "i32", [], "0"), bvec, amap(2, "d0"))],
                     ["parallel", "reduction"], ["%r = arith.addi %o, %v : i32", "linalg.yield %r : i32"],
                     [("%v", "i32"), ("%o", "i32")])
    offs = generic(b, [(totals, bvec, amap(2, "d1"))], [(filled(b, [nb], "i32", [], "0"), bvec, amap(2, "d0"))],
                   ["parallel", "reduction"],
                   ["%ia = linalg.index 0 : index", "%ib = linalg.index 1 : index", "%below = arith.cmpi ult, %ib, %ia : index",
                    "%z = arith.constant 0 : i32", "%cv = arith.select %below, %c, %z : i32",
                    "%r = arith.addi %o, %cv : i32", "linalg.yield %r : i32"], [("%c", "i32"), ("%o", "i32")])
    # rank[c, i] = #{j < i : bk2[c, j] == bk2[c, i]}
    rank = generic(b, [(bk2, bk2t, amap(3, "d0, d1")), (bk2, bk2t, amap(3, "d0, d2"))],
                   [(filled(b, [None, C], "i32", [nch], "0"), bk2t, amap(3, "d0, d1"))], ["parallel", "parallel", "reduction"],
                   ["%ii = linalg.index 1 : index", "%ij = linalg.index 2 : index", "%lt = arith.cmpi ult, %ij, %ii : index",
                    "%eq = arith.cmpi eq, %va, %vb : i32", "%hit = arith.andi %lt, %eq : i1", "%ci = arith.extui %hit : i1 to i32",
                    "%r = arith.addi %o, %ci : i32", "linalg.yield %r : i32"], [("%va", "i32"), ("%vb", "i32"), ("%o", "i32")])
    pos2 = generic(b, [(bk2, bk2t, amap(2, "d0, d1")), (rank, bk2t, amap(2, "d0, d1"))],
                   [(empty(b, [None, C], "i32", [nch]), bk2t, amap(2, "d0, d1"))], ["parallel", "parallel"],
                   ["%ic = linalg.index 0 : index", f"%ke = arith.constant {e} : i32", "%bc = arith.minui %v, %ke : i32",
                    "%bx = arith.index_cast %bc : i32 to index", f"%of = tensor.extract {offs}[%bx] : {bvec}",
                    f"%pf = tensor.extract {prefix}[%ic, %bx] : {ct}", "%a = arith.addi %of, %pf : i32",
                    "%r = arith.addi %a, %rk : i32", "linalg.yield %r : i32"], [("%v", "i32"), ("%rk", "i32"), ("%o", "i32")])
    posp = b.v(f"tensor.collapse_shape {pos2} [[0, 1]] : {bk2t} into {vec}", "pos")
    pos = b.v(f"tensor.extract_slice {posp}[0] [{S}] [1] : {vec} to {vec}", "pos")
    # order[pos[s]] = s
    iota = generic(b, [], [(empty(b, [None], "i32", [S]), vec, amap(1, "d0"))], ["parallel"],
                   ["%is = linalg.index 0 : index", "%r = arith.index_cast %is : index to i32", "linalg.yield %r : i32"],
                   [("%o", "i32")])
    idx = b.v(f"tensor.expand_shape {pos} [[0, 1]] output_shape [{S}, 1] : {vec} into {tt([None, 1], 'i32')}", "idx")
    order = b.v(f"iree_linalg_ext.scatter dimension_map = [0] unique_indices(true) ins({iota}, {idx} : {vec}, "
                f"{tt([None, 1], 'i32')}) outs({empty(b, [None], 'i32', [S])} : {vec}) {{\n  ^bb0(%sa: i32, %sb: i32):\n"
                f"    iree_linalg_ext.yield %sa : i32\n  }} -> {vec}", "order")
    counts = b.v(f"tensor.extract_slice {totals}[0] [{e}] [1] : {bvec} to {evec}", "cnt")
    offsets = b.v(f"tensor.extract_slice {offs}[0] [{e}] [1] : {bvec} to {evec}", "off")
    # uidx[e] = number of used experts below e
    uidx = generic(b, [(counts, evec, amap(2, "d1"))], [(filled(b, [e], "i32", [], "0"), evec, amap(2, "d0"))],
                   ["parallel", "reduction"],
                   ["%ia = linalg.index 0 : index", "%ib = linalg.index 1 : index", "%below = arith.cmpi ult, %ib, %ia : index",
                    "%z = arith.constant 0 : i32", "%one = arith.constant 1 : i32",
                    "%used = arith.cmpi sgt, %c, %z : i32", "%ub = arith.andi %below, %used : i1",
                    "%uv = arith.select %ub, %one, %z : i32", "%r = arith.addi %o, %uv : i32", "linalg.yield %r : i32"],
                   [("%c", "i32"), ("%o", "i32")])
    # used[u] = the u-th expert with a nonzero count; nused = their number
    used = generic(b, [(counts, evec, amap(2, "d1")), (uidx, evec, amap(2, "d1"))],
                   [(filled(b, [e], "i32", [], "0"), evec, amap(2, "d0"))], ["parallel", "reduction"],
                   ["%iu = linalg.index 0 : index", "%ie = linalg.index 1 : index",
                    "%u = arith.index_cast %iu : index to i32", "%ei = arith.index_cast %ie : index to i32",
                    "%z = arith.constant 0 : i32", "%nz = arith.cmpi sgt, %c, %z : i32", "%at = arith.cmpi eq, %ux, %u : i32",
                    "%hit = arith.andi %nz, %at : i1", "%v = arith.select %hit, %ei, %z : i32",
                    "%r = arith.addi %o, %v : i32", "linalg.yield %r : i32"],
                   [("%c", "i32"), ("%ux", "i32"), ("%o", "i32")])
    nused = generic(b, [(counts, evec, amap(1, "d0"))], [(filled(b, [], "i32", [], "0"), tt([], "i32"), amap(1, ""))],
                    ["reduction"],
                    ["%z = arith.constant 0 : i32", "%nz = arith.cmpi sgt, %c, %z : i32", "%ci = arith.extui %nz : i1 to i32",
                     "%r = arith.addi %o, %ci : i32", "linalg.yield %r : i32"], [("%c", "i32"), ("%o", "i32")])
    # info[u] = used expert u's id | its offset << 16 | its row count << 40: the loop reads back one
    # i64 per expert instead of three i32 (each read back is a device round trip)
    info = generic(b, [(used, evec, amap(1, "d0"))], [(empty(b, [e], "i64", []), tt([e], "i64"), amap(1, "d0"))],
                   ["parallel"],
                   ["%ei = arith.index_cast %u : i32 to index",
                    f"%of = tensor.extract {offsets}[%ei] : {evec}", f"%ct = tensor.extract {counts}[%ei] : {evec}",
                    "%u64 = arith.extui %u : i32 to i64", "%o64 = arith.extui %of : i32 to i64", "%c64 = arith.extui %ct : i32 to i64",
                    "%k16 = arith.constant 16 : i64", "%k40 = arith.constant 40 : i64",
                    "%os = arith.shli %o64, %k16 : i64", "%cs = arith.shli %c64, %k40 : i64",
                    "%a = arith.ori %u64, %os : i64", "%r = arith.ori %a, %cs : i64", "linalg.yield %r : i64"],
                   [("%u", "i32"), ("%o", "i64")])
    return {"pos": pos, "order": order, "counts": counts, "offsets": offsets, "used": used, "nused": nused,
            "info": info}


def _slots(b: Body, k: int, e: int, T: str) -> tuple[str, str]:
    """S = T*k and the slots' expert ids ``%ids`` flattened to [S]."""
    if e > 0xFFFF:
        raise ValueError(f"cpu grouped matmul: {e} experts do not fit the 16-bit expert field of the packed expert table")
    S = b.v(f"arith.muli {T}, {b.const(k, 'index')} : index", "S")
    ids_flat = b.v(f"tensor.collapse_shape %ids [[0, 1]] : {tt([None, k], 'i32')} into {tt([None], 'i32')}", "idf")
    return S, ids_flat


def _slots_sorted(b: Body, k: int, e: int, T: str) -> tuple[str, dict[str, str]]:
    """S = T*k and the slot sort of ``%ids``."""
    S, ids_flat = _slots(b, k, e, T)
    return S, _sort_slots(b, ids_flat, S, e)


def grouped_matmul_ukernel(b: Body, x: str, xt, k: int, e: int, n: int, kk: int, bias: tuple[str, str] | None,
                           T: str, exes: tuple[str, str], form: int = 0,
                           glu: tuple[str, float, float] | None = None) -> str:
    """Result ``ys`` [T*k, n] f32 by slot (bias added) from two dispatches of the C microkernels; with ``glu``
    (the matvec executable's GLU epilogue: :func:`cpu_ukernel.executable_text`) the GLU of it, [T*k, n / 2] of
    the activation type.

    ``exes``: the quantizer's and the matvec's ``stream.executable`` (:func:`cpu_ukernel.quantize_executable_text`
    with div = k for a rank-2 ``x``, 1 for a rank-3 one; :func:`cpu_ukernel.executable_text`). Every used
    expert runs in one dispatch at any token count (3-4x faster than the expert loop, 1 to 2048 tokens;
    docs/cpu.md). Expects ``%ids``, ``%w``, ``%s`` (and the bias value named in ``bias``) in scope. ``form``: the
    activation form (:data:`cpu_ukernel.PLANES`, :data:`cpu_ukernel.BF16_ROWS16`; 0: the blocksplit layout's).
    """
    S, ids_flat = _slots(b, k, e, T)
    order, info, counts, ni = cpu_ukernel.group_dispatch(b, exes[0], ids_flat, e, S, form)
    xel = str(xt.element_type)
    if xt.rank == 2:
        rows, R = x, T
    else:
        rows, R = b.v(f"tensor.collapse_shape {x} [[0, 1], [2]] : {xt} into {tt([None, kk], xel)}", "xf"), S
    xq, xsc = cpu_ukernel.quantize_dispatch(b, exes[1], rows, xel, R, order, counts, S, kk, form, (info, ni))
    return cpu_ukernel.matvec_dispatch(b, exes[2], xq, xsc, e, n, kk, bias, info, ni, counts, order, S, form, glu,
                                       xel)


def grouped_matmul_rows(b: Body, x: str, xt, k: int, e: int, n: int, kk: int, bias: tuple[str, str] | None,
                        T: str) -> tuple[str, str]:
    """Sorted-order result ``ys`` [T*k, n] f32 (bias added) and ``pos`` [T*k] i32 (slot -> sorted row),
    through the linalg schedule (the loop over used experts).

    Expects ``%ids``, ``%w``, ``%s`` (and the bias value named in ``bias``) in scope.
    """
    xel = str(xt.element_type)
    c0, c1 = b.const(0, "index"), b.const(1, "index")
    S, srt = _slots_sorted(b, k, e, T)
    # Activations in expert order: f32 rows for the matvec (it reads each activation once per output row)
    # and, with the integer decode, for the contraction too; storage order for scaling_extf's contraction;
    # rows in the input type only where a kernel still reads them (f32 inputs: the same rows for all).
    rows_f32 = xel != "f32" and MATVEC_F32_ROWS
    mm_f32 = rows_f32 and MATMUL_F32_ROWS and DECODE_FOR_MATMUL == "int"
    xs_f32 = _gather_rows(b, x, xt, srt["order"], k, kk, S, storage_order=False, f32=True) if rows_f32 else None
    need_plain = not rows_f32 or (DECODE_FOR_MATMUL == "int" and not mm_f32)
    xs = _gather_rows(b, x, xt, srt["order"], k, kk, S, storage_order=False) if need_plain else None
    xs_dec = _gather_rows(b, x, xt, srt["order"], k, kk, S, storage_order=True) \
        if DECODE_FOR_MATMUL == "scaling_extf" else None
    mv_rows = (xs_f32, "f32") if rows_f32 else (xs, xel)
    mm_rows = (xs_dec, xel) if xs_dec is not None else (xs_f32, "f32") if mm_f32 else (xs, xel)
    ys0 = empty(b, [None, n], "f32", [S])
    ys_t = tt([None, n], "f32")
    evec = tt([e], "i32")

    def expert_step(lb: Body, acc_in: str, packed: str | None, ui: str) -> str:
        """One used expert's rows: ``acc_in`` with rows [off, off + cnt) replaced by the expert's results."""
        acc = lb.v(f"flow.tensor.tie_shape {acc_in} : {ys_t}{{{S}}}", "acc")

        def load(table: str, at: str, prefix: str) -> str:
            v32 = lb.v(f"tensor.extract {srt[table]}[{at}] : {evec}", prefix)
            return lb.v(f"arith.index_cast {v32} : i32 to index", prefix)

        def field(shift: int, mask: int, prefix: str) -> str:
            v = lb.v(f"arith.shrui {packed}, {lb.const(shift, 'i64')} : i64", prefix) if shift else packed
            if mask:
                v = lb.v(f"arith.andi {v}, {lb.const(mask, 'i64')} : i64", prefix)
            return lb.v(f"arith.index_cast {v} : i64 to index", prefix)

        if packed is not None:
            eid, off, cnt = field(0, 0xFFFF, "e"), field(16, 0xFFFFFF, "o"), field(40, 0, "n")
        else:
            eid = load("used", ui, "e")
            off, cnt = load("offsets", eid, "o"), load("counts", eid, "n")
        def rows(src: tuple[str, str], prefix: str) -> tuple[str, str]:
            t = tt([None, kk], src[1])
            return lb.v(f"tensor.extract_slice {src[0]}[{off}, 0] [{cnt}, {kk}] [1, 1] : {t} to {t}", prefix), src[1]

        xe_mv = rows(mv_rows, "xm")
        xe_mm = xe_mv if mm_rows == mv_rows else rows(mm_rows, "xd")
        we = lb.v(f"tensor.extract_slice %w[{eid}, 0, 0] [1, {n}, {kk // 2}] [1, 1, 1] : {tt([e, n, kk // 2], 'i8')} to "
                  f"{tt([n, kk // 2], 'i8')}", "we")
        se = lb.v(f"tensor.extract_slice %s[{eid}, 0, 0] [1, {n}, {kk // 32}] [1, 1, 1] : {tt([e, n, kk // 32], 'i8')} to "
                  f"{tt([n, kk // 32], 'i8')}", "se")
        # init rows: the expert's bias (in f32) or zero
        if bias is not None:
            bname, bel = bias
            be = lb.v(f"tensor.extract_slice {bname}[{eid}, 0] [1, {n}] [1, 1] : {tt([e, n], bel)} to {tt([n], bel)}", "be")
            init = generic(lb, [(be, tt([n], bel), amap(2, "d1"))], [(empty(lb, [None, n], "f32", [cnt]), ys_t, amap(2, "d0, d1"))],
                           ["parallel", "parallel"], to_f32_lines("%bv", bel, "%r") + ["linalg.yield %r : f32"],
                           [("%bv", bel), ("%o", "f32")])
        else:
            init = filled(lb, [None, n], "f32", [cnt], "0.0")
        small = lb.v(f"arith.cmpi ule, {cnt}, {lb.const(SMALL_ROWS, 'index')} : index", "small")
        ye = scf_if(lb, small, ys_t,
                    lambda tb: tb.v(f"flow.tensor.tie_shape {_lane_matvec(tb, *xe_mv, we, se, init, cnt, n, kk)} : "
                                    f"{ys_t}{{{cnt}}}", "r"),
                    lambda eb: eb.v(f"flow.tensor.tie_shape {_decoded_matmul(eb, *xe_mm, we, se, init, cnt, n, kk)} : "
                                    f"{ys_t}{{{cnt}}}", "r"), "ye")
        ye = lb.v(f"flow.tensor.tie_shape {ye} : {ys_t}{{{cnt}}}", "ye")
        ins = lb.v(f"tensor.insert_slice {ye} into {acc}[{off}, 0] [{cnt}, {n}] [1, 1] : {ys_t} into {ys_t}", "ins")
        return lb.v(f"flow.tensor.tie_shape {ins} : {ys_t}{{{S}}}", "ins")

    def loop_form(fb: Body, readback: str) -> str:
        """scf.for over the used experts. ``readback``: "all" reads every expert's packed (id, offset, rows)
        back before the loop (one wait) and each iteration picks its entry on the host, so the host never
        waits on the device between experts; "packed" ("separate") reads one i64 (three dependent i32) back
        per iteration."""
        nu32 = fb.v(f"tensor.extract {srt['nused']}[] : {tt([], 'i32')}", "nu")  # a read back
        nu = fb.v(f"arith.index_cast {nu32} : i32 to index", "nu")
        if readback == "all":  # used experts come first in info: the first READBACK_ENTRIES of them
            packs = [fb.v(f"tensor.extract {srt['info']}[{fb.const(u, 'index')}] : {tt([e], 'i64')}", "pk")
                     for u in range(min(e, READBACK_ENTRIES))]
        lb = Body()
        lb.n = fb.n
        if readback == "all":
            def pick(sb: Body) -> str:
                cases = "".join(f"\n    case {u} {{\n      scf.yield {packs[u]} : i64\n    }}" for u in range(1, len(packs)))
                return sb.v(f"scf.index_switch %ui -> i64{cases}\n    default {{\n      scf.yield {packs[0]} : i64\n    }}",
                            "pk")

            if len(packs) == e:
                packed = pick(lb)
            else:  # later used experts (E > READBACK_ENTRIES) are read back in their iteration
                early = lb.v(f"arith.cmpi ult, %ui, {lb.const(len(packs), 'index')} : index", "early")
                packed = scf_if(lb, early, "i64", pick,
                                lambda eb: eb.v(f"tensor.extract {srt['info']}[%ui] : {tt([e], 'i64')}", "pk"), "pk")
        elif readback == "packed":
            packed = lb.v(f"tensor.extract {srt['info']}[%ui] : {tt([e], 'i64')}", "pk")
        else:
            packed = None
        step = expert_step(lb, "%ys_acc", packed, "%ui")
        fb.n = lb.n
        ys = fb.v(f"scf.for %ui = {c0} to {nu} step {c1} iter_args(%ys_acc = {ys0}) -> ({ys_t}) {{\n    "
                  + "\n    ".join(lb.lines) + f"\n    scf.yield {step} : {ys_t}\n  }}", "ys")
        return fb.v(f"flow.tensor.tie_shape {ys} : {ys_t}{{{S}}}", "ys")

    if READBACK_ALL_SLOTS:
        # Only while no expert can have more than SMALL_ROWS rows (an expert gets at most one row per
        # token): queueing every expert's work at once with the decode-once kernel's large transients is
        # what makes local-task keep memory (docs/cpu.md).
        few_slots = b.v(f"arith.cmpi ule, {S}, {b.const(READBACK_ALL_SLOTS, 'index')} : index", "few")
        few_rows = b.v(f"arith.cmpi ule, {T}, {b.const(SMALL_ROWS, 'index')} : index", "few")
        few = b.v(f"arith.andi {few_slots}, {few_rows} : i1", "few")
        ys = scf_if(b, few, ys_t, lambda tb: loop_form(tb, "all"), lambda eb: loop_form(eb, LOOP_READBACK), "ys")
    else:
        ys = loop_form(b, LOOP_READBACK)
    ys = b.v(f"flow.tensor.tie_shape {ys} : {ys_t}{{{S}}}", "ys")
    # a slot with no expert (id outside [0, e)) has no row in ys: -1 tells unsort_rounded to write zeros
    vec = tt([None], "i32")
    ids_flat = b.v(f"tensor.collapse_shape %ids [[0, 1]] : {tt([None, k], 'i32')} into {vec}", "idf")
    pos = generic(b, [(srt["pos"], vec, amap(1, "d0")), (ids_flat, vec, amap(1, "d0"))],
                  [(empty(b, [None], "i32", [S]), vec, amap(1, "d0"))], ["parallel"],
                  [f"%ke = arith.constant {e} : i32", "%ok = arith.cmpi ult, %id, %ke : i32", "%m1 = arith.constant -1 : i32",
                   "%r = arith.select %ok, %p, %m1 : i32", "linalg.yield %r : i32"], [("%p", "i32"), ("%id", "i32"), ("%o", "i32")])
    return ys, pos


def unsort_rounded(b: Body, ys: str, pos: str, k: int, n: int, el: str, T: str) -> str:
    """[T, k, n] ``el`` = ys[pos[t*k + j]] rounded to ``el`` (the reference's rounding point); zeros where
    ``pos`` is -1 (a slot with no expert)."""
    pos2 = b.v(f"tensor.expand_shape {pos} [[0, 1]] output_shape [{T}, {k}] : {tt([None], 'i32')} into {tt([None, k], 'i32')}", "pos")
    body = ["%z = arith.constant 0 : i32", "%ok = arith.cmpi sge, %p, %z : i32", "%p0 = arith.maxsi %p, %z : i32",
            "%row = arith.index_cast %p0 : i32 to index", "%col = linalg.index 2 : index",
            f"%y = tensor.extract {ys}[%row, %col] : {tt([None, n], 'f32')}"]
    body += ([f"%r0 = arith.truncf %y : f32 to {el}"] if el != "f32" else ["%r0 = arith.maximumf %y, %y : f32"])
    body += [f"%zero = arith.constant 0.0 : {el}", f"%r = arith.select %ok, %r0, %zero : {el}", f"linalg.yield %r : {el}"]
    return generic(b, [(pos2, tt([None, k], "i32"), amap(3, "d0, d1"))],
                   [(empty(b, [None, k, n], el, [T]), tt([None, k, n], el), amap(3, "d0, d1, d2"))],
                   ["parallel"] * 3, body, [("%p", "i32"), ("%o", el)])
