/* RMSNorm rows (SPEC 5 step 1), the GPU twin of reference/norm.c: one block per
 * row; one thread runs dot v1 over the row (a serial chain cannot be split), then
 * the block scales the row. */
#include "vendor.h"
#include "numerics.h"
#include "ops.h"

MB_KERNEL void mb_rmsnorm_k(int64_t M, int64_t n, const float *x, int64_t ldx, const float *w,
                            float *out, int64_t ldo)
{
    __shared__ float r;
    for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
        const float *xr = x + m * ldx;
        if (threadIdx.x == 0) r = mb_rsqrt(mb_dot(n, xr, 1, xr, 1) / (float)n + MB_EPS);
        __syncthreads();
        float *o = out + m * ldo;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) o[j] = (xr[j] * r) * w[j];
        __syncthreads();
    }
}
