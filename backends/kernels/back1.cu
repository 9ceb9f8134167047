/* The Mamba-1 backward's own kernels, the GPU twin of reference/back1.c: every value
 * is produced by the same float operations in the same order (docs/numerics.md,
 * "Backward (Mamba-1)"), so only the schedule differs from the CPU's.
 *
 * The scan's gradient needs, per (row, channel c, state n), dh in reverse time and h
 * in forward time. mb_m1b_carry_k runs both recurrences alone (one thread per
 * (row, c, n)) and keeps their values at every M1B_TC-token chunk boundary; then
 * every chunk is independent: mb_m1b_chunk_k (one thread per (chunk, c)) recomputes
 * the chunk's dh from its carry and h from its carry (the same operations, so the
 * same bits) and produces every per-token piece that stays in the channel. The
 * reductions that cross channels or tokens read the chunk's h, dh and w = d loss /
 * d (delta A) from window buffers (a run of whole chunks in flat token order, sized
 * by the host): mb_m1b_fold_bc_k (dB, dC: chains over channels per token) and
 * mb_m1b_fold_a_k (A_log: chains over flat tokens per (c, n), continued from window
 * to window, cut into 8192-leaves that mb_m1b_alog_k joins). Window buffers are
 * indexed ((m - m0) 16 + n) di + c for flat token m of a window starting at m0, so
 * that a warp's channels meet in memory. */
#include "vendor.h"
#include "numerics.h"

#define NS 16
#define M1B_TC 32 /* tokens per chunk of the scan backward (any value gives the same bits) */

/* Step 5's state update (reference/block1.h mb_m1_h_next): h' = fma(dA, h, (delta B_n) u). */
MB_DEV float m1b_h_next(float dA, float h, float delta, float bn, float u)
{
    return fmaf(dA, h, (delta * bn) * u);
}

/* dt_proj's output plus bias (in place: spre), delta = softplus(spre) and dlu =
 * delta * u (dB's factor, rounded once as reference/back1.c's fold_bc rounds it). */
MB_KERNEL void mb_m1b_prep_k(int64_t M, int64_t di, float *dtp, const float *dt_b,
                             const float *u, float *delta, float *dlu)
{
    MB_GRID_LOOP(i, M * di) {
        const float s = dtp[i] + dt_b[i % di], dl = mb_softplus(s);
        dtp[i] = s;
        delta[i] = dl;
        dlu[i] = dl * u[i];
    }
}

/* dys = dyg * silu(z), z the second half of in_proj's output row. */
MB_KERNEL void mb_m1b_gate_k(int64_t M, int64_t di, const float *dyg, const float *xz, float *dys)
{
    MB_GRID_LOOP(i, M * di) {
        const int64_t m = i / di, c = i % di;
        dys[i] = dyg[i] * mb_silu(xz[m * 2 * di + di + c]);
    }
}

/* Grid (x over di * 16 threads, y over rows, z = 2). z = 0: dh_t = fma(dA_{t+1},
 * dh_{t+1}, C_t[n] dys_t) from the row's end (dA = dh = +0 past it); the carry
 * (dA, dh) of the token after chunk k lands at ck[((b nch + k) 2 + {0, 1}) di 16 +
 * c 16 + n]. z = 1: h from +0; the h entering chunk k lands at hk[(b nch + k) di 16
 * + c 16 + n]. */
MB_KERNEL void mb_m1b_carry_k(int64_t B, int64_t L, int64_t di, int64_t R, const float *delta,
                              const float *u, const float *dys, const float *xdbl,
                              const float *A_log, float *ck, float *hk)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, per = di * NS;
    if (i >= per) return;
    const int64_t c = i / NS, n = i % NS, XR = R + 2 * NS;
    const int64_t nch = (L + M1B_TC - 1) / M1B_TC;
    const float a = -mb_exp(A_log[i]);
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        if (blockIdx.z == 0) {
            float cA = 0.0f, cH = 0.0f;
            for (int64_t k = nch - 1; k >= 0; k--) {
                float *p = ck + (b * nch + k) * 2 * per + i;
                p[0] = cA;
                p[per] = cH;
                if (k == 0) break;
                const int64_t t1 = (k + 1) * M1B_TC < L ? (k + 1) * M1B_TC : L;
                for (int64_t t = t1 - 1; t >= k * M1B_TC; t--) {
                    const int64_t m = b * L + t;
                    const float dA = mb_exp(delta[m * di + c] * a);
                    cH = fmaf(cA, cH, xdbl[m * XR + R + NS + n] * dys[m * di + c]);
                    cA = dA;
                }
            }
        } else {
            float h = 0.0f;
            for (int64_t k = 0; k < nch; k++) {
                hk[(b * nch + k) * per + i] = h;
                if (k == nch - 1) break;
                for (int64_t t = k * M1B_TC; t < (k + 1) * M1B_TC; t++) {
                    const int64_t m = b * L + t;
                    const float dl = delta[m * di + c];
                    h = m1b_h_next(mb_exp(dl * a), h, dl, xdbl[m * XR + R + n], u[m * di + c]);
                }
            }
        }
    }
}

/* Grid (x over channels, y over the window's chunks j0 + y). Chunk j is row j / nch,
 * tokens [k TC, min((k + 1) TC, L)) with k = j % nch. Per token and channel, as
 * reference/back1.c token_fwd and token_out: h advanced, y's chain over n (acc), the
 * chains sA = sum w A and sB = sum dh B over n ascending, then yg, dz (into dxz's
 * second half, stride 2 di), ds (before dt_proj's bias and softplus) and the scan's
 * part of du. H, DH, WV: the window buffers (WV holds dA between the two sweeps). */
MB_KERNEL void mb_m1b_chunk_k(int64_t L, int64_t di, int64_t R, int64_t j0, int64_t nj,
                              int64_t m0, const float *delta, const float *u, const float *xz,
                              const float *xdbl, const float *spre, const float *dyg,
                              const float *dys, const float *A_log, const float *D,
                              const float *ck, const float *hk, float *H, float *DH, float *WV,
                              float *yg, float *dxz, float *ds, float *dus)
{
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= di) return;
    const int64_t XR = R + 2 * NS, per = di * NS, nch = (L + M1B_TC - 1) / M1B_TC;
    float a[NS];
#pragma unroll
    for (int n = 0; n < NS; n++) a[n] = -mb_exp(A_log[c * NS + n]);
    const float Dc = D[c];
    for (int64_t jj = blockIdx.y; jj < nj; jj += gridDim.y) {
        const int64_t j = j0 + jj, b = j / nch, k = j % nch;
        const int64_t t0 = k * M1B_TC, t1 = t0 + M1B_TC < L ? t0 + M1B_TC : L;
        float v[NS], x[NS];
        const float *p = ck + (b * nch + k) * 2 * per + c * NS;
#pragma unroll
        for (int n = 0; n < NS; n++) {
            v[n] = p[n];
            x[n] = p[per + n];
        }
        for (int64_t t = t1 - 1; t >= t0; t--) {
            const int64_t m = b * L + t, w = (m - m0) * per + c;
            const float dl = delta[m * di + c], dy = dys[m * di + c];
            const float *Cv = xdbl + m * XR + R + NS;
#pragma unroll
            for (int n = 0; n < NS; n++) {
                const float dA = mb_exp(dl * a[n]);
                x[n] = fmaf(v[n], x[n], Cv[n] * dy);
                v[n] = dA;
                WV[w + n * di] = dA;
                DH[w + n * di] = x[n];
            }
        }
        const float *hp0 = hk + (b * nch + k) * per + c * NS;
#pragma unroll
        for (int n = 0; n < NS; n++) v[n] = hp0[n];
        for (int64_t t = t0; t < t1; t++) {
            const int64_t m = b * L + t, w = (m - m0) * per + c, e = m * di + c;
            const float dl = delta[e], uu = u[e];
            const float *Bv = xdbl + m * XR + R, *Cv = Bv + NS;
            float acc = 0.0f, sA = 0.0f, sB = 0.0f;
#pragma unroll
            for (int n = 0; n < NS; n++) {
                const float dA = WV[w + n * di], dh = DH[w + n * di], hp = v[n], bn = Bv[n];
                const float hn = m1b_h_next(dA, hp, dl, bn, uu);
                v[n] = hn;
                H[w + n * di] = hn;
                acc = fmaf(Cv[n], hn, acc);
                const float wv = (dh * hp) * dA;
                WV[w + n * di] = wv;
                sA = fmaf(wv, a[n], sA);
                sB = fmaf(dh, bn, sB);
            }
            const float z = xz[m * 2 * di + di + c];
            const float y1 = acc + uu * Dc;
            yg[e] = y1 * mb_silu(z);
            dxz[m * 2 * di + di + c] = (dyg[e] * y1) * mb_dsilu(z);
            ds[e] = (sA + sB * uu) * mb_sigmoid(spre[e]);
            dus[e] = sB * dl;
        }
    }
}

/* Tokens [m0, m0 + nm), one thread per (token, n): dB[n] = dot v1 over channels of
 * dh[c][n] * dlu[c], dC[n] = dot v1 over channels of dys[c] * h[c][n], into dxdbl's B
 * and C columns. */
MB_KERNEL void mb_m1b_fold_bc_k(int64_t di, int64_t R, int64_t m0, int64_t nm, const float *dlu,
                                const float *dys, const float *H, const float *DH, float *dxdbl)
{
    const int64_t XR = R + 2 * NS;
    MB_GRID_LOOP(i, nm * NS) {
        const int64_t r = i / NS, n = i % NS, m = m0 + r;
        const float *du = dlu + m * di, *dy = dys + m * di;
        const float *h = H + (r * NS + n) * di, *dh = DH + (r * NS + n) * di;
        mb_dot_tree tB, tC;
        tB.top = tC.top = 0;
        float oB = 0.0f, oC = 0.0f;
        for (int64_t s = 0; s < di; s += MB_DOT_LEAF) {
            const int64_t e = s + MB_DOT_LEAF < di ? s + MB_DOT_LEAF : di;
            const float aB = mb_chain_run<true>(0.0f, e - s, dh + s, 1, du + s, 1);
            const float aC = mb_chain_run<true>(0.0f, e - s, dy + s, 1, h + s, 1);
            if (di <= MB_DOT_LEAF) {
                oB = aB;
                oC = aC;
            } else {
                mb_dot_tree_push(&tB, aB);
                mb_dot_tree_push(&tC, aC);
            }
        }
        if (di > MB_DOT_LEAF) {
            oB = mb_dot_tree_sum(&tB);
            oC = mb_dot_tree_sum(&tC);
        }
        dxdbl[m * XR + R + n] = oB;
        dxdbl[m * XR + R + NS + n] = oC;
    }
}

/* One thread per (n, c): A_log's chain g = fma(w_t, delta_t, g) over the window's
 * flat tokens [m0, m1), continuing the chain of leaf m0 / 8192 from leaves (unless a
 * leaf starts at m0) and leaving each leaf's value at leaves[p di 16 + c 16 + n]. */
MB_KERNEL void mb_m1b_fold_a_k(int64_t di, int64_t m0, int64_t m1, const float *delta,
                               const float *WV, float *leaves)
{
    const int64_t per = di * NS;
    MB_GRID_LOOP(i, per) {
        const int64_t c = i % di, o = c * NS + i / di;
        float g = m0 % MB_DOT_LEAF == 0 ? 0.0f : leaves[(m0 / MB_DOT_LEAF) * per + o];
        for (int64_t m = m0; m < m1;) {
            if (m > m0 && m % MB_DOT_LEAF == 0) {
                leaves[(m / MB_DOT_LEAF - 1) * per + o] = g;
                g = 0.0f;
            }
            const int64_t e = (m / MB_DOT_LEAF + 1) * MB_DOT_LEAF < m1 ?
                              (m / MB_DOT_LEAF + 1) * MB_DOT_LEAF : m1;
            g = mb_chain_run<true>(g, e - m, WV + (m - m0) * per + i, per, delta + m * di + c, di);
            m = e;
        }
        leaves[((m1 - 1) / MB_DOT_LEAF) * per + o] = g;
    }
}

/* dA_log[c][n] = (the join of the P leaves) * A, A = -exp(A_log). */
MB_KERNEL void mb_m1b_alog_k(int64_t per, int64_t P, const float *leaves, const float *A_log,
                             float *gA)
{
    MB_GRID_LOOP(i, per) gA[i] = mb_dot_fold(P, leaves + i, per) * -mb_exp(A_log[i]);
}

/* du = (x_proj's + the scan's) + the D skip's. */
MB_KERNEL void mb_m1b_du_k(int64_t M, int64_t di, float *dux, const float *dus,
                           const float *dys, const float *D)
{
    MB_GRID_LOOP(i, M * di) dux[i] = (dux[i] + dus[i]) + dys[i] * D[i % di];
}

#undef NS
