/* Mamba-1 block, profile identical.mamba1.fp32.v1 (SPEC section 5). */
#include <float.h>
#include <stdlib.h>
#include <string.h>
#include "mamba_ref.h"
#include "numerics.h"
#include "gemm.h"
#include "ops.h"
#include "fpenv.h"
#include "block1.h"
#include "scratch.h"

#define NS MB_M1_NS
#define CONV_CB 128 /* channels per conv task */
#define PF 8        /* tokens the scan prefetches ahead */

/* p[0..n) into a vector (n <= MB_VW), the other lanes +0 */
static inline mb_vf ld_lanes(const float *p, int n)
{
    return n == MB_VW ? mb_vld(p) : mb_vldn(p, n);
}

/* One token of the scan: the NS states of the lanes' channels updated in hv, y out.
 * core: every dl * a lies in exp's range, so the clamp and selects can be skipped. */
static inline __attribute__((always_inline)) mb_vf scan_token(mb_vf *hv, const float (*a)[MB_VW],
                                                              mb_vf dl, mb_vf uu,
                                                              const float *Bv, const float *Cv,
                                                              int core)
{
    mb_vf acc = mb_vzero();
    MB_UNROLL
    for (int n = 0; n < NS; n++) {
        const mb_vf x = mb_vmul(dl, mb_vld(a[n]));
        const mb_vf dA = core ? mb_vexp_core(x) : mb_vexp(x);
        hv[n] = mb_m1_h_next_v(dA, hv[n], dl, mb_vbc(Bv + n), uu);
        acc = mb_vfma(mb_vbc(Cv + n), hv[n], acc);
    }
    return acc;
}

/* The selective scan of one row over channels [c0, c0 + nc), nc <= MB_VW: one
 * channel per lane, the NS states of each channel in registers for the whole row
 * (h carried in place). Padding lanes scan zeros and are not stored. */
static void scan_lanes(int64_t len, int64_t di, int64_t R, int64_t c0, int nc,
                       const float *delta, const float *u, const float *xz,
                       const float *xdbl, const float *AT, const float *D,
                       float *h, float *yi)
{
    const int64_t XR = R + 2 * NS;
    float a[NS][MB_VW], hs[NS][MB_VW];
    mb_vf hv[NS];
    for (int n = 0; n < NS; n++)
        for (int i = 0; i < MB_VW; i++) {
            a[n][i] = i < nc ? AT[n * di + c0 + i] : 0.0f;
            hs[n][i] = i < nc ? h[(c0 + i) * NS + n] : 0.0f;
        }
    /* With every a in [-FLT_MAX, 0] (amin their lane minimum), a token whose delta
     * lanes are >= 0 and give delta * amin >= exp's lower threshold has every
     * delta * a in [threshold, 0]: rounding is monotonic. */
    mb_vf amin = mb_vzero();
    int afin = 1;
    for (int n = 0; n < NS; n++) {
        hv[n] = mb_vld(hs[n]);
        const mb_vf an = mb_vld(a[n]);
        afin &= mb_vall_ge(an, mb_vset(-FLT_MAX)) & mb_vall_ge(mb_vzero(), an);
        amin = mb_vmin(an, amin);
    }
    const mb_vf Dv = ld_lanes(D + c0, nc), lo = mb_vset(MB_EXP_LO);
    for (int64_t t = 0; t < len; t++) {
        /* the rows are di apart: too far for the hardware prefetcher */
        if (t + PF < len) {
            __builtin_prefetch(delta + (t + PF) * di + c0);
            __builtin_prefetch(u + (t + PF) * di + c0);
            __builtin_prefetch(xz + (t + PF) * 2 * di + di + c0);
        }
        const mb_vf dl = ld_lanes(delta + t * di + c0, nc), uu = ld_lanes(u + t * di + c0, nc);
        const float *Bv = xdbl + t * XR + R, *Cv = Bv + NS;
        const mb_vf acc = afin && mb_vall_ge(dl, mb_vzero()) && mb_vall_ge(mb_vmul(dl, amin), lo)
                              ? scan_token(hv, a, dl, uu, Bv, Cv, 1)
                              : scan_token(hv, a, dl, uu, Bv, Cv, 0);
        const mb_vf z = ld_lanes(xz + t * 2 * di + di + c0, nc);
        const mb_vf y = mb_vmul(mb_vadd(acc, mb_vmul(uu, Dv)), mb_vsilu(z));
        if (nc == MB_VW)
            mb_vst(yi + t * di + c0, y);
        else
            mb_vstn(yi + t * di + c0, y, nc);
    }
    for (int n = 0; n < NS; n++)
        mb_vst(hs[n], hv[n]);
    for (int i = 0; i < nc; i++)
        for (int n = 0; n < NS; n++)
            h[(c0 + i) * NS + n] = hs[n][i];
}

void MB_ISA_FN(mb_m1_front)(const mb_m1_weights *w, int64_t B, const int64_t *off,
                            const float *x, float *xn, float *xz, float *window, float *pre,
                            float *u, float *xdbl, float *spre, float *delta)
{
    const int64_t dm = w->d_model, di = 2 * dm, R = (dm + 15) / 16, XR = R + 2 * NS;
    const int64_t M = off[B];
    MB_ISA_FN(mb_rmsnorm_rows)(M, dm, x, dm, w->norm_w, xn, dm);
    MB_ISA_FN(mb_gemm)(M, 2 * di, dm, xn, dm, w->in_proj, dm, xz, 2 * di);

    /* tasks are (row, block of CONV_CB channels) */
    const int64_t ncb = (di + CONV_CB - 1) / CONV_CB;
    #pragma omp parallel for schedule(dynamic) if (M * di > (1 << 15))
    for (int64_t task = 0; task < B * ncb; task++) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t b = task / ncb, c0 = task % ncb * CONV_CB, o = off[b];
        MB_ISA_FN(mb_conv_silu_pre)(off[b + 1] - o, di - c0 < CONV_CB ? di - c0 : CONV_CB,
                                    xz + o * 2 * di + c0, 2 * di, window + (b * di + c0) * 4,
                                    w->conv_w + c0 * 4, w->conv_b + c0,
                                    pre ? pre + o * di + c0 : NULL, di, u + o * di + c0, di);
        mb_fpenv_exit(env);
    }

    MB_ISA_FN(mb_gemm)(M, XR, di, u, di, w->x_proj, di, xdbl, XR);
    MB_ISA_FN(mb_gemm)(M, di, R, xdbl, XR, w->dt_proj_w, R, delta, di);
    #pragma omp parallel for schedule(dynamic, 16) if (M * di > (1 << 15))
    for (int64_t m = 0; m < M; m++) {
        mb_fpenv env = mb_fpenv_enter();
        for (int64_t c = 0; c < di; c++) {
            float s = delta[m * di + c] + w->dt_proj_b[c];
            if (spre)
                spre[m * di + c] = s;
            delta[m * di + c] = mb_softplus(s);
        }
        mb_fpenv_exit(env);
    }
}

/* mb_m1_forward; keep (lengths NULL), when given, receives the front's activations. */
static int m1_run(const mb_m1_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                  const float *x, const mb_m1_state *st, float *y, float *keep)
{
    const int64_t dm = w->d_model, di = 2 * dm, R = (dm + 15) / 16, XR = R + 2 * NS;
    int64_t *off = malloc((size_t)(B + 1) * sizeof *off);
    if (!off)
        return MB_ENOMEM;
    const int64_t M = mb_row_offsets(B, L, lengths, off);
    /* one allocation: yi (M di), AT (16 di), then the front's activations (pre and
     * spre left unwritten) or, when they are kept, out_proj's output (M dm), which
     * otherwise goes over xn, and the packed input and output when the batch is ragged */
    const int64_t ragged = lengths ? 2 * M * dm : 0;
    float *buf = mb_scratch_take((size_t)(M * di + NS * di + (keep ? M * dm : m1_acts_floats(dm, M))
                                          + ragged));
    if (!buf) {
        free(off);
        return MB_ENOMEM;
    }
    float *yi = buf, *AT = yi + M * di, *tail = AT + NS * di;
    m1_acts a;
    if (keep) {
        m1_acts_carve(&a, keep, dm, M);
    } else {
        tail = m1_acts_carve(&a, tail, dm, M);
        a.pre = a.spre = NULL;
    }
    float *xn = a.xn, *xz = a.xz, *u = a.u, *delta = a.delta, *xdbl = a.xdbl;
    float *ob = keep ? tail : xn;
    const float *xs = x;
    float *ys = y;
    if (lengths) {
        mb_pack_rows(B, L, dm, off, x, tail);
        xs = tail;
        ys = tail + M * dm;
    }

    MB_ISA_FN(mb_m1_front)(w, B, off, xs, xn, xz, st->conv_window, a.pre, u, xdbl, a.spre, delta);
    for (int64_t c = 0; c < di; c++)
        for (int n = 0; n < NS; n++)
            AT[n * di + c] = -mb_exp(w->A_log[c * NS + n]);

    const int64_t nblk = (di + MB_VW - 1) / MB_VW;
    #pragma omp parallel for schedule(dynamic) if (M * di > (1 << 12))
    for (int64_t task = 0; task < B * nblk; task++) {
        mb_fpenv env = mb_fpenv_enter();
        const int64_t b = task / nblk, c0 = (task % nblk) * MB_VW, o = off[b];
        scan_lanes(off[b + 1] - o, di, R, c0, di - c0 < MB_VW ? (int)(di - c0) : MB_VW,
                   delta + o * di, u + o * di, xz + o * 2 * di, xdbl + o * XR, AT, w->D,
                   st->h + b * di * NS, yi + o * di);
        mb_fpenv_exit(env);
    }

    MB_ISA_FN(mb_out_residual)(M, dm, di, yi, w->out_proj, xs, ob, ys);
    if (lengths)
        mb_unpack_rows(B, L, dm, off, ys, y);
    mb_scratch_give(buf);
    free(off);
    return MB_OK;
}

int MB_ISA_FN(mb_m1_forward)(const mb_m1_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                             const float *x, const mb_m1_state *st, float *y)
{
    return m1_run(w, B, L, lengths, x, st, y, NULL);
}

int MB_ISA_FN(mb_m1_vjp)(const mb_m1_weights *w, int64_t B, int64_t L, const float *x, float *y,
                         float *kept)
{
    const int64_t di = 2 * w->d_model;
    float *z = calloc((size_t)(B * di * (4 + NS)), sizeof(float)); /* a zero state */
    if (!z)
        return MB_ENOMEM;
    const mb_m1_state st = {z, z + B * di * 4};
    const int rc = m1_run(w, B, L, NULL, x, &st, y, kept);
    free(z);
    return rc;
}
