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

/* Gradients of mb_m1_backward, each shaped like its weight (conv_w (di, 4)). */
typedef struct {
    float *x; /* (B, L, dm) */
    float *norm_w, *in_proj, *conv_w, *conv_b, *x_proj, *dt_proj_w, *dt_proj_b, *A_log, *D,
        *out_proj;
} mb_m1_grads;

/* The vector-Jacobian product of a zero-state prefill of x (B, L, dm) (no lengths)
 * against dy (B, L, dm): every gradient, a pure function of (w, x, dy) (orders in
 * docs/numerics.md "Backward (Mamba-1)"). kept: NULL, or what mb_m1_vjp left for
 * these w and x (the same bits, without recomputing the projections and the conv). */
int mb_m1_backward(const mb_m1_weights *w, int64_t B, int64_t L, const float *x,
                   const float *kept, const float *dy, const mb_m1_grads *grads);

/* A zero-state prefill of x (B, L, dm) into y (mb_m1_forward's bits) that also leaves
 * in kept, mb_m1_kept_floats(d_model, B, L) floats, the activations before the scan
 * that mb_m1_backward reads. */
int64_t mb_m1_kept_floats(int64_t d_model, int64_t B, int64_t L);
int mb_m1_vjp(const mb_m1_weights *w, int64_t B, int64_t L, const float *x, float *y,
              float *kept);

/* ---- Mamba-2 SSD (identical.mamba2.fp32.v1): N = 128, P = 64, di = 2 dm, H = di / 64,
 * CD = di + 256 conv channels (x | B | C), chunk Q = 256 on each row's absolute grid. */
typedef struct {
    int64_t d_model;
    const float *block_norm_w; /* (dm) block_norm.weight */
    const float *in_proj;      /* (2 di + 256 + H, dm), rows z | xBC | dt */
    const float *conv_w;       /* (CD, 4) */
    const float *conv_b;       /* (CD) */
    const float *dt_bias;      /* (H) */
    const float *A_log;        /* (H) */
    const float *D;            /* (H) */
    const float *norm_w;       /* (di) norm.weight, the gated norm */
    const float *out_proj;     /* (dm, di) */
    float dt_lo, dt_hi;        /* dt = clamp(softplus(dt_raw + dt_bias), dt_lo, dt_hi) */
} mb_m2_weights;

/* Row b's open chunk is rows [0, buffered_tokens[b]) of its buffers; h is the state
 * entering it. After a call that closes a chunk the buffer rows past the open ones are
 * +0; otherwise only the appended rows are written. Rows past the open ones are never
 * read. buffered_tokens holds one count per row (all equal unless lengths is given). */
typedef struct {
    float *conv_window;       /* (B, CD, 4) last four pre-conv xBC inputs, oldest first */
    float *h;                 /* (B, H, 64, 128) */
    float *buffer_xbc;        /* (B, 256, CD) post-conv post-silu xBC rows */
    float *buffer_dtraw;      /* (B, 256, H) dt rows of in_proj, before dt_bias */
    int64_t *buffered_tokens; /* (B) in [0, 256), read at entry and updated */
} mb_m2_state;

/* As mb_m1_forward (each row has its own chunk grid from its position 0 and its own
 * buffered count). */
int mb_m2_forward(const mb_m2_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, const mb_m2_state *state, float *y);

/* The h_last report of a state, a pure function of it (of h, the open rows of the
 * buffers and buffered_tokens; of the weights only dt_bias, A_log and dt_lo/hi are
 * read): h_last (B, H, 64, 128) = h with the open chunk folded as if it were closed
 * (upstream final_states); h itself when no rows are open. The state is not written. */
int mb_m2_h_last(const mb_m2_weights *w, int64_t B, const mb_m2_state *state, float *h_last);

/* Gradients of the backward, each shaped like its weight (conv_w (CD, 4)). */
typedef struct {
    float *x;            /* (B, L, dm) */
    float *block_norm_w; /* (dm) */
    float *in_proj;      /* (2 di + 256 + H, dm) */
    float *conv_w;       /* (CD, 4) */
    float *conv_b;       /* (CD) */
    float *dt_bias;      /* (H) */
    float *A_log;        /* (H) */
    float *D;            /* (H) */
    float *norm_w;       /* (di) */
    float *out_proj;     /* (dm, di) */
} mb_m2_grads;

/* The vector-Jacobian product of a zero-state prefill of x (B, L, dm) (no lengths)
 * against dy (B, L, dm): every gradient, a pure function of (w, x, dy) (orders in
 * docs/numerics.md "Backward (Mamba-2)"). kept: NULL, or what mb_m2_vjp left for
 * these w and x (the same bits, without running the forward again). */
int mb_m2_backward(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                   const float *kept, const float *dy, const mb_m2_grads *grads);

/* A zero-state prefill of x (B, L, dm) into y (mb_m2_forward's bits) that also leaves
 * in kept, mb_m2_kept_floats(d_model, B, L) floats, the activations mb_m2_backward
 * reads. */
int64_t mb_m2_kept_floats(int64_t d_model, int64_t B, int64_t L);
int mb_m2_vjp(const mb_m2_weights *w, int64_t B, int64_t L, const float *x, float *y,
              float *kept);

/* ---- Mamba-3 SISO (identical.mamba3.siso.fp32.v1): di = 2 dm, H = di / 64 heads,
 * in_proj rows 2 di + 256 + 3 H + 32 (z | x | B | C | dd_dt | dd_A | trap | angle). */
enum { MB_M3_N = 128, MB_M3_P = 64, MB_M3_R = 32, MB_M3_Q = 64 };

typedef struct {
    int64_t d_model;
    const float *norm_w;   /* (dm) block_norm.weight */
    const float *in_proj;  /* (2 di + 256 + 3 H + 32, dm) */
    const float *dt_bias;  /* (H) */
    const float *B_norm_w; /* (128) */
    const float *C_norm_w; /* (128) */
    const float *B_bias;   /* (H, 128) */
    const float *C_bias;   /* (H, 128) */
    const float *D;        /* (H) */
    const float *out_proj; /* (dm, di) */
} mb_m3_weights;

/* The working chunk (rows [0, buffered_tokens) of the buffers, zeros after) is the
 * chunk of the absolute grid holding the last token; h is the state entering it.
 * pending: fold (pending_v * pending_k) * (dt * (1 - sig)) of the next first token
 * into h (upstream Input_States; needs buffered_tokens == 0). */
typedef struct {
    float *theta;       /* (B, H, 32) rotary angles */
    float *h;           /* (B, H, 64, 128) */
    float *buffer_qrot; /* (B, 64, H, 128) rotated q */
    float *buffer_krot; /* (B, 64, H, 128) rotated, unscaled k */
    float *buffer_v;    /* (B, 64, H, 64) */
    float *buffer_dt;   /* (B, 64, H) */
    float *buffer_sig;  /* (B, 64, H) */
    float *buffer_adt;  /* (B, 64, H) */
    float *pending_k;   /* (B, H, 128) */
    float *pending_v;   /* (B, H, 64) */
    int64_t buffered_tokens; /* in [0, 64]; updated on return unless lengths is given */
    int pending;             /* consumed (cleared, pending_k/v zeroed) by the call */
} mb_m3_state;

/* Reports of the last token of each row (any pointer may be NULL): h_last (B, H, 64,
 * 128) the working chunk folded into h with the last row's beta +0 (upstream final
 * SSM state), k_last (B, H, 128) its rotated unscaled k, v_last (B, H, 64) its v,
 * theta_last (B, H, 32) the angles after it. */
typedef struct {
    float *h_last, *k_last, *v_last, *theta_last;
} mb_m3_reports;

/* As mb_m1_forward; with lengths every row starts from the state's buffered_tokens
 * and ends at its own length, so buffered_tokens is left as it was. */
int mb_m3_forward(const mb_m3_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, mb_m3_state *state, float *y, const mb_m3_reports *reports);

/* Gradients of the Mamba-3 backward, each shaped like its weight. */
typedef struct {
    float *x;        /* (B, L, dm) */
    float *norm_w;   /* (dm) block_norm.weight */
    float *in_proj;  /* (2 di + 256 + 3 H + 32, dm) */
    float *dt_bias;  /* (H) */
    float *B_norm_w; /* (128) */
    float *C_norm_w; /* (128) */
    float *B_bias;   /* (H, 128) */
    float *C_bias;   /* (H, 128) */
    float *D;        /* (H) */
    float *out_proj; /* (dm, di) */
} mb_m3_grads;

/* The vector-Jacobian product of a zero-state prefill of x (B, L, dm) (no lengths)
 * against dy (B, L, dm): every gradient, a pure function of (w, x, dy) (orders in
 * docs/numerics.md "Backward (Mamba-3)"). kept: NULL, or what mb_m3_vjp left for
 * these w and x (the same bits, without recomputing the projections). */
int mb_m3_backward(const mb_m3_weights *w, int64_t B, int64_t L, const float *x,
                   const float *kept, const float *dy, const mb_m3_grads *grads);

/* A zero-state prefill of x (B, L, dm) into y (mb_m3_forward's bits) that also leaves
 * in kept, mb_m3_kept_floats(d_model, B, L) floats, the per-token projections
 * mb_m3_backward reads. */
int64_t mb_m3_kept_floats(int64_t d_model, int64_t B, int64_t L);
int mb_m3_vjp(const mb_m3_weights *w, int64_t B, int64_t L, const float *x, float *y,
              float *kept);

/* ---- shared pieces, exposed for tests and for the other blocks */
void mb_gemm(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
             const float *W, int64_t ldw, float *Y, int64_t ldy);

/* RMSNorm of M rows of n: out = (x * rsqrt(dot(x, x) / n + eps)) * w. */
void mb_rmsnorm(int64_t M, int64_t n, const float *x, const float *w, float *out);

/* Evaluate one numerics.h function elementwise (tests): which is an MB_MATH_* code. */
enum {
    MB_MATH_EXP, MB_MATH_LOG1P, MB_MATH_SOFTPLUS, MB_MATH_SIGMOID, MB_MATH_SILU,
    MB_MATH_SQRT, MB_MATH_RSQRT, MB_MATH_TANH, MB_MATH_SIN, MB_MATH_COS, MB_MATH_MOD2PI,
    MB_MATH_VEXP, MB_MATH_VSILU, /* simd.h's vector forms of exp and silu */
    MB_MATH_EXPCORE, /* mb_exp_core, for x in [MB_EXP_LO, 0] */
    MB_MATH_MOD2PI_NEAR, /* mb_mod2pi_near, for x in [-TWO_PI, 2 TWO_PI) */
    MB_MATH_COUNT
};
/* The scalar ones as X(code, numerics.h function): probe.c evaluates them on the CPU,
 * backends/kernels/math.cu on a GPU. */
#define MB_MATH_SCALARS(X)                                                            \
    X(MB_MATH_EXP, mb_exp) X(MB_MATH_LOG1P, mb_log1p) X(MB_MATH_SOFTPLUS, mb_softplus)  \
    X(MB_MATH_SIGMOID, mb_sigmoid) X(MB_MATH_SILU, mb_silu) X(MB_MATH_SQRT, mb_sqrt)    \
    X(MB_MATH_RSQRT, mb_rsqrt) X(MB_MATH_TANH, mb_tanh) X(MB_MATH_SIN, mb_sin)          \
    X(MB_MATH_COS, mb_cos) X(MB_MATH_MOD2PI, mb_mod2pi) X(MB_MATH_EXPCORE, mb_exp_core) \
    X(MB_MATH_MOD2PI_NEAR, mb_mod2pi_near)
int mb_math_eval(int which, int64_t n, const float *x, float *y);
float mb_dot_eval(int64_t k, const float *a, const float *b);

/* Instruction set of the hot loops: -1 selects the best the CPU has, 0 the portable
 * baseline, 1 x86-64-v3 (AVX2 + FMA), 2 x86-64-v4 (AVX-512); a level the CPU lacks
 * gives its best. Returns the one in use. Bits never depend on it. */
int mb_isa_select(int which);

/* ---- low-bit weights (lowbit.c; docs/numerics.md "Low-bit weights"), integer-exact.
 * bfloat16: round to nearest even, NaN made quiet; returns the index of the first
 * finite input that rounds to +-inf, or -1. int8: per row r of cols values,
 * e = floor(log2(absmax)) - 6 (0 for an all-zero row), code = clamp(rne(x 2^-e),
 * -127, 127); inputs must be finite. mb_i8_unpack writes code * 2^e (out may be NULL
 * to validate only) and returns the first flat index whose code is -128 or whose
 * value is not an exact finite float32, or -1. */
int64_t mb_bf16_pack(int64_t n, const float *x, uint16_t *out);
void mb_bf16_unpack(int64_t n, const uint16_t *bits, float *out);
void mb_i8_pack(int64_t rows, int64_t cols, const float *x, int8_t *codes, int32_t *exps);
int64_t mb_i8_unpack(int64_t rows, int64_t cols, const int8_t *codes, const int32_t *exps,
                     float *out);

#endif
