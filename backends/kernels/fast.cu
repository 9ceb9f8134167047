/* numeric_mode="fast" (SPEC 3): the same block maths on faster schedules. It
 * promises accuracy (relative L2 error <= 2e-3 against float64), never bits.
 *   mb_fast_gemm_k     Y = X . W^T on the tensor cores in TF32 (operands rounded to
 *                      a 10-bit mantissa; products summed in fp32).
 *   mb_fast_gemv_k     few rows of X (decode): each output's K terms split over a
 *                      warp's lanes and summed by shuffles.
 *   mb_fast_rmsnorm_k  a warp a row.
 * The conv and scan kernels take the fast transcendentals (modes.h). */
#include "vendor.h"
#include "numerics.h"
#include "ops.h"

/* ---- TF32 tensor-core GEMM ------------------------------------------------------
 * Block tile TB_M x TB_N x 32, TB_WM x TB_WN warps, each 64 x 64 outputs as 4 x 8
 * mma.m16n8k8 tiles, so every fragment feeds 4 or 8 mma; two blocks share a
 * multiprocessor, one computing while the other waits. X and W tiles (both
 * K-contiguous, as mma's row.col wants) stream through TB_STAGES shared-memory
 * stages by cp.async, rows padded by 4 floats. The sum over a chunk's 32 terms may
 * take them in any order as long as X and W agree: mma's term t4 (and t4 + 4) of
 * step s is term 8 t4 + 2 s (and + 1) of the chunk, so a thread reads its 8 terms
 * of a row as two 128-bit loads, conflict-free with the padding. Terms past K are
 * zero-filled. Y = X . W^T, plus res (ld ldr) when given, in one fixed order per
 * output (no atomics: the same bits on every run).
 * Dynamic shared memory: TB_STAGES * (TB_M + TB_N) * TB_LD floats (_cuda.py TF32_SMEM). */
#define TB_WM 2
#define TB_WN 2
#define TB_MI 4 /* m16 tiles per warp */
#define TB_NJ 8 /* n8 tiles per warp */
#define TB_M (16 * TB_MI * TB_WM)
#define TB_N (8 * TB_NJ * TB_WN)
#define TB_K 32
#define TB_LD (TB_K + 4)
#define TB_STAGES 3
#define TB_THREADS (32 * TB_WM * TB_WN)

/* Outputs (m, n) and (m, n + 1) of a tensor-core tile, those inside M x N, plus res
 * when given; pair: Y and res take 8-byte stores and loads there. */
MB_DEV void mb_put_pair(float *Y, int64_t ldy, const float *res, int64_t ldr, int64_t M, int64_t N,
                        int64_t m, int64_t n, float v0, float v1, bool pair)
{
    if (m >= M || n >= N) return;
    if (res) {
        v0 = res[m * ldr + n] + v0;
        if (n + 1 < N) v1 = res[m * ldr + n + 1] + v1;
    }
    if (pair && n + 1 < N) {
        *(float2 *)(Y + m * ldy + n) = make_float2(v0, v1);
    } else {
        Y[m * ldy + n] = v0;
        if (n + 1 < N) Y[m * ldy + n + 1] = v1;
    }
}

#if defined(MB_MMA)
/* Four consecutive terms of a staged row, as TF32 operands. */
MB_DEV void mb_tf32x4(uint32_t v[4], const float *p)
{
    const float4 f = *(const float4 *)p;
    v[0] = mb_tf32(f.x);
    v[1] = mb_tf32(f.y);
    v[2] = mb_tf32(f.z);
    v[3] = mb_tf32(f.w);
}

MB_KERNEL void MB_BOUNDS_MIN(TB_THREADS, 2)
mb_fast_gemm_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
               int64_t ldw, float *Y, int64_t ldy, const float *res, int64_t ldr)
{
    extern __shared__ __align__(16) float sm[];
    float *As = sm, *Bs = sm + TB_STAGES * TB_M * TB_LD;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / TB_WN, wn = warp % TB_WN, g = lane / 4, t4 = lane % 4;
    const int64_t m0 = (int64_t)blockIdx.y * TB_M, n0 = (int64_t)blockIdx.x * TB_N;
    const int mrows = M - m0 < TB_M ? (int)(M - m0) : TB_M;
    const int nrows = N - n0 < TB_N ? (int)(N - n0) : TB_N;
    const float *Xb = X + m0 * ldx, *Wb = W + n0 * ldw;
    const bool vx = (ldx & 3) == 0 && ((uintptr_t)Xb & 15) == 0;
    const bool vw = (ldw & 3) == 0 && ((uintptr_t)Wb & 15) == 0;
    const int64_t chunks = (K + TB_K - 1) / TB_K;
    /* a warp whose outputs all lie past M or N (an edge tile, a narrow N) only stages */
    const bool busy = wm * 16 * TB_MI < mrows && wn * 8 * TB_NJ < nrows;

#define MB_TB_ISSUE(c)                                                                \
    {                                                                                 \
        const int slot = (int)((c) % TB_STAGES);                                      \
        mb_stage_rows(As + slot * TB_M * TB_LD, TB_LD, Xb, ldx, mrows, TB_K, (c) * TB_K, K, vx, \
                      tid, TB_THREADS);                                               \
        mb_stage_rows(Bs + slot * TB_N * TB_LD, TB_LD, Wb, ldw, nrows, TB_K, (c) * TB_K, K, vw, \
                      tid, TB_THREADS);                                               \
    }
    for (int s = 0; s < TB_STAGES - 1; s++) {
        if (s < chunks) MB_TB_ISSUE(s)
        mb_cp_commit();
    }
    float acc[TB_MI][TB_NJ][4];
#pragma unroll
    for (int i = 0; i < TB_MI; i++)
#pragma unroll
        for (int j = 0; j < TB_NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    for (int64_t c = 0; c < chunks; c++) {
        mb_cp_wait<TB_STAGES - 2>();
        __syncthreads();
        if (c + TB_STAGES - 1 < chunks) MB_TB_ISSUE(c + TB_STAGES - 1)
        mb_cp_commit();
        if (!busy) continue;
        const int slot = (int)(c % TB_STAGES);
        const float *a = As + (slot * TB_M + wm * 16 * TB_MI + g) * TB_LD + 8 * t4;
        const float *b = Bs + (slot * TB_N + wn * 8 * TB_NJ + g) * TB_LD + 8 * t4;
#pragma unroll
        for (int h = 0; h < 8; h += 4) { /* terms h..h+3 of each thread's 8: steps h/2, h/2 + 1 */
            uint32_t lo[TB_MI][4], hi[TB_MI][4]; /* rows g and g + 8 of each m16 tile */
#pragma unroll
            for (int i = 0; i < TB_MI; i++) {
                mb_tf32x4(lo[i], a + i * 16 * TB_LD + h);
                mb_tf32x4(hi[i], a + (i * 16 + 8) * TB_LD + h);
            }
#pragma unroll
            for (int j = 0; j < TB_NJ; j++) {
                uint32_t w[4];
                mb_tf32x4(w, b + j * 8 * TB_LD + h);
#pragma unroll
                for (int s = 0; s < 4; s += 2)
#pragma unroll
                    for (int i = 0; i < TB_MI; i++)
                        mb_mma_tf32(acc[i][j], lo[i][s], hi[i][s], lo[i][s + 1], hi[i][s + 1],
                                    w[s], w[s + 1]);
            }
        }
    }
#undef MB_TB_ISSUE
    mb_cp_wait<0>();
    /* Accumulator e of tile (i, j): row g (+8 for e >= 2), column 2 t4 + (e & 1). */
    const bool pair = ((ldy | ldr) & 1) == 0 && (((uintptr_t)Y | (uintptr_t)res) & 7) == 0;
#pragma unroll
    for (int i = 0; i < TB_MI; i++)
#pragma unroll
        for (int j = 0; j < TB_NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int64_t m = m0 + wm * 16 * TB_MI + i * 16 + g + (e ? 8 : 0);
                const int64_t n = n0 + wn * 8 * TB_NJ + j * 8 + 2 * t4;
                mb_put_pair(Y, ldy, res, ldr, M, N, m, n, acc[i][j][e], acc[i][j][e + 1], pair);
            }
}
#endif

/* ---- decode GEMV ----------------------------------------------------------------
 * Warp w of block b takes W row n = 8 b + w for every row of X, 8 rows at a time;
 * lanes stride over k (float4 when aligned) and a shuffle tree sums them. res,
 * guard and the conv epilogue as in mb_gemv_k (gemm.cu). */
#define FG_THREADS 256

MB_KERNEL void MB_BOUNDS(FG_THREADS)
mb_fast_gemv_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
               int64_t ldw, float *Y, int64_t ldy, const float *res, int64_t ldr,
               const unsigned long long *guard, MB_CONV_EPI_ARGS)
{
    MB_GRID_WAIT();
    const int lane = threadIdx.x % 32;
    const int64_t n = (int64_t)blockIdx.x * (FG_THREADS / 32) + threadIdx.x / 32;
    if (n >= N) return;
    const float *w = W + n * ldw;
    const bool vec = ((ldx | ldw) & 3) == 0 && (((uintptr_t)X | (uintptr_t)W) & 15) == 0;
    const int64_t kv = vec ? K / 4 * 4 : 0;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mm = M - m0 < 8 ? (int)(M - m0) : 8;
        const float *x = X + m0 * ldx;
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.0f;
#pragma unroll 2
        for (int64_t k = 4 * lane; k < kv; k += 128) {
            const float4 wv = *(const float4 *)(w + k);
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < mm) {
                    const float4 xv = *(const float4 *)(x + j * ldx + k);
                    acc[j] = fmaf(xv.x, wv.x, acc[j]);
                    acc[j] = fmaf(xv.y, wv.y, acc[j]);
                    acc[j] = fmaf(xv.z, wv.z, acc[j]);
                    acc[j] = fmaf(xv.w, wv.w, acc[j]);
                }
        }
        for (int64_t k = kv + lane; k < K; k += 32) {
            const float wv = w[k];
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < mm) acc[j] = fmaf(x[j * ldx + k], wv, acc[j]);
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int o = 16; o > 0; o /= 2) acc[j] += MB_SHFL_XOR(acc[j], o);
        if (lane == 0) {
            const bool refused = mb_refused(guard);
            for (int j = 0; j < mm; j++) {
                const int64_t m = m0 + j;
                float v = acc[j];
                if (res) v = refused ? MB_QNAN : res[m * ldr + n] + v;
                Y[m * ldy + n] = v;
                conv_epilogue<mb_fast>(m, n, v, !refused, c0, C, window, cw, cb, u, ldu);
            }
        }
    }
}

/* ---- RMSNorm ----------------------------------------------------------------------
 * A warp a row: its sum of squares over the lanes (shuffles, no barrier), rsqrtf,
 * then the row scaled (x re-read, from cache; out may be x: a lane writes only what
 * it read). 16-byte loads where the rows allow. */
#define FN_THREADS 256
#define FN_ROWS (FN_THREADS / 32)

MB_KERNEL void MB_BOUNDS(FN_THREADS)
mb_fast_rmsnorm_k(int64_t M, int64_t n, const float *x, int64_t ldx, const float *w,
                  float *out, int64_t ldo, int64_t cn, const uint32_t *cx, unsigned long long *g,
                  volatile unsigned long long *host, unsigned long long *first)
{
    MB_GRID_WAIT();
    if (g) mb_guard_step(cn, cx, g, host); /* as mb_rms_k */
    const int lane = threadIdx.x % 32;
    const bool vec = n % 4 == 0 && ldx % 4 == 0 && ldo % 4 == 0 &&
                     (((uintptr_t)x | (uintptr_t)w | (uintptr_t)out) & 15) == 0;
    unsigned long long bad = ~0ull; /* first: x's input check (as mb_rms_k) */
    for (int64_t m = (int64_t)blockIdx.x * FN_ROWS + threadIdx.x / 32; m < M;
         m += (int64_t)gridDim.x * FN_ROWS) {
        const float *xr = x + m * ldx;
        float *dst = out + m * ldo;
        float s = 0.0f;
        if (vec) {
            for (int64_t j = 4 * lane; j < n; j += 128) {
                const float4 v = *(const float4 *)&xr[j];
                if (first) {
                    mb_note_nonfinite(v.x, m * ldx + j, &bad);
                    mb_note_nonfinite(v.y, m * ldx + j + 1, &bad);
                    mb_note_nonfinite(v.z, m * ldx + j + 2, &bad);
                    mb_note_nonfinite(v.w, m * ldx + j + 3, &bad);
                }
                s = fmaf(v.x, v.x, s), s = fmaf(v.y, v.y, s);
                s = fmaf(v.z, v.z, s), s = fmaf(v.w, v.w, s);
            }
        } else {
            for (int64_t j = lane; j < n; j += 32) {
                const float v = xr[j];
                if (first) mb_note_nonfinite(v, m * ldx + j, &bad);
                s = fmaf(v, v, s);
            }
        }
        for (int o = 16; o > 0; o /= 2) s += MB_SHFL_XOR(s, o);
        const float r = rsqrtf(s / (float)n + MB_EPS);
        if (vec) {
            for (int64_t j = 4 * lane; j < n; j += 128) {
                const float4 v = *(const float4 *)&xr[j], wv = *(const float4 *)&w[j];
                *(float4 *)&dst[j] = make_float4(v.x * r * wv.x, v.y * r * wv.y, v.z * r * wv.z,
                                                 v.w * r * wv.w);
            }
        } else {
            for (int64_t j = lane; j < n; j += 32) dst[j] = xr[j] * r * w[j];
        }
    }
    mb_report_nonfinite(first, bad);
}

#undef TB_M
#undef TB_N
#undef TB_K
#undef TB_LD
#undef TB_STAGES
#undef TB_THREADS
#undef TB_WM
#undef TB_WN
#undef TB_MI
#undef TB_NJ
#undef FG_THREADS
#undef FN_THREADS
#undef FN_ROWS
