/* Mamba-3 SISO block, profile identical.mamba3.siso.fp32.v1 (SPEC section 7).
 *
 * Per (row, head) the tokens are processed in segments that lie inside one chunk of
 * the absolute grid. The state buffers are the working memory: each token's rotated
 * q and k, v, dt, sig and A*dt are written to its chunk row, the outputs of the new
 * rows are computed from the buffer, and a full chunk is folded into h only when
 * the first token of the next chunk arrives (its dt and sig complete the trapezoid
 * of the chunk's last row). Prefill, split prefill and decode therefore run the
 * same arithmetic on the same rows. */
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "mamba_ref.h"
#include "numerics.h"
#include "gemm.h"
#include "ops.h"
#include "fpenv.h"
#include "block3.h"
#include "scratch.h"
#include "tile.h"

/* Tiles: TR3 rows by 64 columns under AVX-512 (16 elsewhere); 16-column tiles for the
 * rest of N, and single rows when fewer than half a tile's rows are left (decode). */
#define TR3 6
#define PF 4 /* rows put_rows prefetches ahead */
#define WV (MB_VW == 16 ? 4 : 16 / MB_VW)
#define NV16 (16 / MB_VW)

static inline __attribute__((always_inline)) void m3_rows(const int R, int64_t N, int64_t K,
                                                          int64_t dK, const float *const *ar,
                                                          int64_t sak, const float *B,
                                                          int64_t ldb, float *C, int64_t ldc,
                                                          int nr)
{
    int64_t n0 = 0;
    for (; n0 + WV * MB_VW <= N; n0 += WV * MB_VW)
        mb_tile(R, WV, K, (int)dK, ar, sak, B + n0, ldb, C + n0, ldc, nr);
    for (; n0 < N; n0 += 16)
        mb_tile(R, NV16, K, (int)dK, ar, sak, B + n0, ldb, C + n0, ldc, nr);
}

/* C[m*ldc + n] = dot v1 over k < K0 + m*dK of A[m*sam + k*sak] and B[k*ldb + n], for
 * m < M and n < N (N a multiple of 16). Chains are per output and ascending in k;
 * rows of a causal product (dK = 1) share the common prefix of k and finish their
 * chains one by one. */
void MB_ISA_FN(mb_m3_mm)(int64_t M, int64_t N, int64_t K0, int64_t dK,
                         const float *A, int64_t sam, int64_t sak,
                         const float *B, int64_t ldb, float *C, int64_t ldc)
{
    for (int64_t m = 0; m < M;) {
        const int nr = M - m < TR3 ? (int)(M - m) : TR3;
        const float *ar[TR3]; /* rows past nr repeat the last one */
        for (int r = 0; r < TR3; r++) ar[r] = A + (m + (r < nr ? r : nr - 1)) * sam;
        if (nr * 2 >= TR3) {
            m3_rows(TR3, N, K0 + m * dK, dK, ar, sak, B, ldb, C + m * ldc, ldc, nr);
            m += nr;
        } else {
            m3_rows(1, N, K0 + m * dK, 0, ar, sak, B, ldb, C + m * ldc, ldc, 1);
            m++;
        }
    }
}

/* out = h folded over buffer rows [0, n), the last row's beta given:
 * out = fma(exp(cs_last), h, (v * exp(cs_last - cs_j))^T . (k_j * scale_j)).
 * hT and out are (NQK, PV) and may alias. */
void MB_ISA_FN(mb_m3_fold)(const m3_head *hv, int64_t n, float beta_last, const float *hT,
                           float *out, float *s)
{
    float *cs = s + S_CS, *ks = s + S_KS, *vd = s + S_VD, *ST = s + S_ST;
    cumsum_adt(hv, n, cs);
    const float cl = cs[n - 1];
    for (int64_t j = 0; j < n; j++) {
        const float sc = j + 1 < n ? scale_of(hv, j)
                                   : hv->dt[j * hv->ss] * hv->sig[j * hv->ss] + beta_last;
        const float *kr = hv->k + j * hv->qs, *vr = hv->v + j * hv->vs;
        float *kd = ks + j * NQK, *vo = vd + j * PV;
        for (int i = 0; i < NQK; i++)
            kd[i] = kr[i] * sc;
        const float dec = mb_exp(cl - cs[j]);
        for (int p = 0; p < PV; p++)
            vo[p] = vr[p] * dec;
    }
    MB_ISA_FN(mb_m3_mm)(NQK, PV, n, 0, ks, 1, NQK, vd, PV, ST, PV);
    const float e = mb_exp(cl);
    for (int i = 0; i < NQK * PV; i++)
        out[i] = fmaf(e, hT[i], ST[i]);
}

/* Tokens [tok0, tok0 + n) of head h into buffer rows [i0, i0 + n): the angle steps,
 * the biased and rotated q and k, v, dt, sig, A*dt and qk_gamma. */
void MB_ISA_FN(mb_m3_put_rows)(const m3_ctx *c, const m3_head *hv, int64_t h, int64_t tok0,
                               int64_t i0, int64_t n, float *theta, float *s)
{
    const int64_t H = c->H;
    float *Qb = s + S_QB, *Kb = s + S_KB;
    const float *Cb = c->w->C_bias + h * NQK, *Bb = c->w->B_bias + h * NQK;
    for (int64_t i = 0; i < n; i++) {
        /* this head's z and x of a later row (v below, z in the gate): rows one stride
         * of in_proj apart are too far for the hardware prefetcher */
        if (i + PF < n) {
            const float *r = c->zx + (tok0 + i + PF) * c->dip + h * PV;
            for (int l = 0; l < PV; l += 16) {
                __builtin_prefetch(r + l);
                __builtin_prefetch(r + c->di + l);
            }
        }
        const float *Cn = c->Cn + (tok0 + i) * NQK, *Bn = c->Bn + (tok0 + i) * NQK;
        for (int m = 0; m < NQK; m++) {
            Qb[i * NQK + m] = Cn[m] + Cb[m];
            Kb[i * NQK + m] = Bn[m] + Bb[m];
        }
    }
    /* qk_gamma = dot(q, k) * gamma: eight tokens' chains in flight (rows past n are
     * scratch, their results unused) */
    for (int64_t a = 0; a < n; a += 8) {
        float acc[8] = {0.0f};
        for (int m = 0; m < NQK; m++)
            for (int u = 0; u < 8; u++)
                acc[u] = fmaf(Qb[(a + u) * NQK + m], Kb[(a + u) * NQK + m], acc[u]);
        for (int u = 0; u < 8 && a + u < n; u++) {
            const int64_t t = (tok0 + a + u) * H + h;
            s[S_QKG + i0 + a + u] = acc[u] * (c->dt[t] * c->sig[t]);
        }
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t tok = tok0 + i, row = i0 + i;
        const float dt = c->dt[tok * H + h];
        const float *ta = c->ta + tok * NA;
        float cs[NA], sn[NA];
        for (int r = 0; r < NA; r++) {
#ifdef MB_SABOTAGE_ANGLE_PER_CHUNK
            theta[r] = theta[r] + ta[r] * dt;
#else
            theta[r] = mb_mod2pi(theta[r] + ta[r] * dt);
#endif
            cs[r] = mb_cos(theta[r]);
            sn[r] = mb_sin(theta[r]);
        }
        if (hv->rot) {
            memcpy(hv->rot + row * 2 * NA, cs, sizeof cs);
            memcpy(hv->rot + row * 2 * NA + NA, sn, sizeof sn);
        }
        const float *q = Qb + i * NQK, *k = Kb + i * NQK;
        float *qo = hv->q + row * hv->qs, *ko = hv->k + row * hv->qs;
        for (int r = 0; r < NA; r++) {
            const float q0 = q[2 * r], q1 = q[2 * r + 1], k0 = k[2 * r], k1 = k[2 * r + 1];
            qo[2 * r] = (q0 * cs[r]) - (q1 * sn[r]);
            qo[2 * r + 1] = (q0 * sn[r]) + (q1 * cs[r]);
            ko[2 * r] = (k0 * cs[r]) - (k1 * sn[r]);
            ko[2 * r + 1] = (k0 * sn[r]) + (k1 * cs[r]);
        }
        /* short copies inline: a libc call per row costs more than the copy */
        for (int l = 2 * NA; l < NQK; l += MB_VW) {
            mb_vst(qo + l, mb_vld(q + l));
            mb_vst(ko + l, mb_vld(k + l));
        }
        const float *xv = c->zx + tok * c->dip + c->di + h * PV;
        for (int l = 0; l < PV; l += MB_VW)
            mb_vst(hv->v + row * hv->vs + l, mb_vld(xv + l));
        hv->dt[row * hv->ss] = dt;
        hv->sig[row * hv->ss] = c->sig[tok * H + h];
        hv->adt[row * hv->ss] = c->adt[tok * H + h];
    }
#ifdef MB_SABOTAGE_ANGLE_PER_CHUNK
    for (int r = 0; r < NA; r++)
        theta[r] = mb_mod2pi(theta[r]);
#endif
}

/* Outputs of buffer rows [r0, r1) (rows [0, r1) filled), token r0 at packed index
 * tok0, h entering the chunk in hT:
 * y = (q.h^T) * exp(cs_i) + ((q.ks^T) * Lm) . v  (strictly causal),
 * y = y + (D + qk_gamma) * v, y = y * silu(z). */
void MB_ISA_FN(mb_m3_chunk_out)(const m3_ctx *c, const m3_head *hv, int64_t h, int64_t r0,
                                int64_t r1, int64_t tok0, const float *hT, float *s)
{
    float *cs = s + S_CS, *kst = s + S_KST, *G = s + S_G, *Lm = s + S_LM, *Mm = s + S_MM;
    float *Ys = s + S_YS, *Yi = s + S_YI, *seg = s + S_SEG;
    cumsum_adt(hv, r1, cs);
    MB_ISA_FN(mb_m3_mm)(r1 - r0, PV, NQK, 0, hv->q + r0 * hv->qs, hv->qs, 1, hT, PV,
                        Ys + r0 * PV, PV);

    /* q_i . ks_j for j < i: ks^T over the columns j < r1 - 1 (scales known), padded */
    const int64_t nj = r1 - 1;
    if (nj > 0) {
        const int64_t pad = UP16(nj);
        float *ks = s + S_KS; /* scaled rows, then transposed into kst */
        for (int64_t j = 0; j < nj; j++) {
            const float sc = scale_of(hv, j);
            const float *kr = hv->k + j * hv->qs;
            for (int n = 0; n < NQK; n++)
                ks[j * NQK + n] = kr[n] * sc;
        }
        mb_transpose_tile(nj, NQK, ks, NQK, kst, QCAP);
        for (int n = 0; n < NQK; n++)
            for (int64_t j = nj; j < pad; j++)
                kst[n * QCAP + j] = 0.0f;
        for (int64_t a = r0 > 1 ? r0 : 1; a < r1; a += 16) {
            const int64_t b = a + 16 < r1 ? a + 16 : r1;
            MB_ISA_FN(mb_m3_mm)(b - a, UP16(b - 1), NQK, 0, hv->q + a * hv->qs, hv->qs, 1,
                                kst, QCAP, G + a * QCAP, QCAP);
        }
    }
    /* seg[i][j] = serial sum of adt[j+1..i] from +0, one row at a time */
    for (int64_t i = 1; i < r1; i++) {
        const float a = hv->adt[i * hv->ss];
        seg[i - 1] = 0.0f;
        for (int64_t j = 0; j < i; j++)
            seg[j] = seg[j] + a;
        if (i >= r0)
            for (int64_t j = 0; j < i; j += MB_VW) {
                const int nn = i - j < MB_VW ? (int)(i - j) : MB_VW;
                const mb_vf e = mb_vexp(mb_vldn(seg + j, nn));
                mb_vstn(Lm + i * QCAP + j, e, nn);
                mb_vstn(Mm + i * QCAP + j, mb_vmul(mb_vldn(G + i * QCAP + j, nn), e), nn);
            }
    }
    MB_ISA_FN(mb_m3_mm)(r1 - r0, PV, r0, 1, Mm + r0 * QCAP, QCAP, 1, hv->v, hv->vs,
                        Yi + r0 * PV, PV);

    const float Dh = c->w->D[h];
    for (int64_t i = r0; i < r1; i++) {
        const int64_t tok = tok0 + (i - r0);
        const float e = mb_exp(cs[i]), dq = Dh + s[S_QKG + i];
        const float *z = c->zx + tok * c->dip + h * PV, *v = hv->v + i * hv->vs;
        const float *ys = Ys + i * PV, *yi = Yi + i * PV;
        float *yo = c->yg + tok * c->di + h * PV;
        float *yp = c->ypre ? c->ypre + tok * c->di + h * PV : yo;
        for (int p = 0; p < PV; p++) {
            const float y = ys[p] * e + yi[p];
            yp[p] = y + dq * v[p];
        }
        for (int p = 0; p < PV; p += MB_VW)
            mb_vst(yo + p, mb_vmul(mb_vld(yp + p), mb_vsilu(mb_vld(z + p))));
    }
}

/* Rows past buffered_tokens hold zeros, so a state's bytes are canonical. */
static void clear_rows(const m3_head *hv)
{
    for (int64_t j = 0; j < QCAP; j++) {
        memset(hv->q + j * hv->qs, 0, NQK * sizeof(float));
        memset(hv->k + j * hv->qs, 0, NQK * sizeof(float));
        memset(hv->v + j * hv->vs, 0, PV * sizeof(float));
        hv->dt[j * hv->ss] = hv->sig[j * hv->ss] = hv->adt[j * hv->ss] = 0.0f;
    }
}

/* One (row, head) between its segments: a segment is the tokens that fall in one chunk
 * of the grid, and the segments of a (row, head) run in order, each one a task. */
typedef struct {
    m3_head hv;
    float *theta, *hs, *hT; /* hT (NQK, PV): h^T of the working chunk */
    int64_t b, h, tok0, len, t, nb;
} m3_run;

/* Segments of len tokens after nb0 buffered rows (a full chunk folds first). */
static int64_t segments(int64_t nb0, int64_t len)
{
    const int64_t n0 = len < CQ - nb0 % CQ ? len : CQ - nb0 % CQ;
    return 1 + (len - n0 + CQ - 1) / CQ;
}

/* Row b, head h over its len tokens starting at packed index tok0: h^T into hT, and
 * the pending input state folded in. */
static void run_begin(const m3_ctx *c, m3_run *r, int64_t b, int64_t h, int64_t tok0,
                      int64_t len, float *hT)
{
    const mb_m3_state *st = c->st;
    const int64_t H = c->H;
    const m3_head hv = {
        st->buffer_qrot + (b * QCAP * H + h) * NQK, st->buffer_krot + (b * QCAP * H + h) * NQK,
        st->buffer_v + (b * QCAP * H + h) * PV, st->buffer_dt + b * QCAP * H + h,
        st->buffer_sig + b * QCAP * H + h, st->buffer_adt + b * QCAP * H + h,
        H * NQK, H * PV, H, NULL,
    };
    r->hv = hv;
    r->theta = st->theta + (b * H + h) * NA;
    r->hs = st->h + (b * H + h) * PV * NQK;
    r->hT = hT;
    r->b = b;
    r->h = h;
    r->tok0 = tok0;
    r->len = len;
    r->t = 0;
    r->nb = c->nb0;
    mb_transpose_tile(PV, NQK, r->hs, NQK, hT, PV);
    if (c->pending) {
        /* upstream Input_States: h0 = h + (v_st * k_st) * (dt_1 * (1 - sig_1)) */
        float *pk = st->pending_k + (b * H + h) * NQK, *pv = st->pending_v + (b * H + h) * PV;
        const float w1 = c->dt[tok0 * H + h] * (1.0f - c->sig[tok0 * H + h]);
        for (int n = 0; n < NQK; n++)
            for (int p = 0; p < PV; p++)
                hT[n * PV + p] = hT[n * PV + p] + (pv[p] * pk[n]) * w1;
        memset(pk, 0, NQK * sizeof(float));
        memset(pv, 0, PV * sizeof(float));
    }
}

/* The next segment: a full working chunk is folded (the first token after it gives
 * the last row's beta) and cleared, then the segment's rows and outputs. */
static void run_step(const m3_ctx *c, m3_run *r, float *s)
{
    const int64_t H = c->H, h = r->h;
    if (r->nb == CQ) {
        const int64_t tok = r->tok0 + r->t;
        MB_ISA_FN(mb_m3_fold)(&r->hv, CQ, beta_of(c->dt[tok * H + h], c->sig[tok * H + h]),
                              r->hT, r->hT, s);
        clear_rows(&r->hv);
        r->nb = 0;
    }
    const int64_t n = r->len - r->t < CQ - r->nb ? r->len - r->t : CQ - r->nb;
    MB_ISA_FN(mb_m3_put_rows)(c, &r->hv, h, r->tok0 + r->t, r->nb, n, r->theta, s);
    MB_ISA_FN(mb_m3_chunk_out)(c, &r->hv, h, r->nb, r->nb + n, r->tok0 + r->t, r->hT, s);
    r->nb += n;
    r->t += n;
}

/* h back into the state, and the reports of the row's last token. */
static void run_end(const m3_ctx *c, const m3_run *r, float *s)
{
    const int64_t bh = r->b * c->H + r->h, nb = r->nb;
    mb_transpose_tile(NQK, PV, r->hT, PV, r->hs, NQK);
    const mb_m3_reports *rep = c->rep;
    if (!rep)
        return;
    if (rep->h_last) {
        /* the working chunk closed as if the sequence ended: the last row's beta is +0 */
        float *hl = s + S_ST;
        MB_ISA_FN(mb_m3_fold)(&r->hv, nb, 0.0f, r->hT, hl, s);
        mb_transpose_tile(NQK, PV, hl, PV, rep->h_last + bh * PV * NQK, NQK);
    }
    if (rep->k_last)
        memcpy(rep->k_last + bh * NQK, r->hv.k + (nb - 1) * r->hv.qs, NQK * sizeof(float));
    if (rep->v_last)
        memcpy(rep->v_last + bh * PV, r->hv.v + (nb - 1) * r->hv.vs, PV * sizeof(float));
    if (rep->theta_last)
        memcpy(rep->theta_last + bh * NA, r->theta, NA * sizeof(float));
}

void MB_ISA_FN(mb_m3_project)(const mb_m3_weights *w, int64_t M, const float *xs,
                              const m3_proj *p)
{
    float *xn = p->xn, *zx = p->zx, *dt = p->dt, *sig = p->sig, *adt = p->adt, *ta = p->ta;
    const int64_t dm = w->d_model, di = 2 * dm, H = di / PV;
    const int64_t dip = 2 * di + 2 * NQK + 3 * H + NA;
    const int64_t oB = 2 * di, oC = oB + NQK, oDT = oC + NQK, oA = oDT + H, oTR = oA + H;
    const int64_t oANG = oTR + H;
    MB_ISA_FN(mb_rmsnorm_rows)(M, dm, xs, dm, w->norm_w, xn, dm);
    MB_ISA_FN(mb_gemm)(M, dip, dm, xn, dm, w->in_proj, dm, zx, dip);
    MB_ISA_FN(mb_rmsnorm_rows)(M, NQK, zx + oB, dip, w->B_norm_w, p->Bn, NQK);
    MB_ISA_FN(mb_rmsnorm_rows)(M, NQK, zx + oC, dip, w->C_norm_w, p->Cn, NQK);

    #pragma omp parallel if (M * H > (1 << 12))
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp for schedule(dynamic, 16)
        for (int64_t m = 0; m < M; m++) {
            const float *r = zx + m * dip;
            for (int64_t hh = 0; hh < H; hh++) {
                const float dA = r[oA + hh];
                float A = m3_heavy_tail(dA); /* floored at -1e-4 */
                A = A > -A_FLOOR ? -A_FLOOR : A;
                const float d = mb_softplus(r[oDT + hh] + w->dt_bias[hh]);
                dt[m * H + hh] = d;
                adt[m * H + hh] = A * d;
                sig[m * H + hh] = mb_sigmoid(r[oTR + hh]);
            }
            for (int a = 0; a < NA; a++)
                ta[m * NA + a] = mb_tanh(r[oANG + a]) * MB_PI;
        }
        mb_fpenv_exit(env);
    }
}

/* mb_m3_forward; keep (lengths NULL), when given, receives the projections. */
static int forward(const mb_m3_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                   const float *x, mb_m3_state *st, float *y, const mb_m3_reports *rep,
                   float *keep)
{
    const int64_t dm = w->d_model, di = 2 * dm, H = di / PV;
    const int64_t dip = 2 * di + 2 * NQK + 3 * H + NA;
    int nth = mb_max_threads();
    int64_t *off = malloc((size_t)(B + 1) * sizeof *off);
    m3_run *runs = malloc((size_t)(B * H) * sizeof *runs);
    if (!off || !runs) {
        free(off);
        free(runs);
        return MB_ENOMEM;
    }
    const int64_t M = mb_row_offsets(B, L, lengths, off);
    /* per-thread scratch, h^T of every (row, head), yg (M di), the projections (or,
     * when they are kept, out_proj's output (M dm), which otherwise goes over xn), and
     * the packed input and output when the batch is ragged */
    const int64_t ragged = lengths ? 2 * M * dm : 0;
    float *scr = mb_scratch_take((size_t)(nth * S_TOTAL + B * H * NQK * PV + M * di
                                          + (keep ? M * dm : m3_proj_floats(dm, M)) + ragged));
    if (!scr) {
        free(off);
        free(runs);
        return MB_ENOMEM;
    }
    memset(scr, 0, (size_t)nth * S_TOTAL * sizeof(float)); /* finite scratch rows */
    float *hTs = scr + (int64_t)nth * S_TOTAL, *yg = hTs + B * H * NQK * PV, *tail = yg + M * di;
    m3_proj p;
    if (keep)
        m3_proj_carve(&p, keep, dm, M);
    else
        tail = m3_proj_carve(&p, tail, dm, M);
    float *ob = keep ? tail : p.xn;
    const float *xs = x;
    float *ys = y;
    if (lengths) {
        mb_pack_rows(B, L, dm, off, x, tail);
        xs = tail;
        ys = tail + M * dm;
    }

    MB_ISA_FN(mb_m3_project)(w, M, xs, &p);

    /* Tasks are segments: each (row, head) runs its segments in order (a dependence),
     * and they are issued chunk by chunk, so the threads work on neighbouring tokens
     * of every head (their rows stay in cache) and a thread held up by another process
     * delays one segment, not a whole head. */
    const m3_ctx c = {w, st, rep, H, di, dip, st->buffered_tokens, st->pending,
                      p.zx, p.Bn, p.Cn, p.dt, p.sig, p.adt, p.ta, yg, NULL};
    int64_t kmax = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t k = segments(c.nb0, off[b + 1] - off[b]);
        kmax = k > kmax ? k : kmax;
    }
    #pragma omp parallel if (B * H > 1 && M * H > 64)
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp single
        for (int64_t k = 0; k < kmax; k++)
            for (int64_t task = 0; task < B * H; task++) {
                const int64_t b = task / H, len = off[b + 1] - off[b], nk = segments(c.nb0, len);
                if (k >= nk)
                    continue;
                #pragma omp task depend(inout: runs[task]) firstprivate(task, k)
                {
                    float *s = scr + (int64_t)mb_thread_num() * S_TOTAL;
                    m3_run *r = runs + task;
                    if (k == 0)
                        run_begin(&c, r, b, task % H, off[b], len, hTs + task * NQK * PV);
                    run_step(&c, r, s);
                    if (k == nk - 1)
                        run_end(&c, r, s);
                }
            }
        mb_fpenv_exit(env);
    }

    MB_ISA_FN(mb_out_residual)(M, dm, di, yg, w->out_proj, xs, ob, ys);
    if (lengths)
        mb_unpack_rows(B, L, dm, off, ys, y);
    else
        st->buffered_tokens = (st->buffered_tokens + L - 1) % CQ + 1;
    st->pending = 0;
    mb_scratch_give(scr);
    free(runs);
    free(off);
    return MB_OK;
}

int MB_ISA_FN(mb_m3_forward)(const mb_m3_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                             const float *x, mb_m3_state *st, float *y, const mb_m3_reports *rep)
{
    return forward(w, B, L, lengths, x, st, y, rep, NULL);
}

int MB_ISA_FN(mb_m3_vjp)(const mb_m3_weights *w, int64_t B, int64_t L, const float *x, float *y,
                         float *kept)
{
    const int64_t H = 2 * w->d_model / PV;
    /* a zero state: theta, h, the buffers, pending k and v */
    const int64_t per = NA + PV * NQK + QCAP * (2 * NQK + PV + 3) + NQK + PV;
    float *z = calloc((size_t)(B * H * per), sizeof(float));
    if (!z)
        return MB_ENOMEM;
    mb_m3_state st = {z, z + B * H * NA, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0};
    st.buffer_qrot = st.h + B * H * PV * NQK;
    st.buffer_krot = st.buffer_qrot + B * QCAP * H * NQK;
    st.buffer_v = st.buffer_krot + B * QCAP * H * NQK;
    st.buffer_dt = st.buffer_v + B * QCAP * H * PV;
    st.buffer_sig = st.buffer_dt + B * QCAP * H;
    st.buffer_adt = st.buffer_sig + B * QCAP * H;
    st.pending_k = st.buffer_adt + B * QCAP * H;
    st.pending_v = st.pending_k + B * H * NQK;
    const int rc = forward(w, B, L, NULL, x, &st, y, NULL, kept);
    free(z);
    return rc;
}
