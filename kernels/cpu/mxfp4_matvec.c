/* mxmoe CPU microkernels: grouped MXFP4 matvec (weights in the cpu-mxfp4-blocksplit layout) and the
 * quantization of its activation rows.
 *
 * Linked into IREE dispatches (hal.executable.objects) by the cpu lowering: freestanding C with no libc,
 * no writable globals, no TLS.  Needs x86-64 with AVX2, FMA and F16C; mxmoe checks the host has them
 * before it builds and links this file.  Every entry point is one IREE workgroup.
 *
 * Rows: a grouped matmul has S = tokens x top_k rows ("slots", flat token order).  The lowering sorts
 * them by expert on the device; order[p] is the slot at sorted position p.  The quantizer reads the
 * activation row of sorted row p from x[order[p] / div] and writes it in sorted order; the matvec reads
 * sorted rows and writes each result row back to its slot, out[order[p]], so what follows the kernel
 * works in token order with no gather.
 *
 * Activations (mxmoe_mxfp4_quantize_rows): int16 with one power-of-two scale per 32-value block.  E is
 * the binary exponent of the block's largest magnitude, clamped to [-100, 127]; q = round(x * 2^(14 - E))
 * (|q| <= 32767, ties to even), so every value within 2^7 of the block's largest is exact and smaller
 * ones are rounded to a multiple of 2^(E - 14).  The stored scale is 2^(E - 14) / 512 (the decode below
 * yields 512 x the e2m1 value); a block holding an inf or NaN gets q = 0 and a NaN scale.
 *
 * Weights: in each 32-value block (16 bytes) byte b holds value b in its low nibble and value b + 16 in
 * its high nibble.  A nibble indexes (vpshufb) a table of 2 x the e2m1 value as an int8 (0, 1, 2, 3, 4,
 * 6, 8, 12 and negatives), which is interleaved above a zero byte: an int16 of 512 x the value.  A block's
 * products are then one exact integer sum (vpmaddwd): |sum| <= 32 x 3072 x 32767 < 2^32 is a multiple of
 * 512 whose quotient is < 2^24, so the int32 sum and its f32 conversion are exact, and the block is scaled
 * once by (weight scale x activation scale), both powers of two.  Only the f32 accumulation over blocks
 * rounds.
 *
 * Data order: blocks go in pairs (one ymm of 32 weight bytes).  xq holds, per pair, the int16 activations
 * in the order the decode produces them: [block 2p values 8j..8j+7 | block 2p+1 values 8j..8j+7] for
 * j = 0..3 (64 values; zeros for a missing last block).  xs holds one scale per block, a row padded with
 * zeros to a multiple of 8 blocks: the kernel reads the scales of 4 pairs at once.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* an MLIR memref<?xT> argument: allocated pointer, aligned pointer, offset, size, stride */
#define MEMREF(T, name) T *name##_alloc, T *name, size_t name##_off, size_t name##_size, size_t name##_stride
#define AT(name) (name + name##_off)

/* element kinds of activations and biases (the lowering passes these codes) */
enum { KIND_NONE = 0, KIND_BF16 = 1, KIND_F32 = 2, KIND_F16 = 3 };

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

/* ------------------------------------------------------------------------------------ quantization */

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

/* One row of k activations (kind) -> its int16 values (64 per pair, xq's order) and block scales. */
static void quantize_row(const void *x, size_t kind, size_t k, int16_t *xq, float *xs) {
  const size_t nb = k / 32, np = row_pairs(nb);
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
  for (size_t b = 0; b < nb; ++b) {
    __m256 v[4];
    __m256i m = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      v[j] = load8(x, kind, 32 * b + 8 * j);
      /* magnitudes compare as integers; inf and NaN are above every finite value */
      m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(v[j]), absmask));
    }
    const int32_t ebits = hmax_epi32(m) >> 23;
    int32_t e = ebits - 127;
    e = e < -100 ? -100 : e > 127 ? 127 : e;
    union { uint32_t u; float f; } up = {(uint32_t)(14 - e + 127) << 23}, sc = {(uint32_t)(e - 23 + 127) << 23};
    const int finite = ebits != 255;
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

/* x: rows of k activations of x_kind; sorted row p comes from row order[p] / div.  xq: [S, 64 np] int16,
 * xs: [S, scale_row(nb)] f32 (nb = k / 32, np = ceil(nb / 2)).  Workgroup wg quantizes sorted rows
 * [wg * rows_per_wg, +rows_per_wg) of the S = `rows`. */
void mxmoe_mxfp4_quantize_rows(MEMREF(const void, x), MEMREF(const int32_t, order), MEMREF(int16_t, xq),
                               MEMREF(float, xs), size_t k, size_t div, size_t x_kind, size_t rows_per_wg,
                               size_t rows, size_t wg) {
  const size_t nb = k / 32, esize = x_kind == KIND_F32 ? 4 : 2;
  const size_t p1 = (wg + 1) * rows_per_wg < rows ? (wg + 1) * rows_per_wg : rows;
  for (size_t p = wg * rows_per_wg; p < p1; ++p) {
    const size_t src = (size_t)AT(order)[p] / div;
    quantize_row((const char *)AT(x) + src * k * esize, x_kind, k, AT(xq) + p * 64 * row_pairs(nb),
                 AT(xs) + p * scale_row(nb));
  }
}

/* ------------------------------------------------------------------------------------------ matvec */

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

/* xq, xs: quantized rows in sorted order (mxmoe_mxfp4_quantize_rows); w: [E, n, k / 2]; s: [E, n, k / 32];
 * bias: [E, n] of bias_kind; info[u] = id | first sorted row << 16 | rows << 40 for u < nused[0];
 * order[p]: the slot of sorted row p; out: [S, n] f32 by slot.  Workgroup (tile, u) computes outputs
 * [tile * tile_n, +tile_n) of the u-th used expert's rows.  With `deinterleave` (n even) output o goes to
 * column o / 2 + (o odd ? n / 2 : 0): interleaved gate/up rows come out as [gate | up] halves, which the
 * GLU that follows reads with unit stride. */
void mxmoe_mxfp4_grouped_matvec(MEMREF(const int16_t, xq), MEMREF(const float, xs),
                                MEMREF(const uint8_t, w), MEMREF(const uint8_t, s),
                                MEMREF(const void, bias), MEMREF(const int64_t, info),
                                MEMREF(const int32_t, nused), MEMREF(const int32_t, order),
                                MEMREF(float, out), size_t n, size_t k, size_t bias_kind, size_t deinterleave,
                                size_t tile_n, size_t tile, size_t u) {
  if ((int64_t)u >= (int64_t)AT(nused)[0]) return;
  const uint64_t pk = (uint64_t)AT(info)[u];
  const size_t id = pk & 0xFFFF, first = (pk >> 16) & 0xFFFFFF, rows = pk >> 40;
  const size_t nb = k / 32, xq_row = 64 * row_pairs(nb), xs_row = scale_row(nb), n0 = tile * tile_n;
  const size_t n1 = n0 + tile_n < n ? n0 + tile_n : n;
  const uint8_t *wexp = AT(w) + id * n * (k / 2), *sexp = AT(s) + id * n * nb;
  const int16_t *xq0 = AT(xq) + first * xq_row;
  const float *xs0 = AT(xs) + first * xs_row;
  const int32_t *slot = AT(order) + first;
  float *ys = AT(out);
  const void *bexp = (const char *)AT(bias) + id * n * (bias_kind == KIND_F32 ? 4 : 2);
  for (size_t o = n0; o < n1; ++o) {
    const uint8_t *wrow = wexp + o * (k / 2), *srow = sexp + o * nb;
    const float b = bias_value(bexp, bias_kind, o);
    const size_t col = deinterleave ? o / 2 + (o % 2) * (n / 2) : o;
    float res[4];
    for (size_t r0 = 0; r0 < rows; r0 += 4) {
      const size_t nr = rows - r0 < 4 ? rows - r0 : 4;
      const int16_t *xq = xq0 + r0 * xq_row;
      const float *xsr = xs0 + r0 * xs_row;
      switch (nr) {
        case 1: dot_rows_1(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
        case 2: dot_rows_2(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
        case 3: dot_rows_3(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
        default: dot_rows_4(wrow, srow, nb, xq, xq_row, xsr, xs_row, res); break;
      }
      for (size_t r = 0; r < nr; ++r) ys[(size_t)slot[r0 + r] * n + col] = res[r] + b;
    }
  }
}
