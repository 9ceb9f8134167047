/* numerics.h's scalar functions evaluated elementwise on the device (a test hook):
 * the device's spelling of each (numerics.h takes a few vendor-specific forms of
 * the same operations) must give reference/probe.c's bits. which: an MB_MATH code
 * (mamba_ref.h) of a scalar function. */
#include "vendor.h"
#include "numerics.h"
#include "mamba_ref.h"

MB_KERNEL void mb_math_k(int64_t which, int64_t n, const float *x, float *y)
{
    MB_GRID_LOOP(i, n) {
        const float v = x[i];
        float r;
        switch (which) {
        case MB_MATH_EXP: r = mb_exp(v); break;
        case MB_MATH_LOG1P: r = mb_log1p(v); break;
        case MB_MATH_SOFTPLUS: r = mb_softplus(v); break;
        case MB_MATH_SIGMOID: r = mb_sigmoid(v); break;
        case MB_MATH_SILU: r = mb_silu(v); break;
        case MB_MATH_SQRT: r = mb_sqrt(v); break;
        case MB_MATH_RSQRT: r = mb_rsqrt(v); break;
        case MB_MATH_TANH: r = mb_tanh(v); break;
        case MB_MATH_SIN: r = mb_sin(v); break;
        case MB_MATH_COS: r = mb_cos(v); break;
        case MB_MATH_MOD2PI: r = mb_mod2pi(v); break;
        case MB_MATH_EXPCORE: r = mb_exp_core(v); break;
        default: r = MB_QNAN;
        }
        y[i] = r;
    }
}
