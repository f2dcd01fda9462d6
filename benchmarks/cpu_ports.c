/* What the decode and dot-product instructions of kernels/cpu cost on this core: cycles per instruction in
 * throughput loops (eight independent chains, registers only), alone and in pairs.  A pair that takes the sum of its
 * parts competes for the same execution ports; one that takes the larger overlaps.  This is what bounds the exact bf16
 * matvec at one row (docs/cpu.md, "What one row costs"): every exact route spends ~6 port slots per 32 weights.
 * The clock comes from a chain of imul (3 cycles each).  x86-64 with AVX-512 BF16 / VNNI / VBMI:
 *   cc -O2 -march=native benchmarks/cpu_ports.c -o /tmp/p && /tmp/p */
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define N 20000000L
#define S(x) #x
#define R8(I) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8)
#define CLOBBER                                                                                              \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
      "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23",     \
      "xmm24", "xmm25", "xmm26", "xmm27", "xmm28"
/* each writes its own register (the operands' values do not matter for the timing) */
#define PERMW(i) "vpermw %%zmm14, %%zmm15, %%zmm" S(i) "\n"
#define PERMPS(i) "vpermps %%zmm14, %%zmm15, %%zmm" S(i) "\n"
#define SHUFB(i) "vpshufb %%zmm14, %%zmm15, %%zmm" S(i) "\n"
#define SRLW(i) "vpsrlw $4, %%zmm14, %%zmm1" S(i) "\n"
#define DPBF16(i) "vdpbf16ps %%zmm0, %%zmm13, %%zmm2" S(i) "\n"
#define DPWSSD(i) "vpdpwssd %%zmm0, %%zmm13, %%zmm2" S(i) "\n"
#define DPBUSD(i) "vpdpbusd %%zmm0, %%zmm13, %%zmm2" S(i) "\n"
#define FMA(i) "vfmadd231ps %%zmm0, %%zmm13, %%zmm2" S(i) "\n"

static double ghz;
#define CASE(name, body)                                                         \
  {                                                                              \
    const double t0 = now();                                                     \
    for (long i = 0; i < N; ++i) __asm__ volatile(body ::: CLOBBER);             \
    printf("%-22s %5.2f\n", name, (now() - t0) / N / 8 * ghz * 1e9);             \
  }

int main(void) {
  long x = 3;
  const double t0 = now();
  for (long i = 0; i < N * 5; ++i) __asm__ volatile("imul %0, %0\n imul %0, %0\n" : "+r"(x));
  ghz = N * 5 * 2 * 3 / (now() - t0) / 1e9;
  printf("clock %.2f GHz (imul chain); cycles per group of one of each, 8 independent groups per loop:\n", ghz);
  CASE("vpermw", R8(PERMW))
  CASE("vpermps", R8(PERMPS))
  CASE("vpshufb", R8(SHUFB))
  CASE("vpsrlw", R8(SRLW))
  CASE("vfmadd231ps", R8(FMA))
  CASE("vdpbf16ps", R8(DPBF16))
  CASE("vpdpwssd", R8(DPWSSD))
  CASE("vpdpbusd", R8(DPBUSD))
  CASE("vpermw + vpsrlw", R8(PERMW) R8(SRLW))
  CASE("vpermw + vfmadd231ps", R8(PERMW) R8(FMA))
  CASE("vpermw + vdpbf16ps", R8(PERMW) R8(DPBF16))
  CASE("vpermw + vpdpwssd", R8(PERMW) R8(DPWSSD))
  CASE("vpermps + vpsrlw", R8(PERMPS) R8(SRLW))
  CASE("vpermps + vfmadd231ps", R8(PERMPS) R8(FMA))
  CASE("vdpbf16ps + vpsrlw", R8(DPBF16) R8(SRLW))
  CASE("vdpbf16ps + vfmadd231ps", R8(DPBF16) R8(FMA))
  CASE("vpshufb + vpsrlw", R8(SHUFB) R8(SRLW))
  CASE("vpshufb + vpdpbusd", R8(SHUFB) R8(DPBUSD))
  return (int)(x & 0);
}
