/* The Mamba-2 SSD (SPEC 6), the GPU twin of ssd_task and fold in
 * reference/block2.c, on the ext layout of ssd.cu: U (ext rows of the post-conv
 * xBC, CD wide: x | B | C) and DTR (ext rows of in_proj's dt, H wide).
 *   mb_m2_prep_k   dt = clamp(softplus(dt_raw + dt_bias)), dA = dt * A, the
 *                  serial cumsum cs, per (chunk, head).
 *   mb_m2_g_k      G = C . B^T per chunk (dot v1, k = 128), causal entries only.
 *   mb_m2_fold_k   S = (B * exp(cs_last - cs))^T . Xd per (chunk, head); with hin,
 *                  the fold fma(exp(cs_last), hin, S) itself (the h_last report).
 *   mb_m2_y_k      Y = Y_diag + Y_off + x * D of a chunk and head per block.
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

/* Block (chunk c, head h), SSD_FOLD_THREADS threads. Without hin: chunks with the
 * fold flag write S[c, h] (HP, NS) and E[c, h] = exp(cs_last). With hin (reports,
 * chunk c is row c): out[c, h] = fma(exp(cs_last), hin[c, h], S), or hin when n = 0.
 * S's terms are (B_j[m] * dec_j) (x_j[p] * dt_j), each product rounded once as in
 * block2.c. */
MB_KERNEL void MB_BOUNDS(SSD_FOLD_THREADS)
mb_m2_fold_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U,
             const float *dt, const float *cs, const float *hin, float *out, float *E)
{
    __shared__ float dec[M2Q];
    __shared__ float sA[SSD_FJ][SSD_NS], sB[SSD_FJ][SSD_HP];
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], per = SSD_HP * SSD_NS;
    if (!hin && !d[5]) return;
    if (n == 0) {
        for (int64_t e = threadIdx.x; e < per; e += SSD_FOLD_THREADS) out[ch * per + e] = hin[ch * per + e];
        return;
    }
    const float *csc = cs + ch * M2Q, *dtc = dt + ch * M2Q, *u = U + e0 * CD;
    const float last = csc[n - 1], ex = mb_exp(last);
    for (int64_t j = threadIdx.x; j < n; j += SSD_FOLD_THREADS) dec[j] = mb_exp(last - csc[j]);
    float *o = out + ch * per;
    const float *hi = hin ? hin + ch * per : nullptr;
    ssd_fold(n, [&](int64_t j, int m) { return u[j * CD + di + m] * dec[j]; },
             [&](int64_t j, int p) { return u[j * CD + h * SSD_HP + p] * dtc[j]; },
             [&](int64_t e, float acc) { o[e] = hi ? fmaf(ex, hi[e], acc) : acc; }, sA, sB);
    if (!hin && threadIdx.x == 0) E[ch] = ex;
}

#define Y_THREADS 256
#define YT 32 /* output rows per tile */
#define YJ 32 /* rows of x staged per step */
#define YM 16 /* columns of C and h_prev staged per step */

/* Block (head h, chunk c), Y_THREADS threads; the chunk's output rows in tiles of
 * YT. For a tile, thread j (one per column) walks seg[i][j], the serial sum of
 * dA[j+1..i] from +0, down the tile's rows (carrying it from the tile above) and
 * stores that tile of M = G * exp(seg) in shared memory (tiles of rows before r0,
 * which came from the state, only advance seg); then each thread forms 8
 * rows of one p: Y_diag = M . Xd (the chain over j ascending, Xd = x * dt staged
 * YJ rows at a time), Y_off = (C_i . h_prev) * exp(cs_i) (the chain over m, C and
 * h_prev staged YM columns at a time) and y = (Y_diag + Y_off) + x * D into yb (packed tokens, di wide), for rows r0 <= i < n. */
MB_KERNEL void MB_BOUNDS(Y_THREADS)
mb_m2_y_k(const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *G,
          const float *dt, const float *dA, const float *cs, const float *hck, const float *D,
          float *yb)
{
    __shared__ float Mt[YT][M2Q], Xd[YJ][SSD_HP];
    __shared__ float Ct[YT][YM + 1], Ht[SSD_HP][YM + 1];
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], ch = c * H + h;
    const float *dAc = dA + ch * M2Q, *dtc = dt + ch * M2Q, *g = G + c * M2Q * M2Q;
    const int tid = threadIdx.x, p = tid % SSD_HP, rb = (tid / SSD_HP) * 8;
    float seg = 0.0f; /* thread tid's column: seg[i][tid] of the last row walked */
    for (int64_t i0 = 0; i0 < n; i0 += YT) {
        const int64_t i1 = n - i0 < YT ? n : i0 + YT;
        for (int64_t i = i0 > tid ? i0 : tid; i < i1; i++) {
            seg = i == tid ? 0.0f : seg + dAc[i];
            if (i >= r0) Mt[i - i0][tid] = g[i * M2Q + tid] * mb_exp(seg);
        }
        if (i1 <= r0) continue; /* rows from the state only: seg walked, no output */
        float yd[8];
#pragma unroll
        for (int r = 0; r < 8; r++) yd[r] = 0.0f;
        for (int64_t j0 = 0; j0 < i1; j0 += YJ) {
            const int nj = i1 - j0 < YJ ? (int)(i1 - j0) : YJ;
            __syncthreads(); /* Mt is written; the previous Xd rows are consumed */
            for (int e = tid; e < nj * SSD_HP; e += Y_THREADS) {
                const int jj = e / SSD_HP, pp = e % SSD_HP;
                Xd[jj][pp] = U[(e0 + j0 + jj) * CD + h * SSD_HP + pp] * dtc[j0 + jj];
            }
            __syncthreads();
            for (int jj = 0; jj < nj; jj++) {
                const int64_t j = j0 + jj;
                const float xv = Xd[jj][p];
#pragma unroll
                for (int r = 0; r < 8; r++)
                    if (j <= i0 + rb + r) yd[r] = fmaf(Mt[rb + r][j], xv, yd[r]);
            }
        }
        float yo[8];
#pragma unroll
        for (int r = 0; r < 8; r++) yo[r] = 0.0f;
        for (int m0 = 0; m0 < SSD_NS; m0 += YM) {
            __syncthreads(); /* the previous columns are consumed */
            for (int e = tid; e < YT * YM; e += Y_THREADS) {
                const int64_t i = i0 + e / YM;
                Ct[e / YM][e % YM] = i < n ? U[(e0 + i) * CD + di + SSD_NS + m0 + e % YM] : 0.0f;
            }
            for (int e = tid; e < SSD_HP * YM; e += Y_THREADS)
                Ht[e / YM][e % YM] = hck[(ch * SSD_HP + e / YM) * SSD_NS + m0 + e % YM];
            __syncthreads();
#pragma unroll
            for (int mm = 0; mm < YM; mm++)
#pragma unroll
                for (int r = 0; r < 8; r++) yo[r] = fmaf(Ct[rb + r][mm], Ht[p][mm], yo[r]);
        }
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int64_t i = i0 + rb + r;
            if (i < r0 || i >= n) continue;
            const float y = (yd[r] + yo[r] * mb_exp(cs[ch * M2Q + i])) +
                            U[(e0 + i) * CD + h * SSD_HP + p] * D[h];
            yb[(d[4] + i - r0) * di + h * SSD_HP + p] = y;
        }
        __syncthreads(); /* the next tile rewrites Mt */
    }
}

/* g = Y * silu(z) over M rows of di; z is the first di columns of in_proj's rows. */
MB_KERNEL void mb_m2_gate_k(int64_t M, int64_t di, const float *zxd, int64_t NP, float *yb)
{
    MB_GRID_LOOP(i, M * di) {
        yb[i] = yb[i] * mb_silu(zxd[(i / di) * NP + i % di]);
    }
}

#undef M2Q
#undef Y_THREADS
#undef YT
#undef YJ
#undef YM
