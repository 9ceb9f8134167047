/* Mamba-2 (SSD) backward: the VJP of a zero-state prefill of B rows of L tokens,
 * differentiating the chunked SSD as block2.c computes it (chunks of Q on the grid
 * from position 0). docs/numerics.md "Backward (Mamba-2)" gives every order.
 *
 * Phases: the forward (block2.c, keeping its activations and the state entering each
 * chunk); out_proj, gated norm and gate backward (per token); the SSD backward per
 * (row, head), serial over chunks in reverse, leaving per-head pieces of dB and dC;
 * their sum over heads per token; conv backward; in_proj and block norm backward;
 * the weight gradients as folds over the tokens. */
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "mamba_ref.h"
#include "numerics.h"
#include "gemm.h"
#include "ops.h"
#include "grad.h"
#include "block2.h"
#include "fpenv.h"
#include "scratch.h"
#include "simd.h"

#define NS MB_M2_NS
#define HP MB_M2_HP
#define CQ MB_M2_Q
#define TAPS 4

typedef struct {
    const mb_m2_weights *w;
    int64_t B, L, nk, di, H, CD, NP;
    const m2_acts *a;
    const float *dY;                 /* (M, di) gradient of Y before the gate */
    float *du;                       /* (M, CD) gradient of u */
    float *dzxd;                     /* (M, NP): the SSD writes the dt columns */
    float *ddA, *dts;                /* (M, H) gradient of dA, and dt */
    float *dGh, *dCoff, *dBst;       /* (M, H, Q), (M, H, NS), (M, H, NS) per-head pieces */
} bctx;

#define TR MB_M2_TR
#define MM MB_ISA_FN(mb_m2_mm64)

/* Row strides of the chunk's scratch matrices: a column walk at a power-of-two stride
 * would fall in a few cache sets. */
#define LDM (CQ + 16) /* (CQ, CQ) and (HP, CQ) */
#define LDC (NS + 16) /* the chunk's copy of C */

/* Per-thread scratch of the SSD backward, in floats. */
#define BSCR (CQ * LDM + HP * LDM + CQ * LDC + 4 * CQ * HP + 4 * NS * HP + 2 * CQ * NS \
              + 2 * TR * CQ + 12 * CQ)

/* The tile's rows i0 + r (r < R) of seg's gradient: dA[m] gets row i's prefix of dseg
 * below m (seg[i][j] holds dA[j+1..i]), the rows' prefix chains interleaved and each
 * sacc[m] taking them in ascending row order. */
static inline __attribute__((always_inline)) void seg_prefix(const int R, int64_t i0,
                                                             const float *dsg, float *sacc)
{
    float pre[TR];
    for (int r = 0; r < R; r++) pre[r] = 0.0f;
    for (int64_t m = 1; m <= i0; m++) {
        float sa = sacc[m];
        for (int r = 0; r < R; r++) {
            pre[r] = pre[r] + dsg[r * CQ + m - 1];
            sa = sa + pre[r];
        }
        sacc[m] = sa;
    }
    for (int64_t m = i0 + 1; m < i0 + R; m++) {
        float sa = sacc[m];
        for (int r = (int)(m - i0); r < R; r++) {
            pre[r] = pre[r] + dsg[r * CQ + m - 1];
            sa = sa + pre[r];
        }
        sacc[m] = sa;
    }
}

/* One (row, head): every chunk from the last to the first, dh the gradient of the
 * state leaving the chunk under work. */
static void ssd_bwd(const bctx *c, int64_t b, int64_t h, float *scr)
{
    const mb_m2_weights *w = c->w;
    const int64_t L = c->L, nk = c->nk, di = c->di, H = c->H, CD = c->CD, NP = c->NP;
    const float A = -mb_exp(w->A_log[h]), bias = w->dt_bias[h], Dh = w->D[h];
    float *Mf = scr, *XdT = Mf + CQ * LDM, *Cc = XdT + HP * LDM, *Xd = Cc + CQ * LDC;
    float *dyo = Xd + CQ * HP, *dXd = dyo + CQ * HP, *tmpv = dXd + CQ * HP, *hP = tmpv + CQ * HP;
    float *dh = hP + HP * NS, *dhP = dh + NS * HP, *dhn = dhP + HP * NS;
    float *Bd = dhn + NS * HP, *dBd = Bd + CQ * NS, *dMt = dBd + CQ * NS, *dsg = dMt + TR * CQ;
    float *dt = dsg + TR * CQ, *dA = dt + CQ, *cs = dA + CQ, *ev = cs + CQ, *s = ev + CQ;
    float *sacc = s + CQ, *dcs = sacc + CQ, *tmp = dcs + CQ, *vpre = tmp + CQ;
    float *dec = vpre + CQ, *live = dec + CQ, *dots = live + CQ;
    memset(dh, 0, NS * HP * sizeof(float));

    for (int64_t k = nk - 1; k >= 0; k--) {
        const int64_t n = L - k * CQ < CQ ? L - k * CQ : CQ, t0 = b * L + k * CQ;
        const int folded = k < nk - 1;
        const float *u = c->a->u + t0 * CD, *dtr = c->a->zxd + t0 * NP + di + CD + h;
        const float *G = c->a->G + t0 * CQ, *dY = c->dY + t0 * di + h * HP;
        const float *hprev = c->a->hck + ((b * H + h) * nk + k) * NS * HP;

        /* the forward's per-chunk values, as chunk_prep computes them */
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            vpre[i] = dtr[i * NP] + bias;
            const float sp = mb_softplus(vpre[i]);
            live[i] = (sp < w->dt_lo || sp > w->dt_hi) ? 0.0f : 1.0f;
            dt[i] = mb_clamp(sp, w->dt_lo, w->dt_hi);
            dA[i] = dt[i] * A;
            acc = acc + dA[i];
            cs[i] = acc;
            ev[i] = mb_exp(cs[i]);
        }
        for (int64_t i = 0; i < n; i++) {
            for (int p = 0; p < HP; p++) Xd[i * HP + p] = u[i * CD + h * HP + p] * dt[i];
            memcpy(Cc + i * LDC, u + i * CD + di + NS, NS * sizeof(float));
        }
        mb_transpose_tile(n, HP, Xd, HP, XdT, LDM);
        mb_transpose_tile(NS, HP, hprev, HP, hP, NS);

        /* per tile of output rows: dM, dG, dseg, the Y_off terms. Chains that run past
         * their last live term (j > i here, i < j in dXd and dB) meet +0 entries:
         * from a +0 seed those leave every bit as skipping them would. */
        for (int64_t j = 0; j < n; j++) sacc[j] = 0.0f;
        for (int64_t i0 = 0; i0 < n; i0 += TR) {
            const int R = n - i0 < TR ? (int)(n - i0) : TR;
            for (int64_t jb = 0; jb < i0 + R; jb += HP)
                MM(R, HP, dY + i0 * di, di, 1, XdT + jb, LDM, dMt + jb, CQ);
            MM(R, NS, Cc + i0 * LDC, LDC, 1, hprev, HP, tmpv, HP); /* C_i . h_prev */
            mb_dot_rows(R, HP, dY + i0 * di, di, tmpv, HP, dcs + i0, 1);
            for (int r = 0; r < R; r++) {
                const int64_t i = i0 + r;
                const float *dYi = dY + i * di, *Gi = G + i * CQ, *dMi = dMt + r * CQ;
                for (int64_t j = 0; j < i; j++) s[j] = s[j] + dA[i];
                s[i] = 0.0f;
                float *dg = c->dGh + ((t0 + i) * H + h) * CQ, *mf = Mf + i * LDM, *ds = dsg + r * CQ;
                for (int64_t j = 0; j <= i; j += MB_VW) {
                    const int nn = i + 1 - j < MB_VW ? (int)(i + 1 - j) : MB_VW;
                    const mb_vf lm = mb_vexp(mb_vldn(s + j, nn)), g = mb_vldn(Gi + j, nn);
                    const mb_vf dm = mb_vldn(dMi + j, nn);
                    mb_vstn(mf + j, mb_vmul(g, lm), nn);
                    mb_vstn(dg + j, mb_vmul(dm, lm), nn);
                    mb_vstn(ds + j, mb_vmul(mb_vmul(dm, g), lm), nn);
                }
                for (int64_t j = i + 1; j < n; j++) mf[j] = 0.0f;
                dcs[i] = dcs[i] * ev[i];
                float *dyr = dyo + i * HP;
                for (int p = 0; p < HP; p++) dyr[p] = dYi[p] * ev[i];
            }
            if (R == TR)
                seg_prefix(TR, i0, dsg, sacc);
            else
                seg_prefix(R, i0, dsg, sacc);
            float *dco = c->dCoff + ((t0 + i0) * H + h) * NS;
            MM(R, HP, dyo + i0 * HP, HP, 1, hP, NS, dco, H * NS);
            MM(R, HP, dyo + i0 * HP, HP, 1, hP + HP, NS, dco + HP, H * NS);
        }
        /* dXd[j] = sum over i >= j of M[i][j] dY[i] */
        for (int64_t j0 = 0; j0 < n; j0 += TR)
            MM(n - j0 < TR ? (int)(n - j0) : TR, n - j0, Mf + j0 * LDM + j0, 1, LDM, dY + j0 * di, di,
               dXd + j0 * HP, HP);
        /* the chunk's fold h = fma(exp(cs_last), h_prev, Bd^T . Xd), when its result is used */
        float E = 0.0f;
        if (folded) {
            const float last = cs[n - 1];
            E = mb_exp(last);
            mb_transpose_tile(NS, HP, dh, HP, dhP, NS);
            float T = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const float *Bj = u + j * CD + di;
                dec[j] = mb_exp(last - cs[j]);
                for (int m = 0; m < NS; m++) Bd[j * NS + m] = Bj[m] * dec[j];
            }
            for (int64_t j0 = 0; j0 < n; j0 += TR) {
                const int R = n - j0 < TR ? (int)(n - j0) : TR;
                MM(R, NS, Bd + j0 * NS, NS, 1, dh, HP, tmpv, HP);
                for (int r = 0; r < R; r++)
                    for (int p = 0; p < HP; p++)
                        dXd[(j0 + r) * HP + p] = dXd[(j0 + r) * HP + p] + tmpv[r * HP + p];
                MM(R, HP, Xd + j0 * HP, HP, 1, dhP, NS, dBd + j0 * NS, NS);
                MM(R, HP, Xd + j0 * HP, HP, 1, dhP + HP, NS, dBd + j0 * NS + HP, NS);
            }
            mb_dot_rows(n, NS, dBd, NS, u + di, CD, tmp, 1);
            for (int64_t j = 0; j < n; j++) {
                const float *dBj = dBd + j * NS;
                float *dbs = c->dBst + ((t0 + j) * H + h) * NS;
                tmp[j] = tmp[j] * dec[j];
                for (int m = 0; m < NS; m++) dbs[m] = dBj[m] * dec[j];
            }
            for (int64_t j = 0; j < n; j++) {
                dcs[j] = dcs[j] - tmp[j];
                T = T + tmp[j];
            }
            dcs[n - 1] = (dcs[n - 1] + T) + mb_dot(NS * HP, dh, 1, hprev, 1) * E;
        }
        /* dA: the cumsum's part (suffix sums of dcs) then seg's */
        float suf = 0.0f;
        for (int64_t i = n - 1; i >= 0; i--) {
            suf = suf + dcs[i];
            tmp[i] = suf + sacc[i];
        }
        mb_dot_rows(n, HP, dXd, HP, u + h * HP, CD, dots, 1);
        for (int64_t i = 0; i < n; i++) {
            const float *dYi = dY + i * di, *dXi = dXd + i * HP;
            float *dx = c->du + (t0 + i) * CD + h * HP;
            for (int p = 0; p < HP; p++) dx[p] = dYi[p] * Dh + dXi[p] * dt[i];
            const float ddt = dots[i] + tmp[i] * A;
            const float g = vpre[i] <= 20.0f ? ddt * mb_sigmoid(vpre[i]) : ddt;
            c->dzxd[(t0 + i) * NP + di + CD + h] = live[i] != 0.0f ? g : 0.0f;
            c->ddA[(t0 + i) * H + h] = tmp[i];
            c->dts[(t0 + i) * H + h] = dt[i];
        }
        /* gradient of the state entering the chunk */
        if (k > 0) {
            for (int m0 = 0; m0 < NS; m0 += TR)
                MM(NS - m0 < TR ? NS - m0 : TR, n, Cc + m0, 1, LDC, dyo, HP, dhn + m0 * HP, HP);
            if (folded)
                for (int i = 0; i < NS * HP; i++) dh[i] = fmaf(E, dh[i], dhn[i]);
            else
                memcpy(dh, dhn, NS * HP * sizeof(float));
        }
    }
}

/* dB and dC of one chunk's rows: the head sum of dG, contracted with C (for dB) or B
 * (for dC), then the heads' state pieces added in ascending order. */
static void bc_combine(const bctx *c, int64_t b, int64_t k, float *dGs)
{
    const int64_t L = c->L, H = c->H, CD = c->CD, di = c->di;
    const int64_t n = L - k * CQ < CQ ? L - k * CQ : CQ, t0 = b * L + k * CQ;
    const int folded = k < c->nk - 1;
    const float *u = c->a->u + t0 * CD;
    for (int64_t i = 0; i < n; i++) {
        float *o = dGs + i * LDM;
        for (int64_t j = 0; j < n; j++) o[j] = 0.0f; /* +0 past the diagonal: see ssd_bwd */
        for (int64_t h = 0; h < H; h++) {
            const float *g = c->dGh + ((t0 + i) * H + h) * CQ;
            for (int64_t j = 0; j <= i; j++) o[j] = o[j] + g[j];
        }
    }
    for (int64_t i0 = 0; i0 < n; i0 += TR) {
        const int R = n - i0 < TR ? (int)(n - i0) : TR;
        float *dC = c->du + (t0 + i0) * CD + di + NS;
        MM(R, i0 + R, dGs + i0 * LDM, LDM, 1, u + di, CD, dC, CD);
        MM(R, i0 + R, dGs + i0 * LDM, LDM, 1, u + di + HP, CD, dC + HP, CD);
        for (int r = 0; r < R; r++)
            for (int64_t h = 0; h < H; h++) {
                const float *p = c->dCoff + ((t0 + i0 + r) * H + h) * NS;
                for (int m = 0; m < NS; m++) dC[r * CD + m] = dC[r * CD + m] + p[m];
            }
    }
    for (int64_t j0 = 0; j0 < n; j0 += TR) {
        const int R = n - j0 < TR ? (int)(n - j0) : TR;
        const float *C0 = u + j0 * CD + di + NS;
        float *dB = c->du + (t0 + j0) * CD + di;
        MM(R, n - j0, dGs + j0 * LDM + j0, 1, LDM, C0, CD, dB, CD);
        MM(R, n - j0, dGs + j0 * LDM + j0, 1, LDM, C0 + HP, CD, dB + HP, CD);
        if (folded)
            for (int r = 0; r < R; r++)
                for (int64_t h = 0; h < H; h++) {
                    const float *p = c->dBst + ((t0 + j0 + r) * H + h) * NS;
                    for (int m = 0; m < NS; m++) dB[r * CD + m] = dB[r * CD + m] + p[m];
                }
    }
}

int MB_ISA_FN(mb_m2_backward)(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                              const float *dy, const mb_m2_grads *gr)
{
    const int64_t dm = w->d_model, di = 2 * dm, H = di / HP, CD = di + 2 * NS, NP = di + CD + H;
    const int64_t M = B * L, nk = (L + CQ - 1) / CQ, nth = mb_max_threads();
    const int64_t bscr = (BSCR + 15) & ~(int64_t)15;
    /* sizes of every buffer, in floats, in allocation order; each a whole number of
     * cache lines */
    const int64_t sz[] = {
        B * CD * TAPS + B * H * HP * NS + B * CQ * CD + B * CQ * H, /* fresh state */
        M * NP, M * CD, M * CD, M * CQ, M * di, B * H * nk * NS * HP, /* activations */
        M * dm,                                                  /* forward output, then dxn */
        M * di, M * di, M * di, M * di,                          /* g, gn / dg, dgn / dY, xr */
        M * NP, M * CD, 2 * M * H,                               /* dzxd, du, ddA + dts */
        M * H * CQ, 2 * M * H * NS,                              /* per-head pieces */
        nth * bscr,                                              /* per-thread scratch */
        M * dm, M * dm,                                          /* xn, xr */
    };
    enum { NB = sizeof sz / sizeof sz[0] };
    int64_t total = 0, at[NB];
    for (int i = 0; i < NB; i++) {
        at[i] = total;
        total += (sz[i] + 15) & ~(int64_t)15;
    }
    float *buf = mb_scratch_take((size_t)total);
    int64_t *cnt = calloc((size_t)B, sizeof *cnt);
    if (!buf || !cnt) {
        mb_scratch_give(buf);
        free(cnt);
        return MB_ENOMEM;
    }
    float *p[NB];
    for (int i = 0; i < NB; i++) p[i] = buf + at[i];
    memset(p[0], 0, (size_t)sz[0] * sizeof(float));
    const mb_m2_state st = {p[0], p[0] + B * CD * TAPS, p[0] + B * CD * TAPS + B * H * HP * NS,
                            p[0] + B * CD * TAPS + B * H * HP * NS + B * CQ * CD, cnt};
    const m2_acts acts = {p[1], p[2], p[3], p[4], p[5], p[6]};
    float *yf = p[7], *g = p[8], *gn = p[9], *dgn = p[10], *xr2 = p[11];
    float *dzxd = p[12], *du = p[13], *ddA = p[14];
    float *dts = ddA + M * H, *dGh = p[15], *dCoff = p[16], *dBst = dCoff + M * H * NS;
    float *scr = p[17], *xn = p[18], *xr = p[19];

    int rc = MB_ISA_FN(mb_m2_acts)(w, B, L, x, &st, yf, &acts);
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        free(cnt);
        return rc;
    }

    /* out_proj: dW = dy^T . gn over the tokens; dgn = dy . W */
    #pragma omp parallel for schedule(static) if (M * di > (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        mb_fpenv env = mb_fpenv_enter();
        const float *Y = acts.Y + m * di, *z = acts.zxd + m * NP;
        for (int64_t j = 0; j < di; j++) g[m * di + j] = Y[j] * mb_silu(z[j]);
        mb_fpenv_exit(env);
    }
    MB_ISA_FN(mb_rmsnorm_rows)(M, di, g, di, w->norm_w, gn, di);
    rc = MB_ISA_FN(mb_linear_bwd)(M, dm, di, gn, di, w->out_proj, di, dy, dm, gr->out_proj, dgn, di);
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        free(cnt);
        return rc;
    }

    /* gated norm, then the gate: dY = dg * silu(z), dz = (dg * Y) * silu'(z) */
    float *dg = gn; /* gn is dead now */
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, di, g, di, w->norm_w, dgn, di, dg, di, xr2, di);
    MB_ISA_FN(mb_colfold)(B, L, di, dgn, di, xr2, di, 0, gr->norm_w, 1);
    float *dY = dgn;
    #pragma omp parallel for schedule(static) if (M * di > (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        mb_fpenv env = mb_fpenv_enter();
        const float *Y = acts.Y + m * di, *z = acts.zxd + m * NP, *d = dg + m * di;
        for (int64_t j = 0; j < di; j++) { /* silu and silu' from one exp(-z) */
            const float e1 = 1.0f + mb_exp(-z[j]), s = 1.0f / e1;
            dzxd[m * NP + j] = (d[j] * Y[j]) * (s * (1.0f + z[j] * (1.0f - s)));
            dY[m * di + j] = d[j] * (z[j] / e1);
        }
        mb_fpenv_exit(env);
    }

    /* the SSD, per (row, head); then dB and dC per chunk */
    const bctx c = {w, B, L, nk, di, H, CD, NP, &acts, dY, du, dzxd, ddA, dts, dGh, dCoff, dBst};
    #pragma omp parallel if (B * H > 1)
    {
        mb_fpenv env = mb_fpenv_enter();
        float *q = scr + mb_thread_num() * bscr;
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * H; task++)
            ssd_bwd(&c, task / H, task % H, q);
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * nk; task++)
            bc_combine(&c, task / nk, task % nk, q);
        mb_fpenv_exit(env);
    }

    /* per-head vectors: D over (token, p), A_log and dt_bias over tokens */
    #pragma omp parallel for schedule(dynamic) if (M * H > (1 << 12))
    for (int64_t h = 0; h < H; h++) {
        mb_fpenv env = mb_fpenv_enter();
        gr->D[h] = MB_ISA_FN(mb_fold_flat)(M, HP, dY + h * HP, di, acts.u + h * HP, CD);
        mb_fpenv_exit(env);
    }
    MB_ISA_FN(mb_colfold)(B, L, H, ddA, H, dts, H, 0, gr->A_log, 1);
    for (int64_t h = 0; h < H; h++) gr->A_log[h] = gr->A_log[h] * -mb_exp(w->A_log[h]);
    MB_ISA_FN(mb_colfold)(B, L, H, dzxd + di + CD, NP, NULL, 0, 0, gr->dt_bias, 1);

    /* conv + silu: dpre = du * silu'(pre), in place; d(xBC) into dzxd */
    MB_ISA_FN(mb_conv_silu_bwd)(B, L, CD, du, CD, acts.pre, CD, acts.zxd + di, NP, w->conv_w,
                                gr->conv_w, gr->conv_b, dzxd + di, NP);

    /* in_proj: dW = dzxd^T . xn over the tokens; dxn = dzxd . W */
    MB_ISA_FN(mb_rmsnorm_rows)(M, dm, x, dm, w->block_norm_w, xn, dm);
    float *dxn = yf;
    rc = MB_ISA_FN(mb_linear_bwd)(M, NP, dm, xn, dm, w->in_proj, dm, dzxd, NP, gr->in_proj, dxn, dm);
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        free(cnt);
        return rc;
    }

    /* block norm and the residual: dx = dx_norm + dy */
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, dm, x, dm, w->block_norm_w, dxn, dm, gr->x, dm, xr, dm);
    MB_ISA_FN(mb_colfold)(B, L, dm, dxn, dm, xr, dm, 0, gr->block_norm_w, 1);
    for (int64_t i = 0; i < M * dm; i++) gr->x[i] = gr->x[i] + dy[i];
    mb_scratch_give(buf);
    free(cnt);
    return MB_OK;
}
