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
#define CASE(code, fn)                                                                \
    case code: r = fn(v); break;
        MB_MATH_SCALARS(CASE)
#undef CASE
        default: r = MB_QNAN;
        }
        y[i] = r;
    }
}
