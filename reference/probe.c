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
#define CASE(code, fn)                                                                \
    case code: EVAL(fn);
    switch (which) {
    MB_MATH_SCALARS(CASE)
    case MB_MATH_VEXP: VEVAL(mb_vexp);
    case MB_MATH_VSILU: VEVAL(mb_vsilu);
    default: return -1;
    }
#undef CASE
    return 0;
}

float MB_ISA_FN(mb_dot_eval)(int64_t k, const float *a, const float *b)
{
    return mb_dot(k, a, 1, b, 1);
}
