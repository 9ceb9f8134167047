/* Mamba-2 (SSD) backward: the VJP of a zero-state prefill of B rows of L tokens,
 * differentiating the chunked SSD as block2.c computes it (chunks of Q on the grid
 * from position 0). docs/numerics.md "Backward (Mamba-2)" gives every order.
 *
 * Phases: the forward (block2.c, keeping its activations and the state entering each
 * chunk); out_proj, gated norm and gate backward (per token); the SSD backward in
 * three passes: per chunk, the heads in order, what does not need the state's
 * gradient (the heads' dG summed in place, dB and dC's main terms); per (row, head)
 * the state gradient's chain over the chunks in reverse; per chunk again, the heads in
 * order, the rest (their pieces of dB and dC added in order); conv backward; in_proj
 * and block norm backward; the weight gradients as folds over the tokens. */
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
    const float *dY;        /* (M, di) gradient of Y before the gate */
    float *du;              /* (M, CD) gradient of u; its x part holds dXd's in-chunk part between the passes */
    float *dzxd;            /* (M, NP): the SSD writes the dt columns */
    float *ddA, *dts;       /* (M, H) gradient of dA, and dt */
    float *dcs, *sacc;      /* (M, H) the cumsum's and seg's gradients before the fold's */
    float *vals;            /* five (B, H, L): chunk_prep's values, from the first pass */
    float *dhn, *dh, *E;    /* (B, H, nk, NS, HP) C^T . dyo of each chunk and dh leaving it; (B, H, nk) exp(cs_last) */
} bctx;

#define TR MB_M2_TR
#define MM MB_ISA_FN(mb_m2_mm64)

/* Row strides of the chunk's scratch matrices: a column walk at a power-of-two stride
 * would fall in a few cache sets. */
#define LDM (CQ + 16) /* (CQ, CQ) and (HP, CQ) */
#define LDC (NS + 16) /* the chunk's copies of B and C */

/* Per-thread scratch of the SSD backward, in floats (the larger pass's). */
#define SCR_A (2 * CQ * LDM + HP * LDM + 2 * CQ * LDC + 3 * CQ * HP + 2 * TR * CQ + 4 * CQ)
#define SCR_C (2 * CQ * NS + 2 * NS * HP + 3 * CQ * HP + TR * NS + 4 * CQ)
#define BSCR (SCR_A > SCR_C ? SCR_A : SCR_C)

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

/* The forward's per-chunk values of head h, as chunk_prep computes them, for the
 * chunk's n rows: the softplus input, whether the clamp let it through, dt, dA, cs. */
typedef struct { float *vpre, *live, *dt, *dA, *cs; } chunk_vals;

static void chunk_prep(const bctx *c, int64_t t0, int64_t n, int64_t h, const chunk_vals *v)
{
    const mb_m2_weights *w = c->w;
    const float A = -mb_exp(w->A_log[h]), bias = w->dt_bias[h];
    const float *dtr = c->a->zxd + t0 * c->NP + c->di + c->CD + h;
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        v->vpre[i] = dtr[i * c->NP] + bias;
        const float sp = mb_softplus(v->vpre[i]);
        v->live[i] = (sp < w->dt_lo || sp > w->dt_hi) ? 0.0f : 1.0f;
        v->dt[i] = mb_clamp(sp, w->dt_lo, w->dt_hi);
        v->dA[i] = v->dt[i] * A;
        acc = acc + v->dA[i];
        v->cs[i] = acc;
    }
}

/* Where chunk k of row b, head h keeps them (one array per value, tokens in order). */
static chunk_vals vals_of(const bctx *c, int64_t b, int64_t h, int64_t k)
{
    const int64_t n = c->B * c->H * c->L;
    float *p = c->vals + (b * c->H + h) * c->L + k * CQ;
    chunk_vals v = {p, p + n, p + 2 * n, p + 3 * n, p + 4 * n};
    return v;
}

/* First pass over chunk k of row b, heads in ascending order: what does not need the
 * gradient of the state leaving the chunk. Per head: dM, dG (summed over the heads
 * into dGs), dseg and its prefix sums, the cumsum's gradient from Y_off, dXd's
 * in-chunk part and C^T . dyo. Then dC and dB from dGs, before the heads' state
 * pieces (the second pass adds those). Chains that run past their last live term
 * (j > i here, i < j in dXd and dB) meet +0 entries: from a +0 seed those leave every
 * bit as skipping them would. */
static void chunk_a(const bctx *c, int64_t b, int64_t k, float *scr)
{
    const int64_t L = c->L, nk = c->nk, di = c->di, H = c->H, CD = c->CD;
    const int64_t n = L - k * CQ < CQ ? L - k * CQ : CQ, t0 = b * L + k * CQ;
    const float *u = c->a->u + t0 * CD, *G = c->a->G + t0 * CQ;
    float *dGs = scr, *Mf = dGs + CQ * LDM, *XdT = Mf + CQ * LDM, *Cc = XdT + HP * LDM;
    float *Bc = Cc + CQ * LDC, *Xd = Bc + CQ * LDC, *dyo = Xd + CQ * HP, *tmpv = dyo + CQ * HP;
    float *dMt = tmpv + CQ * HP, *dsg = dMt + TR * CQ, *ev = dsg + TR * CQ, *s = ev + CQ;
    float *sacc = s + CQ, *dcs = sacc + CQ;
    for (int64_t i = 0; i < n; i++) {
        memcpy(Bc + i * LDC, u + i * CD + di, NS * sizeof(float));
        memcpy(Cc + i * LDC, u + i * CD + di + NS, NS * sizeof(float));
        for (int64_t j = 0; j < n; j++) dGs[i * LDM + j] = 0.0f;
    }
    for (int64_t h = 0; h < H; h++) {
        const float *dY = c->dY + t0 * di + h * HP;
        const float *hprev = c->a->hck + ((b * H + h) * nk + k) * NS * HP;
        const chunk_vals v = vals_of(c, b, h, k);
        chunk_prep(c, t0, n, h, &v);
        for (int64_t i = 0; i < n; i++) {
            ev[i] = mb_exp(v.cs[i]);
            for (int p = 0; p < HP; p++) Xd[i * HP + p] = u[i * CD + h * HP + p] * v.dt[i];
        }
        mb_transpose_tile(n, HP, Xd, HP, XdT, LDM);

        for (int64_t j = 0; j < n; j++) sacc[j] = 0.0f;
        s[0] = 0.0f;
        for (int64_t i0 = 0; i0 < n; i0 += TR) {
            const int R = n - i0 < TR ? (int)(n - i0) : TR;
            for (int64_t jb = 0; jb < i0 + R; jb += HP)
                MM(R, HP, dY + i0 * di, di, 1, XdT + jb, LDM, dMt + jb, CQ);
            MM(R, NS, Cc + i0 * LDC, LDC, 1, hprev, HP, tmpv, HP); /* C_i . h_prev */
            mb_dot_rows(R, HP, dY + i0 * di, di, tmpv, HP, dcs + i0, 1);
            for (int r = 0; r < R; r++) {
                const int64_t i = i0 + r;
                const float *dYi = dY + i * di, *Gi = G + i * CQ, *dMi = dMt + r * CQ;
                for (int64_t j = 0; j < i; j++) s[j] = s[j] + v.dA[i];
                s[i] = 0.0f;
                float *gs = dGs + i * LDM, *mf = Mf + i * LDM, *ds = dsg + r * CQ;
                for (int64_t j = 0; j <= i; j += MB_VW) {
                    const int nn = i + 1 - j < MB_VW ? (int)(i + 1 - j) : MB_VW;
                    const mb_vf lm = mb_vexp(mb_vldn(s + j, nn)), g = mb_vldn(Gi + j, nn);
                    const mb_vf dm = mb_vldn(dMi + j, nn);
                    mb_vstn(mf + j, mb_vmul(g, lm), nn);
                    mb_vstn(gs + j, mb_vadd(mb_vldn(gs + j, nn), mb_vmul(dm, lm)), nn);
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
        }
        /* dXd[j] = sum over i >= j of M[i][j] dY[i], into du's x part */
        for (int64_t j0 = 0; j0 < n; j0 += TR)
            MM(n - j0 < TR ? (int)(n - j0) : TR, n - j0, Mf + j0 * LDM + j0, 1, LDM, dY + j0 * di, di,
               c->du + (t0 + j0) * CD + h * HP, CD);
        /* C^T . dyo: the state gradient's part from this chunk */
        if (k > 0)
            for (int m0 = 0; m0 < NS; m0 += TR)
                MM(NS - m0 < TR ? NS - m0 : TR, n, Cc + m0, 1, LDC, dyo, HP,
                   c->dhn + ((b * H + h) * nk + k) * NS * HP + m0 * HP, HP);
        for (int64_t i = 0; i < n; i++) {
            c->dcs[(t0 + i) * H + h] = dcs[i];
            c->sacc[(t0 + i) * H + h] = sacc[i];
        }
        c->E[(b * H + h) * nk + k] = mb_exp(v.cs[n - 1]);
    }
    /* dC = dGs . B and dB = dGs^T . C */
    for (int64_t i0 = 0; i0 < n; i0 += TR) {
        const int R = n - i0 < TR ? (int)(n - i0) : TR;
        float *dC = c->du + (t0 + i0) * CD + di + NS;
        MM(R, i0 + R, dGs + i0 * LDM, LDM, 1, Bc, LDC, dC, CD);
        MM(R, i0 + R, dGs + i0 * LDM, LDM, 1, Bc + HP, LDC, dC + HP, CD);
        float *dB = c->du + (t0 + i0) * CD + di;
        MM(R, n - i0, dGs + i0 * LDM + i0, 1, LDM, Cc + i0 * LDC, LDC, dB, CD);
        MM(R, n - i0, dGs + i0 * LDM + i0, 1, LDM, Cc + i0 * LDC + HP, LDC, dB + HP, CD);
    }
}

/* The state gradient of row b, head h, from the last chunk back: dh leaving chunk
 * k - 1 = fma(exp(cs_last of k), dh leaving k, C^T . dyo of k), or the latter alone
 * for the last chunk (nothing leaves it). */
static void dh_chain(const bctx *c, int64_t b, int64_t h)
{
    const int64_t nk = c->nk, bh = b * c->H + h;
    for (int64_t k = nk - 1; k > 0; k--) {
        const float *dhn = c->dhn + (bh * nk + k) * NS * HP, *dh = c->dh + (bh * nk + k) * NS * HP;
        float *o = c->dh + (bh * nk + k - 1) * NS * HP;
        if (k < nk - 1) {
            const float E = c->E[bh * nk + k];
            for (int i = 0; i < NS * HP; i++) o[i] = fmaf(E, dh[i], dhn[i]);
        } else {
            memcpy(o, dhn, NS * HP * sizeof(float));
        }
    }
}

/* Second pass over chunk k of row b, heads in ascending order: each head's Y_off
 * piece of dC; with the state gradient dh leaving the chunk (all but the last), the
 * fold's terms: dXd's, the head's piece of dB, the cumsum's; then dA and the outputs
 * of the chunk's rows. */
static void chunk_c(const bctx *c, int64_t b, int64_t k, float *scr)
{
    const mb_m2_weights *w = c->w;
    const int64_t L = c->L, nk = c->nk, di = c->di, H = c->H, CD = c->CD, NP = c->NP;
    const int64_t n = L - k * CQ < CQ ? L - k * CQ : CQ, t0 = b * L + k * CQ;
    const int folded = k < nk - 1;
    const float *u = c->a->u + t0 * CD;
    float *Bd = scr, *dBd = Bd + CQ * NS, *hP = dBd + CQ * NS, *dhP = hP + NS * HP;
    float *Xd = dhP + NS * HP, *dyo = Xd + CQ * HP, *tmpv = dyo + CQ * HP, *pc = tmpv + CQ * HP;
    float *dcs = pc + TR * NS, *tmp = dcs + CQ, *dec = tmp + CQ, *F = dec + CQ;
    /* dh . h_prev of every head, their chains interleaved */
    if (folded) {
        const float *dh0 = c->dh + (b * H * nk + k) * NS * HP, *hp0 = c->a->hck + (b * H * nk + k) * NS * HP;
        mb_dot_rows(H, NS * HP, dh0, nk * NS * HP, hp0, nk * NS * HP, F, 1);
    }
    for (int64_t h = 0; h < H; h++) {
        const float A = -mb_exp(w->A_log[h]), Dh = w->D[h];
        const float *dY = c->dY + t0 * di + h * HP;
        const float *hprev = c->a->hck + ((b * H + h) * nk + k) * NS * HP;
        const chunk_vals v = vals_of(c, b, h, k);
        for (int64_t i = 0; i < n; i++) {
            const float ev = mb_exp(v.cs[i]);
            for (int p = 0; p < HP; p++) dyo[i * HP + p] = dY[i * di + p] * ev;
            dcs[i] = c->dcs[(t0 + i) * H + h];
        }
        mb_transpose_tile(NS, HP, hprev, HP, hP, NS);
        for (int64_t i0 = 0; i0 < n; i0 += TR) { /* dC's Y_off piece */
            const int R = n - i0 < TR ? (int)(n - i0) : TR;
            MM(R, HP, dyo + i0 * HP, HP, 1, hP, NS, pc, NS);
            MM(R, HP, dyo + i0 * HP, HP, 1, hP + HP, NS, pc + HP, NS);
            for (int r = 0; r < R; r++) {
                float *dC = c->du + (t0 + i0 + r) * CD + di + NS;
                for (int m = 0; m < NS; m++) dC[m] = dC[m] + pc[r * NS + m];
            }
        }
        /* the chunk's fold h = fma(exp(cs_last), h_prev, Bd^T . Xd), when its result is used */
        if (folded) {
            const float *dh = c->dh + ((b * H + h) * nk + k) * NS * HP;
            const float last = v.cs[n - 1], E = c->E[(b * H + h) * nk + k];
            mb_transpose_tile(NS, HP, dh, HP, dhP, NS);
            for (int64_t j = 0; j < n; j++) {
                const float *Bj = u + j * CD + di;
                dec[j] = mb_exp(last - v.cs[j]);
                for (int m = 0; m < NS; m++) Bd[j * NS + m] = Bj[m] * dec[j];
                for (int p = 0; p < HP; p++) Xd[j * HP + p] = u[j * CD + h * HP + p] * v.dt[j];
            }
            for (int64_t j0 = 0; j0 < n; j0 += TR) {
                const int R = n - j0 < TR ? (int)(n - j0) : TR;
                MM(R, NS, Bd + j0 * NS, NS, 1, dh, HP, tmpv, HP);
                for (int r = 0; r < R; r++) {
                    float *dx = c->du + (t0 + j0 + r) * CD + h * HP;
                    for (int p = 0; p < HP; p++) dx[p] = dx[p] + tmpv[r * HP + p];
                }
                MM(R, HP, Xd + j0 * HP, HP, 1, dhP, NS, dBd + j0 * NS, NS);
                MM(R, HP, Xd + j0 * HP, HP, 1, dhP + HP, NS, dBd + j0 * NS + HP, NS);
            }
            mb_dot_rows(n, NS, dBd, NS, u + di, CD, tmp, 1);
            float T = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const float *dBj = dBd + j * NS;
                float *dB = c->du + (t0 + j) * CD + di;
                tmp[j] = tmp[j] * dec[j];
                for (int m = 0; m < NS; m++) dB[m] = dB[m] + dBj[m] * dec[j];
            }
            for (int64_t j = 0; j < n; j++) {
                dcs[j] = dcs[j] - tmp[j];
                T = T + tmp[j];
            }
            dcs[n - 1] = (dcs[n - 1] + T) + F[h] * E;
        }
        /* dA: the cumsum's part (suffix sums of dcs) then seg's */
        float suf = 0.0f;
        for (int64_t i = n - 1; i >= 0; i--) {
            suf = suf + dcs[i];
            tmp[i] = suf + c->sacc[(t0 + i) * H + h];
        }
        mb_dot_rows(n, HP, c->du + t0 * CD + h * HP, CD, u + h * HP, CD, dcs, 1);
        for (int64_t i = 0; i < n; i++) {
            const float *dYi = dY + i * di;
            float *dx = c->du + (t0 + i) * CD + h * HP;
            for (int p = 0; p < HP; p++) dx[p] = dYi[p] * Dh + dx[p] * v.dt[i];
            const float ddt = dcs[i] + tmp[i] * A;
            const float g = v.vpre[i] <= 20.0f ? ddt * mb_sigmoid(v.vpre[i]) : ddt;
            c->dzxd[(t0 + i) * NP + di + CD + h] = v.live[i] != 0.0f ? g : 0.0f;
            c->ddA[(t0 + i) * H + h] = tmp[i];
            c->dts[(t0 + i) * H + h] = v.dt[i];
        }
    }
}

int MB_ISA_FN(mb_m2_backward)(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                              const float *kept, const float *dy, const mb_m2_grads *gr)
{
    const int64_t dm = w->d_model, di = 2 * dm, H = di / HP, CD = di + 2 * NS, NP = di + CD + H;
    const int64_t M = B * L, nk = (L + CQ - 1) / CQ, nth = mb_max_threads();
    const int64_t bscr = (BSCR + 15) & ~(int64_t)15;
    /* sizes of every buffer, in floats, in allocation order; each a whole number of
     * cache lines */
    const int64_t sz[] = {
        kept ? 0 : m2_state_floats(dm, B) + m2_acts_floats(dm, B, L), /* the forward's */
        M * dm,                                                  /* dxn */
        M * di, M * di, M * di,                                  /* gn / dg, dgn / dY, xr */
        M * NP, M * CD, 9 * M * H,                               /* dzxd, du, ddA dts dcs sacc vals */
        2 * B * H * nk * NS * HP + B * H * nk,                   /* dhn, dh, E */
        nth * bscr,                                              /* per-thread scratch */
        M * dm,                                                  /* xr */
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
    m2_acts acts;
    float *gn = p[2], *dgn = p[3], *xr2 = p[4];
    float *dzxd = p[5], *du = p[6], *ddA = p[7], *dts = ddA + M * H;
    float *dhn = p[8], *dhs = dhn + B * H * nk * NS * HP, *E = dhs + B * H * nk * NS * HP;
    float *scr = p[9], *xr = p[10];
    int rc = MB_OK;
    if (kept) {
        m2_acts_carve(&acts, (float *)kept, dm, B, L);
    } else {
        const mb_m2_state st = m2_zero_state(p[0], cnt, dm, B);
        m2_acts_carve(&acts, p[0] + m2_state_floats(dm, B), dm, B, L);
        rc = MB_ISA_FN(mb_m2_acts)(w, B, L, x, &st, &acts);
    }
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        free(cnt);
        return rc;
    }
    const float *g = acts.g, *xn = acts.xn;

    /* out_proj: dW = dy^T . gn over the tokens; dgn = dy . W */
    MB_ISA_FN(mb_rmsnorm_rows)(M, di, g, di, w->norm_w, gn, di);
    rc = MB_ISA_FN(mb_linear_bwd)(M, dm, di, gn, di, w->out_proj, di, dy, dm, gr->out_proj, dgn, di);
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        free(cnt);
        return rc;
    }

    /* gated norm, then the gate: dY = dg * silu(z), dz = (dg * Y) * silu'(z) */
    float *dg = gn; /* gn is dead now */
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, di, g, di, w->norm_w, dgn, di, dg, di, xr2, di, NULL, 0);
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

    /* the SSD: a pass over the chunks, the state gradient's chain per (row, head), a
     * second pass over the chunks */
    const bctx c = {w, B, L, nk, di, H, CD, NP, &acts, dY, du, dzxd, ddA, dts,
                    ddA + 2 * M * H, ddA + 3 * M * H, ddA + 4 * M * H, dhn, dhs, E};
    #pragma omp parallel if (B * nk > 1)
    {
        mb_fpenv env = mb_fpenv_enter();
        float *q = scr + mb_thread_num() * bscr;
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * nk; task++)
            chunk_a(&c, task / nk, task % nk, q);
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * H; task++)
            dh_chain(&c, task / H, task % H);
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * nk; task++)
            chunk_c(&c, task / nk, task % nk, q);
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

    /* in_proj: dW = dzxd^T . xn over the tokens (xn from the forward); dxn = dzxd . W */
    float *dxn = p[1];
    rc = MB_ISA_FN(mb_linear_bwd)(M, NP, dm, xn, dm, w->in_proj, dm, dzxd, NP, gr->in_proj, dxn, dm);
    if (rc != MB_OK) {
        mb_scratch_give(buf);
        free(cnt);
        return rc;
    }

    /* block norm and the residual: dx = dx_norm + dy */
    MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, dm, x, dm, w->block_norm_w, dxn, dm, gr->x, dm, xr, dm, dy, dm);
    MB_ISA_FN(mb_colfold)(B, L, dm, dxn, dm, xr, dm, 0, gr->block_norm_w, 1);
    mb_scratch_give(buf);
    free(cnt);
    return MB_OK;
}
