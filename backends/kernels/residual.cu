/* The residual add (SPEC 5 step 7), written into the padded (B, L, n) layout:
 * y = x + out at real positions, +0 at padding (out is packed by rows, off); NaN
 * when a decode session's guard refused the step. */
#include "vendor.h"

MB_KERNEL void mb_residual_k(int64_t B, int64_t L, int64_t n, const int64_t *off,
                             const float *x, const float *out, float *y,
                             const unsigned long long *guard)
{
    const bool refused = mb_refused(guard);
    MB_GRID_LOOP(i, B * L * n) {
        const int64_t b = i / (L * n), t = (i / n) % L, j = i % n;
        y[i] = t < off[b + 1] - off[b] ? (refused ? MB_QNAN : x[i] + out[(off[b] + t) * n + j])
                                       : 0.0f;
    }
}
