/* Mamba-2 (SSD) block, profile identical.mamba2.fp32.v1 (SPEC section 6).
 *
 * Each row is seen as one extended sequence: the open chunk's buffered rows (from the
 * state) followed by the new tokens, cut into chunks of Q on that absolute grid. Chunk
 * 0 lives in the state buffers themselves (new rows are appended there in place, so a
 * decode step copies nothing); later chunks live in scratch, and whatever chunk is
 * left open at the end is moved into the state buffers. Every output and every fold
 * is evaluated by the same per-row formulas whatever the split, so prefill, split
 * prefill and decode agree bit for bit.
 *
 * Phases: norm + in_proj (mb_gemm); conv + silu; G = C . B^T per output row (mb_gemm,
 * shared by all heads since ngroups = 1); the SSD per (row, head), serial over chunks;
 * gate, gated norm, out_proj, residual. */
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "mamba_ref.h"
#include "numerics.h"
#include "gemm.h"
#include "ops.h"
#include "fpenv.h"
#include "block2.h"
#include "scratch.h"
#include "tile.h"

#define NS MB_M2_NS
#define HP MB_M2_HP
#define BUFROWS MB_M2_BUFROWS
#define CQ MB_M2_Q
#define TR MB_M2_TR   /* rows per register tile */
#define GB 64        /* output rows per G task */
#define CB 256       /* channels per conv task */

/* Columns per tile: all 64 under AVX-512 (4 x 6 accumulators), 16 elsewhere. */
#if MB_VW == 16
#define MMV 4
#else
#define MMV 2
#endif

/* out[r][c] = dot v1 over k < K of a[r*sar + k*sak] * b[k*ldb + c], for r < R <= TR and
 * the HP columns c: one ascending fmaf chain from +0 per output (K <= CQ: one leaf). */
static void mm64(int R, int64_t K, const float *a, int64_t sar, int64_t sak,
                 const float *b, int64_t ldb, float *out, int64_t ldo)
{
    const float *ar[TR]; /* rows past R repeat the last one; their outputs are dropped */
    for (int r = 0; r < TR; r++) ar[r] = a + (r < R ? r : R - 1) * sar;
    for (int c = 0; c < HP; c += MMV * MB_VW)
        mb_tile(TR, MMV, K, 0, ar, sak, b + c, ldb, out + c, ldo, R);
}

void MB_ISA_FN(mb_m2_mm64)(int R, int64_t K, const float *a, int64_t sar, int64_t sak,
                           const float *b, int64_t ldb, float *out, int64_t ldo)
{
    mm64(R, K, a, sar, sak, b, ldb, out, ldo);
}

/* Continue one row's chains of mm64 over k in [k0, k1). */
static void mm64_more(const float *a, int64_t sak, int64_t k0, int64_t k1,
                      const float *b, int64_t ldb, float *out)
{
    for (int64_t k = k0; k < k1; k++) {
        const float av = a[k * sak], *bk = b + k * ldb;
        for (int c = 0; c < HP; c++) out[c] = fmaf(av, bk[c], out[c]);
    }
}

/* s[j] = seg[i][j] for j <= i, given s holding row *row < i (or *row == i). seg[i][j] is
 * the serial ascending sum of dA[j+1..i] from +0, so row i is row i - 1 plus dA[i]. */
static void seg_row(float *s, const float *dA, int64_t *row, int64_t i)
{
#ifdef MB_SABOTAGE_SEGSUM_DESCENDING
    s[i] = 0.0f;
    for (int64_t j = i - 1; j >= 0; j--) s[j] = s[j + 1] + dA[j + 1];
#else
    for (int64_t ii = *row + 1; ii <= i; ii++) {
        const float d = dA[ii];
        for (int64_t j = 0; j < ii; j++) s[j] = s[j] + d;
        s[ii] = 0.0f;
    }
#endif
    *row = i;
}

/* hout = fma(exp(cs[n-1]), hT, S) with S[m][p] = sum_j (B_j[m] exp(cs[n-1] - cs[j])) Xd[j][p],
 * the fold of a chunk's first n rows into the state. hT, ST (scratch for S) and hout
 * are (NS, HP); hout may be hT or ST. */
static void fold(int64_t n, const float *Bm, int64_t ldu, const float *cs, const float *Xd,
                 float *Bd, float *ST, const float *hT, float *hout)
{
    const float last = cs[n - 1];
    for (int64_t j = 0; j < n; j++) {
        const float dec = mb_exp(last - cs[j]);
        for (int m = 0; m < NS; m++) Bd[j * NS + m] = Bm[j * ldu + m] * dec;
    }
    for (int m0 = 0; m0 < NS; m0 += TR)
        mm64(NS - m0 < TR ? NS - m0 : TR, n, Bd + m0, 1, NS, Xd, HP, ST + m0 * HP, HP);
    const float e = mb_exp(last);
    for (int i = 0; i < NS * HP; i++)
#ifdef MB_SABOTAGE_UNFUSED_STATE
        hout[i] = e * hT[i] + ST[i];
#else
        hout[i] = fmaf(e, hT[i], ST[i]);
#endif
}

/* dst (rows, cols) = src^T, src (cols, rows). */
static void transpose(int64_t rows, int64_t cols, const float *src, float *dst)
{
    mb_transpose_tile(cols, rows, src, rows, dst, cols);
}

/* Per-thread scratch of the SSD and the report, in floats. */
#define SSD_SCRATCH (4 * CQ + CQ * HP + TR * CQ + CQ * NS + 2 * NS * HP + 2 * TR * HP)

typedef struct { float *dt, *dA, *cs, *s, *Xd, *Mt, *Bd, *hT, *ST, *yd, *yo; } ssd_scr;

static ssd_scr scr_split(float *p)
{
    ssd_scr r;
    r.dt = p; r.dA = r.dt + CQ; r.cs = r.dA + CQ; r.s = r.cs + CQ; r.Xd = r.s + CQ;
    r.Mt = r.Xd + CQ * HP; r.Bd = r.Mt + TR * CQ; r.hT = r.Bd + CQ * NS; r.ST = r.hT + NS * HP;
    r.yd = r.ST + NS * HP; r.yo = r.yd + TR * HP;
    return r;
}

/* For head h and a chunk's first n rows (xBC rows u, raw dt rows dtr): dt, dA = dt * A,
 * the serial inclusive cumsum cs from +0, and Xd = x * dt. */
static void chunk_prep(int64_t n, const float *u, int64_t CD, const float *dtr, int64_t H,
                       int64_t h, const mb_m2_weights *w, const ssd_scr *q)
{
    const float A = -mb_exp(w->A_log[h]), bias = w->dt_bias[h];
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        q->dt[i] = mb_clamp(mb_softplus(dtr[i * H + h] + bias), w->dt_lo, w->dt_hi);
        q->dA[i] = q->dt[i] * A;
        acc = acc + q->dA[i];
        q->cs[i] = acc;
    }
    for (int64_t i = 0; i < n; i++)
        for (int p = 0; p < HP; p++) q->Xd[i * HP + p] = u[i * CD + h * HP + p] * q->dt[i];
}

typedef struct {
    int64_t di, H, CD;
    const int64_t *off, *t0, *eoff; /* token offsets, buffered rows, scratch-chunk rows */
    float *ext_u, *ext_dtr;         /* chunks >= 1 of every row */
    float *u;                       /* NULL, or (tokens, CD): every chunk's rows (m2_acts) */
    const float *G;                 /* (tokens, CQ): G[token][j] */
    const float *z;                 /* (tokens, NP): in_proj's output, z first */
    int64_t NP;
    float *yb;                      /* (tokens, di): the gated output Y * silu(z) */
    float *ypre;                    /* NULL, or (tokens, di): Y before the gate */
    float *hck;                     /* NULL, or the state entering each chunk (m2_acts) */
    int64_t nkmax;                  /* chunks per (row, head) in hck */
} m2_ctx;

static float *chunk_u(const m2_ctx *c, const mb_m2_state *st, int64_t b, int64_t k)
{
    if (c->u)
        return c->u + (c->off[b] + k * CQ) * c->CD;
    return k ? c->ext_u + (c->eoff[b] + (k - 1) * CQ) * c->CD : st->buffer_xbc + b * BUFROWS * c->CD;
}

static float *chunk_dtr(const m2_ctx *c, const mb_m2_state *st, int64_t b, int64_t k)
{
    return k ? c->ext_dtr + (c->eoff[b] + (k - 1) * CQ) * c->H : st->buffer_dtraw + b * BUFROWS * c->H;
}

/* Chunks of row b's extended sequence (buffered rows, then the new tokens). */
static int64_t row_chunks(const m2_ctx *c, int64_t b)
{
    return (c->t0[b] + (c->off[b + 1] - c->off[b]) + CQ - 1) / CQ;
}

/* The SSD of chunk k of one (row, head), the chunks of a (row, head) taken in order:
 * gated outputs into yb, h^T (NS, HP) entering the chunk in hT, left leaving it. */
static void ssd_chunk(const m2_ctx *c, const mb_m2_weights *w, const mb_m2_state *st,
                      int64_t b, int64_t h, int64_t k, const ssd_scr *q, float *hT)
{
    const int64_t di = c->di, H = c->H, CD = c->CD, t0 = c->t0[b];
    const int64_t T = t0 + (c->off[b + 1] - c->off[b]);
    const float Dh = w->D[h];
    float *s = q->s, *Mt = q->Mt, *yd = q->yd, *yo = q->yo;
    {
        const int64_t n = T - k * CQ < CQ ? T - k * CQ : CQ, r0 = k ? 0 : t0;
        const float *u = chunk_u(c, st, b, k);
        chunk_prep(n, u, CD, chunk_dtr(c, st, b, k), H, h, w, q);
        if (c->hck)
            memcpy(c->hck + ((b * H + h) * c->nkmax + k) * NS * HP, hT, NS * HP * sizeof(float));

        int64_t row = 0;
        s[0] = 0.0f;
        for (int64_t i0 = r0; i0 < n; i0 += TR) {
            const int R = n - i0 < TR ? (int)(n - i0) : TR;
            const int64_t tok = c->off[b] + k * CQ + i0 - t0;
            for (int r = 0; r < R; r++) {
                const int64_t i = i0 + r;
                const float *g = c->G + (tok + r) * CQ;
                float *mr = Mt + r * CQ;
                seg_row(s, q->dA, &row, i);
                for (int64_t j = 0; j <= i; j += MB_VW) {
                    const int nn = i + 1 - j < MB_VW ? (int)(i + 1 - j) : MB_VW;
                    mb_vstn(mr + j, mb_vmul(mb_vldn(g + j, nn), mb_vexp(mb_vldn(s + j, nn))), nn);
                }
            }
            /* Y_diag: the chains common to the tile, then each row's causal rest */
            mm64(R, i0 + 1, Mt, CQ, 1, q->Xd, HP, yd, HP);
            for (int r = 1; r < R; r++)
                mm64_more(Mt + r * CQ, 1, i0 + 1, i0 + r + 1, q->Xd, HP, yd + r * HP);
            /* Y_off: C_i . h_prev, contracted over the state first */
            mm64(R, NS, u + i0 * CD + di + NS, CD, 1, hT, HP, yo, HP);
            for (int r = 0; r < R; r++) {
                const int64_t i = i0 + r;
                const float e = mb_exp(q->cs[i]), *xr = u + i * CD + h * HP;
                const float *zr = c->z + (tok + r) * c->NP + h * HP;
                float *yr = c->yb + (tok + r) * di + h * HP;
                float *yp = c->ypre ? c->ypre + (tok + r) * di + h * HP : yr;
                for (int p = 0; p < HP; p++)
                    yp[p] = (yd[r * HP + p] + yo[r * HP + p] * e) + xr[p] * Dh;
                for (int p = 0; p < HP; p += MB_VW)
                    mb_vst(yr + p, mb_vmul(mb_vld(yp + p), mb_vsilu(mb_vld(zr + p))));
            }
        }
        if (n == CQ && !(c->hck && k == row_chunks(c, b) - 1)) /* under acts, only states entering a chunk */
            fold(n, u + di, CD, q->cs, q->Xd, q->Bd, q->ST, hT, hT);
    }
}

typedef struct { int64_t b, k, i0, i1; } g_task;

/* The forward; acts (NULL in plain calls) receives copies of the activations the
 * backward reads, and then y (NULL: stop at the activations) comes from them. */
static int m2_run(const mb_m2_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, const mb_m2_state *st, float *y, const m2_acts *acts)
{
    const int64_t dm = w->d_model, di = 2 * dm, H = di / HP, CD = di + 2 * NS, NP = di + CD + H;
    const int nth = mb_max_threads();
    int64_t *ib = malloc((size_t)(4 * B + 3) * sizeof *ib);
    if (!ib)
        return MB_ENOMEM;
    int64_t *off = ib, *t0 = off + B + 1, *eoff = t0 + B;
    const int64_t M = mb_row_offsets(B, L, lengths, off);
    int64_t nchunks = 0, work = 0;
    eoff[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        t0[b] = st->buffered_tokens[b];
        const int64_t T = t0[b] + off[b + 1] - off[b];
        eoff[b + 1] = eoff[b] + (T > CQ ? T - CQ : 0);
        nchunks += (T + CQ - 1) / CQ;
        work += T;
    }
    const int64_t E = eoff[B], ngt = nchunks * ((CQ + GB - 1) / GB);
    /* one allocation: xn/out (M dm), zxd (M NP), yb (M di), G (M CQ), the scratch chunks
     * (E (CD + H)) (under acts, the activations hold all but the chunks' dt, and y's
     * normed rows and out_proj's output take M (di + dm)), per-thread SSD scratch, and
     * the packed input and output if ragged */
    const int64_t ragged = lengths ? 2 * M * dm : 0;
    const int64_t own = acts ? (y ? di + dm : 0) : dm + NP + di + CQ;
    const int64_t eu = acts ? 0 : CD;
    const int64_t nf = M * own + E * (eu + H) + (int64_t)nth * SSD_SCRATCH
                       + B * H * NS * HP + ragged;
    float *buf = mb_scratch_take((size_t)nf);
    g_task *gt = malloc((size_t)ngt * sizeof *gt);
    if (!buf || !gt) {
        mb_scratch_give(buf);
        free(gt);
        free(ib);
        return MB_ENOMEM;
    }
    float *xn = acts ? acts->xn : buf, *ext_u = buf + M * own, *ext_dtr = ext_u + E * eu;
    float *ob = acts ? buf + M * di : xn; /* out_proj's output */
    float *hTs = ext_dtr + E * H;
    float *zxd = acts ? acts->zxd : xn + M * dm, *yb = acts ? acts->g : zxd + M * NP;
    float *gn = acts ? buf : yb; /* the gated norm's output */
    float *G = acts ? acts->G : yb + M * di;
    float *scr = hTs + B * H * NS * HP;
    const float *xs = x;
    float *ys = y;
    if (lengths) {
        float *xp = scr + (int64_t)nth * SSD_SCRATCH;
        mb_pack_rows(B, L, dm, off, x, xp);
        xs = xp;
        ys = xp + M * dm;
    }
    const m2_ctx c = {di, H, CD, off, t0, eoff, ext_u, ext_dtr, acts ? acts->u : NULL, G, zxd, NP, yb,
                      acts ? acts->Y : NULL,
                      acts ? acts->hck : NULL, acts ? (L + CQ - 1) / CQ : 0};

    MB_ISA_FN(mb_rmsnorm_rows)(M, dm, xs, dm, w->block_norm_w, xn, dm);
    MB_ISA_FN(mb_gemm)(M, NP, dm, xn, dm, w->in_proj, dm, zxd, NP);

    /* conv + silu over xBC into the chunk storage (chunk 0 in the state buffer), and the
     * raw dt rows beside it; tasks are (row, channel block) */
    const int64_t ncb = (CD + CB - 1) / CB;
    #pragma omp parallel for schedule(dynamic) if (M * CD > (1 << 15))
    for (int64_t task = 0; task < B * ncb; task++) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t b = task / ncb, c0 = task % ncb * CB, nc = CD - c0 < CB ? CD - c0 : CB;
        const int64_t len = off[b + 1] - off[b], n0 = (CQ - t0[b] < len ? CQ - t0[b] : len);
        const float *in = zxd + off[b] * NP + di + c0;
        float *win = st->conv_window + (b * CD + c0) * 4;
        float *pre = acts ? acts->pre + off[b] * CD + c0 : NULL;
        MB_ISA_FN(mb_conv_silu_pre)(n0, nc, in, NP, win, w->conv_w + c0 * 4, w->conv_b + c0, pre, CD,
                                    chunk_u(&c, st, b, 0) + t0[b] * CD + c0, CD);
        if (len > n0)
            MB_ISA_FN(mb_conv_silu_pre)(len - n0, nc, in + n0 * NP, NP, win, w->conv_w + c0 * 4,
                                        w->conv_b + c0, pre ? pre + n0 * CD : NULL, CD,
                                        chunk_u(&c, st, b, 1) + c0, CD);
        if (c0 == 0)
            for (int64_t s = 0; s < len; s++) {
                const int64_t e = t0[b] + s;
                float *d = e < CQ ? st->buffer_dtraw + (b * BUFROWS + e) * H
                                  : ext_dtr + (eoff[b] + e - CQ) * H;
                memcpy(d, zxd + (off[b] + s) * NP + di + CD, (size_t)H * sizeof(float));
            }
        mb_fpenv_exit(env);
    }

    /* G rows of every output token, over j up to the end of its row block only */
    int64_t ng = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t T = t0[b] + off[b + 1] - off[b];
        for (int64_t k = 0; k * CQ < T; k++) {
            const int64_t n = T - k * CQ < CQ ? T - k * CQ : CQ;
            for (int64_t i0 = k ? 0 : t0[b]; i0 < n; i0 += GB)
                gt[ng++] = (g_task){b, k, i0, i0 + GB < n ? i0 + GB : n};
        }
    }
    #pragma omp parallel for schedule(dynamic) if (M * CQ * NS > (1 << 18))
    for (int64_t i = 0; i < ng; i++) {
        mb_fpenv env = mb_fpenv_enter();
        const g_task g = gt[i];
        const float *u = chunk_u(&c, st, g.b, g.k);
        const int64_t tok = off[g.b] + g.k * CQ + g.i0 - t0[g.b];
        MB_ISA_FN(mb_gemm)(g.i1 - g.i0, g.i1, NS, u + g.i0 * CD + di + NS, CD, u + di, CD,
                           G + tok * CQ, CQ);
        mb_fpenv_exit(env);
    }

    /* Tasks are chunks: each (row, head) runs its chunks in order (a dependence on its
     * h^T), issued chunk by chunk so that the threads share the chunk's rows in cache
     * and a thread held up by another process delays one chunk, not a whole head. */
    int64_t kmax = 0;
    for (int64_t b = 0; b < B; b++)
        kmax = row_chunks(&c, b) > kmax ? row_chunks(&c, b) : kmax;
    #pragma omp parallel if (B * H > 1 && work * di > (1 << 15))
    {
        mb_fpenv env = mb_fpenv_enter();
        #pragma omp single
        for (int64_t k = 0; k < kmax; k++)
            for (int64_t task = 0; task < B * H; task++) {
                const int64_t b = task / H, h = task % H, nk = row_chunks(&c, b);
                if (k >= nk)
                    continue;
                float *hT = hTs + task * NS * HP, *hs = st->h + task * HP * NS;
                #pragma omp task depend(inout: hT[0]) firstprivate(b, h, k, nk, hT, hs)
                {
                    const ssd_scr q = scr_split(scr + (int64_t)mb_thread_num() * SSD_SCRATCH);
                    if (k == 0)
                        transpose(NS, HP, hs, hT);
                    ssd_chunk(&c, w, st, b, h, k, &q, hT);
                    if (k == nk - 1 && !acts) /* acts' state is discarded */
                        transpose(HP, NS, hT, hs);
                }
            }
        mb_fpenv_exit(env);
    }
    /* the open chunk goes to the state buffers; once a chunk has closed, the rows past
     * it are zeroed so the buffers' bytes depend only on the sequence (not under acts,
     * whose state is discarded) */
    for (int64_t b = 0; b < B && !acts; b++) {
        const int64_t T = t0[b] + off[b + 1] - off[b], r = T % CQ;
        if (T >= CQ) {
            float *bx = st->buffer_xbc + b * BUFROWS * CD, *bd = st->buffer_dtraw + b * BUFROWS * H;
            if (r) {
                const int64_t k = T / CQ;
                memcpy(bx, chunk_u(&c, st, b, k), (size_t)(r * CD) * sizeof(float));
                memcpy(bd, chunk_dtr(&c, st, b, k), (size_t)(r * H) * sizeof(float));
            }
            memset(bx + r * CD, 0, (size_t)((BUFROWS - r) * CD) * sizeof(float));
            memset(bd + r * H, 0, (size_t)((BUFROWS - r) * H) * sizeof(float));
        }
        st->buffered_tokens[b] = r;
    }

    /* the SSD gated its outputs (g = Y * silu(z)); RMSNorm over di (in place but for
     * kept activations), out_proj, residual */
    if (y) {
        MB_ISA_FN(mb_rmsnorm_rows)(M, di, yb, di, w->norm_w, gn, di);
        MB_ISA_FN(mb_out_residual)(M, dm, di, gn, w->out_proj, xs, ob, ys);
        if (lengths)
            mb_unpack_rows(B, L, dm, off, ys, y);
    }
    free(gt);
    mb_scratch_give(buf);
    free(ib);
    return MB_OK;
}

int MB_ISA_FN(mb_m2_forward)(const mb_m2_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                             const float *x, const mb_m2_state *st, float *y)
{
    return m2_run(w, B, L, lengths, x, st, y, NULL);
}

int MB_ISA_FN(mb_m2_acts)(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                          const mb_m2_state *st, const m2_acts *acts)
{
    return m2_run(w, B, L, NULL, x, st, NULL, acts);
}

int MB_ISA_FN(mb_m2_vjp)(const mb_m2_weights *w, int64_t B, int64_t L, const float *x, float *y,
                         float *kept)
{
    const int64_t dm = w->d_model;
    float *z = malloc((size_t)m2_state_floats(dm, B) * sizeof(float));
    int64_t *cnt = malloc((size_t)B * sizeof *cnt);
    m2_acts a;
    m2_acts_carve(&a, kept, dm, B, L);
    int rc = MB_ENOMEM;
    if (z && cnt) {
        const mb_m2_state st = m2_zero_state(z, cnt, dm, B);
        rc = m2_run(w, B, L, NULL, x, &st, y, &a);
    }
    free(cnt);
    free(z);
    return rc;
}

int MB_ISA_FN(mb_m2_h_last)(const mb_m2_weights *w, int64_t B, const mb_m2_state *st, float *h_last)
{
    const int64_t di = 2 * w->d_model, H = di / HP, CD = di + 2 * NS;
    float *scr = mb_scratch_take((size_t)mb_max_threads() * SSD_SCRATCH);
    if (!scr)
        return MB_ENOMEM;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++)
        work += st->buffered_tokens[b];
    #pragma omp parallel if (B * H > 1 && work * di > (1 << 15))
    {
        mb_fpenv env = mb_fpenv_enter();
        const ssd_scr q = scr_split(scr + (int64_t)mb_thread_num() * SSD_SCRATCH);
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * H; task++) {
            const int64_t b = task / H, h = task % H, n = st->buffered_tokens[b];
            const float *hs = st->h + task * HP * NS;
            float *out = h_last + task * HP * NS;
            if (!n) {
                memcpy(out, hs, HP * NS * sizeof(float));
                continue;
            }
            const float *u = st->buffer_xbc + b * BUFROWS * CD;
            chunk_prep(n, u, CD, st->buffer_dtraw + b * BUFROWS * H, H, h, w, &q);
            transpose(NS, HP, hs, q.hT);
            fold(n, u + di, CD, q.cs, q.Xd, q.Bd, q.ST, q.hT, q.ST);
            transpose(HP, NS, q.ST, out);
        }
        mb_fpenv_exit(env);
    }
    mb_scratch_give(scr);
    return MB_OK;
}
