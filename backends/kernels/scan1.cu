/* The Mamba-1 selective scan (SPEC 5 steps 4-6 after the projections), the GPU
 * twin of scan_block in reference/block1.c: serial over the row's tokens, the same
 * expressions in the same order. Lane n of a channel's NS lanes owns state n, so
 * the only serial dependence, h's fmaf, is one instruction per token; everything
 * else is spread over the tokens of a group of SG: lane q computes delta (bias add
 * and softplus) for token q of the group, the lanes advance their states over the
 * group's tokens, leaving each token's h in shared memory, and lane q then forms
 * y = dot(C, h) of token q as the serial chain over n = 0..15 (dot v1 exactly),
 * the D skip and the gate. A = -exp(A_log) is computed here. F is the numeric
 * mode's transcendentals (modes.h). In a decode session, a step refused by the
 * guard leaves h alone. */
#include "modes.h"

#define NS 16
#define SG 16 /* tokens per group: lane q prepares and finishes token q */
#define SCH 8 /* channels per block (blockDim = SCH * NS) */

/* Grid (x over channels / SCH, y over rows). xdbl rows are (dt_low (R) | B (16) |
 * C (16)). Channels past di run on a copy of the last one and store nothing, so
 * every thread reaches every barrier. */
template <class F>
MB_DEV void scan1(int64_t B, const int64_t *off, int64_t di, int64_t R, const float *dtp,
                  const float *dt_b, const float *u, const float *xz, const float *xdbl,
                  const float *A_log, const float *D, float *h, float *yi,
                  const unsigned long long *guard)
{
    __shared__ float hs[SCH][SG][NS + 1]; /* +1: lane q's reads of token q hit distinct banks */
    __shared__ float sdl[SCH][SG], su[SCH][SG];
    const int64_t XR = R + 2 * NS;
    const int n = threadIdx.x % NS, k = threadIdx.x / NS;
    const int64_t cl = (int64_t)blockIdx.x * SCH + k;
    const bool live = cl < di;
    const int64_t c = live ? cl : di - 1;
    const float a = -F::exp(A_log[c * NS + n]);
    const float bias = dt_b[c], Dc = D[c];
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        float *hp = h + (b * di + c) * NS + n;
        float hn = *hp;
        const int64_t t1 = off[b + 1];
        for (int64_t g = off[b]; g < t1; g += SG) {
            const int ng = t1 - g < SG ? (int)(t1 - g) : SG;
            float uq = 0.0f, zq = 0.0f;
            if (n < ng) {
                const int64_t t = g + n;
                uq = u[t * di + c];
                zq = xz[t * 2 * di + di + c];
                sdl[k][n] = F::softplus(dtp[t * di + c] + bias);
                su[k][n] = uq;
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < SG; i++) {
                if (i < ng) {
                    const float dl = sdl[k][i];
                    const float bn = xdbl[(g + i) * XR + R + n];
                    const float dA = F::exp(dl * a);
                    hn = fmaf(dA, hn, (dl * bn) * su[k][i]);
                    hs[k][i][n] = hn;
                }
            }
            __syncthreads();
            if (n < ng) {
                const int64_t t = g + n;
                const float *Cv = xdbl + t * XR + R + NS;
                float acc = 0.0f;
#pragma unroll
                for (int m = 0; m < NS; m++) acc = fmaf(Cv[m], hs[k][n][m], acc);
                if (live) yi[t * di + c] = (acc + uq * Dc) * F::silu(zq);
            }
            __syncthreads();
        }
        if (live && !mb_refused(guard)) *hp = hn;
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
#undef SG
#undef SCH
