/* Single-thread harness of the bf16 forms' GEMMs (kernels/cpu/mxfp4_matvec.c): the blocksplit layout's (item_bf16:
 * the matvec up to AMX_MIN_ROWS rows, then its AMX GEMM with weights as A tiles) against the rows16 layout's
 * (bf16_rows16.c: activations as A tiles, weights decoded into B tiles) on AMX tiles and, the same products, on
 * vdpbf16ps.  One expert of n x 2880, R activation rows, weights in L2 (n = 256) or streamed from DRAM (`dram`: one
 * of 64 experts of n = 2880 per call).  Prints the best call's time of each, the rows16 AMX GEMM's GFLOP/s and weight
 * GB/s, and the rows16 results' largest error against a float64 reference of its layout over the largest output.
 * An AMX host only (the kernels ask Linux for the tile state).  Build:
 *   cc -O3 -std=gnu11 -march=native -falign-functions=64 -mamx-tile -mamx-bf16 benchmarks/cpu_amx.c -o /tmp/a -lm
 * Environment: R (one row count; past 64, the blocksplit form's largest item, the rows16 forms only), CALLS (timed
 * calls). */
#include "../kernels/cpu/mxfp4_matvec.c"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu_harness.h"

#define M(p, n) (void *)(p), (void *)(p), (size_t)0, (size_t)(n), (size_t)1

/* row r's output o of expert 0 from the rows16 layout, in float64 */
static double reference(const uint8_t *w, const uint8_t *s, const uint16_t *x, size_t k, size_t r, size_t o) {
  static const double e2m1[16] = {0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6};
  const size_t nb = k / 32, g = o / 16, i = o % 16;
  double acc = 0;
  for (size_t b = 0; b < nb; ++b) {
    const double sc = ldexp(1.0, (int)s[g * 16 * nb + 16 * b + i] - 127);
    for (size_t v = 0; v < 32; ++v) {
      const uint8_t byte = w[g * 16 * (k / 2) + 256 * b + 64 * ((v % 16) / 4) + 4 * i + v % 4];
      union { uint32_t u; float f; } xv = {(uint32_t)x[r * k + 32 * b + v] << 16};
      acc += e2m1[v < 16 ? byte & 15 : byte >> 4] * sc * xv.f;
    }
  }
  return acc;
}

int main(int argc, char **argv) {
  const int dram = argc > 1;
  const size_t E = dram ? 64 : 1, n = dram ? 2880 : 256, k = 2880, nb = k / 32;
  const int calls = getenv("CALLS") ? atoi(getenv("CALLS")) : dram ? 64 : 200;
  const size_t R0 = getenv("R") ? (size_t)atoi(getenv("R")) : 0;
  if (R0 > BF16R16_MAX_ROWS) /* the rows16 form's largest item (and the harness's order buffer) */
    return printf("R=%zu: the rows16 form's items hold at most %d rows\n", R0, BF16R16_MAX_ROWS), 1;
  uint8_t *w = buffer(E * n * k / 2), *s = buffer(E * n * nb);
  for (size_t i = 0; i < E * n * k / 2; ++i) w[i] = (uint8_t)rand();
  for (size_t i = 0; i < E * n * nb; ++i) s[i] = (uint8_t)(120 + rand() % 10);
  if (amx_permission() != 0) return printf("no AMX tile state\n"), 1;
  printf("%s, one thread, best of %d calls: rows | blocksplit us | rows16 AMX us | rows16 vdpbf16ps us | AMX speedup "
         "| AMX GFLOP/s | AMX GB/s | err AMX | err vdpbf16ps\n",
         dram ? "weights from DRAM (64 experts of 2880 x 2880)" : "weights in L2 (256 x 2880)", calls);
  for (size_t R = R0 ? R0 : 1; R <= (R0 ? R0 : 64); R = R < 4 ? R + 1 : R < 16 ? R + 4 : R * 2) {
    float *out[3] = {buffer(R * n * 4), buffer(R * n * 4), buffer(R * n * 4)};
    uint16_t *xb = buffer(R * k * 2), *xq = buffer(R * 64 * row_pairs(nb) * 2), *xr = buffer((R + 16) * k * 2);
    for (size_t i = 0; i < R * k; ++i) {
      union { float f; uint32_t u; } v = {(float)rand() / RAND_MAX - 0.5f};
      xb[i] = (uint16_t)(v.u >> 16);
    }
    int32_t order[BF16R16_MAX_ROWS], counts[2] = {1, (int32_t)R};
    for (size_t i = 0; i < R; ++i) order[i] = (int32_t)i;
    int64_t info[2] = {0, 0};
    float xs[1];
    mxmoe_mxfp4_quantize_rows(M(xb, R * k), M(order, R), M(counts, 2), M(xq, 1), M(xs, 1), k, 1, KIND_BF16, R, 0);
    /* the rows16 buffer has 16 rows more than the item, never written (as in a layer: the rows past an item's are
     * other items' or unused, and give only output rows nobody reads); set to NaN bits here */
    for (size_t i = R * k; i < (R + 16) * k; ++i) xr[i] = 0x7FC1;
    info[1] = (int64_t)R << 32; /* one work item of expert 0's R rows */
    mxmoe_bf16_rows16_pack_rows(M(xb, R * k), M(order, R), M(counts, 2), M(info, 2), M(xr, (R + 16) * k), M(xs, 1), k,
                                1, KIND_BF16, R, 0, R + 16);
    double best[3] = {1e9, 1e9, 1e9}, err[3] = {0, 0, 0};
    for (int mode = R > MAX_ITEM_ROWS; mode < 3; ++mode) /* the blocksplit form's items hold up to 64 rows */
      for (int c = 0; c < calls; ++c) {
        info[1] = (int64_t)((size_t)c % E) | (int64_t)R << 32;
        const double t0 = now();
        for (size_t tile = 0; tile < n / 64; ++tile) {
          item_t it;
          const ptrdiff_t first = work_item(&it, w, s, 0, info, counts, order, out[mode], R, n, k, KIND_NONE, 0, 64,
                                            tile, 0, glu_params(0, KIND_F32, 0, 0));
          if (mode == 0) item_bf16(&it, xq + first * 64 * row_pairs(nb));
          else item_bf16_rows16(&it, xr, R + 16, (size_t)first, mode == 1);
        }
        const double t = now() - t0;
        if (t < best[mode]) best[mode] = t;
      }
    for (int mode = 1; mode < 3; ++mode) { /* the last call ran expert (calls - 1) % E: check on expert 0 */
      info[1] = (int64_t)R << 32;
      for (size_t tile = 0; tile < n / 64; ++tile) {
        item_t it;
        const ptrdiff_t first = work_item(&it, w, s, 0, info, counts, order, out[mode], R, n, k, KIND_NONE, 0, 64,
                                          tile, 0, glu_params(0, KIND_F32, 0, 0));
        item_bf16_rows16(&it, xr, R + 16, (size_t)first, mode == 1);
      }
    }
    double maxv = 0;
    for (size_t r = 0; r < R; ++r)
      for (size_t o = 0; o < n; ++o) {
        const double ref = reference(w, s, xb, k, r, o);
        maxv = fmax(maxv, fabs(ref));
        for (int mode = 1; mode < 3; ++mode) err[mode] = fmax(err[mode], fabs(ref - out[mode][r * n + o]));
      }
    char split[2][32] = {"        -", "      -"}; /* the blocksplit form's time and speedup, where it ran */
    if (R <= MAX_ITEM_ROWS)
      snprintf(split[0], 32, "%9.1f", best[0] * 1e6), snprintf(split[1], 32, "%6.2fx", best[0] / best[1]);
    printf("%4zu | %s | %9.1f | %9.1f | %s | %7.0f | %5.1f | %.1e | %.1e\n", R, split[0], best[1] * 1e6,
           best[2] * 1e6, split[1], 2.0 * R * n * k / best[1] / 1e9, n * k * 0.53125 / best[1] / 1e9,
           err[1] / maxv, err[2] / maxv);
    for (int mode = 0; mode < 3; ++mode) free(out[mode]);
    free(xb), free(xq), free(xr);
  }
  return 0;
}
