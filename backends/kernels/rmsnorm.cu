/* RMSNorm rows (SPEC 5 step 1), the GPU twin of reference/norm.c, in two kernels:
 * mb_rms_k gives each row's r = rsqrt(dot(x, x) / n + eps), mb_rms_scale_k writes
 * (x * r) * w over the whole grid. A serial chain cannot be split, so rows run side
 * by side instead: a block takes RN_ROWS rows, lane r of warp 0 walks dot v1 of row
 * r (leaves and mb_dot's tree past 8192), and the rows stream through a ring of
 * shared-memory stages (cp.async), issued by the other warps, so the chains never
 * wait on global memory.
 * Dynamic shared memory: RN_STAGES * RN_ROWS * RN_LD floats (_cuda.py norm_smem). */
#include "vendor.h"
#include "numerics.h"
#include "ops.h"
#include "chain.h"

#define RN_ROWS 32
#define RN_KC 128
#define RN_LD (RN_KC + 4)
#define RN_STAGES MB_STAGES
#define RN_THREADS 128

MB_KERNEL void MB_BOUNDS(RN_THREADS)
mb_rms_k(int64_t M, int64_t n, const float *x, int64_t ldx, float *r)
{
    extern __shared__ __align__(16) float ring[];
    const int tid = threadIdx.x;
    const int chunks = (int)((n + RN_KC - 1) / RN_KC);
    for (int64_t m0 = (int64_t)blockIdx.x * RN_ROWS; m0 < M; m0 += (int64_t)gridDim.x * RN_ROWS) {
        const int rows = M - m0 < RN_ROWS ? (int)(M - m0) : RN_ROWS;
        const float *xb = x + m0 * ldx;
        const bool vec = (ldx & 3) == 0 && ((uintptr_t)xb & 15) == 0;
        for (int s = 0; s < RN_STAGES - 1; s++) {
            if (s < chunks && tid >= 32)
                mb_stage_rows(ring + s * RN_ROWS * RN_LD, RN_LD, xb, ldx, rows, RN_KC,
                              (int64_t)s * RN_KC, n, vec, tid - 32, RN_THREADS - 32);
            mb_cp_commit();
        }
        float acc = 0.0f;
        mb_dot_tree tree;
        tree.top = 0;
        for (int c = 0; c < chunks; c++) {
            mb_cp_wait<RN_STAGES - 2>();
            __syncthreads();
            const int nc = c + RN_STAGES - 1;
            if (nc < chunks && tid >= 32)
                mb_stage_rows(ring + (nc % RN_STAGES) * RN_ROWS * RN_LD, RN_LD, xb, ldx, rows,
                              RN_KC, (int64_t)nc * RN_KC, n, vec, tid - 32, RN_THREADS - 32);
            mb_cp_commit();
            if (tid < rows) {
                const int64_t k = (int64_t)c * RN_KC;
                if (k > 0 && k % MB_DOT_LEAF == 0) {
                    mb_dot_tree_push(&tree, acc);
                    acc = 0.0f;
                }
                const float *t = ring + ((c % RN_STAGES) * RN_ROWS + tid) * RN_LD;
                const int64_t kn = n - k;
                if (kn >= RN_KC)
                    acc = mb_chain_tile<RN_KC, true>(acc, t, t);
                else
                    for (int kk = 0; kk < kn; kk++) acc = fmaf(t[kk], t[kk], acc);
            }
        }
        mb_cp_wait<0>();
        if (tid < rows) {
            float ss = acc;
            if (n > MB_DOT_LEAF) {
                mb_dot_tree_push(&tree, acc);
                ss = mb_dot_tree_sum(&tree);
            }
            r[m0 + tid] = mb_rsqrt(ss / (float)n + MB_EPS);
        }
        __syncthreads();
    }
}

MB_KERNEL void mb_rms_scale_k(int64_t M, int64_t n, const float *x, int64_t ldx, const float *r,
                              const float *w, float *out, int64_t ldo)
{
    MB_GRID_LOOP(i, M * n) {
        const int64_t m = i / n, j = i % n;
        out[m * ldo + j] = (x[m * ldx + j] * r[m]) * w[j];
    }
}

#undef RN_ROWS
#undef RN_KC
#undef RN_LD
#undef RN_STAGES
#undef RN_THREADS
