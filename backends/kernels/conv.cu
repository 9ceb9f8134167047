/* Causal depthwise conv (4 taps, oldest first, bias-seeded fma chain) then silu,
 * the GPU twin of reference/conv.c, over a batch of packed rows: row b holds
 * tokens [off[b], off[b+1]) of in (ld ldi). window (B, C, 4) holds each row's four
 * inputs before the call; mb_conv_window_k, launched after, moves it on. A decode
 * step (one token per row) takes mb_conv_step_k, which does both. F is the
 * numeric mode's silu (modes.h). */
#include "modes.h"

#define TAPS 4

template <class F>
MB_DEV float conv_taps(const float *w, float bias, const float v[TAPS])
{
    float acc = bias;
#pragma unroll
    for (int k = 0; k < TAPS; k++)
#ifdef MB_SABOTAGE_CONV_REVERSED /* test builds only (tests/emu): the reference's seam */
        acc = fmaf(w[TAPS - 1 - k], v[k], acc);
#else
        acc = fmaf(w[k], v[k], acc);
#endif
    return F::silu(acc);
}

/* Grid (x over runs of CONV_RUN tokens x C, y over rows): an item walks one channel
 * through a run of tokens, its last three inputs kept in registers, so each input
 * is loaded once. The run's inputs are loaded CONV_BATCH at a time before any output
 * is stored: u may alias in as far as the compiler knows, so a load after a store
 * would wait for it, one load in flight a thread. */
#define CONV_RUN 32
#define CONV_BATCH 8
template <class F>
MB_DEV void conv_silu(int64_t B, const int64_t *off, int64_t C, const float *in, int64_t ldi,
                      const float *window, const float *w, const float *bias, float *u,
                      int64_t ldu)
{
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], len = off[b + 1] - o;
        const float *win = window + b * C * TAPS;
        MB_GRID_LOOP(i, (len + CONV_RUN - 1) / CONV_RUN * C) {
            const int64_t t0 = i / C * CONV_RUN, c = i % C;
            const int64_t t1 = len - t0 < CONV_RUN ? len : t0 + CONV_RUN;
            float v[TAPS];
#pragma unroll
            for (int k = 0; k < TAPS - 1; k++) {
                const int64_t p = t0 - (TAPS - 1) + k;
                v[k] = p >= 0 ? in[(o + p) * ldi + c] : win[c * TAPS + TAPS + p];
            }
            float wc[TAPS]; /* in registers: a load after a store would wait too */
#pragma unroll
            for (int k = 0; k < TAPS; k++) wc[k] = w[c * TAPS + k];
            const float bc = bias[c];
            for (int64_t tb = t0; tb < t1; tb += CONV_BATCH) {
                float nx[CONV_BATCH];
#pragma unroll
                for (int k = 0; k < CONV_BATCH; k++)
                    nx[k] = tb + k < t1 ? in[(o + tb + k) * ldi + c] : 0.0f;
#pragma unroll
                for (int k = 0; k < CONV_BATCH; k++) {
                    if (tb + k >= t1) break;
                    v[TAPS - 1] = nx[k];
                    u[(o + tb + k) * ldu + c] = conv_taps<F>(wc, bc, v);
#pragma unroll
                    for (int q = 0; q < TAPS - 1; q++) v[q] = v[q + 1];
                }
            }
        }
    }
}

/* Four blocks of 256 a multiprocessor (54 registers; unbounded, ptxas takes 80 and
 * three blocks fit): a quarter more loads in flight over the memory-bound pass. */
#define CONV_BOUNDS MB_BOUNDS_MIN(256, 4)
MB_KERNEL void CONV_BOUNDS mb_conv_silu_k(int64_t B, const int64_t *off, int64_t C,
                                          const float *in, int64_t ldi, const float *window,
                                          const float *w, const float *bias, float *u,
                                          int64_t ldu)
{
    conv_silu<mb_identical>(B, off, C, in, ldi, window, w, bias, u, ldu);
}

MB_KERNEL void CONV_BOUNDS mb_fast_conv_silu_k(int64_t B, const int64_t *off, int64_t C,
                                               const float *in, int64_t ldi, const float *window,
                                               const float *w, const float *bias, float *u,
                                               int64_t ldu)
{
    conv_silu<mb_fast>(B, off, C, in, ldi, window, w, bias, u, ldu);
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

/* One token per row: channel c of row b takes token x; the window's last three
 * inputs and the token make the taps, then the window moves on by one, unless the
 * session guard refused the step (keep false). The decode GEMVs run it in their
 * epilogue on in_proj's conv columns (gemm.cu, fast.cu), saving a kernel a step. */
template <class F>
MB_DEV void conv_step_one(int64_t b, int64_t c, float x, int64_t C, float *window,
                          const float *w, const float *bias, float *u, int64_t ldu, bool keep)
{
    float *win = window + (b * C + c) * TAPS;
    const float v[TAPS] = {win[1], win[2], win[3], x};
    u[b * ldu + c] = conv_taps<F>(w + c * TAPS, bias[c], v);
    if (keep) {
#pragma unroll
        for (int k = 0; k < TAPS; k++) win[k] = v[k];
    }
}

/* conv_step_one of every channel of B rows (row b of in is its token) */
template <class F>
MB_DEV void conv_step(int64_t B, int64_t C, const float *in, int64_t ldi, float *window,
                      const float *w, const float *bias, float *u, int64_t ldu,
                      const unsigned long long *guard)
{
    const bool keep = !mb_refused(guard);
    MB_GRID_LOOP(i, B * C) {
        const int64_t b = i / C, c = i % C;
        conv_step_one<F>(b, c, in[b * ldi + c], C, window, w, bias, u, ldu, keep);
    }
}

/* The conv-step arguments of the decode GEMVs (c0 and C: the conv channels are
 * columns [c0, c0 + C) of the output; window NULL: none). */
#define MB_CONV_EPI_ARGS                                                              \
    int64_t c0, int64_t C, float *window, const float *cw, const float *cb, float *u, int64_t ldu

/* The epilogue's part: output (m, n) when n is a conv column. */
template <class F>
MB_DEV void conv_epilogue(int64_t m, int64_t n, float v, bool keep, MB_CONV_EPI_ARGS)
{
    if (window && n >= c0 && n < c0 + C)
        conv_step_one<F>(m, n - c0, v, C, window, cw, cb, u, ldu, keep);
}

MB_KERNEL void mb_conv_step_k(int64_t B, int64_t C, const float *in, int64_t ldi, float *window,
                              const float *w, const float *bias, float *u, int64_t ldu,
                              const unsigned long long *guard)
{
    MB_GRID_WAIT();
    conv_step<mb_identical>(B, C, in, ldi, window, w, bias, u, ldu, guard);
}

MB_KERNEL void mb_fast_conv_step_k(int64_t B, int64_t C, const float *in, int64_t ldi,
                                   float *window, const float *w, const float *bias, float *u,
                                   int64_t ldu, const unsigned long long *guard)
{
    MB_GRID_WAIT();
    conv_step<mb_fast>(B, C, in, ldi, window, w, bias, u, ldu, guard);
}

#undef TAPS
#undef CONV_RUN
#undef CONV_BATCH
#undef CONV_BOUNDS
