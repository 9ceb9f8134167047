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

/* Steps 1-4 for the M packed tokens of B rows (row b at [off[b], off[b + 1])): xn (M, dm),
 * xz (M, 2 di), u (M, di), xdbl (M, R + 32), delta (M, di). window (B, di, 4) is each
 * row's carried conv window, updated. pre (M, di), the conv outputs before silu, and
 * spre (M, di), dt_proj's output plus bias before softplus, are written when not NULL. */
void MB_ISA_FN(mb_m1_front)(const mb_m1_weights *w, int64_t B, const int64_t *off,
                            const float *x, float *xn, float *xz, float *window, float *pre,
                            float *u, float *xdbl, float *spre, float *delta);

#endif
