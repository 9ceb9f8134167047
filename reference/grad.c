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
#define RB 8    /* rows per rmsnorm-backward block */
#define PF 4    /* rows prefetched ahead by the column passes */

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
                                    float *dx, int64_t lddx, float *xr, int64_t ldxr,
                                    const float *res, int64_t ldr)
{
    const float fn = (float)n;
    /* blocks of RB rows: their dot chains run interleaved (mb_dot_rows) */
    #pragma omp parallel for schedule(static) if (M * n > (1 << 16))
    for (int64_t m0 = 0; m0 < M; m0 += RB) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t R = M - m0 < RB ? M - m0 : RB;
        const float *xb = x + m0 * ldx;
        float *ob = dx + m0 * lddx, ss[RB], sd[RB];
        mb_dot_rows(R, n, xb, ldx, xb, ldx, ss, 1);
        for (int64_t i = 0; i < R; i++) {
            const float *dm = dout + (m0 + i) * ldd;
            float *o = ob + i * lddx;
            for (int64_t j = 0; j < n; j++) o[j] = dm[j] * w[j]; /* dxh, in place */
        }
        mb_dot_rows(R, n, ob, lddx, xb, ldx, sd, 1);
        for (int64_t i = 0; i < R; i++) {
            const float *xm = xb + i * ldx;
            float *o = ob + i * lddx;
            const float r = mb_rsqrt(ss[i] / fn + MB_EPS);
            const float coef = -(((sd[i] * r) * r) * r) / fn;
            for (int64_t j = 0; j < n; j++) o[j] = (o[j] * r) + (xm[j] * coef);
            if (res)
                for (int64_t j = 0; j < n; j++) o[j] = o[j] + res[(m0 + i) * ldr + j];
            if (xr)
                for (int64_t j = 0; j < n; j++) xr[(m0 + i) * ldxr + j] = xm[j] * r;
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
    int64_t r0 = 0;
    if (b && cols <= MB_DOT_LEAF && MB_DOT_LEAF % cols == 0) {
        /* whole leaves are whole rows: eight leaves' chains at a time, interleaved */
        const int64_t lr = MB_DOT_LEAF / cols;
        for (; r0 + 8 * lr <= rows; r0 += 8 * lr) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t r = r0; r < r0 + lr; r++)
                for (int64_t c = 0; c < cols; c++)
                    for (int u = 0; u < 8; u++)
                        acc[u] = fmaf(a[(r + u * lr) * lda + c], b[(r + u * lr) * ldb + c], acc[u]);
            for (int u = 0; u < 8; u++) mb_dot_tree_push(&tree, acc[u]);
        }
    }
    float acc = 0.0f;
    int64_t cnt = 0;
    for (int64_t r = r0; r < rows; r++)
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

/* Tokens [m0, m1) (one leaf) of a column block of the conv backward (nc <= CBLK
 * columns at c0): dpre = du * silu'(pre) in place, and from +0 the chains of the
 * bias (acc[4]) and of the taps k (acc[k]: dpre[t] * in[t - 3 + k], terms before the
 * row skipped), in vectors across the columns. */
static void conv_leaf(int64_t m0, int64_t m1, int64_t L, int64_t c0, int64_t nc, float *d,
                      int64_t ldd, const float *pre, int64_t ldp, const float *in, int64_t ldi,
                      float acc[5][CBLK])
{
    enum { NVC = CBLK / MB_VW };
    const mb_vf one = mb_vset(1.0f);
    mb_vf a[5][NVC];
    MB_UNROLL
    for (int o = 0; o < 5; o++)
        MB_UNROLL
        for (int v = 0; v < NVC; v++) a[o][v] = mb_vzero();
    for (int64_t m = m0; m < m1; m++) {
        const int64_t t = m % L;
        float *dm = d + m * ldd + c0;
        const float *pr = pre + m * ldp + c0;
        if (m + PF < m1) /* rows a stride apart: beyond the hardware prefetcher */
            for (int64_t c = 0; c < nc; c += 16) {
                __builtin_prefetch(dm + PF * ldd + c, 1);
                __builtin_prefetch(pr + PF * ldp + c);
                __builtin_prefetch(in + (m + PF) * ldi + c0 + c);
            }
        MB_UNROLL
        for (int v = 0; v < NVC; v++) {
            const int n = nc - v * MB_VW < MB_VW ? (int)(nc - v * MB_VW) : MB_VW;
            if (n <= 0)
                continue;
            /* silu'(z) = s (1 + z (1 - s)), s = 1 / (1 + exp(-z)), as mb_dsilu */
            const mb_vf z = mb_vldn(pr + v * MB_VW, n);
            const mb_vf s = mb_vdiv(one, mb_vadd(one, mb_vexp(mb_vneg(z))));
            const mb_vf ds = mb_vmul(s, mb_vadd(one, mb_vmul(z, mb_vadd(one, mb_vneg(s)))));
            const mb_vf dv = mb_vmul(mb_vldn(dm + v * MB_VW, n), ds);
            mb_vstn(dm + v * MB_VW, dv, n);
            a[4][v] = mb_vadd(a[4][v], dv);
            MB_UNROLL
            for (int k = 0; k < 4; k++)
                if (t >= 3 - k)
                    a[k][v] = mb_vfma(dv, mb_vldn(in + (m - 3 + k) * ldi + c0 + v * MB_VW, n), a[k][v]);
        }
    }
    MB_UNROLL
    for (int o = 0; o < 5; o++)
        MB_UNROLL
        for (int v = 0; v < NVC; v++) {
            const int n = nc - v * MB_VW < MB_VW ? (int)(nc - v * MB_VW) : MB_VW;
            if (n > 0)
                mb_vstn(acc[o] + v * MB_VW, a[o][v], n);
        }
}

void MB_ISA_FN(mb_conv_silu_bwd)(int64_t B, int64_t L, int64_t C, float *d, int64_t ldd,
                                 const float *pre, int64_t ldp, const float *in, int64_t ldi,
                                 const float *w, float *gw, float *gb, float *dx, int64_t ldx)
{
    const int64_t M = B * L, P = (M + MB_DOT_LEAF - 1) / MB_DOT_LEAF, nb = (C + CBLK - 1) / CBLK;
    /* per column block, one pass over the tokens: dpre, then the bias's and the taps'
     * chains (mb_colfold's, with the flat token index cut into leaves); then dx */
    #pragma omp parallel for schedule(dynamic) if (M * C > (1 << 15))
    for (int64_t task = 0; task < nb; task++) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t c0 = task * CBLK, nc = C - c0 < CBLK ? C - c0 : CBLK;
        float acc[5][CBLK];
        mb_dot_tree tree[5][CBLK];
        for (int o = 0; o < 5; o++)
            for (int64_t c = 0; c < nc; c++) tree[o][c].top = 0;
        for (int64_t p = 0; p < (P ? P : 1); p++) {
            const int64_t k1 = (p + 1) * MB_DOT_LEAF < M ? (p + 1) * MB_DOT_LEAF : M;
            conv_leaf(p * MB_DOT_LEAF, k1, L, c0, nc, d, ldd, pre, ldp, in, ldi, acc);
            for (int o = 0; o < 5; o++)
                for (int64_t c = 0; c < nc; c++) mb_dot_tree_push(&tree[o][c], acc[o][c]);
        }
        for (int64_t c = 0; c < nc; c++) {
            gb[c0 + c] = mb_dot_tree_sum(&tree[4][c]);
            for (int k = 0; k < 4; k++) gw[(c0 + c) * 4 + k] = mb_dot_tree_sum(&tree[k][c]);
        }
        /* dx of the block's columns, whose dpre is complete (and still in cache): each
         * output's tap chain in a register, the taps transposed so that a vector of
         * columns loads at once */
        float wt[4][CBLK];
        for (int64_t c = 0; c < nc; c++)
            for (int k = 0; k < 4; k++) wt[k][c] = w[(c0 + c) * 4 + k];
        for (int64_t m = 0; m < M; m++) {
            const int64_t t = m % L;
            const int k0 = t + 4 - L > 0 ? (int)(t + 4 - L) : 0; /* taps past the row skipped */
            for (int64_t c = 0; c < nc; c += MB_VW) {
                const int n = nc - c < MB_VW ? (int)(nc - c) : MB_VW;
                mb_vf acc = mb_vzero();
                for (int k = k0; k < 4; k++)
                    acc = mb_vfma(mb_vldn(wt[k] + c, n), mb_vldn(d + (m + 3 - k) * ldd + c0 + c, n), acc);
                mb_vstn(dx + m * ldx + c0 + c, acc, n);
            }
        }
        mb_fpenv_exit(env);
    }
}
