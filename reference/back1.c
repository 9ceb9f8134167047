/* Mamba-1 backward: the VJP of a zero-state prefill of B rows of L tokens (SPEC 8);
 * docs/numerics.md "Backward (Mamba-1)" gives every order.
 *
 * Phases: steps 1-4 of the forward (mb_m1_front, keeping its activations); dyg =
 * dout . out_proj; the scan backward in two passes (reverse over each row: the dh
 * recurrence alone, leaving a carry at each chunk boundary; then chunk by chunk in
 * token order: dh again from its carry, h recomputed, the per-token pieces and the A
 * gradient's fold, then dB and dC per token, folded over the channels); out_proj,
 * dt_proj, x_proj, conv, in_proj and norm backward. */
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "mamba_ref.h"
#include "numerics.h"
#include "gemm.h"
#include "ops.h"
#include "grad.h"
#include "block1.h"
#include "fpenv.h"
#include "scratch.h"

#define NS MB_M1_NS
#define CB 64 /* channels per scan task */
#define TC 32 /* tokens per chunk of the scan backward */
#define LEAF MB_DOT_LEAF

typedef struct {
    int64_t B, L, di, R, XR, nch, nblk;
    const float *delta, *u, *xz, *xdbl, *spre, *AT, *D, *dyg, *dys;
    float *ck;              /* (B, nch, 2, NS, di): (dA, dh) of the token after each chunk */
    float *hcar, *gA;       /* (nblk, NS, CB): h across chunks; the A gradient's chain */
    float *leaves;          /* (P - 1, nblk, NS, CB): that chain's finished leaves */
    float *hc, *dhc;        /* (TC, di, NS): h and dh of the chunk, for dB and dC */
    float *yg, *dz, *ds, *dus, *dxdbl; /* outputs; dz has stride 2 di */
} sctx;

typedef float tile[NS][CB];

/* dh_t = fma(dA_{t+1}, dh_{t+1}, C_t[n] * dys_t) for t = t1 - 1 down to t0 of row b,
 * channels [c0, c0 + nc); (cA, cH) carry (dA, dh) of the token after, in place. With
 * store, each token's dA and dh land in DA, DH (row t - t0). */
static inline __attribute__((always_inline)) void dh_back(const sctx *c, int64_t b, int64_t c0,
                                                          int64_t nc, int64_t t0, int64_t t1,
                                                          tile cA, tile cH, tile *DA, tile *DH,
                                                          int store)
{
    const int64_t di = c->di, XR = c->XR;
    for (int64_t t = t1 - 1; t >= t0; t--) {
        const int64_t m = b * c->L + t;
        const float *dl = c->delta + m * di + c0, *dy = c->dys + m * di + c0;
        const float *Cv = c->xdbl + m * XR + c->R + NS;
        for (int n = 0; n < NS; n++) {
            const float cn = Cv[n], *a = c->AT + n * di + c0;
            for (int64_t i = 0; i < nc; i++) {
                const float dA = mb_exp(dl[i] * a[i]);
                const float dh = fmaf(cA[n][i], cH[n][i], cn * dy[i]);
                cA[n][i] = dA;
                cH[n][i] = dh;
                if (store) {
                    DA[t - t0][n][i] = dA;
                    DH[t - t0][n][i] = dh;
                }
            }
        }
    }
}

static void carry_io(const sctx *c, int64_t b, int64_t k, int64_t c0, int64_t nc, tile cA,
                     tile cH, int save)
{
    float *p = c->ck + (b * c->nch + k) * 2 * NS * c->di + c0;
    for (int n = 0; n < NS; n++) {
        float *pa = p + n * c->di, *ph = pa + NS * c->di;
        if (save) {
            memcpy(pa, cA[n], (size_t)nc * sizeof(float));
            memcpy(ph, cH[n], (size_t)nc * sizeof(float));
        } else {
            memcpy(cA[n], pa, (size_t)nc * sizeof(float));
            memcpy(cH[n], ph, (size_t)nc * sizeof(float));
        }
    }
}

/* The reverse pass of row b over one channel block: the carries entering every chunk
 * but the first, from the row's end (dA, dh = +0 past the last token). */
static void reverse_row(const sctx *c, int64_t b, int64_t blk)
{
    const int64_t c0 = blk * CB, nc = c->di - c0 < CB ? c->di - c0 : CB;
    tile cA, cH;
    memset(cA, 0, sizeof cA);
    memset(cH, 0, sizeof cH);
    for (int64_t k = c->nch - 1; k >= 0; k--) {
        carry_io(c, b, k, c0, nc, cA, cH, 1);
        if (k > 0)
            dh_back(c, b, c0, nc, k * TC, (k + 1) * TC < c->L ? (k + 1) * TC : c->L, cA, cH,
                    NULL, NULL, 0);
    }
}

/* One token over nc channels, in token order: h advanced in place and y's dot over n
 * (acc), as the forward computes them; g, the A gradient's chains, advanced by the
 * token's term; sA, sB the token's dots over n. hv holds dA on entry and h on exit. */
static inline void token_fwd(int64_t nc, int64_t di, float (*restrict h)[CB],
                             float (*restrict g)[CB], float (*restrict hv)[CB],
                             const float (*restrict dh)[CB], const float *restrict dl,
                             const float *restrict uu, const float *restrict AT,
                             const float *restrict Bv, const float *restrict Cv,
                             float *restrict acc, float *restrict sA, float *restrict sB)
{
    for (int64_t i = 0; i < nc; i++)
        acc[i] = sA[i] = sB[i] = 0.0f;
    for (int n = 0; n < NS; n++) {
        const float bn = Bv[n], cn = Cv[n], *a = AT + n * di;
        for (int64_t i = 0; i < nc; i++) {
            const float dA = hv[n][i], hp = h[n][i];
            const float hn = mb_m1_h_next(dA, hp, dl[i], bn, uu[i]);
            h[n][i] = hn;
            hv[n][i] = hn;
            acc[i] = fmaf(cn, hn, acc[i]);
            const float wv = (dh[n][i] * hp) * dA; /* d loss / d (delta A) */
            g[n][i] = fmaf(wv, dl[i], g[n][i]);
            sA[i] = fmaf(wv, a[i], sA[i]);
            sB[i] = fmaf(dh[n][i], bn, sB[i]);
        }
    }
}

/* The token's outputs per channel: yg (as the forward), dz, ds (before dt_proj's
 * bias and softplus) and the scan's part of du. */
static inline void token_out(int64_t nc, const float *restrict acc, const float *restrict sA,
                             const float *restrict sB, const float *restrict uu,
                             const float *restrict dl, const float *restrict zz,
                             const float *restrict D, const float *restrict dyg,
                             const float *restrict sp, float *restrict yg, float *restrict dz,
                             float *restrict ds, float *restrict dus)
{
    for (int64_t i = 0; i < nc; i++) {
        const float y1 = acc[i] + uu[i] * D[i];
        yg[i] = y1 * mb_silu(zz[i]);
        dz[i] = (dyg[i] * y1) * mb_dsilu(zz[i]);
        ds[i] = (sA[i] + sB[i] * uu[i]) * mb_sigmoid(sp[i]);
        dus[i] = sB[i] * dl[i];
    }
}

/* Chunk k of row b over one channel block, tokens in order: h and y as the forward
 * computes them, and every piece of the scan's gradient that stays in the channel.
 * scr holds 2 TC tiles. */
static void chunk_fwd(const sctx *c, int64_t b, int64_t k, int64_t blk, tile *scr)
{
    const int64_t di = c->di, XR = c->XR, c0 = blk * CB, nc = di - c0 < CB ? di - c0 : CB;
    const int64_t t0 = k * TC, t1 = t0 + TC < c->L ? t0 + TC : c->L;
    tile *DA = scr, *DH = scr + TC, cA, cH, h, g;
    float *hsave = c->hcar + blk * NS * CB, *gsave = c->gA + blk * NS * CB;
    carry_io(c, b, k, c0, nc, cA, cH, 0);
    dh_back(c, b, c0, nc, t0, t1, cA, cH, DA, DH, 1);
    if (k == 0)
        memset(h, 0, sizeof h);
    else
        memcpy(h, hsave, sizeof h);
    memcpy(g, gsave, sizeof g);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t m = b * c->L + t;
        if (m > 0 && m % LEAF == 0) {
            memcpy(c->leaves + ((m / LEAF - 1) * c->nblk + blk) * NS * CB, g, sizeof g);
            memset(g, 0, sizeof g);
        }
        const float *dl = c->delta + m * di + c0, *uu = c->u + m * di + c0;
        const float *Bv = c->xdbl + m * XR + c->R;
        float acc[CB], sA[CB], sB[CB];
        token_fwd(nc, di, h, g, DA[t - t0], (const float (*)[CB])DH[t - t0], dl, uu, c->AT + c0,
                  Bv, Bv + NS, acc, sA, sB);
        token_out(nc, acc, sA, sB, uu, dl, c->xz + m * 2 * di + di + c0, c->D + c0,
                  c->dyg + m * di + c0, c->spre + m * di + c0, c->yg + m * di + c0,
                  c->dz + m * 2 * di + c0, c->ds + m * di + c0, c->dus + m * di + c0);
    }
    memcpy(hsave, h, sizeof h);
    memcpy(gsave, g, sizeof g);
    /* h and dh of the chunk, channel-major, for the folds over channels */
    for (int64_t t = t0; t < t1; t++) {
        float *ho = c->hc + ((t - t0) * di + c0) * NS, *dho = c->dhc + ((t - t0) * di + c0) * NS;
        for (int64_t i = 0; i < nc; i++)
            for (int n = 0; n < NS; n++) {
                ho[i * NS + n] = DA[t - t0][n][i];
                dho[i * NS + n] = DH[t - t0][n][i];
            }
    }
}

/* dB_t[n] = dot v1 over channels of dh[c][n] * (delta[c] * u[c]); dC_t[n] = dot v1 over
 * channels of dys[c] * h[c][n]. */
static void fold_bc(const sctx *c, int64_t b, int64_t t, int64_t t0)
{
    const int64_t di = c->di, m = b * c->L + t;
    const float *hr = c->hc + (t - t0) * di * NS, *dhr = c->dhc + (t - t0) * di * NS;
    const float *dy = c->dys + m * di, *dl = c->delta + m * di, *uu = c->u + m * di;
    float *o = c->dxdbl + m * c->XR + c->R;
    mb_dot_tree tB[NS], tC[NS];
    for (int n = 0; n < NS; n++)
        tB[n].top = tC[n].top = 0;
    for (int64_t s = 0; s < di; s += LEAF) {
        const int64_t e = s + LEAF < di ? s + LEAF : di;
        float aB[NS], aC[NS];
        for (int n = 0; n < NS; n++)
            aB[n] = aC[n] = 0.0f;
        for (int64_t ch = s; ch < e; ch++) {
            const float du = dl[ch] * uu[ch], y = dy[ch];
            for (int n = 0; n < NS; n++) {
                aB[n] = fmaf(dhr[ch * NS + n], du, aB[n]);
                aC[n] = fmaf(y, hr[ch * NS + n], aC[n]);
            }
        }
        for (int n = 0; n < NS; n++) {
            mb_dot_tree_push(&tB[n], aB[n]);
            mb_dot_tree_push(&tC[n], aC[n]);
        }
    }
    for (int n = 0; n < NS; n++) {
        o[n] = mb_dot_tree_sum(&tB[n]);
        o[NS + n] = mb_dot_tree_sum(&tC[n]);
    }
}

static void scan_bwd(const sctx *c, tile *tscr)
{
    const int64_t B = c->B, L = c->L, nch = c->nch, nblk = c->nblk;
    const int par = L * c->di > (1 << 12);
    #pragma omp parallel if (par)
    {
        mb_fpenv env = mb_fpenv_enter();
        tile *scr = tscr + 2 * TC * mb_thread_num();
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * nblk; task++)
            reverse_row(c, task / nblk, task % nblk);
        for (int64_t b = 0; b < B; b++)
            for (int64_t k = 0; k < nch; k++) {
                const int64_t t0 = k * TC, t1 = t0 + TC < L ? t0 + TC : L;
                #pragma omp for schedule(dynamic)
                for (int64_t blk = 0; blk < nblk; blk++)
                    chunk_fwd(c, b, k, blk, scr);
                #pragma omp for schedule(static)
                for (int64_t t = t0; t < t1; t++)
                    fold_bc(c, b, t, t0);
            }
        mb_fpenv_exit(env);
    }
}

int MB_ISA_FN(mb_m1_backward)(const mb_m1_weights *w, int64_t B, int64_t L, const float *x,
                              const float *kept, const float *dy, const mb_m1_grads *gr)
{
    const int64_t dm = w->d_model, di = 2 * dm, R = (dm + 15) / 16, XR = R + 2 * NS, M = B * L;
    const int64_t nch = (L + TC - 1) / TC, nblk = (di + CB - 1) / CB;
    const int64_t P = (M + LEAF - 1) / LEAF;
    const int nth = mb_max_threads();
    const int64_t sz[] = {
        kept ? 0 : m1_acts_floats(dm, M), M * dm,                   /* the front's; xr */
        NS * di, kept ? 0 : B * di * 4,                             /* AT, window */
        M * di, M * di, M * di, M * di, M * di, M * XR, 2 * M * di, /* dyg dys yg ds dus dxdbl dxz */
        B * nch * 2 * NS * di, 2 * TC * di * NS,                    /* carries; hc, dhc */
        (P + 1) * nblk * NS * CB, (int64_t)nth * 2 * TC * NS * CB,  /* hcar, gA, leaves; scratch */
    };
    const int nb = (int)(sizeof sz / sizeof sz[0]);
    int64_t total = 0;
    for (int i = 0; i < nb; i++)
        total += sz[i];
    int64_t *off = malloc((size_t)(B + 1) * sizeof *off);
    float *buf = mb_scratch_take((size_t)total);
    if (!buf || !off) {
        mb_scratch_give(buf);
        free(off);
        return MB_ENOMEM;
    }
    float *p[32];
    p[0] = buf;
    for (int i = 1; i < nb; i++)
        p[i] = p[i - 1] + sz[i - 1];
    m1_acts a;
    m1_acts_carve(&a, kept ? (float *)kept : p[0], dm, M);
    const float *xn = a.xn, *xz = a.xz, *pre = a.pre, *u = a.u, *xdbl = a.xdbl;
    const float *spre = a.spre, *delta = a.delta;
    float *xr = p[1], *AT = p[2], *win = p[3], *dyg = p[4], *dys = p[5];
    float *yg = p[6], *ds = p[7], *dus = p[8], *dxdbl = p[9], *dxz = p[10];
    int rc = MB_OK;

    mb_row_offsets(B, L, NULL, off);
    if (!kept) {
        memset(win, 0, (size_t)sz[3] * sizeof(float));
        MB_ISA_FN(mb_m1_front)(w, B, off, x, a.xn, a.xz, win, a.pre, a.u, a.xdbl, a.spre, a.delta);
    }
    for (int64_t ch = 0; ch < di; ch++)
        for (int n = 0; n < NS; n++)
            AT[n * di + ch] = -mb_exp(w->A_log[ch * NS + n]);

    /* gate input: dyg = dout . out_proj (dot v1 over dm); dys = dyg * silu(z) */
    if (!MB_ISA_FN(mb_gemm_kn)(M, di, dm, dy, dm, 1, w->out_proj, di, dyg, di)) {
        mb_scratch_give(buf);
        free(off);
        return MB_ENOMEM;
    }
    #pragma omp parallel for schedule(static) if (M * di > (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        mb_fpenv env = mb_fpenv_enter();
        for (int64_t ch = 0; ch < di; ch++)
            dys[m * di + ch] = dyg[m * di + ch] * mb_silu(xz[m * 2 * di + di + ch]);
        mb_fpenv_exit(env);
    }

    float *gA = p[13] + nblk * NS * CB;
    memset(gA, 0, (size_t)(nblk * NS * CB) * sizeof(float));
    const sctx c = {B, L, di, R, XR, nch, nblk, delta, u, xz, xdbl, spre, AT, w->D, dyg, dys,
                    p[11], p[13], gA, gA + nblk * NS * CB, p[12], p[12] + TC * di * NS,
                    yg, dxz + di, ds, dus, dxdbl};
    scan_bwd(&c, (tile *)p[14]);

    /* A_log: the fold of each (c, n) chain's leaves, times A = -exp(A_log) */
    for (int64_t blk = 0; blk < nblk; blk++)
        for (int n = 0; n < NS; n++)
            for (int64_t i = 0; i < CB && blk * CB + i < di; i++) {
                mb_dot_tree t;
                t.top = 0;
                const int64_t e = (blk * NS + n) * CB + i;
                for (int64_t q = 0; q + 1 < P; q++)
                    mb_dot_tree_push(&t, c.leaves[q * nblk * NS * CB + e]);
                mb_dot_tree_push(&t, gA[e]);
                const int64_t ch = blk * CB + i;
                gr->A_log[ch * NS + n] = mb_dot_tree_sum(&t) * AT[n * di + ch];
            }

    MB_ISA_FN(mb_colfold)(B, L, di, dys, di, u, di, 0, gr->D, 1);
    MB_ISA_FN(mb_colfold)(B, L, di, ds, di, NULL, 0, 0, gr->dt_proj_b, 1);
    float *dux = dyg, *dxn = yg; /* dead by then */
    rc = MB_ISA_FN(mb_linear_bwd)(M, dm, di, yg, di, w->out_proj, di, dy, dm, gr->out_proj, NULL, 0);
    if (rc == MB_OK)
        rc = MB_ISA_FN(mb_linear_bwd)(M, di, R, xdbl, XR, w->dt_proj_w, R, ds, di, gr->dt_proj_w,
                                      dxdbl, XR);
    if (rc == MB_OK)
        rc = MB_ISA_FN(mb_linear_bwd)(M, XR, di, u, di, w->x_proj, di, dxdbl, XR, gr->x_proj,
                                      dux, di);
    if (rc == MB_OK) {
        /* du = (x_proj's + the scan's) + the D skip's */
        #pragma omp parallel for schedule(static) if (M * di > (1 << 15))
        for (int64_t m = 0; m < M; m++) {
            mb_fpenv env = mb_fpenv_enter();
            for (int64_t ch = 0; ch < di; ch++) {
                const int64_t i = m * di + ch;
                dux[i] = (dux[i] + dus[i]) + dys[i] * w->D[ch];
            }
            mb_fpenv_exit(env);
        }
        MB_ISA_FN(mb_conv_silu_bwd)(B, L, di, dux, di, pre, di, xz, 2 * di, w->conv_w,
                                    gr->conv_w, gr->conv_b, dxz, 2 * di);
        rc = MB_ISA_FN(mb_linear_bwd)(M, 2 * di, dm, xn, dm, w->in_proj, dm, dxz, 2 * di,
                                      gr->in_proj, dxn, dm);
    }
    if (rc == MB_OK) {
        /* norm and residual: dx = dx_norm + dout */
        MB_ISA_FN(mb_rmsnorm_bwd_rows)(M, dm, x, dm, w->norm_w, dxn, dm, gr->x, dm, xr, dm, dy, dm);
        MB_ISA_FN(mb_colfold)(B, L, dm, dxn, dm, xr, dm, 0, gr->norm_w, 1);
    }
    mb_scratch_give(buf);
    free(off);
    return rc;
}
