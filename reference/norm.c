/* RMSNorm (SPEC 5 step 1) and the block tail shared by every block. */
#include "numerics.h"
#include "ops.h"
#include "gemm.h"
#include "fpenv.h"

void MB_ISA_FN(mb_rmsnorm_rows)(int64_t M, int64_t n, const float *x, int64_t ldx,
                                const float *w, float *out, int64_t ldo)
{
    const float fn = (float)n;
    #pragma omp parallel if (M * n > (1 << 16))
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * ldx;
            float *o = out + m * ldo;
            float r = mb_rsqrt(mb_dot(n, xr, 1, xr, 1) / fn + MB_EPS);
            for (int64_t j = 0; j < n; j++)
                o[j] = (xr[j] * r) * w[j];
        }
        mb_fpenv_exit(env);
    }
}

void MB_ISA_FN(mb_out_residual)(int64_t M, int64_t dm, int64_t di, const float *y,
                                const float *W, const float *x, float *scratch, float *out)
{
    MB_ISA_FN(mb_gemm)(M, dm, di, y, di, W, di, scratch, dm);
    for (int64_t i = 0; i < M * dm; i++)
        out[i] = x[i] + scratch[i];
}
