/* Pieces of the Mamba-1 block (SPEC 5) shared by the forward (block1.c) and the
 * backward (back1.c), so that the backward recomputes the forward's exact bits. */
#ifndef MB_BLOCK1_H
#define MB_BLOCK1_H
#include <math.h>
#include "mamba_ref.h"
#include "isa.h"
#include "simd.h"

#define MB_M1_NS 16 /* d_state */

/* Step 5 for one (channel, n), given dA = exp(delta * A): h' = fma(dA, h, (delta * B_n) * u). */
static inline float mb_m1_h_next(float dA, float h, float delta, float bn, float u)
{
    float dBu = (delta * bn) * u;
#ifdef MB_SABOTAGE_UNFUSED_H
    return dA * h + dBu;
#else
    return fmaf(dA, h, dBu);
#endif
}

/* The same, lane by lane. */
static inline mb_vf mb_m1_h_next_v(mb_vf dA, mb_vf h, mb_vf delta, mb_vf bn, mb_vf u)
{
    const mb_vf dBu = mb_vmul(mb_vmul(delta, bn), u);
#ifdef MB_SABOTAGE_UNFUSED_H
    return mb_vadd(mb_vmul(dA, h), dBu);
#else
    return mb_vfma(dA, h, dBu);
#endif
}

/* mb_m1_front's outputs for M tokens, all of them kept by a vjp's forward for its
 * backward, laid out from p; returns the float past them. */
typedef struct {
    float *xn, *xz, *pre, *u, *xdbl, *spre, *delta;
} m1_acts;

static inline float *m1_acts_carve(m1_acts *a, float *p, int64_t dm, int64_t M)
{
    const int64_t di = 2 * dm, XR = (dm + 15) / 16 + 2 * MB_M1_NS;
    float **at[] = {&a->xn, &a->xz, &a->pre, &a->u, &a->xdbl, &a->spre, &a->delta};
    const int64_t sz[] = {M * dm, 2 * M * di, M * di, M * di, M * XR, M * di, M * di};
    for (int i = 0; i < 7; i++) {
        *at[i] = p;
        p += sz[i];
    }
    return p;
}

static inline int64_t m1_acts_floats(int64_t dm, int64_t M)
{
    m1_acts a;
    return m1_acts_carve(&a, (float *)0, dm, M) - (float *)0;
}

/* Steps 1-4 for the M packed tokens of B rows (row b at [off[b], off[b + 1])): xn (M, dm),
 * xz (M, 2 di), u (M, di), xdbl (M, R + 32), delta (M, di). window (B, di, 4) is each
 * row's carried conv window, updated. pre (M, di), the conv outputs before silu, and
 * spre (M, di), dt_proj's output plus bias before softplus, are written when not NULL. */
void MB_ISA_FN(mb_m1_front)(const mb_m1_weights *w, int64_t B, const int64_t *off,
                            const float *x, float *xn, float *xz, float *window, float *pre,
                            float *u, float *xdbl, float *spre, float *delta);

#endif
