/* The one math header of the identical profile (SPEC 4.3, 4.4), included by the C
 * reference and by every CUDA/HIP kernel. Only fmaf, floorf, sqrtf, bit casts,
 * integer ops and separately rounded float arithmetic (on NVIDIA also one add
 * rounded down, an exact floor): no libm transcendental, no approximate vendor
 * intrinsic, so every compiler and device produces the same bits.
 *
 * Elementwise functions are branch-free (both sides computed, then selected) so
 * that gcc -O3 -march=x86-64-v3 vectorises loops that call them; mb_sqrt/mb_rsqrt
 * also need -fno-math-errno and mb_mod2pi (floorf) -fno-trapping-math, which the
 * build sets. Constants are decimal literals that round to the spec's float32
 * values; the bit-specified ones are written as their exact decimal expansion. */
#ifndef MB_NUMERICS_H
#define MB_NUMERICS_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MB_FN static __host__ __device__ inline
#else
#define MB_FN static inline
#endif

/* The build already forbids contraction (SPEC 4.2); under clang (HIP, host clang)
 * each function also says so itself, so the bits survive a caller's flags. */
#if defined(__clang__)
#define MB_NOCONTRACT _Pragma("clang fp contract(off)")
#else
#define MB_NOCONTRACT
#endif

#define MB_PI 3.1415927410125732421875f    /* bits 0x40490FDB */
#define MB_TWO_PI 6.283185482025146484375f /* bits 0x40C90FDB */
#define MB_DOT_LEAF 8192

MB_FN uint32_t mb_f2u_(float x)
{
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

MB_FN float mb_u2f_(uint32_t u)
{
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* c ? a : b as data flow. A plain ?: lets gcc sink the computation of a or b into
 * a branch, and with -ftrapping-math (gcc's default) it will not if-convert that
 * branch back, so the calling loop would not vectorise. */
MB_FN float mb_sel_(int c, float a, float b)
{
    uint32_t m = (uint32_t)0 - (uint32_t)(c != 0);
    return mb_u2f_((mb_f2u_(a) & m) | (mb_f2u_(b) & ~m));
}

MB_FN int32_t mb_seli_(int c, int32_t a, int32_t b)
{
    uint32_t m = (uint32_t)0 - (uint32_t)(c != 0);
    return (int32_t)(((uint32_t)a & m) | ((uint32_t)b & ~m));
}

MB_FN float mb_clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

MB_FN float mb_sqrt(float x) { return sqrtf(x); }

MB_FN float mb_rsqrt(float x)
{
    MB_NOCONTRACT
    return 1.0f / sqrtf(x);
}

/* Cephes expf constants (simd.h's vector exp uses the same). */
#define MB_EXP_HI 88.72283935546875f
#define MB_EXP_LO -87.33654022216797f
#define MB_EXP_LOG2E 1.44269504088896341f
#define MB_EXP_C1 -0.693359375f
#define MB_EXP_C2 2.12194440e-4f
#define MB_EXP_P0 1.9875691500e-4f
#define MB_EXP_P1 1.3981999507e-3f
#define MB_EXP_P2 8.3334519073e-3f
#define MB_EXP_P3 4.1665795894e-2f
#define MB_EXP_P4 1.6666665459e-1f
#define MB_EXP_P5 5.0000001201e-1f

/* Cephes expf's reduction and polynomial for xc in [MB_EXP_LO, MB_EXP_HI]: the
 * result before its scaling by 2^k, and k (in [-126, 128]). */
MB_FN float mb_exp_poly_(float xc, int32_t *kout)
{
    MB_NOCONTRACT
    /* z = floor(v) for v in [-125.5, 128.5], exactly: v + 1.5 * 2^23 holds v rounded
     * to an integer in its low bits, one less when that rounded up. No int/float
     * conversion (a GPU runs those at an eighth of the fma rate); floorf would not
     * vectorise under gcc's default -ftrapping-math. */
    float v = fmaf(xc, MB_EXP_LOG2E, 0.5f);
#if defined(__CUDA_ARCH__)
    /* the same floor in one add rounded down: t = floor(v) + 1.5 * 2^23 exactly */
    float t = __fadd_rd(v, 12582912.0f);
    float z = t - 12582912.0f;
    *kout = (int32_t)(mb_f2u_(t) - 0x4B400000u);
#else
    float t = v + 12582912.0f;
    float n = t - 12582912.0f;
    int up = n > v;
    *kout = (int32_t)(mb_f2u_(t) - 0x4B400000u) - up;
    float z = mb_sel_(up, n - 1.0f, n);
#endif
    float r = fmaf(z, MB_EXP_C1, xc);
    r = fmaf(z, MB_EXP_C2, r);
    float p = MB_EXP_P0;
    p = fmaf(p, r, MB_EXP_P1);
    p = fmaf(p, r, MB_EXP_P2);
    p = fmaf(p, r, MB_EXP_P3);
    p = fmaf(p, r, MB_EXP_P4);
    p = fmaf(p, r, MB_EXP_P5);
    return fmaf(p, r * r, r) + 1.0f;
}

/* Cephes expf. The input is clamped before the integer conversion so that it stays
 * defined for every x (NaN included); the selects afterwards apply the thresholds. */
MB_FN float mb_exp(float x)
{
    MB_NOCONTRACT
    const float hi = MB_EXP_HI, lo = MB_EXP_LO;
    float xc = x > lo ? x : lo;
    xc = xc < hi ? xc : hi;
    int32_t k;
    float y = mb_exp_poly_(xc, &k);
    /* k is in [-126, 128]: two factors 2^k1, 2^k2 are normal and never overflow. */
    int32_t k1 = k >> 1, k2 = k - k1;
    y = y * mb_u2f_((uint32_t)(k1 + 127) << 23);
    y = y * mb_u2f_((uint32_t)(k2 + 127) << 23);
    y = mb_sel_(x < lo, 0.0f, y);
    y = mb_sel_(x > hi, mb_u2f_(0x7f800000u), y);
    return mb_sel_(x == x, y, x);
}

/* mb_exp's bits for x in [MB_EXP_LO, 0]: there the clamp and selects change nothing
 * and k is in [-126, 0], so 2^k is one normal factor (y 2^k1 is exact, so both forms
 * round y 2^k once). Callers check the range; the scans' exp(delta * A) lies in it
 * whenever delta >= 0 and delta * min(A) >= MB_EXP_LO (rounding is monotonic). */
MB_FN float mb_exp_core(float x)
{
    MB_NOCONTRACT
    int32_t k;
    float y = mb_exp_poly_(x, &k);
    return y * mb_u2f_((uint32_t)(k + 127) << 23);
}

/* Cephes logf core: log(m * 2^e) with t = m - 1, m in [sqrt(1/2), sqrt(2)).
 * The exponent terms are skipped when e == 0, as in Cephes; that keeps -0 -> -0. */
MB_FN float mb_logcore_(float t, int32_t e)
{
    MB_NOCONTRACT
    float fe = (float)e;
    float z = t * t;
    float p = 7.0376836292e-2f;
    p = fmaf(p, t, -1.1514610310e-1f);
    p = fmaf(p, t, 1.1676998740e-1f);
    p = fmaf(p, t, -1.2420140846e-1f);
    p = fmaf(p, t, 1.4249322787e-1f);
    p = fmaf(p, t, -1.6668057665e-1f);
    p = fmaf(p, t, 2.0000714765e-1f);
    p = fmaf(p, t, -2.4999993993e-1f);
    p = fmaf(p, t, 3.3333331174e-1f);
    float y = (p * t) * z;
    y = mb_sel_(e != 0, fmaf(fe, -2.12194440e-4f, y), y);
    y = fmaf(z, -0.5f, y);
    float r = t + y;
    return mb_sel_(e != 0, fmaf(fe, 0.693359375f, r), r);
}

/* Near 0 the core runs on x itself (no rounding of 1 + x); elsewhere on 1 + x,
 * which is then 0 or normal, so the bitwise frexp below is exact. */
MB_FN float mb_log1p(float x)
{
    MB_NOCONTRACT
    int near0 = (x >= -0.292893230915069580078125f) & (x <= 0.4142135679721832275390625f);
    uint32_t ub = mb_f2u_(1.0f + x);
    int32_t e = (int32_t)((ub >> 23) & 0xffu) - 126;
    float m = mb_u2f_((ub & 0x007fffffu) | 0x3f000000u); /* 1 + x = m 2^e, m in [0.5, 1) */
    int lowm = m < 0.707106769084930419921875f;
    float t = mb_sel_(lowm, (m + m) - 1.0f, m - 1.0f);
    e = mb_seli_(lowm, e - 1, e);
    t = mb_sel_(near0, x, t);
    e = mb_seli_(near0, 0, e);
    float r = mb_logcore_(t, e);
    r = mb_sel_(x == -1.0f, mb_u2f_(0xff800000u), r);
    r = mb_sel_(x < -1.0f, mb_u2f_(0x7fc00000u), r);
    r = mb_sel_(x == mb_u2f_(0x7f800000u), x, r);
    return mb_sel_(x == x, r, x);
}

MB_FN float mb_softplus(float x)
{
    MB_NOCONTRACT
    return mb_sel_(x <= 20.0f, mb_log1p(mb_exp(x)), x);
}

MB_FN float mb_sigmoid(float x)
{
    MB_NOCONTRACT
    return 1.0f / (1.0f + mb_exp(-x));
}

MB_FN float mb_silu(float x)
{
    MB_NOCONTRACT
    return x / (1.0f + mb_exp(-x));
}

/* Cephes tanhf, evaluated on |x| with the sign restored: the same bits as Cephes'
 * signed evaluation for x != 0 (round-to-nearest is symmetric), and tanh(-0) = -0.
 * 2 * 44.361419677734375 is exactly exp's overflow threshold. */
MB_FN float mb_tanh(float x)
{
    MB_NOCONTRACT
    uint32_t sx = mb_f2u_(x) & 0x80000000u;
    float ax = mb_u2f_(mb_f2u_(x) ^ sx);
    float big = 1.0f - 2.0f / (mb_exp(ax + ax) + 1.0f);
    float z = ax * ax;
    float p = -5.70498872745e-3f;
    p = fmaf(p, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    float small = fmaf(p * z, ax, ax);
    float r = mb_sel_(ax >= 0.625f, big, small);
    r = mb_sel_(ax > 44.361419677734375f, 1.0f, r); /* bits 0x42317218 */
    return mb_u2f_(mb_f2u_(r) ^ sx);
}

/* Cephes sinf/cosf share the octant reduction and both polynomials; cosine is a
 * constant after inlining. Beyond 2^24 - 1 Cephes gives 0 (total loss of
 * precision); +-inf and NaN give NaN. */
MB_FN float mb_trig_(float x, int cosine)
{
    MB_NOCONTRACT
    uint32_t sx = mb_f2u_(x) & 0x80000000u;
    float ax = mb_u2f_(mb_f2u_(x) ^ sx);
    int ok = ax <= 16777215.0f;
    float axc = mb_sel_(ok, ax, 0.0f);
    int32_t j = (int32_t)(axc * 1.27323954473516f); /* floor: axc >= 0 */
    j += j & 1; /* map zeros to origin: r in [-pi/4, pi/4] */
    float y = (float)j;
    float r = fmaf(y, -0.78515625f, axc);
    r = fmaf(y, -2.4187564849853515625e-4f, r);
    r = fmaf(y, -3.77489497744594108e-8f, r);
    float z = r * r;
    float ps = fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f);
    ps = fmaf(ps, z, -1.6666654611e-1f);
    float s = fmaf(ps * z, r, r);
    float pc = fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f);
    pc = fmaf(pc, z, 4.166664568298827e-2f);
    float c = fmaf(z, -0.5f, (pc * z) * z) + 1.0f;
    /* j & 7 is 0, 2, 4 or 6: sin gives s, c, -s, -c; cos gives c, -s, -c, s. */
    int odd = (j & 2) != 0;
    uint32_t neg;
    float v;
    if (cosine) {
        v = mb_sel_(odd, s, c);
        neg = (uint32_t)(((j >> 2) ^ (j >> 1)) & 1) << 31;
    } else {
        v = mb_sel_(odd, c, s);
        neg = ((uint32_t)((j >> 2) & 1) << 31) ^ sx;
    }
    v = mb_u2f_(mb_f2u_(v) ^ neg);
    return mb_sel_(ok, v, x - x);
}

MB_FN float mb_sin(float x) { return mb_trig_(x, 0); }

MB_FN float mb_cos(float x) { return mb_trig_(x, 1); }

/* The result lies in [0, TWO_PI] up to one rounding of the quotient: it may equal
 * TWO_PI or be a tiny negative number, both fine for mb_sin/mb_cos. The quotient is
 * not x / TWO_PI but p = x * RN(1 / TWO_PI) corrected by one fma, with x's sign: it
 * can differ from the division by an ulp, but floor() of the two, and so the
 * result, is the same for every float32 x (checked over all 2^32 inputs,
 * docs/numerics.md), and the multiply and two fmas are a fraction of a correctly
 * rounded division, which the angle recurrence runs once a token. */
#define MB_INV_TWO_PI 0.15915493667125701904296875f /* bits 0x3E22F983, RN(1 / TWO_PI) */
MB_FN float mb_mod2pi(float x)
{
    MB_NOCONTRACT
    const float p = x * MB_INV_TWO_PI;
    const float q = copysignf(fmaf(fmaf(-p, MB_TWO_PI, x), MB_INV_TWO_PI, p), x);
    return fmaf(-MB_TWO_PI, floorf(q), x);
}

/* mb_mod2pi's bits for x in [-TWO_PI, 2 TWO_PI): there floor(q) is -1 from -2^-147
 * down (q of the three negatives above it rounds to -0), +-0 below TWO_PI and 1 from
 * it on, so the result is fma(-TWO_PI, k, x) with k exact: x + TWO_PI, x + 0 (which
 * makes -0 +0, as k = -0 does) or x - TWO_PI, picked by compares on x instead of
 * waiting on the quotient (checked over all 2.2e9 floats of the domain). A walk of
 * angles th = mod2pi(th + d) stays in it while th starts in [-0.25, 6.5] and every
 * |d| < 6, mb_mod2pi's results being in [-1e-6, TWO_PI]. */
MB_FN float mb_mod2pi_near(float x)
{
    MB_NOCONTRACT
    const float lo = x + MB_TWO_PI, mid = x + 0.0f, hi = x - MB_TWO_PI;
    return mb_sel_(x >= MB_TWO_PI, hi, mb_sel_(x <= -5.605193857299268e-45f, lo, mid));
}

/* dot v1 (SPEC 4.4): a serial fma chain seeded with +0 over each leaf of 8192. */
MB_FN float mb_dot_chain_(int64_t n, const float *a, int64_t sa, const float *b, int64_t sb)
{
    MB_NOCONTRACT
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++)
        acc = fmaf(a[i * sa], b[i * sb], acc);
    return acc;
}

/* Leaves combine as the level-by-level pairing (0,1), (2,3), ... with an odd last
 * node carried up. That tree is: for P = 2^a1 + 2^a2 + ... (a1 > a2 > ...) leaves,
 * balanced blocks of 2^a1, 2^a2, ... leaves in order, combined B1 + (B2 + (B3 + ...)),
 * because at each level the carried node holds the leaves past the last full block
 * and a full block meets it exactly when that level's bit of P is set. A stack that
 * merges equal-sized neighbours as leaves arrive (a binary counter) builds the same
 * blocks; folding the stack from the top builds the same right-nested sum. Kernels
 * that compute leaves elsewhere join them with the same stack (mb_dot_fold). */
typedef struct {
    float part[64];
    int size[64]; /* log2 of the leaves in each stacked block */
    int top;
} mb_dot_tree;

MB_FN void mb_dot_tree_push(mb_dot_tree *t, float v)
{
    MB_NOCONTRACT
    int lv = 0;
    while (t->top > 0 && t->size[t->top - 1] == lv) {
        v = t->part[--t->top] + v;
        lv++;
    }
    t->part[t->top] = v;
    t->size[t->top] = lv;
    t->top++;
}

MB_FN float mb_dot_tree_sum(mb_dot_tree *t)
{
    MB_NOCONTRACT
    float v = t->part[--t->top];
    while (t->top > 0)
        v = t->part[--t->top] + v;
    return v;
}

/* dot v1's join of P >= 1 leaf results leaves[0], leaves[stride], ... */
MB_FN float mb_dot_fold(int64_t P, const float *leaves, int64_t stride)
{
    mb_dot_tree t;
    t.top = 0;
    for (int64_t p = 0; p < P; p++)
        mb_dot_tree_push(&t, leaves[p * stride]);
    return mb_dot_tree_sum(&t);
}

MB_FN float mb_dot(int64_t k, const float *a, int64_t sa, const float *b, int64_t sb)
{
    if (k <= MB_DOT_LEAF)
        return mb_dot_chain_(k, a, sa, b, sb);
    mb_dot_tree t;
    t.top = 0;
    for (int64_t s = 0; s < k; s += MB_DOT_LEAF) {
        int64_t n = k - s < MB_DOT_LEAF ? k - s : MB_DOT_LEAF;
        mb_dot_tree_push(&t, mb_dot_chain_(n, a + s * sa, sa, b + s * sb, sb));
    }
    return mb_dot_tree_sum(&t);
}

#endif
