/* A decode session's step of Mamba-2 and Mamba-3 as part of one CUDA graph
 * (mamba/_cuda_session.py): the chunk tables that _cuda_ssd._Plan would give a
 * one-token call, written on the device from the session's own count of buffered
 * tokens, so that a replayed graph needs no data from the host.
 *
 * The ext layout of ssd.cu with row b's ext rows at b * Q: the state buffers
 * (B, Q, W) are their own ext arrays, and every grid and table size depends only
 * on B. ctl[0] holds the buffered tokens; the step's last writer of the tables
 * moves it on. A step the session guard refused (finite.cu) gets an empty plan: no
 * new row, no fold, no state piece written, the count kept. */
#include "ssd3.cu"

#define STEP_Q2 256 /* Mamba-2's chunk (ssd2.cu M2Q) */

MB_DEV void step_desc(int64_t *d, int64_t b, int64_t e0, int64_t n, int64_t r0, int64_t fold)
{
    d[0] = b;
    d[1] = e0;
    d[2] = n;
    d[3] = r0;
    d[4] = b;
    d[5] = fold;
}

/* Mamba-2, the step's first kernel after the conv. t = ctl[0] rows are buffered.
 * Block 0 writes the tables: scal = (count after the step, fold), cbeg = b, desc =
 * one chunk per row (rows [0, n) at ext row b * 256, output row t, folding when it
 * fills the chunk), rep = the h_last report's chunk (the open rows after the step).
 * Every block: the new row of u (the conv's output, B x CD) and of the raw dt (ldr
 * apart) into buffer row t of bx and bd, and dt, dA and cs of rows [from, n) of
 * each (row, head) into the session's cache (B * H, 256) with mb_m2_prep_k's
 * expressions and chain; from is t, or 0 when ctl[1] asks for the whole chunk (the
 * buffers were loaded since the cache was made). */
MB_KERNEL void mb_m2_step_in_k(int64_t B, int64_t H, int64_t CD, const float *u, const float *dtr,
                               int64_t ldr, const float *dt_bias, const float *A_log,
                               int64_t lo_bits, int64_t hi_bits, const unsigned long long *guard,
                               const int64_t *ctl, float *bx, float *bd, float *dt, float *dA,
                               float *cs, int64_t *scal, int64_t *cbeg, int64_t *desc,
                               int64_t *rep)
{
    const int64_t t = ctl[0], from = ctl[1] ? 0 : t;
    const bool refused = mb_refused(guard);
    const int64_t n = refused ? t : t + 1, fold = n == STEP_Q2;
    if (blockIdx.x == 0) {
        for (int64_t b = threadIdx.x; b <= B; b += blockDim.x) {
            cbeg[b] = b;
            if (b == B) continue;
            step_desc(desc + b * MB_DESC, b, b * STEP_Q2, n, t, fold);
            step_desc(rep + b * MB_DESC, b, b * STEP_Q2, fold ? 0 : n, 0, 0);
        }
        if (threadIdx.x == 0) {
            scal[0] = n % STEP_Q2;
            scal[1] = fold;
        }
    }
    const float lo = __int_as_float((int)lo_bits), hi = __int_as_float((int)hi_bits);
    MB_GRID_LOOP(i, B * (CD + H)) {
        if (i < B * CD) {
            const int64_t b = i / CD, c = i % CD;
            if (!refused) bx[(b * STEP_Q2 + t) * CD + c] = u[i];
            continue;
        }
        const int64_t bh = i - B * CD, b = bh / H, h = bh % H;
        const float raw = dtr[b * ldr + h];
        if (!refused) bd[(b * STEP_Q2 + t) * H + h] = raw;
        const float A = -mb_exp(A_log[h]), bias = dt_bias[h];
        float *dtc = dt + bh * STEP_Q2, *dAc = dA + bh * STEP_Q2, *csc = cs + bh * STEP_Q2;
        float acc = from > 0 ? csc[from - 1] : 0.0f;
        for (int64_t j = from; j < n; j++) {
            const float r = j == t ? raw : bd[(b * STEP_Q2 + j) * H + h];
            const float v = mb_clamp(mb_softplus(r + bias), lo, hi);
            const float a = v * A;
            acc = acc + a;
            dtc[j] = v;
            dAc[j] = a;
            csc[j] = acc;
        }
    }
}

/* Mamba-2, the step's last kernel: a chunk that folded leaves zeros in the buffers
 * (as _Plan's store does); ctl moves on to the count after the step, with the cache
 * whole again. */
MB_KERNEL void mb_m2_step_close_k(int64_t B, int64_t H, int64_t CD, const int64_t *scal,
                                  int64_t *ctl, float *bx, float *bd)
{
    if (scal[1]) {
        MB_GRID_LOOP(i, B * STEP_Q2 * (CD + H)) {
            if (i < B * STEP_Q2 * CD)
                bx[i] = 0.0f;
            else
                bd[i - B * STEP_Q2 * CD] = 0.0f;
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        ctl[0] = scal[0];
        ctl[1] = 0;
    }
}

/* Mamba-3, the step's plan (one block), before any kernel that writes state. t =
 * ctl[0] in [0, 64] rows of the working chunk are buffered. The new token goes to
 * row w = t, or, when t = 64, seals the chunk (which folds with the new token's
 * beta) and becomes row 0 of the next. Tables: scal = (seal, w, refused); off, the
 * new token's packed rows (none when refused); two chunks per row for the state
 * pass (cbeg = 2 b): the sealed chunk at ext row b * 65 of the seal copies
 * (fdesc, folding only at a seal) and the chunk holding the new token (ydesc: rows
 * [0, w] of the buffers, output row w); rep and last, the reports' chunk and row
 * (the working chunk after the step). ctl moves on at the end. */
MB_KERNEL void mb_m3_step_plan_k(int64_t B, const unsigned long long *guard, int64_t *ctl,
                                 int64_t *scal, int64_t *off, int64_t *cbeg, int64_t *fdesc,
                                 int64_t *ydesc, int64_t *rep, int64_t *last)
{
    const int64_t t = ctl[0];
    const bool refused = mb_refused(guard);
    const int64_t seal = !refused && t == M3Q, w = t == M3Q ? 0 : t;
    const int64_t after = refused ? t : t % M3Q + 1, nrep = after > 0 ? after : 1;
    for (int64_t b = threadIdx.x; b <= B; b += blockDim.x) {
        off[b] = refused ? 0 : b;
        cbeg[b] = 2 * b;
        if (b == B) continue;
        int64_t *f = fdesc + 2 * b * MB_DESC, *y = ydesc + 2 * b * MB_DESC;
        step_desc(f, b, b * (M3Q + 1), M3Q, M3Q, seal);
        step_desc(f + MB_DESC, b, 0, 0, 0, 0);
        step_desc(y, b, 0, 0, 0, 0);
        step_desc(y + MB_DESC, b, b * M3Q, refused ? 0 : w + 1, refused ? 0 : w, 0);
        step_desc(rep + b * MB_DESC, b, b * M3Q, nrep, 0, 0);
        last[b] = b * M3Q + nrep - 1;
    }
    if (threadIdx.x == 0) {
        scal[0] = seal;
        scal[1] = w;
        scal[2] = refused;
    }
    __syncthreads(); /* every thread has read ctl */
    if (threadIdx.x == 0) ctl[0] = after;
}

/* One array's part of m3_step_rows: element c of row j of batch row b. Without a
 * seal, the new row (nw, B rows of W) into buffer row w; at a seal, buffer row j
 * first into the seal copy (B, 65, W) when there is one, then the new row into
 * buffer row 0 and zeros after it; next: the new row is also the seal copy's row 64
 * (the row after the sealed chunk, whose dt and sigmoid complete its trapezoid). */
MB_DEV void m3_step_row(int64_t b, int64_t j, int64_t c, int64_t W, bool seal, int64_t w,
                        const float *nw, float *buf, float *save, bool next)
{
    const float v = nw[b * W + c];
    if (!seal) {
        buf[(b * M3Q + w) * W + c] = v;
        return;
    }
    float *at = buf + (b * M3Q + j) * W + c;
    if (save) {
        save[(b * (M3Q + 1) + j) * W + c] = *at;
        if (next && j == 0) save[(b * (M3Q + 1) + M3Q) * W + c] = v;
    }
    *at = j == 0 ? v : 0.0f;
}

/* Mamba-3: the new token's rows (q, k, v, dt, sig, A*dt, qk_gamma, computed into
 * rows of their own by the one-token kernels) into the working chunk's buffers, as
 * the plan in scal says; at a seal the old chunk is first copied for its fold and
 * the buffers keep only the new row (as _Plan's store does). qkg (B, 64, H) is the
 * y kernel's qk_gamma ext array. Nothing when the step was refused. */
MB_KERNEL void mb_m3_step_rows_k(int64_t B, int64_t H, const int64_t *scal, const float *qn,
                                 const float *kn, const float *vn, const float *dtn,
                                 const float *sgn, const float *adn, const float *qgn, float *bq,
                                 float *bk, float *bv, float *bdt, float *bsg, float *bad,
                                 float *qkg, float *sk, float *sv, float *sdt, float *ssg,
                                 float *sad)
{
    if (scal[2]) return;
    const bool seal = scal[0] != 0;
    const int64_t w = scal[1], rows = seal ? M3Q : 1, WQ = H * SSD_NS, WV = H * SSD_HP;
    const int64_t WT = 2 * WQ + WV + 4 * H;
    MB_GRID_LOOP(i, B * rows * WT) {
        const int64_t b = i / (rows * WT), j = (i / WT) % rows;
        int64_t c = i % WT;
        if (c < WQ) {
            m3_step_row(b, j, c, WQ, seal, w, qn, bq, nullptr, false);
        } else if ((c -= WQ) < WQ) {
            m3_step_row(b, j, c, WQ, seal, w, kn, bk, sk, false);
        } else if ((c -= WQ) < WV) {
            m3_step_row(b, j, c, WV, seal, w, vn, bv, sv, false);
        } else if ((c -= WV) < H) {
            m3_step_row(b, j, c, H, seal, w, dtn, bdt, sdt, true);
        } else if ((c -= H) < H) {
            m3_step_row(b, j, c, H, seal, w, sgn, bsg, ssg, true);
        } else if ((c -= H) < H) {
            m3_step_row(b, j, c, H, seal, w, adn, bad, sad, false);
        } else if (j == 0) {
            c -= H;
            qkg[(b * M3Q + w) * H + c] = qgn[b * H + c];
        }
    }
}

#undef STEP_Q2
