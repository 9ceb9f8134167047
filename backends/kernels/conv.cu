/* Causal depthwise conv (4 taps, oldest first, bias-seeded fma chain) then silu,
 * the GPU twin of reference/conv.c, over a batch of packed rows: row b holds
 * tokens [off[b], off[b+1]) of in (ld ldi). window (B, C, 4) holds each row's four
 * inputs before the call; mb_conv_window_k, launched after, moves it on. */
#include "vendor.h"
#include "numerics.h"

#define TAPS 4

/* Grid (x over len * C, y over rows). */
MB_KERNEL void mb_conv_silu_k(int64_t B, const int64_t *off, int64_t C, const float *in,
                              int64_t ldi, const float *window, const float *w,
                              const float *bias, float *u, int64_t ldu)
{
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], len = off[b + 1] - o;
        const float *win = window + b * C * TAPS;
        MB_GRID_LOOP(i, len * C) {
            const int64_t t = i / C, c = i % C;
            float acc = bias[c];
#pragma unroll
            for (int k = 0; k < TAPS; k++) {
                const int64_t p = t - (TAPS - 1) + k;
                const float v = p >= 0 ? in[(o + p) * ldi + c] : win[c * TAPS + TAPS + p];
                acc = fmaf(w[c * TAPS + k], v, acc);
            }
            u[(o + t) * ldu + c] = mb_silu(acc);
        }
    }
}

/* Slot j takes position len - 4 + j, from the input or, for a short row, from the
 * old window; ascending j reads before it overwrites (as in conv.c). */
MB_KERNEL void mb_conv_window_k(int64_t B, const int64_t *off, int64_t C, const float *in,
                                int64_t ldi, float *window)
{
    MB_GRID_LOOP(i, B * C) {
        const int64_t b = i / C, c = i % C, o = off[b], len = off[b + 1] - o;
        float *win = window + i * TAPS;
        for (int j = 0; j < TAPS; j++) {
            const int64_t p = len - TAPS + j;
            win[j] = p >= 0 ? in[(o + p) * ldi + c] : win[TAPS + p];
        }
    }
}

#undef TAPS
