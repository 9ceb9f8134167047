/* Causal depthwise conv + silu (SPEC 5 step 3), shared by Mamba-1 and Mamba-2. */
#include <stdlib.h>
#include "numerics.h"
#include "ops.h"

#define TAPS 4

void MB_ISA_FN(mb_conv_silu_pre)(int64_t len, int64_t C, const float *in, int64_t ldi,
                                 float *window, const float *w, const float *bias,
                                 float *pre, int64_t ldp, float *u, int64_t ldu)
{
    for (int64_t t = 0; t < len; t++) {
        /* window position k holds the input at t - 3 + k; before the call it is the
         * carried window, whose slot 4 + p holds position p < 0. */
        const float *row[TAPS];
        for (int k = 0; k < TAPS; k++) {
            int64_t p = t - (TAPS - 1) + k;
            row[k] = p >= 0 ? in + p * ldi : NULL;
        }
        /* the conv outputs land in pre (or in u itself), then silu maps them into u */
        float *o = u + t * ldu, *po = pre ? pre + t * ldp : o;
        if (row[0]) {
            for (int64_t c = 0; c < C; c++) {
                float acc = bias[c];
                for (int k = 0; k < TAPS; k++) {
#ifdef MB_SABOTAGE_CONV_REVERSED
                    acc = fmaf(w[c * TAPS + (TAPS - 1 - k)], row[k][c], acc);
#else
                    acc = fmaf(w[c * TAPS + k], row[k][c], acc);
#endif
                }
                po[c] = acc;
            }
        } else {
            for (int64_t c = 0; c < C; c++) {
                float acc = bias[c];
                for (int k = 0; k < TAPS; k++) {
                    int64_t p = t - (TAPS - 1) + k;
                    float v = row[k] ? row[k][c] : window[c * TAPS + TAPS + p];
#ifdef MB_SABOTAGE_CONV_REVERSED
                    acc = fmaf(w[c * TAPS + (TAPS - 1 - k)], v, acc);
#else
                    acc = fmaf(w[c * TAPS + k], v, acc);
#endif
                }
                po[c] = acc;
            }
        }
        for (int64_t c = 0; c < C; c++)
            o[c] = mb_silu(po[c]);
    }
    /* Shift in place: slot j takes position len - 4 + j; a slot still inside the
     * old window reads a higher index than it writes, so ascending j is safe. */
    for (int64_t c = 0; c < C; c++) {
        float *win = window + c * TAPS;
        for (int j = 0; j < TAPS; j++) {
            int64_t p = len - TAPS + j;
            win[j] = p >= 0 ? in[p * ldi + c] : win[TAPS + p];
        }
    }
}

void MB_ISA_FN(mb_conv_silu)(int64_t len, int64_t C, const float *in, int64_t ldi,
                             float *window, const float *w, const float *bias,
                             float *u, int64_t ldu)
{
    MB_ISA_FN(mb_conv_silu_pre)(len, C, in, ldi, window, w, bias, NULL, 0, u, ldu);
}
