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
#define GR_FT 32       /* terms of each chain per stage of the token folds' rings */
#define GR_FS MB_STAGES /* stages of those rings */

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

/* The token folds (mb_colfold_k, mb_fold_flat_k): chain x < n, leaf p is dot v1's
 * serial chain over the flat terms k in [8192 p, min(8192 (p + 1), K)), k ascending,
 * of a[x ga + r lda + c] * b[x gb + r ldb + c + bo] with r = k / cols, c = k % cols
 * (b NULL: a plain sum), terms with k % L < shift skipped, into out[p ldp + x so].
 *
 * A lone chain has no other work to hide memory latency behind, so one warp walks
 * 32 chains (lane i chain x0 + i, one leaf) and each lane feeds its own chain
 * through a ring of GR_FS stages of GR_FT terms in shared memory, filled by cp.async
 * GR_FS - 1 stages ahead. A lane copies only the terms it walks, so the lanes never
 * wait on each other and any launch shape walks every chain in its order. Adjacent
 * lanes are adjacent columns (a colfold, a per-head fold) or adjacent heads' row runs
 * (16-byte copies when aligned), so the copies are coalesced or whole sectors. A
 * lane's stage is a row of GR_FT + 1 floats (4-byte copies: conflict-free across
 * lanes) or GR_FT + 4 (16-byte copies, walked as float4: conflict-free per phase).
 * The copies take a tile "plain" (unrolled, no per-term test) when it is whole,
 * holds no masked term and stays within one row run; the walk, when it is whole. */
#if defined(__HIPCC__)
#define GR_WARP_SYNC() ((void)0) /* the copies are synchronous: nothing to order */
#else
#define GR_WARP_SYNC() __syncwarp() /* orders a lane's shared reads and its cp.async */
#endif

struct mb_fold_args {
    int64_t K, cols, L, shift, n, lda, ga, ldb, gb, bo, P, so, ldp;
    const float *a, *b;
    float *out;
};

/* Where a lane's copies stand: the next term's offsets into a and b, its place c in
 * its run (a row of cols terms, or one endless run when the terms are evenly spaced)
 * and its token t (k % L, tracked only when shift > 0). */
struct mb_fold_pos {
    int64_t oa, ob, c, t;
};

/* Copy cnt terms (a multiple of V) of the lane's chain into sa, sb; masked terms
 * are zero-filled without a read (mb_fold_walk). */
template <int V, bool PROD>
MB_DEV void mb_fold_copy(const mb_fold_args &g, mb_fold_pos &q, float *sa, float *sb, int cnt,
                         int64_t sta, int64_t stb, int64_t run, int64_t ja, int64_t jb)
{
    const bool plain = cnt == GR_FT && q.c + GR_FT <= run &&
                       (g.shift == 0 || (q.t >= g.shift && q.t + GR_FT <= g.L));
    if (plain) {
        const float *pa = g.a + q.oa, *pb = PROD ? g.b + q.ob : NULL;
#pragma unroll
        for (int j = 0; j < GR_FT; j += V) {
            if (V == 4) mb_cp_async16(sa + j, pa, 16); else mb_cp_async4(sa + j, pa, 4);
            if (PROD) {
                if (V == 4) mb_cp_async16(sb + j, pb, 16); else mb_cp_async4(sb + j, pb, 4);
                pb += V * stb;
            }
            pa += V * sta;
        }
        q.oa += GR_FT * sta;
        q.ob += GR_FT * stb;
        q.c += GR_FT;
        if (g.shift > 0) {
            q.t += GR_FT;
            if (q.t == g.L) q.t = 0;
        }
    } else {
        for (int j = 0; j < cnt; j += V) {
            const bool live = g.shift == 0 || q.t >= g.shift;
            if (V == 4) {
                mb_cp_async16(sa + j, g.a + q.oa, 16);
                if (PROD) mb_cp_async16(sb + j, g.b + q.ob, 16);
            } else {
                mb_cp_async4(sa + j, live ? g.a + q.oa : g.a, live ? 4 : 0);
                if (PROD) mb_cp_async4(sb + j, live ? g.b + q.ob : g.b, live ? 4 : 0);
            }
            q.oa += V * sta;
            q.ob += V * stb;
            q.c += V;
            if (g.shift > 0 && ++q.t == g.L) q.t = 0;
            if (q.c == run) {
                q.c = 0;
                q.oa += ja;
                q.ob += jb;
            }
        }
    }
    if (q.c == run) { /* a plain tile ended its row */
        q.c = 0;
        q.oa += ja;
        q.ob += jb;
    }
}

/* acc continued over the cnt staged terms. A masked term was staged as a = b = +0,
 * which leaves acc as it is (fma(+0, +0, acc) and acc + +0 are acc, acc never being
 * -0 on a chain seeded with +0): the same bits as skipping it. */
template <int V, bool PROD>
MB_DEV float mb_fold_walk(float acc, const float *sa, const float *sb, int cnt)
{
    if (cnt == GR_FT) {
        if (V == 4) {
#pragma unroll
            for (int j = 0; j < GR_FT; j += 4) {
                const float4 x = *(const float4 *)(sa + j);
                if (PROD) {
                    const float4 y = *(const float4 *)(sb + j);
                    acc = fmaf(x.x, y.x, acc);
                    acc = fmaf(x.y, y.y, acc);
                    acc = fmaf(x.z, y.z, acc);
                    acc = fmaf(x.w, y.w, acc);
                } else {
                    acc = acc + x.x;
                    acc = acc + x.y;
                    acc = acc + x.z;
                    acc = acc + x.w;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < GR_FT; j++) acc = PROD ? fmaf(sa[j], sb[j], acc) : acc + sa[j];
        }
        return acc;
    }
    for (int j = 0; j < cnt; j++) acc = PROD ? fmaf(sa[j], sb[j], acc) : acc + sa[j];
    return acc;
}

/* The fold's chains, warp by warp (a grid-stride loop over (column group, leaf)). */
template <int V, bool PROD>
MB_DEV void mb_fold_run(const mb_fold_args &g, float *st)
{
    constexpr int S = GR_FT + (V == 4 ? 4 : 1);
    const int lane = threadIdx.x % 32;
    const int64_t nx = (g.n + 31) / 32, items = nx * g.P;
    /* Evenly spaced terms (one column, or rows packed at their width) are one run. */
    const bool one = g.cols == 1 || (g.lda == g.cols && (!PROD || g.ldb == g.cols));
    const int64_t sta = g.cols == 1 ? g.lda : 1, stb = g.cols == 1 ? g.ldb : 1;
    const int64_t run = one ? INT64_MAX : g.cols;
    const int64_t ja = one ? 0 : g.lda - g.cols, jb = one ? 0 : g.ldb - g.cols;
    for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < items;
         w += (int64_t)gridDim.x * blockDim.x / 32) {
        const int64_t p = w / nx, x0 = (w % nx) * 32;
        /* lanes past n walk chain n - 1 too (every lane keeps the warp's pace), unwritten */
        const int64_t x = x0 + lane < g.n ? x0 + lane : g.n - 1;
        const int64_t k0 = p * MB_DOT_LEAF, k1 = g.K < k0 + MB_DOT_LEAF ? g.K : k0 + MB_DOT_LEAF;
        const int64_t r0 = k0 < g.K ? k0 / g.cols : 0, c0 = k0 < g.K ? k0 % g.cols : 0;
        mb_fold_pos q;
        q.oa = x * g.ga + r0 * g.lda + c0;
        q.ob = x * g.gb + r0 * g.ldb + c0 + g.bo;
        q.c = one ? 0 : c0;
        q.t = g.shift > 0 && k0 < g.K ? k0 % g.L : 0;
        int64_t kc = k0;
        const int tiles = (int)((k1 - k0 + GR_FT - 1) / GR_FT);
        float acc = 0.0f;
        for (int i = 0; i < GR_FS - 1; i++) {
            if (i < tiles) {
                const int cnt = k1 - kc < GR_FT ? (int)(k1 - kc) : GR_FT;
                float *sa = st + ((i * 2) * 32 + lane) * S, *sb = sa + 32 * S;
                mb_fold_copy<V, PROD>(g, q, sa, sb, cnt, sta, stb, run, ja, jb);
                kc += cnt;
            }
            mb_cp_commit();
        }
        for (int i = 0; i < tiles; i++) {
            if (i + GR_FS - 1 < tiles) {
                const int cnt = k1 - kc < GR_FT ? (int)(k1 - kc) : GR_FT;
                float *sa = st + ((((i + GR_FS - 1) % GR_FS) * 2) * 32 + lane) * S;
                mb_fold_copy<V, PROD>(g, q, sa, sa + 32 * S, cnt, sta, stb, run, ja, jb);
                kc += cnt;
            }
            mb_cp_commit();
            mb_cp_wait<GR_FS - 1>();
            GR_WARP_SYNC();
            const int64_t kw = k0 + (int64_t)i * GR_FT;
            const int cnt = k1 - kw < GR_FT ? (int)(k1 - kw) : GR_FT;
            const float *sa = st + (((i % GR_FS) * 2) * 32 + lane) * S;
            acc = mb_fold_walk<V, PROD>(acc, sa, sa + 32 * S, cnt);
            GR_WARP_SYNC(); /* the next copy refills this stage */
        }
        if (x0 + lane < g.n) g.out[p * g.ldp + x * g.so] = acc;
    }
}

/* 16-byte copies when every run of a lane's terms is whole aligned float4s. The
 * ring: per stage, a row of a's terms then one of b's per lane (one warp a block:
 * the kernels launch 32 threads a block). */
MB_DEV void mb_fold(const mb_fold_args &g)
{
    __shared__ __attribute__((aligned(16))) float ring[GR_FS * 2 * 32 * (GR_FT + 4)];
    const bool one = g.cols == 1 || (g.lda == g.cols && (!g.b || g.ldb == g.cols));
    const bool vec = g.cols > 1 && g.shift == 0 && g.cols % 4 == 0 && g.K % 4 == 0 &&
                     (one || (g.lda % 4 == 0 && (!g.b || g.ldb % 4 == 0))) && g.ga % 4 == 0 &&
                     (uintptr_t)g.a % 16 == 0 &&
                     (!g.b || ((uintptr_t)g.b % 16 == 0 && g.gb % 4 == 0 && g.bo % 4 == 0));
    if (vec) {
        if (g.b) mb_fold_run<4, true>(g, ring); else mb_fold_run<4, false>(g, ring);
    } else {
        if (g.b) mb_fold_run<1, true>(g, ring); else mb_fold_run<1, false>(g, ring);
    }
}

/* mb_colfold: column c's chain over flat tokens k (t = k % L, t < shift skipped) of
 * a[k lda + c] * b[(k - shift) ldb + c] (b NULL: a plain sum), leaf p into
 * out[p * ldp + c * so]. One warp per 32 columns and leaf (mb_fold). */
MB_KERNEL void MB_BOUNDS(32)
mb_colfold_k(int64_t B, int64_t L, int64_t n, const float *a, int64_t lda, const float *b,
             int64_t ldb, int64_t shift, int64_t P, float *out, int64_t so, int64_t ldp)
{
    const mb_fold_args g = {B * L, 1, L, shift, n, lda, 1, ldb, 1, -shift * ldb, P, so, ldp,
                            a, b, out};
    mb_fold(g);
}

/* mb_fold_flat, G of them: group g's chain over flat indices k = r * cols + c of
 * a[g ga + r lda + c] * b[g gb + r ldb + c] (b NULL: a plain sum), leaf p into
 * out[p * ldp + g * so]. One warp per 32 groups and leaf (mb_fold). */
MB_KERNEL void MB_BOUNDS(32)
mb_fold_flat_k(int64_t rows, int64_t cols, const float *a, int64_t lda, const float *b,
               int64_t ldb, int64_t G, int64_t ga, int64_t gb, int64_t P, float *out,
               int64_t so, int64_t ldp)
{
    const mb_fold_args g = {rows * cols, cols, 1, 0, G, lda, ga, ldb, gb, 0, P, so, ldp,
                            a, b, out};
    mb_fold(g);
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
#undef GR_FT
#undef GR_FS
#undef GR_WARP_SYNC
