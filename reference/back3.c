/* Mamba-3 SISO backward: the vector-Jacobian product of a zero-state prefill, in the
 * order docs/numerics.md "Backward (Mamba-3)" writes down.
 *
 * Per (row, head): a forward pass fills the whole row's q, k, v, dt, sig, A*dt and
 * angles with the forward's own functions (block3.h) and folds the chunks, keeping the
 * state entering each one; a reverse pass over the chunks recomputes each chunk's
 * outputs (again the forward's function) and differentiates them, carrying dh from
 * chunk to chunk; a reverse pass over the tokens then collects the angle, dt, sig and
 * A gradients. Cross-head sums (B, C, angles) and the weight folds come after. */
#include <string.h>
#include "threads.h"
#include "mamba_ref.h"
#include "numerics.h"
#include "gemm.h"
#include "grad.h"
#include "fpenv.h"
#include "block3.h"
#include "simd.h"
#include "scratch.h"

#define MM MB_ISA_FN(mb_m3_mm)
#define PF 4 /* rows the gate prefetches ahead */

/* Per-thread chunk scratch past the forward's S_TOTAL, in floats. */
enum {
    B_DY = S_TOTAL,              /* dy of the chunk rows (QCAP, PV), before the gate */
    B_DYE = B_DY + QCAP * PV,    /* dy * exp(cs) */
    B_VT = B_DYE + QCAP * PV,    /* v^T (PV, QCAP), padded */
    B_DG = B_VT + PV * QCAP,     /* dP, then dG (QCAP, QCAP) */
    B_W = B_DG + QCAP * QCAP,    /* dseg, then its inclusive row prefix sums */
    B_KS = B_W + QCAP * QCAP,    /* scaled k (QCAP, NQK) */
    B_T1 = B_KS + QCAP * NQK,    /* two (QCAP, NQK) products */
    B_T2 = B_T1 + QCAP * NQK,
    B_P1 = B_T2 + QCAP * NQK,    /* three (QCAP, PV) products */
    B_P2 = B_P1 + QCAP * PV,
    B_P3 = B_P2 + QCAP * PV,
    B_HPN = B_P3 + QCAP * PV,    /* h (PV, NQK) entering the chunk */
    B_DHT = B_HPN + PV * NQK,    /* dh^T (NQK, PV) leaving the chunk */
    B_DHPN = B_DHT + NQK * PV,   /* dh (PV, NQK) */
    B_DHIN = B_DHPN + PV * NQK,  /* dh^T entering the chunk */
    B_VEC = B_DHIN + NQK * PV,   /* six QCAP vectors */
    B_TOTAL = B_VEC + 6 * QCAP
};

typedef struct {
    m3_ctx c;
    int64_t L, M;
    const float *dyg;   /* (M, di) gradient of the gated output */
    float *dzx;         /* (M, dip) gradient of in_proj's output */
    float *dQ, *dK;     /* (H, M, NQK) gradients of the biased, unrotated q and k */
    float *dTA;         /* (H, M, NA) gradient of tanh(angle) * PI, per head */
    float *dQKG;        /* (M, H) gradient of qk_gamma (= of D, per token) */
    const float *zin;   /* (H, 2, M) per head the A and dt columns of in_proj's output */
    float *gz;          /* (H, 3, M) per head their gradients and the trap column's */
} m3_bctx;

/* Per-thread row arrays for one head, in floats. */
static int64_t row_floats(int64_t L)
{
    const int64_t nc = (L + CQ - 1) / CQ;
    return 2 * (L + 1) * NQK + (L + 1) * PV + 3 * (L + 1) + L * 2 * NA + 4 * L
        + 2 * L * NQK + 2 * nc * NQK * PV + 2 * nc;
}

typedef struct {
    float *q, *k, *v, *dt, *sig, *adt, *rot, *qkg, *dsc, *dadt, *dqr, *dkr, *hs;
    float *fv;            /* per row: F_j of dadt */
    float *dhs, *cl, *f0; /* per chunk: dh^T leaving it, cs_last, F0 */
} m3_rows;

static m3_rows carve(float *p, int64_t L)
{
    const int64_t nc = (L + CQ - 1) / CQ;
    m3_rows r;
    r.q = p; p += (L + 1) * NQK;
    r.k = p; p += (L + 1) * NQK;
    r.v = p; p += (L + 1) * PV;
    r.dt = p; p += L + 1;
    r.sig = p; p += L + 1;
    r.adt = p; p += L + 1;
    r.rot = p; p += L * 2 * NA;
    r.qkg = p; p += L;
    r.dsc = p; p += L;
    r.dadt = p; p += L;
    r.dqr = p; p += L * NQK;
    r.dkr = p; p += L * NQK;
    r.fv = p; p += L;
    r.dhs = p; p += nc * NQK * PV;
    r.cl = p; p += nc;
    r.f0 = p; p += nc;
    r.hs = p;
    return r;
}

static m3_head view(const m3_rows *r, int64_t c0)
{
    m3_head hv = {r->q + c0 * NQK, r->k + c0 * NQK, r->v + c0 * PV, r->dt + c0, r->sig + c0,
                  r->adt + c0, NQK, PV, 1, r->rot + c0 * 2 * NA};
    return hv;
}

/* W[i][j] = W[i][j - 1] + W[i][j] for 0 < j < i < n, each row's chain in ascending j,
 * eight rows interleaved. */
static void row_prefix(int64_t n, float *W)
{
    for (int64_t i0 = 1; i0 < n; i0 += 8) {
        const int R = n - i0 < 8 ? (int)(n - i0) : 8;
        for (int64_t j = 1; j < i0 + R - 1; j++)
            for (int r = 0; r < R; r++)
                if (j < i0 + r)
                    W[(i0 + r) * QCAP + j] = W[(i0 + r) * QCAP + j - 1] + W[(i0 + r) * QCAP + j];
    }
}

/* The F terms of dadt for the chunks with a fold (chunks [0, nc - 1)): F0 = (dh^T
 * leaving the chunk . h^T entering it) * exp(cs_last), the chains of several chunks
 * interleaved; then dadt_l = (dadt_l + F0) + sum_{j<l} F_j. */
static void dadt_tail(const m3_rows *r, int64_t nc)
{
    mb_dot_rows(nc - 1, NQK * PV, r->dhs, NQK * PV, r->hs, NQK * PV, r->f0, 1);
    for (int64_t ci = 0; ci + 1 < nc; ci++) {
        const float F0 = r->f0[ci] * mb_exp(r->cl[ci]);
        const float *Fv = r->fv + ci * CQ;
        float *da = r->dadt + ci * CQ, pf = 0.0f;
        for (int64_t l = 0; l < CQ; l++) {
            float d = da[l] + F0;
            if (l > 0) {
                pf = pf + Fv[l - 1];
                d = d + pf;
            }
            da[l] = d;
        }
    }
}

/* Gradients of one chunk of n rows at row c0 (token tok = tok0 + c0), after
 * mb_m3_chunk_out left cs, G, Lm, Mm and Ys in s. dh^T leaving the chunk is in
 * s + B_DHT when has_dh; when need_in, dh^T entering it is left in s + B_DHT. */
static void chunk_bwd(const m3_bctx *g, const m3_rows *r, int64_t h, int64_t c0, int64_t n,
                      int64_t tok, const float *hT, int has_dh, int need_in, float *s)
{
    const m3_ctx *c = &g->c;
    const m3_head hv = view(r, c0);
    const int64_t H = c->H, di = c->di, dip = c->dip;
    const float *cs = s + S_CS, *G = s + S_G, *Lm = s + S_LM, *Mm = s + S_MM, *Ys = s + S_YS;
    float *dy = s + B_DY, *dye = s + B_DYE, *vT = s + B_VT, *dG = s + B_DG, *W = s + B_W;
    float *ks = s + B_KS, *T1 = s + B_T1, *T2 = s + B_T2;
    float *P1 = s + B_P1, *P2 = s + B_P2, *P3 = s + B_P3;
    float *hPN = s + B_HPN, *dhT = s + B_DHT, *dhPN = s + B_DHPN, *dhin = s + B_DHIN;
    float *ev = s + B_VEC, *av = ev + QCAP, *dec = av + QCAP, *Fv = dec + QCAP;
    float *Rv = Fv + QCAP, *sc = Rv + QCAP;
    const float *q = hv.q, *k = hv.k, *v = hv.v;
    const float Dh = c->w->D[h];

    /* the gate: dy = dyg * silu(z), dz = (dyg * ypre) * silu'(z), both from one
     * exp(-z); dqk_gamma = dy . v */
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = tok + i;
        const float *z = c->zx + t * dip + h * PV, *dg = g->dyg + t * di + h * PV;
        const float *yp = c->ypre + t * di + h * PV;
        float *dz = g->dzx + t * dip + h * PV, *d = dy + i * PV;
        if (i + PF < n) /* rows a stride apart: beyond the hardware prefetcher */
            for (int l = 0; l < PV; l += 16) {
                __builtin_prefetch(z + PF * dip + l);
                __builtin_prefetch(dg + PF * di + l);
                __builtin_prefetch(yp + PF * di + l);
                __builtin_prefetch(dz + PF * dip + l, 1);
            }
        for (int p = 0; p < PV; p++) {
            const float e1 = 1.0f + mb_exp(-z[p]), sg = 1.0f / e1;
            d[p] = dg[p] * (z[p] / e1);
            dz[p] = (dg[p] * yp[p]) * (sg * (1.0f + z[p] * (1.0f - sg)));
        }
        ev[i] = mb_exp(cs[i]);
        for (int p = 0; p < PV; p++)
            dye[i * PV + p] = d[p] * ev[i];
    }
    mb_dot_rows(n, PV, dy, PV, v, PV, g->dQKG + tok * H + h, H);
    mb_dot_rows(n, PV, dy, PV, Ys, PV, av, 1);
    for (int64_t i = 0; i < n; i++)
        av[i] = av[i] * ev[i];
    /* the scales; the last row's is only used by the fold (the next chunk's beta) */
    for (int64_t j = 0; j < n; j++) {
        sc[j] = j + 1 < n || has_dh ? scale_of(&hv, j) : 0.0f;
        for (int m = 0; m < NQK; m++)
            ks[j * NQK + m] = k[j * NQK + m] * sc[j];
    }
    /* dP_ij = dy_i . v_j (j < i); dseg = (dP * G) * Lm; dG = dP * Lm */
    const int64_t nj = n - 1;
    if (nj > 0) {
        const int64_t pad = UP16(nj);
        for (int p = 0; p < PV; p++) {
            for (int64_t j = 0; j < nj; j++)
                vT[p * QCAP + j] = v[j * PV + p];
            for (int64_t j = nj; j < pad; j++)
                vT[p * QCAP + j] = 0.0f;
        }
        for (int64_t a = 1; a < n; a += 16) {
            const int64_t b = a + 16 < n ? a + 16 : n;
            MM(b - a, UP16(b - 1), PV, 0, dy + a * PV, PV, 1, vT, QCAP, dG + a * QCAP, QCAP);
        }
        for (int64_t i = 1; i < n; i++)
            for (int64_t j = 0; j < i; j++) {
                const int64_t ij = i * QCAP + j;
                W[ij] = (dG[ij] * G[ij]) * Lm[ij];
                dG[ij] = dG[ij] * Lm[ij];
            }
    }

    /* dq_rot_i = dye_i . h + sum_{j<i} dG_ij ks_j */
    mb_transpose_tile(NQK, PV, hT, PV, hPN, NQK);
    MM(n, NQK, PV, 0, dye, PV, 1, hPN, NQK, T1, NQK);
    MM(n, NQK, 0, 1, dG, QCAP, 1, ks, NQK, T2, NQK);
    for (int64_t i = 0; i < n; i++)
        for (int m = 0; m < NQK; m++)
            r->dqr[(c0 + i) * NQK + m] = T1[i * NQK + m] + T2[i * NQK + m];

    /* the chunk's fold into the next state: dvd = dh . ks_j, ddec = dvd . v_j */
    const float cl = cs[n - 1];
    if (has_dh) {
        mb_transpose_tile(NQK, PV, dhT, PV, dhPN, NQK);
        for (int64_t j = 0; j < n; j++) {
            dec[j] = mb_exp(cl - cs[j]);
            for (int p = 0; p < PV; p++)
                P3[j * PV + p] = v[j * PV + p] * dec[j]; /* vd, as the fold */
        }
        MM(n, PV, NQK, 0, ks, NQK, 1, dhT, PV, P2, PV);      /* dvd */
        MM(n, NQK, PV, 0, P3, PV, 1, dhPN, NQK, T1, NQK);    /* fold part of dks */
        mb_dot_rows(n, PV, P2, PV, v, PV, Fv, 1);
        for (int64_t j = 0; j < n; j++)
            Fv[j] = Fv[j] * dec[j];
    }

    /* dks_j = sum_{i>j} dG_ij q_i (i descending) [+ fold part]; dsc_j = dks_j . k_j */
    MM(n, NQK, 0, 1, dG + (n - 1) * QCAP + (n - 1), -1, -QCAP, q + (n - 1) * NQK, -NQK,
       T2 + (n - 1) * NQK, -NQK);
    if (has_dh)
        for (int64_t i = 0; i < n * NQK; i++)
            T2[i] = T2[i] + T1[i];
    mb_dot_rows(n, NQK, T2, NQK, k, NQK, r->dsc + c0, 1);
    for (int64_t j = 0; j < n; j++)
        for (int m = 0; m < NQK; m++)
            r->dkr[(c0 + j) * NQK + m] = T2[j * NQK + m] * sc[j];

    /* dv_j = sum_{i>j} Mm_ij dy_i (i descending), + (D + qk_gamma_j) dy_j, + dvd_j dec_j */
    MM(n, PV, 0, 1, Mm + (n - 1) * QCAP + (n - 1), -1, -QCAP, dy + (n - 1) * PV, -PV,
       P1 + (n - 1) * PV, -PV);
    for (int64_t j = 0; j < n; j++) {
        const float dq = Dh + r->qkg[c0 + j];
        float *dv = g->dzx + (tok + j) * dip + di + h * PV;
        if (j + PF < n)
            for (int l = 0; l < PV; l += 16) __builtin_prefetch(dv + PF * dip + l, 1);
        for (int p = 0; p < PV; p++) {
            float d = P1[j * PV + p] + dq * dy[j * PV + p];
            if (has_dh)
                d = d + P2[j * PV + p] * dec[j];
            dv[p] = d;
        }
    }

    /* dadt_l = ((sum_{i>=l} a_i + sum_{i>=l, j<l} dseg_ij) + F0) + sum_{j<l} F_j, the
     * terms with F left to dadt_tail (F0's chain runs with the other chunks') */
    row_prefix(n, W);
    for (int64_t l = 0; l < n; l++)
        Rv[l] = 0.0f;
    for (int64_t i = 1; i < n; i++)
        for (int64_t l = 1; l <= i; l++)
            Rv[l] = Rv[l] + W[i * QCAP + l - 1];
    float sa = 0.0f;
    for (int64_t l = n - 1; l >= 0; l--) {
        sa = sa + av[l];
        r->dadt[c0 + l] = sa + Rv[l];
    }
    r->cl[c0 / CQ] = cl;
    if (has_dh) {
        memcpy(r->fv + c0, Fv, n * sizeof(float));
        memcpy(r->dhs + c0 / CQ * NQK * PV, dhT, NQK * PV * sizeof(float));
    }

    /* dh^T entering: sum_i q_i dye_i^T (+ exp(cs_last) dh^T leaving) */
    if (need_in) {
        MM(NQK, PV, n, 0, q, 1, NQK, dye, PV, dhin, PV);
        if (has_dh) {
            const float e = mb_exp(cl);
            for (int i = 0; i < NQK * PV; i++)
                dhT[i] = fmaf(e, dhT[i], dhin[i]);
        } else {
            memcpy(dhT, dhin, NQK * PV * sizeof(float));
        }
    }
}

/* Token t of row b (packed index tok0 + t), head h: q, k, angle, dt, sig and A
 * gradients, given dot(q, k) (qk), th . ta (tad) and the angle gradient th. */
static void token_bwd(const m3_bctx *g, const m3_rows *rr, int64_t h, int64_t tok0, int64_t t,
                      const float *Cn, const float *Bn, float qk, float tad, const float *th)
{
    const m3_ctx *c = &g->c;
    const m3_rows r = *rr;
    const int64_t H = c->H, M = g->M, m = tok0 + t;
    const float *Cb = c->w->C_bias + h * NQK, *Bb = c->w->B_bias + h * NQK;
    const float *dq = r.dqr + t * NQK, *dk = r.dkr + t * NQK;
    const float *cs = r.rot + t * 2 * NA, *sn = cs + NA;
    /* unrotate, then qk_gamma = dot(q, k) * gamma on the biased, unrotated q, k */
    const float dt = r.dt[t], sig = r.sig[t], gam = dt * sig;
    const float dqkg = g->dQKG[m * H + h], dacc = dqkg * gam;
    float *oq = g->dQ + (h * M + m) * NQK, *ok = g->dK + (h * M + m) * NQK;
    for (int a = 0; a < NA; a++) {
        oq[2 * a] = dq[2 * a] * cs[a] + dq[2 * a + 1] * sn[a];
        oq[2 * a + 1] = dq[2 * a + 1] * cs[a] - dq[2 * a] * sn[a];
        ok[2 * a] = dk[2 * a] * cs[a] + dk[2 * a + 1] * sn[a];
        ok[2 * a + 1] = dk[2 * a + 1] * cs[a] - dk[2 * a] * sn[a];
    }
    memcpy(oq + 2 * NA, dq + 2 * NA, (NQK - 2 * NA) * sizeof(float));
    memcpy(ok + 2 * NA, dk + 2 * NA, (NQK - 2 * NA) * sizeof(float));
    for (int i = 0; i < NQK; i++) {
        oq[i] = oq[i] + dacc * (Bn[i] + Bb[i]);
        ok[i] = ok[i] + dacc * (Cn[i] + Cb[i]);
    }
    /* gamma_t = dt sig feeds scale_t and qk_gamma; beta_{t-1} = dt (1 - sig) */
    const float dgam = r.dsc[t] + dqkg * qk, da = r.dadt[t];
    const float *zi = g->zin + h * 2 * M;
    const float x = zi[m], Araw = m3_heavy_tail(x);
    const float A = Araw > -A_FLOOR ? -A_FLOOR : Araw;
    float ddt = dgam * sig, dsig = dgam * dt;
    if (t > 0) {
        ddt = ddt + r.dsc[t - 1] * (1.0f - sig);
        dsig = dsig - r.dsc[t - 1] * dt;
    }
    ddt = ddt + A * da;
    ddt = ddt + tad;
    float *dta = g->dTA + (h * M + m) * NA;
    for (int a = 0; a < NA; a++)
        dta[a] = th[a] * dt;
    float *gz = g->gz + h * 3 * M;
    const float u = zi[M + m] + c->w->dt_bias[h];
    gz[m] = u <= 20.0f ? ddt * mb_sigmoid(u) : ddt;
    gz[M + m] = (dsig * sig) * (1.0f - sig);
    /* A = -(x >= 0 ? 1 + x : 1 / (1 - x)), floored: no gradient where the floor binds */
    const float dA = da * dt;
    float dx = 0.0f;
    if (!(Araw > -A_FLOOR)) {
        const float f = 1.0f / (1.0f - x);
        dx = x >= 0.0f ? -dA : -(dA * (f * f));
    }
    gz[2 * M + m] = dx;
}

/* Row b, head h: forward pass, reverse pass over the chunks, reverse pass over tokens. */
static void head_bwd(const m3_bctx *g, int64_t b, int64_t h, float *s, float *rowbuf)
{
    const m3_ctx *c = &g->c;
    const int64_t L = g->L, tok0 = b * L, nc = (L + CQ - 1) / CQ;
    m3_rows r = carve(rowbuf, L);
    r.dt[L] = r.sig[L] = r.adt[L] = 0.0f;
    float theta[NA] = {0.0f};
    for (int64_t ci = 0; ci < nc; ci++) {
        const int64_t c0 = ci * CQ, n = L - c0 < CQ ? L - c0 : CQ;
        const m3_head hv = view(&r, c0);
        MB_ISA_FN(mb_m3_put_rows)(c, &hv, h, tok0 + c0, 0, n, theta, s);
        memcpy(r.qkg + c0, s + S_QKG, n * sizeof(float));
    }
    memset(r.hs, 0, NQK * PV * sizeof(float));
    for (int64_t ci = 0; ci + 1 < nc; ci++) {
        const int64_t c0 = ci * CQ;
        const m3_head hv = view(&r, c0);
        MB_ISA_FN(mb_m3_fold)(&hv, CQ, beta_of(r.dt[c0 + CQ], r.sig[c0 + CQ]),
                              r.hs + ci * NQK * PV, r.hs + (ci + 1) * NQK * PV, s);
    }
    for (int64_t ci = nc - 1; ci >= 0; ci--) {
        const int64_t c0 = ci * CQ, n = L - c0 < CQ ? L - c0 : CQ;
        const m3_head hv = view(&r, c0);
        const float *hT = r.hs + ci * NQK * PV;
        memcpy(s + S_QKG, r.qkg + c0, n * sizeof(float));
        MB_ISA_FN(mb_m3_chunk_out)(c, &hv, h, 0, n, tok0 + c0, hT, s);
        chunk_bwd(g, &r, h, c0, n, tok0 + c0, hT, ci + 1 < nc, ci > 0, s);
    }

    if (nc > 1)
        dadt_tail(&r, nc);

    /* tokens in reverse, eight at a time: the angle gradient accumulates backwards
     * through the steps; dot(q, k) on the biased, unrotated q and k, and th . ta, run
     * the eight tokens' chains at once (tokens before the first repeat it) */
    float th[NA] = {0.0f}, thb[8][NA];
    const float *Cb = c->w->C_bias + h * NQK, *Bb = c->w->B_bias + h * NQK;
    for (int64_t t1 = L; t1 > 0; t1 -= 8) {
        const int64_t t0 = t1 - 8;
        for (int64_t t = t1 - 1; t >= t0 && t >= 0; t--) {
            const float *qr = r.q + t * NQK, *kr = r.k + t * NQK;
            const float *dq = r.dqr + t * NQK, *dk = r.dkr + t * NQK;
            for (int a = 0; a < NA; a++) {
                const float lq = dq[2 * a + 1] * qr[2 * a] - dq[2 * a] * qr[2 * a + 1];
                const float lk = dk[2 * a + 1] * kr[2 * a] - dk[2 * a] * kr[2 * a + 1];
                th[a] = th[a] + (lq + lk);
            }
            memcpy(thb[t - t0], th, sizeof th);
        }
        const float *Cn[8], *Bn[8], *ta[8], *tr[8];
        float acc[8], ad[8];
        for (int u = 0; u < 8; u++) {
            const int v = t0 + u >= 0 ? u : (int)-t0;
            Cn[u] = c->Cn + (tok0 + t0 + v) * NQK;
            Bn[u] = c->Bn + (tok0 + t0 + v) * NQK;
            ta[u] = c->ta + (tok0 + t0 + v) * NA;
            tr[u] = thb[v];
            acc[u] = ad[u] = 0.0f;
        }
        for (int i = 0; i < NQK; i++)
            for (int u = 0; u < 8; u++)
                acc[u] = fmaf(Cn[u][i] + Cb[i], Bn[u][i] + Bb[i], acc[u]);
        for (int a = 0; a < NA; a++)
            for (int u = 0; u < 8; u++)
                ad[u] = fmaf(tr[u][a], ta[u][a], ad[u]);
        for (int64_t t = t0 < 0 ? 0 : t0; t < t1; t++) {
            const int u = (int)(t - t0);
            token_bwd(g, &r, h, tok0, t, Cn[u], Bn[u], acc[u], ad[u], thb[u]);
        }
    }
}

int MB_ISA_FN(mb_m3_backward)(const mb_m3_weights *w, int64_t B, int64_t L, const float *x,
                              const float *kept, const float *dy, const mb_m3_grads *gr)
{
    const int64_t dm = w->d_model, di = 2 * dm, H = di / PV, M = B * L;
    const int64_t dip = 2 * di + 2 * NQK + 3 * H + NA;
    const int64_t oB = 2 * di, oC = oB + NQK, oDT = oC + NQK, oANG = oDT + 3 * H;
    int nth = mb_max_threads();
    const int64_t per = B_TOTAL + row_floats(L);
    /* dxn, xr (M dm), dzx (M dip), dBn, dCn, Bxr, Cxr (M NQK), dQKG (M H), yg, ypre,
     * dyg (M di), dQ, dK (H M NQK), dTA (H M NA), zin, gz (M H 2, M H 3), and the
     * projections unless kept */
    const int64_t total = M * (2 * dm + dip + 4 * NQK + H + 3 * di + 2 * H * NQK + H * NA
                               + 5 * H) + (kept ? 0 : m3_proj_floats(dm, M));
    float *buf = mb_scratch_take((size_t)(total + nth * per));
    if (!buf)
        return MB_ENOMEM;
    float *scr = buf + total;
    for (int i = 0; i < nth; i++) /* finite scratch rows, as the forward's */
        memset(scr + i * per, 0, B_TOTAL * sizeof(float));
    float *dxn = buf, *xr = dxn + M * dm, *dzx = xr + M * dm, *dBn = dzx + M * dip;
    float *dCn = dBn + M * NQK, *Bxr = dCn + M * NQK, *Cxr = Bxr + M * NQK;
    float *dQKG = Cxr + M * NQK, *yg = dQKG + M * H, *ypre = yg + M * di, *dyg = ypre + M * di;
    float *dQ = dyg + M * di, *dK = dQ + M * H * NQK, *dTA = dK + M * H * NQK;
    float *zin = dTA + M * H * NA, *gz = zin + 2 * M * H;
    m3_proj p;
    m3_proj_carve(&p, kept ? (float *)kept : gz + 3 * M * H, dm, M);
    if (!kept)
        MB_ISA_FN(mb_m3_project)(w, M, x, &p);
    const float *xn = p.xn, *zx = p.zx;

    /* dyg = dy . out_proj (dot v1 over dm) */
    if (!MB_ISA_FN(mb_gemm_kn)(M, di, dm, dy, dm, 1, w->out_proj, di, dyg, di)) {
        mb_scratch_give(buf);
        return MB_ENOMEM;
    }

    /* the A and dt columns per head, for the heads' passes over the tokens */
    const int64_t oA = oDT + H, oTR = oA + H;
    #pragma omp parallel for schedule(static) if (M * H > (1 << 12))
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < H; h++) {
            zin[h * 2 * M + m] = zx[m * dip + oA + h];
            zin[h * 2 * M + M + m] = zx[m * dip + oDT + h];
        }
    m3_bctx g = {{w, NULL, NULL, H, di, dip, 0, 0, zx, p.Bn, p.Cn, p.dt, p.sig, p.adt, p.ta, yg,
                  ypre},
                 L, M, dyg, dzx, dQ, dK, dTA, dQKG, zin, gz};
    #pragma omp parallel if (B * H > 1)
    {
        mb_fpenv env = mb_fpenv_enter();
        int tid = mb_thread_num();
        float *s = scr + (int64_t)tid * per;
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * H; task++)
            head_bwd(&g, task / H, task % H, s, s + B_TOTAL);
        mb_fpenv_exit(env);
    }

    /* per token: the heads' q, k and angle gradients summed over h ascending, from +0 */
    #pragma omp parallel if (M * H > 64)
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *dc = dCn + m * NQK, *db = dBn + m * NQK, dta[NA];
            for (int i = 0; i < NQK; i++)
                dc[i] = db[i] = 0.0f;
            for (int a = 0; a < NA; a++)
                dta[a] = 0.0f;
            for (int64_t h = 0; h < H; h++) {
                const float *q = dQ + (h * M + m) * NQK, *k = dK + (h * M + m) * NQK;
                const float *an = dTA + (h * M + m) * NA;
                for (int i = 0; i < NQK; i++) {
                    dc[i] = dc[i] + q[i];
                    db[i] = db[i] + k[i];
                }
                for (int a = 0; a < NA; a++)
                    dta[a] = dta[a] + an[a];
            }
            /* ta = tanh(angle) * PI */
            const float *an = zx + m * dip + oANG;
            float *o = dzx + m * dip + oANG, *dz = dzx + m * dip;
            for (int a = 0; a < NA; a++) {
                const float th = mb_tanh(an[a]);
                o[a] = (dta[a] * MB_PI) * (1.0f - th * th);
            }
            for (int64_t h = 0; h < H; h++) {
                dz[oDT + h] = gz[h * 3 * M + m];
                dz[oTR + h] = gz[h * 3 * M + M + m];
                dz[oA + h] = gz[h * 3 * M + 2 * M + m];
            }
        }
        mb_fpenv_exit(env);
    }
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, NQK, zx + oB, dip, w->B_norm_w, dBn, NQK, dzx + oB, dip,
                                   Bxr, NQK, NULL, 0);
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, NQK, zx + oC, dip, w->C_norm_w, dCn, NQK, dzx + oC, dip,
                                   Cxr, NQK, NULL, 0);

    /* in_proj and out_proj: folds over the tokens; dxn = dzx . in_proj over dip */
    int rc = MB_ISA_FN(mb_linear_bwd)(M, dip, dm, xn, dm, w->in_proj, dm, dzx, dip,
                                      gr->in_proj, dxn, dm);
    if (rc == MB_OK)
        rc = MB_ISA_FN(mb_linear_bwd)(M, dm, di, yg, di, w->out_proj, di, dy, dm,
                                      gr->out_proj, NULL, 0);
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        return rc;
    }
    /* the block norm; dx = dy + the norm's dx */
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, dm, x, dm, w->norm_w, dxn, dm, gr->x, dm, xr, dm, dy, dm);
    MB_ISA_FN(mb_colfold)(B, L, dm, dxn, dm, xr, dm, 0, gr->norm_w, 1);
    MB_ISA_FN(mb_colfold)(B, L, NQK, dBn, NQK, Bxr, NQK, 0, gr->B_norm_w, 1);
    MB_ISA_FN(mb_colfold)(B, L, NQK, dCn, NQK, Cxr, NQK, 0, gr->C_norm_w, 1);
    for (int64_t h = 0; h < H; h++) {
        MB_ISA_FN(mb_colfold)(B, L, NQK, dK + h * M * NQK, NQK, NULL, 0, 0, gr->B_bias + h * NQK, 1);
        MB_ISA_FN(mb_colfold)(B, L, NQK, dQ + h * M * NQK, NQK, NULL, 0, 0, gr->C_bias + h * NQK, 1);
    }
    MB_ISA_FN(mb_colfold)(B, L, H, dQKG, H, NULL, 0, 0, gr->D, 1);
    MB_ISA_FN(mb_colfold)(B, L, H, dzx + oDT, dip, NULL, 0, 0, gr->dt_bias, 1);
    mb_scratch_give(buf);
    return MB_OK;
}
