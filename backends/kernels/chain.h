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

#endif
