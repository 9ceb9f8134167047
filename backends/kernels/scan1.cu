/* The Mamba-1 selective scan (SPEC 5 steps 4-6 after the projections), the GPU
 * twin of scan_block in reference/block1.c: serial over the row's tokens, the same
 * expressions in the same order. Lane n of a channel's NS lanes owns state n, so
 * the only serial dependence, h's fmaf, is one instruction per token; everything
 * else is spread over the tokens of a group of SG: delta (bias add and softplus) is
 * computed once per (token, channel) while staging, the lanes advance their states
 * over the group's tokens, leaving each token's h in shared memory, and lane q forms
 * y = dot(C, h) of token q as the serial chain over n = 0..15 (dot v1 exactly),
 * the D skip and the gate. A = -exp(A_log) is computed here. A group whose every
 * delta * A lies in [MB_EXP_LO, 0] (checked while staging: delta >= 0 and delta
 * times its channel's least A at or above MB_EXP_LO) takes exp's core, the same
 * bits in fewer instructions. Fast mode takes it too where mb_fast_scan1p_k does not
 * fit: with its core exp it measured faster than __expf's twin of it (2.50 against
 * 2.86 ms at W3). In a decode session, a step refused by the guard leaves h alone. */
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
    const float a = -mb_exp(A_log[c * NS + n]);
    const float lbias = dt_b[lc], Dc = D[c];
    float amin = 0.0f; /* the least A of the staged channel lc (-inf, NaN: never in range) */
    for (int m = 0; m < NS; m++) amin = fminf(amin, -mb_exp(A_log[lc * NS + m]));
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        float *hp = h + (b * di + c) * NS + n;
        float hn = *hp;
        const int64_t t1 = off[b + 1];
        for (int64_t g = off[b]; g < t1; g += SG) {
            const int ng = t1 - g < SG ? (int)(t1 - g) : SG;
            bool in_range = true;
            if (lq < ng) {
                const int64_t t = g + lq;
                const float dl = mb_softplus(dtp[t * di + lc] + lbias);
                sdl[lk][lq] = dl;
                su[lk][lq] = u[t * di + lc];
                sz[lk][lq] = xz[t * 2 * di + di + lc];
                in_range = dl >= 0.0f && dl * amin >= MB_EXP_LO;
            }
            for (int e = threadIdx.x; e < ng * 2 * NS; e += SCH * NS) {
                const int q = e / (2 * NS), m = e % (2 * NS);
                const float v = xdbl[(g + q) * XR + R + m];
                if (m < NS)
                    sB[q][m] = v;
                else
                    sC[q][m - NS] = v;
            }
            const bool core = __syncthreads_and(in_range);
            auto advance = [&](auto exp) {
                auto step = [&](int i, float dA) { /* token i, dA = exp(delta * A) */
                    hn = fmaf(dA, hn, (sdl[k][i] * sB[i][n]) * su[k][i]);
                    hs[k][i][n] = hn;
                };
                /* a whole group takes its exps first, as independent chains that
                 * interleave: at B 1 too few warps are resident to hide a step's
                 * latency */
                if (ng == SG) {
                    float e[SG];
#pragma unroll
                    for (int i = 0; i < SG; i++) e[i] = exp(sdl[k][i] * a);
#pragma unroll
                    for (int i = 0; i < SG; i++) step(i, e[i]);
                } else {
#pragma unroll
                    for (int i = 0; i < SG; i++)
                        if (i < ng) step(i, exp(sdl[k][i] * a));
                }
            };
            if (core)
                advance([](float x) { return mb_exp_core(x); });
            else
                advance([](float x) { return mb_exp(x); });
            __syncthreads();
            if (n < ng) {
                float acc = 0.0f;
#pragma unroll
                for (int m = 0; m < NS; m++) acc = fmaf(sC[n][m], hs[k][n][m], acc);
                if (live) yi[(g + n) * di + c] = (acc + su[k][n] * Dc) * mb_silu(sz[k][n]);
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
    scan1(B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi, guard);
}

/* numeric_mode="fast", a call of more than one token (any order may be taken):
 * four lanes per channel, each holding four of its 16 states in registers, so the
 * step is one fmaf per state and y = dot(C, h) a four-term sum per lane joined by
 * two shuffles; no shared-memory round trip of h. Per group of SP_G tokens the
 * block stages delta's input, u, z (SP_C channels) and the tokens' B and C rows in a
 * ring of SP_STAGES stages (cp.async, SP_STAGES - 1 groups ahead), then turns delta's
 * input into delta in place. Grid (x over channels / SP_C, y over rows). */
#define SP_C 32
#define SP_G 16
#define SP_STAGES 3
#define SP_THREADS (4 * SP_C)
#define SP_LD (SP_C + 4)

MB_KERNEL void MB_BOUNDS(SP_THREADS)
mb_fast_scan1p_k(MB_SCAN1_ARGS)
{
    __shared__ __align__(16) float sd[SP_STAGES][SP_G][SP_LD], su[SP_STAGES][SP_G][SP_LD];
    __shared__ __align__(16) float sz[SP_STAGES][SP_G][SP_LD], sbc[SP_STAGES][SP_G][2 * NS + 4];
    const int tid = threadIdx.x, q = tid % 4, k = tid / 4; /* channel k, states 4q..4q+3 */
    const int64_t XR = R + 2 * NS, c0 = (int64_t)blockIdx.x * SP_C, cl = c0 + k;
    const bool live = cl < di;
    const int64_t c = live ? cl : di - 1;
    float a[4];
#pragma unroll
    for (int j = 0; j < 4; j++) a[j] = -mb_fast::exp(A_log[c * NS + 4 * q + j]);
    const float Dc = D[c];
    const bool vd = (di & 3) == 0 && (((uintptr_t)dtp | (uintptr_t)u | (uintptr_t)xz) & 15) == 0;
    const bool vb = (XR & 3) == 0 && (R & 3) == 0 && ((uintptr_t)xdbl & 15) == 0;
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t t0 = off[b], t1 = off[b + 1];
        const int64_t groups = (t1 - t0 + SP_G - 1) / SP_G;
        float hv[4];
        float *hp = h + (b * di + c) * NS + 4 * q;
#pragma unroll
        for (int j = 0; j < 4; j++) hv[j] = hp[j];
#define SP_ISSUE(gi)                                                                   \
    {                                                                                 \
        const int st = (int)((gi) % SP_STAGES);                                       \
        const int64_t g = t0 + (gi) * SP_G;                                           \
        const int ng = t1 - g < SP_G ? (int)(t1 - g) : SP_G;                          \
        mb_stage_rows(&sd[st][0][0], SP_LD, dtp + g * di, di, ng, SP_C, c0, di, vd, tid, \
                      SP_THREADS);                                                    \
        mb_stage_rows(&su[st][0][0], SP_LD, u + g * di, di, ng, SP_C, c0, di, vd, tid,  \
                      SP_THREADS);                                                    \
        mb_stage_rows(&sz[st][0][0], SP_LD, xz + g * 2 * di + di, 2 * di, ng, SP_C, c0, di, \
                      vd, tid, SP_THREADS);                                           \
        mb_stage_rows(&sbc[st][0][0], 2 * NS + 4, xdbl + g * XR + R, XR, ng, 2 * NS, 0,  \
                      2 * NS, vb, tid, SP_THREADS);                                   \
    }
        __syncthreads(); /* the previous row's stages are consumed */
        for (int s = 0; s < SP_STAGES - 1; s++) {
            if (s < groups) SP_ISSUE(s)
            mb_cp_commit();
        }
        for (int64_t gi = 0; gi < groups; gi++) {
            const int st = (int)(gi % SP_STAGES);
            const int64_t g = t0 + gi * SP_G;
            const int ng = t1 - g < SP_G ? (int)(t1 - g) : SP_G;
            mb_cp_wait<SP_STAGES - 2>();
            __syncthreads(); /* stage gi landed; the stage refilled next was consumed */
            if (gi + SP_STAGES - 1 < groups) SP_ISSUE(gi + SP_STAGES - 1)
            mb_cp_commit();
            for (int e = tid; e < ng * SP_C; e += SP_THREADS) {
                const int tk = e / SP_C, ch = e % SP_C;
                const int64_t cc = c0 + ch < di ? c0 + ch : di - 1;
                sd[st][tk][ch] = mb_fast::softplus(sd[st][tk][ch] + dt_b[cc]);
            }
            __syncthreads();
            for (int i = 0; i < ng; i++) {
                const float dl = sd[st][i][k], du = dl * su[st][i][k];
                const float4 Bv = *(const float4 *)&sbc[st][i][4 * q];
                const float4 Cv = *(const float4 *)&sbc[st][i][NS + 4 * q];
                const float bv[4] = {Bv.x, Bv.y, Bv.z, Bv.w}, cv[4] = {Cv.x, Cv.y, Cv.z, Cv.w};
                float y = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    hv[j] = fmaf(mb_fast::exp(dl * a[j]), hv[j], du * bv[j]);
                    y = fmaf(cv[j], hv[j], y);
                }
                y += MB_SHFL_XOR(y, 1);
                y += MB_SHFL_XOR(y, 2);
                if (q == 0 && live)
                    yi[(g + i) * di + c] = (y + su[st][i][k] * Dc) * mb_fast::silu(sz[st][i][k]);
            }
        }
#undef SP_ISSUE
        if (live) {
#pragma unroll
            for (int j = 0; j < 4; j++) hp[j] = hv[j];
        }
    }
    mb_cp_wait<0>();
}

#undef SP_C
#undef SP_G
#undef SP_STAGES
#undef SP_THREADS
#undef SP_LD
#undef MB_SCAN1_ARGS

#undef NS
#undef SG
#undef SCH
