/* Elementwise evaluation of numerics.h for the accuracy and identity tests. */
#include "numerics.h"
#include "simd.h"
#include "mamba_ref.h"
#include "isa.h"

#define EVAL(fn) for (int64_t i = 0; i < n; i++) y[i] = fn(x[i]); break
/* whole vectors, then the last lanes of a partial one */
#define VEVAL(fn)                                                                     \
    for (int64_t i = 0; i < n; i += MB_VW) {                                          \
        const int r = n - i < MB_VW ? (int)(n - i) : MB_VW;                           \
        mb_vstn(y + i, fn(mb_vldn(x + i, r)), r);                                     \
    }                                                                                 \
    break

int MB_ISA_FN(mb_math_eval)(int which, int64_t n, const float *x, float *y)
{
    switch (which) {
    case MB_MATH_EXP: EVAL(mb_exp);
    case MB_MATH_LOG1P: EVAL(mb_log1p);
    case MB_MATH_SOFTPLUS: EVAL(mb_softplus);
    case MB_MATH_SIGMOID: EVAL(mb_sigmoid);
    case MB_MATH_SILU: EVAL(mb_silu);
    case MB_MATH_SQRT: EVAL(mb_sqrt);
    case MB_MATH_RSQRT: EVAL(mb_rsqrt);
    case MB_MATH_TANH: EVAL(mb_tanh);
    case MB_MATH_SIN: EVAL(mb_sin);
    case MB_MATH_COS: EVAL(mb_cos);
    case MB_MATH_MOD2PI: EVAL(mb_mod2pi);
    case MB_MATH_VEXP: VEVAL(mb_vexp);
    case MB_MATH_VSILU: VEVAL(mb_vsilu);
    case MB_MATH_EXPCORE: EVAL(mb_exp_core);
    default: return -1;
    }
    return 0;
}

float MB_ISA_FN(mb_dot_eval)(int64_t k, const float *a, const float *b)
{
    return mb_dot(k, a, 1, b, 1);
}
