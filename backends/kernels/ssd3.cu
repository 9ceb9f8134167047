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
 * The backward (back3.cu) and the decode step (ssd_step.cu) include this file for its
 * device functions and the sizes M3Q, M3A. */
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

/* One new token's prep from its in_proj row r (z | x | B | C | dd_dt | dd_A | trap |
 * angle, or with di = 0 the columns from B on): j < H, head j's dt, A * dt,
 * sigmoid(trap) and qk_gamma (c, k: the token's normed C and B, 16-byte aligned) at
 * e + j of DT, ADT, SIG and QKG; j >= H, angle j - H's tanh(angle) * PI at ta[j - H]. */
MB_DEV void m3_prep_one(const float *r, int64_t j, int64_t H, int64_t di, const float *dt_bias,
                        const float *c, const float *k, const float *B_bias, const float *C_bias,
                        int64_t e, float *DT, float *SIG, float *ADT, float *QKG, float *ta)
{
    const int64_t oDT = 2 * di + 2 * SSD_NS, oA = oDT + H, oTR = oA + H, oANG = oTR + H;
    if (j >= H) {
        ta[j - H] = mb_tanh(r[oANG + j - H]) * MB_PI;
        return;
    }
    const int64_t h = j;
    e += h;
    const float dA = r[oA + h];
    float A = m3_heavy_tail(dA);
    A = A > -1e-4f ? -1e-4f : A;
    const float dt = mb_softplus(r[oDT + h] + dt_bias[h]);
    const float sig = mb_sigmoid(r[oTR + h]);
    DT[e] = dt;
    ADT[e] = A * dt;
    SIG[e] = sig;
    const float *cb = C_bias + h * SSD_NS, *kb = B_bias + h * SSD_NS;
    /* four terms to a float4 of each operand: a warp's threads read the biases of as
     * many heads, each load as many cache lines */
    float acc = 0.0f;
    for (int m = 0; m < SSD_NS; m += 4) {
        const float4 c4 = *(const float4 *)(c + m), cb4 = *(const float4 *)(cb + m);
        const float4 k4 = *(const float4 *)(k + m), kb4 = *(const float4 *)(kb + m);
        acc = fmaf(c4.x + cb4.x, k4.x + kb4.x, acc);
        acc = fmaf(c4.y + cb4.y, k4.y + kb4.y, acc);
        acc = fmaf(c4.z + cb4.z, k4.z + kb4.z, acc);
        acc = fmaf(c4.w + cb4.w, k4.w + kb4.w, acc);
    }
    QKG[e] = acc * (dt * sig);
}

/* Grid (x over the row's tokens * (H + M3A), y over rows): m3_prep_one of every new
 * token, its row of zx dip floats; Bn, Cn the normed B and C. */
MB_KERNEL void mb_m3_prep_k(int64_t B, const int64_t *off, const int64_t *eoff, const int64_t *t0,
                            int64_t H, int64_t di, int64_t dip, const float *zx,
                            const float *dt_bias, const float *Bn, const float *Cn,
                            const float *B_bias, const float *C_bias, float *DT, float *SIG,
                            float *ADT, float *QKG, float *TA)
{
    MB_GRID_WAIT();
    const int64_t W = H + M3A;
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], e0 = eoff[b] + t0[b];
        MB_GRID_LOOP(i, (off[b + 1] - o) * W) {
            const int64_t t = i / W, tok = o + t;
            m3_prep_one(zx + tok * dip, i % W, H, di, dt_bias, Cn + tok * SSD_NS,
                        Bn + tok * SSD_NS, B_bias, C_bias, (e0 + t) * H, DT, SIG, ADT, QKG,
                        TA + tok * M3A);
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

#define M3_AHEAD 16 /* tokens a batch: a batch's inputs load while the one before is walked */

/* One thread per (row, head, angle): the angle recurrence alone (the only serial
 * part of the rotation), each token's angle parked in q's slot 2r, which
 * mb_m3_rotate_k then reads and overwrites. theta (B, H, M3A) ends after the row's
 * last token; theta_last (optional) receives the same. */
MB_KERNEL void mb_m3_angles_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                              const int64_t *t0, const float *TA, const float *DT, float *theta,
                              float *Q, float *theta_last)
{
    MB_GRID_WAIT();
    MB_GRID_LOOP(i, B * H * M3A) {
        const int64_t b = i / (H * M3A), h = (i / M3A) % H, r = i % M3A;
        const int64_t o = off[b], T = off[b + 1] - o, e0 = eoff[b] + t0[b];
        float th = theta[i];
        auto load = [&](float (&ta)[M3_AHEAD], float (&dt)[M3_AHEAD], int64_t t) {
#pragma unroll
            for (int u = 0; u < M3_AHEAD; u++) {
                const bool in = t + u < T;
                ta[u] = in ? TA[(o + t + u) * M3A + r] : 0.0f;
                dt[u] = in ? DT[(e0 + t + u) * H + h] : 0.0f;
            }
        };
        auto walk = [&](const float (&ta)[M3_AHEAD], const float (&dt)[M3_AHEAD], int64_t t) {
#pragma unroll
            for (int u = 0; u < M3_AHEAD; u++) {
                if (t + u < T) {
                    th = m3_angle(th, ta[u], dt[u]);
                    Q[((e0 + t + u) * H + h) * SSD_NS + 2 * r] = th;
                }
            }
        };
        float ta0[M3_AHEAD], dt0[M3_AHEAD], ta1[M3_AHEAD], dt1[M3_AHEAD];
        load(ta0, dt0, 0);
        for (int64_t t = 0; t < T; t += 2 * M3_AHEAD) {
            load(ta1, dt1, t + M3_AHEAD);
            walk(ta0, dt0, t);
            load(ta0, dt0, t + 2 * M3_AHEAD);
            walk(ta1, dt1, t + M3_AHEAD);
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
    MB_GRID_WAIT();
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

/* scale_j = dt_j * sig_j + beta, beta = dt_{j+1} * (1 - sig_{j+1}) from the next ext
 * row, or +0 for the last row of a chunk that does not fold (the report). */
MB_DEV float m3_beta(float dt, float sig) { return dt * (1.0f - sig); }

MB_DEV float m3_scale_of(float dt, float sig, float beta) { return dt * sig + beta; }

MB_DEV float m3_scale(const float *DT, const float *SIG, int64_t H, int64_t e, bool next)
{
    return m3_scale_of(DT[e], SIG[e], next ? m3_beta(DT[e + H], SIG[e + H]) : 0.0f);
}

/* h (B, H, HP, NS) += (v * k) * (dt_1 * (1 - sig_1)), dt_1 and sig_1 of each row's
 * first token (ext row eoff[b]). */
MB_KERNEL void mb_m3_pending_k(int64_t B, int64_t H, const int64_t *eoff, const float *DT,
                               const float *SIG, const float *pk, const float *pv, float *h)
{
    MB_GRID_WAIT();
    const int64_t per = SSD_HP * SSD_NS;
    MB_GRID_LOOP(i, B * H * per) {
        const int64_t bh = i / per, b = bh / H, hh = bh % H, p = (i % per) / SSD_NS, m = i % SSD_NS;
        const int64_t e = eoff[b] * H + hh;
        const float w1 = m3_beta(DT[e], SIG[e]);
        h[i] = h[i] + (pv[bh * SSD_HP + p] * pk[bh * SSD_NS + m]) * w1;
    }
}

/* A chunk's fold of n rows on a block of T threads: row j's A * dt adt(j) and scale
 * scl(j) into shared memory, the cumsum serial over them, then ssd_fold of the terms
 * (k(j, m) * scale_j) (v(j, p) * dec_j), dec_j = exp(cs_last - cs_j); out(e, S,
 * exp(cs_last)) per element. cs, sc, dec: M3Q floats of shared memory each. */
template <int T, class Adt, class Scl, class KF, class VF, class Out>
MB_DEV void m3_fold(int64_t n, Adt adt, Scl scl, KF k, VF v, Out out, float *cs, float *sc,
                    float *dec, float (*sA)[SSD_NS], float (*sB)[SSD_HP])
{
    /* the row values loaded by one thread each, then the cumsum serial over shared
     * memory (n global latencies in a row otherwise) */
    const int t = threadIdx.x;
    if (t < n) {
        cs[t] = adt(t);
        sc[t] = scl(t);
    }
    __syncthreads();
    if (t == 0) {
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) cs[j] = acc = acc + cs[j];
    }
    __syncthreads();
    const float last = cs[n - 1], ex = mb_exp(last);
    if (t < n) dec[t] = mb_exp(last - cs[t]);
    ssd_fold<T>(n, [&](int64_t j, int m) { return k(j, m) * sc[j]; },
                [&](int64_t j, int p) { return v(j, p) * dec[j]; },
                [&](int64_t e, float acc) { out(e, acc, ex); }, sA, sB);
}

/* Block (chunk c, head h), SSD_FOLD_THREADS threads. Without hin: chunks with the
 * fold flag (sealed: the next ext row exists) write S[c, h] (HP, NS) and E[c, h] =
 * exp(cs_last). With hin (reports, chunk c is row c, its last row's beta +0):
 * out[c, h] = fma(exp(cs_last), hin[c, h], S). */
MB_KERNEL void MB_BOUNDS_MIN(SSD_FOLD_THREADS, 3)
mb_m3_fold_k(const int64_t *desc, int64_t H, const float *K, const float *V, const float *DT,
             const float *SIG, const float *ADT, const float *hin, float *out, float *E)
{
    MB_GRID_WAIT();
    __shared__ float cs[M3Q], sc[M3Q], dec[M3Q];
    __shared__ __align__(16) float sA[SSD_FJ][SSD_NS], sB[SSD_FJ][SSD_HP];
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], per = SSD_HP * SSD_NS;
    const bool sealed = d[5] != 0;
    if (!hin && !sealed) return;
    float *o = out + ch * per;
    const float *hi = hin ? hin + ch * per : nullptr;
    m3_fold<SSD_FOLD_THREADS>(
        n, [&](int64_t j) { return ADT[(e0 + j) * H + h]; },
        [&](int64_t j) { return m3_scale(DT, SIG, H, (e0 + j) * H + h, j + 1 < n || sealed); },
        [&](int64_t j, int m) { return K[((e0 + j) * H + h) * SSD_NS + m]; },
        [&](int64_t j, int p) { return V[((e0 + j) * H + h) * SSD_HP + p]; },
        [&](int64_t e, float acc, float ex) {
            o[e] = hi ? fmaf(ex, hi[e], acc) : acc;
            if (!hin && e == 0) E[ch] = ex;
        },
        cs, sc, dec, sA, sB);
}

/* Block (head h, chunk c), SSD_UT threads (ssd.cu's 64 x 64 tiles, rows i). The
 * chains are the C reference's: G[i][j] = q_i . (k_j * scale_j) over m (q and k
 * staged 64 columns at a time); M[i][j] = G * exp(seg[i][j]) for j < i (seg the
 * serial sum of A*dt[j+1..i] from +0, walked down each column by one thread); yi =
 * M . v over u < i ascending, then parked in Ta; ys = q_i . h_prev over m (q and
 * h_prev staged 32 columns at a time, both in Tb); y = ys * exp(cs_i) + yi, y = y +
 * (D + qk_gamma) * v, y * silu(z) into yg (packed tokens, di wide) for rows r0 <= i
 * < n. yg may be z itself (dip = di): each element of z is read only by the thread
 * that then writes it. TC (mb_fast_m3_y_k): the products on the tensor cores. */
#define M3_Y_PARAMS                                                                       \
    const int64_t *desc, int64_t H, int64_t di, int64_t dip, const float *Q, const float *K, \
        const float *V, const float *DT, const float *SIG, const float *ADT, const float *QKG, \
        const float *hck, const float *D, const float *zx, float *yg
template <bool TC> MB_DEV void m3_y(M3_Y_PARAMS)
{
    __shared__ __align__(16) float Ta[64][SSD_LD], Tb[64][SSD_LD]; /* row and column operands */
    __shared__ float adt[M3Q], sc[M3Q], cs[M3Q];
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], ch = c * H + h, ld = H * SSD_NS;
    const float *q = Q + (e0 * H + h) * SSD_NS, *k = K + (e0 * H + h) * SSD_NS;
    const float *v = V + (e0 * H + h) * SSD_HP, *hp = hck + ch * SSD_HP * SSD_NS;
    const int t = threadIdx.x;
    /* the scale of row j reads row j + 1, which exists for every j < n - 1 */
    if (t < n) {
        const int64_t e = (e0 + t) * H + h;
        adt[t] = ADT[e];
        sc[t] = t + 1 < n ? m3_scale(DT, SIG, H, e, true) : 0.0f;
    }
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) cs[i] = s = s + adt[i];
    }
    float acc[8][8];
    ssd_zero(acc);
    for (int m0 = 0; m0 < SSD_NS; m0 += 64) {
        __syncthreads(); /* the previous operands are consumed */
        ssd_stage_t<64>(Ta, [&](int r, int kk) { return r < n ? q[r * ld + m0 + kk] : 0.0f; });
        ssd_stage_t<64>(Tb, [&](int r, int kk) { return r < n ? k[r * ld + m0 + kk] * sc[r] : 0.0f; });
        __syncthreads();
        ssd_prod<TC>(acc, Ta, Tb, 0, 64);
    }
    /* seg down column j = t into Ta[j][i], four rows to a float4 store (rows up to j
     * are never read); v into Tb */
    __syncthreads();
    if (t < n) {
        float s = 0.0f;
        for (int64_t i0 = t & ~3; i0 < n; i0 += 4) {
            float sv[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = i0 + u;
                sv[u] = 0.0f;
                if (i <= t || i >= n) continue;
                sv[u] = s = s + adt[i];
            }
            float4 w;
            w.x = sv[0], w.y = sv[1], w.z = sv[2], w.w = sv[3];
            *(float4 *)&Ta[t][i0] = w;
        }
    }
    ssd_stage(Tb, (int)n, [&](int u, int p) { return v[u * H * SSD_HP + p]; });
    __syncthreads();
    ssd_each<TC>([&](int r, int qq, int i, int j) {
        if (j < i && i < n) Ta[j][i] = acc[r][qq] * mb_exp(Ta[j][i]);
        acc[r][qq] = 0.0f;
    });
    __syncthreads();
    ssd_prod_tri<TC>(acc, Ta, Tb, 0, (int)n, 0);
    __syncthreads(); /* M and v are consumed */
    if constexpr (TC)
        ssd_each<TC>([&](int r, int qq, int i, int j) { Ta[i][j] = acc[r][qq]; });
    else
        ssd_park(Ta, acc);
    ssd_zero(acc);
    for (int m0 = 0; m0 < SSD_NS; m0 += 32) {
        __syncthreads(); /* the previous columns are consumed */
        ssd_stage_t<32>(Tb, [&](int r, int kk) { return r < n ? q[r * ld + m0 + kk] : 0.0f; });
        ssd_stage_t<32>(Tb + 32, [&](int r, int kk) { return hp[r * SSD_NS + m0 + kk]; });
        __syncthreads();
        ssd_prod<TC>(acc, Tb, Tb + 32, 0, 32);
    }
    const int64_t tok0 = d[4];
    if constexpr (TC) {
        ssd_each<TC>([&](int r, int qq, int i, int p) {
            if (i < r0 || i >= n) return;
            const int64_t tok = tok0 + i - r0;
            const float vr = v[i * H * SSD_HP + p], zr = zx[tok * dip + h * SSD_HP + p];
            float y = acc[r][qq] * mb_exp(cs[i]) + Ta[i][p];
            y = y + (D[h] + QKG[(e0 + i) * H + h]) * vr;
            yg[tok * di + h * SSD_HP + p] = y * mb_silu(zr);
        });
    } else {
        /* a row's v and z are all loaded before its outputs are stored (a store may
         * alias a later load, so the loads would not move up past it) */
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int64_t i = ssd_r(t) + r;
            if (i < r0 || i >= n) continue;
            const int64_t tok = tok0 + i - r0;
            const float *vi = v + i * H * SSD_HP, *zi = zx + tok * dip + h * SSD_HP;
            float vr[8], zr[8];
#pragma unroll
            for (int qq = 0; qq < 8; qq++) {
                vr[qq] = vi[ssd_cq(t, qq)];
                zr[qq] = zi[ssd_cq(t, qq)];
            }
            const float e = mb_exp(cs[i]), dq = D[h] + QKG[(e0 + i) * H + h];
#pragma unroll
            for (int qq = 0; qq < 8; qq++) {
                const int p = ssd_cq(t, qq);
                float y = acc[r][qq] * e + Ta[i][p];
                y = y + dq * vr[qq];
                yg[tok * di + h * SSD_HP + p] = y * mb_silu(zr[qq]);
            }
        }
    }
}

MB_KERNEL_PAIR(MB_BOUNDS(SSD_UT), m3_y_k, M3_Y_PARAMS, m3_y, desc, H, di, dip, Q, K, V, DT, SIG,
               ADT, QKG, hck, D, zx, yg)

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
