/* A strided device array into C order (non-contiguous inputs are copied, SPEC 9).
 * Bytes move untouched. Shapes and strides (in elements) travel by value. */
#include "vendor.h"

#define MAX_NDIM 8

typedef struct {
    int64_t ndim;
    int64_t shape[MAX_NDIM];
    int64_t strides[MAX_NDIM];
} mb_layout;

MB_KERNEL void mb_gather_k(int64_t n, mb_layout g, const uint32_t *src, uint32_t *dst)
{
    MB_GRID_LOOP(i, n) {
        int64_t rest = i, at = 0;
        for (int64_t d = g.ndim - 1; d >= 0; d--) {
            at += (rest % g.shape[d]) * g.strides[d];
            rest /= g.shape[d];
        }
        dst[i] = src[at];
    }
}

#undef MAX_NDIM
