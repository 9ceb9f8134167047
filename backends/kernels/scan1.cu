/* The Mamba-1 selective scan (SPEC 5 steps 4-6 after the projections), the GPU
 * twin of scan_block in reference/block1.c: serial over the row's tokens, the same
 * expressions in the same order. Lane n of a channel's NS lanes owns state n, so
 * the only serial dependence, h's fmaf, is one instruction per token; everything
 * else is spread over the tokens of a group of SG: delta (bias add and softplus) is
 * computed once per (token, channel) while staging, the lanes advance their states
 * over the group's tokens, leaving each token's h in shared memory, and lane q forms
 * y = dot(C, h) of token q as the serial chain over n = 0..15 (dot v1 exactly),
 * the D skip and the gate. A = -exp(A_log) is computed here. F is the numeric
 * mode's transcendentals (modes.h). In a decode session, a step refused by the
 * guard leaves h alone. */
#include "modes.h"

#define NS 16
#define SG 16 /* tokens per group: lane q finishes token q */
#define SCH 8 /* channels per block (blockDim = SCH * NS) */

/* Grid (x over channels / SCH, y over rows). xdbl rows are (dt_low (R) | B (16) |
 * C (16)). A group's inputs are staged in shared memory with coalesced loads: delta,
 * u and z of its SG tokens x SCH channels (thread tid takes token tid / SCH, channel
 * tid % SCH), and the tokens' B and C rows, which all channels share. Channels past
 * di run on a copy of the last one and store nothing, so every thread reaches every
 * barrier. */
template <class F>
MB_DEV void scan1(int64_t B, const int64_t *off, int64_t di, int64_t R, const float *dtp,
                  const float *dt_b, const float *u, const float *xz, const float *xdbl,
                  const float *A_log, const float *D, float *h, float *yi,
                  const unsigned long long *guard)
{
    __shared__ float hs[SCH][SG][NS + 1]; /* +1: lane q's reads of token q hit distinct banks */
    __shared__ float sdl[SCH][SG], su[SCH][SG], sz[SCH][SG];
    __shared__ float sB[SG][NS], sC[SG][NS + 1];
    const int64_t XR = R + 2 * NS;
    const int n = threadIdx.x % NS, k = threadIdx.x / NS;
    const int lq = threadIdx.x / SCH, lk = threadIdx.x % SCH; /* the staging split */
    const int64_t c0 = (int64_t)blockIdx.x * SCH, cl = c0 + k;
    const bool live = cl < di;
    const int64_t c = live ? cl : di - 1, lc = c0 + lk < di ? c0 + lk : di - 1;
    const float a = -F::exp(A_log[c * NS + n]);
    const float lbias = dt_b[lc], Dc = D[c];
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        float *hp = h + (b * di + c) * NS + n;
        float hn = *hp;
        const int64_t t1 = off[b + 1];
        for (int64_t g = off[b]; g < t1; g += SG) {
            const int ng = t1 - g < SG ? (int)(t1 - g) : SG;
            if (lq < ng) {
                const int64_t t = g + lq;
                sdl[lk][lq] = F::softplus(dtp[t * di + lc] + lbias);
                su[lk][lq] = u[t * di + lc];
                sz[lk][lq] = xz[t * 2 * di + di + lc];
            }
            for (int e = threadIdx.x; e < ng * 2 * NS; e += SCH * NS) {
                const int q = e / (2 * NS), m = e % (2 * NS);
                const float v = xdbl[(g + q) * XR + R + m];
                if (m < NS)
                    sB[q][m] = v;
                else
                    sC[q][m - NS] = v;
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < SG; i++) {
                if (i < ng) {
                    const float dl = sdl[k][i];
                    const float dA = F::exp(dl * a);
                    hn = fmaf(dA, hn, (dl * sB[i][n]) * su[k][i]);
                    hs[k][i][n] = hn;
                }
            }
            __syncthreads();
            if (n < ng) {
                float acc = 0.0f;
#pragma unroll
                for (int m = 0; m < NS; m++) acc = fmaf(sC[n][m], hs[k][n][m], acc);
                if (live) yi[(g + n) * di + c] = (acc + su[k][n] * Dc) * F::silu(sz[k][n]);
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
    MB_GRID_WAIT();
    scan1<mb_identical>(B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi, guard);
}

MB_KERNEL void mb_fast_scan1_k(MB_SCAN1_ARGS)
{
    MB_GRID_WAIT();
    scan1<mb_fast>(B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi, guard);
}

#undef MB_SCAN1_ARGS

#undef NS
#undef SG
#undef SCH
