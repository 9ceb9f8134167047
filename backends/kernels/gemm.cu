/* Y = X . W^T under dot v1 (SPEC 4.4), the GPU twin of reference/gemm.c.
 *
 * A standard tiled SGEMM: each thread owns an 8x8 block of outputs and walks k in
 * ascending order with one fmaf per term from +0, no split-K, so every output is
 * the serial chain of dot v1 whatever the tile or grid. Terms past K are skipped
 * (the last tile's loop stops at K), never multiplied by a zero pad: a pad could
 * turn an accumulated -0 into +0. For K > 8192, blockIdx.z is the leaf: each leaf
 * writes its chains to its own slice and mb_dot_fold_k joins them. mb_gemv_k is the
 * same chains for a few rows of X (decode). */
#include "vendor.h"
#include "numerics.h"

#define BM 128
#define BN 128
#define BK 8
#define THREADS 256

MB_DEV void load_tile(const float *xp, const float *wp, int64_t k, int64_t k1, bool vec,
                      float ra[4], float rb[4])
{
    if (vec && k + 4 <= k1) {
        float4 a = *(const float4 *)(xp + k), b = *(const float4 *)(wp + k);
        ra[0] = a.x; ra[1] = a.y; ra[2] = a.z; ra[3] = a.w;
        rb[0] = b.x; rb[1] = b.y; rb[2] = b.z; rb[3] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ra[i] = k + i < k1 ? xp[k + i] : 0.0f;
            rb[i] = k + i < k1 ? wp[k + i] : 0.0f;
        }
    }
}

/* Grid (ceil(N/BN), ceil(M/BM), leaves); leaf z writes Y + z * ldleaf. */
MB_KERNEL void MB_BOUNDS(THREADS)
mb_gemm_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
          int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf)
{
    __shared__ __align__(16) float As[BK][BM];
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int64_t m0 = (int64_t)blockIdx.y * BM, n0 = (int64_t)blockIdx.x * BN;
    const int64_t k0 = (int64_t)blockIdx.z * MB_DOT_LEAF;
    const int64_t k1 = K < k0 + MB_DOT_LEAF ? K : k0 + MB_DOT_LEAF;
    Y += (int64_t)blockIdx.z * ldleaf;

    /* Loader: row lr of each tile, four consecutive k from lc. Rows past M or N
     * read row 0 instead; their outputs are never stored. */
    const int lr = tid >> 1, lc = (tid & 1) * 4;
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

    float ra[4], rb[4];
    if (k0 < k1) load_tile(xp, wp, k0 + lc, k1, vec, ra, rb);
    for (int64_t kt = k0; kt < k1; kt += BK) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            As[lc + i][lr] = ra[i];
            Bs[lc + i][lr] = rb[i];
        }
        __syncthreads();
        if (kt + BK < k1) load_tile(xp, wp, kt + BK + lc, k1, vec, ra, rb);
        const int kn = k1 - kt < BK ? (int)(k1 - kt) : BK;
#define MB_GEMM_STEP(kk)                                                              \
    {                                                                                 \
        float4 a0 = *(const float4 *)&As[kk][ty * 4], a1 = *(const float4 *)&As[kk][64 + ty * 4]; \
        float4 b0 = *(const float4 *)&Bs[kk][tx * 4], b1 = *(const float4 *)&Bs[kk][64 + tx * 4]; \
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

/* Small M (decode): one thread per output column n keeps the chains of all M rows
 * (at most GV_M); W rows are staged through shared memory in chunks of GV_K k,
 * loaded coalesced by the whole block, the next chunk in flight while the first
 * warp walks the current one. Same grid-z leaves as mb_gemm_k. */
#define GV_M 8
#define GV_ROWS 32
#define GV_K 128
#define GV_THREADS 128
#define GV_LOADS (GV_ROWS * GV_K / GV_THREADS)

MB_KERNEL void MB_BOUNDS(GV_THREADS)
mb_gemv_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
          int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf)
{
    __shared__ float Ws[GV_K][GV_ROWS + 1];
    __shared__ float Xs[GV_M][GV_K];
    const int tid = threadIdx.x, lane = tid % 32, wq = tid / 32;
    const int64_t n0 = (int64_t)blockIdx.x * GV_ROWS;
    const int64_t k0 = (int64_t)blockIdx.z * MB_DOT_LEAF;
    const int64_t k1 = K < k0 + MB_DOT_LEAF ? K : k0 + MB_DOT_LEAF;
    Y += (int64_t)blockIdx.z * ldleaf;
    /* Loader: load j takes row j of the chunk, k = wq * 32 + lane (a warp reads 32
     * consecutive floats of one row); rows past N read row 0, never stored. */
    float rw[GV_LOADS];
#define MB_GV_LOAD(kt)                                                                \
    _Pragma("unroll") for (int j = 0; j < GV_LOADS; j++) {                          \
        const int64_t r = n0 + j, k = (kt) + wq * 32 + lane;                         \
        rw[j] = k < k1 ? W[(r < N ? r : 0) * ldw + k] : 0.0f;                        \
    }
    float acc[GV_M];
#pragma unroll
    for (int m = 0; m < GV_M; m++) acc[m] = 0.0f;
    if (k0 < k1) MB_GV_LOAD(k0)
    for (int64_t kt = k0; kt < k1; kt += GV_K) {
#pragma unroll
        for (int j = 0; j < GV_LOADS; j++) Ws[wq * 32 + lane][j] = rw[j];
        for (int i = tid; i < GV_M * GV_K; i += GV_THREADS) {
            const int m = i / GV_K, kk = i % GV_K;
            Xs[m][kk] = m < M && kt + kk < k1 ? X[m * ldx + kt + kk] : 0.0f;
        }
        __syncthreads();
        if (kt + GV_K < k1) MB_GV_LOAD(kt + GV_K)
        if (wq == 0) {
            const int kn = k1 - kt < GV_K ? (int)(k1 - kt) : GV_K;
            for (int kk = 0; kk < kn; kk++) {
                const float w = Ws[kk][lane];
#pragma unroll
                for (int m = 0; m < GV_M; m++) acc[m] = fmaf(Xs[m][kk], w, acc[m]);
            }
        }
        __syncthreads();
    }
#undef MB_GV_LOAD
    const int64_t n = n0 + lane;
    if (wq == 0 && n < N)
#pragma unroll
        for (int m = 0; m < GV_M; m++)
            if (m < M) Y[m * ldy + n] = acc[m];
}

/* Join P leaf results per output as mb_dot does: equal-sized neighbours merge as
 * the leaves arrive, then the stack folds from the top (the level-by-level
 * adjacent pairing with an odd last node carried up). parts[p * ldp + m * N + n]. */
MB_KERNEL void mb_dot_fold_k(int64_t P, int64_t M, int64_t N, const float *parts, int64_t ldp,
                             float *Y, int64_t ldy)
{
    MB_GRID_LOOP(i, M * N) {
        float part[64];
        int size[64], top = 0;
        for (int64_t p = 0; p < P; p++) {
            float v = parts[p * ldp + i];
            int lv = 0;
            while (top > 0 && size[top - 1] == lv) {
                v = part[--top] + v;
                lv++;
            }
            part[top] = v;
            size[top] = lv;
            top++;
        }
        float v = part[--top];
        while (top > 0) v = part[--top] + v;
        Y[(i / N) * ldy + i % N] = v;
    }
}

#undef BM
#undef BN
#undef BK
#undef THREADS
#undef GV_M
#undef GV_ROWS
#undef GV_K
#undef GV_THREADS
#undef GV_LOADS
