/* The C ABI of the reference: one weights struct and one state struct per block,
 * each a set of typed pointers (host memory here; the GPU backends use the same
 * layouts). Every entry point returns MB_OK or an MB_E* code and, on error,
 * leaves the state untouched. */
#ifndef MAMBA_REF_H
#define MAMBA_REF_H
#include <stdint.h>

enum { MB_OK = 0, MB_ENOMEM = 1 };

/* ---- Mamba-1 (identical.mamba1.fp32.v1): N = 16, d_conv 4, di = 2 dm,
 * R = ceil(dm / 16). */
typedef struct {
    int64_t d_model;
    const float *norm_w;    /* (dm) */
    const float *in_proj;   /* (2 di, dm) */
    const float *conv_w;    /* (di, 4) */
    const float *conv_b;    /* (di) */
    const float *x_proj;    /* (R + 32, di) */
    const float *dt_proj_w; /* (di, R) */
    const float *dt_proj_b; /* (di) */
    const float *A_log;     /* (di, 16) */
    const float *D;         /* (di) */
    const float *out_proj;  /* (dm, di) */
} mb_m1_weights;

typedef struct {
    float *conv_window; /* (B, di, 4), last four pre-conv inputs, oldest first */
    float *h;           /* (B, di, 16) */
} mb_m1_state;

/* x (B, L, dm) -> y (B, L, dm), y = x + mixer(norm(x)). lengths is NULL (every row
 * has L tokens) or B values in [1, L]: row b is real at [0, lengths[b]), its padding
 * outputs are +0 and its padding inputs are never read. The state is read at entry
 * and holds, on return, the state after each row's last real token. */
int mb_m1_forward(const mb_m1_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, const mb_m1_state *state, float *y);

/* ---- shared pieces, exposed for tests and for the other blocks */
void mb_gemm(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
             const float *W, int64_t ldw, float *Y, int64_t ldy);

/* Evaluate one numerics.h function elementwise (tests): which is an MB_MATH_* code. */
enum {
    MB_MATH_EXP, MB_MATH_LOG1P, MB_MATH_SOFTPLUS, MB_MATH_SIGMOID, MB_MATH_SILU,
    MB_MATH_SQRT, MB_MATH_RSQRT, MB_MATH_TANH, MB_MATH_SIN, MB_MATH_COS, MB_MATH_MOD2PI,
    MB_MATH_COUNT
};
int mb_math_eval(int which, int64_t n, const float *x, float *y);
float mb_dot_eval(int64_t k, const float *a, const float *b);

/* Instruction set of the hot loops: -1 selects the best the CPU has, 0 the portable
 * baseline, 1 x86-64-v3. Returns the one in use (0 or 1). Bits never depend on it. */
int mb_isa_select(int which);

#endif
