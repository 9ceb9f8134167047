/* Building blocks of the backward passes, the GPU twins of reference/grad.c (and of
 * the conv's pre-activation output of reference/conv.c). Every reduction is dot v1
 * (SPEC 4.4): one thread walks one chain, in the reference's order, from +0; a
 * reduction longer than 8192 terms is cut into leaves that separate threads walk,
 * joined afterwards by mb_dot_fold_k (gemm.cu) with mb_dot's tree. Threads split
 * outputs, rows or leaves, never a chain, so grid shapes change no bit.
 * mamba/_cuda_grad.py launches these kernels; its docstring gives each contract. */
#include "vendor.h"
#include "numerics.h"
#include "ops.h"

#define GR_TILE 32     /* transpose tile */
#define GR_ROWS 32     /* rows per block of the RMSNorm backward */
#define GR_KC 64       /* columns per shared-memory stage of it (divides 8192) */
#define GR_THREADS 128
#define TAPS 4
#define GR_U 32        /* terms of a chain loaded ahead (mb_chain_run) */

/* A grid-stride walk over the elements (m, c) of an M x C array in flat order, with
 * t = m % L (L = 1 where unused), stepped by additions: a 64-bit division per element
 * would cost these element-wise kernels more than their memory traffic. */
struct mb_walk {
    int64_t m, c, t, dm, dc, dt, C, L;
};

MB_DEV mb_walk mb_walk_first(int64_t M, int64_t C, int64_t L)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t n = (int64_t)gridDim.x * blockDim.x;
    mb_walk w = {M, 0, 0, 0, 0, 0, C, L};
    if (C > 0) {
        w.m = i / C;
        w.c = i % C;
        w.t = w.m % L;
        w.dm = n / C;
        w.dc = n % C;
        w.dt = w.dm % L;
    }
    return w;
}

MB_DEV void mb_walk_next(mb_walk &w)
{
    const int64_t k = w.c + w.dc >= w.C; /* the step carries into m */
    w.c += w.dc - (k ? w.C : 0);
    w.m += w.dm + k;
    w.t += w.dt + k;
    if (w.t >= w.L) w.t -= w.L;
}

#define MB_WALK(w, M, C, L) for (mb_walk w = mb_walk_first((M), (C), (L)); w.m < (M); mb_walk_next(w))

/* silu'(z) = s (1 + z (1 - s)), s = sigmoid(z), each operation rounded: the device
 * twin of reference/grad.h's mb_dsilu (that header is host-only). */
MB_DEV float mb_dsilu(float z)
{
    const float s = mb_sigmoid(z);
    return s * (1.0f + z * (1.0f - s));
}

/* acc continued over k in [0, n), k ascending, by fma(a[k sa], b[k sb], acc) (PROD)
 * or acc + a[k sa]. A thread walking a chain alone has nothing to hide global memory's
 * latency behind, so the next GR_U terms are loaded while the current GR_U are walked. */
template <bool PROD>
MB_DEV float mb_chain_run(float acc, int64_t n, const float *a, int64_t sa, const float *b,
                          int64_t sb)
{
    float ca[GR_U], cb[GR_U], na[GR_U], nb[GR_U];
    const int64_t full = n / GR_U * GR_U;
#define MB_RUN_LOAD(va, vb, k0)                                                        \
    _Pragma("unroll") for (int j = 0; j < GR_U; j++) {                                \
        va[j] = a[((k0) + j) * sa];                                                   \
        if (PROD) vb[j] = b[((k0) + j) * sb];                                         \
    }
    if (full > 0) MB_RUN_LOAD(ca, cb, 0)
    for (int64_t k = 0; k < full; k += GR_U) {
        const bool more = k + GR_U < full;
        if (more) MB_RUN_LOAD(na, nb, k + GR_U)
#pragma unroll
        for (int j = 0; j < GR_U; j++) acc = PROD ? fmaf(ca[j], cb[j], acc) : acc + ca[j];
        if (more) {
#pragma unroll
            for (int j = 0; j < GR_U; j++) {
                ca[j] = na[j];
                cb[j] = nb[j];
            }
        }
    }
#undef MB_RUN_LOAD
    for (int64_t k = full; k < n; k++)
        acc = PROD ? fmaf(a[k * sa], b[k * sb], acc) : acc + a[k * sa];
    return acc;
}

/* dst[c * ldd + r] = src[r * lds + c]; grid (x over column tiles, y over row tiles),
 * GR_TILE x 8 threads; bytes move untouched. */
MB_KERNEL void MB_BOUNDS(GR_TILE * 8)
mb_transpose_k(int64_t rows, int64_t cols, const float *src, int64_t lds, float *dst, int64_t ldd)
{
    __shared__ float t[GR_TILE][GR_TILE + 1];
    const int tx = threadIdx.x % GR_TILE, ty = threadIdx.x / GR_TILE;
    for (int64_t r0 = (int64_t)blockIdx.y * GR_TILE; r0 < rows; r0 += (int64_t)gridDim.y * GR_TILE)
        for (int64_t c0 = (int64_t)blockIdx.x * GR_TILE; c0 < cols;
             c0 += (int64_t)gridDim.x * GR_TILE) {
            for (int i = ty; i < GR_TILE; i += 8)
                if (r0 + i < rows && c0 + tx < cols) t[i][tx] = src[(r0 + i) * lds + c0 + tx];
            __syncthreads();
            for (int i = ty; i < GR_TILE; i += 8)
                if (c0 + i < cols && r0 + tx < rows) dst[(c0 + i) * ldd + r0 + tx] = t[tx][i];
            __syncthreads();
        }
}

/* Per row m of the RMSNorm backward: rc[2m] = r = rsqrt(dot(x, x) / n + eps) as the
 * forward computes it, rc[2m + 1] = coef = -(((s * r) * r) * r) / n with s = dot v1
 * of (dout * w) and x. A block stages GR_ROWS rows through shared memory, GR_KC
 * columns at a time; thread r walks both chains of row r. */
MB_KERNEL void MB_BOUNDS(GR_THREADS)
mb_rms_bwd_rows_k(int64_t M, int64_t n, const float *x, int64_t ldx, const float *w,
                  const float *dout, int64_t ldd, float *rc)
{
    __shared__ float xs[GR_ROWS][GR_KC + 1], hs[GR_ROWS][GR_KC + 1];
    const int tid = threadIdx.x;
    for (int64_t m0 = (int64_t)blockIdx.x * GR_ROWS; m0 < M; m0 += (int64_t)gridDim.x * GR_ROWS) {
        const int rows = M - m0 < GR_ROWS ? (int)(M - m0) : GR_ROWS;
        float ss = 0.0f, s = 0.0f;
        mb_dot_tree tss, ts;
        tss.top = ts.top = 0;
        for (int64_t k0 = 0; k0 < n; k0 += GR_KC) {
            const int kn = n - k0 < GR_KC ? (int)(n - k0) : GR_KC;
            for (int i = tid; i < GR_ROWS * GR_KC; i += GR_THREADS) {
                const int r = i / GR_KC, k = i % GR_KC;
                if (r < rows && k < kn) {
                    const int64_t m = m0 + r;
                    xs[r][k] = x[m * ldx + k0 + k];
                    hs[r][k] = dout[m * ldd + k0 + k] * w[k0 + k];
                }
            }
            __syncthreads();
            if (tid < rows) {
                if (k0 > 0 && k0 % MB_DOT_LEAF == 0) {
                    mb_dot_tree_push(&tss, ss);
                    mb_dot_tree_push(&ts, s);
                    ss = s = 0.0f;
                }
                for (int k = 0; k < kn; k++) {
                    const float xv = xs[tid][k];
                    ss = fmaf(xv, xv, ss);
                    s = fmaf(hs[tid][k], xv, s);
                }
            }
            __syncthreads();
        }
        if (tid < rows) {
            if (n > MB_DOT_LEAF) {
                mb_dot_tree_push(&tss, ss);
                mb_dot_tree_push(&ts, s);
                ss = mb_dot_tree_sum(&tss);
                s = mb_dot_tree_sum(&ts);
            }
            const float fn = (float)n, r = mb_rsqrt(ss / fn + MB_EPS);
            rc[2 * (m0 + tid)] = r;
            rc[2 * (m0 + tid) + 1] = -(((s * r) * r) * r) / fn;
        }
    }
}

/* dx = ((dout * w) * r) + (x * coef); xr (may be NULL) = x * r. */
MB_KERNEL void mb_rms_bwd_apply_k(int64_t M, int64_t n, const float *x, int64_t ldx,
                                  const float *w, const float *dout, int64_t ldd,
                                  const float *rc, float *dx, int64_t lddx, float *xr,
                                  int64_t ldxr)
{
    MB_WALK(ix, M, n, 1) {
        const int64_t m = ix.m, j = ix.c;
        const float r = rc[2 * m], xv = x[m * ldx + j];
        dx[m * lddx + j] = ((dout[m * ldd + j] * w[j]) * r) + (xv * rc[2 * m + 1]);
        if (xr) xr[m * ldxr + j] = xv * r;
    }
}

/* Leaf p of column c of mb_colfold: the chain over flat tokens k in [8192 p,
 * min(8192 (p + 1), B L)), t = k % L, skipping t < shift, of a[k lda + c] *
 * b[(k - shift) ldb + c] (b NULL: a plain sum), into out[p * ldp + c * so]. The leaf
 * is walked row by row: row r's terms are the run [r L + shift, (r + 1) L). */
MB_KERNEL void mb_colfold_k(int64_t B, int64_t L, int64_t n, const float *a, int64_t lda,
                            const float *b, int64_t ldb, int64_t shift, int64_t P, float *out,
                            int64_t so, int64_t ldp)
{
    const int64_t K = B * L;
    MB_GRID_LOOP(i, n * P) {
        const int64_t c = i % n, p = i / n;
        const int64_t k0 = p * MB_DOT_LEAF, k1 = K < k0 + MB_DOT_LEAF ? K : k0 + MB_DOT_LEAF;
        float acc = 0.0f;
        for (int64_t r0 = k0 - k0 % L; r0 < k1; r0 += L) {
            const int64_t s = r0 + shift > k0 ? r0 + shift : k0, e = r0 + L < k1 ? r0 + L : k1;
            if (s >= e) continue;
            acc = b ? mb_chain_run<true>(acc, e - s, a + s * lda + c, lda,
                                         b + (s - shift) * ldb + c, ldb)
                    : mb_chain_run<false>(acc, e - s, a + s * lda + c, lda, NULL, 0);
        }
        out[p * ldp + c * so] = acc;
    }
}

/* Leaf p of group g of mb_fold_flat: the chain over flat indices k = r * cols + c in
 * [8192 p, min(8192 (p + 1), rows cols)) of a[g ga + r lda + c] * b[g gb + r ldb + c]
 * (b NULL: a plain sum), into out[p * ldp + g * so]. Walked as one strided run when
 * the flat index is one (a single column, or rows packed at their width), else as the
 * runs of each row's columns. */
MB_KERNEL void mb_fold_flat_k(int64_t rows, int64_t cols, const float *a, int64_t lda,
                              const float *b, int64_t ldb, int64_t G, int64_t ga, int64_t gb,
                              int64_t P, float *out, int64_t so, int64_t ldp)
{
    const int64_t K = rows * cols;
    const bool flat = cols == 1 || (lda == cols && (!b || ldb == cols));
    const int64_t sa = cols == 1 ? lda : 1, sb = cols == 1 ? ldb : 1;
    MB_GRID_LOOP(i, G * P) {
        const int64_t g = i % G, p = i / G;
        const int64_t k0 = p * MB_DOT_LEAF, k1 = K < k0 + MB_DOT_LEAF ? K : k0 + MB_DOT_LEAF;
        const float *ag = a + g * ga, *bg = b ? b + g * gb : NULL;
        float acc = 0.0f;
        if (flat) {
            acc = bg ? mb_chain_run<true>(acc, k1 - k0, ag + k0 * sa, sa, bg + k0 * sb, sb)
                     : mb_chain_run<false>(acc, k1 - k0, ag + k0 * sa, sa, NULL, 0);
        } else {
            for (int64_t r = k0 / cols; r * cols < k1; r++) {
                const int64_t s = r * cols > k0 ? r * cols : k0;
                const int64_t e = (r + 1) * cols < k1 ? (r + 1) * cols : k1;
                const float *ar = ag + r * lda + (s - r * cols);
                acc = bg ? mb_chain_run<true>(acc, e - s, ar, 1, bg + r * ldb + (s - r * cols), 1)
                         : mb_chain_run<false>(acc, e - s, ar, 1, NULL, 0);
            }
        }
        out[p * ldp + g * so] = acc;
    }
}

/* The conv of reference/conv.c from a zero window over B rows of L tokens (a prefill
 * with no carried state): pre = the bias-seeded chain over the four taps, oldest
 * first, positions before the row reading the window's +0; u = silu(pre). */
MB_KERNEL void mb_conv_pre_k(int64_t B, int64_t L, int64_t C, const float *in, int64_t ldi,
                             const float *w, const float *bias, float *pre, int64_t ldp,
                             float *u, int64_t ldu)
{
    MB_WALK(ix, B * L, C, L) {
        const int64_t m = ix.m, c = ix.c, t = ix.t;
        float acc = bias[c];
#pragma unroll
        for (int k = 0; k < TAPS; k++) {
            const int64_t p = t - (TAPS - 1) + k;
            acc = fmaf(w[c * TAPS + k], p >= 0 ? in[(m - (TAPS - 1) + k) * ldi + c] : 0.0f, acc);
        }
        pre[m * ldp + c] = acc;
        u[m * ldu + c] = mb_silu(acc);
    }
}

/* d = d * silu'(pre), element-wise over M rows of C channels. */
MB_KERNEL void mb_dsilu_mul_k(int64_t M, int64_t C, float *d, int64_t ldd, const float *pre,
                              int64_t ldp)
{
    MB_WALK(ix, M, C, 1) {
        const int64_t m = ix.m, c = ix.c;
        d[m * ldd + c] = d[m * ldd + c] * mb_dsilu(pre[m * ldp + c]);
    }
}

/* The conv's input gradient: dx[t][c] = the chain over taps k ascending of
 * fma(w[c][k], dpre[t + 3 - k][c], .) from +0, positions past the row's end skipped. */
MB_KERNEL void mb_conv_bwd_dx_k(int64_t B, int64_t L, int64_t C, const float *d, int64_t ldd,
                                const float *w, float *dx, int64_t ldx)
{
    MB_WALK(ix, B * L, C, L) {
        const int64_t m = ix.m, c = ix.c, t = ix.t;
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < TAPS; k++)
            if (t + (TAPS - 1) - k < L) acc = fmaf(w[c * TAPS + k], d[(m + (TAPS - 1) - k) * ldd + c], acc);
        dx[m * ldx + c] = acc;
    }
}

/* out = a + b, element-wise (out may alias a or b). */
MB_KERNEL void mb_add_k(int64_t n, const float *a, const float *b, float *out)
{
    MB_GRID_LOOP(i, n) out[i] = a[i] + b[i];
}

#undef GR_TILE
#undef GR_ROWS
#undef GR_KC
#undef GR_THREADS
#undef TAPS
#undef GR_U
