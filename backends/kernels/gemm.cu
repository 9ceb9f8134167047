/* Y = X . W^T under dot v1 (SPEC 4.4), the GPU twin of reference/gemm.c.
 *
 * A standard tiled SGEMM: each thread owns an 8x8 block of outputs and walks k in
 * ascending order with one fmaf per term from +0, no split-K, so every output is
 * the serial chain of dot v1 whatever the tile or grid. Terms past K are skipped
 * (the last tile's loop stops at K), never multiplied by a zero pad: a pad could
 * turn an accumulated -0 into +0. For K > 8192, blockIdx.z is the leaf: each leaf
 * writes its chains to its own slice and mb_dot_fold_k joins them with mb_dot's
 * tree. mb_gemv_k is the same chains for a few rows of X (decode). */
#include "vendor.h"
#include "numerics.h"
#include "chain.h"

#define BM 128
#define BN 128
#define BK 16
#define THREADS 256

/* Loader: thread t stages row t % 128 of both tiles, k = 8 (t / 128) + 0..7 (two
 * float4 per operand; a warp reads 32 rows x 32 bytes, one sector each). Rows past
 * M or N read row 0 instead; their outputs are never stored. */
MB_DEV void load_tile(const float *xp, const float *wp, int64_t k, int64_t k1, bool vec,
                      float ra[8], float rb[8])
{
    if (vec && k + 8 <= k1) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float4 a = *(const float4 *)(xp + k + 4 * h), b = *(const float4 *)(wp + k + 4 * h);
            ra[4 * h] = a.x; ra[4 * h + 1] = a.y; ra[4 * h + 2] = a.z; ra[4 * h + 3] = a.w;
            rb[4 * h] = b.x; rb[4 * h + 1] = b.y; rb[4 * h + 2] = b.z; rb[4 * h + 3] = b.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ra[i] = k + i < k1 ? xp[k + i] : 0.0f;
            rb[i] = k + i < k1 ? wp[k + i] : 0.0f;
        }
    }
}

/* Grid (ceil(N/BN), ceil(M/BM), leaves); leaf z writes Y + z * ldleaf. Two shared
 * buffers: the next tile is loaded into registers while the current one is walked,
 * then stored into the other buffer, so one barrier per tile suffices. */
MB_KERNEL void MB_BOUNDS_MIN(THREADS, 2)
mb_gemm_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
          int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf)
{
    __shared__ __align__(16) float As[2][BK][BM];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x;
    const int64_t m0 = (int64_t)blockIdx.y * BM, n0 = (int64_t)blockIdx.x * BN;
    const int64_t k0 = (int64_t)blockIdx.z * MB_DOT_LEAF;
    const int64_t k1 = K < k0 + MB_DOT_LEAF ? K : k0 + MB_DOT_LEAF;
    Y += (int64_t)blockIdx.z * ldleaf;

    const int lr = tid % BM, lc = (tid / BM) * 8;
    const float *xp = X + (m0 + lr < M ? m0 + lr : 0) * ldx;
    const float *wp = W + (n0 + lr < N ? n0 + lr : 0) * ldw;
    const bool vec = ((ldx | ldw) & 3) == 0 && (((uintptr_t)X | (uintptr_t)W) & 15) == 0;

    /* Compute: rows ty*4 + {0..3} and 64 + ty*4 + {0..3}; columns likewise with tx. */
    const int ty = tid >> 4, tx = tid & 15;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

    float ra[8], rb[8];
    int buf = 0;
    if (k0 < k1) {
        load_tile(xp, wp, k0 + lc, k1, vec, ra, rb);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            As[0][lc + i][lr] = ra[i];
            Bs[0][lc + i][lr] = rb[i];
        }
    }
    __syncthreads();
    for (int64_t kt = k0; kt < k1; kt += BK, buf ^= 1) {
        const bool more = kt + BK < k1;
        if (more) load_tile(xp, wp, kt + BK + lc, k1, vec, ra, rb);
        const int kn = k1 - kt < BK ? (int)(k1 - kt) : BK;
#define MB_GEMM_STEP(kk)                                                              \
    {                                                                                 \
        const float4 a0 = *(const float4 *)&As[buf][kk][ty * 4];                       \
        const float4 a1 = *(const float4 *)&As[buf][kk][64 + ty * 4];                  \
        const float4 b0 = *(const float4 *)&Bs[buf][kk][tx * 4];                       \
        const float4 b1 = *(const float4 *)&Bs[buf][kk][64 + tx * 4];                  \
        const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};        \
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};        \
        _Pragma("unroll") for (int i = 0; i < 8; i++)                                \
            _Pragma("unroll") for (int j = 0; j < 8; j++)                            \
                acc[i][j] = fmaf(a[i], b[j], acc[i][j]);                              \
    }
        if (kn == BK) {
#pragma unroll
            for (int kk = 0; kk < BK; kk++) MB_GEMM_STEP(kk)
        } else {
            for (int kk = 0; kk < kn; kk++) MB_GEMM_STEP(kk)
        }
#undef MB_GEMM_STEP
        if (more) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                As[buf ^ 1][lc + i][lr] = ra[i];
                Bs[buf ^ 1][lc + i][lr] = rb[i];
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; i++) {
        int64_t m = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int64_t n = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (n < N) Y[m * ldy + n] = acc[i][j];
        }
    }
}

/* Few rows of X (decode): each block takes GV_ROWS rows of W and GV_MROWS rows of X
 * (grid y), and thread (warp m, lane n) walks the chain of output (m, n) alone, so
 * a chain runs at the latency of one fmaf per term. W and X tiles stream through a
 * ring of GV_STAGES shared-memory stages (cp.async) kept GV_STAGES - 1 chunks ahead.
 * The warps with no row of X (all of them when every row is live) issue the
 * copies, so a chain never waits for its own warp's address arithmetic. W rows
 * are padded by 4 floats: a quarter-warp's float4 reads of 8 rows then fall in
 * distinct banks. Rows past N or M are not loaded; their outputs are not stored.
 * res (optional) adds the residual in the epilogue, as mb_residual_k would:
 * Y = res + chain, NaN when the session guard refused the step. Dynamic shared
 * memory: GV_STAGES * (GV_ROWS + GV_MROWS) * GV_LD floats (_cuda.py gemv_smem). */
#define GV_ROWS 32
#define GV_MROWS 8
#define GV_KC 128
#define GV_LD (GV_KC + 4)
#define GV_STAGES MB_STAGES
#define GV_THREADS 256

MB_KERNEL void MB_BOUNDS(GV_THREADS)
mb_gemv_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
          int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf, const float *res, int64_t ldr,
          const unsigned long long *guard)
{
    extern __shared__ __align__(16) float sm[];
    float *Ws = sm, *Xs = sm + GV_STAGES * GV_ROWS * GV_LD;
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

#define MB_GV_ISSUE(c)                                                                \
    if (ltid >= 0) {                                                                  \
        const int slot = (c) % GV_STAGES;                                             \
        const int64_t kt = k0 + (int64_t)(c) * GV_KC;                                 \
        mb_stage_rows(Ws + slot * GV_ROWS * GV_LD, GV_LD, Wb, ldw, nrows, GV_KC, kt, k1, vw, \
                      ltid, lthreads);                                                \
        mb_stage_rows(Xs + slot * GV_MROWS * GV_LD, GV_LD, Xb, ldx, mrows, GV_KC, kt, k1, vx, \
                      ltid, lthreads);                                                \
    }
    for (int s = 0; s < GV_STAGES - 1; s++) {
        if (s < chunks) MB_GV_ISSUE(s)
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
            const float *x = Xs + (slot * GV_MROWS + mw) * GV_LD;
            const int64_t kn = k1 - (k0 + (int64_t)c * GV_KC);
            if (kn >= GV_KC)
                acc = mb_chain_tile<GV_KC, false>(acc, x, w);
            else
                for (int kk = 0; kk < kn; kk++) acc = fmaf(x[kk], w[kk], acc);
        }
    }
#undef MB_GV_ISSUE
    mb_cp_wait<0>();
    if (live && lane < nrows) {
        const int64_t m = m0 + mw, n = n0 + lane;
        float v = acc;
        if (res) v = mb_refused(guard) ? MB_QNAN : res[m * ldr + n] + v;
        Y[m * ldy + n] = v;
    }
}

/* Join P leaf results per output with mb_dot's tree (parts[p * ldp + m * N + n]);
 * res and guard as in mb_gemv_k. */
MB_KERNEL void mb_dot_fold_k(int64_t P, int64_t M, int64_t N, const float *parts, int64_t ldp,
                             float *Y, int64_t ldy, const float *res, int64_t ldr,
                             const unsigned long long *guard)
{
    MB_GRID_LOOP(i, M * N) {
        const int64_t m = i / N, n = i % N;
        float v = mb_dot_fold(P, parts + i, ldp);
        if (res) v = mb_refused(guard) ? MB_QNAN : res[m * ldr + n] + v;
        Y[m * ldy + n] = v;
    }
}

#undef BM
#undef BN
#undef BK
#undef THREADS
#undef GV_ROWS
#undef GV_MROWS
#undef GV_KC
#undef GV_LD
#undef GV_STAGES
#undef GV_THREADS
