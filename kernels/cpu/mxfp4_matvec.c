/* mxmoe CPU microkernels: grouping of a grouped matmul's rows by expert, and its MXFP4 matmul (weights in
 * the cpu-mxfp4-blocksplit layout) with the preparation of its activation rows.
 *
 * Linked into IREE dispatches (hal.executable.objects) by the cpu lowering: freestanding C with no libc,
 * no writable globals, no TLS.  Every entry point is one IREE workgroup.  Built in two flavors
 * (mxmoe.kernels.cpu picks the best the host runs): "avx2" (AVX2, FMA, F16C) and "avx512bf16" (also
 * AVX-512 F/BW/VL/DQ, AVX512-BF16 and AVX512-VNNI), which adds the bf16 path below (and vpdpbusd to the int8
 * form of mxint8_rows16.c, included at the end); the entry points and their
 * buffers are the same in both, so the lowering does not depend on the flavor.
 *
 * Rows: a grouped matmul has S = tokens x top_k rows ("slots", flat token order).  mxmoe_group_slots
 * sorts them by expert (order[p] is the slot at sorted position p) and cuts each expert's rows into work
 * items of at most `chunk` rows.  The activation step reads the row of sorted row p from x[order[p] / div]
 * and writes it in sorted order; the matmul reads sorted rows and writes each result row back to its slot,
 * out[order[p]], so what follows the kernel works in token order with no gather.
 *
 * Weights: in each 32-value block (16 bytes) byte b holds value b in its low nibble and value b + 16 in
 * its high nibble.  Blocks go in pairs (32 bytes).
 *
 * int16 path (avx2 flavor; f16 activations in both flavors).  Activations (mxmoe_mxfp4_quantize_rows):
 * int16 with one power-of-two scale per 32-value block.  E is the binary exponent of the block's largest
 * magnitude, clamped to [-100, 127]; q = round(x * 2^(14 - E)) (|q| <= 32767, ties to even), so every
 * value within 2^7 of the block's largest is exact and smaller ones are rounded to a multiple of
 * 2^(E - 14).  The stored scale is 2^(E - 14) / 512 (the decode below yields 512 x the e2m1 value); a
 * block holding an inf or NaN gets q = 0 and a NaN scale.  A nibble indexes (vpshufb) a table of 2 x the
 * e2m1 value as an int8 (0, 1, 2, 3, 4, 6, 8, 12 and negatives), which is interleaved above a zero byte:
 * an int16 of 512 x the value.  A block's products are then one exact integer sum (vpmaddwd): |sum| <=
 * 32 x 3072 x 32767 < 2^32 is a multiple of 512 whose quotient is < 2^24, so the int32 sum and its f32
 * conversion are exact, and the block is scaled once by (weight scale x activation scale), both powers of
 * two.  Only the f32 accumulation over blocks rounds.  xq holds, per pair, the int16 activations in the
 * order the decode produces them: [block 2p values 8j..8j+7 | block 2p+1 values 8j..8j+7] for j = 0..3
 * (64 values; zeros for a missing last block).  xs holds one scale per block, a row padded with zeros to
 * a multiple of 8 blocks: the kernel reads the scales of 4 pairs at once.
 *
 * bf16 path (avx512bf16 flavor, bf16 activations): exact.  The activations are the bf16 values
 * themselves, only reordered to the order the decode produces (per quad of 4 blocks, four planes of 32 values,
 * one nibble of each of the quad's 32 weight words; the last nb % 4 blocks per pair: "The bf16 path's order"
 * below; 64 bf16 per pair in the int16 buffer xq; xs is not used).  Each nibble indexes (vpermw) a table of
 * the e2m1 values as bf16, whose exponents the GEMM's decode moves by the block's scale (value x 2^(s - 127) is
 * an exact bf16 for scale bytes 2..252; a row whose scales leave that range takes an f32 decode,
 * exact up to bf16 subnormals, NaN for byte 255) and the matvec applies in f32 to each quad's sums, so the
 * products are exact and vdpbf16ps accumulates them in f32: the only rounding is the f32 accumulation,
 * as in an f32 matmul of the dequantized weights.  Few rows per expert: the decoded quads of two weight rows
 * stay in registers and meet each row (the matvec); more rows: 4 weight rows are decoded to a buffer once and a
 * 4 x 4 register block of dot products runs over them (the GEMM), so the decode is shared by every row.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* an MLIR memref<?xT> argument: allocated pointer, aligned pointer, offset, size, stride */
#define MEMREF(T, name) T *name##_alloc, T *name, size_t name##_off, size_t name##_size, size_t name##_stride
#define AT(name) (name + name##_off)

/* element kinds of activations and biases (the lowering passes these codes) */
enum { KIND_NONE = 0, KIND_BF16 = 1, KIND_F32 = 2, KIND_F16 = 3 };

/* bytes per element of a kind (a bias of KIND_NONE is never read) */
static inline size_t kind_size(size_t kind) { return kind == KIND_F32 ? 4 : 2; }

/* 2 x the e2m1 value of the codes 0..15 */
#define E2M1_X2 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* pairs per row and the padded length of a row of block scales */
static inline size_t row_pairs(size_t nb) { return (nb + 1) / 2; }
static inline size_t scale_row(size_t nb) { return (nb + 7) / 8 * 8; }

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static inline float bias_value(const void *bias, size_t kind, size_t i) {
  union { uint32_t u; float f; } v;
  switch (kind) {
    case KIND_BF16: v.u = (uint32_t)((const uint16_t *)bias)[i] << 16; return v.f;
    case KIND_F32: return ((const float *)bias)[i];
    case KIND_F16: return _cvtsh_ss(((const uint16_t *)bias)[i]);
    default: return 0.0f;
  }
}

#include "glu_epilogue.c"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define MXMOE_BF16 1
#else
#define MXMOE_BF16 0
#endif
/* AMX tiles for the bf16 GEMM (the avx512amx flavor) */
#if MXMOE_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MXMOE_AMX 1
#else
#define MXMOE_AMX 0
#endif

/* ---------------------------------------------------------------------------------------- grouping */

/* Groups the S slots by expert in O(S + E): counts per expert, a prefix sum, a stable scatter; then cuts
 * each used expert's rows into work items of at most `chunk` rows (as equal as they can be).  A slot whose
 * id is outside [0, E) (the fused-MoE interface's -1, "not on this rank") belongs to no expert: it goes
 * after every valid slot, and the matmul gives it an output row of zeros and no work.
 *
 * order[p]: the slot at sorted position p (the valid slots by expert, each expert's in slot order, then
 * the invalid ones).  info [2 cap], cap = E + S / chunk (>= the number of items): info[2i] is item i's
 * first sorted row, info[2i + 1] its expert id | rows << 32 (items by expert; the rest of info is zero).
 * counts[0] = the number of items, counts[1] = nvalid (the number of valid slots).  The last E entries of
 * info count the rows per expert while it runs (the items written never reach an expert's counter
 * before it was read), so no scratch is needed.  One workgroup; S < 2^31. */
void mxmoe_group_slots(MEMREF(const int32_t, ids), MEMREF(int32_t, order), MEMREF(int64_t, info),
                       MEMREF(int32_t, counts), size_t S, size_t E, size_t chunk) {
  const int32_t *id = AT(ids);
  const size_t cap = E + S / chunk;
  int64_t *tab = AT(info), *cur = tab + 2 * cap - E; /* per expert: its count, then its next free row */
  for (size_t e = 0; e < E; ++e) cur[e] = 0;
  size_t nvalid = 0;
  for (size_t s = 0; s < S; ++s)
    if ((uint32_t)id[s] < (uint32_t)E) ++cur[id[s]], ++nvalid;
  int64_t next = 0;
  for (size_t e = 0; e < E; ++e) {
    const int64_t c = cur[e];
    cur[e] = next;
    next += c;
  }
  int32_t *ord = AT(order);
  size_t inv = nvalid;
  for (size_t s = 0; s < S; ++s) {
    const uint32_t e = (uint32_t)id[s];
    if (e < (uint32_t)E) ord[cur[e]++] = (int32_t)s;
    else ord[inv++] = (int32_t)s;
  }
  /* cur[e] is now the end of expert e's rows.  Items of experts <= e take at most 2 (e + 1 + S / chunk)
   * entries, below cur[e + 1] = tab[2 cap - E + e + 1] since E >= e + 1. */
  int64_t start = 0;
  size_t items = 0;
  for (size_t e = 0; e < E; ++e) {
    const int64_t end = cur[e], rows = end - start;
    if (rows > 0) {
      const int64_t pieces = (rows + (int64_t)chunk - 1) / (int64_t)chunk;
      for (int64_t i = 0; i < pieces; ++i) {
        const int64_t r0 = start + rows * i / pieces, r1 = start + rows * (i + 1) / pieces;
        tab[2 * items] = r0;
        tab[2 * items + 1] = (int64_t)e | (r1 - r0) << 32;
        ++items;
      }
    }
    start = end;
  }
  for (size_t i = 2 * items; i < 2 * cap; ++i) tab[i] = 0;
  AT(counts)[0] = (int32_t)items;
  AT(counts)[1] = (int32_t)nvalid;
}

/* ---------------------------------------------------------------------------------- int16 path */

/* 8 activations from x[i..i+8) of the given kind, as f32 */
static inline __m256 load8(const void *x, size_t kind, size_t i) {
  switch (kind) {
    case KIND_BF16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    case KIND_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    default: return _mm256_loadu_ps((const float *)x + i);
  }
}

static inline int32_t hmax_epi32(__m256i v) {
  __m128i a = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_max_epi32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_max_epi32(a, _mm_shuffle_epi32(a, 0xB1));
  return _mm_cvtsi128_si32(a);
}

/* Block b (32 values) of a row of activations (kind) as 4 x 8 floats, and the binary exponent of its largest
 * magnitude clamped to [-100, 127]; *finite: no inf or NaN in it. The quantizers of both forms start here. */
static inline int32_t load_block(const void *x, size_t kind, size_t b, __m256 v[4], int *finite) {
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i m = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    v[j] = load8(x, kind, 32 * b + 8 * j);
    /* magnitudes compare as integers; inf and NaN are above every finite value */
    m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(v[j]), absmask));
  }
  const int32_t ebits = hmax_epi32(m) >> 23, e = ebits - 127;
  *finite = ebits != 255;
  return e < -100 ? -100 : e > 127 ? 127 : e;
}

/* One row of k activations (kind) -> its int16 values (64 per pair, xq's order) and block scales. */
static void quantize_row(const void *x, size_t kind, size_t k, int16_t *xq, float *xs) {
  const size_t nb = k / 32, np = row_pairs(nb);
  for (size_t b = 0; b < nb; ++b) {
    __m256 v[4];
    int finite;
    const int32_t e = load_block(x, kind, b, v, &finite);
    union { uint32_t u; float f; } up = {(uint32_t)(14 - e + 127) << 23}, sc = {(uint32_t)(e - 23 + 127) << 23};
    int16_t *dst = xq + 64 * (b / 2) + 8 * (b % 2);
    for (int j = 0; j < 4; ++j) {
      /* round to nearest even (the MXCSR default), saturate to +-32767 on the pack */
      const __m256i q = finite ? _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(up.f)))
                               : _mm256_setzero_si256();
      __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      h = _mm_max_epi16(h, _mm_set1_epi16(-32767));
      _mm_storeu_si128((__m128i *)(dst + 16 * j), h);
    }
    if (!finite) sc.u = 0x7FC00000u;
    xs[b] = sc.f;
  }
  if (nb % 2) /* the missing second block of the last pair */
    for (int j = 0; j < 4; ++j) _mm_storeu_si128((__m128i *)(xq + 64 * (np - 1) + 16 * j + 8), _mm_setzero_si128());
  for (size_t b = nb; b < scale_row(nb); ++b) xs[b] = 0.0f;
}


/* the weight scales of blocks [b0, b0 + 8) of a row with nb blocks as f32 2^(byte - 127) (byte 0 is
 * 2^-127, 255 is NaN; blocks at or past nb read as byte 0, against activation scales of 0) */
static inline __m256 weight_scales8(const uint8_t *srow, size_t nb, size_t b0) {
  __m128i raw;
  if (b0 + 8 <= nb) {
    raw = _mm_loadl_epi64((const __m128i *)(srow + b0));
  } else {
    uint64_t v = 0;
    for (size_t i = 0; b0 + i < nb; ++i) v |= (uint64_t)srow[b0 + i] << (8 * i);
    raw = _mm_cvtsi64_si128((long long)v);
  }
  const __m256i b = _mm256_cvtepu8_epi32(raw);
  const __m256i special = _mm256_cmpeq_epi32(
      _mm256_and_si256(_mm256_add_epi32(b, _mm256_set1_epi32(1)), _mm256_set1_epi32(0xFE)), _mm256_setzero_si256());
  return _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_slli_epi32(b, 23), _mm256_and_si256(special, _mm256_set1_epi32(1 << 22))));
}

/* 32 weight bytes (two blocks; only the first when `lone`) -> 64 int16 (512 x value) in xq's order */
static inline void decode_pair(const uint8_t *wp, int lone, __m256i d[4]) {
  const __m256i lut = _mm256_setr_epi8(E2M1_X2, E2M1_X2), low4 = _mm256_set1_epi8(0x0F);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i b = lone ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)wp))
                         : _mm256_loadu_si256((const __m256i *)wp);
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(b, low4));
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
  d[0] = _mm256_unpacklo_epi8(zero, lo);
  d[1] = _mm256_unpackhi_epi8(zero, lo);
  d[2] = _mm256_unpacklo_epi8(zero, hi);
  d[3] = _mm256_unpackhi_epi8(zero, hi);
}

/* pair p (the i-th of its group of 4) of R activation rows against decoded weights d: the two blocks'
 * exact sums times their scales (lanes 2i, 2i + 1 of sc[r], spread to 4 lanes each) into ACC[r] */
#define PAIR_ROWS(R, ACC, P, IDX)                                                                       \
  for (int r = 0; r < R; ++r) {                                                                        \
    const __m256i *xp = (const __m256i *)(xq + r * xq_row + 64 * (P));                                 \
    const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(d[0], _mm256_loadu_si256(xp)),              \
                                         _mm256_madd_epi16(d[1], _mm256_loadu_si256(xp + 1)));         \
    const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(d[2], _mm256_loadu_si256(xp + 2)),          \
                                         _mm256_madd_epi16(d[3], _mm256_loadu_si256(xp + 3)));         \
    ACC[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s01, s23)),                           \
                             _mm256_permutevar8x32_ps(sc[r], IDX), ACC[r]);                            \
  }

/* R (1..4) activation rows (strides xq_row, xs_row) against one weight row.  Per group of 4 pairs the 8
 * weight scales are decoded once and multiplied by each row's 8 activation scales.  One row alternates
 * two accumulators (ACCB = acc1) to overlap the FMA latency; several rows already do, and keep one each
 * (ACCB = acc0) to stay within the 16 ymm registers. */
#define DOT_ROWS(R, ACCB)                                                                               \
  static void dot_rows_##R(const uint8_t *wrow, const uint8_t *srow, size_t nb, const int16_t *xq,    \
                           size_t xq_row, const float *xs, size_t xs_row, float *res) {                \
    const size_t np = row_pairs(nb);                                                                   \
    const __m256i i0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), two = _mm256_set1_epi32(2);         \
    const __m256i i1 = _mm256_add_epi32(i0, two), i2 = _mm256_add_epi32(i1, two);                      \
    const __m256i i3 = _mm256_add_epi32(i2, two);                                                      \
    __m256 acc0[R], acc1[R], sc[R];                                                                    \
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();                               \
    size_t p = 0;                                                                                      \
    for (; 2 * p + 8 <= nb; p += 4) { /* groups of four pairs of whole blocks */                       \
      const __m256 ws = weight_scales8(srow, nb, 2 * p);                                               \
      for (int r = 0; r < R; ++r) sc[r] = _mm256_mul_ps(ws, _mm256_loadu_ps(xs + r * xs_row + 2 * p)); \
      __m256i d[4];                                                                                    \
      decode_pair(wrow + 32 * p, 0, d);                                                                \
      PAIR_ROWS(R, acc0, p, i0)                                                                        \
      decode_pair(wrow + 32 * (p + 1), 0, d);                                                          \
      PAIR_ROWS(R, ACCB, p + 1, i1)                                                                    \
      decode_pair(wrow + 32 * (p + 2), 0, d);                                                          \
      PAIR_ROWS(R, acc0, p + 2, i2)                                                                    \
      decode_pair(wrow + 32 * (p + 3), 0, d);                                                          \
      PAIR_ROWS(R, ACCB, p + 3, i3)                                                                    \
    }                                                                                                  \
    if (p < np) { /* the last 1-3 pairs, maybe ending in a lone block */                               \
      const __m256 ws = weight_scales8(srow, nb, 2 * p);                                               \
      for (int r = 0; r < R; ++r) sc[r] = _mm256_mul_ps(ws, _mm256_loadu_ps(xs + r * xs_row + 2 * p)); \
      __m256i d[4], idx = i0;                                                                          \
      for (size_t q = p; q < np; ++q, idx = _mm256_add_epi32(idx, two)) {                              \
        decode_pair(wrow + 32 * q, 2 * q + 1 == nb, d);                                                \
        PAIR_ROWS(R, acc0, q, idx)                                                                     \
      }                                                                                                \
    }                                                                                                  \
    for (int r = 0; r < R; ++r) res[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));                        \
  }
DOT_ROWS(1, acc1)
DOT_ROWS(2, acc0)
DOT_ROWS(3, acc0)
DOT_ROWS(4, acc0)

/* ------------------------------------------------------------------------------------------ bf16 */
#if MXMOE_BF16

/* e2m1 codes 0..15 as bf16 bits, twice: a 32-entry vpermw table whose upper half serves a pair's second
 * block */
static const uint16_t E2M1_BF16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* The bf16 path's order of a row's values (the packed activations, and the weights the GEMM decodes): each quad
 * of whole blocks 4j..4j+3 (64 weight bytes) is four planes of 32 values.  Read as 32 words, the quad's bytes give
 * word i = bytes 2i and 2i + 1 (block 4j + i / 8, its values c and c + 16 in the first byte, c + 1 and c + 17 in
 * the second, c = 2 (i % 8)); its four nibbles, low first, are word i of planes 0..3.  So a plane is one shift and
 * one vpermw of the quad's bytes, and f32 lane l of every plane's dot product sums values of block 4j + l / 4.  The
 * last nb % 4 blocks go in pairs: [block 2p values 0..15 | block 2p + 1 values 0..15] then values 16..31 (zeros
 * for a missing second block), a pair's bytes widened to words (vpmovzxbw) and each nibble looked up. */
static inline size_t row_quads(size_t nb) { return nb / 4; }

/* word i of plane n of a quad is word QUAD_PACK[i] + n / 2 + 16 (n % 2) of the quad's blocks 2 (i / 16) and
 * 2 (i / 16) + 1 side by side (64 words) */
static const uint16_t QUAD_PACK[32] = {0, 2, 4, 6, 8, 10, 12, 14, 32, 34, 36, 38, 40, 42, 44, 46,
                                       0, 2, 4, 6, 8, 10, 12, 14, 32, 34, 36, 38, 40, 42, 44, 46};

/* One row of k bf16 activations -> the order above. */
static void pack_row_bf16(const uint16_t *x, size_t k, uint16_t *dst) {
  const size_t nb = k / 32, nq = row_quads(nb), np = row_pairs(nb);
  const __m512i base = _mm512_loadu_si512((const void *)QUAD_PACK);
  for (size_t j = 0; j < nq; ++j) {
    const uint16_t *src = x + 128 * j;
    const __m512i b0 = _mm512_loadu_si512((const void *)src), b1 = _mm512_loadu_si512((const void *)(src + 32));
    const __m512i b2 = _mm512_loadu_si512((const void *)(src + 64)), b3 = _mm512_loadu_si512((const void *)(src + 96));
    for (int n = 0; n < 4; ++n) {
      const __m512i idx = _mm512_add_epi16(base, _mm512_set1_epi16((short)((n >> 1) + 16 * (n & 1))));
      _mm512_storeu_si512((void *)(dst + 128 * j + 32 * n),
                          _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_permutex2var_epi16(b0, idx, b1),
                                                  _mm512_permutex2var_epi16(b2, idx, b3)));
    }
  }
  for (size_t p = 2 * nq; p < np; ++p) {
    const __m512i a = _mm512_loadu_si512((const void *)(x + 64 * p));
    const __m512i b = 2 * p + 1 < nb ? _mm512_loadu_si512((const void *)(x + 64 * p + 32)) : _mm512_setzero_si512();
    _mm512_storeu_si512((void *)(dst + 64 * p), _mm512_shuffle_i64x2(a, b, 0x44));
    _mm512_storeu_si512((void *)(dst + 64 * p + 32), _mm512_shuffle_i64x2(a, b, 0xEE));
  }
}

/* a pair's 32 weight bytes (only the first 16 when `lone`: the row's last block) widened to 32 words */
static inline __m512i pair_words(const uint8_t *wp, int lone) {
  return _mm512_cvtepu8_epi16(lone ? _mm256_maskz_loadu_epi8(0xFFFFu, wp) : _mm256_loadu_si256((const __m256i *)wp));
}

/* Per group of 32 blocks from b0 (of nb): the scale bytes as 32 words (0 past nb), and whether one leaves 2..252
 * (then value x 2^(s - 127) may not be a normal bf16: the exact decode) */
static inline __m512i scale_words(const uint8_t *srow, size_t nb, size_t b0, int *special) {
  const size_t n = nb - b0 < 32 ? nb - b0 : 32;
  const __mmask32 m = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
  const __m512i sv = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, srow + b0));
  *special = _mm512_mask_cmpgt_epu16_mask(m, _mm512_sub_epi16(sv, _mm512_set1_epi16(2)), _mm512_set1_epi16(250)) != 0;
  return sv;
}

/* The e2m1 codes as bf16 of 2^125 x their value (both zeros +0), twice: decode_quad_bf16's table.  Value x 2^(s - 127)
 * is then the entry less (252 - s) << 7, an unsigned saturating subtraction from the exponent field: for scale bytes
 * 2..252 the amount is at most the field (251..254) less 1, so the result is a normal bf16 of the right sign, and the
 * zeros, 0 less anything, stay 0 (adding (s - 127) << 7 to the plain table would need a mask to keep them). */
static const uint16_t E2M1_BF16_HI[32] = {
    0x0000, 0x7D80, 0x7E00, 0x7E40, 0x7E80, 0x7EC0, 0x7F00, 0x7F40,
    0x0000, 0xFD80, 0xFE00, 0xFE40, 0xFE80, 0xFEC0, 0xFF00, 0xFF40,
    0x0000, 0x7D80, 0x7E00, 0x7E40, 0x7E80, 0x7EC0, 0x7F00, 0x7F40,
    0x0000, 0xFD80, 0xFE00, 0xFE40, 0xFE80, 0xFEC0, 0xFF00, 0xFF40};
/* word i of a quad's planes belongs to block i / 8 of the quad */
static const uint16_t QUAD_BLOCK[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};

/* decode_quad_bf16's subtrahends (252 - s) << 7 of scale words */
static inline __m512i scale_subtrahends(__m512i sv) {
  return _mm512_slli_epi16(_mm512_sub_epi16(_mm512_set1_epi16(252), sv), 7);
}

/* Pair p of a row (32 weight bytes at wp; only 16 when `lone`) -> lo = [block 2p values 0..15 | block 2p+1 values
 * 0..15], hi = the values 16..31, bf16 with the scales applied (scale bytes 2..252) as in decode_quad_bf16.  idx selects
 * the pair's two subtrahends: words 0..15 = 2j, 16..31 = 2j + 1 for the j-th pair of the subtrahends' group. */
static inline void decode_pair_bf16(const uint8_t *wp, int lone, __m512i subs, __m512i idx, __m512i *lo,
                                    __m512i *hi) {
  const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16_HI), sub = _mm512_permutexvar_epi16(idx, subs);
  const __m512i v = pair_words(wp, lone); /* vpermw reads 5 bits: the low nibble and a bit the table's repeat ignores */
  *lo = _mm512_subs_epu16(_mm512_permutexvar_epi16(v, tab), sub);
  *hi = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab), sub);
}

/* The quad of blocks 4t..4t+3 of the subtrahends' group (64 weight bytes at wp) -> its four planes, bf16 with the
 * scales applied (scale bytes 2..252): per plane a shift, a vpermw of the 2^125-biased table and one saturating
 * subtraction of its block's subtrahend.  Until 2026-11-29 a 64-entry table of the quad's four blocks with the adders
 * applied (two masked adds, four vpermt2w): 22.5 against 19.3 cycles per quad for 64 rows' chunks of 6 pairs, 4-5% of
 * an 8- or 64-row AMX item (benchmarks/cpu_amx.c, Intel host), level with the noise in the whole layer. */
static inline void decode_quad_bf16(const uint8_t *wp, __m512i subs, size_t t, __m512i out[4]) {
  const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16_HI);
  const __m512i idx = _mm512_add_epi16(_mm512_loadu_si512((const void *)QUAD_BLOCK), _mm512_set1_epi16((short)(4 * t)));
  const __m512i sub = _mm512_permutexvar_epi16(idx, subs), v = _mm512_loadu_si512((const void *)wp);
  out[0] = _mm512_subs_epu16(_mm512_permutexvar_epi16(v, tab), sub);
  out[1] = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab), sub);
  out[2] = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab), sub);
  out[3] = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab), sub);
}

/* e8m0 byte -> f32 2^(b - 127), exactly: 0 is the subnormal 2^-127, 255 NaN */
static inline float e8m0(uint8_t b) {
  union { uint32_t u; float f; } v = {b == 0 ? 0x00400000u : b == 255 ? 0x7FC00000u : (uint32_t)b << 23};
  return v.f;
}

/* bf16 x f32 scale, rounded back to bf16 (exact but for bf16 subnormals, which vcvtne2ps2bf16 flushes; NaN for a
 * NaN scale): the two halves of 32 words with their own scales */
static inline __m512i scale_exact(__m512i v, __m512 s_lo, __m512 s_hi) {
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
  const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo));
}

/* two blocks' scales as 8 + 8 lanes */
static inline __m512 two_scales(const uint8_t *sp) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(e8m0(sp[0])), _mm512_set1_ps(e8m0(sp[1])));
}

/* a quad's four planes of e2m1 values as bf16, unscaled (tab: E2M1_BF16; vpermw reads a word's low 5 bits and the
 * table repeats every 16 entries, so a plane needs no mask) */
static inline void quad_planes(const uint8_t *wp, __m512i tab, __m512bh p[4]) {
  const __m512i v = _mm512_loadu_si512((const void *)wp);
  p[0] = (__m512bh)_mm512_permutexvar_epi16(v, tab);
  p[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
  p[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab);
  p[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab);
}

/* a pair's two halves (lo: values 0..15 of both blocks, hi: 16..31) as bf16, unscaled; `lone`: the row's last block */
static inline void pair_planes(const uint8_t *wp, int lone, __m512i tab, __m512bh *lo, __m512bh *hi) {
  const __m512i v = pair_words(wp, lone);
  *lo = (__m512bh)_mm512_permutexvar_epi16(v, tab);
  *hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
}

/* decode_pair_bf16 and decode_quad_bf16 through f32, for rows with scale bytes outside 2..252 */
static inline void decode_pair_bf16_exact(const uint8_t *wp, const uint8_t *sp, int lone, __m512i *lo, __m512i *hi) {
  __m512bh l, h;
  pair_planes(wp, lone, _mm512_loadu_si512((const void *)E2M1_BF16), &l, &h);
  const __m512 s0 = _mm512_set1_ps(e8m0(sp[0])), s1 = _mm512_set1_ps(lone ? 0.0f : e8m0(sp[1]));
  *lo = scale_exact((__m512i)l, s0, s1);
  *hi = scale_exact((__m512i)h, s0, s1);
}
static inline void decode_quad_bf16_exact(const uint8_t *wp, const uint8_t *sp, __m512i out[4]) {
  __m512bh p[4];
  quad_planes(wp, _mm512_loadu_si512((const void *)E2M1_BF16), p);
  const __m512 s01 = two_scales(sp), s23 = two_scales(sp + 2);
  for (int n = 0; n < 4; ++n) out[n] = scale_exact((__m512i)p[n], s01, s23);
}

/* A weight row of nb blocks decoded to dst (2 row_pairs(nb) vectors, the order above) with its scales applied,
 * for the GEMM; the bytes of the row at `next` are fetched meanwhile (the decode otherwise waits for DRAM at every
 * row). */
static void decode_row_bf16(const uint8_t *wrow, const uint8_t *srow, size_t nb, const char *next, __m512i *dst) {
  const size_t nq = row_quads(nb), np = row_pairs(nb);
  for (size_t g = 0; g < nq; g += 8) { /* 8 quads share a group of 32 subtrahends */
    int special;
    const __m512i subs = scale_subtrahends(scale_words(srow, nb, 4 * g, &special));
    const size_t ge = g + 8 < nq ? g + 8 : nq;
    for (size_t j = g; j < ge; ++j) {
      _mm_prefetch(next + 64 * j, _MM_HINT_T0);
      if (special) decode_quad_bf16_exact(wrow + 64 * j, srow + 4 * j, dst + 4 * j);
      else decode_quad_bf16(wrow + 64 * j, subs, j - g, dst + 4 * j);
    }
  }
  if (2 * nq < np) { /* the last 1-3 blocks */
    int special;
    const __m512i subs = scale_subtrahends(scale_words(srow, nb, 4 * nq, &special));
    __m512i idx = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 1);
    _mm_prefetch(next + 64 * nq, _MM_HINT_T0);
    for (size_t p = 2 * nq; p < np; ++p, idx = _mm512_add_epi16(idx, _mm512_set1_epi16(2))) {
      const int lone = 2 * p + 1 == nb;
      if (special) decode_pair_bf16_exact(wrow + 32 * p, srow + 2 * p, lone, dst + 2 * p, dst + 2 * p + 1);
      else decode_pair_bf16(wrow + 32 * p, lone, subs, idx, dst + 2 * p, dst + 2 * p + 1);
    }
  }
}


/* the f32 scales of blocks [b0, b0 + 16) of a row with nb blocks, exactly (0: 2^-127, 255: NaN; blocks at or
 * past nb read as byte 0) */
static inline __m512 scales16(const uint8_t *srow, size_t nb, size_t b0) {
  const size_t n = nb - b0 < 16 ? nb - b0 : 16;
  const __mmask16 m = n == 16 ? 0xFFFFu : (__mmask16)((1u << n) - 1u);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, srow + b0));
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(255));
  __m512i v = _mm512_mask_mov_epi32(_mm512_slli_epi32(b, 23), zero, _mm512_set1_epi32(0x00400000));
  v = _mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(v);
}

/* bytes ahead of each weight row being read that the matvec prefetches (twice that for two adjacent rows read as
 * one stream: bdot_rows).  Measured with the one-row matvec of 2026-11-28 evening, single-thread harness, weights
 * from DRAM, GB/s at 1 / 2 / 3 / 4 rows: 15.9 / 12.8 / 8.8 / 5.4 without, 17.1 / 13.9 / 10.9 / 6.8 at 2048 (1024
 * and 4096 no better); in L2 no change. */
#define BF16_PREFETCH 2048

/* quad Q of R packed activation rows against two weight rows w0, w1 in registers (planes p, q; scales picked from
 * sv0, sv1 by IDX) into A0[r], A1[r]: each activation load feeds both rows' dot products */
#define QUAD_ROWS(R, A0, A1, Q, IDX)                                                                    \
  {                                                                                                      \
    _mm_prefetch(pf0 + pfs * (Q), _MM_HINT_T0);                                                          \
    _mm_prefetch(pf1 + pfs * (Q), _MM_HINT_T0);                                                          \
    __m512bh p_[4], q_[4];                                                                               \
    quad_planes(w0 + 64 * (Q), tab, p_);                                                                 \
    quad_planes(w1 + 64 * (Q), tab, q_);                                                                 \
    const __m512 sc0_ = _mm512_permutexvar_ps(IDX, sv0), sc1_ = _mm512_permutexvar_ps(IDX, sv1);         \
    for (int r = 0; r < R; ++r) {                                                                        \
      const uint16_t *xp = x + r * xrow + 128 * (Q);                                                     \
      __m512 t = _mm512_setzero_ps(), u = _mm512_setzero_ps();                                           \
      for (int n = 0; n < 4; ++n) {                                                                      \
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xp + 32 * n));                   \
        t = _mm512_dpbf16_ps(t, p_[n], xv);                                                              \
        u = _mm512_dpbf16_ps(u, q_[n], xv);                                                              \
      }                                                                                                  \
      A0[r] = _mm512_fmadd_ps(t, sc0_, A0[r]);                                                           \
      A1[r] = _mm512_fmadd_ps(u, sc1_, A1[r]);                                                           \
    }                                                                                                    \
  }

/* The matvec: one pass of R (1-8) packed activation rows (stride xrow elements) against two weight rows (w0, w1;
 * res[r] and res[R + r]) decoded in registers.  The e2m1 values come from a constant table (quad_planes), and the
 * block scales are applied to the planes' f32 sums (one fma per weight row, activation row and quad): fewer ops per
 * value than the GEMM's scaled table when few rows share the decode, and exact for every scale byte.  Quads rather
 * than pairs: one 64-byte load and 3 shifts where two pairs take 2 widenings and 2 shifts, and one fma and scale
 * pick per 4 blocks instead of 2 (one weight row, 2026-11-28: 21.5 against 17.7 GB/s per core from L2 at one row).
 * Two weight rows because on Zen 4 a vdpbf16ps with a load of its own takes ~1.5 cycles and with one load per two ~1
 * (a throughput loop: 8 dp + 8 loads in 12 cycles, 8 dp + 4 loads in 8): sharing each activation load, they run
 * 71-72% of the vdpbf16ps peak at 4-8 rows against 59-62% for one weight row (weights in L1, build/dev harness,
 * 2026-11-28 night), and the decode's permutes and shifts mostly issue beside the dot products.  At 1-2 rows two
 * adjacent weight rows are prefetched as the one stream they are: prefetching each row 2 KB ahead, as for rows
 * apart, streamed DRAM slower than one weight row (harness, 1 / 2 rows: 12.5 / 10.7 against 17.5 / 14.1 GB/s;
 * as one stream 21.3-21.7 / 15.7-15.9). */
#define BDOT_ROWS(R)                                                                                    \
  static void bdot_rows_##R(const uint8_t *w0, const uint8_t *s0, const uint8_t *w1, const uint8_t *s1, \
                             size_t nb, const uint16_t *x, size_t xrow, float *res) {                    \
    const size_t nq = row_quads(nb), np = row_pairs(nb);                                                 \
    const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16), four = _mm512_set1_epi32(4);        \
    /* at 1-2 rows adjacent rows are one stream: its lines, two per quad; else each row's, BF16_PREFETCH ahead */ \
    const int one = R <= 2 && w1 == w0 + 16 * nb;                                                       \
    const char *pf0 = (const char *)w0 + (one ? 2 : 1) * BF16_PREFETCH;                                  \
    const char *pf1 = one ? pf0 + 64 : (const char *)w1 + BF16_PREFETCH;                                 \
    const size_t pfs = one ? 128 : 64;                                                                   \
    __m512 a0[R], a1[R];                                                                                 \
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();                                     \
    for (size_t q = 0; q < nq; q += 4) { /* 4 quads share 16 scales */                                   \
      const __m512 sv0 = scales16(s0, nb, 4 * q), sv1 = scales16(s1, nb, 4 * q);                         \
      __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);                    \
      for (size_t j = q; j < q + 4 && j < nq; ++j, idx = _mm512_add_epi32(idx, four))                   \
        QUAD_ROWS(R, a0, a1, j, idx)                                                                    \
    }                                                                                                    \
    if (2 * nq < np) { /* the last 1-3 blocks, in pairs */                                               \
      const __m512 sv0 = scales16(s0, nb, 4 * nq), sv1 = scales16(s1, nb, 4 * nq);                       \
      __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);                    \
      for (size_t p = 2 * nq; p < np; ++p, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {          \
        __m512bh l0, h0, l1, h1;                                                                         \
        pair_planes(w0 + 32 * p, 2 * p + 1 == nb, tab, &l0, &h0);                                        \
        pair_planes(w1 + 32 * p, 2 * p + 1 == nb, tab, &l1, &h1);                                        \
        const __m512 sc0 = _mm512_permutexvar_ps(idx, sv0), sc1 = _mm512_permutexvar_ps(idx, sv1);       \
        for (int r = 0; r < R; ++r) {                                                                    \
          const uint16_t *xp = x + r * xrow + 64 * p;                                                    \
          const __m512bh xl = (__m512bh)_mm512_loadu_si512((const void *)xp);                            \
          const __m512bh xh = (__m512bh)_mm512_loadu_si512((const void *)(xp + 32));                     \
          const __m512 t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), l0, xl), h0, xh);         \
          const __m512 u = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), l1, xl), h1, xh);         \
          a0[r] = _mm512_fmadd_ps(t, sc0, a0[r]);                                                        \
          a1[r] = _mm512_fmadd_ps(u, sc1, a1[r]);                                                        \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    for (int r = 0; r < R; ++r) {                                                                        \
      res[r] = _mm512_reduce_add_ps(a0[r]);                                                              \
      res[R + r] = _mm512_reduce_add_ps(a1[r]);                                                          \
    }                                                                                                    \
  }
BDOT_ROWS(1)
BDOT_ROWS(2)
BDOT_ROWS(3)
BDOT_ROWS(4)
BDOT_ROWS(5)
BDOT_ROWS(6)
BDOT_ROWS(7)
BDOT_ROWS(8)


/* lane i = the sum of the lanes of v[i]: a transposing tree of 15 unpack/shuffle + add pairs (a
 * _mm512_reduce_add_ps each would take ~4x the ops) */
static inline __m512 reduce16(const __m512 v[16]) {
  __m512 x[8], z[4], u[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

/* GEMM block: 4 decoded weight rows (np pairs x (lo, hi) each, one after the other in w) x RB (1..4) packed
 * activation rows; 4 RB accumulators of K-partial sums (the rest stay zero), reduced by one tree: res[o * 4 + r].
 * 4 weight and RB activation loads per 4 RB vdpbf16ps; against a 4 x 6 block with a _mm512_reduce_add_ps per
 * accumulator: 0.58-0.72 vs 0.58-0.60 ns per vdpbf16ps at K = 2880, 0.68-0.73 vs 0.77-0.78 at K = 512, 0.60-0.68
 * vs 0.66-0.67 at 8 rows (one thread, load avg ~7).  A last group of fewer than 4 rows takes its own RB rather than
 * repeating a row whose products are discarded. */
#define BGEMM_4XR(RB)                                                                                      \
  static __attribute__((noinline)) void bgemm_4x##RB(const __m512i *w, size_t np, const uint16_t *x, size_t xrow, \
                                                   float *res) {                                           \
    __m512 acc[16];                                                                                        \
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();                                             \
    for (size_t q = 0; q < 2 * np; ++q) { /* q = 2 p + half */                                             \
      const __m512bh w0 = (__m512bh)w[q], w1 = (__m512bh)w[2 * np + q], w2 = (__m512bh)w[4 * np + q],     \
                     w3 = (__m512bh)w[6 * np + q];                                                         \
      for (int r = 0; r < RB; ++r) {                                                                       \
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * xrow + 32 * q));           \
        acc[r] = _mm512_dpbf16_ps(acc[r], w0, xv);                                                         \
        acc[4 + r] = _mm512_dpbf16_ps(acc[4 + r], w1, xv);                                                 \
        acc[8 + r] = _mm512_dpbf16_ps(acc[8 + r], w2, xv);                                                 \
        acc[12 + r] = _mm512_dpbf16_ps(acc[12 + r], w3, xv);                                               \
      }                                                                                                    \
    }                                                                                                      \
    _mm512_storeu_ps(res, reduce16(acc));                                                                  \
  }
BGEMM_4XR(1)
BGEMM_4XR(2)
BGEMM_4XR(3)
BGEMM_4XR(4)

#endif /* MXMOE_BF16 */

/* ------------------------------------------------------------------------------------ entry points */

/* x: rows of k activations of x_kind; sorted row p comes from row order[p] / div.  xq: [S, 64 np] int16,
 * xs: [S, scale_row(nb)] f32 (nb = k / 32, np = ceil(nb / 2)).  Workgroup wg prepares sorted rows
 * [wg * rows_per_wg, +rows_per_wg) of the first counts[1] (the valid slots, mxmoe_group_slots): bf16 rows
 * packed for the bf16 path where this flavor has it, else quantized to int16. */
void mxmoe_mxfp4_quantize_rows(MEMREF(const void, x), MEMREF(const int32_t, order),
                               MEMREF(const int32_t, counts), MEMREF(int16_t, xq), MEMREF(float, xs), size_t k,
                               size_t div, size_t x_kind, size_t rows_per_wg, size_t wg) {
  const size_t nb = k / 32, esize = kind_size(x_kind), rows = (size_t)AT(counts)[1];
  const size_t p1 = (wg + 1) * rows_per_wg < rows ? (wg + 1) * rows_per_wg : rows;
  for (size_t p = wg * rows_per_wg; p < p1; ++p) {
    const char *src = (const char *)AT(x) + (size_t)AT(order)[p] / div * k * esize;
#if MXMOE_BF16
    if (x_kind == KIND_BF16) {
      pack_row_bf16((const uint16_t *)src, k, (uint16_t *)AT(xq) + p * 64 * row_pairs(nb));
      continue;
    }
#endif
    quantize_row(src, x_kind, k, AT(xq) + p * 64 * row_pairs(nb), AT(xs) + p * scale_row(nb));
  }
}

/* the output column of output o (see mxmoe_mxfp4_grouped_matvec) */
static inline size_t out_col(size_t o, size_t n, size_t deinterleave) {
  return deinterleave ? o / 2 + (o % 2) * (n / 2) : o;
}

/* the largest work item (rows: mxmoe_group_slots' chunk) and output tile (tile_n) a tile buffer holds: 16 KB */
#define MAX_ITEM_ROWS 64
#define MAX_TILE_N 64

/* what one work item writes: rows [first, +rows) of one expert, outputs [n0, n1) */
typedef struct {
  const uint8_t *w, *s; /* the expert's weights and scales */
  const void *bias;     /* the expert's bias row (bias_kind) */
  size_t bias_kind, n, nb, deinterleave, rows, n0, n1;
  size_t halves;        /* gate/up weight rows in halves, taken in pairs (weight_row) */
  const int32_t *slot;  /* the slots of the rows */
  void *out;            /* [S, n] f32, or with the GLU epilogue [S, n / 2] of glu.kind */
  glu_t glu;
} item_t;

/* the zero outputs [n0, n1) of a slot with no expert: n f32 columns, or with the GLU n / 2 of its kind (the GLU
 * of a zero gate is zero whatever the up) */
static void zero_outputs(void *out, size_t slot, size_t n, size_t n0, size_t n1, size_t deinterleave,
                         const glu_t *glu) {
  if (glu->act != GLU_NONE) {
    const size_t esize = kind_size(glu->kind);
    char *row = (char *)out + slot * (n / 2) * esize;
    for (size_t b = n0 / 2 * esize; b < n1 / 2 * esize; ++b) row[b] = 0;
    return;
  }
  float *row = (float *)out + slot * n;
  for (size_t o = n0; o < n1; ++o) row[out_col(o, n, deinterleave)] = 0.0f;
}

/* where row r's GLU output col goes: column col of its slot's n / 2-wide row of glu.kind */
static inline char *glu_out(const item_t *it, size_t r, size_t col) {
  return (char *)it->out + ((size_t)it->slot[r] * (it->n / 2) + col) * kind_size(it->glu.kind);
}

/* the weight (and bias) row of output o: o, or with gate/up halves (GLU epilogue of a w13 whose gate rows come
 * first) the gate row o / 2 of an even o and the up row n / 2 + o / 2 of an odd one: the outputs then come in the
 * interleaved order, so an output tile holds whole (gate, up) pairs */
static inline size_t weight_row(const item_t *it, size_t o) { return out_col(o, it->n, it->halves); }

/* Work item u of a grouped matmul's dispatch over output tile `tile`: fills *it (the expert's weights, scales and
 * bias, its rows' slots, the tile's outputs) and returns its first sorted row, or -1 when there is nothing to
 * multiply: u == items is the extra item that zeroes the tile of the slots with no expert (done here), u > items
 * has nothing. Both grouped matmuls (this file's and mxint8_rows16.c's) start this way. */
static ptrdiff_t work_item(item_t *it, const uint8_t *w, const uint8_t *s, const void *bias, const int64_t *info,
                           const int32_t *counts, const int32_t *order, void *ys, size_t S, size_t n, size_t k,
                           size_t bias_kind, size_t pairs, size_t tile_n, size_t tile, size_t u, glu_t glu) {
  const size_t deinterleave = pairs != 0;
  const size_t items = (size_t)counts[0], n0 = tile * tile_n;
  const size_t n1 = n0 + tile_n < n ? n0 + tile_n : n;
  if (u == items) { /* the slots with no expert: zero rows */
    for (size_t p = (size_t)counts[1]; p < S; ++p) zero_outputs(ys, (size_t)order[p], n, n0, n1, deinterleave, &glu);
    return -1;
  }
  if (u > items) return -1;
  const size_t first = (size_t)info[2 * u];
  const uint64_t pk = (uint64_t)info[2 * u + 1];
  const size_t id = pk & 0xFFFFFFFFu, nb = k / 32;
  *it = (item_t){w + id * n * (k / 2), s + id * n * nb,
                 (const char *)bias + id * n * kind_size(bias_kind), bias_kind, n, nb, deinterleave,
                 pk >> 32, n0, n1, pairs == 2, order + first, ys, glu};
  return (ptrdiff_t)first;
}

/* The tile's results [rows][tile] (output o at tile position tile_pos(o): o - n0, or with deinterleave the even
 * outputs first, then the odd) go out row by row with the bias added, each row's outputs one or two contiguous
 * runs, or with the GLU epilogue one run of n / 2-wide rows: writing them one float at a time as each 4 x 4 block
 * finished cost ~20% of the item at 4096 tokens of a small layer (scattered stores missing the cache). */
static inline size_t tile_pos(const item_t *it, size_t o) {
  const size_t d = o - it->n0, half = (it->n1 - it->n0) / 2;
  return it->deinterleave ? d / 2 + (d % 2) * half : d;
}

static void write_tile(const item_t *it, float (*buf)[MAX_TILE_N]) {
  const size_t m = it->n1 - it->n0;
  float bias[MAX_TILE_N];
  for (size_t o = it->n0; o < it->n1; ++o)
    bias[tile_pos(it, o)] = bias_value(it->bias, it->bias_kind, weight_row(it, o));
  const size_t run = it->deinterleave ? m / 2 : m;
  if (it->glu.act != GLU_NONE) {
    for (size_t r = 0; r < it->rows; ++r)
      glu_row(&it->glu, buf[r], buf[r] + run, bias, bias + run, run, glu_out(it, r, it->n0 / 2));
    return;
  }
  /* output columns of the tile's first run, and of its second (deinterleave: the odd outputs) */
  const size_t c0 = out_col(it->n0, it->n, it->deinterleave), c1 = out_col(it->n0 + 1, it->n, it->deinterleave);
  for (size_t r = 0; r < it->rows; ++r) {
    float *row = (float *)it->out + (size_t)it->slot[r] * it->n;
    for (size_t i = 0; i < run; ++i) row[c0 + i] = buf[r][i] + bias[i];
    if (it->deinterleave)
      for (size_t i = 0; i < run; ++i) row[c1 + i] = buf[r][run + i] + bias[run + i];
  }
}

static void item_int16(const item_t *it, const int16_t *xq0, const float *xs0) {
  const size_t nb = it->nb, xq_row = 64 * row_pairs(nb), xs_row = scale_row(nb), kh = nb * 16;
  float buf[MAX_ITEM_ROWS][MAX_TILE_N];
  for (size_t o = it->n0; o < it->n1; ++o) {
    const uint8_t *wrow = it->w + weight_row(it, o) * kh, *srow = it->s + weight_row(it, o) * nb;
    const size_t pos = tile_pos(it, o);
    float res[4];
    for (size_t r0 = 0; r0 < it->rows; r0 += 4) {
      const size_t nr = it->rows - r0 < 4 ? it->rows - r0 : 4;
      const int16_t *xq = xq0 + r0 * xq_row;
      const float *xsr = xs0 + r0 * xs_row;
      switch (nr) {
        case 1: dot_rows_1(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
        case 2: dot_rows_2(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
        case 3: dot_rows_3(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
        default: dot_rows_4(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
      }
      for (size_t r = 0; r < nr; ++r) buf[r0 + r][pos] = res[r];
    }
  }
  write_tile(it, buf);
}

#if MXMOE_BF16
/* at most this many rows per item take the matvec (two weight rows decoded in registers at a time, in two passes
 * past 8 rows); more take the GEMM (4 weight rows decoded to a buffer once per item).  Single-thread harness
 * (benchmarks/cpu_rows16.c), weights streamed from DRAM, GB/s at 1 / 2 / 3 / 4 / 5 / 6 / 7 / 8 / 10 / 11 rows: one
 * weight row to 6 rows then the GEMM (2026-11-28 evening) 17.4 / 14.1 / 11.0 / 6.8 / 5.7 / 4.5 / 3.8 / 4.2 / 3.5 /
 * 3.1, now 21.3-21.7 / 15.7-15.9 / 9.9-10.3 / 8.1-9.2 / 6.7-7.7 / 5.8-6.5 / 5.3-5.6 / 4.7-4.9 / 3.9 / 3.5; at 12-16
 * rows the passes were level with the GEMM or slower (2026-11-28 night). */
#ifndef BF16_MATVEC_ROWS
#define BF16_MATVEC_ROWS 11
#endif
/* pairs of 4 weight rows the GEMM decodes at once: 4 x 48 x 128 B = 24 KB of stack (IREE's workers have
 * 128 KB); longer rows go in chunks, their partial sums added (an even number: a chunk starts a quad) */
#define BF16_GEMM_PAIRS 48
#if MXMOE_AMX
/* at least this many rows per item take the AMX GEMM (item_amx), ahead of the matvec.  Single-thread harness
 * (benchmarks/cpu_amx.c, 2026-11-29), µs per call, matvec against AMX, 4 / 5 / 8 rows: weights in L2 69.6 / 83.1 / 139.7
 * against 55.7 / 53.2 / 53.8, from DRAM 844 / 970 / 1561 against 885 / 894 / 873.  (Until 2026-11-29 the matvec's
 * test came first, so the AMX GEMM took only items of 12+ rows.) */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 5
#endif
static int item_amx(const item_t *it, const uint16_t *x0);
#endif
static void item_bf16(const item_t *it, const uint16_t *x0) {
  const size_t nb = it->nb, np = row_pairs(nb), xrow = 64 * np, kh = nb * 16, rows = it->rows;
  float buf[MAX_ITEM_ROWS][MAX_TILE_N];
#if MXMOE_AMX
  if (rows >= AMX_MIN_ROWS && item_amx(it, x0)) return;
#endif
  if (rows <= BF16_MATVEC_ROWS) {
    const size_t passes = (rows + 7) / 8; /* of up to 8 rows each, the weight rows staying in L1 between them */
    for (size_t o = it->n0; o < it->n1; o += 2) {
      const size_t o1 = o + 1 < it->n1 ? o + 1 : o; /* a lone last output pairs with itself */
      const uint8_t *w0 = it->w + weight_row(it, o) * kh, *s0 = it->s + weight_row(it, o) * nb;
      const uint8_t *w1 = it->w + weight_row(it, o1) * kh, *s1 = it->s + weight_row(it, o1) * nb;
      for (size_t i = 0, r0 = 0; i < passes; ++i) {
        const size_t nr = (rows - r0) / (passes - i);
        const uint16_t *x = x0 + r0 * xrow;
        float res[16];
        switch (nr) {
          case 1: bdot_rows_1(w0, s0, w1, s1, nb, x, xrow, res); break;
          case 2: bdot_rows_2(w0, s0, w1, s1, nb, x, xrow, res); break;
          case 3: bdot_rows_3(w0, s0, w1, s1, nb, x, xrow, res); break;
          case 4: bdot_rows_4(w0, s0, w1, s1, nb, x, xrow, res); break;
          case 5: bdot_rows_5(w0, s0, w1, s1, nb, x, xrow, res); break;
          case 6: bdot_rows_6(w0, s0, w1, s1, nb, x, xrow, res); break;
          case 7: bdot_rows_7(w0, s0, w1, s1, nb, x, xrow, res); break;
          default: bdot_rows_8(w0, s0, w1, s1, nb, x, xrow, res); break;
        }
        for (size_t r = 0; r < nr; ++r) {
          buf[r0 + r][tile_pos(it, o)] = res[r];
          buf[r0 + r][tile_pos(it, o1)] = res[nr + r];
        }
        r0 += nr;
      }
    }
    write_tile(it, buf);
    return;
  }
  __m512i wbuf[4 * 2 * BF16_GEMM_PAIRS];
  for (size_t p0 = 0; p0 < np; p0 += BF16_GEMM_PAIRS) {
    const size_t npc = np - p0 < BF16_GEMM_PAIRS ? np - p0 : BF16_GEMM_PAIRS;
    const size_t b0 = 2 * p0, nbc = nb - b0 < 2 * npc ? nb - b0 : 2 * npc;
    const uint16_t *xc = x0 + 64 * p0;
    for (size_t o0 = it->n0; o0 < it->n1; o0 += 4) {
      for (size_t j = 0; j < 4; ++j) { /* a partial last quad repeats its last row */
        const size_t o = o0 + j < it->n1 ? o0 + j : it->n1 - 1;
        const char *next = (const char *)(it->w + weight_row(it, o + 4 < it->n1 ? o + 4 : o) * kh + 16 * b0);
        decode_row_bf16(it->w + weight_row(it, o) * kh + 16 * b0, it->s + weight_row(it, o) * nb + b0, nbc, next,
                        wbuf + j * 2 * npc);
      }
      size_t pos[4];
      for (size_t j = 0; j < 4; ++j) pos[j] = o0 + j < it->n1 ? tile_pos(it, o0 + j) : MAX_TILE_N;
      for (size_t r0 = 0; r0 < rows; r0 += 4) {
        const size_t rb = rows - r0 < 4 ? rows - r0 : 4;
        float res[16];
        switch (rb) {
          case 1: bgemm_4x1(wbuf, npc, xc + r0 * xrow, xrow, res); break;
          case 2: bgemm_4x2(wbuf, npc, xc + r0 * xrow, xrow, res); break;
          case 3: bgemm_4x3(wbuf, npc, xc + r0 * xrow, xrow, res); break;
          default: bgemm_4x4(wbuf, npc, xc + r0 * xrow, xrow, res); break;
        }
        for (size_t j = 0; j < 4; ++j) {
          if (pos[j] == MAX_TILE_N) continue;
          for (size_t r = 0; r < rb; ++r) buf[r0 + r][pos[j]] = (p0 ? buf[r0 + r][pos[j]] : 0.0f) + res[j * 4 + r];
        }
      }
    }
  }
  write_tile(it, buf);
}

#if MXMOE_AMX
/* Asks Linux for the AMX tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)): 0 when granted.  The
 * grant is per process and the request idempotent (~0.2 us), so every item that would use the tiles asks, whatever
 * loaded the module; a kernel that refuses (older than 5.16) leaves the items to the AVX-512 GEMM. */
static inline long amx_permission(void) {
  long ret;
  __asm__ volatile("syscall" : "=a"(ret) : "0"(158L), "D"(0x1023L), "S"(18L) : "rcx", "r11", "memory");
  return ret;
}

/* LDTILECFG's 64-byte operand (palette 1) */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config_t;

/* LDTILECFG of cfg.  GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the operand, so stores to the
 * rows and widths may be dropped as dead (a prototype on 2026-11-29 lost all of them: the first tile load then
 * faulted); the operand is passed whole here. */
static inline void amx_load_config(const amx_config_t *cfg) {
  __asm__ volatile("ldtilecfg %0" : : "m"(*cfg));
}

/* 16 rows of 16 dwords -> their transpose (r[i] dword j -> r[j] dword i) */
static inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) { /* u[4i + j], 128-bit lane L: dword 4L + j of rows 4i..4i+3 */
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

/* the AMX GEMM's stack buffer of a K chunk (64 KB, later the results' buffer; with the C tiles' 16 KB within IREE's
 * 128 KB worker stacks): two A buffers of 16 decoded weight rows and the activation rows in tile order; the chunk is
 * as long as it lets (10 pairs with one row group, 4 with four), an even number of pairs (a chunk starts a quad).
 * Single-thread harness, 8 rows by 64 x 2880 weights in L2: chunks of 2 / 4 / 8 pairs 116 / 83 / 74 us (the decode's
 * per-call cost, 2026-11-29 morning); a 32 / 40 / 48 KB buffer measured level with 64 KB at 8-64 rows (2026-11-29). */
#define AMX_WORK_ZMM 1024
/* bytes ahead in each weight row that the decode prefetches: a chunk reads 128-640 B of each of 16 rows (1.4 KB apart
 * for gpt-oss), which the hardware prefetchers do not follow (8-16 rows from DRAM without it, 2-pair chunks: 2.1-2.6 ms
 * against 1.1-1.4 per 2880 x 2880; 512-1024 bytes ahead no better than 256) */
#define AMX_PREFETCH 256
/* The GEMM on AMX tiles (TDPBF16PS: 16 x 16 f32 += 16 x 32 bf16 by 32 x 16 bf16).  Per K chunk the activation rows,
 * 16 per row group (zeros past the last), are transposed to the B tiles' pair layout (row i: values 2i and 2i + 1 of
 * 16 rows); then per output group of 16 weight rows the rows are decoded as for the AVX-512 GEMM (scales applied, the
 * packed activations' order) into one of two A buffers (16 outputs x 32 values per slice) and meet every B tile.  The
 * tile unit runs a group's TDPBF16PS while the core decodes the next group into the other buffer: decoding all of a
 * chunk's groups before their tile ops left both idle in turn (benchmarks/cpu_amx.c, 256 x 2880 in L2, one thread,
 * 8 / 16 / 64 rows: 70.4 / 70.5 / 164.4 us before, 53.8 / 54.0 / 157.5 after; from DRAM 988 -> 873 us at 8 rows).  At
 * 64 rows the parts, each left out in turn: the decode ~48 us, the activation rows' loads, transposes and stores ~50
 * (redone by every output tile of the item's rows), the tile ops ~60.  One row group keeps each output group's C tile
 * in its tile register for the whole item (zeroed in the first chunk, stored after the last); more load and store
 * theirs per chunk.  The products are exact and TDPBF16PS sums them in f32, as vdpbf16ps
 * does (its order of additions differs).  Returns 0 when the kernel refuses the tiles (nothing written). */
static int item_amx(const item_t *it, const uint16_t *x0) {
  if (amx_permission() != 0) return 0;
  const size_t nb = it->nb, np = row_pairs(nb), xrow = 64 * np, kh = nb * 16, rows = it->rows;
  const size_t m = it->n1 - it->n0, nog = (m + 15) / 16, ntg = (rows + 15) / 16;
  /* per pair: two A buffers of 16 rows x 2 vectors, and per row group 32 B rows of 16 dwords */
  const size_t cp = AMX_WORK_ZMM / (64 + 32 * ntg) / 2 * 2;
  union {
    __m512i work[AMX_WORK_ZMM];
    float buf[MAX_ITEM_ROWS][MAX_TILE_N]; /* after the last chunk, the results by row */
  } u;
  __m512i *const xv = u.work + 64 * cp;
  float acc[MAX_TILE_N / 16][MAX_ITEM_ROWS / 16][16][16];
  amx_config_t cfg = {0};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  amx_load_config(&cfg);
  /* C tiles: output group og in tile og (the intrinsics take constant tile numbers); AMX_C_OP(OP, og, ptr) is OP(og,
   * ptr, 64) on C tile og, e.g. AMX_DP46: its TDPBF16PS with A tile 4 and B tile 6, AMX_ZERO: zeroing it */
#define AMX_C_OP(OP, og, ptr)                \
  switch (og) {                              \
    case 0: OP(0, ptr, 64); break;           \
    case 1: OP(1, ptr, 64); break;           \
    case 2: OP(2, ptr, 64); break;           \
    default: OP(3, ptr, 64); break;          \
  }
#define AMX_DP46(c, unused, stride) _tile_dpbf16ps(c, 4, 6)
#define AMX_DP57(c, unused, stride) _tile_dpbf16ps(c, 5, 7)
#define AMX_ZERO(c, unused, stride) _tile_zero(c)
  for (size_t p0 = 0; p0 < np; p0 += cp) {
    const size_t npc = np - p0 < cp ? np - p0 : cp;
    const size_t b0 = 2 * p0, nbc = nb - b0 < 2 * npc ? nb - b0 : 2 * npc, slices = 2 * npc;
    for (size_t g = 0; g < ntg; ++g)
      for (size_t sl = 0; sl < slices; ++sl) {
        __m512i r[16];
        for (size_t t = 0; t < 16; ++t)
          r[t] = 16 * g + t < rows ? _mm512_loadu_si512((const void *)(x0 + (16 * g + t) * xrow + 64 * p0 + 32 * sl))
                                   : _mm512_setzero_si512();
        transpose16x16(r);
        for (size_t i = 0; i < 16; ++i) _mm512_store_si512((void *)(xv + (g * 32 * npc + 16 * sl + i)), r[i]);
      }
    for (size_t og = 0; og < nog; ++og) {
      __m512i *const a = u.work + (og & 1) * 32 * cp;
      for (size_t j = 0; j < 16; ++j) { /* rows past the tile repeat its last */
        const size_t o = it->n0 + 16 * og + j < it->n1 ? it->n0 + 16 * og + j : it->n1 - 1;
        const uint8_t *wrow = it->w + weight_row(it, o) * kh + 16 * b0;
        decode_row_bf16(wrow, it->s + weight_row(it, o) * nb + b0, nbc, (const char *)wrow + AMX_PREFETCH,
                        a + j * slices);
      }
      const size_t as = slices * 64; /* bytes between decoded rows */
      for (size_t g = 0; g < ntg; ++g) {
        const __m512i *b = xv + g * 32 * npc;
        if (p0 == 0) AMX_C_OP(AMX_ZERO, og, 0)
        else if (ntg > 1) AMX_C_OP(_tile_loadd, og, acc[og][g])
        for (size_t sl = 0; sl < slices; ++sl) { /* A and B tiles alternate registers 4 / 5 and 6 / 7 */
          if (sl & 1) {
            _tile_loadd(7, b + 16 * sl, 64);
            _tile_loadd(5, a + sl, as);
            AMX_C_OP(AMX_DP57, og, 0)
          } else {
            _tile_loadd(6, b + 16 * sl, 64);
            _tile_loadd(4, a + sl, as);
            AMX_C_OP(AMX_DP46, og, 0)
          }
        }
        if (ntg > 1 || p0 + cp >= np) AMX_C_OP(_tile_stored, og, acc[og][g])
      }
    }
  }
#undef AMX_C_OP
#undef AMX_DP46
#undef AMX_DP57
#undef AMX_ZERO
  _tile_release();
  for (size_t o = it->n0; o < it->n1; ++o) {
    const size_t j = o - it->n0, pos = tile_pos(it, o);
    for (size_t r = 0; r < rows; ++r) u.buf[r][pos] = acc[j / 16][r / 16][j % 16][r % 16];
  }
  write_tile(it, u.buf);
  return 1;
}
#endif
#endif

/* the out memref's first element: f32, or with the GLU epilogue the activation type's */
#define OUT_AT(out, glu) ((void *)(out + out##_off * ((glu).act != GLU_NONE ? kind_size((glu).kind) : 4)))

/* xq, xs: prepared rows in sorted order (mxmoe_mxfp4_quantize_rows, x_kind as given to it); w: [E, n,
 * k / 2]; s: [E, n, k / 32]; bias: [E, n] of bias_kind; info, counts: the work items of
 * mxmoe_group_slots; order[p]: the slot of sorted row p; out: [S, n] f32 by slot.  Workgroup (tile, u)
 * computes outputs [tile * tile_n, +tile_n) of work item u; workgroup (tile, items) writes zeros to those
 * outputs of the slots with no expert (sorted rows nvalid..S).  `pairs` (the gate/up order; n even where it is
 * not 0): 0 outputs in their order; 1 interleaved gate/up rows, output o going to column o / 2 + (o odd ? n / 2 :
 * 0), i.e. [gate | up] halves, which the GLU that follows reads with unit stride; 2 (GLU epilogue only) gate rows
 * [0, n / 2) and up rows [n / 2, n), taken in pairs (weight_row).  With glu != GLU_NONE the GLU epilogue
 * (glu_epilogue.c) writes out [S, n / 2] of out_kind instead (n and tile_n multiples of 32); glu_alpha and
 * glu_limit are the bits of the activation's f32 parameters. */
void mxmoe_mxfp4_grouped_matvec(MEMREF(const int16_t, xq), MEMREF(const float, xs),
                                MEMREF(const uint8_t, w), MEMREF(const uint8_t, s),
                                MEMREF(const void, bias), MEMREF(const int64_t, info),
                                MEMREF(const int32_t, counts), MEMREF(const int32_t, order),
                                MEMREF(char, out), size_t S, size_t n, size_t k, size_t x_kind,
                                size_t bias_kind, size_t pairs, size_t tile_n, size_t tile, size_t u,
                                size_t glu, size_t glu_alpha, size_t glu_limit, size_t out_kind) {
  item_t it;
  const glu_t g = glu_params(glu, out_kind, glu_alpha, glu_limit);
  const ptrdiff_t first = work_item(&it, AT(w), AT(s), AT(bias), AT(info), AT(counts), AT(order), OUT_AT(out, g), S,
                                    n, k, bias_kind, pairs, tile_n, tile, u, g);
  if (first < 0) return;
  const size_t nb = k / 32;
  const size_t xq_row = 64 * row_pairs(nb);
#if MXMOE_BF16
  if (x_kind == KIND_BF16) {
    item_bf16(&it, (const uint16_t *)AT(xq) + first * xq_row);
    return;
  }
#endif
  (void)x_kind;
  item_int16(&it, AT(xq) + first * xq_row, AT(xs) + first * scale_row(nb));
}

/* the int8-activation form (activations="mxint8", weights in the cpu-mxfp4-rows16 layout) */
#include "mxint8_rows16.c"
/* the bf16 form on rows16 weights (AMX hosts' bf16 layers) */
#include "bf16_rows16.c"
