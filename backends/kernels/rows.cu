/* Ragged batches (reference/rows.c): copy each row's real tokens from the padded
 * (B, L, n) layout into the packed one; padding is never read. */
#include "vendor.h"

MB_KERNEL void mb_pack_rows_k(int64_t B, int64_t L, int64_t n, const int64_t *off,
                              const float *padded, float *packed)
{
    MB_GRID_LOOP(i, B * L * n) {
        const int64_t b = i / (L * n), t = (i / n) % L;
        if (t < off[b + 1] - off[b]) packed[(off[b] + t) * n + i % n] = padded[i];
    }
}
