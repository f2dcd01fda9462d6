/* Single-thread harness of the int8 forms' matmul (kernels/cpu/mxint8_rows16.c: MXINT8 rows, and mxint16's two
 * int8 planes per row) against the bf16 / int16 one (mxfp4_matvec.c), one expert of n x k, R activation rows,
 * weights in L2 (n = 256, k = 2880: 368 KB) or streamed from DRAM (one of 256 experts of n = 2880 per call, 1.06 GB
 * in all: past a last-level cache of up to ~800 MB, as 64 of them, 265 MB, were not on a 480 MB one).  Prints GB/s of
 * packed weights per core, best of many calls.  Build: cc -O3 -march=native -falign-functions=64 -Ikernels/cpu
 * benchmarks/cpu_rows16.c -o /tmp/h (with the flags of a flavor: kernels/cpu FLAVORS and BASE_CFLAGS).  Random
 * bytes; correctness is tests/kernels/test_cpu_mxint8.py's. */
#include "../kernels/cpu/mxfp4_matvec.c"
#include <stdio.h>
#include <stdlib.h>

#include "cpu_harness.h"

#define M(p, n) (void *)(p), (void *)(p), (size_t)0, (size_t)(n), (size_t)1

/* form: 0 the bf16 / int16 one, 1 MXINT8, 2 mxint16 */
static double run(int form, size_t E, size_t n, size_t k, size_t R, int calls) {
  const size_t nb = k / 32;
  uint8_t *w = buffer(E * n * k / 2), *s = buffer(E * n * nb);
  uint64_t z = 88172645463325252ull;  /* xorshift: rand() per byte takes ~10 s for the DRAM pool */
  for (size_t i = 0; i < E * n * k / 2; ++i) { z ^= z << 13; z ^= z >> 7; z ^= z << 17; w[i] = (uint8_t)(z >> 24); }
  for (size_t i = 0; i < E * n * nb; ++i) s[i] = (uint8_t)(120 + rand() % 10);
  float *x = buffer(R * k * 4), *out = buffer(R * n * 4);
  for (size_t i = 0; i < R * k; ++i) x[i] = (float)rand() / RAND_MAX - 0.5f;
  int32_t order[64], counts[2] = {1, (int32_t)R};
  for (size_t i = 0; i < R; ++i) order[i] = (int32_t)i;
  int64_t info[2];
  int8_t *q8 = buffer(2 * R * k);
  float *xs8 = buffer(2 * R * 2 * nb * 4);
  int16_t *q16 = buffer(R * 64 * row_pairs(nb) * 2);
  float *xs16 = buffer(R * scale_row(nb) * 4);
  uint16_t *xb = buffer(R * k * 2);
  for (size_t i = 0; i < R * k; ++i) { union { float f; uint32_t u; } v = {x[i]}; xb[i] = (uint16_t)(v.u >> 16); }
  if (form == 1) mxmoe_mxint8_quantize_rows(M(x, R * k), M(order, R), M(counts, 2), M(q8, R * k), M(xs8, R * 2 * nb), k, 1, KIND_F32, R, 0);
  else if (form == 2) mxmoe_mxint16_quantize_rows(M(x, R * k), M(order, R), M(counts, 2), M(q8, 2 * R * k), M(xs8, 4 * R * nb), k, 1, KIND_F32, R, 0);
  else mxmoe_mxfp4_quantize_rows(M(xb, R * k), M(order, R), M(counts, 2), M(q16, 1), M(xs16, 1), k, 1, KIND_BF16, R, 0);
  double best = 1e9;
  for (int c = 0; c < calls; ++c) {
    const size_t e = (size_t)c % E;
    info[0] = 0;
    info[1] = (int64_t)e | (int64_t)R << 32;
    const double t0 = now();
    for (size_t tile = 0; tile < n / 64; ++tile) {
      if (form == 2)
        mxmoe_rows16x2_grouped_matvec(M(q8, 1), M(xs8, 1), M(w, 1), M(s, 1), M(x, 1), M(info, 2), M(counts, 2), M(order, R),
                                      M(out, R * n), R, n, k, KIND_NONE, 0, 64, tile, 0, 0, 0, 0, KIND_F32);
      else if (form == 1)
        mxmoe_rows16_grouped_matvec(M(q8, 1), M(xs8, 1), M(w, 1), M(s, 1), M(x, 1), M(info, 2), M(counts, 2), M(order, R),
                                    M(out, R * n), R, n, k, KIND_NONE, 0, 64, tile, 0, 0, 0, 0, KIND_F32);
      else
        mxmoe_mxfp4_grouped_matvec(M(q16, 1), M(xs16, 1), M(w, 1), M(s, 1), M(x, 1), M(info, 2), M(counts, 2), M(order, R),
                                   M(out, R * n), R, n, k, MXMOE_BF16 ? KIND_BF16 : KIND_F32, KIND_NONE, 0, 64, tile, 0, 0, 0, 0, KIND_F32);
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  free(w); free(s); free(x); free(out); free(q8); free(xs8); free(q16); free(xs16); free(xb);
  return n * k / 2 / best / 1e9;
}

int main(void) {
  printf("GB/s of packed weights, one thread, best call: rows | L2 bf16/int16  int8  mxint16 | DRAM bf16/int16  int8  mxint16\n");
  for (size_t R = 1; R <= 64; R = R < 4 ? R + 1 : R == 8 ? 12 : R == 12 ? 16 : R * 2) {
    const double l2a = run(0, 1, 256, 2880, R, 400), l2b = run(1, 1, 256, 2880, R, 400), l2c = run(2, 1, 256, 2880, R, 400);
    const double da = run(0, 256, 2880, 2880, R, 64), db = run(1, 256, 2880, 2880, R, 64), dc = run(2, 256, 2880, 2880, R, 64);
    printf("%4zu | %6.2f %6.2f %6.2f | %6.2f %6.2f %6.2f\n", R, l2a, l2b, l2c, da, db, dc);
  }
  return 0;
}
