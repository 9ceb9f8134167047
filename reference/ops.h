/* Building blocks shared by the block files (each compiled per ISA, see isa.h). */
#ifndef MB_OPS_H
#define MB_OPS_H
#include <stdint.h>
#include "isa.h"

#define MB_EPS 1e-5f

/* out[m] = (x[m] * rsqrt(dot(x[m], x[m]) / n + eps)) * w, for M rows of n. */
void MB_ISA_FN(mb_rmsnorm_rows)(int64_t M, int64_t n, const float *x, int64_t ldx,
                                const float *w, float *out, int64_t ldo);

/* Causal depthwise conv (4 taps, oldest first, bias-seeded fma chain) then silu,
 * over one sequence of len tokens and C channels. in[t * ldi + c] are the pre-conv
 * inputs; window (C, 4) holds the four inputs before this call (oldest first) and
 * is updated to the last four. u[t * ldu + c] receives the outputs, and
 * pre[t * ldp + c] the pre-activations (conv outputs before silu) when pre is not
 * NULL (backward). */
void MB_ISA_FN(mb_conv_silu_pre)(int64_t len, int64_t C, const float *in, int64_t ldi,
                                 float *window, const float *w, const float *bias,
                                 float *pre, int64_t ldp, float *u, int64_t ldu);

/* The block tail: out = x + y . W^T (out_proj under dot v1, then the residual), for
 * M tokens; scratch holds M * dm floats. */
void MB_ISA_FN(mb_out_residual)(int64_t M, int64_t dm, int64_t di, const float *y,
                                const float *W, const float *x, float *scratch, float *out);

/* Token bookkeeping for ragged batches: off[b] is row b's first token in the
 * packed (sum of lengths, ...) layout; off[B] is the total. */
int64_t mb_row_offsets(int64_t B, int64_t L, const int64_t *lengths, int64_t *off);

/* Copy between the padded (B, L, n) layout and the packed one; unpack zero-fills
 * padding with +0. */
void mb_pack_rows(int64_t B, int64_t L, int64_t n, const int64_t *off, const float *padded, float *packed);
void mb_unpack_rows(int64_t B, int64_t L, int64_t n, const int64_t *off, const float *packed, float *padded);

#endif
