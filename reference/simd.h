/* One vector of floats for the ISA copy being compiled (isa.h): 16 lanes under
 * AVX-512, 8 under AVX2 + FMA, and a plain float in the baseline copy (fmaf from
 * libm, correctly rounded). Kernels written against these names put vector lanes
 * across outputs only, each lane one fmaf chain, so the width never changes a bit. */
#ifndef MB_SIMD_H
#define MB_SIMD_H
#include <math.h>

/* Kernels keep accumulator arrays in registers; that needs their short constant
 * loops unrolled completely. */
#define MB_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__)
#include <immintrin.h>
#define MB_VW 16
typedef __m512 mb_vf;
static inline mb_vf mb_vzero(void) { return _mm512_setzero_ps(); }
static inline mb_vf mb_vld(const float *p) { return _mm512_loadu_ps(p); }
static inline void mb_vst(float *p, mb_vf v) { _mm512_storeu_ps(p, v); }
static inline mb_vf mb_vbc(const float *p) { return _mm512_set1_ps(*p); }
static inline mb_vf mb_vfma(mb_vf a, mb_vf b, mb_vf c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_VW 8
typedef __m256 mb_vf;
static inline mb_vf mb_vzero(void) { return _mm256_setzero_ps(); }
static inline mb_vf mb_vld(const float *p) { return _mm256_loadu_ps(p); }
static inline void mb_vst(float *p, mb_vf v) { _mm256_storeu_ps(p, v); }
static inline mb_vf mb_vbc(const float *p) { return _mm256_broadcast_ss(p); }
static inline mb_vf mb_vfma(mb_vf a, mb_vf b, mb_vf c) { return _mm256_fmadd_ps(a, b, c); }
#else
#define MB_VW 1
typedef float mb_vf;
static inline mb_vf mb_vzero(void) { return 0.0f; }
static inline mb_vf mb_vld(const float *p) { return *p; }
static inline void mb_vst(float *p, mb_vf v) { *p = v; }
static inline mb_vf mb_vbc(const float *p) { return *p; }
static inline mb_vf mb_vfma(mb_vf a, mb_vf b, mb_vf c) { return fmaf(a, b, c); }
#endif

#endif
