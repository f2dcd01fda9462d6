/* mxmoe CPU microkernels, int8-activation forms (included by mxfp4_matvec.c, which defines MEMREF, AT, the
 * element kinds, item_t / store / out_col and load_block): the opt-in activations="mxint8" and "mxint16" of
 * the cpu target.
 *
 * Activations (mxmoe_mxint8_quantize_rows): OCP MXINT8 per 32-value block.  E = the binary exponent of the
 * block's largest magnitude (floor(log2 amax), clamped to [-100, 127] like the int16 path), the element
 * q = round(x * 2^(6 - E)) to nearest even, saturated to [-127, 127] (so the value is q x 2^(E - 6): the
 * OCP scale 2^E with int8 elements of 2^-6 units; the largest magnitude lands in [64, 127], a value at or
 * above 127.5 x 2^(E - 6) saturates to 127, and -128 is never produced).  Stored: xq [S, k] int8 in natural
 * order, xs [S, 2 nb]: xs[b] = 2^(E - 7) (the block scale over 2: the decode yields 2 x the e2m1 value),
 * and at xs[nb + b] the int32 -12 x sum(q) of the block (the offset correction below).  A block holding an
 * inf or NaN gets q = 0, correction 0 and a NaN scale (its outputs are NaN).
 *
 * Weights: the cpu-mxfp4-rows16 layout (mxmoe.core.swizzle.rows16_swizzle).  Each expert's rows go in
 * groups of 16 (n is a multiple of 16: the cpu target pads it to 32); per group and 32-value block, 256
 * bytes in 4 chunks j of 64 bytes; in chunk j, bytes 4i..4i+3 belong to row i of the group: their low
 * nibbles are its values 4j..4j+3 of the block, their high nibbles its values 16+4j..16+4j+3.  The scales
 * go the same way: per group and block, the 16 rows' e8m0 bytes side by side.  So one 64-byte load,
 * split into nibble planes and looked up (vpshufb) in a table of 2 x e2m1 + 12 (0..24, unsigned), is
 * the u8 operand of two vpdpbusd whose s8 operand is 4 activations broadcast to the 16 int32 lanes: lane
 * i accumulates row i.  A block is 8 vpdpbusd into one int32 register started at the correction
 * -12 x sum(q), which takes the +12 offset back: the register holds sum(2 w q) exactly (|.| <= 32 x 12 x
 * 127 < 2^24, so its f32 conversion is exact too), and it is scaled once, by (weight scale x activation
 * scale), into an f32 accumulator with one FMA (the scale product by vmulps, or in the GEMM passes by adding
 * the two powers of two's bits where that gives the same bits: R16_SCALE_1, r16_fast).  Only the f32
 * accumulation over blocks rounds, in block order for every row, whatever the number of rows computed
 * together (batch invariant).
 *
 * The two-plane form (activations="mxint16", mx_row with planes 2): each activation row as two int8 rows, hi and
 * lo of a 15-bit element, with their own scales and corrections; the same passes compute both planes of a row
 * and join each block's two sums exactly in int32 (hi << 8 + lo) before its one convert and FMA (R16_ROWS).
 *
 * Flavors: AVX-512 with VNNI (zmm, vpdpbusd: 16 rows per register) and AVX2 (the same bytes, two ymm
 * halves of 8 rows, vpmaddubsw + vpmaddwd: the u8 x s8 products of a lane pair are <= 6096, four of them
 * summed in int16 <= 24384, no saturation).
 */

/* 2 x the e2m1 value of the codes 0..15, plus 12: an unsigned byte 0..24 */
#define E2M1_X2_U8 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
#define R16_OFFSET 12

typedef int32_t __attribute__((may_alias, aligned(1))) i32u_t;

/* bytes ahead of the weights being read that the matmul prefetches (one cache line per 64-byte chunk).
 * Single-thread harness (benchmarks/cpu_rows16.c), weights streamed from DRAM (Zen 4), 1 / 2 / 3 rows: 21.4 / 16.7 /
 * 12.4 GB/s without, 27.6-28.2 / 22.4-23.2 / 17.8-18.2 at 4096 (2048: 25-26 / 21 / 17-18; 8192: 26.7 / 22.0 /
 * 17.0); in L2 no change.  Into L2 (T1), not L1: on a Xeon with AMX (2 threads, gpt-oss-20b, mxint8, 2026-11-29)
 * 8-12 / 10-12 / 10-14% faster at 1 (weights from DRAM) / 4 / 8 tokens, level at 64; one thread from true DRAM
 * 11.6-11.8 against 10.0-10.7 GB/s at 1 row; the distance (2-16 KB) changed nothing there.  (AMD's cores are
 * documented to treat the hints alike.) */
#ifndef R16_PREFETCH
#define R16_PREFETCH 4096
#endif
#ifndef R16_PREFETCH_HINT
#define R16_PREFETCH_HINT _MM_HINT_T1
#endif

/* the f32 words of a quantized row: nb scales, then nb int32 corrections */
static inline size_t mxint8_xs_row(size_t nb) { return 2 * nb; }

/* 8 int32 -> 8 int8 are done 32 at a time: q0..q3 (8 each, values in [-127, 127]) -> 32 bytes in order */
static inline __m256i pack32_epi8(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* the sum of 8 int32 lanes */
static inline int32_t hsum8_epi32(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

/* One row of k activations (kind) -> `planes` int8 rows (natural order, k apart) and their xs words (2 nb
 * apart).  planes 1: MXINT8.  planes 2 (activations="mxint16"): q = round(x * 2^(13 - E)), |q| <= 2^14 (no
 * saturation: |x| < 2^(E + 1)), split exactly as q = 256 hi + lo with hi = (q + 128) >> 8 in [-64, 64] and lo in
 * [-128, 127]; plane 0 holds hi with the scale 2^(E - 6) (over 2, as above), plane 1 lo with 2^(E - 14). */
static void mx_row(const void *x, size_t kind, size_t k, size_t planes, int8_t *xq, float *xs) {
  const size_t nb = k / 32;
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127), half = _mm256_set1_epi32(128);
  const int shift = planes == 1 ? 6 : 13;
  for (size_t b = 0; b < nb; ++b) {
    __m256 v[4];
    int finite;
    const int32_t e = load_block(x, kind, b, v, &finite);
    union { uint32_t u; float f; } up = {(uint32_t)(shift - e + 127) << 23};
    __m256i q[2][4], sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 4; ++j) {
      /* round to nearest even (the MXCSR default) */
      const __m256i t = finite ? _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(up.f))) : _mm256_setzero_si256();
      if (planes == 1) {
        q[0][j] = _mm256_min_epi32(_mm256_max_epi32(t, lo), hi); /* saturate to +-127 */
      } else {
        q[0][j] = _mm256_srai_epi32(_mm256_add_epi32(t, half), 8);
        q[1][j] = _mm256_sub_epi32(t, _mm256_slli_epi32(q[0][j], 8));
        sum[1] = _mm256_add_epi32(sum[1], q[1][j]);
      }
      sum[0] = _mm256_add_epi32(sum[0], q[0][j]);
    }
    for (size_t pl = 0; pl < planes; ++pl) {
      /* the plane's unit over 2: 2^(E - shift - 1), the hi plane of two 2^8 times that */
      union { uint32_t u; float f; } sc = {(uint32_t)(e - shift - 1 + 8 * (int)(planes - 1 - pl) + 127) << 23};
      float *xw = xs + pl * 2 * nb;
      _mm256_storeu_si256((__m256i *)(xq + pl * k + 32 * b), pack32_epi8(q[pl][0], q[pl][1], q[pl][2], q[pl][3]));
      if (!finite) sc.u = 0x7FC00000u;
      xw[b] = sc.f;
      ((int32_t *)(xw + nb))[b] = -R16_OFFSET * hsum8_epi32(sum[pl]);
    }
  }
}

/* x: rows of k activations of x_kind; sorted row p comes from row order[p] / div.  xq: [S, planes k] int8,
 * xs: [S, planes 2 nb] (see mx_row).  Workgroup wg quantizes sorted rows [wg * rows_per_wg, +rows_per_wg) of
 * the first counts[1] (the valid slots, mxmoe_group_slots). */
static void mx_quantize_rows(const void *x, const int32_t *order, const int32_t *counts, int8_t *xq, float *xs,
                             size_t k, size_t div, size_t x_kind, size_t rows_per_wg, size_t wg, size_t planes) {
  const size_t nb = k / 32, esize = kind_size(x_kind), rows = (size_t)counts[1];
  const size_t p1 = (wg + 1) * rows_per_wg < rows ? (wg + 1) * rows_per_wg : rows;
  for (size_t p = wg * rows_per_wg; p < p1; ++p) {
    const char *src = (const char *)x + (size_t)order[p] / div * k * esize;
    mx_row(src, x_kind, k, planes, xq + p * planes * k, xs + p * planes * mxint8_xs_row(nb));
  }
}

/* the quantizers' entry points: MXINT8 rows, and two-plane rows (activations="mxint16": xq [S, 2 k], xs [S, 4 nb]) */
#define MX_QUANTIZE_ENTRY(NAME, PLANES)                                                                          \
  void NAME(MEMREF(const void, x), MEMREF(const int32_t, order), MEMREF(const int32_t, counts), MEMREF(int8_t, xq), \
            MEMREF(float, xs), size_t k, size_t div, size_t x_kind, size_t rows_per_wg, size_t wg) {                \
    mx_quantize_rows(AT(x), AT(order), AT(counts), AT(xq), AT(xs), k, div, x_kind, rows_per_wg, wg, PLANES);      \
  }
MX_QUANTIZE_ENTRY(mxmoe_mxint8_quantize_rows, 1)
MX_QUANTIZE_ENTRY(mxmoe_mxint16_quantize_rows, 2)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define MXMOE_VNNI 1
/* the most activation rows one pass over a weight group holds (the GEMM form).  Single-thread harness, G op/s:
 * main's 8-row passes (rows one after another, vmulps scales) 331-333 in L2 at 8-64 rows; this kernel built with
 * passes of 8 / 16 at 12 / 16 / 24 / 64 rows: L2 349-357 / 369-374, weights from DRAM 304-345 / 345-357
 * (2026-11-27, docs/cpu.md "The int8 form"). */
#define R16_MAX_ROWS 16
/* the most int8 rows of a pass in the two-plane form (12 activation rows): its rows joined in pairs need half the
 * f32 accumulators, so a pass holds more */
#define R16_MAX_ROWS2 24
/* the rows whose 8-deep vpdpbusd chains run interleaved (the chain of one row alone waits on vpdpbusd's latency;
 * 8 chains + 8 decoded registers + their f32 accumulators fit the 32 zmm) */
#define R16_IL 8
/* the fewest rows of a work item that use the exponent-add scale form (item_rows16) */
#define R16_FAST_ROWS 4

/* The block's scale product ws x xs for one row, two ways giving the same bits.  Slow: vmulps.  Fast: both
 * are powers of two, so their product's bits are the sum of their bits less 127 << 23, exact where ws is
 * normal (its byte >= 1) and the product is normal (1 <= its exponent field <= 254; xs is never subnormal
 * nor NaN there): r16_fast says where.  On Zen 4 vmulps (and vfmadd) share vpdpbusd's two pipes, vpaddd does
 * not (a loop of 12 vpdpbusd + 4 vmulps: 352 G op/s of vpdpbusd; + 4 vpaddd: 470, the peak). */
#define R16_SCALE_0(ws, xsw) _mm512_mul_ps(ws, _mm512_set1_ps(*(xsw)))
#define R16_SCALE_1(ws, xsw)                          \
  _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(ws), \
                                       _mm512_set1_epi32(*(const i32u_t *)(xsw) - (127 << 23))))

/* R activation rows (int8 at x, stride xrow; xs words at xsv, stride xsrow) against one group of 16 weight
 * rows (wg: nb x 256 bytes, sg: nb x 16 scale bytes): res[r] lane i = row i's dot product with row r.
 * Every loaded and decoded block meets the R rows in registers, R16_IL rows at a time.  P = 2 (the two-plane
 * form): rows 2q and 2q + 1 are the hi and lo planes of one activation row, whose block sums are joined exactly
 * in int32 (hi << 8 + lo: |sum| <= 2^23, exact in f32 too) and take one convert and one FMA by the lo plane's
 * scale (the hi plane's is 2^8 times it): res[q] is that row's result. */
#define R16_ROWS(R, FAST, P)                                                                               \
  static void r16_rows_##R##_##FAST##_##P(const uint8_t *wg, const uint8_t *sg, size_t nb, const int8_t *x,   \
                                    size_t xrow, const float *xsv, size_t xsrow, __m512 *res) {          \
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(E2M1_X2_U8)), low4 = _mm512_set1_epi8(0x0F); \
    for (int r = 0; r < R / P; ++r) res[r] = _mm512_setzero_ps();                                      \
    for (size_t b = 0; b < nb; ++b) {                                                                  \
      const __m512i sb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sg + 16 * b)));        \
      const __m512 ws = _mm512_castsi512_ps(_mm512_mask_mov_epi32(                                     \
          _mm512_slli_epi32(sb, 23), _mm512_cmpeq_epi32_mask(sb, _mm512_setzero_si512()),              \
          _mm512_set1_epi32(0x00400000)));                                                             \
      __m512i d[8];                                                                                    \
      /* the next group's scales, which item_rows16 scans before its first pass */                     \
      if (R >= R16_FAST_ROWS && b % 4 == 0) _mm_prefetch((const char *)(sg + 16 * (nb + b)), _MM_HINT_T0); \
      for (int j = 0; j < 4; ++j) {                                                                    \
        _mm_prefetch((const char *)(wg + 256 * b + 64 * j + R16_PREFETCH), R16_PREFETCH_HINT);               \
        const __m512i raw = _mm512_loadu_si512((const void *)(wg + 256 * b + 64 * j));                 \
        d[2 * j] = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, low4));                              \
        d[2 * j + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));    \
      }                                                                                                \
      _Pragma("GCC unroll 16") for (int r0 = 0; r0 < R; r0 += R16_IL) {                                \
        const int r1 = r0 + R16_IL < R ? r0 + R16_IL : R;                                              \
        __m512i t[R16_IL];                                                                             \
        _Pragma("GCC unroll 16") for (int r = r0; r < r1; ++r)                                         \
          t[r - r0] = _mm512_set1_epi32(((const i32u_t *)(xsv + r * xsrow + nb))[b]);                  \
        /* value v of the block: d[v % 4 * 2 + v / 4], activations 4v..4v+3 */                         \
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; ++v)                                            \
          _Pragma("GCC unroll 16") for (int r = r0; r < r1; ++r)                                       \
            t[r - r0] = _mm512_dpbusd_epi32(t[r - r0], d[v % 4 * 2 + v / 4],                           \
                                            _mm512_set1_epi32(((const i32u_t *)(x + r * xrow + 32 * b))[v])); \
        _Pragma("GCC unroll 16") for (int r = r0 + P - 1; r < r1; r += P) {                            \
          const __m512i sum = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(t[r - 1 - r0], 8), t[r - r0]) : t[r - r0]; \
          res[r / P] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), R16_SCALE_##FAST(ws, xsv + r * xsrow + b), \
                                       res[r / P]);                                                    \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
  }
#define R16_ROWS_BOTH(R, P) R16_ROWS(R, 0, P) R16_ROWS(R, 1, P)
R16_ROWS_BOTH(1, 1) R16_ROWS_BOTH(2, 1) R16_ROWS_BOTH(3, 1) R16_ROWS_BOTH(4, 1) R16_ROWS_BOTH(5, 1)
R16_ROWS_BOTH(6, 1) R16_ROWS_BOTH(7, 1) R16_ROWS_BOTH(8, 1) R16_ROWS_BOTH(9, 1) R16_ROWS_BOTH(10, 1)
R16_ROWS_BOTH(11, 1) R16_ROWS_BOTH(12, 1) R16_ROWS_BOTH(13, 1) R16_ROWS_BOTH(14, 1) R16_ROWS_BOTH(15, 1)
R16_ROWS_BOTH(16, 1)
R16_ROWS_BOTH(2, 2) R16_ROWS_BOTH(4, 2) R16_ROWS_BOTH(6, 2) R16_ROWS_BOTH(8, 2) R16_ROWS_BOTH(10, 2)
R16_ROWS_BOTH(12, 2) R16_ROWS_BOTH(14, 2) R16_ROWS_BOTH(16, 2) R16_ROWS_BOTH(18, 2) R16_ROWS_BOTH(20, 2)
R16_ROWS_BOTH(22, 2) R16_ROWS_BOTH(24, 2)

/* A switch per scale form, not a table of pointers nor one switch of both forms: the passes inline, their
 * accumulators a local array the compiler keeps in registers (harness, L2, G op/s at 4 / 8 / 16 rows: 326 /
 * 366 / 369; one switch of both forms 320 / 366 / 364; pointers, accumulators through a pointer 312 / 339 /
 * 329). */
#define R16_CASE(R, FAST, P) \
  case R: r16_rows_##R##_##FAST##_##P(wg, sg, nb, x, xrow, xsv, xsrow, v); break;
#define R16_CASES_1(FAST)                                                                                        \
  R16_CASE(1, FAST, 1) R16_CASE(2, FAST, 1) R16_CASE(3, FAST, 1) R16_CASE(4, FAST, 1) R16_CASE(5, FAST, 1)       \
  R16_CASE(6, FAST, 1) R16_CASE(7, FAST, 1) R16_CASE(8, FAST, 1) R16_CASE(9, FAST, 1) R16_CASE(10, FAST, 1)      \
  R16_CASE(11, FAST, 1) R16_CASE(12, FAST, 1) R16_CASE(13, FAST, 1) R16_CASE(14, FAST, 1) R16_CASE(15, FAST, 1)  \
  default: R16_CASE(16, FAST, 1)
#define R16_CASES_2(FAST)                                                                                        \
  R16_CASE(2, FAST, 2) R16_CASE(4, FAST, 2) R16_CASE(6, FAST, 2) R16_CASE(8, FAST, 2) R16_CASE(10, FAST, 2)      \
  R16_CASE(12, FAST, 2) R16_CASE(14, FAST, 2) R16_CASE(16, FAST, 2) R16_CASE(18, FAST, 2) R16_CASE(20, FAST, 2)  \
  R16_CASE(22, FAST, 2) default: R16_CASE(24, FAST, 2)
#define R16_DISPATCH(FAST, P)                                                                                  \
  static __attribute__((noinline)) void r16_rows_form##FAST##_##P(size_t R, const uint8_t *wg, const uint8_t *sg, \
                                                                  size_t nb, const int8_t *x, size_t xrow,     \
                                                                  const float *xsv, size_t xsrow,              \
                                                                  float (*res)[16]) {                          \
    __m512 v[R16_MAX_ROWS];                                                                                    \
    switch (R) { R16_CASES_##P(FAST) }                                                                         \
    for (size_t r = 0; r < R / P; ++r) _mm512_storeu_ps(res[r], v[r]);                                        \
  }
R16_DISPATCH(0, 1) R16_DISPATCH(1, 1) R16_DISPATCH(0, 2) R16_DISPATCH(1, 2)

/* R int8 rows (R / planes activation rows) -> res[R / planes]: see R16_ROWS */
static void r16_rows(size_t R, size_t planes, int fast, const uint8_t *wg, const uint8_t *sg, size_t nb,
                     const int8_t *x, size_t xrow, const float *xsv, size_t xsrow, float (*res)[16]) {
  if (planes == 2) {
    if (fast) r16_rows_form1_2(R, wg, sg, nb, x, xrow, xsv, xsrow, res);
    else r16_rows_form0_2(R, wg, sg, nb, x, xrow, xsv, xsrow, res);
  } else {
    if (fast) r16_rows_form1_1(R, wg, sg, nb, x, xrow, xsv, xsrow, res);
    else r16_rows_form0_1(R, wg, sg, nb, x, xrow, xsv, xsrow, res);
  }
}

#else
#define MXMOE_VNNI 0
#define R16_MAX_ROWS 4
#define R16_MAX_ROWS2 4
#define R16_FAST_ROWS 4 /* unused: one scale form here */

/* the AVX2 form of R16_ROWS: each 64-byte chunk is two ymm of 8 rows; res[r] lanes 0..7 / 8..15 (P = 2: rows 2q,
 * 2q + 1 are a row's two planes, joined in int32 as in R16_ROWS; res[q] its result) */
#define R16_ROWS(R, P)                                                                                   \
  static void r16_rows_##R##_##P(const uint8_t *wg, const uint8_t *sg, size_t nb, const int8_t *x, size_t xrow, \
                           const float *xsv, size_t xsrow, __m256 *res) {                              \
    const __m256i lut = _mm256_setr_epi8(E2M1_X2_U8, E2M1_X2_U8), low4 = _mm256_set1_epi8(0x0F);       \
    const __m256i ones = _mm256_set1_epi16(1);                                                         \
    __m256 acc[2 * R / P];                                                                             \
    for (int r = 0; r < 2 * R / P; ++r) acc[r] = _mm256_setzero_ps();                                  \
    for (size_t b = 0; b < nb; ++b) {                                                                  \
      for (int h = 0; h < 2; ++h) {                                                                    \
        const __m256i sb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sg + 16 * b + 8 * h))); \
        const __m256i zero = _mm256_cmpeq_epi32(sb, _mm256_setzero_si256());                           \
        const __m256 ws = _mm256_castsi256_ps(_mm256_or_si256(                                         \
            _mm256_slli_epi32(sb, 23), _mm256_and_si256(zero, _mm256_set1_epi32(0x00400000))));        \
        __m256i d[8];                                                                                  \
        for (int j = 0; j < 4; ++j) {                                                                  \
          if (!h) _mm_prefetch((const char *)(wg + 256 * b + 64 * j + R16_PREFETCH), R16_PREFETCH_HINT);     \
          const __m256i raw = _mm256_loadu_si256((const __m256i *)(wg + 256 * b + 64 * j + 32 * h));   \
          d[2 * j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, low4));                            \
          d[2 * j + 1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));  \
        }                                                                                              \
        __m256i hi_plane = _mm256_setzero_si256();                                                     \
        for (int r = 0; r < R; ++r) {                                                                  \
          const i32u_t *xi = (const i32u_t *)(x + r * xrow + 32 * b);                                  \
          const float *xw = xsv + r * xsrow;                                                           \
          __m256i s[2];                                                                                \
          for (int q = 0; q < 2; ++q) /* chunks 2q, 2q + 1: four lane pairs summed in int16 */         \
            s[q] = _mm256_add_epi16(                                                                   \
                _mm256_add_epi16(_mm256_maddubs_epi16(d[4 * q], _mm256_set1_epi32(xi[2 * q])),         \
                                 _mm256_maddubs_epi16(d[4 * q + 1], _mm256_set1_epi32(xi[4 + 2 * q]))), \
                _mm256_add_epi16(_mm256_maddubs_epi16(d[4 * q + 2], _mm256_set1_epi32(xi[2 * q + 1])), \
                                 _mm256_maddubs_epi16(d[4 * q + 3], _mm256_set1_epi32(xi[5 + 2 * q])))); \
          __m256i t = _mm256_add_epi32(                                                                \
              _mm256_set1_epi32(((const i32u_t *)(xw + nb))[b]),                                       \
              _mm256_add_epi32(_mm256_madd_epi16(s[0], ones), _mm256_madd_epi16(s[1], ones)));         \
          if (P == 2 && r % 2 == 0) {                                                                  \
            hi_plane = t; /* joined with the next row, its lo plane */                                 \
            continue;                                                                                  \
          }                                                                                            \
          if (P == 2) t = _mm256_add_epi32(_mm256_slli_epi32(hi_plane, 8), t);                         \
          acc[2 * (r / P) + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),                                \
                                                 _mm256_mul_ps(ws, _mm256_set1_ps(xw[b])), acc[2 * (r / P) + h]); \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    for (int r = 0; r < 2 * R / P; ++r) res[r] = acc[r];                                               \
  }
R16_ROWS(1, 1) R16_ROWS(2, 1) R16_ROWS(3, 1) R16_ROWS(4, 1) R16_ROWS(2, 2) R16_ROWS(4, 2)

/* R int8 rows (R / planes activation rows) -> res[R / planes] */
static void r16_rows(size_t R, size_t planes, int fast, const uint8_t *wg, const uint8_t *sg, size_t nb,
                     const int8_t *x, size_t xrow, const float *xsv, size_t xsrow, float (*res)[16]) {
  (void)fast; /* one scale form (vmulps) in this flavor: the exponent add was not tried here */
  __m256 v[2 * R16_MAX_ROWS];
  if (planes == 2) {
    if (R == 2) r16_rows_2_2(wg, sg, nb, x, xrow, xsv, xsrow, v);
    else r16_rows_4_2(wg, sg, nb, x, xrow, xsv, xsrow, v);
  } else {
    switch (R) {
      case 1: r16_rows_1_1(wg, sg, nb, x, xrow, xsv, xsrow, v); break;
      case 2: r16_rows_2_1(wg, sg, nb, x, xrow, xsv, xsrow, v); break;
      case 3: r16_rows_3_1(wg, sg, nb, x, xrow, xsv, xsrow, v); break;
      default: r16_rows_4_1(wg, sg, nb, x, xrow, xsv, xsrow, v); break;
    }
  }
  for (size_t r = 0; r < R / planes; ++r) {
    _mm256_storeu_ps(res[r], v[2 * r]);
    _mm256_storeu_ps(res[r] + 8, v[2 * r + 1]);
  }
}
#endif

/* Row r's outputs o0..o0+15 (res, plus bias) to its slot, as write_tile would put them: 16 contiguous columns,
 * or with deinterleave the 8 even outputs at o0 / 2.. and the 8 odd ones at n / 2 + o0 / 2.. (n and o0 are
 * multiples of 16), or with the GLU epilogue the GLU of the 8 (even, odd) pairs at o0 / 2.. of an n / 2-wide row.
 * Plain loops the compiler vectorizes, the bias converted once per group: in place of a store per value (its
 * bias-kind switch and column arithmetic each time), +1-2% at 8-64 rows in the harness without bias. */
static inline void store16(const item_t *it, size_t o0, const float *bias, size_t r, const float *res) {
  if (it->glu.act != GLU_NONE) {
    float gate[8], up[8], gb[8], ub[8];
    for (size_t i = 0; i < 8; ++i) {
      gate[i] = res[2 * i];
      up[i] = res[2 * i + 1];
      gb[i] = bias[2 * i];
      ub[i] = bias[2 * i + 1];
    }
    glu_row(&it->glu, gate, up, gb, ub, 8, glu_out(it, r, o0 / 2));
    return;
  }
  float *row = (float *)it->out + (size_t)it->slot[r] * it->n;
  if (!it->deinterleave) {
    for (size_t o = 0; o < 16; ++o) row[o0 + o] = res[o] + bias[o];
    return;
  }
  float *even = row + o0 / 2, *odd = row + it->n / 2 + o0 / 2;
  for (size_t i = 0; i < 8; ++i) {
    even[i] = res[2 * i] + bias[2 * i];
    odd[i] = res[2 * i + 1] + bias[2 * i + 1];
  }
}

/* Whether R16_SCALE_1 (exponent add) gives the bits of vmulps for every scale pair of a group and the item's
 * rows: the weight scale bytes in [wlo, whi] and the activation scales' exponent fields in [xlo, xhi] (a NaN
 * scale has 255).  ws = 2^(byte - 127) is normal from byte 1 on, xs = 2^(field - 127), the product's field is
 * byte + field - 127. */
static inline int r16_fast(int wlo, int whi, int xlo, int xhi) {
#ifdef MXMOE_R16_SLOW_ONLY /* the tests' build that checks both forms give the same bits */
  return 0 * (wlo + whi + xlo + xhi);
#endif
  return wlo >= 1 && xhi <= 254 && wlo + xlo - 127 >= 1 && whi + xhi - 127 <= 254;
}

/* the least and greatest exponent field of the block scales of `rows` quantized rows (xs words: positive
 * powers of two, or the NaN 0x7FC00000 of a non-finite block: their bits order as their fields) */
static void xs_field_range(const float *xs0, size_t xs_row, size_t nb, size_t rows, int *lo, int *hi) {
  __m256i xmin = _mm256_set1_epi32(-1), xmax = _mm256_setzero_si256();
  uint32_t smin = 0xFFFFFFFFu, smax = 0, lanes[16];
  for (size_t r = 0; r < rows; ++r) {
    const uint32_t *xw = (const uint32_t *)(xs0 + r * xs_row);
    size_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(xw + b));
      xmin = _mm256_min_epu32(xmin, v);
      xmax = _mm256_max_epu32(xmax, v);
    }
    for (; b < nb; ++b) {
      smin = xw[b] < smin ? xw[b] : smin;
      smax = xw[b] > smax ? xw[b] : smax;
    }
  }
  _mm256_storeu_si256((__m256i *)lanes, xmin);
  _mm256_storeu_si256((__m256i *)(lanes + 8), xmax);
  for (int i = 0; i < 8; ++i) {
    smin = lanes[i] < smin ? lanes[i] : smin;
    smax = lanes[8 + i] > smax ? lanes[8 + i] : smax;
  }
  *lo = (int)(smin >> 23);
  *hi = (int)(smax >> 23);
}

/* the least and greatest scale byte of one group (nb x 16 bytes) */
static void scale_byte_range(const uint8_t *sg, size_t nb, int *lo, int *hi) {
  __m128i bmin = _mm_set1_epi8(-1), bmax = _mm_setzero_si128();
  for (size_t b = 0; b < nb; ++b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(sg + 16 * b));
    bmin = _mm_min_epu8(bmin, v);
    bmax = _mm_max_epu8(bmax, v);
  }
  uint8_t bl[32];
  _mm_storeu_si128((__m128i *)bl, bmin);
  _mm_storeu_si128((__m128i *)(bl + 16), bmax);
  *lo = 255;
  *hi = 0;
  for (int i = 0; i < 16; ++i) {
    *lo = bl[i] < *lo ? bl[i] : *lo;
    *hi = bl[16 + i] > *hi ? bl[16 + i] : *hi;
  }
}

_Static_assert(R16_MAX_ROWS2 / 2 <= R16_MAX_ROWS, "a two-plane pass has at most R16_MAX_ROWS results");

/* The group of 16 weight rows from row o against every row of the item, in passes of at most R16_MAX_ROWS int8 rows
 * (R16_MAX_ROWS2 in the two-plane form; as equal as they can be; a row's `planes` int8 rows in one pass, joined
 * by r16_rows), the group's weights (nb x 256 bytes) staying in cache from one pass to the next: res[r] (rows
 * r < it->rows) and the group's bias.  try_fast, xlo, xhi: the item's scale-form choice (item_rows16). */
static void group_rows16(const item_t *it, size_t o, const int8_t *xq0, const float *xs0, size_t planes, int try_fast,
                         int xlo, int xhi, float *bias, float (*res)[16]) {
  const size_t nb = it->nb, k = 32 * nb, xs_row = mxint8_xs_row(nb), rows = it->rows;
  const size_t per_pass = (planes == 2 ? R16_MAX_ROWS2 : R16_MAX_ROWS) / planes;
  const size_t passes = (rows + per_pass - 1) / per_pass;
  const uint8_t *wg = it->w + o * 16 * nb, *sg = it->s + o * nb;
  int fast = 0;
  if (try_fast) {
    int wlo, whi;
    scale_byte_range(sg, nb, &wlo, &whi);
    fast = r16_fast(wlo, whi, xlo, xhi);
  }
  for (size_t i = 0; i < 16; ++i) bias[i] = bias_value(it->bias, it->bias_kind, o + i);
  for (size_t i = 0; i < passes; ++i) {
    const size_t r0 = rows * i / passes, r1 = rows * (i + 1) / passes;
    r16_rows(planes * (r1 - r0), planes, fast, wg, sg, nb, xq0 + planes * r0 * k, k, xs0 + planes * r0 * xs_row,
             xs_row, res + r0);
  }
}

/* One work item, group by group of 16 outputs (store16).  With gate/up halves (the GLU epilogue of a w13 whose
 * gate rows come first) a tile of 32 outputs is the gate group of rows [o0 / 2, +16) and the up group of rows
 * [n / 2 + o0 / 2, +16), the GLU of their 16 pairs at o0 / 2 (n / 2 and the tile's outputs multiples of 32). */
static void item_rows16(const item_t *it, const int8_t *xq0, const float *xs0, size_t planes) {
  const size_t nb = it->nb, xs_row = mxint8_xs_row(nb), rows = it->rows;
  /* the scale form: the exponent add only where it pays (the GEMM passes of the AVX-512 flavor: at 1-3 rows
   * the decode, not the FMA pipes, bounds the pass, and the scans cost the matvec 5-10% in the harness) */
  const int try_fast = MXMOE_VNNI && planes * rows >= R16_FAST_ROWS;
  int xlo = 0, xhi = 255;
  if (try_fast) xs_field_range(xs0, xs_row, nb, planes * rows, &xlo, &xhi);
  float res[MAX_ITEM_ROWS][16], bias[16];
  if (it->halves) {
    const size_t half = it->n / 2;
    float up[MAX_ITEM_ROWS][16], ubias[16];
    for (size_t o0 = it->n0; o0 < it->n1; o0 += 32) {
      group_rows16(it, o0 / 2, xq0, xs0, planes, try_fast, xlo, xhi, bias, res);
      group_rows16(it, half + o0 / 2, xq0, xs0, planes, try_fast, xlo, xhi, ubias, up);
      for (size_t r = 0; r < rows; ++r)
        glu_row(&it->glu, res[r], up[r], bias, ubias, 16, glu_out(it, r, o0 / 2));
    }
    return;
  }
  for (size_t o0 = it->n0; o0 < it->n1; o0 += 16) {
    group_rows16(it, o0, xq0, xs0, planes, try_fast, xlo, xhi, bias, res);
    for (size_t r = 0; r < rows; ++r) store16(it, o0, bias, r, res[r]);
  }
}

static void rows16_grouped_matvec(const int8_t *xq, const float *xs, const uint8_t *w, const uint8_t *s,
                                  const void *bias, const int64_t *info, const int32_t *counts, const int32_t *order,
                                  void *out, size_t S, size_t n, size_t k, size_t bias_kind, size_t pairs,
                                  size_t tile_n, size_t tile, size_t u, size_t planes, glu_t glu) {
  item_t it;
  const ptrdiff_t first = work_item(&it, w, s, bias, info, counts, order, out, S, n, k, bias_kind, pairs, tile_n,
                                    tile, u, glu);
  if (first < 0) return;
  item_rows16(&it, xq + first * planes * k, xs + first * planes * mxint8_xs_row(k / 32), planes);
}

/* xq, xs: quantized rows in sorted order (mxmoe_mxint8_quantize_rows; with two planes per row,
 * mxmoe_mxint16_quantize_rows: xq [S, 2 k], xs [S, 4 k / 32]); w: [E, n, k / 2] and s: [E, n, k / 32] in the rows16
 * layout (n a multiple of 16); bias: [E, n] of bias_kind; info, counts, order, out, tile_n, tile, u, pairs,
 * glu, glu_alpha, glu_limit, out_kind: as mxmoe_mxfp4_grouped_matvec (tile_n a multiple of 16).  One entry point
 * per number of planes. */
#define ROWS16_ENTRY(NAME, PLANES)                                                                              \
  void NAME(MEMREF(const int8_t, xq), MEMREF(const float, xs), MEMREF(const uint8_t, w), MEMREF(const uint8_t, s),  \
            MEMREF(const void, bias), MEMREF(const int64_t, info), MEMREF(const int32_t, counts),                 \
            MEMREF(const int32_t, order), MEMREF(char, out), size_t S, size_t n, size_t k, size_t bias_kind,       \
            size_t pairs, size_t tile_n, size_t tile, size_t u, size_t glu, size_t glu_alpha,                     \
            size_t glu_limit, size_t out_kind) {                                                                  \
    const glu_t g = glu_params(glu, out_kind, glu_alpha, glu_limit);                                             \
    rows16_grouped_matvec(AT(xq), AT(xs), AT(w), AT(s), AT(bias), AT(info), AT(counts), AT(order), OUT_AT(out, g), \
                          S, n, k, bias_kind, pairs, tile_n, tile, u, PLANES, g);                                \
  }
ROWS16_ENTRY(mxmoe_rows16_grouped_matvec, 1)
ROWS16_ENTRY(mxmoe_rows16x2_grouped_matvec, 2)
