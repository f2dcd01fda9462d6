/* mxmoe CPU microkernels: the GLU epilogue of a w13 grouped matmul (included by mxfp4_matvec.c after the element
 * kinds).
 *
 * The reference rounds h = x w13^T + b to the layer's activation type, applies the GLU to (gate, up) in f32 and
 * rounds the result to the activation type.  With the epilogue on, the matmul does those steps on a row's gate
 * and up values while they are in cache and writes [S, n / 2] of the activation type, instead of [S, n] f32 that
 * a generic dispatch reads back (at 512 tokens of gpt-oss-20b that dispatch alone took 7.4 ms of a 186 ms call,
 * bound by its strided reads; docs/cpu.md).  Each output tile holds whole (gate, up) pairs: rows 2j and 2j + 1 of
 * an interleaved w13, rows j and n / 2 + j of one in halves (weight_row in mxfp4_matvec.c); the lowering keeps the
 * generic for the activations not here.
 *
 * 8 lanes (AVX2 + FMA + F16C), the same code in both flavors.  The activations as the lowering's generic writes
 * them (compiler/passes/lower_to_linalg.py, _glu_apply): the clamps propagate NaN (minimumf / maximumf), the
 * sigmoid is 1 / (1 + exp(-z)) with a true division, tanh(y) = sign(y) (1 - 2 / (exp(2|y|) + 1)).  exp: Cody-Waite
 * reduction by ln 2 and a degree-6 polynomial (the Cephes coefficients, ~1 ulp), the power of two applied in two
 * halves so that results down to the subnormals and up to FLT_MAX come out right; inf above 88.72.  Gelu with erf
 * is not here (the lowering keeps the generic for it).
 */

/* the epilogue's activation codes (the lowering passes them; GLU_NONE: write h as f32, no GLU) */
enum { GLU_NONE = 0, GLU_SWIGLU_OAI = 1, GLU_SILU = 2, GLU_SILU_CLAMPED = 3, GLU_GELU_TANH = 4 };

typedef struct {
  size_t act;  /* GLU_* */
  size_t kind; /* the activation type: h is rounded to it, and the result is stored as it (KIND_*) */
  float alpha, limit;
} glu_t;

static inline glu_t glu_params(size_t act, size_t kind, size_t alpha_bits, size_t limit_bits) {
  union { uint32_t u; float f; } a = {(uint32_t)alpha_bits}, l = {(uint32_t)limit_bits};
  return (glu_t){act, kind, a.f, l.f};
}

/* f32 -> bf16 to nearest even, as the f32 bits of the result (low half zero); NaN stays a (quiet) NaN */
static inline __m256i bf16_rne_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                                     _mm256_set1_epi32((int)0xFFFF0000u));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
}

/* v rounded to the activation type (value kept as f32) */
static inline __m256 round_to_kind(__m256 v, size_t kind) {
  switch (kind) {
    case KIND_BF16: return _mm256_castsi256_ps(bf16_rne_bits(v));
    case KIND_F16: return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    default: return v;
  }
}

/* 8 values to dst[0..8) of the activation type, rounded to nearest even */
static inline void store8_kind(void *dst, __m256 v, size_t kind) {
  switch (kind) {
    case KIND_BF16: {
      const __m256i h = _mm256_srli_epi32(bf16_rne_bits(v), 16);
      _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
      return;
    }
    case KIND_F16:
      _mm_storeu_si128((__m128i *)dst, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    default: _mm256_storeu_ps((float *)dst, v);
  }
}

static inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283935546875f), lo = _mm256_set1_ps(-104.0f);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_max_ps(lo, _mm256_min_ps(hi, x)); /* NaN stays NaN (the second operand is returned) */
  const __m256 magic = _mm256_set1_ps(12582912.0f); /* 1.5 x 2^23: adding it rounds to an integer */
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 n = _mm256_sub_ps(t, magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  /* 2^n for n in [-150, 128] as 2^n1 x 2^n2, both normal */
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
  p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
  return _mm256_blendv_ps(p, _mm256_set1_ps(__builtin_inff()), over);
}

/* the GLU of gate g and up u (both already rounded to the activation type), in f32 */
static inline __m256 glu8(__m256 g, __m256 u, const glu_t *p) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if (p->act == GLU_GELU_TANH) { /* g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u */
    const __m256 hx = _mm256_mul_ps(g, _mm256_set1_ps(0.5f));
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 in = _mm256_mul_ps(_mm256_add_ps(g, _mm256_mul_ps(x3, _mm256_set1_ps(0.044715f))),
                                    _mm256_set1_ps(0.7978845608028654f));
    /* tanh(|y|) = 1 - 2 / (exp(2|y|) + 1) rounded once near 1 (as a correctly rounded tanh is), its sign put back */
    const __m256 sign = _mm256_set1_ps(-0.0f), ay = _mm256_andnot_ps(sign, in);
    const __m256 e = exp8(_mm256_add_ps(ay, ay));
    const __m256 ta = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    const __m256 t = _mm256_or_ps(ta, _mm256_and_ps(sign, in));
    return _mm256_mul_ps(u, _mm256_mul_ps(hx, _mm256_add_ps(t, one)));
  }
  if (p->act != GLU_SILU) { /* the clamped forms: gate from above, up both ways */
    const __m256 lim = _mm256_set1_ps(p->limit), nlim = _mm256_set1_ps(-p->limit);
    g = _mm256_min_ps(lim, g);
    u = _mm256_max_ps(nlim, _mm256_min_ps(lim, u));
  }
  const __m256 z = p->act == GLU_SWIGLU_OAI ? _mm256_mul_ps(g, _mm256_set1_ps(p->alpha)) : g;
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
  const __m256 glu = _mm256_mul_ps(g, _mm256_div_ps(one, _mm256_add_ps(e, one)));
  return p->act == GLU_SWIGLU_OAI ? _mm256_mul_ps(_mm256_add_ps(u, one), glu) : _mm256_mul_ps(u, glu);
}

/* cnt outputs of one row (a multiple of 8: the lowering asks for the epilogue where n is a multiple of 32, so
 * every tile's run of pairs is): gate[i] + gbias[i] and up[i] + ubias[i] rounded to the activation type, their
 * GLU stored at dst (the activation type) */
static void glu_row(const glu_t *p, const float *gate, const float *up, const float *gbias, const float *ubias,
                    size_t cnt, char *dst) {
  for (size_t i = 0; i < cnt; i += 8) {
    const __m256 g = round_to_kind(_mm256_add_ps(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(gbias + i)), p->kind);
    const __m256 u = round_to_kind(_mm256_add_ps(_mm256_loadu_ps(up + i), _mm256_loadu_ps(ubias + i)), p->kind);
    store8_kind(dst + i * kind_size(p->kind), glu8(g, u, p), p->kind);
  }
}
