/* RMSNorm rows (SPEC 5 step 1), the GPU twin of reference/norm.c: mb_rms_k gives
 * each row's r = rsqrt(dot(x, x) / n + eps), and (x * r) * w is written by mb_rms_k
 * itself for rows it holds whole, else by mb_rms_scale_k over the whole grid. A
 * serial chain cannot be split, so rows run side by side instead: a block takes
 * up to RN_ROWS rows and lane r of warp 0 walks dot v1 of row r. Rows of one leaf of
 * which a few fit the block's shared memory whole are copied at once, walked as
 * their parts land, then scaled from there, so x is read once; longer rows stream
 * through a ring of shared-memory stages (cp.async), issued by the other warps, so
 * the chains never wait on global memory, and past 8192 terms join their leaves with
 * mb_dot's tree.
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
#define RN_CHUNKS 4

/* (v * r) * w, noting v (flat index e) in bad where check is set and v is not finite */
MB_DEV float rms_scale1(float v, float r, float w, int64_t e, bool check, unsigned long long *bad)
{
    if (check) mb_note_nonfinite(v, e, bad);
    return (v * r) * w;
}

/* rms_scale1 of four terms (flat indices e on) */
MB_DEV float4 rms_scale4(float4 v, float r, float4 w, int64_t e, bool check,
                         unsigned long long *bad)
{
    float4 o;
    o.x = rms_scale1(v.x, r, w.x, e, check, bad);
    o.y = rms_scale1(v.y, r, w.y, e + 1, check, bad);
    o.z = rms_scale1(v.z, r, w.z, e + 2, check, bad);
    o.w = rms_scale1(v.w, r, w.w, e + 3, check, bad);
    return o;
}

/* rows [m0, m0 + rows) whole at sm (ld floats apart), scaled from there by sw (w,
 * staged by the caller). Their copy is issued at once as RN_CHUNKS commit groups
 * and lane i of warp 0 walks row i's chain through each group as it lands, so the
 * chains run under the copy instead of after it (dot v1's terms in the order of
 * chain.h mb_sumsq_row). */
MB_DEV void rms_whole(int64_t m0, int rows, int64_t n, const float *xb, int64_t ldx, bool vec,
                      int ld, float *sm, const float *sw, float *r, float *out, int64_t ldo,
                      unsigned long long *bad)
{
    __shared__ float rr[RN_ROWS];
    const int tid = threadIdx.x;
    const int n4 = (int)(n + 3) / 4 * 4, n16 = (int)n / 16 * 16;
    const int kc = (n4 + 16 * RN_CHUNKS - 1) / (16 * RN_CHUNKS) * 16; /* terms a group */
    for (int c = 0; c < RN_CHUNKS; c++) {
        const int k = c * kc;
        if (k < n4)
            mb_stage_rows(sm + k, ld, xb, ldx, rows, kc < n4 - k ? kc : n4 - k, k, n, vec, tid,
                          RN_THREADS);
        mb_cp_commit();
    }
    float acc = 0.0f;
    const float *t = sm + tid * ld;
    for (int c = 0; c < RN_CHUNKS; c++) {
        mb_cp_wait_n(RN_CHUNKS - 1 - c);
        __syncthreads();
        const int k = c * kc, k1 = k + kc < n16 ? k + kc : n16;
        if (tid < rows && k < k1) acc = mb_chain_tile<true>(acc, t + k, t + k, k1 - k);
    }
    if (tid < rows) {
        rr[tid] = mb_rms_r(mb_sumsq_tail(acc, t, n), n);
        r[m0 + tid] = rr[tid];
    }
    __syncthreads();
    const bool v4 = ((n | ldo) & 3) == 0 && ((uintptr_t)out & 15) == 0;
    for (int m = 0; m < rows; m++) {
        const int64_t e = (m0 + m) * ldx, o = (m0 + m) * ldo;
        if (v4)
            for (int j = 4 * tid; j < n; j += 4 * RN_THREADS) {
                const float4 v = *(const float4 *)(sm + m * ld + j);
                *(float4 *)(out + o + j) =
                    rms_scale4(v, rr[m], *(const float4 *)(sw + j), e + j, bad != nullptr, bad);
            }
        else
            for (int j = tid; j < n; j += RN_THREADS)
                out[o + j] = rms_scale1(sm[m * ld + j], rr[m], sw[j], e + j, bad != nullptr, bad);
    }
    __syncthreads();
}

/* rows [m0, m0 + rows) through the ring; TREE: n spans several leaves */
template <bool TREE>
MB_DEV void rms_ring(int64_t m0, int rows, int64_t n, const float *xb, int64_t ldx, bool vec,
                     float *ring, float *r)
{
    const int tid = threadIdx.x;
    const int chunks = (int)((n + RN_KC - 1) / RN_KC);
    for (int s = 0; s < RN_STAGES - 1; s++) {
        if (s < chunks && tid >= 32)
            mb_stage_rows(ring + s * RN_ROWS * RN_LD, RN_LD, xb, ldx, rows, RN_KC,
                          (int64_t)s * RN_KC, n, vec, tid - 32, RN_THREADS - 32);
        mb_cp_commit();
    }
    float acc = 0.0f;
    mb_dot_tree tree;
    if (TREE) tree.top = 0;
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
            if (TREE && k > 0 && k % MB_DOT_LEAF == 0) {
                mb_dot_tree_push(&tree, acc);
                acc = 0.0f;
            }
            const float *t = ring + ((c % RN_STAGES) * RN_ROWS + tid) * RN_LD;
            const int64_t kn = n - k;
            if (kn >= RN_KC)
                acc = mb_chain_tile<true>(acc, t, t, RN_KC);
            else
                for (int kk = 0; kk < kn; kk++) acc = fmaf(t[kk], t[kk], acc);
        }
    }
    mb_cp_wait<0>();
    if (tid < rows) {
        if (TREE) {
            mb_dot_tree_push(&tree, acc);
            acc = mb_dot_tree_sum(&tree);
        }
        r[m0 + tid] = mb_rms_r(acc, n);
    }
    __syncthreads();
}

/* out (rows ldo apart, may be x itself): given only with `per`, the rows of one leaf
 * that a block holds whole with w (_cuda.py _norm_whole, at most RN_ROWS); they are
 * then scaled here, else r alone is written, RN_ROWS rows a block. g: a decode
 * session's guard word, given to a one-block launch, which first checks the step's
 * input (cn words at cx; finite.cu mb_guard_step). first: a prefill's input check
 * (finite.cu mb_first_nonfinite_k's answer), run where x is scaled: here or in
 * mb_rms_scale_k */
MB_KERNEL void MB_BOUNDS(RN_THREADS)
mb_rms_k(int64_t M, int64_t n, const float *x, int64_t ldx, float *r, const float *w, float *out,
         int64_t ldo, int64_t per, int64_t cn, const uint32_t *cx, unsigned long long *g,
         volatile unsigned long long *host, unsigned long long *first)
{
    MB_GRID_WAIT();
    if (g) mb_guard_step(cn, cx, g, host);
    extern __shared__ __align__(16) float ring[];
    const int ld = (int)((n + 31) / 32 * 32 + 4); /* a whole row's stride */
    unsigned long long bad = ~0ull;
    const int64_t R = out ? per : RN_ROWS;
    float *sw = out ? ring + R * ld : nullptr; /* w after the rows, copied with the first group */
    if (sw)
        mb_stage_w(sw, w, n, threadIdx.x, RN_THREADS);
    for (int64_t m0 = (int64_t)blockIdx.x * R; m0 < M; m0 += (int64_t)gridDim.x * R) {
        const int rows = M - m0 < R ? (int)(M - m0) : (int)R;
        const float *xb = x + m0 * ldx;
        const bool vec = (ldx & 3) == 0 && ((uintptr_t)xb & 15) == 0;
        if (out)
            rms_whole(m0, rows, n, xb, ldx, vec, ld, ring, sw, r, out, ldo, first ? &bad : nullptr);
        else if (n > MB_DOT_LEAF)
            rms_ring<true>(m0, rows, n, xb, ldx, vec, ring, r);
        else
            rms_ring<false>(m0, rows, n, xb, ldx, vec, ring, r);
    }
    mb_report_nonfinite(first, bad);
}

/* Rows scaled by their r, RS_ROWS rows a block at a time: a thread loads its items
 * (float4 where rows allow) of all of them before it stores any, since out may alias
 * x as far as the compiler knows and a load after a store would wait for it. */
#define RS_ROWS 8
MB_KERNEL void mb_rms_scale_k(int64_t M, int64_t n, const float *x, int64_t ldx, const float *r,
                              const float *w, float *out, int64_t ldo, unsigned long long *first)
{
    MB_GRID_WAIT();
    unsigned long long bad = ~0ull;
    const bool vec = ((n | ldx | ldo) & 3) == 0 &&
                     (((uintptr_t)x | (uintptr_t)w | (uintptr_t)out) & 15) == 0;
    const int64_t per = vec ? n / 4 : n; /* a row's items */
    for (int64_t m0 = (int64_t)blockIdx.x * RS_ROWS; m0 < M; m0 += (int64_t)gridDim.x * RS_ROWS) {
        const int rows = M - m0 < RS_ROWS ? (int)(M - m0) : RS_ROWS;
        float rr[RS_ROWS];
#pragma unroll
        for (int k = 0; k < RS_ROWS; k++) rr[k] = k < rows ? r[m0 + k] : 0.0f;
        for (int64_t j = threadIdx.x; j < per; j += blockDim.x) {
            if (vec) {
                float4 v[RS_ROWS];
#pragma unroll
                for (int k = 0; k < RS_ROWS; k++)
                    if (k < rows) v[k] = *(const float4 *)(x + (m0 + k) * ldx + 4 * j);
                const float4 wv = *(const float4 *)(w + 4 * j);
#pragma unroll
                for (int k = 0; k < RS_ROWS; k++) {
                    if (k >= rows) break;
                    *(float4 *)(out + (m0 + k) * ldo + 4 * j) =
                        rms_scale4(v[k], rr[k], wv, (m0 + k) * ldx + 4 * j, first, &bad);
                }
            } else {
                float v[RS_ROWS];
#pragma unroll
                for (int k = 0; k < RS_ROWS; k++)
                    if (k < rows) v[k] = x[(m0 + k) * ldx + j];
                const float wj = w[j];
#pragma unroll
                for (int k = 0; k < RS_ROWS; k++) {
                    if (k >= rows) break;
                    out[(m0 + k) * ldo + j] = rms_scale1(v[k], rr[k], wj, (m0 + k) * ldx + j,
                                                         first, &bad);
                }
            }
        }
    }
    mb_report_nonfinite(first, bad);
}

#undef RN_ROWS
#undef RN_KC
#undef RN_LD
#undef RN_STAGES
#undef RN_THREADS
#undef RN_CHUNKS
#undef RS_ROWS
