/* Backward building blocks shared by the blocks (grad.h). */
#include <stdlib.h>
#include "numerics.h"
#include "ops.h"
#include "grad.h"
#include "fpenv.h"
#include "gemm.h"
#include "mamba_ref.h"
#include "simd.h"

#define TB 32   /* transpose tile */
#define CBLK 64 /* columns per colfold task */

void MB_ISA_FN(mb_transpose)(int64_t rows, int64_t cols, const float *src, int64_t lds,
                             float *dst, int64_t ldd)
{
    const int64_t nr = (rows + TB - 1) / TB, nc = (cols + TB - 1) / TB;
    #pragma omp parallel for schedule(static) if (rows * cols > (1 << 18))
    for (int64_t task = 0; task < nr * nc; task++) {
        const int64_t r0 = task / nc * TB, c0 = task % nc * TB;
        const int64_t r1 = r0 + TB < rows ? r0 + TB : rows, c1 = c0 + TB < cols ? c0 + TB : cols;
        mb_transpose_tile(r1 - r0, c1 - c0, src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
    }
}

void MB_ISA_FN(mb_rmsnorm_bwd_rows)(int64_t M, int64_t n, const float *x, int64_t ldx,
                                    const float *w, const float *dout, int64_t ldd,
                                    float *dx, int64_t lddx, float *xr, int64_t ldxr)
{
    const float fn = (float)n;
    #pragma omp parallel if (M * n > (1 << 16))
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * ldx, *dm = dout + m * ldd;
            float *o = dx + m * lddx;
            const float r = mb_rsqrt(mb_dot(n, xm, 1, xm, 1) / fn + MB_EPS);
            for (int64_t j = 0; j < n; j++) o[j] = dm[j] * w[j]; /* dxh, in place */
            const float s = mb_dot(n, o, 1, xm, 1);
            const float coef = -(((s * r) * r) * r) / fn;
            for (int64_t j = 0; j < n; j++) o[j] = (o[j] * r) + (xm[j] * coef);
            if (xr)
                for (int64_t j = 0; j < n; j++) xr[m * ldxr + j] = xm[j] * r;
        }
        mb_fpenv_exit(env);
    }
}

void MB_ISA_FN(mb_colfold)(int64_t B, int64_t L, int64_t n, const float *a, int64_t lda,
                           const float *b_, int64_t ldb, int64_t shift, float *out, int64_t so)
{
    const int64_t K = B * L, P = (K + MB_DOT_LEAF - 1) / MB_DOT_LEAF, nb = (n + CBLK - 1) / CBLK;
    #pragma omp parallel for schedule(dynamic) if (K * n > (1 << 16))
    for (int64_t task = 0; task < nb; task++) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t c0 = task * CBLK, nc = n - c0 < CBLK ? n - c0 : CBLK;
        float acc[CBLK];
        mb_dot_tree tree[CBLK];
        for (int64_t c = 0; c < nc; c++) tree[c].top = 0;
        for (int64_t p = 0; p < (P ? P : 1); p++) {
            const int64_t k1 = (p + 1) * MB_DOT_LEAF < K ? (p + 1) * MB_DOT_LEAF : K;
            for (int64_t c = 0; c < nc; c++) acc[c] = 0.0f;
            for (int64_t k = p * MB_DOT_LEAF; k < k1; k++) {
                const int64_t t = k % L;
                if (t < shift)
                    continue;
                const float *ar = a + k * lda + c0;
                if (b_) {
                    const float *br = b_ + (k - shift) * ldb + c0;
                    for (int64_t c = 0; c < nc; c++) acc[c] = fmaf(ar[c], br[c], acc[c]);
                } else {
                    for (int64_t c = 0; c < nc; c++) acc[c] = acc[c] + ar[c];
                }
            }
            for (int64_t c = 0; c < nc; c++) mb_dot_tree_push(&tree[c], acc[c]);
        }
        for (int64_t c = 0; c < nc; c++) out[(c0 + c) * so] = mb_dot_tree_sum(&tree[c]);
        mb_fpenv_exit(env);
    }
}

float MB_ISA_FN(mb_fold_flat)(int64_t rows, int64_t cols, const float *a, int64_t lda,
                              const float *b, int64_t ldb)
{
    mb_dot_tree tree;
    tree.top = 0;
    float acc = 0.0f;
    int64_t cnt = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            acc = b ? fmaf(a[r * lda + c], b[r * ldb + c], acc) : acc + a[r * lda + c];
            if (++cnt == MB_DOT_LEAF) {
                mb_dot_tree_push(&tree, acc);
                acc = 0.0f;
                cnt = 0;
            }
        }
    if (cnt || !tree.top)
        mb_dot_tree_push(&tree, acc);
    return mb_dot_tree_sum(&tree);
}

int MB_ISA_FN(mb_linear_bwd)(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
                             const float *W, int64_t ldw, const float *dY, int64_t ldy,
                             float *gW, float *dX, int64_t lddx)
{
    if (!MB_ISA_FN(mb_gemm_kn)(N, K, M, dY, 1, ldy, X, ldx, gW, K))
        return MB_ENOMEM;
    if (dX && !MB_ISA_FN(mb_gemm_kn)(M, K, N, dY, ldy, 1, W, ldw, dX, lddx))
        return MB_ENOMEM;
    return MB_OK;
}

void MB_ISA_FN(mb_conv_silu_bwd)(int64_t B, int64_t L, int64_t C, float *d, int64_t ldd,
                                 const float *pre, int64_t ldp, const float *in, int64_t ldi,
                                 const float *w, float *gw, float *gb, float *dx, int64_t ldx)
{
    const int64_t M = B * L;
    #pragma omp parallel for schedule(static) if (M * C > (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        mb_fpenv env = mb_fpenv_enter();
        float *dm = d + m * ldd;
        const float *pr = pre + m * ldp;
        for (int64_t c = 0; c < C; c++) dm[c] = dm[c] * mb_dsilu(pr[c]);
        mb_fpenv_exit(env);
    }
    MB_ISA_FN(mb_colfold)(B, L, C, d, ldd, NULL, 0, 0, gb, 1);
    for (int k = 0; k < 4; k++)
        MB_ISA_FN(mb_colfold)(B, L, C, d, ldd, in, ldi, 3 - k, gw + k, 4);
    #pragma omp parallel for schedule(static) if (M * C > (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t t = m % L;
        float *o = dx + m * ldx;
        for (int64_t c = 0; c < C; c++) o[c] = 0.0f;
        for (int k = 0; k < 4; k++) {
            if (t + 3 - k >= L)
                continue;
            const float *dp = d + (m + 3 - k) * ldd;
            for (int64_t c = 0; c < C; c++) o[c] = fmaf(w[c * 4 + k], dp[c], o[c]);
        }
        mb_fpenv_exit(env);
    }
}
