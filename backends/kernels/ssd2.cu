/* The Mamba-2 SSD (SPEC 6), the GPU twin of ssd_task and fold in
 * reference/block2.c, on the ext layout of ssd.cu: U (ext rows of the post-conv
 * xBC, CD wide: x | B | C) and DTR (ext rows of in_proj's dt, H wide).
 *   mb_m2_prep_k   dt = clamp(softplus(dt_raw + dt_bias)), dA = dt * A, the
 *                  serial cumsum cs, per (chunk, head).
 *   mb_m2_g_k      G = C . B^T per chunk (dot v1, k = 128), causal entries only.
 *   mb_m2_fold_k   S = (B * exp(cs_last - cs))^T . Xd per (chunk, head); with hin,
 *                  the fold fma(exp(cs_last), hin, S) itself (the h_last report).
 *   mb_m2_y_k      Y = Y_diag + Y_off + x * D of one output row per block.
 *   mb_m2_gate_k   g = Y * silu(z).
 * Every sum is the C reference's serial chain, one thread per output. */
#include "ssd.cu"

#define M2Q 256

/* One thread per (chunk, head): the chunk's n rows in order. dt, dA and cs are
 * (chunks, H, M2Q). lo and hi travel as float bit patterns. */
MB_KERNEL void mb_m2_prep_k(int64_t NC, const int64_t *desc, int64_t H, const float *DTR,
                            const float *dt_bias, const float *A_log, int64_t lo_bits,
                            int64_t hi_bits, float *dt, float *dA, float *cs)
{
    const float lo = __int_as_float((int)lo_bits), hi = __int_as_float((int)hi_bits);
    MB_GRID_LOOP(i, NC * H) {
        const int64_t c = i / H, h = i % H, *d = desc + c * MB_DESC;
        const int64_t e0 = d[1], n = d[2];
        const float A = -mb_exp(A_log[h]), bias = dt_bias[h];
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float t = mb_clamp(mb_softplus(DTR[(e0 + j) * H + h] + bias), lo, hi);
            const float a = t * A;
            acc = acc + a;
            dt[i * M2Q + j] = t;
            dA[i * M2Q + j] = a;
            cs[i * M2Q + j] = acc;
        }
    }
}

/* G[c][i][j] = dot(C_i, B_j) for r0 <= i < n, j <= i. */
MB_KERNEL void mb_m2_g_k(int64_t NC, const int64_t *desc, int64_t di, int64_t CD, const float *U,
                         float *G)
{
    MB_GRID_LOOP(t, NC * M2Q * M2Q) {
        const int64_t c = t / (M2Q * M2Q), i = (t / M2Q) % M2Q, j = t % M2Q;
        const int64_t *d = desc + c * MB_DESC;
        if (i < d[3] || i >= d[2] || j > i) continue;
        const float *Ci = U + (d[1] + i) * CD + di + SSD_NS, *Bj = U + (d[1] + j) * CD + di;
        float acc = 0.0f;
        for (int m = 0; m < SSD_NS; m++) acc = fmaf(Ci[m], Bj[m], acc);
        G[t] = acc;
    }
}

#define FOLD_THREADS 256

/* Block (chunk c, head h), FOLD_THREADS threads. Without hin: chunks with the fold
 * flag write S[c, h] (HP, NS) and E[c, h] = exp(cs_last). With hin (reports, chunk
 * c is row c): out[c, h] = fma(exp(cs_last), hin[c, h], S), or hin when n = 0. */
MB_KERNEL void MB_BOUNDS(FOLD_THREADS)
mb_m2_fold_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U,
             const float *dt, const float *cs, const float *hin, float *out, float *E)
{
    __shared__ float dec[M2Q];
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], per = SSD_HP * SSD_NS;
    if (!hin && !d[5]) return;
    if (n == 0) {
        for (int64_t e = threadIdx.x; e < per; e += FOLD_THREADS) out[ch * per + e] = hin[ch * per + e];
        return;
    }
    const float *csc = cs + ch * M2Q, *dtc = dt + ch * M2Q;
    const float last = csc[n - 1];
    for (int64_t j = threadIdx.x; j < n; j += FOLD_THREADS) dec[j] = mb_exp(last - csc[j]);
    __syncthreads();
    const float ex = mb_exp(last);
    for (int64_t e = threadIdx.x; e < per; e += FOLD_THREADS) {
        const int64_t p = e / SSD_NS, m = e % SSD_NS;
        const float *u = U + e0 * CD;
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++, u += CD)
            acc = fmaf(u[di + m] * dec[j], u[h * SSD_HP + p] * dtc[j], acc);
        if (hin)
            out[ch * per + e] = fmaf(ex, hin[ch * per + e], acc);
        else
            out[ch * per + e] = acc;
    }
    if (!hin && threadIdx.x == 0) E[ch] = ex;
}

/* Block (row i, head h, chunk c), SSD_HP threads (one per p): the row of
 * M = G * exp(seg) in shared memory (seg[i][j] the serial sum of dA[j+1..i] from
 * +0), then Y_diag = M . Xd, Y_off = (C_i . h_prev) * exp(cs_i) and
 * y = (Y_diag + Y_off) + x * D into yb (packed tokens, di wide). */
MB_KERNEL void MB_BOUNDS(SSD_HP)
mb_m2_y_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *G,
          const float *dt, const float *dA, const float *cs, const float *hck, const float *D,
          float *yb)
{
    __shared__ float Mrow[M2Q];
    const int64_t i = blockIdx.x, h = blockIdx.y, c = blockIdx.z, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3];
    if (i < r0 || i >= n) return;
    const int64_t ch = c * H + h;
    const float *dAc = dA + ch * M2Q, *g = G + (c * M2Q + i) * M2Q;
    for (int64_t j = threadIdx.x; j <= i; j += SSD_HP) {
        float s = 0.0f;
        for (int64_t u = j + 1; u <= i; u++) s = s + dAc[u];
        Mrow[j] = g[j] * mb_exp(s);
    }
    __syncthreads();
    const int64_t p = threadIdx.x;
    const float *dtc = dt + ch * M2Q, *u = U + e0 * CD + h * SSD_HP + p;
    float yd = 0.0f;
    for (int64_t j = 0; j <= i; j++) yd = fmaf(Mrow[j], u[j * CD] * dtc[j], yd);
    const float *Ci = U + (e0 + i) * CD + di + SSD_NS, *hp = hck + (ch * SSD_HP + p) * SSD_NS;
    float yo = 0.0f;
    for (int m = 0; m < SSD_NS; m++) yo = fmaf(Ci[m], hp[m], yo);
    const float y = (yd + yo * mb_exp(cs[ch * M2Q + i])) + u[i * CD] * D[h];
    yb[(d[4] + i - r0) * di + h * SSD_HP + p] = y;
}

/* g = Y * silu(z) over M rows of di; z is the first di columns of in_proj's rows. */
MB_KERNEL void mb_m2_gate_k(int64_t M, int64_t di, const float *zxd, int64_t NP, float *yb)
{
    MB_GRID_LOOP(i, M * di) {
        yb[i] = yb[i] * mb_silu(zxd[(i / di) * NP + i % di]);
    }
}

#undef M2Q
#undef FOLD_THREADS
