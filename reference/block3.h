/* What the Mamba-3 forward (block3.c) shares with its backward (back3.c): the chunk
 * arithmetic on views of rows, so that the backward recomputes the forward's bits. */
#ifndef MB_BLOCK3_H
#define MB_BLOCK3_H
#include "mamba_ref.h"
#include "isa.h"

#define NQK MB_M3_N   /* q/k head dimension */
#define PV MB_M3_P    /* v head dimension */
#define NA MB_M3_R    /* rotary angles */
#define QCAP MB_M3_Q  /* buffer rows */
#ifdef MB_SABOTAGE_CHUNK32
#define CQ 32
#else
#define CQ MB_M3_Q    /* chunk size: part of the arithmetic */
#endif
#define A_FLOOR 1e-4f

/* Per-thread scratch, in floats. */
enum {
    S_HT = 0,                   /* h^T (NQK, PV) of the working chunk */
    S_KST = S_HT + NQK * PV,    /* scaled k^T (NQK, QCAP): operand of q.k^T */
    S_KS = S_KST + NQK * QCAP,  /* scaled k (QCAP, NQK): operand of the fold */
    S_ST = S_KS + QCAP * NQK,   /* fold result (NQK, PV) */
    S_VD = S_ST + NQK * PV,     /* decayed v (QCAP, PV) */
    S_G = S_VD + QCAP * PV,     /* q.k^T (QCAP, QCAP) */
    S_LM = S_G + QCAP * QCAP,   /* exp(seg) below the diagonal */
    S_MM = S_LM + QCAP * QCAP,  /* (q.k^T) * Lm */
    S_YS = S_MM + QCAP * QCAP,  /* q.h^T (QCAP, PV) */
    S_YI = S_YS + QCAP * PV,    /* intra-chunk output (QCAP, PV) */
    S_CS = S_YI + QCAP * PV,    /* dA_cs */
    S_SEG = S_CS + QCAP,        /* one row of seg */
    S_QKG = S_SEG + QCAP,       /* qk_gamma per row */
    S_QB = S_QKG + QCAP,        /* biased, unrotated q and k of the segment's rows */
    S_KB = S_QB + QCAP * NQK,
    S_TOTAL = S_KB + QCAP * NQK
};

typedef struct {
    const mb_m3_weights *w;
    const mb_m3_state *st;
    const mb_m3_reports *rep;
    int64_t H, di, dip, nb0;
    int pending;
    const float *zx;               /* (M, dip) in_proj output of the packed tokens */
    const float *Bn, *Cn;          /* (M, NQK) normed B and C, before the biases */
    const float *dt, *sig, *adt;   /* (M, H) */
    const float *ta;               /* (M, NA) tanh(angle) * PI */
    float *yg;                     /* (M, di) gated mixer output */
    float *ypre;                   /* (M, di) the output before the gate, or NULL */
} m3_ctx;

/* One head of one row: views of its buffer rows (row j at base + j * stride). */
typedef struct {
    float *q, *k, *v, *dt, *sig, *adt;
    int64_t qs, vs, ss;
    float *rot;                    /* NULL, or row j's cos and sin at rot + j * 2 NA */
} m3_head;

/* The shifted trapezoid term dt * (1 - sig) of the token after a row. */
static inline float beta_of(float dt, float sig)
{
#ifdef MB_SABOTAGE_NO_SHIFT
    (void)dt;
    (void)sig;
    return 0.0f;
#else
    return dt * (1.0f - sig);
#endif
}

/* scale_j = gamma_j + beta_j of buffer row j, the next row's dt and sig giving beta. */
static inline float scale_of(const m3_head *hv, int64_t j)
{
    return hv->dt[j * hv->ss] * hv->sig[j * hv->ss]
        + beta_of(hv->dt[(j + 1) * hv->ss], hv->sig[(j + 1) * hv->ss]);
}

/* Serial inclusive cumsum of A*dt over buffer rows [0, n), seeded +0. */
static inline void cumsum_adt(const m3_head *hv, int64_t n, float *cs)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        acc = acc + hv->adt[i * hv->ss];
        cs[i] = acc;
    }
}

/* upstream main's heavy-tail A before its floor: -(x >= 0 ? 1 + x : 1 / (1 - x)) */
static inline float m3_heavy_tail(float x)
{
    return -(x >= 0.0f ? 1.0f + x : 1.0f / (1.0f - x));
}

#define UP16(n) (((n) + 15) & ~(int64_t)15)

/* C[m*ldc + n] = dot v1 over k < K0 + m*dK of A[m*sam + k*sak] and B[k*ldb + n], for
 * m < M and n < N (N a multiple of 16); strides may be negative. */
void MB_ISA_FN(mb_m3_mm)(int64_t M, int64_t N, int64_t K0, int64_t dK,
                         const float *A, int64_t sam, int64_t sak,
                         const float *B, int64_t ldb, float *C, int64_t ldc);

/* The per-token inputs of M packed tokens (mb_m3_project's outputs): xn (M, dm) the
 * normed input, zx (M, dip) in_proj's output, Bn, Cn (M, NQK), dt, sig, adt (M, H),
 * ta (M, NA). A vjp's forward leaves them for its backward. */
typedef struct {
    float *xn, *zx, *Bn, *Cn, *dt, *sig, *adt, *ta;
} m3_proj;

static inline int64_t m3_proj_floats(int64_t dm, int64_t M)
{
    const int64_t H = 2 * dm / PV, dip = 4 * dm + 2 * NQK + 3 * H + NA;
    return M * (dm + dip + 2 * NQK + 3 * H + NA);
}

/* The m3_proj of M tokens laid out from p; returns the float past it. */
static inline float *m3_proj_carve(m3_proj *q, float *p, int64_t dm, int64_t M)
{
    const int64_t H = 2 * dm / PV, dip = 4 * dm + 2 * NQK + 3 * H + NA;
    q->xn = p; p += M * dm;
    q->zx = p; p += M * dip;
    q->Bn = p; p += M * NQK;
    q->Cn = p; p += M * NQK;
    q->dt = p; p += M * H;
    q->sig = p; p += M * H;
    q->adt = p; p += M * H;
    q->ta = p; p += M * NA;
    return p;
}

void MB_ISA_FN(mb_m3_project)(const mb_m3_weights *w, int64_t M, const float *xs,
                              const m3_proj *p);

/* out = h folded over buffer rows [0, n), the last row's beta given (hT, out (NQK, PV),
 * may alias). */
void MB_ISA_FN(mb_m3_fold)(const m3_head *hv, int64_t n, float beta_last, const float *hT,
                           float *out, float *s);

/* Tokens [tok0, tok0 + n) of head h into rows [i0, i0 + n) of hv (angles stepped in
 * theta), qk_gamma into s[S_QKG + row]. */
void MB_ISA_FN(mb_m3_put_rows)(const m3_ctx *c, const m3_head *hv, int64_t h, int64_t tok0,
                               int64_t i0, int64_t n, float *theta, float *s);

/* Outputs of rows [r0, r1) (rows [0, r1) filled, qk_gamma in s), token r0 at packed
 * index tok0, h entering the chunk in hT. Leaves cs, G, Lm, Mm, Ys (before exp(cs))
 * and Yi of those rows in s. */
void MB_ISA_FN(mb_m3_chunk_out)(const m3_ctx *c, const m3_head *hv, int64_t h, int64_t r0,
                                int64_t r1, int64_t tok0, const float *hT, float *s);

#endif
