/* RMSNorm (SPEC 5 step 1) and the block tail shared by every block. */
#include "numerics.h"
#include "ops.h"
#include "gemm.h"
#include "fpenv.h"
#include "simd.h"

#define NROW 8 /* rows whose sum-of-squares chains run side by side */

void MB_ISA_FN(mb_rmsnorm_rows)(int64_t M, int64_t n, const float *x, int64_t ldx,
                                const float *w, float *out, int64_t ldo)
{
    const float fn = (float)n;
    const int64_t nb = (M + NROW - 1) / NROW;
    #pragma omp parallel if (M * n > (1 << 16))
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp for schedule(dynamic, 4)
        for (int64_t blk = 0; blk < nb; blk++) {
            const int64_t m0 = blk * NROW;
            const int nr = M - m0 < NROW ? (int)(M - m0) : NROW;
            const float *xr[NROW]; /* rows past M repeat the last one, unused */
            float ss[NROW];
            for (int u = 0; u < NROW; u++)
                xr[u] = x + (m0 + (u < nr ? u : nr - 1)) * ldx;
            if (n <= MB_DOT_LEAF) {
                /* one leaf: mb_dot's chain, NROW of them in flight */
                for (int u = 0; u < NROW; u++) ss[u] = 0.0f;
                for (int64_t j = 0; j < n; j++)
                    MB_UNROLL
                    for (int u = 0; u < NROW; u++) ss[u] = fmaf(xr[u][j], xr[u][j], ss[u]);
            } else {
                for (int u = 0; u < nr; u++) ss[u] = mb_dot(n, xr[u], 1, xr[u], 1);
            }
            /* every chain is read before any row is written: out may be x */
            for (int u = 0; u < nr; u++) {
                const float r = mb_rsqrt(ss[u] / fn + MB_EPS);
                float *o = out + (m0 + u) * ldo;
                for (int64_t j = 0; j < n; j++)
                    o[j] = (xr[u][j] * r) * w[j];
            }
        }
        mb_fpenv_exit(env);
    }
}

void MB_ISA_FN(mb_out_residual)(int64_t M, int64_t dm, int64_t di, const float *y,
                                const float *W, const float *x, float *scratch, float *out)
{
    MB_ISA_FN(mb_gemm)(M, dm, di, y, di, W, di, scratch, dm);
    #pragma omp parallel for schedule(dynamic, 64) if (M * dm > (1 << 16))
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < dm; j++)
            out[m * dm + j] = x[m * dm + j] + scratch[m * dm + j];
}
