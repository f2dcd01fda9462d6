/* The machine's peaks for the instructions mxmoe's cpu kernels use, and its read bandwidth: what
 * benchmarks/cpu_moe.py compares the MoE layer with.
 *
 *   cc -O2 -march=native -pthread benchmarks/cpu_peak.c -o cpu_peak && ./cpu_peak [threads]
 *
 * Each instruction runs in a loop of 16 independent accumulator chains (enough to cover its latency),
 * in 1 and `threads` threads at once; printed as the operations per second of all threads together
 * (a multiply-add counts 2), the best of 60 runs of ~1 ms. Read bandwidth: each thread sums its part of
 * a 128 MB window of a 1 GiB buffer with vector loads; the best of 24 passes. Instructions the CPU lacks
 * (compiled with -march=native) are skipped.  AMX (tdpbf16ps) asks Linux for the tile state first.
 * Output lines: "peak <name> <threads> <G/s>" and "read_bw <threads> <GB/s>".
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define X16(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11) I(12) I(13) I(14) I(15)
#define CLOB "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
             "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17"
/* 16 chains on registers 0..15, sources 16 and 17 */
#define LOOP(NAME, INSTR, OPS)                                                      \
  static double NAME(long it) {                                                   \
    double t0 = now();                                                            \
    for (long i = 0; i < it; ++i) __asm__ volatile(X16(INSTR) ::: CLOB);          \
    return (double)it * 16 * (OPS) / (now() - t0);                                 \
  }
#define ZDP(d) "vdpbf16ps %%zmm16, %%zmm17, %%zmm" #d "\n"
#define ZDPBUSD(d) "vpdpbusd %%zmm16, %%zmm17, %%zmm" #d "\n"
#define ZFMA(d) "vfmadd231ps %%zmm16, %%zmm17, %%zmm" #d "\n"
#define YDP(d) "vdpbf16ps %%ymm16, %%ymm17, %%ymm" #d "\n"
#define YDPBUSD(d) "%{vex%} vpdpbusd %%ymm14, %%ymm15, %%ymm" #d "\n"
#define YMADD(d) "vpmaddwd %%ymm14, %%ymm15, %%ymm" #d "\n"
#define YFMA(d) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #d "\n"

#ifdef __AVX512BF16__
LOOP(zdp, ZDP, 64)
LOOP(ydp, YDP, 32)
#endif
#ifdef __AVX512VNNI__
LOOP(zdpbusd, ZDPBUSD, 128)
#endif
#ifdef __AVX512F__
LOOP(zfma, ZFMA, 32)
#endif
#ifdef __AVXVNNI__
/* 14 chains: the sources take registers 14 and 15 (VEX encodings reach only 0..15) */
#undef X16
#define X16(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11) I(12) I(13)
LOOP(ydpbusd_vex, YDPBUSD, 128 * 14 / 16 / 2)
#endif
#undef X16
#define X16(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11) I(12) I(13)
/* vpmaddwd: 16 multiply-adds of int16 pairs into 8 int32 (counted as 32 ops) */
LOOP(ymadd, YMADD, 32 * 14 / 16)
LOOP(yfma, YFMA, 16 * 14 / 16)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
/* tdpbf16ps: 16 x 16 f32 += 16 x 32 bf16 by 32 x 16 bf16 (16384 ops), on 4 independent accumulator tiles; the tiles'
 * contents are whatever the loads gave (the rate does not depend on them) */
static double amx_bf16(long it) {
  static const struct { uint8_t palette, start, pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg = {
      1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  static uint8_t data[1024] __attribute__((aligned(64)));
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0; /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
  _tile_loadconfig(&cfg);
  _tile_loadd(4, data, 64);
  _tile_loadd(5, data, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  double t0 = now();
  for (long i = 0; i < it / 16; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  double t = now() - t0;
  _tile_release();
  return (double)(it / 16) * 4 * 16384 / t;
}
#endif

typedef struct {
  double (*fn)(long);
  long it;
  double rate;
  const uint8_t *buf;
  size_t bytes;
} job_t;

static void *run_peak(void *a) {
  job_t *j = a;
  j->rate = j->fn(j->it);
  return 0;
}

/* the best of many short runs (~1 ms each): on a shared machine a run the scheduler interrupts is slower,
 * and short runs make an uninterrupted one likely */
static double peak(double (*fn)(long), int threads) {
  long it = 200000;
  double best = 0;
  for (int rep = 0; rep < 60; ++rep) {
    pthread_t th[256];
    job_t jobs[256];
    for (int i = 0; i < threads; ++i) {
      jobs[i] = (job_t){fn, it, 0, 0, 0};
      pthread_create(&th[i], 0, run_peak, &jobs[i]);
    }
    double sum = 0;
    for (int i = 0; i < threads; ++i) {
      pthread_join(th[i], 0);
      sum += jobs[i].rate;
    }
    if (sum > best) best = sum;
  }
  return best;
}

static void *run_read(void *a) {
  job_t *j = a;
  const __m256i *p = (const __m256i *)j->buf;
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  double t0 = now();
  for (size_t i = 0; i < j->bytes / 32; i += 4) {
    s0 = _mm256_add_epi64(s0, _mm256_load_si256(p + i));
    s1 = _mm256_add_epi64(s1, _mm256_load_si256(p + i + 1));
    s2 = _mm256_add_epi64(s2, _mm256_load_si256(p + i + 2));
    s3 = _mm256_add_epi64(s3, _mm256_load_si256(p + i + 3));
  }
  double t = now() - t0;
  __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
  j->rate = t + 1e-30 * (double)_mm256_extract_epi64(s, 0);
  return 0;
}

/* the best of 24 passes over 128 MB windows (4x the L3 here) that move through the buffer, so no pass finds
 * its data in the cache */
static double read_bw(const uint8_t *buf, size_t bytes, int threads) {
  double best = 0;
  const size_t window = (size_t)128 << 20;
  for (int rep = 0; rep < 24; ++rep) {
    pthread_t th[256];
    job_t jobs[256];
    const uint8_t *base = buf + (size_t)rep % (bytes / window) * window;
    size_t part = window / threads / 4096 * 4096;
    for (int i = 0; i < threads; ++i) {
      jobs[i] = (job_t){0, 0, 0, base + i * part, part};
      pthread_create(&th[i], 0, run_read, &jobs[i]);
    }
    double tmax = 0;
    for (int i = 0; i < threads; ++i) {
      pthread_join(th[i], 0);
      if (jobs[i].rate > tmax) tmax = jobs[i].rate;
    }
    double gbs = (double)part * threads / tmax / 1e9;
    if (gbs > best) best = gbs;
  }
  return best;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 2;
  if (threads < 1 || threads > 256) threads = 1;
  struct { const char *name; double (*fn)(long); } tests[] = {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      {"amx-bf16", amx_bf16},
#endif
#ifdef __AVX512BF16__
      {"vdpbf16ps-zmm", zdp}, {"vdpbf16ps-ymm", ydp},
#endif
#ifdef __AVX512VNNI__
      {"vpdpbusd-zmm", zdpbusd},
#endif
#ifdef __AVXVNNI__
      {"vpdpbusd-ymm-vex", ydpbusd_vex},
#endif
#ifdef __AVX512F__
      {"vfmadd231ps-zmm", zfma},
#endif
      {"vpmaddwd-ymm", ymadd}, {"vfmadd231ps-ymm", yfma},
  };
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; ++i) {
    printf("peak %s 1 %.1f\n", tests[i].name, peak(tests[i].fn, 1) / 1e9);
    if (threads > 1) printf("peak %s %d %.1f\n", tests[i].name, threads, peak(tests[i].fn, threads) / 1e9);
    fflush(stdout);
  }
  size_t bytes = (size_t)1 << 30;
  uint8_t *buf = aligned_alloc(4096, bytes);
  if (!buf) return 1;
  memset(buf, 1, bytes);
  printf("read_bw 1 %.1f\n", read_bw(buf, bytes, 1));
  if (threads > 1) printf("read_bw %d %.1f\n", threads, read_bw(buf, bytes, threads));
  free(buf);
  return 0;
}
