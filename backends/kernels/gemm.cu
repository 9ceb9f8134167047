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

#define BM 128
#define BN 256
#define BK 8
#define THREADS 256            /* 8 warps, 2 (M) x 4 (N), of WM x WN outputs */
#define WM 64
#define WN 64
#define TM 16                  /* a thread's outputs: TM/4 x TN/4 blocks of 4 x 4 */
#define TN 8
#define LY (WM / TM)           /* a warp's lanes: LY along M x LX along N */
#define LX (WN / TN)
#define QA (BM * BK / 4 / THREADS) /* float4 of X, of W per thread per tile */
#define QB (BN * BK / 4 / THREADS)

/* Grid (ceil(N/BN), ceil(M/BM), leaves); leaf z writes Y + z * ldleaf.
 * Loads: float4 f = tid + q * THREADS of a tile is row f / 2, k 4 (f % 2) + 0..3, so
 * a warp reads 16 rows x 32 bytes, one sector each; rows past M or N read row 0
 * instead (their outputs are never stored). The next tile is loaded into registers
 * while the current one is walked, then stored transposed (k-major) into the other
 * of two shared buffers. Rows are padded by 4 floats: a warp's scalar stores then
 * hit distinct banks, while a lane's 4 rows (columns) at one k stay one float4, and
 * a warp's fragment reads are broadcasts of 4 (8) distinct float4. The fragments of
 * k + 1 are read while the fmas of k run; at a tile's last k, the next tile is
 * stored, one barrier passed and its first fragments read, so one barrier per tile
 * suffices. The fmas of a k walk the thread's outputs in a serpentine (odd rows
 * backwards), so consecutive fmas share an operand register (7% faster on the H200
 * than row by row). */
MB_KERNEL void MB_BOUNDS_MIN(THREADS, 1)
mb_gemm_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
          int64_t ldw, float *Y, int64_t ldy, int64_t ldleaf)
{
    __shared__ __align__(16) float As[2][BK][BM + 4];
    __shared__ __align__(16) float Bs[2][BK][BN + 4];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / (BN / WN) * WM, wn = warp % (BN / WN) * WN;
    const int ly = lane / LX, lx = lane % LX;
    const int64_t m0 = (int64_t)blockIdx.y * BM, n0 = (int64_t)blockIdx.x * BN;
    const int64_t k0 = (int64_t)blockIdx.z * MB_DOT_LEAF;
    const int kl = (int)(K - k0 < MB_DOT_LEAF ? K - k0 : MB_DOT_LEAF); /* this leaf's terms */
    Y += (int64_t)blockIdx.z * ldleaf;
    const bool vec = ((ldx | ldw) & 3) == 0 && (((uintptr_t)X | (uintptr_t)W) & 15) == 0;

    const float *xp[QA], *wp[QB];
    int ar[QA], ac[QA], br[QB], bc[QB];
#pragma unroll
    for (int q = 0; q < QA; q++) {
        const int f = tid + q * THREADS;
        ar[q] = f / (BK / 4);
        ac[q] = f % (BK / 4) * 4;
        xp[q] = X + (m0 + ar[q] < M ? m0 + ar[q] : 0) * ldx + k0 + ac[q];
    }
#pragma unroll
    for (int q = 0; q < QB; q++) {
        const int f = tid + q * THREADS;
        br[q] = f / (BK / 4);
        bc[q] = f % (BK / 4) * 4;
        wp[q] = W + (n0 + br[q] < N ? n0 + br[q] : 0) * ldw + k0 + bc[q];
    }
    float4 pa[QA], pb[QB];
    auto load = [&](int kt) {
        if (vec && kt + BK <= kl) {
#pragma unroll
            for (int q = 0; q < QA; q++) pa[q] = *(const float4 *)(xp[q] + kt);
#pragma unroll
            for (int q = 0; q < QB; q++) pb[q] = *(const float4 *)(wp[q] + kt);
        } else {
            /* the first `left` of four terms (terms past K are loaded as +0, never used) */
            auto part = [](const float *s, int left) {
                float4 v;
                v.x = left > 0 ? s[0] : 0.0f;
                v.y = left > 1 ? s[1] : 0.0f;
                v.z = left > 2 ? s[2] : 0.0f;
                v.w = left > 3 ? s[3] : 0.0f;
                return v;
            };
#pragma unroll
            for (int q = 0; q < QA; q++) pa[q] = part(xp[q] + kt, kl - kt - ac[q]);
#pragma unroll
            for (int q = 0; q < QB; q++) pb[q] = part(wp[q] + kt, kl - kt - bc[q]);
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int q = 0; q < QA; q++) {
            As[buf][ac[q] + 0][ar[q]] = pa[q].x;
            As[buf][ac[q] + 1][ar[q]] = pa[q].y;
            As[buf][ac[q] + 2][ar[q]] = pa[q].z;
            As[buf][ac[q] + 3][ar[q]] = pa[q].w;
        }
#pragma unroll
        for (int q = 0; q < QB; q++) {
            Bs[buf][bc[q] + 0][br[q]] = pb[q].x;
            Bs[buf][bc[q] + 1][br[q]] = pb[q].y;
            Bs[buf][bc[q] + 2][br[q]] = pb[q].z;
            Bs[buf][bc[q] + 3][br[q]] = pb[q].w;
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

    const int tiles = (kl + BK - 1) / BK;
    load(0);
    store(0);
    __syncthreads();
    frag(0, 0, 0);
    for (int t = 0; t < tiles; t++) {
        const int buf = t & 1, kt = t * BK;
        const bool more = t + 1 < tiles;
        if (more) load(kt + BK);
        if (kt + BK <= kl) {
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
        } else { /* the leaf's last, partial tile */
            for (int kk = 0; kk < kl - kt; kk++) {
                frag(0, buf, kk);
                step(0);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int64_t m = m0 + wm + i / 4 * LY * 4 + ly * 4 + i % 4;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t n = n0 + wn + j / 4 * LX * 4 + lx * 4 + j % 4;
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
#undef WM
#undef WN
#undef TM
#undef TN
#undef LY
#undef LX
#undef QA
#undef QB
#undef GV_ROWS
#undef GV_MROWS
#undef GV_KC
#undef GV_LD
#undef GV_STAGES
#undef GV_THREADS
