/* Causal depthwise conv + silu (SPEC 5 step 3), shared by Mamba-1 and Mamba-2. */
#include <stdlib.h>
#include "numerics.h"
#include "simd.h"
#include "ops.h"

#define TAPS 4
#define CBLK 256 /* channels whose taps and window are transposed on the stack */
#define PF 8     /* rows of input prefetched ahead */

void MB_ISA_FN(mb_conv_silu_pre)(int64_t len, int64_t C, const float *in, int64_t ldi,
                                 float *window, const float *w, const float *bias,
                                 float *pre, int64_t ldp, float *u, int64_t ldu)
{
    for (int64_t c0 = 0; c0 < C; c0 += CBLK) {
        const int nc = C - c0 < CBLK ? (int)(C - c0) : CBLK;
        /* taps and the carried window (slot j holds position j - 4) channel-minor, so
         * that vector lanes run across channels */
        float wt[TAPS][CBLK], hist[TAPS][CBLK];
        for (int k = 0; k < TAPS; k++)
            for (int i = 0; i < nc; i++) {
#ifdef MB_SABOTAGE_CONV_REVERSED
                wt[k][i] = w[(c0 + i) * TAPS + (TAPS - 1 - k)];
#else
                wt[k][i] = w[(c0 + i) * TAPS + k];
#endif
                hist[k][i] = window[(c0 + i) * TAPS + k];
            }
        for (int64_t t = 0; t < len; t++) {
            /* tap k reads position t - 3 + k: the input, or the carried window */
            const float *row[TAPS];
            for (int k = 0; k < TAPS; k++) {
                const int64_t p = t - (TAPS - 1) + k;
                row[k] = p >= 0 ? in + p * ldi + c0 : hist[TAPS + p];
            }
            float *o = u + t * ldu + c0, *po = pre ? pre + t * ldp + c0 : NULL;
            /* rows ldi apart defeat the hardware prefetcher: ask PF rows ahead */
            if (t + PF < len)
                for (int i = 0; i < nc; i += 16)
                    __builtin_prefetch(in + (t + PF) * ldi + c0 + i);
            for (int i = 0; i < nc; i += MB_VW) {
                const int n = nc - i < MB_VW ? nc - i : MB_VW;
                mb_vf acc = mb_vldn(bias + c0 + i, n);
                MB_UNROLL
                for (int k = 0; k < TAPS; k++)
                    acc = mb_vfma(mb_vldn(wt[k] + i, n), mb_vldn(row[k] + i, n), acc);
                if (po)
                    mb_vstn(po + i, acc, n);
                mb_vstn(o + i, mb_vsilu(acc), n);
            }
        }
        /* the window takes the last four positions, oldest first */
        for (int i = 0; i < nc; i++)
            for (int j = 0; j < TAPS; j++) {
                const int64_t p = len - TAPS + j;
                window[(c0 + i) * TAPS + j] = p >= 0 ? in[p * ldi + c0 + i] : hist[TAPS + p][i];
            }
    }
}
