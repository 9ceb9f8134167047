/* A decode session's step of Mamba-2 and Mamba-3 as part of one CUDA graph
 * (mamba/_cuda_session.py): the chunk tables that _cuda_ssd._Plan would give a
 * one-token call, written on the device from the session's own count of buffered
 * tokens, so that a replayed graph needs no data from the host.
 *
 * The ext layout of ssd.cu with row b's ext rows at b * Q: the state buffers
 * (B, Q, W) are their own ext arrays, and every grid and table size depends only
 * on B. ctl[0] holds the buffered tokens, moved on once every reader has read it
 * (Mamba-2: by the output kernel, after the dots kernel; Mamba-3: by the step
 * kernel's last block to have read it). A step the session guard refused
 * (finite.cu) gets an empty plan: no new row, no fold, no state piece written, the
 * count kept. */
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

/* Mamba-2, the step's first kernel after in_proj and the conv. t = ctl[0] rows are
 * buffered. Block 0 writes the tables: scal = (count after the step, fold, refused,
 * whole: ctl[1], so that mb_m2_step_y_k may move ctl on),
 * desc = one chunk per row (rows [0, n) at ext row b * 256, output row t, folding
 * when it fills the chunk), rep = the h_last report's chunk (the open rows after the
 * step). The grid shares the new row's writes: u (the conv's output, B x CD) and the
 * raw dt (ldr apart) into buffer row t of bx and bd, and dt, dA and cs of rows
 * [from, n) of each (row, head) into the session's cache (B * H, 256) with
 * mb_m2_prep_k's expressions and chain; from is t, or 0 when ctl[1] asks for the
 * whole chunk (the buffers were loaded since the cache was made). Then the dots
 * with C_t, each a row's serial chain: C . B_j of the open chunk's rows j <= t into
 * G (B, 256; the same for every head) and C . h_p of every head's state column p
 * into Yo (B, H * 64; Y_off's dots). A block takes STEP_CB rows (grid x: the 256 /
 * STEP_CB blocks of B's rows, then the H * 64 / STEP_CB of h's; y: batch rows),
 * copies them whole with coalesced reads (the new row's from u), and thread r walks
 * row r. */
MB_KERNEL void MB_BOUNDS(STEP_CBT)
mb_m2_step_cb_k(int64_t H, int64_t di, int64_t CD, const float *u, const float *dtr, int64_t ldr,
                const float *dt_bias, const float *A_log, int64_t lo_bits, int64_t hi_bits,
                const unsigned long long *guard, const int64_t *ctl, float *bx, float *bd,
                float *dt, float *dA, float *cs, int64_t *scal, int64_t *desc, int64_t *rep,
                const float *h, float *G, float *Yo)
{
    MB_GRID_WAIT();
    __shared__ __align__(16) float rows[STEP_CB][SSD_NS + 4];
    __shared__ __align__(16) float Ct[SSD_NS];
    const int64_t B = gridDim.y, t = ctl[0], from = ctl[1] ? 0 : t;
    const bool refused = mb_refused(guard);
    const int64_t n = refused ? t : t + 1, fold = n == STEP_Q2;
    const int tid = threadIdx.x;
    const int64_t blk = (int64_t)blockIdx.y * gridDim.x + blockIdx.x;
    if (blk == 0) {
        for (int64_t b = tid; b < B; b += blockDim.x) {
            step_desc(desc + b * MB_DESC, b, b * STEP_Q2, n, t, fold);
            step_desc(rep + b * MB_DESC, b, b * STEP_Q2, fold ? 0 : n, 0, 0);
        }
        if (tid == 0) {
            scal[0] = n % STEP_Q2;
            scal[1] = fold;
            scal[2] = refused;
            scal[3] = ctl[1];
        }
    }
    /* the dots' copies first: they read only rows the loop below leaves alone (the
     * new row comes from u), and are in flight while it runs */
    const int64_t b = blockIdx.y, gb = STEP_Q2 / STEP_CB, on_b = blockIdx.x < gb;
    const int64_t r0 = (on_b ? blockIdx.x : blockIdx.x - gb) * STEP_CB;
    const bool dots = t < n && !(on_b && r0 > t); /* not refused, rows up to t */
    const int nr = on_b && t + 1 - r0 < STEP_CB ? (int)(t + 1 - r0) : STEP_CB;
    const float *un = u + b * CD + di; /* the new row's B and C */
    if (dots) {
        const float *src = on_b ? bx + (b * STEP_Q2 + r0) * CD + di
                                : h + (b * H * SSD_HP + r0) * SSD_NS;
        const int64_t ld = on_b ? CD : SSD_NS;
        for (int m = tid; m < SSD_NS / 4; m += STEP_CBT)
            mb_cp_async16(Ct + 4 * m, un + SSD_NS + 4 * m, 16);
        for (int e = tid; e < nr * (SSD_NS / 4); e += STEP_CBT) {
            const int r = e / (SSD_NS / 4), c = e % (SSD_NS / 4) * 4;
            mb_cp_async16(&rows[r][c], (on_b && r0 + r == t ? un : src + r * ld) + c, 16);
        }
    }
    mb_cp_commit();
    const float lo = __int_as_float((int)lo_bits), hi = __int_as_float((int)hi_bits);
    const int64_t stride = (int64_t)gridDim.x * gridDim.y * blockDim.x;
    for (int64_t i = blk * blockDim.x + tid; i < B * (CD + H); i += stride) {
        if (i < B * CD) {
            const int64_t bi = i / CD, c = i % CD;
            if (!refused) bx[(bi * STEP_Q2 + t) * CD + c] = u[i];
            continue;
        }
        const int64_t bh = i - B * CD, bi = bh / H, hh = bh % H;
        const float raw = dtr[bi * ldr + hh];
        if (!refused) bd[(bi * STEP_Q2 + t) * H + hh] = raw;
        const float A = -mb_exp(A_log[hh]), bias = dt_bias[hh];
        float *dtc = dt + bh * STEP_Q2, *dAc = dA + bh * STEP_Q2, *csc = cs + bh * STEP_Q2;
        float acc = from > 0 ? csc[from - 1] : 0.0f;
        for (int64_t j = from; j < n; j++) {
            const float r = j == t ? raw : bd[(bi * STEP_Q2 + j) * H + hh];
            const float v = mb_clamp(mb_softplus(r + bias), lo, hi);
            const float a = v * A;
            acc = acc + a;
            dtc[j] = v;
            dAc[j] = a;
            csc[j] = acc;
        }
    }
    if (!dots) return;
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
 * or, when the plan says whole, walks it again. A chunk that folds then moves the
 * block's columns of h on, h = fma(E, h, S) as mb_m2_fold_k and mb_ssd_chain_k do,
 * and leaves zeros in the buffers (as _Plan's store does): each block its own
 * columns of x, the last block of a row to finish (done: a counter per row, back to
 * 0 after) the B and C columns every block reads, and the raw dt. The row leaves
 * gated by silu(z) (z: the row of zx, NP apart), as mb_m2_y_k gates it. Block 0
 * moves ctl on: mb_m2_step_cb_k, its only reader, is complete. */
MB_KERNEL void MB_BOUNDS(STEP_Q2)
mb_m2_step_y_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const int64_t *scal,
               int64_t *ctl, unsigned *done, float *U, float *bd, const float *dt,
               const float *dA, const float *cs, const float *D, const float *zx, int64_t NP,
               const float *G, const float *Yo, float *h, float *seg, float *yb)
{
    MB_GRID_WAIT();
    __shared__ __align__(16) float Xs[STEP_Q2][STEP_PC];
    __shared__ float Mt[STEP_Q2], dts[STEP_Q2];
    __shared__ bool last_block;
    const int64_t hh = blockIdx.x, b = blockIdx.y, bh = b * H + hh, *d = desc + b * MB_DESC;
    const int tid = threadIdx.x;
    if (hh == 0 && b == 0 && blockIdx.z == 0 && tid == 0) {
        ctl[0] = scal[0];
        if (!scal[2]) ctl[1] = 0;
    }
    /* every global read is issued as early as its address is known: the step
     * waits on memory as few times as it can */
    const int64_t e0 = d[1], n = d[2], t = d[3], whole = scal[3];
    if (t >= n) return; /* refused: no row, the columns kept */
    const int p0 = blockIdx.z * STEP_PC;
    const int64_t c0 = hh * SSD_HP + p0, c = c0 + tid; /* the block's first column, the thread's */
    float *u = U + e0 * CD;
    const float *dAc = dA + bh * STEP_Q2;
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
    /* the fold of the block's columns: mb_m2_fold_k's S (its terms and chains: rows
     * j ascending, SSD_FJ staged at a time in Xs) and E, then h = fma(E, h, S) */
    static_assert(SSD_FJ * (SSD_NS + STEP_PC) <= STEP_Q2 * STEP_PC, "the fold's staging fits Xs");
    float(*fA)[SSD_NS] = (float(*)[SSD_NS]) & Xs[0][0];
    float(*fB)[STEP_PC] = (float(*)[STEP_PC])(&Xs[0][0] + SSD_FJ * SSD_NS);
    float *hs = h + bh * SSD_HP * SSD_NS;
    const float *csc = cs + bh * STEP_Q2, *dtc = dt + bh * STEP_Q2;
    const float last = csc[STEP_Q2 - 1], ex = mb_exp(last);
    const int m0 = 4 * (tid / 8), q0 = 4 * (tid % 8); /* rows m0 + (0..3), columns q0 + (0..3) */
    float acc[4][4] = {};
    __syncthreads(); /* Mt and Xs are consumed */
    Mt[tid] = mb_exp(last - csc[tid]);
    for (int j0 = 0; j0 < STEP_Q2; j0 += SSD_FJ) {
        __syncthreads(); /* the decays are written, the previous rows consumed */
        for (int e = tid; e < SSD_FJ * SSD_NS; e += STEP_Q2) {
            const int j = e / SSD_NS, m = e % SSD_NS;
            fA[j][m] = u[(j0 + j) * CD + di + m] * Mt[j0 + j];
        }
        for (int e = tid; e < SSD_FJ * STEP_PC; e += STEP_Q2) {
            const int j = e / STEP_PC, q = e % STEP_PC;
            fB[j][q] = u[(j0 + j) * CD + c0 + q] * dtc[j0 + j];
        }
        __syncthreads();
        ssd_mma<4, 4, 4, 4>(acc, &fA[0][m0], SSD_NS, &fB[0][q0], STEP_PC, 0, SSD_FJ);
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int64_t e = (p0 + q0 + q) * SSD_NS + m0 + r;
            hs[e] = fmaf(ex, hs[e], acc[r][q]);
        }
    /* the block's reads of the buffers are behind the last barrier */
    const float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int e = tid; e < STEP_Q2 * (STEP_PC / 4); e += STEP_Q2)
        *(float4 *)(u + e / (STEP_PC / 4) * CD + c0 + e % (STEP_PC / 4) * 4) = zero;
    if (tid == 0) last_block = mb_last_block(done + b, gridDim.x * gridDim.z);
    __syncthreads();
    if (!last_block) return;
    constexpr int BC = 2 * SSD_NS / 4; /* float4s of a row's B and C */
    for (int e = tid; e < STEP_Q2 * BC; e += STEP_Q2)
        *(float4 *)(u + e / BC * CD + di + e % BC * 4) = zero;
    for (int64_t e = tid; e < STEP_Q2 * H / 4; e += STEP_Q2)
        *(float4 *)(bd + b * STEP_Q2 * H + 4 * e) = zero;
}

#define STEP_Y3 (M3Q + SSD_HP) /* threads of mb_m3_step_k: one per column j, then per p */

/* Mamba-3, a step after in_proj (rows zx, dip apart), block (head hh, row b). In
 * order:
 * - The plan: t = ctl[0] in [0, 64] rows of the working chunk are buffered; the
 *   new token goes to row w = t or, when t = 64, seals the chunk (which folds with
 *   the new token's beta) and becomes row 0 of the next; whole (ctl[1]): the
 *   carried columns are to be walked again. Block (0, b) writes its row's rep and
 *   last, the reports' chunk and row (the working chunk after the step). Each block
 *   counts itself in done once it has read ctl; the last moves ctl on (unless the
 *   step was refused) and sets done back to 0. Nothing else when refused.
 * - The new token's rows of the block's head, in shared memory: the B and C RMSNorms
 *   (reference/norm.c's chain; fast: a warp's shuffle sum), m3_prep_one of the head
 *   and of every angle (the angles' tanh), then the head's angle steps and rotation
 *   (m3_angle into theta, m3_rotate_token into q and k).
 * - Input_States (pk given): h += (v * k) * (dt_1 * (1 - sig_1)), the new token's
 *   dt and sig, then pk and pv are zeroed (such a step's x is checked before the
 *   launch: it is never refused).
 * - At a seal, the full chunk folds into h as mb_m3_fold_k and mb_ssd_chain_k do
 *   (the new token's beta completes its last row's trapezoid): h = fma(exp(cs_last),
 *   h, S), h then being the state entering the new chunk.
 * - The output row w of the chunk holding the new token, mb_m3_y_k's row i = w (G,
 *   M, ys, yi, the D and qk_gamma term and the gate in its expressions and orders):
 *   thread j < w computes column j of M, thread M3Q + p the ys of column p, each
 *   from its row (of K, of h) held in registers, loaded with the staging of V's rows
 *   u <= w, so that the step waits on global memory once; thread p then walks yi's
 *   chain. seg[w][j] of the columns j < w (the serial sum of A*dt[j+1..w] from +0)
 *   and the cumsum cs_w are carried between steps in seg (B * H, 65; cs in the last
 *   slot): each step adds A*dt[w] to the row before's, or walks them again when the
 *   plan says whole (or a chunk starts).
 * - Last, the new row into the buffers' row w; at a seal, row 0 and zeros after it
 *   (as _Plan's store). */
MB_KERNEL void MB_BOUNDS(STEP_Y3)
mb_m3_step_k(int64_t H, int64_t di, int64_t dip, const float *zx, const float *Bn_w,
             const float *Cn_w, const float *dt_bias, const float *B_bias, const float *C_bias,
             const float *D, int64_t fast, const unsigned long long *guard, int64_t *ctl,
             unsigned *done, int64_t *rep, int64_t *last, float *theta, float *pk, float *pv,
             float *bq, float *bk, float *bv, float *bdt, float *bsg, float *bad, float *h,
             float *seg, float *yg)
{
    MB_GRID_WAIT();
    __shared__ __align__(16) float Vt[M3Q][SSD_HP], bc[2][SSD_NS]; /* B and C, raw, then normed */
    __shared__ __align__(16) float qs[SSD_NS], ks[SSD_NS], fA[SSD_FJ][SSD_NS], fB[SSD_FJ][SSD_HP];
    __shared__ float Mt[M3Q + 1], Ys[SSD_HP], cs[M3Q], sc[M3Q], dec[M3Q];
    __shared__ float rr[2], ta[M3A], nt[4]; /* nt: the new token's dt, sig, A*dt, qk gamma */
    __shared__ int64_t plan[2];
    const int64_t hh = blockIdx.x, b = blockIdx.y, bh = b * H + hh, per = SSD_HP * SSD_NS;
    const int tid = threadIdx.x, lane = tid % 32, wp = tid / 32;
    const float *row = zx + b * dip;
    if (tid == 0) {
        plan[0] = ctl[0];
        plan[1] = ctl[1];
    }
    /* the new token's B and C load with the plan (a refused step drops them) */
    for (int i = tid; i < 2 * SSD_NS; i += STEP_Y3) bc[i / SSD_NS][i % SSD_NS] = row[2 * di + i];
    __syncthreads();
    const int64_t t = plan[0], whole = plan[1], e0 = b * M3Q;
    const bool refused = mb_refused(guard), seal = !refused && t == M3Q;
    const int64_t w = t == M3Q ? 0 : t;
    if (tid == STEP_Y3 - 1) { /* a thread the norms and prep leave idle */
        if (hh == 0) {
            const int64_t after = refused ? t : t % M3Q + 1, nrep = after > 0 ? after : 1;
            step_desc(rep + b * MB_DESC, b, e0, nrep, 0, 0);
            last[b] = e0 + nrep - 1;
        }
        if (mb_last_block(done, gridDim.x * gridDim.y) && !refused) {
            ctl[0] = w + 1;
            ctl[1] = 0;
        }
    }
    if (refused) return;
    if (wp < 2) {
        const float *x = bc[wp];
        if (fast) {
            float s = 0.0f;
            for (int m = lane; m < SSD_NS; m += 32) s = fmaf(x[m], x[m], s);
            for (int o = 16; o > 0; o /= 2) s += MB_SHFL_XOR(s, o);
            if (lane == 0) rr[wp] = rsqrtf(s / (float)SSD_NS + MB_EPS);
        } else if (lane == 0) {
            rr[wp] = mb_rms_r(mb_sumsq_row(x, SSD_NS), SSD_NS);
        }
    }
    __syncthreads();
    for (int i = tid; i < 2 * SSD_NS; i += STEP_Y3) {
        const int q = i / SSD_NS, m = i % SSD_NS;
        bc[q][m] = (bc[q][m] * rr[q]) * (q ? Cn_w : Bn_w)[m];
    }
    __syncthreads();
    /* e = -hh puts the head's values in nt's slots */
    if (tid <= M3A)
        m3_prep_one<false>(row, tid ? H + tid - 1 : hh, H, di, dt_bias, bc[1], bc[0], B_bias,
                           C_bias, -hh, nt, nt + 1, nt + 2, nt + 3, ta);
    __syncthreads(); /* dt and the angles' tanh are written */
    if (tid < M3A) {
        const int64_t at = bh * M3A + tid;
        const float th = m3_angle(theta[at], ta[tid], nt[0]);
        theta[at] = th;
        m3_rotate_token(m3_turn_of(th), hh, 0, tid, bc[0], bc[1], B_bias, C_bias, qs, ks);
    }
    __syncthreads(); /* q and k are written */
    float *hs = h + bh * per, *sg = seg + bh * (M3Q + 1);
    if (pk) {
        const float w1 = m3_beta(nt[0], nt[1]);
        for (int e = tid; e < per; e += STEP_Y3)
            hs[e] = hs[e] + (pv[bh * SSD_HP + e / SSD_NS] * pk[bh * SSD_NS + e % SSD_NS]) * w1;
        __syncthreads(); /* pk and pv are read */
        for (int e = tid; e < SSD_NS + SSD_HP; e += STEP_Y3)
            (e < SSD_NS ? pk[bh * SSD_NS + e] : pv[bh * SSD_HP + e - SSD_NS]) = 0.0f;
    }
    const float *vn = row + di + hh * SSD_HP;
    auto at = [&](int64_t j) { return (e0 + j) * H + hh; }; /* buffer row j's index */
    /* the scale of row j < end, whose next row is the new token's when j + 1 = end */
    auto scale = [&](int64_t j, int64_t end) {
        const int64_t e = at(j);
        const bool nw = j + 1 == end;
        const float beta = m3_beta(nw ? nt[0] : bdt[e + H], nw ? nt[1] : bsg[e + H]);
        return m3_scale_of(bdt[e], bsg[e], beta);
    };
    auto adt = [&](int64_t i) { return i == w ? nt[2] : bad[at(i)]; };
    if (seal) {
        m3_fold<STEP_Y3>(
            M3Q, [&](int64_t j) { return bad[at(j)]; }, [&](int64_t j) { return scale(j, M3Q); },
            ssd_rows_a([&](int64_t j) { return bk + at(j) * SSD_NS; }, fA),
            [](int64_t, int, int) {},
            [&](int64_t j) { return bv + at(j) * SSD_HP; },
            [&](int64_t e, float4 v, float ex) { ssd_put4(hs, hs, ex, e, v); }, cs, sc, dec,
            fA, fB);
        __syncthreads(); /* h is whole before its rows are read */
    }
    float dq = 0.0f, z = 0.0f; /* the row's epilogue operands */
    if (tid < SSD_HP) {
        dq = D[hh] + nt[3];
        z = row[hh * SSD_HP + tid];
    }
    /* every global read is issued as early as its address is known */
    for (int e = tid; e < w * (SSD_HP / 4); e += STEP_Y3) {
        const int u = e / (SSD_HP / 4), c = e % (SSD_HP / 4) * 4;
        mb_cp_async16(&Vt[u][c], bv + at(u) * SSD_HP + c, 16);
    }
    mb_cp_commit();
    if (tid < SSD_HP) Vt[w][tid] = vn[tid]; /* in_proj's rows need not be 16-byte aligned */
    float4 row4[SSD_NS / 4];
    float s = 0.0f, scj = 0.0f;
    if (tid < w) {
        step_row(row4, bk + at(tid) * SSD_NS);
        scj = scale(tid, w);
        if (whole || tid == w - 1)
            for (int64_t i = tid + 1; i <= w; i++) s = s + adt(i);
        else
            s = sg[tid] + adt(w);
        sg[tid] = s;
    } else if (tid == w) {
        float c = 0.0f;
        if (whole || w == 0)
            for (int64_t i = 0; i <= w; i++) c = c + adt(i);
        else
            c = sg[M3Q] + adt(w);
        sg[M3Q] = c;
        Mt[M3Q] = mb_exp(c);
    } else if (tid >= M3Q) {
        step_row(row4, hs + (tid - M3Q) * SSD_NS);
    }
    mb_cp_wait<0>();
    __syncthreads();
    if (tid < w)
        Mt[tid] = step_dot<true>(qs, row4, scj) * mb_exp(s);
    else if (tid >= M3Q)
        Ys[tid - M3Q] = step_dot<false>(qs, row4, 1.0f);
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
    /* the new row last: every read of the buffers' rows is behind the barriers */
    const int64_t W = 2 * SSD_NS + SSD_HP + 3;
    for (int64_t i = tid; i < (seal ? M3Q : 1) * W; i += STEP_Y3) {
        const int64_t j = seal ? i / W : w, e = at(j);
        const bool nw = j == w;
        int64_t c = i % W;
        if (c < SSD_NS)
            bq[e * SSD_NS + c] = nw ? qs[c] : 0.0f;
        else if ((c -= SSD_NS) < SSD_NS)
            bk[e * SSD_NS + c] = nw ? ks[c] : 0.0f;
        else if ((c -= SSD_NS) < SSD_HP)
            bv[e * SSD_HP + c] = nw ? Vt[w][c] : 0.0f;
        else if ((c -= SSD_HP) == 0)
            bdt[e] = nw ? nt[0] : 0.0f;
        else if (c == 1)
            bsg[e] = nw ? nt[1] : 0.0f;
        else
            bad[e] = nw ? nt[2] : 0.0f;
    }
}

#undef STEP_Y3
#undef STEP_Q2
#undef STEP_PS
#undef STEP_PC
#undef STEP_CB
#undef STEP_CBT
