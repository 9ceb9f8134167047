/* The Mamba-1 selective scan (SPEC 5 steps 4-6 after the projections), the GPU
 * twin of scan_block in reference/block1.c: serial over the row's tokens, the same
 * expressions in the same order. Each channel is spread over LANES adjacent lanes,
 * each holding NS / LANES states in registers; y = dot(C, h) is then the serial
 * chain over n = 0..15 with every term fetched from its lane by a shuffle, which
 * spells dot v1 exactly. delta's bias add and softplus, and A = -exp(A_log), are
 * computed here (every lane of a channel computes the same bits). F is the numeric
 * mode's transcendentals (modes.h). In a decode session, a step refused by the
 * guard leaves h alone. */
#include "modes.h"

#define NS 16
#define LANES 4
#define PER (NS / LANES)

/* Grid (x over channels * LANES threads, y over rows); blockDim a multiple of 32.
 * xdbl rows are (dt_low (R) | B (16) | C (16)). */
template <class F>
MB_DEV void scan1(int64_t B, const int64_t *off, int64_t di, int64_t R, const float *dtp,
                  const float *dt_b, const float *u, const float *xz, const float *xdbl,
                  const float *A_log, const float *D, float *h, float *yi,
                  const unsigned long long *guard)
{
    const int64_t XR = R + 2 * NS;
    const int q = threadIdx.x % LANES;
    /* Channels past di run on a copy of the last one (the shuffles need every
     * lane) and store nothing. */
    const int64_t cl = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const bool live = cl < di;
    const int64_t c = live ? cl : di - 1;
    float a[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) a[j] = -F::exp(A_log[c * NS + q * PER + j]);
    const float bias = dt_b[c], Dc = D[c];
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        float *hp = h + (b * di + c) * NS + q * PER;
        float hh[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) hh[j] = hp[j];
        /* The next token's inputs are loaded while this one computes: the loop
         * carries only h, so memory latency need not stall it. */
        float in[3 + PER + NS], nx[3 + PER + NS];
#define MB_SCAN_LOAD(v, t)                                                            \
    {                                                                                 \
        const float *Bv = xdbl + (t) * XR + R;                                         \
        v[0] = dtp[(t) * di + c];                                                      \
        v[1] = u[(t) * di + c];                                                        \
        v[2] = xz[(t) * 2 * di + di + c];                                              \
        _Pragma("unroll") for (int j = 0; j < PER; j++) v[3 + j] = Bv[q * PER + j];    \
        _Pragma("unroll") for (int n = 0; n < NS; n++) v[3 + PER + n] = Bv[NS + n];    \
    }
        const int64_t t0 = off[b], t1 = off[b + 1];
        if (t0 < t1) MB_SCAN_LOAD(nx, t0)
        for (int64_t t = t0; t < t1; t++) {
#pragma unroll
            for (int i = 0; i < 3 + PER + NS; i++) in[i] = nx[i];
            if (t + 1 < t1) MB_SCAN_LOAD(nx, t + 1)
            const float dl = F::softplus(in[0] + bias);
            const float uu = in[1];
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const float dA = F::exp(dl * a[j]);
                const float dBu = (dl * in[3 + j]) * uu;
                hh[j] = fmaf(dA, hh[j], dBu);
            }
            float acc = 0.0f;
#pragma unroll
            for (int n = 0; n < NS; n++)
                acc = fmaf(in[3 + PER + n], MB_SHFL(hh[n % PER], n / PER, LANES), acc);
            if (q == 0 && live)
                yi[t * di + c] = (acc + uu * Dc) * F::silu(in[2]);
        }
#undef MB_SCAN_LOAD
        if (live && !mb_refused(guard))
#pragma unroll
            for (int j = 0; j < PER; j++) hp[j] = hh[j];
    }
}

#define MB_SCAN1_ARGS                                                                 \
    int64_t B, const int64_t *off, int64_t di, int64_t R, const float *dtp, const float *dt_b, \
        const float *u, const float *xz, const float *xdbl, const float *A_log, const float *D, \
        float *h, float *yi, const unsigned long long *guard

MB_KERNEL void mb_scan1_k(MB_SCAN1_ARGS)
{
    scan1<mb_identical>(B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi, guard);
}

MB_KERNEL void mb_fast_scan1_k(MB_SCAN1_ARGS)
{
    scan1<mb_fast>(B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi, guard);
}

#undef MB_SCAN1_ARGS

#undef NS
#undef LANES
#undef PER
