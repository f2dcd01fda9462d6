/* mxmoe CPU microkernel: grouped MXFP4 matvec, weights in the cpu-mxfp4-blocksplit layout.
 *
 * Linked into IREE dispatches (hal.executable.objects) by the cpu lowering: freestanding C with no libc,
 * no writable globals, no TLS.  Needs x86-64 with AVX2, FMA and F16C; mxmoe checks the host has them
 * before it builds and links this file.
 *
 * One call is one IREE workgroup: for the u-th expert the routing picked (its id, first sorted row and
 * row count are packed in info[u]), outputs [tile * tile_n, +tile_n) of each of its rows:
 *     out[row, o] = bias[id, o] + sum_k x[row, k] * w(id, o, k)
 *
 * Weights: in each 32-value block (16 bytes) byte b holds value b in its low nibble and value b + 16 in
 * its high nibble.  A nibble indexes (vpshufb) a table of 2 x the e2m1 value as an int8 (0, 1, 2, 3, 4,
 * 6, 8, 12 and negatives), which is interleaved above a zero byte: an int16 of 512 x the value.
 *
 * Activations arrive as int16 with one power-of-two scale per 32-value block (see docs/cpu.md "int16
 * activations"), so a whole block's products are one exact integer sum (vpmaddwd): |sum| <= 32 x 3072 x
 * 32767 < 2^32 is a multiple of 512 whose quotient is < 2^24, so the int32 sum and its f32 conversion are
 * exact, and the block is scaled once by (weight scale x activation scale), both powers of two.
 * Only the f32 accumulation over blocks rounds.
 *
 * Data order: blocks go in pairs (one ymm of 32 weight bytes); xq holds, per pair, the int16 activations
 * in the order the decode produces them: [block 2p values 8j..8j+7 | block 2p+1 values 8j..8j+7] for
 * j = 0..3 (64 values), a lone last block (odd block count) in natural order followed by 32 zeros.
 * xs holds, per pair, [scale of block 2p] x 4 then [scale of block 2p+1] x 4 (0 for a missing block).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* an MLIR memref<?xT> argument: allocated pointer, aligned pointer, offset, size, stride */
#define MEMREF(T, name) T *name##_alloc, T *name, size_t name##_off, size_t name##_size, size_t name##_stride
#define AT(name) (name + name##_off)

/* 2 x the e2m1 value of the codes 0..15 */
#define E2M1_X2 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static inline float bias_value(const void *bias, size_t kind, size_t i) {
  union { uint32_t u; float f; } v;
  switch (kind) {
    case 1: v.u = (uint32_t)((const uint16_t *)bias)[i] << 16; return v.f; /* bf16 */
    case 2: return ((const float *)bias)[i];                                /* f32 */
    case 3: return _cvtsh_ss(((const uint16_t *)bias)[i]);                  /* f16 */
    default: return 0.0f;
  }
}

/* e8m0 byte -> f32 2^(b - 127) / 512 (the decode's int16 are 512 x the value): byte 0 is 2^-127 / 512, 255
 * is NaN */
static inline float weight_scale(uint32_t b) {
  union { uint32_t u; float f; } v;
  v.u = b << 23 | (uint32_t)(((b + 1) & 0xFE) == 0) << 22;
  return v.f * (1.0f / 512.0f);
}

/* weight scales are decoded a chunk of block pairs at a time (bounds the stack use) */
#define CHUNK_PAIRS 256

/* The scales of block pairs [p0, p1) of a row with nb blocks, as dot_rows reads them: per pair
 * [scale of block 2p] x 4 then [scale of block 2p + 1] x 4 (0 for a block at or past nb); times the
 * activation scales xs (same order) when given. */
static void weight_scales(const uint8_t *srow, size_t nb, size_t p0, size_t p1, const float *xs, float *out) {
  const __m256i one = _mm256_set1_epi32(1), fe = _mm256_set1_epi32(0xFE), bit22 = _mm256_set1_epi32(1 << 22);
  const __m256 inv512 = _mm256_set1_ps(1.0f / 512.0f);
  const __m256i q0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), q1 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  const __m256i q2 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), q3 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
  size_t p = p0;
  for (; p + 4 <= p1 && 2 * p + 8 <= nb; p += 4) { /* 8 whole blocks */
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(srow + 2 * p)));
    const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_add_epi32(b, one), fe), _mm256_setzero_si256());
    const __m256 f = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(b, 23), _mm256_and_si256(special, bit22))), inv512);
    float *o = out + 8 * (p - p0);
    _mm256_storeu_ps(o, _mm256_permutevar8x32_ps(f, q0));
    _mm256_storeu_ps(o + 8, _mm256_permutevar8x32_ps(f, q1));
    _mm256_storeu_ps(o + 16, _mm256_permutevar8x32_ps(f, q2));
    _mm256_storeu_ps(o + 24, _mm256_permutevar8x32_ps(f, q3));
    if (xs)
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * i), _mm256_loadu_ps(xs + 8 * (p + i))));
  }
  for (; p < p1; ++p) {
    const float a = weight_scale(srow[2 * p]), c = 2 * p + 1 < nb ? weight_scale(srow[2 * p + 1]) : 0.0f;
    float *o = out + 8 * (p - p0);
    o[0] = o[1] = o[2] = o[3] = a;
    o[4] = o[5] = o[6] = o[7] = c;
    if (xs)
      for (int i = 0; i < 8; ++i) o[i] *= xs[8 * p + i];
  }
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

/* One pair of blocks (p) of R activation rows against decoded weights d; scale ws, or ws x xs when XS. */
#define PAIR_ROWS(R, ACC, XS)                                                                        \
  for (int r = 0; r < R; ++r) {                                                                     \
    const __m256i *xp = (const __m256i *)(xq + r * xq_row + 64 * p);                                \
    const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(d[0], _mm256_loadu_si256(xp)),           \
                                         _mm256_madd_epi16(d[1], _mm256_loadu_si256(xp + 1)));      \
    const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(d[2], _mm256_loadu_si256(xp + 2)),       \
                                         _mm256_madd_epi16(d[3], _mm256_loadu_si256(xp + 3)));      \
    const __m256 sc = XS ? _mm256_mul_ps(ws, _mm256_loadu_ps(xs + r * xs_row + 8 * p)) : ws;        \
    ACC[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s01, s23)), sc, ACC[r]);           \
  }

/* R (1..4) activation rows (xq/xs strides xq_row/xs_row) against one weight row.  With one row the
 * activation scales are folded into the weight scale table, so the loop multiplies nothing extra. */
#define DOT_ROWS(R)                                                                                  \
  static void dot_rows_##R(const uint8_t *wrow, const uint8_t *srow, size_t nb, const int16_t *xq, \
                           size_t xq_row, const float *xs, size_t xs_row, float *res) {             \
    const size_t np = (nb + 1) / 2, full = nb / 2;                                                  \
    float wsc[8 * CHUNK_PAIRS];                                                                     \
    __m256 acc0[R], acc1[R];                                                                        \
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();                            \
    for (size_t c0 = 0; c0 < np; c0 += CHUNK_PAIRS) {                                               \
      const size_t c1 = c0 + CHUNK_PAIRS < np ? c0 + CHUNK_PAIRS : np;                              \
      weight_scales(srow, nb, c0, c1, R == 1 ? xs : NULL, wsc);                                     \
      const size_t cf = c1 < full ? c1 : full; /* pairs of two whole blocks */                      \
      size_t p = c0;                                                                                \
      for (; p + 2 <= cf; p += 2) {                                                                 \
        __m256i d[4];                                                                               \
        decode_pair(wrow + 32 * p, 0, d);                                                           \
        __m256 ws = _mm256_loadu_ps(wsc + 8 * (p - c0));                                            \
        PAIR_ROWS(R, acc0, R > 1)                                                                   \
        ++p;                                                                                        \
        decode_pair(wrow + 32 * p, 0, d);                                                           \
        ws = _mm256_loadu_ps(wsc + 8 * (p - c0));                                                   \
        PAIR_ROWS(R, acc1, R > 1)                                                                   \
        --p;                                                                                        \
      }                                                                                             \
      for (; p < c1; ++p) { /* an odd pair out, and a lone last block */                            \
        __m256i d[4];                                                                               \
        decode_pair(wrow + 32 * p, 2 * p + 1 == nb, d);                                             \
        const __m256 ws = _mm256_loadu_ps(wsc + 8 * (p - c0));                                      \
        PAIR_ROWS(R, acc0, R > 1)                                                                   \
      }                                                                                             \
    }                                                                                               \
    for (int r = 0; r < R; ++r) res[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));                     \
  }
DOT_ROWS(1)
DOT_ROWS(2)
DOT_ROWS(3)
DOT_ROWS(4)

/* xq: [S, 64 * np] int16, xs: [S, 8 * np] f32 (np = ceil(k / 64)), rows in expert order;
 * w: [E, n, k / 2]; s: [E, n, k / 32]; bias: [E, n] of bias_kind (0 none, 1 bf16, 2 f32, 3 f16);
 * info[u] = id | first row << 16 | rows << 40 for u < nused[0]; out: [S, n] f32. */
void mxmoe_mxfp4_grouped_matvec(MEMREF(const int16_t, xq), MEMREF(const float, xs),
                                             MEMREF(const uint8_t, w), MEMREF(const uint8_t, s),
                                             MEMREF(const void, bias), MEMREF(const int64_t, info),
                                             MEMREF(const int32_t, nused), MEMREF(float, out), size_t n,
                                             size_t k, size_t bias_kind, size_t tile_n, size_t tile, size_t u) {
  if ((int64_t)u >= (int64_t)AT(nused)[0]) return;
  const uint64_t pk = (uint64_t)AT(info)[u];
  const size_t id = pk & 0xFFFF, first = (pk >> 16) & 0xFFFFFF, rows = pk >> 40;
  const size_t nb = k / 32, np = (nb + 1) / 2, n0 = tile * tile_n;
  const size_t n1 = n0 + tile_n < n ? n0 + tile_n : n;
  const uint8_t *wexp = AT(w) + id * n * (k / 2), *sexp = AT(s) + id * n * nb;
  const int16_t *xq0 = AT(xq) + first * 64 * np;
  const float *xs0 = AT(xs) + first * 8 * np;
  float *ys = AT(out) + first * n;
  const void *bexp = (const char *)AT(bias) + id * n * (bias_kind == 2 ? 4 : 2);
  for (size_t o = n0; o < n1; ++o) {
    const uint8_t *wrow = wexp + o * (k / 2), *srow = sexp + o * nb;
    const float b = bias_value(bexp, bias_kind, o);
    float res[4];
    for (size_t r0 = 0; r0 < rows; r0 += 4) {
      const size_t nr = rows - r0 < 4 ? rows - r0 : 4;
      const int16_t *xq = xq0 + r0 * 64 * np;
      const float *xsr = xs0 + r0 * 8 * np;
      switch (nr) {
        case 1: dot_rows_1(wrow, srow, nb, xq, 64 * np, xsr, 8 * np, res); break;
        case 2: dot_rows_2(wrow, srow, nb, xq, 64 * np, xsr, 8 * np, res); break;
        case 3: dot_rows_3(wrow, srow, nb, xq, 64 * np, xsr, 8 * np, res); break;
        default: dot_rows_4(wrow, srow, nb, xq, 64 * np, xsr, 8 * np, res); break;
      }
      for (size_t r = 0; r < nr; ++r) ys[(r0 + r) * n + o] = res[r] + b;
    }
  }
}
