/* The Mamba-3 SISO mixer (SPEC 7), the GPU twin of put_rows, chunk_out and fold in
 * reference/block3.c, on the ext layout of ssd.cu. Ext arrays, H heads per row:
 * Q, K (rotated, K unscaled; H x 128), V (H x 64), DT, SIG, ADT (H) and QKG (H,
 * qk_gamma, new rows only).
 *   mb_m3_prep_k    per new token and head: heavy-tail A with its floor, dt, A * dt,
 *                   sigmoid(trap), qk_gamma = dot(q, k) * (dt * sig); per token and
 *                   angle: tanh(angle) * PI.
 *   mb_m3_angles_k  per (row, head, angle): the angle recurrence, serial over the
 *                   row's tokens and reduced every token.
 *   mb_m3_rotate_k  per (token, head, angle): the rotation of q and k.
 *   mb_m3_pending_k Input_States: h0 = h + (v * k) * (dt_1 * (1 - sig_1)).
 *   mb_m3_fold_k    S = (v * exp(cs_last - cs))^T . (k * scale) per (chunk, head);
 *                   with hin, the fold itself (the h_last report).
 *   mb_m3_y_k       the gated output of a chunk and head per block.
 *   mb_m3_last_k    the k_last and v_last reports.
 * The backward (back3.cu) includes this file for m3_heavy_tail, m3_rotate, m3_scale and
 * the sizes M3Q, M3A. */
#ifndef MB_SSD3_CU
#define MB_SSD3_CU
#include "ssd.cu"

#define M3Q 64
#define M3A 32 /* rotary angles */

/* upstream main's heavy-tail A before its floor: -(x >= 0 ? 1 + x : 1 / (1 - x)) */
MB_DEV float m3_heavy_tail(float x)
{
    return -(x >= 0.0f ? 1.0f + x : 1.0f / (1.0f - x));
}

/* Grid (x over the row's tokens * (H + M3A), y over rows). zx rows are in_proj's
 * (z | x | B | C | dd_dt | dd_A | trap | angle); Bn, Cn the normed B and C. */
MB_KERNEL void mb_m3_prep_k(int64_t B, const int64_t *off, const int64_t *eoff, const int64_t *t0,
                            int64_t H, int64_t di, int64_t dip, const float *zx,
                            const float *dt_bias, const float *Bn, const float *Cn,
                            const float *B_bias, const float *C_bias, float *DT, float *SIG,
                            float *ADT, float *QKG, float *TA)
{
    const int64_t oDT = 2 * di + 2 * SSD_NS, oA = oDT + H, oTR = oA + H, oANG = oTR + H;
    const int64_t W = H + M3A;
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], e0 = eoff[b] + t0[b];
        MB_GRID_LOOP(i, (off[b + 1] - o) * W) {
            const int64_t t = i / W, j = i % W, tok = o + t;
            const float *r = zx + tok * dip;
            if (j >= H) {
                TA[tok * M3A + j - H] = mb_tanh(r[oANG + j - H]) * MB_PI;
                continue;
            }
            const int64_t h = j, e = (e0 + t) * H + h;
            const float dA = r[oA + h];
            float A = m3_heavy_tail(dA);
            A = A > -1e-4f ? -1e-4f : A;
            const float dt = mb_softplus(r[oDT + h] + dt_bias[h]);
            const float sig = mb_sigmoid(r[oTR + h]);
            DT[e] = dt;
            ADT[e] = A * dt;
            SIG[e] = sig;
            const float *c = Cn + tok * SSD_NS, *k = Bn + tok * SSD_NS;
            const float *cb = C_bias + h * SSD_NS, *kb = B_bias + h * SSD_NS;
            float acc = 0.0f;
            for (int m = 0; m < SSD_NS; m++) acc = fmaf(c[m] + cb[m], k[m] + kb[m], acc);
            QKG[e] = acc * (dt * sig);
        }
    }
}

/* theta after a token: mod2pi(theta + ta * dt). */
MB_DEV float m3_angle(float th, float ta, float dt) { return mb_mod2pi(th + ta * dt); }

/* Token tok (ext row index e = ext row * H + h) at angle th: pair (2r, 2r + 1) of
 * the biased q and k rotated, dims 64 + 2r, 64 + 2r + 1 copied unrotated; rot
 * (optional) receives cos and sin at rot[(e * M3A + r) * 2 + {0, 1}]. */
MB_DEV void m3_rotate_token(float th, int64_t h, int64_t tok, int64_t e, int64_t r,
                            const float *Bn, const float *Cn, const float *B_bias,
                            const float *C_bias, float *Q, float *K, float *rot)
{
    const float *cb = C_bias + h * SSD_NS, *kb = B_bias + h * SSD_NS;
    const float cs = mb_cos(th), sn = mb_sin(th);
    if (rot) {
        rot[(e * M3A + r) * 2] = cs;
        rot[(e * M3A + r) * 2 + 1] = sn;
    }
    const float *c = Cn + tok * SSD_NS, *k = Bn + tok * SSD_NS;
    float *qo = Q + e * SSD_NS, *ko = K + e * SSD_NS;
    const float q0 = c[2 * r] + cb[2 * r], q1 = c[2 * r + 1] + cb[2 * r + 1];
    const float k0 = k[2 * r] + kb[2 * r], k1 = k[2 * r + 1] + kb[2 * r + 1];
    qo[2 * r] = (q0 * cs) - (q1 * sn);
    qo[2 * r + 1] = (q0 * sn) + (q1 * cs);
    ko[2 * r] = (k0 * cs) - (k1 * sn);
    ko[2 * r + 1] = (k0 * sn) + (k1 * cs);
    for (int64_t m = 2 * M3A + 2 * r; m < 2 * M3A + 2 * r + 2; m++) {
        qo[m] = c[m] + cb[m];
        ko[m] = k[m] + kb[m];
    }
}

/* Row b, head h, angle r of i: the angle recurrence token by token, each token
 * rotated at once (the backward's form, keeping cos and sin in rot). theta (B, H,
 * M3A) ends after the row's last token; theta_last (optional) receives the same. */
MB_DEV void m3_rotate(int64_t i, int64_t H, const int64_t *off, const int64_t *eoff,
                      const int64_t *t0, const float *Bn, const float *Cn, const float *B_bias,
                      const float *C_bias, const float *TA, const float *DT, float *theta,
                      float *Q, float *K, float *theta_last, float *rot)
{
    const int64_t b = i / (H * M3A), h = (i / M3A) % H, r = i % M3A;
    float th = theta[i];
    const int64_t e0 = eoff[b] + t0[b];
    for (int64_t t = 0; t < off[b + 1] - off[b]; t++) {
        const int64_t tok = off[b] + t, e = (e0 + t) * H + h;
        th = m3_angle(th, TA[tok * M3A + r], DT[e]);
        m3_rotate_token(th, h, tok, e, r, Bn, Cn, B_bias, C_bias, Q, K, rot);
    }
    theta[i] = th;
    if (theta_last) theta_last[i] = th;
}

#define M3_AHEAD 8 /* tokens whose inputs are loaded ahead of the angle chain */

/* One thread per (row, head, angle): the angle recurrence alone (the only serial
 * part of the rotation), each token's angle parked in q's slot 2r, which
 * mb_m3_rotate_k then reads and overwrites. theta and theta_last as m3_rotate. */
MB_KERNEL void mb_m3_angles_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                              const int64_t *t0, const float *TA, const float *DT, float *theta,
                              float *Q, float *theta_last)
{
    MB_GRID_LOOP(i, B * H * M3A) {
        const int64_t b = i / (H * M3A), h = (i / M3A) % H, r = i % M3A;
        const int64_t o = off[b], T = off[b + 1] - o, e0 = eoff[b] + t0[b];
        float th = theta[i];
        for (int64_t t = 0; t < T; t += M3_AHEAD) {
            float ta[M3_AHEAD], dt[M3_AHEAD];
#pragma unroll
            for (int u = 0; u < M3_AHEAD; u++) {
                const bool in = t + u < T;
                ta[u] = in ? TA[(o + t + u) * M3A + r] : 0.0f;
                dt[u] = in ? DT[(e0 + t + u) * H + h] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < M3_AHEAD; u++) {
                if (t + u < T) {
                    th = m3_angle(th, ta[u], dt[u]);
                    Q[((e0 + t + u) * H + h) * SSD_NS + 2 * r] = th;
                }
            }
        }
        theta[i] = th;
        if (theta_last) theta_last[i] = th;
    }
}
#undef M3_AHEAD

/* One thread per (new token, head, angle): m3_rotate_token at the angle that
 * mb_m3_angles_k parked. Grid (x over the row's tokens * H * M3A, y over rows). */
MB_KERNEL void mb_m3_rotate_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                              const int64_t *t0, const float *Bn, const float *Cn,
                              const float *B_bias, const float *C_bias, float *Q, float *K)
{
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], e0 = eoff[b] + t0[b];
        MB_GRID_LOOP(j, (off[b + 1] - o) * H * M3A) {
            const int64_t t = j / (H * M3A), h = (j / M3A) % H, r = j % M3A;
            const int64_t e = (e0 + t) * H + h;
            m3_rotate_token(Q[e * SSD_NS + 2 * r], h, o + t, e, r, Bn, Cn, B_bias, C_bias, Q,
                            K, NULL);
        }
    }
}

/* h (B, H, HP, NS) += (v * k) * (dt_1 * (1 - sig_1)), dt_1 and sig_1 of each row's
 * first token (ext row eoff[b]). */
MB_KERNEL void mb_m3_pending_k(int64_t B, int64_t H, const int64_t *eoff, const float *DT,
                               const float *SIG, const float *pk, const float *pv, float *h)
{
    const int64_t per = SSD_HP * SSD_NS;
    MB_GRID_LOOP(i, B * H * per) {
        const int64_t bh = i / per, b = bh / H, hh = bh % H, p = (i % per) / SSD_NS, m = i % SSD_NS;
        const int64_t e = eoff[b] * H + hh;
        const float w1 = DT[e] * (1.0f - SIG[e]);
        h[i] = h[i] + (pv[bh * SSD_HP + p] * pk[bh * SSD_NS + m]) * w1;
    }
}

/* scale_j = dt_j * sig_j + beta, beta = dt_{j+1} * (1 - sig_{j+1}) from the next ext
 * row, or +0 for the last row of a chunk that does not fold (the report). */
MB_DEV float m3_scale(const float *DT, const float *SIG, int64_t H, int64_t e, bool next)
{
    const float beta = next ? DT[e + H] * (1.0f - SIG[e + H]) : 0.0f;
    return DT[e] * SIG[e] + beta;
}

/* Block (chunk c, head h), SSD_FOLD_THREADS threads. Without hin: chunks with the
 * fold flag (sealed: the next ext row exists) write S[c, h] (HP, NS) and E[c, h] =
 * exp(cs_last). With hin (reports, chunk c is row c, its last row's beta +0):
 * out[c, h] = fma(exp(cs_last), hin[c, h], S). S's terms are (k_j[m] * scale_j)
 * (v_j[p] * dec_j). */
MB_KERNEL void MB_BOUNDS(SSD_FOLD_THREADS)
mb_m3_fold_k(const int64_t *desc, int64_t H, const float *K, const float *V, const float *DT,
             const float *SIG, const float *ADT, const float *hin, float *out, float *E)
{
    __shared__ float cs[M3Q], sc[M3Q], dec[M3Q];
    __shared__ float sA[SSD_FJ][SSD_NS], sB[SSD_FJ][SSD_HP];
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], per = SSD_HP * SSD_NS;
    const bool sealed = d[5] != 0;
    if (!hin && !sealed) return;
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            acc = acc + ADT[(e0 + j) * H + h];
            cs[j] = acc;
        }
    }
    __syncthreads();
    const float last = cs[n - 1], ex = mb_exp(last);
    for (int64_t j = threadIdx.x; j < n; j += SSD_FOLD_THREADS) {
        sc[j] = m3_scale(DT, SIG, H, (e0 + j) * H + h, j + 1 < n || sealed);
        dec[j] = mb_exp(last - cs[j]);
    }
    float *o = out + ch * per;
    const float *hi = hin ? hin + ch * per : nullptr;
    ssd_fold(n, [&](int64_t j, int m) { return K[((e0 + j) * H + h) * SSD_NS + m] * sc[j]; },
             [&](int64_t j, int p) { return V[((e0 + j) * H + h) * SSD_HP + p] * dec[j]; },
             [&](int64_t e, float acc) { o[e] = hi ? fmaf(ex, hi[e], acc) : acc; }, sA, sB);
    if (!hin && threadIdx.x == 0) E[ch] = ex;
}

#define Y3_THREADS 256
#define Y3K 16 /* columns of q, k and h_prev staged per step */

/* Stage rows [0, 64) x columns [m0, m0 + Y3K) of an (ext row, head) array of width
 * SSD_NS into dst, each row times f(row); rows at or past n read as +0. */
template <class Fn>
MB_DEV void m3_stage(float (*dst)[Y3K + 1], const float *src, int64_t e0, int64_t n, int64_t H,
                     int64_t h, int m0, Fn f)
{
    for (int e = threadIdx.x; e < M3Q * Y3K; e += Y3_THREADS) {
        const int r = e / Y3K, mm = e % Y3K;
        dst[r][mm] = r < n ? src[((e0 + r) * H + h) * SSD_NS + m0 + mm] * f(r) : 0.0f;
    }
}

/* acc[r][q] advanced by the staged columns: the chain of row 4 ti + r of At with row
 * 4 tj + q of Bt, column by column. */
MB_DEV void m3_products(float (&acc)[4][4], const float (*At)[Y3K + 1], const float (*Bt)[Y3K + 1],
                        int ti, int tj)
{
#pragma unroll
    for (int mm = 0; mm < Y3K; mm++)
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[r][q] = fmaf(At[4 * ti + r][mm], Bt[4 * tj + q][mm], acc[r][q]);
}

/* Block (head h, chunk c), Y3_THREADS threads; thread (ti, tj) owns rows 4 ti..+3
 * and columns 4 tj..+3 of each 64 x 64 product. The chains are the C reference's:
 * G[i][j] = q_i . (k_j * scale_j) over m ascending (both staged Y3K columns at a
 * time); M[i][j] = G * exp(seg[i][j]) for j < i (seg the serial sum of A*dt[j+1..i]
 * from +0, walked down each column by one thread); ys = q_i . h_prev over m; yi =
 * M . v over u < i ascending; y = ys * exp(cs_i) + yi, y = y + (D + qk_gamma) * v,
 * y * silu(z) into yg (packed tokens, di wide) for rows r0 <= i < n. */
MB_KERNEL void MB_BOUNDS(Y3_THREADS)
mb_m3_y_k(const int64_t *desc, int64_t H, int64_t di, int64_t dip, const float *Q, const float *K,
          const float *V, const float *DT, const float *SIG, const float *ADT, const float *QKG,
          const float *hck, const float *D, const float *zx, float *yg)
{
    __shared__ float At[M3Q][Y3K + 1], Bt[M3Q][Y3K + 1];
    __shared__ float Mt[M3Q][M3Q + 1], Vs[M3Q][SSD_HP];
    __shared__ float ecs[M3Q];
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], ch = c * H + h;
    const int tid = threadIdx.x, ti = tid / 16, tj = tid % 16;
    const float *adt = ADT + e0 * H + h; /* row u at adt[u * H] */
    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[r][q] = 0.0f;
    /* G; the scale of row j reads row j + 1, which exists for every j < n - 1 */
    for (int m0 = 0; m0 < SSD_NS; m0 += Y3K) {
        __syncthreads();
        m3_stage(At, Q, e0, n, H, h, m0, [](int64_t) { return 1.0f; });
        m3_stage(Bt, K, e0, n, H, h, m0, [&](int64_t j) {
            return j + 1 < n ? m3_scale(DT, SIG, H, (e0 + j) * H + h, true) : 0.0f;
        });
        __syncthreads();
        m3_products(acc, At, Bt, ti, tj);
    }
    /* seg down column j (thread j) into Mt, and cs (thread M3Q) into ecs */
    if (tid < n) {
        float s = 0.0f;
        for (int64_t i = tid + 1; i < n; i++) {
            s = s + adt[i * H];
            Mt[i][tid] = s;
        }
    } else if (tid == M3Q) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            s = s + adt[i * H];
            ecs[i] = mb_exp(s);
        }
    }
    for (int e = tid; e < M3Q * SSD_HP; e += Y3_THREADS) {
        const int u = e / SSD_HP, p = e % SSD_HP;
        Vs[u][p] = u < n ? V[((e0 + u) * H + h) * SSD_HP + p] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int i = 4 * ti + r, j = 4 * tj + q;
            if (j < i && i < n) Mt[i][j] = acc[r][q] * mb_exp(Mt[i][j]);
            acc[r][q] = 0.0f;
        }
    /* ys = q . h_prev, with columns p = 4 tj..+3 */
    const float *hp = hck + ch * SSD_HP * SSD_NS;
    for (int m0 = 0; m0 < SSD_NS; m0 += Y3K) {
        __syncthreads();
        m3_stage(At, Q, e0, n, H, h, m0, [](int64_t) { return 1.0f; });
        for (int e = tid; e < SSD_HP * Y3K; e += Y3_THREADS) {
            const int p = e / Y3K, mm = e % Y3K;
            Bt[p][mm] = hp[p * SSD_NS + m0 + mm];
        }
        __syncthreads();
        m3_products(acc, At, Bt, ti, tj);
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int64_t i = 4 * ti + r;
        if (i < r0 || i >= n) continue;
        const int64_t ei = (e0 + i) * H + h, tok = d[4] + i - r0;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int p = 4 * tj + q;
            float yi = 0.0f;
            for (int64_t u = 0; u < i; u++) yi = fmaf(Mt[i][u], Vs[u][p], yi);
            float y = acc[r][q] * ecs[i] + yi;
            y = y + (D[h] + QKG[ei]) * Vs[i][p];
            yg[tok * di + h * SSD_HP + p] = y * mb_silu(zx[tok * dip + h * SSD_HP + p]);
        }
    }
}

#undef Y3_THREADS
#undef Y3K

/* k_last, v_last (B, H, ...) from ext row last[b] (each row's last token). */
MB_KERNEL void mb_m3_last_k(int64_t B, int64_t H, const int64_t *last, const float *K,
                            const float *V, float *k_last, float *v_last)
{
    const int64_t W = SSD_NS + SSD_HP;
    MB_GRID_LOOP(i, B * H * W) {
        const int64_t bh = i / W, b = bh / H, h = bh % H, w = i % W, e = last[b] * H + h;
        if (w < SSD_NS)
            k_last[bh * SSD_NS + w] = K[e * SSD_NS + w];
        else
            v_last[bh * SSD_HP + w - SSD_NS] = V[e * SSD_HP + w - SSD_NS];
    }
}

#endif
