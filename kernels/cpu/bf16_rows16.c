/* mxmoe CPU microkernels, the bf16 form on rows16 weights (included by mxfp4_matvec.c after mxint8_rows16.c, whose
 * store16 and scale_byte_range it uses): the cpu target's form for bf16 layers on hosts with AMX tiles (flavor
 * avx512amx), exact like the blocksplit bf16 path.  Built in the AVX-512 BF16 flavors only.
 *
 * Why another form: the blocksplit GEMM feeds TDPBF16PS decoded weight rows as A tiles and has to transpose the
 * activation rows into B tiles for every output tile; here the activations are the A tiles as they lie in memory
 * and the weights are decoded straight into B tiles, which the rows16 layout makes one shift, one vpermw and one
 * saturating subtraction per B-tile row (benchmarks/cpu_amx.c, one thread: level with the blocksplit form at 1 row,
 * 1.1-2.3x at 2-64 before the passes below took items of 33-128 rows; docs/cpu.md has the layer's figures).  The
 * decode's bytes-to-words lookup by two vpshufb and a vpermt2b instead of vpermw (fewer port-0 slots, which the
 * tile unit also takes) measured 15-20% slower at 1-8 rows.
 *
 * Weights: cpu-mxfp4-rows16 (mxint8_rows16.c).  Per group of 16 rows and 32-value block, chunk j's 64 bytes are 16
 * dwords, dword i for row i; its 16-bit halves hold row i's values (4j, 16 + 4j, 4j + 1, 17 + 4j) and those + 2, a
 * nibble each.  Shifting the words by 4n and looking the low nibble up (vpermw of the 2^125-biased table, as the
 * blocksplit decode: the table repeats every 16 entries, so the next nibble's bit is ignored) gives 16 dwords of
 * bf16 pairs: row i's values V(j, n) and V(j, n) + 2, V = 4j, 16 + 4j, 4j + 1, 17 + 4j for n = 0..3.  That is row
 * 4j + n of a B tile (TDPBF16PS's pair layout: row q, dword i = the pair multiplied with A's columns 2q, 2q + 1 for
 * output column i), so one block of a group is one B tile of 16 weight rows.  The group's scales (16 bytes a block)
 * become one vector of per-dword subtrahends (value x 2^(s - 127) = the biased entry less (252 - s) << 7, exact for
 * bytes 2..252); a group with another byte takes the f32 decode (exact up to bf16 subnormals, NaN for 255).
 *
 * Activations (mxmoe_bf16_rows16_pack_rows): each sorted row's bf16 values, per block permuted so that columns 2q,
 * 2q + 1 hold V(j, n), V(j, n) + 2 (q = 4j + n: BF16R16_PERM), and each work item's rows packed where its first row's
 * would be, in bands of 32 rows from its first, each band block-major (r16_at: block b of a band of R rows is R x 64
 * bytes in one piece).  An A tile (16 rows of one block) is then 1 KB in one piece, read with stride 64, and the
 * tiles of a band's two row groups walk it in order, block after block.  (Before, the whole buffer was block-major:
 * consecutive blocks of a row were S x 64 bytes apart, a new 4 KB page for every tile at 512 tokens of gpt-oss-20b,
 * and that layer's 512 / 2048-token calls were 17-25% slower.)  Rows read past a band's end belong to the next block,
 * band or item and only give output rows nobody reads.
 *
 * Matmul (mxmoe_bf16_rows16_grouped_matmul): work items of up to 128 rows (BF16R16_MAX_ROWS), C tiles (groups of 16
 * weight rows) x (groups of 16 activation rows), over the blocks in order one TDPBF16PS per C tile and block.  With
 * one or two row groups, two weight groups at a time in one pass, the core decoding the next block's B tiles while
 * the tile unit multiplies (bf16r16_groups_amx); with more, two weight groups x two row groups per pass, in passes
 * over chunks of blocks that decode each B tile once for all the item's rows (bf16r16_groups_amx_pairs).  Every
 * output is its row's products summed in f32 in block order whatever the item's rows: batch invariant.  A kernel
 * that refuses the tile state gets the same products from vdpbf16ps (bf16r16_groups_avx, also the avx512bf16
 * flavor's form where it is asked for: MXMOE_CPU_BF16_LAYOUT).
 */

#if MXMOE_BF16

/* the largest work item of this form (rows: the grouping's chunk for it, cpu_ukernel.row_chunk): larger than the
 * other forms' MAX_ITEM_ROWS, since each of its work items decodes its weights once whatever its rows */
#define BF16R16_MAX_ROWS 128

/* the column of a packed block that holds value v: position 2q + e holds value V(j, n) + 2e, q = 4j + n */
static const uint16_t BF16R16_PERM[32] = {0, 2, 16, 18, 1, 3, 17, 19, 4, 6, 20, 22, 5, 7, 21, 23,
                                          8, 10, 24, 26, 9, 11, 25, 27, 12, 14, 28, 30, 13, 15, 29, 31};

/* Word offset, within its work item's packed rows, of block b of the item's row r (an item of n rows, nb blocks):
 * the item's rows in bands of 32 from its first, each band block-major (R = the band's rows: block b's rows of the
 * band are R x 64 bytes in one piece), so the tiles of one or two row groups walk their band in order. */
static inline size_t r16_at(size_t n, size_t nb, size_t b, size_t r) {
  const size_t j = r / 32, R = n - 32 * j < 32 ? n - 32 * j : 32;
  return (32 * j * nb + b * R + r % 32) * 32;
}

/* x: rows of k bf16 activations; sorted row p (p < counts[1]) comes from row order[p] / div.  info: the work items
 * (mxmoe_group_slots: by first row, which partition the valid rows).  xq: [S, k] words, each item's rows at its
 * first row's, in bands (r16_at).  Workgroup wg packs sorted rows [wg * rows_per_wg, +rows_per_wg).  xs is not
 * written. */
void mxmoe_bf16_rows16_pack_rows(MEMREF(const void, x), MEMREF(const int32_t, order), MEMREF(const int32_t, counts),
                                 MEMREF(const int64_t, info), MEMREF(uint16_t, xq), MEMREF(float, xs), size_t k,
                                 size_t div, size_t x_kind, size_t rows_per_wg, size_t wg, size_t S) {
  (void)x_kind, (void)S; /* bf16 only: the lowering gives this form bf16 layers */
  const size_t nb = k / 32, rows = (size_t)AT(counts)[1], items = (size_t)AT(counts)[0];
  const int64_t *tab = AT(info);
  const size_t p0 = wg * rows_per_wg, p1 = p0 + rows_per_wg < rows ? p0 + rows_per_wg : rows;
  const __m512i perm = _mm512_loadu_si512((const void *)BF16R16_PERM);
  size_t lo = 0, hi = items; /* the last item whose first row is <= p0 */
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if ((size_t)tab[2 * mid] <= p0) lo = mid;
    else hi = mid;
  }
  for (size_t p = p0, i = lo; p < p1; ++p) {
    while ((size_t)tab[2 * i] + ((uint64_t)tab[2 * i + 1] >> 32) <= p) ++i;
    const size_t f = (size_t)tab[2 * i], n = (uint64_t)tab[2 * i + 1] >> 32;
    const uint16_t *src = (const uint16_t *)AT(x) + (size_t)AT(order)[p] / div * k;
    uint16_t *dst = AT(xq) + f * k;
    for (size_t b = 0; b < nb; ++b)
      _mm512_storeu_si512((void *)(dst + r16_at(n, nb, b, p - f)),
                          _mm512_permutexvar_epi16(perm, _mm512_loadu_si512((const void *)(src + 32 * b))));
  }
}

/* bytes ahead in a group's weights (one 23 KB stream per group for gpt-oss) that the decode prefetches */
#ifndef BF16R16_PREFETCH
#define BF16R16_PREFETCH 4096
#endif

/* the blocksplit decode's subtrahends (scale_subtrahends) of a block's 16 scale bytes sv, one per dword (both of its
 * words: a weight row's pair) */
static inline __m512i bf16r16_subs(__m128i sv) {
  const __m512i d = _mm512_cvtepu8_epi32(sv);
  return scale_subtrahends(_mm512_or_si512(d, _mm512_slli_epi32(d, 16)));
}

/* f32 lane l of a 32-word vector's low / high half is word l / 16 + l: dword (l / 2) / (8 + l / 2), i.e. row */
static const uint32_t BF16R16_LO[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const uint32_t BF16R16_HI[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

/* A block of a group whose scale bytes leave 2..252, through f32 (see bf16r16_btile); kept out of line, the rare
 * case (inlined, it made the fast decode's loop slower) */
static __attribute__((noinline)) void bf16r16_btile_exact(const uint8_t *wb, const uint8_t *sb, __m512i *dst) {
  const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16);
  const __m512 f = scales16(sb, 16, 0);
  const __m512 s_lo = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)BF16R16_LO), f);
  const __m512 s_hi = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)BF16R16_HI), f);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * j));
    for (int n = 0; n < 4; ++n)
      dst[4 * j + n] = scale_exact(_mm512_permutexvar_epi16(_mm512_srl_epi16(v, _mm_cvtsi32_si128(4 * n)), tab),
                                   s_lo, s_hi);
  }
}

/* the fast form of bf16r16_btile: tab the 2^125-biased table, sub the block's subtrahends */
static inline void bf16r16_btile_fast(const uint8_t *wb, __m512i sub, __m512i tab, __m512i *dst) {
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * j));
    dst[4 * j] = _mm512_subs_epu16(_mm512_permutexvar_epi16(v, tab), sub);
    dst[4 * j + 1] = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab), sub);
    dst[4 * j + 2] = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab), sub);
    dst[4 * j + 3] = _mm512_subs_epu16(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab), sub);
  }
}

/* One block of a group (256 weight bytes at wb, 16 scale bytes at sb) -> its B tile, 16 rows of 16 dwords at dst:
 * the fast form when every scale byte is in 2..252 (tab: E2M1_BF16_HI), else the f32 one. */
static inline void bf16r16_btile(const uint8_t *wb, const uint8_t *sb, __m512i tab, __m512i *dst) {
  const __m128i sv = _mm_loadu_si128((const __m128i *)sb);
  if (_mm_cmpgt_epu8_mask(_mm_sub_epi8(sv, _mm_set1_epi8(2)), _mm_set1_epi8((char)250))) {
    bf16r16_btile_exact(wb, sb, dst);
    return;
  }
  bf16r16_btile_fast(wb, bf16r16_subs(sv), tab, dst);
}

/* what one call of the groups' matmul needs: the item's activations (block-major buffer xq of S rows, the item's
 * first sorted row), its ng groups (first weight row of each) */
typedef struct {
  const item_t *it;
  const uint16_t *xq;
  size_t S, first, ng;
  const uint8_t *w[4], *s[4]; /* each group's first weight and scale bytes */
} bf16r16_call_t;

/* the decode of block b of a group (its first weight and scale bytes w, s) into a B tile, with the prefetch of the
 * group's weights ahead (to L2: to L1 it measured 5% slower at 1 token of gpt-oss-20b, 2 threads) */
static inline void bf16r16_decode(const uint8_t *w, const uint8_t *s, size_t b, __m512i tab, __m512i *dst) {
  for (int q = 0; q < 4; ++q) _mm_prefetch((const char *)(w + 256 * b + BF16R16_PREFETCH + 64 * q), _MM_HINT_T1);
  bf16r16_btile(w + 256 * b, s + 16 * b, tab, dst);
}

/* The call's groups against the item's rows with vdpbf16ps, 8 rows at a time (each B tile decoded once per 8 rows):
 * res[i][r][o] = sum over the blocks in order of row r's products with weight row o of group i. */
static void bf16r16_groups_avx(const bf16r16_call_t *c, float (*res)[BF16R16_MAX_ROWS][16]) {
  const size_t nb = c->it->nb, rows = c->it->rows;
  const uint16_t *const x = c->xq + c->first * 32 * nb;
  const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16_HI);
  for (size_t i = 0; i < c->ng; ++i)
    for (size_t r0 = 0; r0 < rows; r0 += 8) {
      const size_t nr = rows - r0 < 8 ? rows - r0 : 8;
      __m512 acc[8];
      for (size_t r = 0; r < 8; ++r) acc[r] = _mm512_setzero_ps();
      for (size_t b = 0; b < nb; ++b) {
        __m512i bt[16];
        bf16r16_decode(c->w[i], c->s[i], b, tab, bt);
        for (size_t r = 0; r < nr; ++r) {
          const uint32_t *xr = (const uint32_t *)(x + r16_at(rows, nb, b, r0 + r));
          for (int q = 0; q < 16; ++q)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)bt[q], (__m512bh)_mm512_set1_epi32((int)xr[q]));
        }
      }
      for (size_t r = 0; r < nr; ++r) _mm512_storeu_ps(res[i][r0 + r], acc[r]);
    }
}

#if MXMOE_AMX
/* An A tile (16 rows from a): in place, or where it would read past the packed buffer (xq, end words), the rows within
 * it copied to tail (the rest zero).  A tile of a whole band holds its rows; a last band of R < 32 rows reads past its
 * end (into the next item's rows: output rows nobody reads) in its last block, and with R < 16 in its last 16 / R
 * blocks, so only the buffer's last item copies.  One row group's tile holds only the item's rows (the tile
 * configuration): no check. */
static inline const uint16_t *r16_a_tile(const uint16_t *a, const uint16_t *xq, size_t end, uint16_t *tail) {
  const size_t at = (size_t)(a - xq);
  if (__builtin_expect(at + 16 * 32 <= end, 1)) return a;
  for (size_t i = 0; i < 16 * 32; ++i) tail[i] = at + i < end ? a[i] : 0;
  return tail;
}

/* The call's groups (ng <= 2) against an item of one or two row groups (one band) on AMX tiles: C tile i * ntg + g is
 * group i x row group g (res[i][16 g + t][o]).  With one row group the A tile alternates registers 4 / 5 by block and
 * the groups' B tiles 6 / 7; with two, the groups' B tiles sit in 6 and 7 for the block and the row groups' A tiles
 * in 4 / 5.  Block b's B tiles are decoded (into one of two buffers) during block b - 1's tile ops, so their stores
 * drain before the tile loads read them. */
static void bf16r16_groups_amx(const bf16r16_call_t *c, float (*res)[BF16R16_MAX_ROWS][16]) {
  const size_t nb = c->it->nb, n = c->it->rows, ntg = (n + 15) / 16, ng = c->ng;
  const uint16_t *const x = c->xq + c->first * 32 * nb; /* one band: row group g of block b at (b n + 16 g) 32 */
  const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16_HI);
  const uint8_t *w[4], *sc[4];
  for (size_t i = 0; i < ng; ++i) w[i] = c->w[i], sc[i] = c->s[i];
  const size_t end = c->S * 32 * nb;
  uint16_t tail[2][16 * 32];
  /* the two blocks' B tiles, 512 bytes into their stack buffer: where the frame put them at its start, the harness
   * streamed one row's weights from DRAM 4-6% slower (fragile stack-layout effects, likely 4 KB aliasing with the
   * row's A tiles; benchmarks/cpu_amx.c dram, R=1) */
  __m512i bt_buf[2 * 4 * 16 + 8];
  __m512i(*const bt)[4][16] = (__m512i(*)[4][16])(bt_buf + 8);
  /* OP(tile, arg) on C tile t (the intrinsics take constant tile numbers) */
#define R16_C(OP, t, arg)         \
  switch (t) {                    \
    case 0: OP(0, arg); break;    \
    case 1: OP(1, arg); break;    \
    case 2: OP(2, arg); break;    \
    default: OP(3, arg); break;   \
  }
#define R16_ZERO(t, arg) _tile_zero(t)
#define R16_DP4(t, b) _tile_dpbf16ps(t, 4, b)
#define R16_DP5(t, b) _tile_dpbf16ps(t, 5, b)
#define R16_STORE(t, p) _tile_stored(t, p, 64)
  for (size_t t = 0; t < ng * ntg; ++t) R16_C(R16_ZERO, t, 0)
  for (size_t b = 0; b <= nb; ++b) {
    if (b > 0) {
      const size_t bp = b - 1;
      __m512i(*bb)[16] = bt[bp & 1];
      if (ntg == 1) {
        const uint16_t *a = x + bp * n * 32;
        if (bp & 1) _tile_loadd(5, a, 64);
        else _tile_loadd(4, a, 64);
        for (size_t i = 0; i < ng; ++i) {
          if (i & 1) {
            _tile_loadd(7, bb[i], 64);
            if (bp & 1) R16_C(R16_DP5, i, 7) else R16_C(R16_DP4, i, 7)
          } else {
            _tile_loadd(6, bb[i], 64);
            if (bp & 1) R16_C(R16_DP5, i, 6) else R16_C(R16_DP4, i, 6)
          }
        }
      } else {
        _tile_loadd(6, bb[0], 64);
        if (ng > 1) _tile_loadd(7, bb[1], 64);
        for (size_t g = 0; g < ntg; ++g) {
          const uint16_t *a = r16_a_tile(x + (bp * n + 16 * g) * 32, c->xq, end, tail[g]);
          if (g & 1) {
            _tile_loadd(5, a, 64);
            R16_C(R16_DP5, g, 6)
            if (ng > 1) R16_C(R16_DP5, ntg + g, 7)
          } else {
            _tile_loadd(4, a, 64);
            R16_C(R16_DP4, g, 6)
            if (ng > 1) R16_C(R16_DP4, ntg + g, 7)
          }
        }
      }
    }
    if (b < nb)
      for (size_t i = 0; i < ng; ++i) bf16r16_decode(w[i], sc[i], b, tab, bt[b & 1][i]);
  }
  for (size_t i = 0; i < ng; ++i)
    for (size_t g = 0; g < ntg; ++g) R16_C(R16_STORE, i * ntg + g, &res[i][16 * g][0])
#undef R16_C
#undef R16_ZERO
#undef R16_DP4
#undef R16_DP5
#undef R16_STORE
}

/* blocks of a chunk in bf16r16_groups_amx_pairs: its buffer of two groups' B tiles is 2 x R16_CHUNK KB of stack
 * (IREE's workers have 128 KB; with the item's 32 KB of results and the last tiles' 2 KB) */
#ifndef R16_CHUNK
#define R16_CHUNK 8
#endif

/* The call's groups (ng <= 2) against an item of 3-8 row groups in 2 x 2 C tiles: per chunk of R16_CHUNK blocks, the
 * first band (two row groups) decodes the chunk's B tiles into a buffer (the next block's during the current one's
 * tile ops) and the other bands read them back, so each B tile is decoded once per item and each tile load feeds two
 * TDPBF16PS.  The C tiles go to res between passes (exact: f32 in, f32 out), so every output still sums its blocks in
 * order.  C tile i * 2 + t is group i x the band's row group t; A tiles 4 / 5, B tiles 6 / 7.  One thread, 256 x
 * 2880 weights in L2 (benchmarks/cpu_amx.c): 64 rows 123 -> 97 us against one weight group x four row groups in one
 * pass (a B tile loaded for four TDPBF16PS but each A tile for one); chunks of 6-8 blocks measured best (4: 104-106, 12:
 * 122 us), where the buffer stays in L1. */
static void bf16r16_groups_amx_pairs(const bf16r16_call_t *c, float (*res)[BF16R16_MAX_ROWS][16]) {
  const size_t nb = c->it->nb, n = c->it->rows, ntg = (n + 15) / 16, ng = c->ng;
  const uint16_t *const x = c->xq + c->first * 32 * nb;
  const __m512i tab = _mm512_loadu_si512((const void *)E2M1_BF16_HI);
  const size_t end = c->S * 32 * nb;
  uint16_t tail[2][16 * 32];
  __m512i buf[R16_CHUNK][2][16];
  for (size_t b0 = 0; b0 < nb; b0 += R16_CHUNK) {
    const size_t nbc = nb - b0 < R16_CHUNK ? nb - b0 : R16_CHUNK;
    for (size_t h = 0; h < ntg; h += 2) {
      const int two = h + 1 < ntg, pair = ng > 1;
      float *const c0 = &res[0][16 * h][0], *const c1 = &res[0][16 * h + 16][0];
      float *const c2 = &res[pair][16 * h][0], *const c3 = &res[pair][16 * h + 16][0];
      if (b0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, c0, 64);
        if (two) _tile_loadd(1, c1, 64);
        if (pair) _tile_loadd(2, c2, 64);
        if (two && pair) _tile_loadd(3, c3, 64);
      }
      for (size_t j = 0; j <= nbc; ++j) {
        if (j > 0 || h > 0) {
          const size_t jp = h > 0 ? j : j - 1, b = b0 + jp;
          if (h > 0 && j == nbc) break;
          _tile_loadd(6, buf[jp][0], 64);
          if (pair) _tile_loadd(7, buf[jp][1], 64);
          const uint16_t *a = x + r16_at(n, nb, b, 16 * h); /* the pass's band: its two row groups in one piece */
          _tile_loadd(4, r16_a_tile(a, c->xq, end, tail[0]), 64);
          _tile_dpbf16ps(0, 4, 6);
          if (pair) _tile_dpbf16ps(2, 4, 7);
          if (two) {
            _tile_loadd(5, r16_a_tile(a + 16 * 32, c->xq, end, tail[1]), 64);
            _tile_dpbf16ps(1, 5, 6);
            if (pair) _tile_dpbf16ps(3, 5, 7);
          }
        }
        if (h == 0 && j < nbc)
          for (size_t i = 0; i < ng; ++i) bf16r16_decode(c->w[i], c->s[i], b0 + j, tab, buf[j][i]);
      }
      _tile_stored(0, c0, 64);
      if (two) _tile_stored(1, c1, 64);
      if (pair) _tile_stored(2, c2, 64);
      if (two && pair) _tile_stored(3, c3, 64);
    }
  }
}

#endif

/* One work item: its output tile's groups of 16 weight rows (with gate/up halves, each 32 outputs' gate group of rows
 * [o0 / 2, +16) and up group of rows [n / 2 + o0 / 2, +16)), two at a time (with one row group, four weight streams at
 * once measured 10-20% slower at 1-64 tokens of gpt-oss-20b, 2 threads, alternated runs, though faster in the
 * one-thread harness), then the results out as item_rows16 writes them (store16, or the GLU of the halves' pairs).
 * try_amx: 0 takes vdpbf16ps (the harness's comparison). */
static void item_bf16_rows16(const item_t *it, const uint16_t *xq, size_t S, size_t first, int try_amx) {
  const size_t nb = it->nb, rows = it->rows, ntg = (rows + 15) / 16, per = 2;
  size_t g0[MAX_TILE_N / 16], ngroups = 0;
  if (it->halves)
    for (size_t o0 = it->n0; o0 < it->n1; o0 += 32) g0[ngroups++] = o0 / 2, g0[ngroups++] = it->n / 2 + o0 / 2;
  else
    for (size_t o0 = it->n0; o0 < it->n1; o0 += 16) g0[ngroups++] = o0;
  float res[MAX_TILE_N / 16][BF16R16_MAX_ROWS][16];
#if MXMOE_AMX
  const int amx = try_amx && amx_permission() == 0;
  if (amx) {
    amx_config_t cfg = {0};
    cfg.palette = 1;
    /* C tiles 0-3 and A tiles 4-5 as many rows as the item has, up to 16 (a smaller item multiplies only its
     * rows), B tiles 6-7 sixteen */
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = t < 6 && rows < 16 ? (uint8_t)rows : 16;
    amx_load_config(&cfg);
  }
#else
  (void)try_amx;
#endif
  for (size_t q0 = 0; q0 < ngroups; q0 += per) {
    bf16r16_call_t c = {it, xq, S, first, ngroups - q0 < per ? ngroups - q0 : per, {0}, {0}};
    for (size_t i = 0; i < c.ng; ++i) c.w[i] = it->w + g0[q0 + i] * 16 * nb, c.s[i] = it->s + g0[q0 + i] * nb;
#if MXMOE_AMX
    if (amx) {
      if (ntg > 2) bf16r16_groups_amx_pairs(&c, res + q0);
      else bf16r16_groups_amx(&c, res + q0);
      continue;
    }
#endif
    bf16r16_groups_avx(&c, res + q0);
  }
#if MXMOE_AMX
  if (amx) _tile_release();
#endif
  float bias[16], ubias[16];
  if (it->halves) {
    for (size_t q = 0; q < ngroups; q += 2) {
      for (size_t i = 0; i < 16; ++i) {
        bias[i] = bias_value(it->bias, it->bias_kind, g0[q] + i);
        ubias[i] = bias_value(it->bias, it->bias_kind, g0[q + 1] + i);
      }
      for (size_t r = 0; r < rows; ++r)
        glu_row(&it->glu, res[q][r], res[q + 1][r], bias, ubias, 16, glu_out(it, r, g0[q]));
    }
    return;
  }
  for (size_t q = 0; q < ngroups; ++q) {
    for (size_t i = 0; i < 16; ++i) bias[i] = bias_value(it->bias, it->bias_kind, g0[q] + i);
    for (size_t r = 0; r < rows; ++r) store16(it, g0[q], bias, r, res[q][r]);
  }
}

/* xq: sorted rows packed by mxmoe_bf16_rows16_pack_rows ([S, k] words, block-major); xs: not read; w, s: the rows16
 * layout; the rest as mxmoe_rows16_grouped_matvec (tile_n a multiple of 16, at most MAX_TILE_N). */
void mxmoe_bf16_rows16_grouped_matmul(MEMREF(const uint16_t, xq), MEMREF(const float, xs), MEMREF(const uint8_t, w),
                                      MEMREF(const uint8_t, s), MEMREF(const void, bias), MEMREF(const int64_t, info),
                                      MEMREF(const int32_t, counts), MEMREF(const int32_t, order), MEMREF(char, out),
                                      size_t S, size_t n, size_t k, size_t bias_kind, size_t pairs, size_t tile_n,
                                      size_t tile, size_t u, size_t glu, size_t glu_alpha, size_t glu_limit,
                                      size_t out_kind) {
  item_t it;
  const glu_t g = glu_params(glu, out_kind, glu_alpha, glu_limit);
  const ptrdiff_t first = work_item(&it, AT(w), AT(s), AT(bias), AT(info), AT(counts), AT(order), OUT_AT(out, g), S,
                                    n, k, bias_kind, pairs, tile_n, tile, u, g);
  if (first < 0) return;
  item_bf16_rows16(&it, AT(xq), S, (size_t)first, 1);
}

#endif
