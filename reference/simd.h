/* One vector of floats for the ISA copy being compiled (isa.h): 16 lanes under
 * AVX-512, 8 under AVX2 + FMA, and a plain float in the baseline copy (fmaf from
 * libm, correctly rounded). Kernels written against these names put vector lanes
 * across outputs only, each lane one fmaf chain, so the width never changes a bit.
 *
 * mb_vexp and mb_vsilu are numerics.h's mb_exp and mb_silu lane by lane, bit for
 * bit (tests/test_numerics.py compares them on every ISA). Where the vector form
 * takes a shortcut it is exact: floor by a rounding instruction instead of the
 * truncation trick (the same integer), and under AVX-512 the scaling by 2^k as one
 * vscalefps (the two-step scaling's first product is exact, so both round once). */
#ifndef MB_SIMD_H
#define MB_SIMD_H
#include <stdint.h>
#include "numerics.h"

/* Kernels keep accumulator arrays in registers; that needs their short constant
 * loops unrolled completely. */
#define MB_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__)
#include <immintrin.h>
#define MB_VW 16
typedef __m512 mb_vf;
static inline mb_vf mb_vzero(void) { return _mm512_setzero_ps(); }
static inline mb_vf mb_vset(float x) { return _mm512_set1_ps(x); }
static inline mb_vf mb_vld(const float *p) { return _mm512_loadu_ps(p); }
static inline void mb_vst(float *p, mb_vf v) { _mm512_storeu_ps(p, v); }
static inline mb_vf mb_vbc(const float *p) { return _mm512_set1_ps(*p); }
static inline mb_vf mb_vfma(mb_vf a, mb_vf b, mb_vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline mb_vf mb_vadd(mb_vf a, mb_vf b) { return _mm512_add_ps(a, b); }
static inline mb_vf mb_vmul(mb_vf a, mb_vf b) { return _mm512_mul_ps(a, b); }
static inline mb_vf mb_vdiv(mb_vf a, mb_vf b) { return _mm512_div_ps(a, b); }
/* the first n lanes (the others read nothing and load as +0 / are not written) */
static inline mb_vf mb_vldn(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void mb_vstn(float *p, mb_vf v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
static inline mb_vf mb_vneg(mb_vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u))); }
static inline mb_vf mb_vmin(mb_vf a, mb_vf b) { return _mm512_min_ps(a, b); }
/* every lane a >= b (false where either is NaN) */
static inline int mb_vall_ge(mb_vf a, mb_vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) == 0xFFFF; }

static inline mb_vf mb_vmax(mb_vf a, mb_vf b) { return _mm512_max_ps(a, b); }
static inline mb_vf mb_vfloor(mb_vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
/* y * 2^z for whole z in exp's range: one vscalefps, rounding once as the two-step
 * scaling does (its first product is exact) */
static inline mb_vf mb_vscale2(mb_vf y, mb_vf z) { return _mm512_scalef_ps(y, z); }
/* c ? t : f lane by lane, for c = a < b, a > b (ordered: false where either is
 * NaN), a not NaN */
static inline mb_vf mb_vif_lt(mb_vf a, mb_vf b, mb_vf t, mb_vf f) { return _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), t); }
static inline mb_vf mb_vif_gt(mb_vf a, mb_vf b, mb_vf t, mb_vf f) { return _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), t); }
static inline mb_vf mb_vif_num(mb_vf a, mb_vf t, mb_vf f) { return _mm512_mask_mov_ps(f, _mm512_cmp_ps_mask(a, a, _CMP_EQ_OQ), t); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_VW 8
typedef __m256 mb_vf;
static inline mb_vf mb_vzero(void) { return _mm256_setzero_ps(); }
static inline mb_vf mb_vset(float x) { return _mm256_set1_ps(x); }
static inline mb_vf mb_vld(const float *p) { return _mm256_loadu_ps(p); }
static inline void mb_vst(float *p, mb_vf v) { _mm256_storeu_ps(p, v); }
static inline mb_vf mb_vbc(const float *p) { return _mm256_broadcast_ss(p); }
static inline mb_vf mb_vfma(mb_vf a, mb_vf b, mb_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline mb_vf mb_vadd(mb_vf a, mb_vf b) { return _mm256_add_ps(a, b); }
static inline mb_vf mb_vmul(mb_vf a, mb_vf b) { return _mm256_mul_ps(a, b); }
static inline mb_vf mb_vdiv(mb_vf a, mb_vf b) { return _mm256_div_ps(a, b); }
static inline __m256i mb_vmask_(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline mb_vf mb_vldn(const float *p, int n) { return _mm256_maskload_ps(p, mb_vmask_(n)); }
static inline void mb_vstn(float *p, mb_vf v, int n) { _mm256_maskstore_ps(p, mb_vmask_(n), v); }
static inline mb_vf mb_vneg(mb_vf a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
static inline mb_vf mb_vmin(mb_vf a, mb_vf b) { return _mm256_min_ps(a, b); }
static inline int mb_vall_ge(mb_vf a, mb_vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)) == 0xFF; }

static inline mb_vf mb_vmax(mb_vf a, mb_vf b) { return _mm256_max_ps(a, b); }
static inline mb_vf mb_vfloor(mb_vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
/* y * 2^z as mb_exp scales: by 2^(k >> 1), then by the rest (k = z) */
static inline mb_vf mb_vscale2(mb_vf y, mb_vf z)
{
    const __m256i k = _mm256_cvtps_epi32(z), k1 = _mm256_srai_epi32(k, 1);
    const __m256i k2 = _mm256_sub_epi32(k, k1), bias = _mm256_set1_epi32(127);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23)));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23)));
}
static inline mb_vf mb_vif_lt(mb_vf a, mb_vf b, mb_vf t, mb_vf f) { return _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline mb_vf mb_vif_gt(mb_vf a, mb_vf b, mb_vf t, mb_vf f) { return _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
static inline mb_vf mb_vif_num(mb_vf a, mb_vf t, mb_vf f) { return _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, a, _CMP_EQ_OQ)); }
#else
#define MB_VW 1
typedef float mb_vf;
static inline mb_vf mb_vzero(void) { return 0.0f; }
static inline mb_vf mb_vset(float x) { return x; }
static inline mb_vf mb_vld(const float *p) { return *p; }
static inline void mb_vst(float *p, mb_vf v) { *p = v; }
static inline mb_vf mb_vbc(const float *p) { return *p; }
static inline mb_vf mb_vfma(mb_vf a, mb_vf b, mb_vf c) { return fmaf(a, b, c); }
static inline mb_vf mb_vadd(mb_vf a, mb_vf b) { return a + b; }
static inline mb_vf mb_vmul(mb_vf a, mb_vf b) { return a * b; }
static inline mb_vf mb_vdiv(mb_vf a, mb_vf b) { return a / b; }
static inline mb_vf mb_vldn(const float *p, int n) { (void)n; return *p; }
static inline void mb_vstn(float *p, mb_vf v, int n) { (void)n; *p = v; }
static inline mb_vf mb_vneg(mb_vf a) { return -a; }
static inline mb_vf mb_vmin(mb_vf a, mb_vf b) { return a < b ? a : b; }
static inline int mb_vall_ge(mb_vf a, mb_vf b) { return a >= b; }
static inline mb_vf mb_vexp(mb_vf x) { return mb_exp(x); }
static inline mb_vf mb_vexp_core(mb_vf x) { return mb_exp_core(x); }
#endif

#if MB_VW > 1
/* exp for x in [MB_EXP_LO, MB_EXP_HI] (not NaN), where mb_exp's clamp and selects
 * change nothing */
static inline mb_vf mb_vexp_core(mb_vf xc)
{
    const mb_vf z = mb_vfloor(mb_vfma(xc, mb_vset(MB_EXP_LOG2E), mb_vset(0.5f)));
    mb_vf r = mb_vfma(z, mb_vset(MB_EXP_C1), xc);
    r = mb_vfma(z, mb_vset(MB_EXP_C2), r);
    mb_vf p = mb_vfma(mb_vset(MB_EXP_P0), r, mb_vset(MB_EXP_P1));
    p = mb_vfma(p, r, mb_vset(MB_EXP_P2));
    p = mb_vfma(p, r, mb_vset(MB_EXP_P3));
    p = mb_vfma(p, r, mb_vset(MB_EXP_P4));
    p = mb_vfma(p, r, mb_vset(MB_EXP_P5));
    return mb_vscale2(mb_vadd(mb_vfma(p, mb_vmul(r, r), r), mb_vset(1.0f)), z);
}

static inline mb_vf mb_vexp(mb_vf x)
{
    const mb_vf lo = mb_vset(MB_EXP_LO), hi = mb_vset(MB_EXP_HI);
    mb_vf y = mb_vexp_core(mb_vmin(mb_vmax(x, lo), hi));
    y = mb_vif_lt(x, lo, mb_vzero(), y);
    y = mb_vif_gt(x, hi, mb_vset(mb_u2f_(0x7f800000u)), y);
    return mb_vif_num(x, y, x);
}
#endif

/* mb_silu: x / (1 + exp(-x)), one division */
static inline mb_vf mb_vsilu(mb_vf x) { return mb_vdiv(x, mb_vadd(mb_vset(1.0f), mb_vexp(mb_vneg(x)))); }

#if defined(__AVX2__)
/* d[j * ld + i] = s[i * ls + j] for an 8 x 8 block, in registers */
static inline void mb_tr8x8_(const float *s, int64_t ls, float *d, int64_t ld)
{
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(s + i * ls);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) { /* rows h..h+3: columns j and j + 4 in u[h + j] */
        u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
        u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(d + j * ld, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
        _mm256_storeu_ps(d + (j + 4) * ld, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
    }
}
#endif

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols, in this thread (pure
 * data movement: no bits at stake) */
static inline void mb_transpose_tile(int64_t rows, int64_t cols, const float *src, int64_t lds,
                                     float *dst, int64_t ldd)
{
    /* whole 8 x 8 blocks, then the last rows and columns (bounds written so that
     * with constant sizes the compiler sees the tails are empty) */
#if defined(__AVX2__)
    const int64_t rv = rows & ~(int64_t)7, cv = cols & ~(int64_t)7;
    for (int64_t r0 = 0; r0 < rv; r0 += 8)
        for (int64_t c = 0; c < cv; c += 8)
            mb_tr8x8_(src + r0 * lds + c, lds, dst + c * ldd + r0, ldd);
#else
    const int64_t rv = 0, cv = 0;
#endif
    for (int64_t c = cv; c < cols; c++)
        for (int64_t r = 0; r < rv; r++) dst[c * ldd + r] = src[r * lds + c];
    for (int64_t c = 0; c < cols; c++)
        for (int64_t r = rv; r < rows; r++) dst[c * ldd + r] = src[r * lds + c];
}

#endif
