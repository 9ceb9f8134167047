/* Y = X . W^T under dot v1 (SPEC 4.4), the GPU twin of reference/gemm.c.
 *
 * A tiled SGEMM: each thread owns 16x8 outputs and walks k in ascending order with
 * one fmaf per term from +0, no split-K, so every output is the serial chain of dot
 * v1 whatever the tile or grid. Terms past K are skipped (the last tile's loop stops
 * at K), never multiplied by a zero pad: a pad could turn an accumulated -0 into
 * +0. For K > 8192, blockIdx.z is the leaf: each leaf writes its chains to its own
 * slice and mb_dot_fold_k joins them with mb_dot's tree. mb_gemv_k is the same
 * chains for a few rows of X (decode). */
#include "vendor.h"
#include "numerics.h"
#include "chain.h"

/* One tile shape of the kernels below: BM x BN outputs per block, warps of WM x WN
 * outputs (lanes LY along M x LX along N), each lane TM x TN of them (TM / 4 x TN / 4
 * blocks of 4 x 4), blockDim (BM / WM) (BN / WN) warps, BK terms a k-tile. Grid
 * (ceil(M/BM) ceil(N/BN), 1, leaves): block x takes tile x of the row-major order over
 * (M / BM, N / BN); leaf z writes Y + z * ldleaf.
 * Loads: float4 f = tid + q * threads of a tile is row f / (BK / 4), k 4 (f % (BK /
 * 4)) + 0..3, so (BK 8) a warp reads 16 rows x 32 bytes, one sector each; rows past M
 * or N read row 0 instead (their outputs are never stored). The next tile is loaded
 * into registers while the current one is walked, then stored transposed (k-major)
 * into the other of two shared buffers. Rows are padded by 4 floats: a warp's scalar
 * stores then hit distinct banks, while a lane's 4 rows (columns) at one k stay one
 * float4, and a warp's fragment reads are broadcasts of 4 (8) distinct float4. The
 * fragments of k + 1 are read while the fmas of k run; at a tile's last k, the next
 * tile is stored, one barrier passed and its first fragments read, so one barrier per
 * tile suffices. The fmas of a k walk the thread's outputs in a serpentine (odd rows
 * backwards), so consecutive fmas share an operand register (7% faster on the H200
 * than row by row). RES: Y = res + chain, as mb_residual_k would add the residual
 * (uniform rows: res has Y's layout, ld ldr); a compile-time choice, since a runtime
 * one changed the main loop's register allocation and cost 6% on the H200. */
template <int BM, int BN, int WM, int WN, int TM, int TN, int BK, bool RES>
MB_DEV void gemm_tiles(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
                       const float *W, int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf,
                       const float *res, int64_t ldr)
{
    constexpr int THREADS = 32 * (BM / WM) * (BN / WN), LY = WM / TM, LX = WN / TN;
    static_assert(LY * LX == 32, "a warp is 32 lanes");
    constexpr int FA = BM * BK / 4, FB = BN * BK / 4; /* float4 of X, of W per tile */
    constexpr int QA = (FA + THREADS - 1) / THREADS, QB = (FB + THREADS - 1) / THREADS;
    __shared__ __align__(16) float As[2][BK][BM + 4];
    __shared__ __align__(16) float Bs[2][BK][BN + 4];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / (BN / WN) * WM, wn = warp % (BN / WN) * WN;
    const int ly = lane / LX, lx = lane % LX;
    const int64_t tn = (N + BN - 1) / BN, m0 = blockIdx.x / tn * BM, n0 = blockIdx.x % tn * BN;
    const int64_t k0 = (int64_t)blockIdx.z * MB_DOT_LEAF;
    const int kl = (int)(K - k0 < MB_DOT_LEAF ? K - k0 : MB_DOT_LEAF); /* this leaf's terms */
    Y += (int64_t)blockIdx.z * ldleaf;
    const bool vec = ((ldx | ldw) & 3) == 0 && (((uintptr_t)X | (uintptr_t)W) & 15) == 0;

    /* a thread's float4 slots of one operand's tile: rows, k offsets, row pointers
     * (a slot past the tile, when the threads do not divide it, loads nothing) */
    struct slots {
        int r, c;
        const float *p;
        bool on;
    };
    auto place = [&](slots *sl, int Q, int F, const float *A, int64_t lda, int64_t r0,
                     int64_t R) {
#pragma unroll
        for (int q = 0; q < Q; q++) {
            const int f = tid + q * THREADS;
            sl[q].on = F % THREADS == 0 || f < F;
            sl[q].r = sl[q].on ? f / (BK / 4) : 0;
            sl[q].c = f % (BK / 4) * 4;
            sl[q].p = A + (r0 + sl[q].r < R ? r0 + sl[q].r : 0) * lda + k0 + sl[q].c;
        }
    };
    slots sa[QA], sb[QB];
    place(sa, QA, FA, X, ldx, m0, M);
    place(sb, QB, FB, W, ldw, n0, N);
    float4 pa[QA], pb[QB];
    auto load4 = [&](int kt) { /* a whole tile of float4 (vec) */
#pragma unroll
        for (int q = 0; q < QA; q++)
            if (sa[q].on) pa[q] = *(const float4 *)(sa[q].p + kt);
#pragma unroll
        for (int q = 0; q < QB; q++)
            if (sb[q].on) pb[q] = *(const float4 *)(sb[q].p + kt);
    };
    auto load = [&](int kt) {
        /* the first `left` of four terms (terms past K are loaded as +0, never used) */
        auto part = [](const float *s, int left) {
            float4 v;
            v.x = left > 0 ? s[0] : 0.0f;
            v.y = left > 1 ? s[1] : 0.0f;
            v.z = left > 2 ? s[2] : 0.0f;
            v.w = left > 3 ? s[3] : 0.0f;
            return v;
        };
        if (vec && kt + BK <= kl) {
            load4(kt);
        } else {
#pragma unroll
            for (int q = 0; q < QA; q++)
                if (sa[q].on) pa[q] = part(sa[q].p + kt, kl - kt - sa[q].c);
#pragma unroll
            for (int q = 0; q < QB; q++)
                if (sb[q].on) pb[q] = part(sb[q].p + kt, kl - kt - sb[q].c);
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int q = 0; q < QA; q++) {
            if (!sa[q].on) continue;
            As[buf][sa[q].c + 0][sa[q].r] = pa[q].x;
            As[buf][sa[q].c + 1][sa[q].r] = pa[q].y;
            As[buf][sa[q].c + 2][sa[q].r] = pa[q].z;
            As[buf][sa[q].c + 3][sa[q].r] = pa[q].w;
        }
#pragma unroll
        for (int q = 0; q < QB; q++) {
            if (!sb[q].on) continue;
            Bs[buf][sb[q].c + 0][sb[q].r] = pb[q].x;
            Bs[buf][sb[q].c + 1][sb[q].r] = pb[q].y;
            Bs[buf][sb[q].c + 2][sb[q].r] = pb[q].z;
            Bs[buf][sb[q].c + 3][sb[q].r] = pb[q].w;
        }
    };
    float a[2][TM], b[2][TN], acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
    auto frag = [&](int s, int buf, int kk) {
#pragma unroll
        for (int i = 0; i < TM / 4; i++) {
            const float4 v = *(const float4 *)&As[buf][kk][wm + i * LY * 4 + ly * 4];
            a[s][4 * i] = v.x; a[s][4 * i + 1] = v.y; a[s][4 * i + 2] = v.z; a[s][4 * i + 3] = v.w;
        }
#pragma unroll
        for (int j = 0; j < TN / 4; j++) {
            const float4 v = *(const float4 *)&Bs[buf][kk][wn + j * LX * 4 + lx * 4];
            b[s][4 * j] = v.x; b[s][4 * j + 1] = v.y; b[s][4 * j + 2] = v.z; b[s][4 * j + 3] = v.w;
        }
    };
    auto step = [&](int s) {
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
            for (int jj = 0; jj < TN; jj++) {
                const int j = i & 1 ? TN - 1 - jj : jj;
                acc[i][j] = fmaf(a[s][i], b[s][j], acc[i][j]);
            }
    };

    /* one k-tile: the fmas of its BK terms, the next tile (loaded by the caller)
     * stored and its first fragments read before the last term's fmas */
    auto walk = [&](int buf, bool more) {
#pragma unroll
        for (int kk = 0; kk < BK; kk++) {
            if (kk == BK - 1) {
                if (more) {
                    store(buf ^ 1);
                    __syncthreads();
                    frag((kk + 1) & 1, buf ^ 1, 0);
                }
            } else {
                frag((kk + 1) & 1, buf, kk + 1);
            }
            step(kk & 1);
        }
    };
    const int tiles = (kl + BK - 1) / BK, wt = kl / BK; /* tiles, whole tiles */
    load(0);
    store(0);
    __syncthreads();
    frag(0, 0, 0);
    int t = 0;
    /* whole tiles followed by a whole tile: no branch between the barrier's
     * fragment reads and the last term's fmas, which then cover their latency */
    if (vec)
        for (; t + 1 < wt; t++) {
            load4((t + 1) * BK);
            walk(t & 1, true);
        }
    for (; t < tiles; t++) {
        const int buf = t & 1, kt = t * BK;
        const bool more = t + 1 < tiles;
        if (more) load(kt + BK);
        if (kt + BK <= kl) {
            walk(buf, more);
        } else { /* the leaf's last, partial tile */
            for (int kk = 0; kk < kl - kt; kk++) {
                frag(0, buf, kk);
                step(0);
            }
        }
    }

    /* a whole tile takes its residual in a pass of its own, before any store: its
     * loads then go out together, where between stores to Y (which may alias res, as
     * far as the compiler knows) each would wait for the one before */
    const bool whole = RES && m0 + BM <= M && n0 + BN <= N;
    if (whole)
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < TN; j++) {
                const int64_t m = m0 + wm + i / 4 * LY * 4 + ly * 4 + i % 4;
                const int64_t n = n0 + wn + j / 4 * LX * 4 + lx * 4 + j % 4;
                acc[i][j] = res[m * ldr + n] + acc[i][j];
            }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int64_t m = m0 + wm + i / 4 * LY * 4 + ly * 4 + i % 4;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t n = n0 + wn + j / 4 * LX * 4 + lx * 4 + j % 4;
            if (n < N) Y[m * ldy + n] = RES && !whole ? res[m * ldr + n] + acc[i][j] : acc[i][j];
        }
    }
}

/* A kernel of one tile shape (gemm_tiles' parameters), at `blocks` blocks a
 * multiprocessor */
#define MB_GEMM_KERNEL(name, blocks, BM, BN, WM, WN, TM, TN, BK, RES)                 \
    MB_KERNEL void MB_BOUNDS_MIN(32 * (BM / WM) * (BN / WN), blocks)                  \
    name(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,   \
         int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf, const float *res, int64_t ldr) \
    {                                                                                 \
        gemm_tiles<BM, BN, WM, WN, TM, TN, BK, RES>(M, N, K, X, ldx, W, ldw, Y, ldy, ldleaf, res, \
                                               ldr);                                  \
    }

/* 128 x 128 tiles of 4 warps of 64 x 64, two blocks a multiprocessor (one block's
 * stores, barrier and first fragment reads run under the other's fmas): the
 * projections' common shapes, without and with the residual res (a uniform out_proj) */
MB_GEMM_KERNEL(mb_gemm_k, 2, 128, 128, 64, 64, 16, 8, 8, false)
MB_GEMM_KERNEL(mb_gemm_res_k, 2, 128, 128, 64, 64, 16, 8, 8, true)

/* Narrow N, one tile across (res unused), so that no block walks a wide tile's 128
 * columns, or two tiles of them, for Mamba-1's x_proj (N = d_model / 16 + 32): up to
 * 96 (d_model 1024), 3 warps of 128 x 32; up to 160 (d_model 2048), 5 warps of 64 x
 * 32 (on the H200 32 x 32 at four blocks a multiprocessor was slower) */
MB_GEMM_KERNEL(mb_gemm_n96_k, 2, 128, 96, 128, 32, 16, 8, 8, false)
MB_GEMM_KERNEL(mb_gemm_n160_k, 2, 64, 160, 64, 32, 8, 8, 8, false)

/* The tiles left after the last whole wave of a wide call, on 32 x 64 tiles of two
 * warps: a small tail of 128 x 128 tiles would keep all but a few multiprocessors
 * idle for a whole tile's time (_cuda.py gemm). 32 terms a k-tile: with two warps a
 * multiprocessor, 8 terms of fmas did not cover the next tile's loads. */
MB_GEMM_KERNEL(mb_gemm_tail_k, 4, 32, 64, 32, 32, 4, 8, 32, false)
MB_GEMM_KERNEL(mb_gemm_tail_res_k, 4, 32, 64, 32, 32, 4, 8, 32, true)

/* The columns past a wide call's last whole tile where they are few (a strip, e.g.
 * Mamba-2's in_proj's d_model / 32 dt columns): 64 x 32 tiles of one warp, 8 x 8
 * outputs a thread, so a 32-wide strip computes no column twice; 16 terms a k-tile
 * (32 spill) */
MB_GEMM_KERNEL(mb_gemm_strip_k, 4, 64, 32, 64, 32, 8, 8, 16, false)
MB_GEMM_KERNEL(mb_gemm_strip_res_k, 4, 64, 32, 64, 32, 8, 8, 16, true)
#undef MB_GEMM_KERNEL

/* Few rows of X (decode): each block takes GV_ROWS rows of W and GV_MROWS rows of X
 * (grid y), and thread (warp m, lane n) walks the chain of output (m, n) alone, so
 * a chain runs at the latency of one fmaf per term. W and X tiles stream through a
 * ring of GV_STAGES shared-memory stages (cp.async) kept GV_STAGES - 1 chunks ahead.
 * The warps with no row of X (all of them when every row is live) issue the
 * copies, so a chain never waits for its own warp's address arithmetic. W rows
 * are padded by 4 floats: a quarter-warp's float4 reads of 8 rows then fall in
 * distinct banks. Rows past N or M are not loaded; their outputs are not stored.
 * res (optional) adds the residual in the epilogue, as mb_residual_k would:
 * Y = res + chain, NaN when the session guard refused the step; a decode step's
 * conv (conv.cu conv_epilogue) may run on the outputs' conv columns. nw (optional,
 * one leaf): X's rows are RMSNormed here first with weight nw, as mb_rms_k would
 * (each block its own rows: a kernel boundary fewer than the norm's own kernel);
 * they are then held whole, after the ring, GV_NLD(K) floats apart, with nw.
 * host (with nw, X a decode step's whole input in one block's rows): the step's
 * check (finite.cu), each block finding a bad value in its copy of X itself and
 * block 0 reporting it, so that no block waits on another for the verdict.
 * Dynamic shared memory: GV_STAGES * (GV_ROWS + GV_MROWS) * GV_LD floats (_cuda.py
 * gemv_smem), with nw GV_STAGES * GV_ROWS * GV_LD + rows * GV_NLD(K) + K rounded up
 * to 4 (gemv_norm_smem). */
#define GV_ROWS 32
#define GV_MROWS 8
#define GV_KC MB_GEMV_KC
#define GV_LD (GV_KC + 4)
#define GV_STAGES 2
#define GV_THREADS 256
#define GV_NLD(K) (((K) + 31) / 32 * 32 + 4) /* 4 mod 32: as rmsnorm.cu's whole rows */

MB_KERNEL void MB_BOUNDS(GV_THREADS)
mb_gemv_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
          int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf, const float *nw, const float *res,
          int64_t ldr, unsigned long long *guard, volatile unsigned long long *host,
          MB_CONV_EPI_ARGS)
{
    extern __shared__ __align__(16) float sm[];
    float *Ws = sm, *Xs = sm + GV_STAGES * GV_ROWS * GV_LD;
    const int xld = nw ? (int)GV_NLD(K) : GV_LD; /* X's row stride: whole rows, or the ring's */
    const int tid = threadIdx.x, lane = tid % 32, mw = tid / 32;
    const int64_t n0 = (int64_t)blockIdx.x * GV_ROWS, m0 = (int64_t)blockIdx.y * GV_MROWS;
    const int64_t k0 = (int64_t)blockIdx.z * MB_DOT_LEAF;
    const int64_t k1 = K < k0 + MB_DOT_LEAF ? K : k0 + MB_DOT_LEAF;
    const int nrows = N - n0 < GV_ROWS ? (int)(N - n0) : GV_ROWS;
    const int mrows = M - m0 < GV_MROWS ? (int)(M - m0) : GV_MROWS;
    const float *Xb = X + m0 * ldx, *Wb = W + n0 * ldw;
    const bool vx = (ldx & 3) == 0 && ((uintptr_t)Xb & 15) == 0;
    const bool vw = (ldw & 3) == 0 && ((uintptr_t)Wb & 15) == 0;
    const int chunks = (int)((k1 - k0 + GV_KC - 1) / GV_KC);
    const int first = mrows < GV_MROWS ? 32 * mrows : 0; /* the loaders: tid >= first */
    const int ltid = tid - first, lthreads = GV_THREADS - first;
    Y += (int64_t)blockIdx.z * ldleaf;

#define MB_GV_STAGE(c, Rs, R, ld, rows, vec, nr)                                      \
    if (ltid >= 0)                                                                    \
        mb_stage_rows(Rs + (c) % GV_STAGES * nr * GV_LD, GV_LD, R, ld, rows, GV_KC,    \
                      k0 + (int64_t)(c) * GV_KC, k1, vec, ltid, lthreads);
#define MB_GV_ISSUE(c)                                                                \
    MB_GV_STAGE(c, Ws, Wb, ldw, nrows, vw, GV_ROWS)                                   \
    if (!nw) MB_GV_STAGE(c, Xs, Xb, ldx, mrows, vx, GV_MROWS)
    /* the weights' first stages are copied while the previous kernel may still run;
     * they join the first stage's group of copies */
    for (int s = 0; s < GV_STAGES - 1 && s < chunks; s++)
        MB_GV_STAGE(s, Ws, Wb, ldw, nrows, vw, GV_ROWS)
    MB_GRID_WAIT();
    __shared__ float rr[GV_MROWS];
    __shared__ unsigned long long bad; /* the step's check (host): its first bad index */
    if (nw) { /* as rmsnorm.cu rms_whole, into the rows in place */
        if (host && tid == 0) bad = ~0ull; /* mb_norm_rows's barriers order it */
        const float *sw = mb_norm_rows(Xs, xld, Xb, ldx, mrows, K, vx, nw, rr, tid, GV_THREADS);
        for (int m = 0; m < mrows; m++)
            for (int j = tid; j < K; j += GV_THREADS) {
                const float v = Xs[m * xld + j];
                if (host && mb_nonfinite(v))
                    atomicMin(&bad, (unsigned long long)(m * K + j));
                Xs[m * xld + j] = (v * rr[m]) * sw[j];
            }
        __syncthreads();
    }
    for (int s = 0; s < GV_STAGES - 1; s++) {
        if (s < chunks && !nw) MB_GV_STAGE(s, Xs, Xb, ldx, mrows, vx, GV_MROWS)
        mb_cp_commit();
    }
    float acc = 0.0f;
    const bool live = mw < mrows;
    for (int c = 0; c < chunks; c++) {
        mb_cp_wait<GV_STAGES - 2>();
        __syncthreads();
        if (c + GV_STAGES - 1 < chunks) MB_GV_ISSUE(c + GV_STAGES - 1)
        mb_cp_commit();
        if (live) {
            const int slot = c % GV_STAGES;
            const float *w = Ws + (slot * GV_ROWS + lane) * GV_LD;
            const float *x = nw ? Xs + mw * xld + (int64_t)c * GV_KC
                                : Xs + (slot * GV_MROWS + mw) * GV_LD;
            const int64_t kn = k1 - (k0 + (int64_t)c * GV_KC);
            if (kn >= GV_KC)
                acc = mb_chain_tile<false>(acc, x, w, GV_KC);
            else
                for (int kk = 0; kk < kn; kk++) acc = fmaf(x[kk], w[kk], acc);
        }
    }
#undef MB_GV_ISSUE
#undef MB_GV_STAGE
    mb_cp_wait<0>();
    /* the guard word is read only here, once the chains are done (a load before them
     * would hold them up). A check's step is refused by its own bad value, which
     * block 0 may not have reported yet, or by an earlier step's. */
    if (host && blockIdx.x == 0 && tid == 0) mb_guard_report(!mb_refused(guard), bad, guard, host);
    if (live && lane < nrows) {
        const bool refused = (host && bad != ~0ull) || mb_refused(guard);
        const int64_t m = m0 + mw, n = n0 + lane;
        float v = acc;
        if (res) v = refused ? MB_QNAN : res[m * ldr + n] + v;
        Y[m * ldy + n] = v;
        conv_epilogue<mb_identical>(m, n, v, !refused, c0, C, window, cw, cb, u, ldu);
    }
}

/* Join P leaf results per output with mb_dot's tree (parts[p * ldp + m * N + n]);
 * res and guard as in mb_gemv_k. */
MB_KERNEL void mb_dot_fold_k(int64_t P, int64_t M, int64_t N, const float *parts, int64_t ldp,
                             float *Y, int64_t ldy, const float *res, int64_t ldr,
                             const unsigned long long *guard)
{
    MB_GRID_WAIT();
    MB_GRID_LOOP(i, M * N) {
        const int64_t m = i / N, n = i % N;
        float v = mb_dot_fold(P, parts + i, ldp);
        if (res) v = mb_refused(guard) ? MB_QNAN : res[m * ldr + n] + v;
        Y[m * ldy + n] = v;
    }
}

#undef GV_ROWS
#undef GV_MROWS
#undef GV_KC
#undef GV_LD
#undef GV_STAGES
#undef GV_THREADS
#undef GV_NLD
