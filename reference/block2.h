/* What the Mamba-2 forward shares with its backward (back2.c): the forward run on a
 * given state with copies of the activations the backward differentiates. */
#ifndef MB_BLOCK2_H
#define MB_BLOCK2_H
#include "mamba_ref.h"
#include <string.h>
#include "isa.h"

#define MB_M2_NS 128 /* d_state */
#define MB_M2_HP 64  /* head dim */
#ifdef MB_SABOTAGE_CHUNK128
#define MB_M2_Q 128
#else
#define MB_M2_Q 256  /* chunk size: part of the arithmetic */
#endif
#define MB_M2_BUFROWS 256 /* rows of the state buffers */

/* Buffers for M tokens (packed, row-major b then t) of a call without lengths:
 * zxd (M, 2 di + 256 + H) in_proj's output; pre (M, di + 256) the conv outputs before
 * silu; u (M, di + 256) post-conv post-silu xBC;
 * G (M, Q) with G[t][j] = C_t . B_j over the chunk's rows j <= t (others unset);
 * Y (M, di) the SSD output before the gate, g (M, di) the gated Y * silu(z); hck (B, H, ceil(L / Q), 128, 64) the state
 * entering each chunk, transposed (h[n][p]); xn (M, d_model) the block norm's output.
 * The fold of each row's last chunk is not computed (nothing reads the state after). */
typedef struct {
    float *zxd, *pre, *u, *G, *Y, *g, *hck, *xn;
} m2_acts;

/* The m2_acts of B rows of L tokens laid out from p, each a whole number of cache
 * lines; returns the float past them (m2_acts_floats after p). */
static inline float *m2_acts_carve(m2_acts *a, float *p, int64_t dm, int64_t B, int64_t L)
{
    const int64_t di = 2 * dm, H = di / MB_M2_HP, CD = di + 2 * MB_M2_NS, NP = di + CD + H;
    const int64_t M = B * L, nk = (L + MB_M2_Q - 1) / MB_M2_Q;
    float **at[] = {&a->zxd, &a->pre, &a->u, &a->G, &a->Y, &a->g, &a->hck, &a->xn};
    const int64_t sz[] = {M * NP, M * CD, M * CD, M * MB_M2_Q, M * di, M * di,
                          B * H * nk * MB_M2_NS * MB_M2_HP, M * dm};
    for (int i = 0; i < 8; i++) {
        *at[i] = p;
        p += (sz[i] + 15) & ~(int64_t)15;
    }
    return p;
}

static inline int64_t m2_acts_floats(int64_t dm, int64_t B, int64_t L)
{
    m2_acts a;
    return m2_acts_carve(&a, (float *)0, dm, B, L) - (float *)0;
}

/* A zero state of B rows laid out from p (m2_state_floats of them, zeroed here), its
 * buffered-token counts in cnt (B of them, zeroed here). */
static inline int64_t m2_state_floats(int64_t dm, int64_t B)
{
    const int64_t di = 2 * dm, H = di / MB_M2_HP, CD = di + 2 * MB_M2_NS;
    return B * (CD * 4 + H * MB_M2_HP * MB_M2_NS + MB_M2_BUFROWS * (CD + H));
}

static inline mb_m2_state m2_zero_state(float *p, int64_t *cnt, int64_t dm, int64_t B)
{
    const int64_t di = 2 * dm, H = di / MB_M2_HP, CD = di + 2 * MB_M2_NS;
    memset(p, 0, (size_t)m2_state_floats(dm, B) * sizeof(float));
    memset(cnt, 0, (size_t)B * sizeof *cnt);
    const mb_m2_state st = {p, p + B * CD * 4, p + B * CD * 4 + B * H * MB_M2_HP * MB_M2_NS,
                            p + B * CD * 4 + B * H * MB_M2_HP * MB_M2_NS + B * MB_M2_BUFROWS * CD,
                            cnt};
    return st;
}

/* out[r * ldo + c] = dot v1 over k < K (<= 8192) of a[r * sar + k * sak] * b[k * ldb + c]
 * for r < R <= MB_M2_TR and the 64 columns c: the SSD's register-tiled kernel. */
#define MB_M2_TR 6
void MB_ISA_FN(mb_m2_mm64)(int R, int64_t K, const float *a, int64_t sar, int64_t sak,
                           const float *b, int64_t ldb, float *out, int64_t ldo);

/* The forward from st, which holds no buffered tokens, into acts (whose u and G hold
 * the SSD's working rows); st's buffers are left unset. */
int MB_ISA_FN(mb_m2_acts)(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                          const mb_m2_state *st, const m2_acts *acts);

#endif
