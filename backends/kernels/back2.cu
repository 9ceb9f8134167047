/* The Mamba-2 SSD backward (docs/numerics.md "Backward (Mamba-2)"), the GPU twin of
 * ssd_bwd and bc_combine in reference/back2.c, on the forward's chunk layout
 * (ssd.cu descriptors of a zero-state prefill without lengths: t0 = 0, so ext rows
 * are the packed tokens and U holds the post-conv xBC rows). The forward's own
 * kernels (ssd2.cu) recompute dt, dA, cs, G, the chunk states hck (HP, NS per
 * chunk and head) and E = exp(cs_last).
 *
 * The C reference walks each (row, head) over its chunks in reverse because of
 * dh, the gradient of the state leaving a chunk. dh entering chunk k is
 * fma(exp(cs_last_k), dh leaving it, S'_k) with S'_k = sum_i C_i dyo_i^T, a
 * function of the chunk alone, so here every chunk's own part runs in parallel
 * and only that fma chain is serial (ssd.cu's mb_ssd_dchain_k), as in the forward's
 * state pass. Each value is produced by the C reference's own sequence of
 * operations: every chain runs whole in one thread, in the reference's order.
 *   mb_m2b_gate_k  dz = (dg * Y) * silu'(z), dY = dg * silu(z).
 *   mb_m2b_row_k   per (chunk, head), a thread per column j of the causal triangle:
 *                  seg, M, dM, dseg down the column; dXd's chain over the rows
 *                  (into du's x columns); dseg's row prefixes summed down the
 *                  columns (sacc).
 *   mb_m2b_off_k   per (chunk, head): dcs from Y_off's terms; S'.
 *   mb_m2b_col_k   per (chunk, head), after the dh chain: the fold's terms of dXd,
 *                  dBd and tmp; du of x and dot(dXd, x); then dcs, its suffix sums,
 *                  ddA and dt_raw's gradient.
 *   mb_m2b_dgs_k   per (row tile, chunk): dG summed over heads, each head's dM and
 *                  Lm formed again.
 *   mb_m2b_bc_k    per (row tile, chunk): dC and dB from dGs, then every head's
 *                  dCoff or dBst term, formed here, in head order.
 *   mb_m2b_alog_k  A_log's gradient from its fold (grad.cu folds the per-head
 *                  vectors).
 * Nothing of Q x Q per head is stored: per chunk and head only dcs and sacc (Q
 * each) and S', dh (NS x HP); per chunk dGs (Q x Q). */
#include "ssd.cu" /* and grad.cu (mb_dsilu), which mamba_kernels.cu includes first */

#define BQ 256            /* chunk size Q of Mamba-2 */
#define BPER (SSD_HP * SSD_NS)
#define BT 32             /* rows per tile: row, off (= SSD_FJ), dgs, bc */
#define CT 16             /* rows per tile: col */
#define COL_THREADS 256   /* col: SSD_NS threads m, then SSD_HP x 2 threads (p, parity) */
#define QM (SSD_NS / (BQ / CT)) /* col: dh rows of q's chain per tile of a whole chunk */

MB_DEV float4 b2_ld4(const float *p) { return *reinterpret_cast<const float4 *>(p); }

/* v = the 64 floats at p (16-byte aligned) */
MB_DEV void b2_load64(const float *p, float *v)
{
#pragma unroll
    for (int k = 0; k < SSD_HP; k += 4) {
        const float4 a = b2_ld4(p + k);
        v[k] = a.x;
        v[k + 1] = a.y;
        v[k + 2] = a.z;
        v[k + 3] = a.w;
    }
}

/* Xd_j = x_j * dt_j of the head whose x starts at u */
MB_DEV void b2_xd(const float *u, float t, float *v)
{
    b2_load64(u, v);
#pragma unroll
    for (int k = 0; k < SSD_HP; k++) v[k] = v[k] * t;
}

/* acc[r] continued over k < K of a[r * lda + k] * w[k], one fmaf each, k ascending,
 * for the R rows of a (shared memory, rows 16-byte aligned); the R chains interleave. */
template <int R, int K> MB_DEV void b2_rows(const float *a, int lda, const float *w, float *acc)
{
#pragma unroll
    for (int k = 0; k < K; k += 4)
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float4 v = b2_ld4(a + r * lda + k);
            acc[r] = fmaf(v.x, w[k], acc[r]);
            acc[r] = fmaf(v.y, w[k + 1], acc[r]);
            acc[r] = fmaf(v.z, w[k + 2], acc[r]);
            acc[r] = fmaf(v.w, w[k + 3], acc[r]);
        }
}

/* q continued over dh[m][p] h_prev[p][m] for m in [m0, m1) (outer) and every p
 * (inner); dh is (NS, HP), h_prev (HP, NS) */
MB_DEV float b2_qdot(const float *dh, const float *hp, int m0, int m1, float q)
{
    for (int m = m0; m < m1; m++)
#pragma unroll 16
        for (int p = 0; p < SSD_HP; p++) q = fmaf(dh[m * SSD_HP + p], hp[p * SSD_NS + m], q);
    return q;
}

/* acc[r] = fmaf(a[r], s, acc[r]) for lo <= r < BT; a in shared memory, 16-byte aligned */
MB_DEV void b2_axpy(const float *a, float s, float *acc, int lo, int hi)
{
#pragma unroll
    for (int r = 0; r < BT; r += 4) {
        const float4 v = b2_ld4(a + r);
        if (r >= lo && r < hi) acc[r] = fmaf(v.x, s, acc[r]);
        if (r + 1 >= lo && r + 1 < hi) acc[r + 1] = fmaf(v.y, s, acc[r + 1]);
        if (r + 2 >= lo && r + 2 < hi) acc[r + 2] = fmaf(v.z, s, acc[r + 2]);
        if (r + 3 >= lo && r + 3 < hi) acc[r + 3] = fmaf(v.w, s, acc[r + 3]);
    }
}

/* Gate backward over M rows of di: dg (M, di) in, dz into zd (ld NP), dY out. dY may
 * be Y itself (each element is read before it is written). */
MB_KERNEL void mb_m2b_gate_k(int64_t M, int64_t di, const float *Y, const float *zxd, int64_t NP,
                             const float *dg, float *dzd, float *dY)
{
    MB_GRID_LOOP(i, M * di) {
        const int64_t m = i / di, j = i % di;
        const float z = zxd[m * NP + j], d = dg[i], y = Y[i];
        dzd[m * NP + j] = (d * y) * mb_dsilu(z);
        dY[i] = d * mb_silu(z);
    }
}

/* Block (head h, chunk c), BQ threads. Thread j owns column j of the causal triangle
 * and walks its rows i >= j down, in tiles of BT rows: seg[i][j] (the serial sum of
 * dA[j+1..i] from +0, carried down the column one term a row), Lm = exp(seg), M = G
 * Lm (G staged a tile at a time where dseg then goes), dM = dot_p(dY_i, Xd_j) (Xd_j
 * in registers), dseg = (dM G) Lm, and dXd_j's
 * chain over the rows, M[i][j] dY_i from +0 (in registers). Per tile, a thread per
 * row then turns the row's dseg into its prefix sums in place, and thread j adds
 * the prefix below j of each of the tile's rows i >= j to sacc[j]. dXd goes to du's
 * x columns, where mb_m2b_col_k adds the fold's term. */
MB_KERNEL void MB_BOUNDS(BQ)
mb_m2b_row_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *G,
             const float *dt, const float *dA, const float *dY, float *sacc, float *du)
{
    __shared__ __align__(16) float dys[BT][SSD_HP];
    __shared__ float ds[BT][BQ + 1], dAs[BQ];
    const int64_t h = blockIdx.x, c = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    /* warps w and w + 4 (one scheduler) take column blocks w and 7 - w: equal rows */
    const int wp = threadIdx.x / 32, j = (wp < 4 ? wp : 11 - wp) * 32 + threadIdx.x % 32;
    float xd[SSD_HP], acc[SSD_HP];
#pragma unroll
    for (int p = 0; p < SSD_HP; p++) xd[p] = acc[p] = 0.0f;
    if (j < n) {
        dAs[j] = dA[ch * BQ + j];
        b2_xd(U + (e0 + j) * CD + h * SSD_HP, dt[ch * BQ + j], xd);
    }
    const float *g0 = G + c * BQ * BQ;
    float seg = 0.0f, sa = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += BT) {
        const int nr = n - i0 < BT ? (int)(n - i0) : BT;
        const int r0 = j > i0 ? (int)(j - i0) : 0; /* the tile's rows i >= j: [r0, nr) */
        __syncthreads(); /* dAs is written; the previous tile's dys and ds are consumed */
        for (int e = threadIdx.x; e < nr * SSD_HP; e += BQ)
            dys[e / SSD_HP][e % SSD_HP] = dY[(tok + i0 + e / SSD_HP) * di + h * SSD_HP + e % SSD_HP];
        for (int r = 0; r < nr; r++) ds[r][threadIdx.x] = g0[(i0 + r) * BQ + threadIdx.x];
        __syncthreads();
        for (int r = r0; r < nr; r++) {
            const int64_t i = i0 + r;
            const float g = ds[r][j]; /* G, staged; dseg replaces it */
            seg = i == j ? 0.0f : seg + dAs[i];
            const float lm = mb_exp(seg), m = g * lm;
            float dm = 0.0f;
#pragma unroll
            for (int p = 0; p < SSD_HP; p += 4) {
                const float4 y = b2_ld4(&dys[r][p]);
                dm = fmaf(y.x, xd[p], dm);
                dm = fmaf(y.y, xd[p + 1], dm);
                dm = fmaf(y.z, xd[p + 2], dm);
                dm = fmaf(y.w, xd[p + 3], dm);
                acc[p] = fmaf(m, y.x, acc[p]);
                acc[p + 1] = fmaf(m, y.y, acc[p + 1]);
                acc[p + 2] = fmaf(m, y.z, acc[p + 2]);
                acc[p + 3] = fmaf(m, y.w, acc[p + 3]);
            }
            ds[r][j] = (dm * g) * lm;
        }
        __syncthreads();
        if (j < nr) { /* row i0 + j: ds[j][u] becomes the serial sum of its dseg[0..u] */
            float pre = 0.0f;
#pragma unroll 8
            for (int64_t u = 0; u < i0 + j; u++) {
                pre = pre + ds[j][u];
                ds[j][u] = pre;
            }
        }
        __syncthreads();
        if (j > 0) /* seg[i][u] holds dA[u+1..i]: dA[j] gets the prefix of row i below j */
#pragma unroll 8
            for (int r = r0; r < nr; r++) sa = sa + ds[r][j - 1];
    }
    if (j < n) {
        sacc[ch * BQ + j] = sa;
        float *o = du + (tok + j) * CD + h * SSD_HP;
#pragma unroll
        for (int p = 0; p < SSD_HP; p += 4) {
            float4 v;
            v.x = acc[p];
            v.y = acc[p + 1];
            v.z = acc[p + 2];
            v.w = acc[p + 3];
            *reinterpret_cast<float4 *>(o + p) = v;
        }
    }
}

/* Block (head h, chunk c), SSD_FOLD_THREADS threads. dcs[i] = dot_p(dY_i, yo_i)
 * exp(cs_i) with yo_i = C_i . h_prev (the forward's Y_off chain over m): thread (p,
 * q) holds h_prev[p][.] in registers and forms yo of 8 rows of a tile, then a thread
 * per row the dot. Where the chunk is not its row's first, S' (NS, HP) = the sum over
 * rows i ascending of C_i[m] dyo_i[p], dyo = dY * exp(cs) (ssd_fold). */
MB_KERNEL void MB_BOUNDS(SSD_FOLD_THREADS)
mb_m2b_off_k(const int64_t *desc, int64_t nk, int64_t H, int64_t di, int64_t CD, const float *U,
             const float *cs, const float *hck, const float *dY, float *dcs, float *Sd)
{
    __shared__ __align__(16) float cr[SSD_FJ][SSD_NS], yr[SSD_FJ][SSD_HP]; /* ssd_fold's sA, sB */
    __shared__ float dys[SSD_FJ][SSD_HP + 1], yos[SSD_FJ][SSD_HP + 1], ev[BQ];
    const int64_t h = blockIdx.x, c = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    const int t = threadIdx.x, p = t % SSD_HP, rb = (t / SSD_HP) * 8;
    for (int64_t i = t; i < n; i += SSD_FOLD_THREADS) ev[i] = mb_exp(cs[ch * BQ + i]);
    float hv[SSD_NS];
    b2_load64(hck + ch * BPER + p * SSD_NS, hv);
    b2_load64(hck + ch * BPER + p * SSD_NS + SSD_HP, hv + SSD_HP);
    for (int64_t i0 = 0; i0 < n; i0 += SSD_FJ) {
        const int nr = n - i0 < SSD_FJ ? (int)(n - i0) : SSD_FJ;
        __syncthreads(); /* ev is written; the previous tile is consumed */
        for (int e = t; e < nr * SSD_NS; e += SSD_FOLD_THREADS)
            cr[e / SSD_NS][e % SSD_NS] = U[(e0 + i0 + e / SSD_NS) * CD + di + SSD_NS + e % SSD_NS];
        for (int e = t; e < nr * SSD_HP; e += SSD_FOLD_THREADS)
            dys[e / SSD_HP][e % SSD_HP] = dY[(tok + i0 + e / SSD_HP) * di + h * SSD_HP + e % SSD_HP];
        __syncthreads();
        if (rb < nr) {
            float yo[8];
#pragma unroll
            for (int r = 0; r < 8; r++) yo[r] = 0.0f;
            b2_rows<8, SSD_NS>(&cr[rb][0], SSD_NS, hv, yo);
#pragma unroll
            for (int r = 0; r < 8; r++) yos[rb + r][p] = yo[r];
        }
        __syncthreads();
        if (t < nr) {
            float a = 0.0f;
#pragma unroll 16
            for (int q = 0; q < SSD_HP; q++) a = fmaf(dys[t][q], yos[t][q], a);
            dcs[ch * BQ + i0 + t] = a * ev[i0 + t];
        }
    }
    if (c % nk == 0) return;
    ssd_fold(n, [] {}, ssd_rows_a([&](int64_t i) { return U + (e0 + i) * CD + di + SSD_NS; }, cr),
             [](int64_t, int, int) {}, /* C_i as it is */
             [&](int64_t i) { return dY + (tok + i) * di + h * SSD_HP; },
             [&](int64_t i) { return ev[i]; },
             [&](int64_t e, float4 v) {
                 float *s = Sd + ch * BPER + (e % SSD_NS) * SSD_HP + e / SSD_NS;
                 s[0] = v.x, s[SSD_HP] = v.y, s[2 * SSD_HP] = v.z, s[3 * SSD_HP] = v.w;
             },
             cr, yr);
}

/* Block (head h, chunk c), COL_THREADS threads, after the dh chain; rows j in tiles
 * of CT. Where the chunk's fold is used (all but a row's last chunk): Bd_j = B_j
 * dec_j (dec = exp(cs_last - cs_j)); dXd_j += dot_m(Bd_j, dh) (threads (p, parity):
 * dh[.][p] in registers, the tile's rows of that parity); dBd_j = dot_p(Xd_j, dh)
 * (threads m: dh[m][.] in registers); tmp_j = dot_m(dBd_j, B_j) dec_j. Then du of x =
 * dY D + dXd dt and xdot_j = dot_p(dXd_j, x_j). Last, per chunk: dcs - tmp, T = the
 * sum of tmp, q = dot(dh, h_prev) over (m, p), m outer (thread 2 CT walks it a slice
 * a tile), dcs[last] = (dcs[last] + T) + q exp(cs_last); the suffix sums of dcs plus
 * sacc give ddA; dt_raw's gradient into dzxd's dt column (ld NP), +0 where the clamp
 * binds; dt per token. lo and hi travel as float bit patterns. */
MB_KERNEL void MB_BOUNDS(COL_THREADS)
mb_m2b_col_k(const int64_t *desc, int64_t nk, int64_t H, int64_t di, int64_t CD, const float *U,
             const float *DTR, const float *dt_bias, const float *A_log, int64_t lo_bits,
             int64_t hi_bits, const float *dt, const float *cs, const float *hck, const float *dh,
             const float *dY, const float *D, const float *dcs, const float *sacc, float *du,
             float *dzdt, int64_t NP, float *ddA, float *dts)
{
    __shared__ __align__(16) float bd[CT][SSD_NS], xd[CT][SSD_HP];
    __shared__ float bs[CT][SSD_NS + 1], db[CT][SSD_NS + 1], xs[CT][SSD_HP + 1], ax[CT][SSD_HP + 1];
    __shared__ float dec[BQ], tm[BQ], xo[BQ], gv[BQ], sa[BQ], qs;
    __shared__ float qd[QM][SSD_HP], qh[SSD_HP][QM]; /* the tile's slice of q: dh rows, h_prev columns */
    const int64_t h = blockIdx.x, c = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    const bool fold = c % nk < nk - 1, mt = threadIdx.x < SSD_NS;
    const int t = threadIdx.x, p = (t - SSD_NS) % SSD_HP, par = (t - SSD_NS) / SSD_HP;
    const float *csc = cs + ch * BQ, *dtc = dt + ch * BQ, *dhc = dh + ch * BPER;
    const float *hp = hck + ch * BPER;
    for (int64_t i = t; i < n; i += COL_THREADS) {
        if (fold) dec[i] = mb_exp(csc[n - 1] - csc[i]);
        sa[i] = sacc[ch * BQ + i];
    }
    float w[SSD_NS]; /* dh[t][.] (its first SSD_HP) for threads m, dh[.][p] for the others */
    if (fold) {
        if (mt)
            b2_load64(dhc + t * SSD_HP, w);
        else
#pragma unroll
            for (int m = 0; m < SSD_NS; m++) w[m] = dhc[m * SSD_HP + p];
    }
    float q = 0.0f;
    int qm = 0; /* q's chain has walked dh's rows [0, qm) (thread 2 CT) */
    for (int64_t j0 = 0; j0 < n; j0 += CT) {
        const int nr = n - j0 < CT ? (int)(n - j0) : CT;
        __syncthreads(); /* dec is written; the previous tile is consumed */
        for (int e = t; e < nr * SSD_NS; e += COL_THREADS) {
            const int r = e / SSD_NS, m = e % SSD_NS;
            const float b = U[(e0 + j0 + r) * CD + di + m];
            bs[r][m] = b;
            if (fold) bd[r][m] = b * dec[j0 + r];
        }
        for (int e = t; e < nr * SSD_HP; e += COL_THREADS) {
            const int r = e / SSD_HP, k = e % SSD_HP;
            const float x = U[(e0 + j0 + r) * CD + h * SSD_HP + k];
            xs[r][k] = x;
            xd[r][k] = x * dtc[j0 + r];
            ax[r][k] = du[(tok + j0 + r) * CD + h * SSD_HP + k];
        }
        if (fold && qm + QM <= SSD_NS)
            for (int e = t; e < QM * SSD_HP; e += COL_THREADS) {
                qd[e / SSD_HP][e % SSD_HP] = dhc[qm * SSD_HP + e];
                qh[e / QM][e % QM] = hp[(e / QM) * SSD_NS + qm + e % QM];
            }
        __syncthreads();
        if (fold && mt) {
            float a[CT];
#pragma unroll
            for (int r = 0; r < CT; r++) a[r] = 0.0f;
            b2_rows<CT, SSD_HP>(&xd[0][0], SSD_HP, w, a);
#pragma unroll
            for (int r = 0; r < CT; r++)
                if (r < nr) db[r][t] = a[r];
        } else if (fold) {
            float a[CT / 2];
#pragma unroll
            for (int k = 0; k < CT / 2; k++) a[k] = 0.0f;
            b2_rows<CT / 2, SSD_NS>(&bd[par][0], 2 * SSD_NS, w, a);
#pragma unroll
            for (int k = 0; k < CT / 2; k++)
                if (par + 2 * k < nr) ax[par + 2 * k][p] = ax[par + 2 * k][p] + a[k];
        }
        __syncthreads();
        if (!mt) {
            for (int r = par; r < nr; r += 2) {
                const int64_t j = j0 + r;
                du[(tok + j) * CD + h * SSD_HP + p] =
                    dY[(tok + j) * di + h * SSD_HP + p] * D[h] + ax[r][p] * dtc[j];
            }
        } else if (t < nr) {
            float a = 0.0f;
#pragma unroll 16
            for (int k = 0; k < SSD_HP; k++) a = fmaf(ax[t][k], xs[t][k], a);
            xo[j0 + t] = a;
        } else if (fold && t >= CT && t < CT + nr) {
            const int r = t - CT;
            float a = 0.0f;
#pragma unroll 16
            for (int m = 0; m < SSD_NS; m++) a = fmaf(db[r][m], bs[r][m], a);
            tm[j0 + r] = a * dec[j0 + r];
        } else if (fold && t == 2 * CT && qm + QM <= SSD_NS) {
            for (int mm = 0; mm < QM; mm++)
#pragma unroll 16
                for (int k = 0; k < SSD_HP; k++) q = fmaf(qd[mm][k], qh[k][mm], q);
        }
        qm += QM;
    }
    __syncthreads();
    if (fold && t == 2 * CT) {
        qs = b2_qdot(dhc, hp, qm < SSD_NS ? qm : SSD_NS, SSD_NS, q);
    }
    for (int64_t i = t; i < n; i += COL_THREADS)
        gv[i] = fold ? dcs[ch * BQ + i] - tm[i] : dcs[ch * BQ + i];
    __syncthreads();
    if (t == 0) {
        if (fold) {
            float T = 0.0f;
            for (int64_t j = 0; j < n; j++) T = T + tm[j];
            gv[n - 1] = (gv[n - 1] + T) + qs * mb_exp(csc[n - 1]);
        }
        float suf = 0.0f;
        for (int64_t i = n - 1; i >= 0; i--) {
            suf = suf + gv[i];
            gv[i] = suf + sa[i];
        }
    }
    __syncthreads();
    const float lo = __int_as_float((int)lo_bits), hi = __int_as_float((int)hi_bits);
    const float A = -mb_exp(A_log[h]), bias = dt_bias[h];
    for (int64_t i = t; i < n; i += COL_THREADS) {
        const float g = gv[i], v = DTR[(e0 + i) * H + h] + bias, sp = mb_softplus(v);
        const float ddt = xo[i] + g * A;
        const float gr = v <= 20.0f ? ddt * mb_sigmoid(v) : ddt;
        dzdt[(tok + i) * NP + h] = (sp < lo || sp > hi) ? 0.0f : gr;
        ddA[(tok + i) * H + h] = g;
        dts[(tok + i) * H + h] = dtc[i];
    }
}

/* Block (row tile of BT rows, chunk c), BQ threads: dGs[i][j] = the sum over heads
 * ascending of dG_h[i][j] = dM Lm, from +0, j <= i. Per head, thread j takes Xd_j
 * into registers, walks seg down column j to the tile and on through it, and for each
 * row forms dM's chain and adds dM Lm to the row's sum (in registers). Two blocks a
 * multiprocessor (44 bytes of spills) hide each other's barriers, which measured
 * faster here and slower for the kernels above (docs/performance.md). */
MB_KERNEL void MB_BOUNDS_MIN(BQ, 2)
mb_m2b_dgs_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *dt,
             const float *dA, const float *dY, float *dGs)
{
    __shared__ __align__(16) float dys[BT][SSD_HP];
    __shared__ float dAs[BQ];
    const int64_t i0 = blockIdx.x * BT, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    if (i0 >= n) return;
    const int j = threadIdx.x, nr = n - i0 < BT ? (int)(n - i0) : BT;
    const bool live = j < i0 + nr; /* column j has rows in the tile */
    float o[BT];
#pragma unroll
    for (int r = 0; r < BT; r++) o[r] = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        const int64_t ch = c * H + h;
        __syncthreads(); /* the previous head's rows are consumed */
        for (int e = j; e < nr * SSD_HP; e += BQ)
            dys[e / SSD_HP][e % SSD_HP] = dY[(tok + i0 + e / SSD_HP) * di + h * SSD_HP + e % SSD_HP];
        if (live) dAs[j] = dA[ch * BQ + j];
        __syncthreads();
        if (!live) continue;
        float xd[SSD_HP];
        b2_xd(U + (e0 + j) * CD + h * SSD_HP, dt[ch * BQ + j], xd);
        float seg = 0.0f;
#pragma unroll 8
        for (int64_t i = j + 1; i < i0; i++) seg = seg + dAs[i];
#pragma unroll
        for (int r0 = 0; r0 < BT; r0 += 4) {
            if (r0 >= nr || i0 + r0 + 3 < j) continue;
            float dm[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* four rows' chains at once */
            b2_rows<4, SSD_HP>(&dys[r0][0], SSD_HP, xd, dm);
#pragma unroll
            for (int r = r0; r < r0 + 4; r++) {
                const int64_t i = i0 + r;
                if (r < nr && i >= j) {
                    seg = i == j ? 0.0f : seg + dAs[i];
                    o[r] = o[r] + dm[r - r0] * mb_exp(seg);
                }
            }
        }
    }
    if (live)
#pragma unroll
        for (int r = 0; r < BT; r++)
            if (r < nr && i0 + r >= j) dGs[(c * BQ + i0 + r) * BQ + j] = o[r];
}

/* Block (row tile of BT rows, chunk c, z), SSD_NS threads (one per m). z = 0: dC_i
 * = the chain over j <= i ascending of dGs[i][j] B_j, then dCoff_h[i] = dot_p(dyo_i,
 * h_prev[.][m]) (dyo = dY exp(cs_i)) of every head ascending; z = 1: dB_j = the chain
 * over i >= j ascending of dGs[i][j] C_i, then, where the chunk's fold is used,
 * dBst_h[j] = dot_p(Xd_j, dh[m]) dec_j of every head ascending. A head's term is
 * formed here from its h_prev or dh column in registers. Into du's B and C columns. */
MB_KERNEL void MB_BOUNDS(SSD_NS)
mb_m2b_bc_k(const int64_t *desc, int64_t nk, int64_t H, int64_t di, int64_t CD, const float *U,
            const float *dt, const float *cs, const float *hck, const float *dh, const float *dY,
            const float *dGs, float *du)
{
    /* z = 0: gs[j][r] = dGs[i0 + r][j]; z = 1: gs[i - i0][r] = dGs[i][i0 + r] */
    __shared__ __align__(16) float gs[BQ][BT + 4], vt[SSD_HP][BT + 4]; /* vt: a head's rows, [p][r] */
    __shared__ float sv[BT]; /* a head's exp(cs_i) or dec_j */
    const int64_t i0 = blockIdx.x * BT, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    if (i0 >= n) return;
    const int m = threadIdx.x, nr = n - i0 < BT ? (int)(n - i0) : BT;
    const bool dc = blockIdx.z == 0, fold = c % nk < nk - 1;
    const float *g = dGs + c * BQ * BQ;
    if (dc)
        for (int64_t e = m; e < nr * (i0 + nr); e += SSD_NS) {
            const int64_t r = e / (i0 + nr), k = e % (i0 + nr);
            if (k <= i0 + r) gs[k][r] = g[(i0 + r) * BQ + k];
        }
    else
        for (int64_t e = m; e < (n - i0) * BT; e += SSD_NS) {
            const int64_t i = i0 + e / BT, r = e % BT;
            if (r < nr && i >= i0 + r) gs[i - i0][r] = g[i * BQ + i0 + r];
        }
    __syncthreads();
    float acc[BT];
#pragma unroll
    for (int r = 0; r < BT; r++) acc[r] = 0.0f;
    if (dc) {
        for (int64_t k = 0; k < i0 + nr; k++) /* rows i >= k */
            b2_axpy(&gs[k][0], U[(e0 + k) * CD + di + m], acc, k > i0 ? (int)(k - i0) : 0, BT);
    } else {
        for (int64_t i = i0; i < n; i++) /* rows j <= i */
            b2_axpy(&gs[i - i0][0], U[(e0 + i) * CD + di + SSD_NS + m], acc, 0, (int)(i - i0) + 1);
    }
    for (int64_t h = 0; h < H && (dc || fold); h++) {
        const int64_t ch = c * H + h;
        const float *csc = cs + ch * BQ;
        float w[SSD_HP];
        if (dc)
#pragma unroll
            for (int k = 0; k < SSD_HP; k++) w[k] = hck[ch * BPER + k * SSD_NS + m];
        else
            b2_load64(dh + ch * BPER + m * SSD_HP, w);
        __syncthreads(); /* the previous head's rows are consumed */
        if (m < nr) sv[m] = dc ? mb_exp(csc[i0 + m]) : mb_exp(csc[n - 1] - csc[i0 + m]);
        __syncthreads();
        for (int e = m; e < nr * SSD_HP; e += SSD_NS) {
            const int r = e / SSD_HP, k = e % SSD_HP;
            vt[k][r] = dc ? dY[(tok + i0 + r) * di + h * SSD_HP + k] * sv[r]
                          : U[(e0 + i0 + r) * CD + h * SSD_HP + k] * dt[ch * BQ + i0 + r];
        }
        __syncthreads();
        float a[BT];
#pragma unroll
        for (int r = 0; r < BT; r++) a[r] = 0.0f;
#pragma unroll
        for (int k = 0; k < SSD_HP; k++) b2_axpy(&vt[k][0], w[k], a, 0, BT);
#pragma unroll
        for (int r = 0; r < BT; r++) acc[r] = acc[r] + (dc ? a[r] : a[r] * sv[r]);
    }
#pragma unroll
    for (int r = 0; r < BT; r++)
        if (r < nr) du[(tok + i0 + r) * CD + di + (dc ? SSD_NS : 0) + m] = acc[r];
}

/* A_log's gradient: the fold of ddA * dt (in out) times dA / dA_log = A = -exp(A_log). */
MB_KERNEL void mb_m2b_alog_k(int64_t H, const float *A_log, float *out)
{
    MB_GRID_LOOP(h, H) out[h] = out[h] * -mb_exp(A_log[h]);
}

#undef BQ
#undef BPER
#undef BT
#undef CT
#undef COL_THREADS
#undef QM
