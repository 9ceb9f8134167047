/* Public entry points: pick the ISA copy of the hot code once, and run every call
 * with FTZ/DAZ cleared (fpenv.h). */
#include "mamba_ref.h"
#include "fpenv.h"
#include "block1.h"
#include "block2.h"
#include "block3.h"

#define DECLARE_ISA(ret, name, params) \
    ret name##_base params; ret name##_v3 params; ret name##_v4 params;
DECLARE_ISA(int, mb_m1_forward, (const mb_m1_weights *, int64_t, int64_t, const int64_t *,
                                 const float *, const mb_m1_state *, float *))
DECLARE_ISA(int, mb_m1_vjp, (const mb_m1_weights *, int64_t, int64_t, const float *, float *,
                             float *))
DECLARE_ISA(int, mb_m1_backward, (const mb_m1_weights *, int64_t, int64_t, const float *,
                                  const float *, const float *, const mb_m1_grads *))
DECLARE_ISA(int, mb_m2_forward, (const mb_m2_weights *, int64_t, int64_t, const int64_t *,
                                 const float *, const mb_m2_state *, float *))
DECLARE_ISA(int, mb_m2_h_last, (const mb_m2_weights *, int64_t, const mb_m2_state *, float *))
DECLARE_ISA(int, mb_m2_vjp, (const mb_m2_weights *, int64_t, int64_t, const float *, float *,
                             float *))
DECLARE_ISA(int, mb_m2_backward, (const mb_m2_weights *, int64_t, int64_t, const float *,
                                  const float *, const float *, const mb_m2_grads *))
DECLARE_ISA(int, mb_m3_forward, (const mb_m3_weights *, int64_t, int64_t, const int64_t *,
                                 const float *, mb_m3_state *, float *, const mb_m3_reports *))
DECLARE_ISA(int, mb_m3_vjp, (const mb_m3_weights *, int64_t, int64_t, const float *, float *,
                             float *))
DECLARE_ISA(int, mb_m3_backward, (const mb_m3_weights *, int64_t, int64_t, const float *,
                                  const float *, const float *, const mb_m3_grads *))
DECLARE_ISA(void, mb_gemm, (int64_t, int64_t, int64_t, const float *, int64_t,
                            const float *, int64_t, float *, int64_t))
DECLARE_ISA(void, mb_rmsnorm_rows, (int64_t, int64_t, const float *, int64_t, const float *,
                                    float *, int64_t))
DECLARE_ISA(int, mb_math_eval, (int, int64_t, const float *, float *))
DECLARE_ISA(float, mb_dot_eval, (int64_t, const float *, const float *))

/* 0 baseline, 1 x86-64-v3, 2 x86-64-v4; -1 until the first call picks the best. */
static int isa_level = -1;

static int cpu_best_level(void)
{
#if MB_HAVE_X86_ISAS
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return 0;
    /* libgcc also checks that the OS saves the AVX-512 state */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return 2;
    return 1;
#else
    return 0;
#endif
}

int mb_isa_select(int which)
{
    const int best = cpu_best_level();
    isa_level = which < 0 || which > best ? best : which;
    return isa_level;
}

#define ISA_LEVEL (isa_level < 0 ? mb_isa_select(-1) : isa_level)
#if MB_HAVE_X86_ISAS
#define ISA(name) (ISA_LEVEL == 2 ? name##_v4 : ISA_LEVEL == 1 ? name##_v3 : name##_base)
#else
#define ISA(name) name##_base
#endif

#define GUARDED(call)                         \
    mb_fpenv env_ = mb_fpenv_enter();         \
    call;                                     \
    mb_fpenv_exit(env_);

int mb_m1_forward(const mb_m1_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, const mb_m1_state *state, float *y)
{
    int rc;
    GUARDED(rc = ISA(mb_m1_forward)(w, B, L, lengths, x, state, y))
    return rc;
}

int64_t mb_m1_kept_floats(int64_t d_model, int64_t B, int64_t L)
{
    return m1_acts_floats(d_model, B * L);
}

int mb_m1_vjp(const mb_m1_weights *w, int64_t B, int64_t L, const float *x, float *y,
              float *kept)
{
    int rc;
    GUARDED(rc = ISA(mb_m1_vjp)(w, B, L, x, y, kept))
    return rc;
}

int mb_m1_backward(const mb_m1_weights *w, int64_t B, int64_t L, const float *x,
                   const float *kept, const float *dy, const mb_m1_grads *grads)
{
    int rc;
    GUARDED(rc = ISA(mb_m1_backward)(w, B, L, x, kept, dy, grads))
    return rc;
}

int mb_m2_forward(const mb_m2_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, const mb_m2_state *state, float *y)
{
    int rc;
    GUARDED(rc = ISA(mb_m2_forward)(w, B, L, lengths, x, state, y))
    return rc;
}

int mb_m2_h_last(const mb_m2_weights *w, int64_t B, const mb_m2_state *state, float *h_last)
{
    int rc;
    GUARDED(rc = ISA(mb_m2_h_last)(w, B, state, h_last))
    return rc;
}

int64_t mb_m2_kept_floats(int64_t d_model, int64_t B, int64_t L)
{
    return m2_acts_floats(d_model, B, L);
}

int mb_m2_vjp(const mb_m2_weights *w, int64_t B, int64_t L, const float *x, float *y,
              float *kept)
{
    int rc;
    GUARDED(rc = ISA(mb_m2_vjp)(w, B, L, x, y, kept))
    return rc;
}

int mb_m2_backward(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                   const float *kept, const float *dy, const mb_m2_grads *grads)
{
    int rc;
    GUARDED(rc = ISA(mb_m2_backward)(w, B, L, x, kept, dy, grads))
    return rc;
}

int mb_m3_forward(const mb_m3_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, mb_m3_state *state, float *y, const mb_m3_reports *reports)
{
    int rc;
    GUARDED(rc = ISA(mb_m3_forward)(w, B, L, lengths, x, state, y, reports))
    return rc;
}

int64_t mb_m3_kept_floats(int64_t d_model, int64_t B, int64_t L)
{
    return m3_proj_floats(d_model, B * L);
}

int mb_m3_vjp(const mb_m3_weights *w, int64_t B, int64_t L, const float *x, float *y,
              float *kept)
{
    int rc;
    GUARDED(rc = ISA(mb_m3_vjp)(w, B, L, x, y, kept))
    return rc;
}

int mb_m3_backward(const mb_m3_weights *w, int64_t B, int64_t L, const float *x,
                   const float *kept, const float *dy, const mb_m3_grads *grads)
{
    int rc;
    GUARDED(rc = ISA(mb_m3_backward)(w, B, L, x, kept, dy, grads))
    return rc;
}

void mb_gemm(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
             const float *W, int64_t ldw, float *Y, int64_t ldy)
{
    GUARDED(ISA(mb_gemm)(M, N, K, X, ldx, W, ldw, Y, ldy))
}

void mb_rmsnorm(int64_t M, int64_t n, const float *x, const float *w, float *out)
{
    GUARDED(ISA(mb_rmsnorm_rows)(M, n, x, n, w, out, n))
}

int mb_math_eval(int which, int64_t n, const float *x, float *y)
{
    int rc;
    GUARDED(rc = ISA(mb_math_eval)(which, n, x, y))
    return rc;
}

float mb_dot_eval(int64_t k, const float *a, const float *b)
{
    float r;
    GUARDED(r = ISA(mb_dot_eval)(k, a, b))
    return r;
}
