/* What the kernel harnesses (cpu_amx.c, cpu_rows16.c) share: a clock, and buffers allocated as the layer's dispatches
 * get them. */
#ifndef MXMOE_CPU_HARNESS_H
#define MXMOE_CPU_HARNESS_H
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* IREE binds 64-byte aligned buffers (`stream.alignment = 64`); a plain malloc of these sizes is 16 bytes past a page,
 * which splits every 64-byte row of a tile load in two. */
static void *buffer(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

#endif
