/* What the tile unit's instructions cost on this host (one thread, cycles at 4.0 GHz): TDPBF16PS back to back on
 * tiles in registers, TILELOADD of 1 KB from L1, and the two alternating with the loads from L1 or from a 64 KB ring
 * (past L1), as the AMX GEMMs of kernels/cpu run them; then LDTILECFG, and TDPBF16PS with half of them on 8-row A and
 * C tiles (what configuring a partly filled row group with only its rows would save).  An AMX host only.  Build:
 *   cc -O2 -march=native -mamx-tile -mamx-bf16 benchmarks/cpu_tiles.c -o /tmp/t && /tmp/t */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static __attribute__((aligned(64))) uint16_t buf[64][1024];
int main(void){
  long r; __asm__ volatile("syscall":"=a"(r):"0"(158L),"D"(0x1023L),"S"(18L):"rcx","r11","memory");
  cfg_t c={0}; c.palette=1; for(int t=0;t<8;++t)c.colsb[t]=64,c.rows[t]=16; _tile_loadconfig(&c);
  for (int i=0;i<64*1024;++i) buf[i/1024][i%1024]=0x3f80;
  _tile_loadd(6,buf[0],64); _tile_loadd(7,buf[1],64); _tile_loadd(4,buf[2],64); _tile_loadd(5,buf[3],64);
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  const int N=200000; double t0;
  t0=now(); for(int i=0;i<N;++i){_tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,5,6);_tile_dpbf16ps(2,4,7);_tile_dpbf16ps(3,5,7);} printf("tdp only: %.1f cycles/tdp\n",(now()-t0)*4e9/(4.0*N));
  t0=now(); for(int i=0;i<N;++i){_tile_loadd(4,buf[2],64);_tile_loadd(5,buf[3],64);} printf("tileloadd L1 only: %.1f cycles/load\n",(now()-t0)*4e9/(2.0*N));
  t0=now(); for(int i=0;i<N;++i){_tile_loadd(4,buf[(2*i)&63],64);_tile_dpbf16ps(0,4,6);_tile_loadd(5,buf[(2*i+1)&63],64);_tile_dpbf16ps(1,5,6);} printf("load+tdp (64 KB ring): %.1f cycles/tdp\n",(now()-t0)*4e9/(2.0*N));
  t0=now(); for(int i=0;i<N;++i){_tile_loadd(4,buf[2],64);_tile_dpbf16ps(0,4,6);_tile_loadd(5,buf[3],64);_tile_dpbf16ps(1,5,6);} printf("load+tdp (L1 2 KB): %.1f cycles/tdp\n",(now()-t0)*4e9/(2.0*N));
  t0=now(); for(int i=0;i<N;++i){_tile_loadd(4,buf[2],64);_tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,4,7);_tile_loadd(5,buf[3],64);_tile_dpbf16ps(2,5,6);_tile_dpbf16ps(3,5,7);} printf("1 load per 2 tdp (L1): %.1f cycles/tdp\n",(now()-t0)*4e9/(4.0*N));
  cfg_t h=c; h.rows[1]=h.rows[3]=h.rows[5]=8;
  t0=now(); for(int i=0;i<N;++i) _tile_loadconfig(i&1?&c:&h); printf("ldtilecfg: %.1f cycles\n",(now()-t0)*4e9/N);
  _tile_loadconfig(&h); _tile_loadd(6,buf[0],64); _tile_loadd(7,buf[1],64); _tile_loadd(4,buf[2],64); _tile_loadd(5,buf[3],64);
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  t0=now(); for(int i=0;i<N;++i){_tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,5,6);_tile_dpbf16ps(2,4,7);_tile_dpbf16ps(3,5,7);} printf("tdp, half on 8-row tiles: %.1f cycles/tdp\n",(now()-t0)*4e9/(4.0*N));
  _tile_release(); return 0; }
