/* Building blocks of the backward passes (each compiled per ISA, see isa.h). Every
 * reduction is dot v1 (SPEC 4.4); "fold over tokens" means the flat token index
 * (row-major b, then t) is the reduction index, in 8192-leaves joined by the tree. */
#ifndef MB_GRAD_H
#define MB_GRAD_H
#include <stdint.h>
#include "isa.h"
#include "numerics.h"

/* silu'(z) = s (1 + z (1 - s)), s = sigmoid(z), each operation rounded. */
static inline float mb_dsilu(float z)
{
    const float s = mb_sigmoid(z);
    return s * (1.0f + z * (1.0f - s));
}

/* out[r * so] = mb_dot(n, a + r * lda, 1, b + r * ldb, 1) for r < R: eight rows' chains
 * at a time, interleaved so that their latencies overlap (a last group of fewer rows
 * repeats its last row, whose extra chains are dropped). */
static inline void mb_dot_rows(int64_t R, int64_t n, const float *a, int64_t lda,
                               const float *b, int64_t ldb, float *out, int64_t so)
{
    int64_t r = 0;
    if (n <= MB_DOT_LEAF)
        for (; r < R; r += 8) {
            const int nr = R - r < 8 ? (int)(R - r) : 8;
            const float *ar[8], *br[8];
            for (int j = 0; j < 8; j++) {
                ar[j] = a + (r + (j < nr ? j : nr - 1)) * lda;
                br[j] = b + (r + (j < nr ? j : nr - 1)) * ldb;
            }
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t k = 0; k < n; k++)
                for (int j = 0; j < 8; j++) acc[j] = fmaf(ar[j][k], br[j][k], acc[j]);
            for (int j = 0; j < nr; j++) out[(r + j) * so] = acc[j];
        }
    for (; r < R; r++) out[r * so] = mb_dot(n, a + r * lda, 1, b + r * ldb, 1);
}

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols. */
void MB_ISA_FN(mb_transpose)(int64_t rows, int64_t cols, const float *src, int64_t lds,
                             float *dst, int64_t ldd);

/* Backward of mb_rmsnorm_rows (out = (x * r) * w, r = rsqrt(dot(x, x) / n + eps)) for
 * M rows: with dxh = dout * w, s = dot v1(dxh, x) and coef = -(((s * r) * r) * r) / n,
 * dx = (dxh * r) + (x * coef), then + res when res is not NULL (a residual's
 * gradient). xr (may be NULL) receives x * r, the factor of w's gradient. dx must not
 * alias x, dout or res. */
void MB_ISA_FN(mb_rmsnorm_bwd_rows)(int64_t M, int64_t n, const float *x, int64_t ldx,
                                    const float *w, const float *dout, int64_t ldd,
                                    float *dx, int64_t lddx, float *xr, int64_t ldxr,
                                    const float *res, int64_t ldr);

/* out[c * so] for c < n: dot v1 over the flat tokens (b, t), b < B, t < L, skipping
 * t < shift, of a[(b L + t) lda + c] * y, y = b_[(b L + t - shift) ldb + c], or y = 1
 * when b_ is NULL (a plain sum). Leaves cut the flat index (skipped terms included)
 * every 8192. Threads split the columns. */
void MB_ISA_FN(mb_colfold)(int64_t B, int64_t L, int64_t n, const float *a, int64_t lda,
                           const float *b_, int64_t ldb, int64_t shift, float *out, int64_t so);

/* dot v1 over the flat index r * cols + c (r < rows outer, c < cols inner) of
 * a[r lda + c] * b[r ldb + c] (b NULL: times 1). */
float MB_ISA_FN(mb_fold_flat)(int64_t rows, int64_t cols, const float *a, int64_t lda,
                              const float *b, int64_t ldb);

/* Backward of a linear layer Y = X . W^T (mb_gemm) over M tokens, X (M, K), W (N, K),
 * given dY (M, N): gW (N, K) = the fold over the tokens of dY[m][n] * X[m][k]; dX (M, K)
 * = dY . W, dot v1 over n (skipped when dX is NULL). Both read their operands in place
 * (mb_gemm_kn). Returns MB_OK or MB_ENOMEM (scratch). */
int MB_ISA_FN(mb_linear_bwd)(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
                             const float *W, int64_t ldw, const float *dY, int64_t ldy,
                             float *gW, float *dX, int64_t lddx);

/* Backward of mb_conv_silu_pre from a zero window, over B rows of L tokens and C
 * channels. d[m * ldd + c] holds du on entry and dpre = du * silu'(pre) on return.
 * gb (C) and gw (C, 4) fold over the tokens: dpre, and dpre[t] * in[t - 3 + k] (terms
 * before the row skipped). dx[m * ldx + c] = the chain over taps k ascending of
 * fma(w[c][k], dpre[t + 3 - k], .) from +0, skipping t + 3 - k >= L. */
void MB_ISA_FN(mb_conv_silu_bwd)(int64_t B, int64_t L, int64_t C, float *d, int64_t ldd,
                                 const float *pre, int64_t ldp, const float *in, int64_t ldi,
                                 const float *w, float *gw, float *gb, float *dx, int64_t ldx);

#endif
