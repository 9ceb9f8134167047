/* numeric_mode="fast" (SPEC 3): the same block maths on faster schedules. It
 * promises accuracy (relative L2 error <= 2e-3 against float64), never bits.
 *   mb_fast_gemm_k     Y = X . W^T on the tensor cores in TF32 (operands rounded to
 *                      a 10-bit mantissa; products summed in fp32).
 *   mb_fast_gemv_k     few rows of X (decode): each output's K terms split over a
 *                      warp's lanes and summed by shuffles.
 *   mb_fast_rmsnorm_k  the sum of squares split over a block.
 * The conv and scan kernels take the fast transcendentals (modes.h). */
#include "vendor.h"
#include "numerics.h"
#include "ops.h"

/* ---- TF32 tensor-core GEMM ------------------------------------------------------
 * Block tile 128 x 128 x 32, 8 warps as 2 (M) x 4 (N), each warp 64 x 32 outputs as
 * 4 x 4 mma.m16n8k8 tiles. X and W tiles (both K-contiguous, as mma's row.col
 * wants) stream through TB_STAGES shared-memory stages by cp.async, rows padded by
 * 4 floats so fragment loads hit distinct banks. Terms past K are zero-filled.
 * Dynamic shared memory: TB_STAGES * 2 * 128 * TB_LD floats (_cuda.py TF32_SMEM). */
#define TB_M 128
#define TB_N 128
#define TB_K 32
#define TB_LD (TB_K + 4)
#define TB_STAGES 3
#define TB_THREADS 256

#if !defined(__HIPCC__)
/* TF32 operand, rounded to nearest (ties away) by adding half a unit of its 10-bit
 * mantissa: the tensor core ignores the 13 low bits. One integer add, where
 * cvt.rna.tf32.f32 costs several instructions on sm_90 (inf inputs become NaN). */
MB_DEV uint32_t mb_tf32(float x) { return __float_as_uint(x) + 0x1000u; }

MB_DEV void mb_mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

MB_KERNEL void MB_BOUNDS_MIN(TB_THREADS, 2)
mb_fast_gemm_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
               int64_t ldw, float *Y, int64_t ldy)
{
    extern __shared__ __align__(16) float sm[];
    float *As = sm, *Bs = sm + TB_STAGES * TB_M * TB_LD;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / 4, wn = warp % 4, g = lane / 4, t4 = lane % 4;
    const int64_t m0 = (int64_t)blockIdx.y * TB_M, n0 = (int64_t)blockIdx.x * TB_N;
    const int mrows = M - m0 < TB_M ? (int)(M - m0) : TB_M;
    const int nrows = N - n0 < TB_N ? (int)(N - n0) : TB_N;
    const float *Xb = X + m0 * ldx, *Wb = W + n0 * ldw;
    const bool vx = (ldx & 3) == 0 && ((uintptr_t)Xb & 15) == 0;
    const bool vw = (ldw & 3) == 0 && ((uintptr_t)Wb & 15) == 0;
    const int64_t chunks = (K + TB_K - 1) / TB_K;

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
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    for (int64_t c = 0; c < chunks; c++) {
        mb_cp_wait<TB_STAGES - 2>();
        __syncthreads();
        if (c + TB_STAGES - 1 < chunks) MB_TB_ISSUE(c + TB_STAGES - 1)
        mb_cp_commit();
        const int slot = (int)(c % TB_STAGES);
        const float *a = As + (slot * TB_M + wm * 64 + g) * TB_LD + t4;
        const float *b = Bs + (slot * TB_N + wn * 32 + g) * TB_LD + t4;
#pragma unroll
        for (int kk = 0; kk < TB_K; kk += 8) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float *r = a + i * 16 * TB_LD + kk;
                af[i][0] = mb_tf32(r[0]);
                af[i][1] = mb_tf32(r[8 * TB_LD]);
                af[i][2] = mb_tf32(r[4]);
                af[i][3] = mb_tf32(r[8 * TB_LD + 4]);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float *r = b + j * 8 * TB_LD + kk;
                bf[j][0] = mb_tf32(r[0]);
                bf[j][1] = mb_tf32(r[4]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mb_mma_tf32(acc[i][j], af[i], bf[j]);
        }
    }
#undef MB_TB_ISSUE
    mb_cp_wait<0>();
    /* Accumulator e of tile (i, j): row g (+8 for e >= 2), column 2 t4 + (e & 1). */
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t m = m0 + wm * 64 + i * 16 + g + (e >= 2 ? 8 : 0);
                const int64_t n = n0 + wn * 32 + j * 8 + 2 * t4 + (e & 1);
                if (m < M && n < N) Y[m * ldy + n] = acc[i][j][e];
            }
}
#endif

/* ---- decode GEMV ----------------------------------------------------------------
 * Warp w of block b takes W row n = 8 b + w for every row of X, 8 rows at a time;
 * lanes stride over k (float4 when aligned) and a shuffle tree sums them. res and
 * guard as in mb_gemv_k (gemm.cu). */
#define FG_THREADS 256

MB_KERNEL void MB_BOUNDS(FG_THREADS)
mb_fast_gemv_k(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W,
               int64_t ldw, float *Y, int64_t ldy, const float *res, int64_t ldr,
               const unsigned long long *guard)
{
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
            }
        }
    }
}

/* ---- RMSNorm ----------------------------------------------------------------------
 * One block per row: the sum of squares over the block's threads, then a shuffle
 * and shared-memory tree; rsqrtf. */
#define FN_THREADS 256

MB_KERNEL void MB_BOUNDS(FN_THREADS)
mb_fast_rmsnorm_k(int64_t M, int64_t n, const float *x, int64_t ldx, const float *w,
                  float *out, int64_t ldo)
{
    __shared__ float part[FN_THREADS / 32];
    __shared__ float r;
    const int tid = threadIdx.x, lane = tid % 32;
    for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
        const float *xr = x + m * ldx;
        float s = 0.0f;
        for (int64_t j = tid; j < n; j += FN_THREADS) s = fmaf(xr[j], xr[j], s);
        for (int o = 16; o > 0; o /= 2) s += MB_SHFL_XOR(s, o);
        if (lane == 0) part[tid / 32] = s;
        __syncthreads();
        if (tid < 32) {
            s = lane < FN_THREADS / 32 ? part[lane] : 0.0f;
            for (int o = 16; o > 0; o /= 2) s += MB_SHFL_XOR(s, o);
            if (lane == 0) r = rsqrtf(s / (float)n + MB_EPS);
        }
        __syncthreads();
        float *dst = out + m * ldo;
        for (int64_t j = tid; j < n; j += FN_THREADS) dst[j] = xr[j] * r * w[j];
        __syncthreads();
    }
}

#undef TB_M
#undef TB_N
#undef TB_K
#undef TB_LD
#undef TB_STAGES
#undef TB_THREADS
#undef FG_THREADS
#undef FN_THREADS
