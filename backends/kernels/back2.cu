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
 * state pass. Each value is produced by the C reference's own sequence of operations:
 *   mb_m2b_gate_k   dz = (dg * Y) * silu'(z), dY = dg * silu(z).
 *   mb_m2b_row_k    per output row i: M, dG, dseg, the prefix sums of dseg, the
 *                   Y_off terms dcs, dyo and dCoff.
 *   mb_m2b_sdh_k    S'_k per (chunk, head).
 *   mb_m2b_col_k    per column j: dXd, the fold's dXd, dBst and tmp terms, the
 *                   seg part of dA (sacc), du of x, dot(dXd, x).
 *   mb_m2b_dt_k     per (chunk, head): dcs, its suffix sums, ddA and dt_raw's
 *                   gradient.
 *   mb_m2b_dgs_k    dG summed over heads; mb_m2b_bc_k dC and dB from it.
 *   mb_m2b_alog_k   A_log's gradient from its fold (grad.cu folds the per-head
 *                   vectors).
 * Scratch layouts: rows (NC * H, Q, Q) for M and the dseg prefixes; (NC * H, Q)
 * per-row values; per token (M, H, Q) dG and (M, H, NS) dCoff, dBst. */
#include "ssd.cu" /* and grad.cu (mb_dsilu), which mamba_kernels.cu includes first */

#define BQ 256            /* chunk size Q of Mamba-2 */
#define BPER (SSD_HP * SSD_NS)

/* Gate backward over M rows of di: dg (M, di) in, dz into zd (ld NP), dY out. */
MB_KERNEL void mb_m2b_gate_k(int64_t M, int64_t di, const float *Y, const float *zxd, int64_t NP,
                             const float *dg, float *dzd, float *dY)
{
    MB_GRID_LOOP(i, M * di) {
        const int64_t m = i / di, j = i % di;
        const float z = zxd[m * NP + j], d = dg[i];
        dzd[m * NP + j] = (d * Y[i]) * mb_dsilu(z);
        dY[i] = d * mb_silu(z);
    }
}

/* Block (row i, head h, chunk c), SSD_HP threads. */
MB_KERNEL void MB_BOUNDS(SSD_HP)
mb_m2b_row_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *G,
             const float *dt, const float *dA, const float *cs, const float *hck, const float *dY,
             float *Mb, float *Pb, float *dGh, float *dcs, float *dyo, float *dCoff)
{
    __shared__ float dys[SSD_HP], yo[SSD_HP], dyos[SSD_HP], dseg[BQ];
    const int64_t i = blockIdx.x, h = blockIdx.y, c = blockIdx.z, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4] + i;
    if (i >= n) return;
    const int64_t ch = c * H + h, p = threadIdx.x;
    const float *dAc = dA + ch * BQ, *dtc = dt + ch * BQ, *g = G + (c * BQ + i) * BQ;
    const float *hp = hck + ch * BPER; /* h_prev[p][m] */
    dys[p] = dY[tok * di + h * SSD_HP + p];
    __syncthreads();
    float *Mrow = Mb + (ch * BQ + i) * BQ, *dg = dGh + (tok * H + h) * BQ;
    for (int64_t j = p; j <= i; j += SSD_HP) {
        float s = 0.0f;
        for (int64_t u = j + 1; u <= i; u++) s = s + dAc[u];
        const float lm = mb_exp(s), *uj = U + (e0 + j) * CD + h * SSD_HP, tj = dtc[j];
        float dm = 0.0f;
        for (int q = 0; q < SSD_HP; q++) dm = fmaf(dys[q], uj[q] * tj, dm);
        Mrow[j] = g[j] * lm;
        dg[j] = dm * lm;
        dseg[j] = (dm * g[j]) * lm;
    }
    /* Y_off's terms: yo = C_i . h_prev, dcs = dot(dY, yo) * e, dyo = dY * e */
    const float *Ci = U + (e0 + i) * CD + di + SSD_NS;
    float a = 0.0f;
    for (int m = 0; m < SSD_NS; m++) a = fmaf(Ci[m], hp[p * SSD_NS + m], a);
    yo[p] = a;
    const float e = mb_exp(cs[ch * BQ + i]);
    dyos[p] = dys[p] * e;
    dyo[tok * di + h * SSD_HP + p] = dyos[p];
    __syncthreads();
    if (p == 0) {
        float t = 0.0f;
        for (int q = 0; q < SSD_HP; q++) t = fmaf(dys[q], yo[q], t);
        dcs[ch * BQ + i] = t * e;
    } else if (p == 1) {
        /* seg[i][j] holds dA[j+1..i]: dA[m] gets the prefix of row i below m */
        float *pr = Pb + (ch * BQ + i) * BQ, pre = 0.0f;
        for (int64_t m = 1; m <= i; m++) {
            pre = pre + dseg[m - 1];
            pr[m] = pre;
        }
    }
    float *dco = dCoff + (tok * H + h) * SSD_NS;
    for (int m = p; m < SSD_NS; m += SSD_HP) {
        float t = 0.0f;
        for (int q = 0; q < SSD_HP; q++) t = fmaf(dyos[q], hp[q * SSD_NS + m], t);
        dco[m] = t;
    }
}

/* Block (chunk c, head h) of a chunk that is not its row's first (nk chunks per
 * row), FOLD threads: S[m][p] = sum over the chunk's rows i ascending of
 * C_i[m] dyo_i[p]. */
#define BFOLD 256
MB_KERNEL void MB_BOUNDS(BFOLD)
mb_m2b_sdh_k(const int64_t *desc, int64_t nk, int64_t H, int64_t di, int64_t CD, const float *U,
             const float *dyo, float *S)
{
    const int64_t c = blockIdx.x, h = blockIdx.y, *d = desc + c * MB_DESC;
    if (c % nk == 0) return;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    for (int64_t e = threadIdx.x; e < BPER; e += BFOLD) {
        const int64_t m = e / SSD_HP, p = e % SSD_HP;
        const float *C = U + e0 * CD + di + SSD_NS + m, *y = dyo + tok * di + h * SSD_HP + p;
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) acc = fmaf(C[i * CD], y[i * di], acc);
        S[(c * H + h) * BPER + e] = acc;
    }
}

/* Block (column j, head h, chunk c), SSD_HP threads. */
MB_KERNEL void MB_BOUNDS(SSD_HP)
mb_m2b_col_k(const int64_t *desc, int64_t nk, int64_t H, int64_t di, int64_t CD, const float *U,
             const float *dt, const float *cs, const float *dY, const float *Mb, const float *Pb,
             const float *dh, const float *D, float *du, float *dBst, float *tmp, float *sacc,
             float *xdot)
{
    __shared__ float Bd[SSD_NS], dBd[SSD_NS], xd[SSD_HP], dxd[SSD_HP];
    const int64_t j = blockIdx.x, h = blockIdx.y, c = blockIdx.z, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    if (j >= n) return;
    const int64_t ch = c * H + h, p = threadIdx.x, r = ch * BQ + j;
    const float *dtc = dt + ch * BQ, *uj = U + (e0 + j) * CD;
    const float tj = dtc[j];
    /* dXd[j] = sum over i >= j of M[i][j] dY[i] */
    float a = 0.0f;
    for (int64_t i = j; i < n; i++)
        a = fmaf(Mb[(ch * BQ + i) * BQ + j], dY[(tok + i) * di + h * SSD_HP + p], a);
    if (c % nk < nk - 1) {
        /* the chunk's fold h = fma(exp(cs_last), h_prev, Bd^T . Xd) is used */
        const float *csc = cs + ch * BQ, *dhc = dh + ch * BPER;
        const float dec = mb_exp(csc[n - 1] - csc[j]);
        for (int m = p; m < SSD_NS; m += SSD_HP) Bd[m] = uj[di + m] * dec;
        xd[p] = uj[h * SSD_HP + p] * tj;
        __syncthreads();
        float t = 0.0f;
        for (int m = 0; m < SSD_NS; m++) t = fmaf(Bd[m], dhc[m * SSD_HP + p], t);
        a = a + t;
        float *dbs = dBst + ((tok + j) * H + h) * SSD_NS;
        for (int m = p; m < SSD_NS; m += SSD_HP) {
            float q = 0.0f;
            for (int k = 0; k < SSD_HP; k++) q = fmaf(xd[k], dhc[m * SSD_HP + k], q);
            dBd[m] = q;
            dbs[m] = q * dec;
        }
        __syncthreads();
        if (p == 0) {
            float q = 0.0f;
            for (int m = 0; m < SSD_NS; m++) q = fmaf(dBd[m], uj[di + m], q);
            tmp[r] = q * dec;
        }
    }
    dxd[p] = a;
    const float *xj = uj + h * SSD_HP;
    du[(tok + j) * CD + h * SSD_HP + p] = dY[(tok + j) * di + h * SSD_HP + p] * D[h] + a * tj;
    __syncthreads();
    if (p == 0) {
        float q = 0.0f;
        for (int k = 0; k < SSD_HP; k++) q = fmaf(dxd[k], xj[k], q);
        xdot[r] = q;
    } else if (p == 1) {
        /* dA[j]'s part from seg: the prefixes below j of the rows i >= j, ascending */
        float s = 0.0f;
        if (j > 0)
            for (int64_t i = j; i < n; i++) s = s + Pb[(ch * BQ + i) * BQ + j];
        sacc[r] = s;
    }
}

/* One thread per (chunk, head): dcs with the fold's terms, dA's gradient (suffix
 * sums of dcs plus sacc), dt_raw's gradient into dzxd's dt column (ld NP, +0 where
 * the clamp binds), ddA and dt per token. */
MB_KERNEL void mb_m2b_dt_k(int64_t NC, const int64_t *desc, int64_t nk, int64_t H, const float *DTR,
                           const float *dt_bias, const float *A_log, int64_t lo_bits,
                           int64_t hi_bits, const float *dt, const float *cs, const float *hck,
                           const float *dh, const float *tmp, const float *sacc, const float *xdot,
                           float *dcs, float *dzdt, int64_t NP, float *ddA, float *dts)
{
    const float lo = __int_as_float((int)lo_bits), hi = __int_as_float((int)hi_bits);
    MB_GRID_LOOP(t, NC * H) {
        const int64_t c = t / H, h = t % H, *d = desc + c * MB_DESC;
        const int64_t e0 = d[1], n = d[2], tok = d[4];
        const float A = -mb_exp(A_log[h]), bias = dt_bias[h];
        float *dc = dcs + t * BQ;
        const float *tm = tmp + t * BQ, *sa = sacc + t * BQ, *xo = xdot + t * BQ;
        if (c % nk < nk - 1) {
            float T = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                dc[j] = dc[j] - tm[j];
                T = T + tm[j];
            }
            /* dot(dh, h_prev) over (m, p), m outer; hck holds h_prev as [p][m] */
            const float *dhc = dh + t * BPER, *hp = hck + t * BPER;
            float q = 0.0f;
            for (int m = 0; m < SSD_NS; m++)
                for (int p = 0; p < SSD_HP; p++) q = fmaf(dhc[m * SSD_HP + p], hp[p * SSD_NS + m], q);
            dc[n - 1] = (dc[n - 1] + T) + q * mb_exp(cs[t * BQ + n - 1]);
        }
        float suf = 0.0f;
        for (int64_t i = n - 1; i >= 0; i--) {
            suf = suf + dc[i];
            const float g = suf + sa[i], v = DTR[(e0 + i) * H + h] + bias, sp = mb_softplus(v);
            const float ddt = xo[i] + g * A;
            const float gr = v <= 20.0f ? ddt * mb_sigmoid(v) : ddt;
            dzdt[(tok + i) * NP + h] = (sp < lo || sp > hi) ? 0.0f : gr;
            ddA[(tok + i) * H + h] = g;
            dts[(tok + i) * H + h] = dt[t * BQ + i];
        }
    }
}

/* dGs[c][i][j] = sum over heads ascending of dG_h[i][j], j <= i < n. */
MB_KERNEL void mb_m2b_dgs_k(int64_t NC, const int64_t *desc, int64_t H, const float *dGh, float *dGs)
{
    MB_GRID_LOOP(t, NC * BQ * BQ) {
        const int64_t c = t / (BQ * BQ), i = (t / BQ) % BQ, j = t % BQ, *d = desc + c * MB_DESC;
        if (i >= d[2] || j > i) continue;
        const float *g = dGh + (d[4] + i) * H * BQ + j;
        float o = 0.0f;
        for (int64_t h = 0; h < H; h++) o = o + g[h * BQ];
        dGs[t] = o;
    }
}

/* Block (row r, chunk c, z), SSD_NS threads (one per m). z = 0: dC of row r =
 * sum over j <= r of dGs[r][j] B_j, then dCoff of every head ascending. z = 1: dB
 * of row r = sum over i >= r of dGs[i][r] C_i, then dBst of every head ascending
 * where the chunk's fold is used. Into du's B and C columns. */
MB_KERNEL void MB_BOUNDS(SSD_NS)
mb_m2b_bc_k(const int64_t *desc, int64_t nk, int64_t H, int64_t di, int64_t CD, const float *U,
            const float *dGs, const float *dCoff, const float *dBst, float *du)
{
    const int64_t r = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4] + r, m = threadIdx.x;
    if (r >= n) return;
    const float *gs = dGs + c * BQ * BQ, *u = U + e0 * CD + di + m;
    float acc = 0.0f;
    if (blockIdx.z == 0) {
        for (int64_t j = 0; j <= r; j++) acc = fmaf(gs[r * BQ + j], u[j * CD], acc);
        for (int64_t h = 0; h < H; h++) acc = acc + dCoff[(tok * H + h) * SSD_NS + m];
        du[tok * CD + di + SSD_NS + m] = acc;
    } else {
        for (int64_t i = r; i < n; i++) acc = fmaf(gs[i * BQ + r], u[i * CD + SSD_NS], acc);
        if (c % nk < nk - 1)
            for (int64_t h = 0; h < H; h++) acc = acc + dBst[(tok * H + h) * SSD_NS + m];
        du[tok * CD + di + m] = acc;
    }
}

/* A_log's gradient: the fold of ddA * dt (in out) times dA / dA_log = A = -exp(A_log). */
MB_KERNEL void mb_m2b_alog_k(int64_t H, const float *A_log, float *out)
{
    MB_GRID_LOOP(h, H) out[h] = out[h] * -mb_exp(A_log[h]);
}

#undef BQ
#undef BPER
#undef BFOLD
