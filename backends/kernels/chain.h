/* dot v1's serial chain over a tile staged in shared memory (mb_stage_rows): the
 * decode GEMV and the RMSNorm sum of squares walk it; and RMSNorm rows held whole
 * in shared memory (mb_norm_rows, the decode GEMV's). */
#ifndef MB_CHAIN_H
#define MB_CHAIN_H

#include "vendor.h"
#include "numerics.h"
#include "ops.h"

/* acc[r] continued over the kc terms x[r][k] * w[k], k ascending, one fmaf each (x
 * and w 16-byte aligned, kc a multiple of 16; SQUARE: w is x[0], R = 1); no term past
 * kc is read. P pieces of four terms of each row are in flight, each reloaded 4 P
 * terms ahead once walked, so a lone chain waits on the fma, not on shared-memory
 * latency: 8 terms ahead it took 8.3 cycles a term, 32 ahead (P = 8) 6.6 (the fma
 * alone 5.2; H100, loaders copying beside it). R rows share each piece of w read. */
#define MB_LD4(p) (*(const float4 *)(p))
#define MB_FMA4(acc, a, b)                                                            \
    {                                                                                 \
        acc = fmaf((a).x, (b).x, acc);                                                \
        acc = fmaf((a).y, (b).y, acc);                                                \
        acc = fmaf((a).z, (b).z, acc);                                                \
        acc = fmaf((a).w, (b).w, acc);                                                \
    }
template <bool SQUARE, int R = 1, int P = 8>
MB_DEV void mb_chain_rows(float (&acc)[R], const float *const (&x)[R], const float *w, int kc)
{
    static_assert(P == 1 || P == 2 || P % 4 == 0, "kc - k stays a multiple of the step");
    static_assert(!SQUARE || R == 1, "a square walks one row");
    float4 a[R][P], v[P];
#pragma unroll
    for (int i = 0; i < P; i++)
        if (4 * i < kc) {
#pragma unroll
            for (int r = 0; r < R; r++) a[r][i] = MB_LD4(x[r] + 4 * i);
            v[i] = SQUARE ? a[0][i] : MB_LD4(w + 4 * i);
        }
    int k = 0;
#pragma unroll 1
    for (; k + 4 * P <= kc; k += 4 * P) {
        bool more[(P + 3) / 4]; /* piece group g reloads (kc - k is a multiple of 16) */
#pragma unroll
        for (int g = 0; g < (P + 3) / 4; g++) more[g] = k + 4 * P + 16 * g < kc;
#pragma unroll
        for (int i = 0; i < P; i++) {
#pragma unroll
            for (int r = 0; r < R; r++) MB_FMA4(acc[r], a[r][i], v[i])
            if (more[i / 4]) {
#pragma unroll
                for (int r = 0; r < R; r++) a[r][i] = MB_LD4(x[r] + k + 4 * P + 4 * i);
                v[i] = SQUARE ? a[0][i] : MB_LD4(w + k + 4 * P + 4 * i);
            }
        }
    }
    if (k < kc) /* the last kc - k terms: at most 4 P - 16 */
#pragma unroll
        for (int i = 0; i < P - 4; i++)
            if (k + 16 * (i / 4) < kc)
#pragma unroll
                for (int r = 0; r < R; r++) MB_FMA4(acc[r], a[r][i], v[i])
}

/* one row's chain: acc continued over x[k] * w[k] */
template <bool SQUARE>
MB_DEV float mb_chain_tile(float acc, const float *x, const float *w, int kc)
{
    float a[1] = {acc};
    const float *const xs[1] = {x};
    mb_chain_rows<SQUARE>(a, xs, w, kc);
    return a[0];
}
#undef MB_LD4
#undef MB_FMA4

/* r of a row of n from its sum of squares ss (reference/norm.c) */
MB_DEV float mb_rms_r(float ss, int64_t n) { return mb_rsqrt(ss / (float)n + MB_EPS); }

/* acc continued over the squares of a staged row's terms past its last whole 16 */
MB_DEV float mb_sumsq_tail(float acc, const float *t, int64_t n)
{
    for (int k = (int)n / 16 * 16; k < n; k++) acc = fmaf(t[k], t[k], acc);
    return acc;
}

/* dot v1 of a row with itself, the row staged whole (16-byte aligned) */
MB_DEV float mb_sumsq_row(const float *t, int64_t n)
{
    return mb_sumsq_tail(mb_chain_tile<true>(0.0f, t, t, (int)n / 16 * 16), t, n);
}

/* w's n terms staged at sw (padded to 4; a copy group of the caller's) */
MB_DEV void mb_stage_w(float *sw, const float *w, int64_t n, int tid, int nthreads)
{
    const int n4 = (int)(n + 3) / 4 * 4;
    mb_stage_rows(sw, n4, w, 0, 1, n4, 0, n, ((uintptr_t)w & 15) == 0, tid, nthreads);
}

/* Rows [0, rows) of src (n terms, ldx apart; rows <= the block's threads) staged
 * whole at sm, ld floats apart (ld = 4 mod 32: a quarter-warp's float4 reads of 8
 * rows fall in distinct banks), w after them; rr[i] = r of row i, thread i walking
 * row i's chain. Every thread of the block calls it; returns the staged w. */
MB_DEV const float *mb_norm_rows(float *sm, int ld, const float *src, int64_t ldx, int rows,
                                 int64_t n, bool vec, const float *w, float *rr, int tid,
                                 int nthreads)
{
    const int n4 = (int)(n + 3) / 4 * 4;
    float *sw = sm + rows * ld;
    mb_stage_rows(sm, ld, src, ldx, rows, n4, 0, n, vec, tid, nthreads);
    mb_stage_w(sw, w, n, tid, nthreads);
    mb_cp_commit();
    mb_cp_wait<0>();
    __syncthreads();
    if (tid < rows) rr[tid] = mb_rms_r(mb_sumsq_row(sm + tid * ld, n), n);
    __syncthreads();
    return sw;
}

#endif
