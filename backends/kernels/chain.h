/* dot v1's serial chain over a tile staged in shared memory (mb_stage_rows): the
 * decode GEMV and the RMSNorm sum of squares walk it. */
#ifndef MB_CHAIN_H
#define MB_CHAIN_H

#include "vendor.h"

/* acc continued over the kc terms x[k] * w[k], k ascending, one fmaf each (x and
 * w 16-byte aligned, kc a multiple of 16; SQUARE: w is x; the first 8 terms are
 * read even when kc is 0). The next 8 terms are
 * loaded while the current 8 are walked, so the chain waits on the fma alone, not
 * on shared-memory latency; the loop is kept rolled because unrolled, the compiler
 * sinks each load to just before its use. */
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
    float4 a0 = MB_LD4(x), a1 = MB_LD4(x + 4);
    float4 v0 = SQUARE ? a0 : MB_LD4(w), v1 = SQUARE ? a1 : MB_LD4(w + 4);
#pragma unroll 1
    for (int k = 0; k < kc; k += 16) {
        const float4 b0 = MB_LD4(x + k + 8), b1 = MB_LD4(x + k + 12);
        const float4 u0 = SQUARE ? b0 : MB_LD4(w + k + 8), u1 = SQUARE ? b1 : MB_LD4(w + k + 12);
        MB_FMA4(a0, v0)
        MB_FMA4(a1, v1)
        if (k + 16 < kc) {
            a0 = MB_LD4(x + k + 16);
            a1 = MB_LD4(x + k + 20);
            v0 = SQUARE ? a0 : MB_LD4(w + k + 16);
            v1 = SQUARE ? a1 : MB_LD4(w + k + 20);
        }
        MB_FMA4(b0, u0)
        MB_FMA4(b1, u1)
    }
    return acc;
}
#undef MB_LD4
#undef MB_FMA4

/* The same chain walked by a warp with every operand in registers, for a chain that
 * is alone on its critical path (a decode step's single row): lane L holds terms
 * L * MB_RELAY + (0..MB_RELAY - 1) of a run of 32 * MB_RELAY (mb_relay_load) and
 * continues the chain where lane L - 1 left it, passed by a shuffle. No fma waits on
 * a load: about 4.6 cycles a term on one warp and 5.1-5.5 with eight warps a
 * multiprocessor, against mb_chain_tile's 6.7 (H200). Terms past the end are loaded
 * as zeros: fmaf(0, 0, acc) is acc, as a chain from +0 is never -0. Every lane
 * returns the sum. */
#define MB_RELAY 64

/* a lane's terms of the run at k0 of a row of n (vec: the row is 16-byte aligned) */
MB_DEV void mb_relay_load(float (&v)[MB_RELAY], const float *row, int64_t k0, int64_t n, bool vec)
{
    const int64_t k = k0 + (threadIdx.x % 32) * MB_RELAY;
    if (vec && k + MB_RELAY <= n) {
#pragma unroll
        for (int i = 0; i < MB_RELAY; i += 4) {
            const float4 f = *(const float4 *)(row + k + i);
            v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < MB_RELAY; i++) v[i] = k + i < n ? row[k + i] : 0.0f;
}

/* acc continued over the run at k0 of x . w (SQUARE: x . x), n terms in all */
template <bool SQUARE>
MB_DEV float mb_relay(float acc, const float (&x)[MB_RELAY], const float (&w)[MB_RELAY],
                      int64_t k0, int64_t n)
{
    const int64_t left = (n - k0 + MB_RELAY - 1) / MB_RELAY;
    const int lanes = left < 32 ? (int)left : 32;
    for (int L = 0; L < lanes; L++) {
        float c = acc;
#pragma unroll
        for (int i = 0; i < MB_RELAY; i++) c = fmaf(x[i], SQUARE ? x[i] : w[i], c);
        acc = MB_SHFL(c, L, 32);
    }
    return acc;
}

#endif
