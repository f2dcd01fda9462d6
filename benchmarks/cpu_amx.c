/* Single-thread harness of the bf16 form's GEMM on AMX tiles (kernels/cpu/mxfp4_matvec.c, item_amx) against the
 * AVX-512 path the avx512bf16 flavor takes (the matvec up to 11 rows per item, then the 4 x 4 vdpbf16ps GEMM): one
 * expert of n x 2880, R activation rows, weights in L2 (n = 256) or streamed from DRAM (`dram`: one of 64 experts of
 * n = 2880 per call).  Prints the best call's time of each and the largest difference between them over the largest
 * output (the two sum in different orders).  An AMX host only (the kernel asks Linux for the tile state).  Build:
 *   cc -O3 -std=gnu11 -march=native -falign-functions=64 -mamx-tile -mamx-bf16 benchmarks/cpu_amx.c -o /tmp/a -lm
 * Environment: R (one row count), CALLS (timed calls). */
#define AMX_MIN_ROWS 1000 /* item_bf16 keeps to the AVX-512 path; item_amx is called directly */
#include "../kernels/cpu/mxfp4_matvec.c"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define M(p, n) (void *)(p), (void *)(p), (size_t)0, (size_t)(n), (size_t)1

int main(int argc, char **argv) {
  const int dram = argc > 1;
  const size_t E = dram ? 64 : 1, n = dram ? 2880 : 256, k = 2880, nb = k / 32;
  const int calls = getenv("CALLS") ? atoi(getenv("CALLS")) : dram ? 64 : 200;
  const size_t R0 = getenv("R") ? (size_t)atoi(getenv("R")) : 0;
  uint8_t *w = malloc(E * n * k / 2), *s = malloc(E * n * nb);
  for (size_t i = 0; i < E * n * k / 2; ++i) w[i] = (uint8_t)rand();
  for (size_t i = 0; i < E * n * nb; ++i) s[i] = (uint8_t)(120 + rand() % 10);
  printf("%s, one thread, best of %d calls: rows | AVX-512 us | AMX us | speedup | AMX GFLOP/s | max diff\n",
         dram ? "weights from DRAM (64 experts of 2880 x 2880)" : "weights in L2 (256 x 2880)", calls);
  for (size_t R = R0 ? R0 : 4; R <= (R0 ? R0 : 64); R = R < 16 ? R + 2 : R * 2) {
    float *out[2] = {malloc(R * n * 4), malloc(R * n * 4)};
    uint16_t *xb = malloc(R * k * 2), *xq = malloc(R * 64 * row_pairs(nb) * 2);
    for (size_t i = 0; i < R * k; ++i) {
      union { float f; uint32_t u; } v = {(float)rand() / RAND_MAX - 0.5f};
      xb[i] = (uint16_t)(v.u >> 16);
    }
    int32_t order[64], counts[2] = {1, (int32_t)R};
    for (size_t i = 0; i < R; ++i) order[i] = (int32_t)i;
    int64_t info[2] = {0, 0};
    float xs[1];
    mxmoe_mxfp4_quantize_rows(M(xb, R * k), M(order, R), M(counts, 2), M(xq, 1), M(xs, 1), k, 1, KIND_BF16, R, 0);
    double best[2] = {1e9, 1e9};
    for (int mode = 0; mode < 2; ++mode)
      for (int c = 0; c < calls; ++c) {
        info[1] = (int64_t)((size_t)c % E) | (int64_t)R << 32;
        const double t0 = now();
        for (size_t tile = 0; tile < n / 64; ++tile) {
          item_t it;
          const ptrdiff_t first = work_item(&it, w, s, 0, info, counts, order, out[mode], R, n, k, KIND_NONE, 0, 64,
                                            tile, 0, glu_params(0, KIND_F32, 0, 0));
          if (mode == 0) item_bf16(&it, xq + first * 64 * row_pairs(nb));
          else if (!item_amx(&it, xq + first * 64 * row_pairs(nb))) return printf("no AMX tile state\n"), 1;
        }
        const double t = now() - t0;
        if (t < best[mode]) best[mode] = t;
      }
    double maxd = 0, maxv = 0;
    for (size_t i = 0; i < R * n; ++i) maxd = fmax(maxd, fabs(out[0][i] - out[1][i])), maxv = fmax(maxv, fabs(out[0][i]));
    printf("%4zu | %9.1f | %7.1f | %6.2fx | %7.0f | %.1e\n", R, best[0] * 1e6, best[1] * 1e6, best[0] / best[1],
           2.0 * R * n * k / best[1] / 1e9, maxd / maxv);
    free(out[0]), free(out[1]), free(xb), free(xq);
  }
  return 0;
}
