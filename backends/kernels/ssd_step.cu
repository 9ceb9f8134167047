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
#include "chain.h"

#define STEP_Q2 256 /* Mamba-2's chunk (ssd2.cu M2Q) */
#define STEP_PS 2 /* blocks per head of mb_m2_step_y_k */
#define STEP_PC (SSD_HP / STEP_PS) /* their columns */
#define STEP_CB 32 /* rows per block of mb_m2_step_cb_k */
#define STEP_CBT 128 /* its threads */

/* a row of SSD_NS floats (global, 16-byte aligned) into registers: the loads issue
 * together, so that the chain after them waits on global memory once */
MB_DEV void step_row(float4 (&v)[SSD_NS / 4], const float *b)
{
    const float4 *b4 = (const float4 *)b;
#pragma unroll
    for (int k = 0; k < SSD_NS / 4; k++) v[k] = b4[k];
}

/* dot v1 of a (shared) and a row v of step_row (each v[m] times sc when SCALED):
 * the serial chain */
template <bool SCALED>
MB_DEV float step_dot(const float *a, const float4 (&v)[SSD_NS / 4], float sc)
{
    float g = 0.0f;
#pragma unroll
    for (int k = 0; k < SSD_NS / 4; k++) {
        const float *am = a + 4 * k;
        g = fmaf(am[0], SCALED ? v[k].x * sc : v[k].x, g);
        g = fmaf(am[1], SCALED ? v[k].y * sc : v[k].y, g);
        g = fmaf(am[2], SCALED ? v[k].z * sc : v[k].z, g);
        g = fmaf(am[3], SCALED ? v[k].w * sc : v[k].w, g);
    }
    return g;
}

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
 * Block 0 writes the tables: scal = (count after the step, fold, refused), desc =
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
                               float *cs, int64_t *scal, int64_t *desc, int64_t *rep)
{
    MB_GRID_WAIT();
    const int64_t t = ctl[0], from = ctl[1] ? 0 : t;
    const bool refused = mb_refused(guard);
    const int64_t n = refused ? t : t + 1, fold = n == STEP_Q2;
    if (blockIdx.x == 0) {
        for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
            step_desc(desc + b * MB_DESC, b, b * STEP_Q2, n, t, fold);
            step_desc(rep + b * MB_DESC, b, b * STEP_Q2, fold ? 0 : n, 0, 0);
        }
        if (threadIdx.x == 0) {
            scal[0] = n % STEP_Q2;
            scal[1] = fold;
            scal[2] = refused;
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

/* Mamba-2: the step's dots with C_t, each a row's serial chain: C . B_j of the
 * open chunk's rows j <= t into G (B, 256; the same for every head) and C . h_p of
 * every head's state column p into Yo (B, H * 64; Y_off's dots). A block takes
 * STEP_CB rows (grid x: the 256 / STEP_CB blocks of B's rows, then the H * 64 /
 * STEP_CB of h's; y: batch rows), copies them whole with coalesced reads, and
 * thread r walks row r. */
MB_KERNEL void MB_BOUNDS(STEP_CBT)
mb_m2_step_cb_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U,
                const float *h, float *G, float *Yo)
{
    MB_GRID_WAIT();
    __shared__ __align__(16) float rows[STEP_CB][SSD_NS + 4];
    __shared__ __align__(16) float Ct[SSD_NS];
    const int64_t b = blockIdx.y, *d = desc + b * MB_DESC;
    const int64_t e0 = d[1], n = d[2], t = d[3];
    const int64_t gb = STEP_Q2 / STEP_CB, on_b = blockIdx.x < gb;
    const int64_t r0 = (on_b ? blockIdx.x : blockIdx.x - gb) * STEP_CB;
    if (t >= n || (on_b && r0 > t)) return; /* refused, or rows past t */
    const int tid = threadIdx.x;
    const int nr = on_b && t + 1 - r0 < STEP_CB ? (int)(t + 1 - r0) : STEP_CB;
    const float *u = U + e0 * CD;
    const float *src = on_b ? u + r0 * CD + di : h + (b * H * SSD_HP + r0) * SSD_NS;
    const int64_t ld = on_b ? CD : SSD_NS;
    for (int m = tid; m < SSD_NS / 4; m += STEP_CBT)
        mb_cp_async16(Ct + 4 * m, u + t * CD + di + SSD_NS + 4 * m, 16);
    for (int e = tid; e < nr * (SSD_NS / 4); e += STEP_CBT) {
        const int r = e / (SSD_NS / 4), c = e % (SSD_NS / 4) * 4;
        mb_cp_async16(&rows[r][c], src + r * ld + c, 16);
    }
    mb_cp_commit();
    mb_cp_wait<0>();
    __syncthreads();
    if (tid < nr) {
        const float g = mb_chain_tile<false>(0.0f, Ct, rows[tid], SSD_NS);
        (on_b ? G + b * STEP_Q2 : Yo + b * H * SSD_HP)[r0 + tid] = g;
    }
}

/* Mamba-2: the step's output row, mb_m2_y_k's row i = t of the open chunk (M,
 * Y_diag, Y_off and the sum in its expressions and orders) from the dots of
 * mb_m2_step_cb_k, a head's columns split over STEP_PS blocks (grid (H, B,
 * STEP_PS)) so that a batch-1 step spreads over the SMs. Thread j <= t computes
 * column j of M (each block all of them) while the block's columns of u (rows j <=
 * t) are copied; thread p then walks Y_diag's chain. seg[t][j], the serial sum of
 * dA[j+1..t] from +0, is carried between steps in seg (2, B * H, 256), the row of
 * step t in half t % 2 (the blocks of a head read the row before while one writes
 * theirs): each step adds dA[t] to the columns of the row before (the same chain),
 * or, when ctl[1] asks, walks it again. A chunk that folds then moves the block's
 * columns of h on, h = fma(E, h, S) as mb_ssd_chain_k does. The row leaves gated
 * by silu(z) (z: the row of zx, NP apart), as mb_m2_y_k gates it. */
MB_KERNEL void MB_BOUNDS(STEP_Q2)
mb_m2_step_y_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const int64_t *ctl,
               const float *U, const float *dt, const float *dA, const float *cs, const float *D,
               const float *E, const float *S, const float *zx, int64_t NP, const float *G,
               const float *Yo, float *h, float *seg, float *yb)
{
    MB_GRID_WAIT();
    __shared__ __align__(16) float Xs[STEP_Q2][STEP_PC];
    __shared__ float Mt[STEP_Q2], dts[STEP_Q2];
    const int64_t hh = blockIdx.x, b = blockIdx.y, bh = b * H + hh, *d = desc + b * MB_DESC;
    /* every global read is issued as early as its address is known: the step
     * waits on memory as few times as it can */
    const int64_t e0 = d[1], n = d[2], t = d[3], whole = ctl[1];
    if (t >= n) return; /* refused: no row, the columns kept */
    const int tid = threadIdx.x, p0 = blockIdx.z * STEP_PC;
    const int64_t c0 = hh * SSD_HP + p0, c = c0 + tid; /* the block's first column, the thread's */
    const float *u = U + e0 * CD, *dAc = dA + bh * STEP_Q2;
    for (int e = tid; e < (t + 1) * (STEP_PC / 4); e += STEP_Q2) {
        const int j = e / (STEP_PC / 4), cc = e % (STEP_PC / 4) * 4;
        mb_cp_async16(&Xs[j][cc], u + j * CD + c0 + cc, 16);
    }
    mb_cp_commit();
    float yo = 0.0f, cst = 0.0f, dh = 0.0f, z = 0.0f; /* the row's epilogue operands */
    if (tid < STEP_PC) {
        yo = Yo[bh * SSD_HP + p0 + tid];
        cst = cs[bh * STEP_Q2 + t];
        dh = D[hh];
        z = zx[b * NP + c];
    }
    if (tid <= t) {
        const int64_t half = (int64_t)gridDim.y * H * STEP_Q2, at = bh * STEP_Q2 + tid;
        const float prev = tid < t ? seg[(~t & 1) * half + at] : 0.0f, at_t = dAc[t];
        const float g = G[b * STEP_Q2 + tid];
        dts[tid] = dt[bh * STEP_Q2 + tid];
        float s = 0.0f;
        if (whole) {
            for (int64_t i = tid + 1; i <= t; i++) s = s + dAc[i];
        } else if (tid < t) {
            s = prev + at_t;
        }
        if (blockIdx.z == 0) seg[(t & 1) * half + at] = s;
        Mt[tid] = g * mb_exp(s);
    }
    mb_cp_wait<0>();
    __syncthreads();
    if (tid < STEP_PC) {
        float yd = 0.0f;
#pragma unroll 8 /* the shared-memory reads run ahead of the chain */
        for (int j = 0; j <= t; j++) yd = fmaf(Mt[j], Xs[j][tid] * dts[j], yd);
        const float y = (yd + yo * mb_exp(cst)) + Xs[t][tid] * dh;
        yb[b * di + c] = y * mb_silu(z);
    }
    if (!d[5]) return;
    float *hs = h + bh * SSD_HP * SSD_NS;
    for (int e = tid; e < STEP_PC * SSD_NS; e += STEP_Q2) {
        const int64_t i = p0 * SSD_NS + e;
        hs[i] = fmaf(E[bh], hs[i], S[bh * SSD_HP * SSD_NS + i]);
    }
}

/* Mamba-2, the step's last kernel: a chunk that folded leaves zeros in the buffers
 * (as _Plan's store does); ctl moves on to the count after the step, and the
 * carried columns are whole again unless the step was refused. */
MB_KERNEL void mb_m2_step_close_k(int64_t B, int64_t H, int64_t CD, const int64_t *scal,
                                  int64_t *ctl, float *bx, float *bd)
{
    MB_GRID_WAIT();
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
        if (!scal[2]) ctl[1] = 0;
    }
}

/* Mamba-3, the step's plan (one block), before any kernel that writes state. t =
 * ctl[0] in [0, 64] rows of the working chunk are buffered. The new token goes to
 * row w = t, or, when t = 64, seals the chunk (which folds with the new token's
 * beta) and becomes row 0 of the next. Tables: scal = (seal, w, refused, whole:
 * the carried columns are to be walked again, ctl[1]); off, the new token's packed
 * rows (none when refused); fdesc, the sealed chunk at ext row b * 65 of the seal
 * copies (folding only at a seal); ydesc, the chunk holding the new token (rows
 * [0, w] of the buffers, output row w; none when refused); rep and last, the
 * reports' chunk and row (the working chunk after the step). ctl moves on at the
 * end. */
MB_KERNEL void mb_m3_step_plan_k(int64_t B, const unsigned long long *guard, int64_t *ctl,
                                 int64_t *scal, int64_t *off, int64_t *fdesc, int64_t *ydesc,
                                 int64_t *rep, int64_t *last)
{
    MB_GRID_WAIT();
    const int64_t t = ctl[0], whole = ctl[1];
    const bool refused = mb_refused(guard);
    const int64_t seal = !refused && t == M3Q, w = t == M3Q ? 0 : t;
    const int64_t after = refused ? t : t % M3Q + 1, nrep = after > 0 ? after : 1;
    for (int64_t b = threadIdx.x; b <= B; b += blockDim.x) {
        off[b] = refused ? 0 : b;
        if (b == B) continue;
        step_desc(fdesc + b * MB_DESC, b, b * (M3Q + 1), M3Q, M3Q, seal);
        step_desc(ydesc + b * MB_DESC, b, b * M3Q, refused ? 0 : w + 1, refused ? 0 : w, 0);
        step_desc(rep + b * MB_DESC, b, b * M3Q, nrep, 0, 0);
        last[b] = b * M3Q + nrep - 1;
    }
    if (threadIdx.x == 0) {
        scal[0] = seal;
        scal[1] = w;
        scal[2] = refused;
        scal[3] = whole;
    }
    __syncthreads(); /* every thread has read ctl */
    if (threadIdx.x == 0) {
        ctl[0] = after;
        if (!refused) ctl[1] = 0;
    }
}

/* Mamba-3: the new token's angle and rotation per (row, head, angle) in one kernel
 * (ssd3.cu m3_rotate: mb_m3_angles_k's recurrence, then mb_m3_rotate_k's
 * rotation at that angle, the same operations); a refused step's plan has no token
 * (off), so theta stays. */
MB_KERNEL void mb_m3_step_rotate_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                                   const int64_t *t0, const float *Bn, const float *Cn,
                                   const float *B_bias, const float *C_bias, const float *TA,
                                   const float *DT, float *theta, float *Q, float *K)
{
    MB_GRID_WAIT();
    MB_GRID_LOOP(i, B * H * M3A)
        m3_rotate(i, H, off, eoff, t0, Bn, Cn, B_bias, C_bias, TA, DT, theta, Q, K, NULL, NULL);
}

/* One array's part of m3_step_rows: element c of row j of batch row b. Without a
 * seal, the new row (nw, B rows of W, ldn apart) into buffer row w; at a seal,
 * buffer row j first into the seal copy (B, 65, W) when there is one, then the new
 * row into buffer row 0 and zeros after it; next: the new row is also the seal
 * copy's row 64 (the row after the sealed chunk, whose dt and sigmoid complete its
 * trapezoid). */
MB_DEV void m3_step_row(int64_t b, int64_t j, int64_t c, int64_t W, bool seal, int64_t w,
                        const float *nw, int64_t ldn, float *buf, float *save, bool next)
{
    const float v = nw[b * ldn + c];
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

/* Mamba-3: the new token's rows (q, k, dt, sig, A*dt, computed into rows of their
 * own by the one-token kernels, and v, read from in_proj's rows ldv apart) into the
 * working chunk's buffers, as the plan in scal says; at a seal the old chunk is
 * first copied for its fold and the buffers keep only the new row (as _Plan's store
 * does). Nothing when the step was refused. */
MB_KERNEL void mb_m3_step_rows_k(int64_t B, int64_t H, const int64_t *scal, const float *qn,
                                 const float *kn, const float *vn, int64_t ldv,
                                 const float *dtn, const float *sgn, const float *adn, float *bq,
                                 float *bk, float *bv, float *bdt, float *bsg, float *bad,
                                 float *sk, float *sv, float *sdt, float *ssg, float *sad)
{
    MB_GRID_WAIT();
    if (scal[2]) return;
    const bool seal = scal[0] != 0;
    const int64_t w = scal[1], rows = seal ? M3Q : 1, WQ = H * SSD_NS, WV = H * SSD_HP;
    const int64_t WT = 2 * WQ + WV + 3 * H;
    MB_GRID_LOOP(i, B * rows * WT) {
        const int64_t b = i / (rows * WT), j = (i / WT) % rows;
        int64_t c = i % WT;
        if (c < WQ)
            m3_step_row(b, j, c, WQ, seal, w, qn, WQ, bq, nullptr, false);
        else if ((c -= WQ) < WQ)
            m3_step_row(b, j, c, WQ, seal, w, kn, WQ, bk, sk, false);
        else if ((c -= WQ) < WV)
            m3_step_row(b, j, c, WV, seal, w, vn, ldv, bv, sv, false);
        else if ((c -= WV) < H)
            m3_step_row(b, j, c, H, seal, w, dtn, H, bdt, sdt, true);
        else if ((c -= H) < H)
            m3_step_row(b, j, c, H, seal, w, sgn, H, bsg, ssg, true);
        else
            m3_step_row(b, j, c - H, H, seal, w, adn, H, bad, sad, false);
    }
}

#define STEP_Y3 (M3Q + SSD_HP) /* threads of mb_m3_step_y_k: one per column j, then per p */

/* Mamba-3: the step's output row, mb_m3_y_k's row i = w of the chunk holding the
 * new token (G, M, ys, yi, the D and qk_gamma term and the gate in its expressions
 * and orders) per (head, row) block. Thread j < w computes column j of M, thread
 * M3Q + p the ys of column p, each from its row (of K, of h) held in registers,
 * loaded with the staging of q and of V's rows u <= w, so that the step waits on
 * global memory once; thread p then walks yi's chain. seg[w][j] of the columns j <
 * w (the serial sum of A*dt[j+1..w] from +0) and the cumsum cs_w are carried
 * between steps in seg (B * H, 65; cs in the last slot): each step adds A*dt[w] to
 * the row before's, or walks them again when the plan says whole (or a chunk
 * starts). At a seal the block first moves its heads' state on, h = fma(E, h, S)
 * as mb_ssd_chain_k does, h then being the state entering the chunk. qg: the new
 * token's qk_gamma (B, H). */
MB_KERNEL void MB_BOUNDS(STEP_Y3)
mb_m3_step_y_k(const int64_t *ydesc, const int64_t *scal, int64_t H, int64_t di, int64_t dip,
               const float *Q, const float *K, const float *V, const float *DT, const float *SIG,
               const float *ADT, const float *qg, const float *D, const float *zx,
               const float *E, const float *S, float *h, float *seg, float *yg)
{
    MB_GRID_WAIT();
    __shared__ __align__(16) float Vt[M3Q][SSD_HP];
    __shared__ __align__(16) float qs[SSD_NS];
    __shared__ float Mt[M3Q + 1], Ys[SSD_HP];
    const int64_t hh = blockIdx.x, b = blockIdx.y, bh = b * H + hh, *d = ydesc + b * MB_DESC;
    /* every global read is issued as early as its address is known */
    const int64_t e0 = d[1], n = d[2], w = d[3], seal = scal[0], whole = scal[3];
    if (w >= n) return; /* refused: no row, the columns kept */
    const int tid = threadIdx.x;
    float *hs = h + bh * SSD_HP * SSD_NS, *sg = seg + bh * (M3Q + 1);
    float dq = 0.0f, z = 0.0f; /* the row's epilogue operands */
    if (tid < SSD_HP) {
        dq = D[hh] + qg[bh];
        z = zx[b * dip + hh * SSD_HP + tid];
    }
    if (seal) {
        for (int64_t e = tid; e < SSD_HP * SSD_NS; e += STEP_Y3)
            hs[e] = fmaf(E[bh], hs[e], S[bh * SSD_HP * SSD_NS + e]);
        __syncthreads(); /* h is whole before its rows are read */
    }
    const float *q = Q + ((e0 + w) * H + hh) * SSD_NS;
    for (int m = tid; m < SSD_NS / 4; m += STEP_Y3) mb_cp_async16(qs + 4 * m, q + 4 * m, 16);
    for (int e = tid; e < (w + 1) * (SSD_HP / 4); e += STEP_Y3) {
        const int u = e / (SSD_HP / 4), c = e % (SSD_HP / 4) * 4;
        mb_cp_async16(&Vt[u][c], V + ((e0 + u) * H + hh) * SSD_HP + c, 16);
    }
    mb_cp_commit();
    const float *adt = ADT + e0 * H + hh; /* row u at adt[u * H] */
    float4 row[SSD_NS / 4];
    float s = 0.0f, sc = 0.0f;
    if (tid < w) {
        step_row(row, K + ((e0 + tid) * H + hh) * SSD_NS);
        sc = m3_scale(DT, SIG, H, (e0 + tid) * H + hh, true);
        if (whole || tid == w - 1)
            for (int64_t i = tid + 1; i <= w; i++) s = s + adt[i * H];
        else
            s = sg[tid] + adt[w * H];
        sg[tid] = s;
    } else if (tid == w) {
        float c = 0.0f;
        if (whole || w == 0)
            for (int64_t i = 0; i <= w; i++) c = c + adt[i * H];
        else
            c = sg[M3Q] + adt[w * H];
        sg[M3Q] = c;
        Mt[M3Q] = mb_exp(c);
    } else if (tid >= M3Q) {
        step_row(row, hs + (tid - M3Q) * SSD_NS);
    }
    mb_cp_wait<0>();
    __syncthreads();
    if (tid < w)
        Mt[tid] = step_dot<true>(qs, row, sc) * mb_exp(s);
    else if (tid >= M3Q)
        Ys[tid - M3Q] = step_dot<false>(qs, row, 1.0f);
    __syncthreads();
    if (tid < SSD_HP) {
        const int p = tid;
        float yi = 0.0f;
#pragma unroll 8 /* the shared-memory reads run ahead of the chain */
        for (int u = 0; u < w; u++) yi = fmaf(Mt[u], Vt[u][p], yi);
        float y = Ys[p] * Mt[M3Q] + yi;
        y = y + dq * Vt[w][p];
        yg[b * di + hh * SSD_HP + p] = y * mb_silu(z);
    }
}

#undef STEP_Y3
#undef STEP_Q2
#undef STEP_PS
#undef STEP_PC
#undef STEP_CB
#undef STEP_CBT
