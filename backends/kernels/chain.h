/* dot v1's serial chain over a tile staged in shared memory (mb_stage_rows): the
 * decode GEMV and the RMSNorm sum of squares walk it; and RMSNorm rows held whole
 * in shared memory (mb_norm_rows, the decode GEMV's). */
#ifndef MB_CHAIN_H
#define MB_CHAIN_H

#include "vendor.h"
#include "numerics.h"
#include "ops.h"

/* acc continued over the kc terms x[k] * w[k], k ascending, one fmaf each (x and
 * w 16-byte aligned, kc a multiple of 16; SQUARE: w is x); no term past kc is read.
 * Eight pieces of four terms are in flight, each reloaded 32 terms ahead once
 * walked, so the chain waits on the fma, not on shared-memory latency: 8 terms
 * ahead the chain took 8.3 cycles a term, 32 ahead 6.6 (the fma alone 5.2; H100,
 * loaders copying beside it). */
#define MB_LD4(p) (*(const float4 *)(p))
#define MB_FMA4(a, b)                                                                 \
    {                                                                                 \
        acc = fmaf((a).x, (b).x, acc);                                                \
        acc = fmaf((a).y, (b).y, acc);                                                \
        acc = fmaf((a).z, (b).z, acc);                                                \
        acc = fmaf((a).w, (b).w, acc);                                                \
    }
template <bool SQUARE>
MB_DEV float mb_chain_tile(float acc, const float *x, const float *w, int kc)
{
    float4 a[8], v[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (4 * i < kc) {
            a[i] = MB_LD4(x + 4 * i);
            v[i] = SQUARE ? a[i] : MB_LD4(w + 4 * i);
        }
    int k = 0;
#pragma unroll 1
    for (; k + 32 <= kc; k += 32) {
        const bool lo = k + 32 < kc, hi = k + 48 < kc; /* pieces 0-3 and 4-7 reload */
#pragma unroll
        for (int i = 0; i < 8; i++) {
            MB_FMA4(a[i], v[i])
            if (i < 4 ? lo : hi) {
                a[i] = MB_LD4(x + k + 32 + 4 * i);
                v[i] = SQUARE ? a[i] : MB_LD4(w + k + 32 + 4 * i);
            }
        }
    }
    if (k < kc) /* a last 16 */
#pragma unroll
        for (int i = 0; i < 4; i++) MB_FMA4(a[i], v[i])
    return acc;
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
