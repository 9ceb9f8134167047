/* The Mamba-1 selective scan (SPEC 5 steps 4-6 after the projections), the GPU
 * twin of scan_block in reference/block1.c: one thread per (row, channel),
 * serial over the row's tokens, h in registers, the same expressions in the same
 * order. delta's bias add and softplus, and A = -exp(A_log), happen here. */
#include "vendor.h"
#include "numerics.h"

#define NS 16

/* Grid (x over channels, y over rows). xdbl rows are (dt_low (R) | B (16) | C (16)). */
MB_KERNEL void mb_scan1_k(int64_t B, const int64_t *off, int64_t di, int64_t R,
                          const float *dtp, const float *dt_b, const float *u, const float *xz,
                          const float *xdbl, const float *A_log, const float *D, float *h,
                          float *yi)
{
    const int64_t XR = R + 2 * NS;
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        MB_GRID_LOOP(c, di) {
            float a[NS], hh[NS];
            float *hp = h + (b * di + c) * NS;
#pragma unroll
            for (int n = 0; n < NS; n++) {
                a[n] = -mb_exp(A_log[c * NS + n]);
                hh[n] = hp[n];
            }
            const float bias = dt_b[c], Dc = D[c];
            for (int64_t t = off[b]; t < off[b + 1]; t++) {
                const float dl = mb_softplus(dtp[t * di + c] + bias);
                const float uu = u[t * di + c], zz = xz[t * 2 * di + di + c];
                const float *Bv = xdbl + t * XR + R, *Cv = Bv + NS;
                float acc = 0.0f;
#pragma unroll
                for (int n = 0; n < NS; n++) {
                    const float dA = mb_exp(dl * a[n]);
                    const float dBu = (dl * Bv[n]) * uu;
                    const float hv = fmaf(dA, hh[n], dBu);
                    hh[n] = hv;
                    acc = fmaf(Cv[n], hv, acc);
                }
                yi[t * di + c] = (acc + uu * Dc) * mb_silu(zz);
            }
#pragma unroll
            for (int n = 0; n < NS; n++) hp[n] = hh[n];
        }
    }
}

#undef NS
