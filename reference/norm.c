/* RMSNorm (SPEC 5 step 1): ss = dot(x, x); r = rsqrt(ss / n + eps); (x * r) * w. */
#include "numerics.h"
#include "ops.h"
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
