/* The Mamba-3 SISO mixer (SPEC 7), the GPU twin of put_rows, chunk_out and fold in
 * reference/block3.c, on the ext layout of ssd.cu. Ext arrays, H heads per row: V (H x
 * 64), DT, SIG, ADT (H), QKG (H, qk_gamma, new rows only), and in the backward Q, K
 * (rotated, K unscaled; H x 128). A prefill keeps q and k (B, M3Q, H, 128) of each
 * row's last chunk alone, as the state does, and forms the other new rows' where used.
 *   mb_m3_prep_k    per new token and head: heavy-tail A with its floor, dt, A * dt,
 *                   sigmoid(trap), qk_gamma = dot(q, k) * (dt * sig); per token and
 *                   angle: tanh(angle) * PI.
 *   mb_m3_angles_k  per (row, head, angle): the angle recurrence, serial over the
 *                   row's tokens and reduced every token.
 *   mb_m3_rotate_k  per (token of a last chunk, head, angle): the rotation of q and k.
 *   mb_m3_pending_k Input_States: h0 = h + (v * k) * (dt_1 * (1 - sig_1)).
 *   mb_m3_fold_k    S = (v * exp(cs_last - cs))^T . (k * scale) per (chunk, head);
 *                   with hin, the fold itself (the h_last report).
 *   mb_m3_fold_chain_k a prefill's folds and state pass in one (ssd_fold_chain).
 *   mb_m3_y_k       the gated output of a chunk and head per block.
 *   mb_m3_last_k    the k_last and v_last reports.
 * The backward (back3.cu) and the decode step (ssd_step.cu) include this file for its
 * device functions and the sizes M3Q, M3A. */
#ifndef MB_SSD3_CU
#define MB_SSD3_CU
#include "ssd.cu"

#define M3Q 64
#define M3A 32 /* rotary angles */
#define M3_TURNS (2 * M3A) /* a token's turns (cos, sin of each angle), floats */

/* upstream main's heavy-tail A before its floor: -(x >= 0 ? 1 + x : 1 / (1 - x)) */
MB_DEV float m3_heavy_tail(float x)
{
    return -(x >= 0.0f ? 1.0f + x : 1.0f / (1.0f - x));
}

/* One new token's prep from its in_proj row r (z | x | B | C | dd_dt | dd_A | trap |
 * angle, or with di = 0 the columns from B on): j < H, head j's dt, A * dt,
 * sigmoid(trap) and qk_gamma (c, k: the token's normed C and B, 16-byte aligned) at
 * e + j of DT, ADT, SIG and QKG; j >= H, angle j - H's tanh(angle) * PI at ta[j - H].
 * The biases are (H, SSD_NS), or (SSD_NS, H) when HM (head-minor: a warp of heads
 * then reads one cache line a term, not one a head). */
template <bool HM>
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
    const float *cb = C_bias + h * (HM ? 1 : SSD_NS), *kb = B_bias + h * (HM ? 1 : SSD_NS);
    auto bias4 = [&](const float *b, int m) {
        return HM ? make_float4(b[m * H], b[(m + 1) * H], b[(m + 2) * H], b[(m + 3) * H])
                  : *(const float4 *)(b + m);
    };
    float acc = 0.0f;
    for (int m = 0; m < SSD_NS; m += 4) {
        const float4 c4 = *(const float4 *)(c + m), cb4 = bias4(cb, m);
        const float4 k4 = *(const float4 *)(k + m), kb4 = bias4(kb, m);
        acc = fmaf(c4.x + cb4.x, k4.x + kb4.x, acc);
        acc = fmaf(c4.y + cb4.y, k4.y + kb4.y, acc);
        acc = fmaf(c4.z + cb4.z, k4.z + kb4.z, acc);
        acc = fmaf(c4.w + cb4.w, k4.w + kb4.w, acc);
    }
    QKG[e] = acc * (dt * sig);
}

/* Grid (x over the row's tokens * (H + M3A), y over rows): m3_prep_one of every new
 * token, its row of zx dip floats; Bn, Cn the normed B and C; the biases head-minor,
 * (SSD_NS, H). */
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
            m3_prep_one<true>(zx + tok * dip, i % W, H, di, dt_bias, Cn + tok * SSD_NS,
                              Bn + tok * SSD_NS, B_bias, C_bias, (e0 + t) * H, DT, SIG, ADT,
                              QKG, TA + tok * M3A);
        }
    }
}

/* theta after a token: mod2pi(theta + ta * dt). */
MB_DEV float m3_angle(float th, float ta, float dt) { return mb_mod2pi(th + ta * dt); }

/* the pair x plus its bias b, rotated by z = (cos, sin) */
MB_DEV float2 m3_rot2(float2 x, float2 b, float2 z)
{
    const float x0 = x.x + b.x, x1 = x.y + b.y;
    return make_float2(x0 * z.x - x1 * z.y, x0 * z.y + x1 * z.x);
}

/* Four columns of a new row, x: its two pairs biased by b and turned by z (two turns). */
MB_DEV float4 m3_fix_piece(float4 x, float4 b, float4 z)
{
    const float2 u = m3_rot2(make_float2(x.x, x.y), make_float2(b.x, b.y), make_float2(z.x, z.y));
    const float2 v = m3_rot2(make_float2(x.z, x.w), make_float2(b.z, b.w), make_float2(z.z, z.w));
    return make_float4(u.x, u.y, v.x, v.y);
}

/* Columns c .. c + 3 of a new row of q or k from its normed row's piece x and the
 * head's bias piece b, as m3_rotate_token makes them: below 2 M3A turned by z (the
 * turns of pairs c / 2 and c / 2 + 1, as mb_m3_angles_k parks them at column c),
 * else biased only. */
MB_DEV float4 m3_form4(float4 x, float4 b, float4 z, int c)
{
    if (c < 2 * M3A) return m3_fix_piece(x, b, z);
    return make_float4(x.x + b.x, x.y + b.y, x.z + b.z, x.w + b.w);
}

/* the turn (cos, sin) of angle th */
MB_DEV float2 m3_turn_of(float th) { return make_float2(mb_cos(th), mb_sin(th)); }

/* Token tok of head h turned by z (m3_turn_of its angle r) into its rows qo and ko:
 * pair (2r, 2r + 1) of the biased q and k rotated, dims 64 + 2r, 64 + 2r + 1 copied
 * unrotated. */
MB_DEV void m3_rotate_token(float2 z, int64_t h, int64_t tok, int64_t r, const float *Bn,
                            const float *Cn, const float *B_bias, const float *C_bias, float *qo,
                            float *ko)
{
    /* every input read before any output is written (the compiler must assume they
     * may alias, and would hold a later load back behind an earlier store) */
    const float *cb = C_bias + h * SSD_NS, *kb = B_bias + h * SSD_NS;
    const float *c = Cn + tok * SSD_NS, *k = Bn + tok * SSD_NS;
    auto pair = [&](const float *x) { return *(const float2 *)(x + 2 * r); };
    const float2 cr = pair(c), cbr = pair(cb), kr = pair(k), kbr = pair(kb);
    const float2 cu = pair(c + 2 * M3A), cbu = pair(cb + 2 * M3A);
    const float2 ku = pair(k + 2 * M3A), kbu = pair(kb + 2 * M3A);
    *(float2 *)(qo + 2 * r) = m3_rot2(cr, cbr, z);
    *(float2 *)(ko + 2 * r) = m3_rot2(kr, kbr, z);
    *(float2 *)(qo + 2 * M3A + 2 * r) = make_float2(cu.x + cbu.x, cu.y + cbu.y);
    *(float2 *)(ko + 2 * M3A + 2 * r) = make_float2(ku.x + kbu.x, ku.y + kbu.y);
}

#define M3_ANG_NB 64 /* tokens a batch */
#define M3_ANG_THREADS 256
#define M3_ANG_HW ((M3_ANG_THREADS - MB_WARP) / M3A) /* helper groups, after the walkers' warp */
#define M3_ANG_PER ((M3_ANG_NB + M3_ANG_HW - 1) / M3_ANG_HW) /* tokens a helper thread */

/* Block (row b, head h) of B H, M3_ANG_THREADS threads: the angle recurrence alone (the
 * only serial part of the rotation), each token's angle r parked in slot r of its row
 * of park (H x SSD_NS floats an ext row), or with turns its turn (m3_turn_of) in slots
 * 2r, 2r + 1 of a park of turns (H x M3_TURNS floats an ext row; a row's 32 in one
 * coalesced store). theta (B, H, M3A) ends after the
 * row's last token; theta_last (optional) receives the same.
 * Thread r < M3A walks angle r's chain and nothing else, so a step is the chain's
 * arithmetic with one shared load and store: the helpers, groups of M3A threads from
 * the next warp on (thread r of group w: angle r of tokens w, w + M3_ANG_HW, ...), form
 * each batch's products ta * dt in shared memory a batch ahead and store the walked
 * angles to Q a batch behind, one barrier a batch. A batch whose increments and
 * starting angle allow it walks by mb_mod2pi_near, whose chain is an add, a compare and
 * two selects instead of the quotient's seven steps. */
MB_KERNEL void MB_BOUNDS(M3_ANG_THREADS)
mb_m3_angles_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff, const int64_t *t0,
               const float *TA, const float *DT, float *theta, float *park, int64_t turns,
               float *theta_last)
{
    __shared__ float inc[2][M3_ANG_NB][M3A], ang[2][M3_ANG_NB][M3A];
    MB_GRID_WAIT();
    const int64_t b = blockIdx.x / H, h = blockIdx.x % H, o = off[b], T = off[b + 1] - o;
    const int64_t e0 = eoff[b] + t0[b], nb = (T + M3_ANG_NB - 1) / M3_ANG_NB;
    const int tid = threadIdx.x, r = tid % M3A, hw = tid < MB_WARP ? -1 : (tid - MB_WARP) / M3A;
    auto tokens = [&](int64_t n) {
        const int64_t left = T - n * M3_ANG_NB;
        return (int)(left < M3_ANG_NB ? left : M3_ANG_NB);
    };
    /* a batch's loads are issued a batch before their products are stored, so that
     * they wait on memory while the walk before runs (a token past the batch loads
     * the batch's first and is not stored) */
    float a[M3_ANG_PER], d[M3_ANG_PER];
    auto load = [&](int64_t n) {
        const int cnt = tokens(n);
        const float *ta = TA + (o + n * M3_ANG_NB) * M3A + r;
        const float *dt = DT + (e0 + n * M3_ANG_NB) * H + h;
#pragma unroll
        for (int j = 0; j < M3_ANG_PER; j++) {
            const int u = hw + j * M3_ANG_HW, uu = u < cnt ? u : 0;
            a[j] = ta[uu * M3A];
            d[j] = dt[uu * H];
        }
    };
    auto fill = [&](int64_t n) {
        const int cnt = tokens(n);
#pragma unroll
        for (int j = 0; j < M3_ANG_PER; j++) {
            const int u = hw + j * M3_ANG_HW;
            if (u < cnt) inc[n & 1][u][r] = a[j] * d[j];
        }
    };
    auto flush = [&](int64_t n) {
        const int cnt = tokens(n);
        const int64_t pw = turns ? M3_TURNS : SSD_NS; /* the park's floats a head */
        float *q = park + ((e0 + n * M3_ANG_NB) * H + h) * pw + (turns ? 2 * r : r);
        float v[M3_ANG_PER];
#pragma unroll
        for (int j = 0; j < M3_ANG_PER; j++) {
            const int u = hw + j * M3_ANG_HW;
            v[j] = ang[n & 1][u < cnt ? u : 0][r];
        }
#pragma unroll
        for (int j = 0; j < M3_ANG_PER; j++) {
            const int u = hw + j * M3_ANG_HW;
            if (u >= cnt) continue;
            if (turns)
                *(float2 *)(q + u * H * pw) = m3_turn_of(v[j]);
            else
                q[u * H * pw] = v[j];
        }
    };
    const int64_t i = (int64_t)blockIdx.x * M3A + tid;
    float th = tid < M3A ? theta[i] : 0.0f;
    if (hw >= 0 && nb > 0) {
        load(0);
        fill(0);
        if (nb > 1) load(1);
    }
    __syncthreads();
    for (int64_t n = 0; n < nb; n++) {
        if (tid < M3A) { /* m3_angle, its product formed by the helpers */
            const float(*a)[M3A] = inc[n & 1];
            float(*g)[M3A] = ang[n & 1];
            const int64_t left = T - n * M3_ANG_NB;
            if (left >= M3_ANG_NB) { /* the batch's loads first: the compiler cannot
                                        * move one past a store to another array */
                float v[M3_ANG_NB];
                bool near = th >= -0.25f && th <= 6.5f; /* mb_mod2pi_near's walk */
#pragma unroll
                for (int u = 0; u < M3_ANG_NB; u++) {
                    v[u] = a[u][tid];
                    near = near && fabsf(v[u]) < 6.0f;
                }
                if (near) {
#pragma unroll
                    for (int u = 0; u < M3_ANG_NB; u++) {
                        th = mb_mod2pi_near(th + v[u]);
                        g[u][tid] = th;
                    }
                } else {
#pragma unroll
                    for (int u = 0; u < M3_ANG_NB; u++) {
                        th = mb_mod2pi(th + v[u]);
                        g[u][tid] = th;
                    }
                }
            } else {
                for (int u = 0; u < left; u++) {
                    th = mb_mod2pi(th + a[u][tid]);
                    g[u][tid] = th;
                }
            }
        } else if (hw >= 0) {
            if (n + 1 < nb) {
                fill(n + 1);
                if (n + 2 < nb) load(n + 2);
            }
            if (n > 0) flush(n - 1);
        }
        __syncthreads();
    }
    if (hw >= 0 && nb > 0) flush(nb - 1);
    if (tid < M3A) {
        theta[i] = th;
        if (theta_last) theta_last[i] = th;
    }
}
#undef M3_ANG_NB
#undef M3_ANG_HW
#undef M3_ANG_PER

/* The first of a row's T new tokens in its last chunk, less the t0 rows held from the
 * state: negative where the chunk begins among those rows. */
MB_DEV int64_t m3_last_chunk(int64_t t0, int64_t T) { return (t0 + T - 1) / M3Q * M3Q - t0; }

/* One thread per (new token of a row's last chunk, head, angle r): m3_rotate_token by
 * the turn that mb_m3_angles_k parked in TK, into Q and K (B, M3Q, H, SSD_NS), which
 * hold each row's last chunk alone, as the state does (the chunks' q and k are formed
 * where used: m3_form4). Grid (x over M3Q * H * M3A, y over rows). */
MB_KERNEL void mb_m3_rotate_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                              const int64_t *t0, const float *Bn, const float *Cn,
                              const float *B_bias, const float *C_bias, const float *TK,
                              float *Q, float *K)
{
    MB_GRID_WAIT();
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], T = off[b + 1] - o, e0 = eoff[b] + t0[b];
        const int64_t tr = m3_last_chunk(t0[b], T), t1 = tr < 0 ? 0 : tr;
        MB_GRID_LOOP(j, (T - t1) * H * M3A) {
            const int64_t t = t1 + j / (H * M3A), h = (j / M3A) % H, r = j % M3A;
            const float2 z = *(const float2 *)(TK + ((e0 + t) * H + h) * M3_TURNS + 2 * r);
            const int64_t row = (b * M3Q + t - tr) * H + h;
            m3_rotate_token(z, h, o + t, r, Bn, Cn, B_bias, C_bias, Q + row * SSD_NS,
                            K + row * SSD_NS);
        }
    }
}

#if defined(MB_MMA)
/* Fast mode forms the q and k rows of new tokens where they are used: the chunk
 * kernels copy the normed C and B rows (one a token, every head's), then add the
 * head's biases and rotate the pairs below 2 M3A by the token's angles TH (M new
 * tokens, H, M3A) in shared memory. Q and K are then the state's buffers (B, M3Q,
 * H, SSD_NS), whose rows the chunks before r0 take; the rows of each row's last
 * chunk, which the reports and the state take, are rotated by the angles kernel into
 * arrays of that shape. With TH null the chunk kernels read every row from Q and K
 * in the ext layout. */
#define M3_ROT_PARAMS                                                                     \
    const float *Bn, const float *Cn, const float *B_bias, const float *C_bias, const float *TH

/* (cos, sin) of pair p's angle th: the identity past the rotated pairs */
MB_DEV float2 m3_turn(int p, float th)
{
    float sn = 0.0f, cs = 1.0f;
    if (p < M3A) __sincosf(th, &sn, &cs);
    return make_float2(cs, sn);
}

/* Fast mode's angles. Block (row b, head h, group of M3R_ANG angles), M3R_ANG x
 * M3R_RUNS threads: thread (u, a) owns angle a of the group over run u of the row's
 * new tokens (runs of ceil(T / M3R_RUNS)). Pass 1 walks each run's increments ta *
 * dt from 0 (the recurrence's own mod 2 pi every token, M3R_AHEAD increments loaded
 * together); the runs' starting angles follow serially in shared memory; pass 2 walks
 * each run again from its start, writing every token's angle into TH, and those of
 * the row's last chunk into shared memory, from which the whole block writes their
 * rotated q and k (__sincosf) into Q and K, (B, M3Q, H, SSD_NS) that hold the last
 * chunks alone: one run's serial walk would wait on each token's loads. theta and
 * theta_last as mb_m3_angles_k writes them. Two blocks a multiprocessor: the walks
 * are chains of dependent adds. */
#define M3R_ANG 8
#define M3R_RUNS 64
#define M3R_AHEAD 8 /* increments loaded together */
MB_KERNEL void MB_BOUNDS_MIN(M3R_ANG * M3R_RUNS, 2)
mb_fast_m3_angles_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                    const int64_t *t0, const float *TA, const float *DT, float *theta,
                    float *TH, const float *Bn, const float *Cn, const float *B_bias,
                    const float *C_bias, float *Q, float *K, float *theta_last)
{
    __shared__ float start[M3R_RUNS][M3R_ANG], last[M3Q][M3R_ANG];
    constexpr int G = M3A / M3R_ANG;
    const int64_t b = blockIdx.x / (H * G), h = blockIdx.x / G % H;
    const int ai = threadIdx.x % M3R_ANG, u = threadIdx.x / M3R_ANG;
    const int r = (int)(blockIdx.x % G) * M3R_ANG + ai;
    const int64_t o = off[b], T = off[b + 1] - o, e0 = eoff[b] + t0[b];
    const int64_t run = (T + M3R_RUNS - 1) / M3R_RUNS, ta = u * run;
    const int64_t tb = ta + run < T ? ta + run : T;
    const int64_t tr = m3_last_chunk(t0[b], T);
    auto inc = [&](int64_t t) { return TA[(o + t) * M3A + r] * DT[(e0 + t) * H + h]; };
    auto walk = [&](int64_t from, int64_t to, auto f) { /* f(t, increment) for t in [from, to) */
        for (int64_t t1 = from; t1 < to; t1 += M3R_AHEAD) {
            float d[M3R_AHEAD];
#pragma unroll
            for (int v = 0; v < M3R_AHEAD; v++) d[v] = t1 + v < to ? inc(t1 + v) : 0.0f;
#pragma unroll
            for (int v = 0; v < M3R_AHEAD; v++)
                if (t1 + v < to) f(t1 + v, d[v]);
        }
    };
    float s = 0.0f;
    walk(ta, tb, [&](int64_t, float d) { s = mb_mod2pi(s + d); });
    start[u][ai] = s;
    __syncthreads();
    if (u == 0) {
        const int64_t i = (b * H + h) * M3A + r;
        float th = theta[i];
        for (int k = 0; k < M3R_RUNS; k++) {
            const float d = start[k][ai];
            start[k][ai] = th;
            th = mb_mod2pi(th + d);
        }
        theta[i] = th;
        if (theta_last) theta_last[i] = th;
    }
    __syncthreads();
    float th = start[u][ai];
    walk(ta, tb, [&](int64_t t, float d) {
        th = mb_mod2pi(th + d);
        TH[((o + t) * H + h) * M3A + r] = th;
        if (t >= tr) last[t - tr][ai] = th;
    });
    __syncthreads();
    const int64_t t1 = tr < 0 ? 0 : tr; /* the last chunk's new tokens: [t1, T) */
    const float *cb = C_bias + h * SSD_NS, *kb = B_bias + h * SSD_NS;
    for (int64_t i = threadIdx.x; i < (T - t1) * M3R_ANG; i += blockDim.x) {
        const int64_t t = t1 + i / M3R_ANG;
        const int a = (int)(i % M3R_ANG), ra = r - ai + a;
        const float *c = Cn + (o + t) * SSD_NS, *k = Bn + (o + t) * SSD_NS;
        const float2 z = m3_turn(ra, last[t - tr][a]), one = make_float2(1.0f, 0.0f);
        const int64_t row = (b * M3Q + t - tr) * H + h; /* the last chunk's rows alone */
        float *qo = Q + row * SSD_NS, *ko = K + row * SSD_NS;
#pragma unroll
        for (int w = 0; w < 2; w++) { /* pair ra (turned), then pair M3A + ra (biased only) */
            const int m = 2 * (ra + M3A * w);
            *(float2 *)(qo + m) = m3_rot2(*(const float2 *)(c + m), *(const float2 *)(cb + m), w ? one : z);
            *(float2 *)(ko + m) = m3_rot2(*(const float2 *)(k + m), *(const float2 *)(kb + m), w ? one : z);
        }
    }
}
#endif

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
 * (k_j[m] * scale_j) (v_j[p] * dec_j), dec_j = exp(cs_last - cs_j), k_j the row that
 * kcopy and kform make (as ssd_fold's acopy and afix, before the scale) and v_j =
 * vrow(j); out(e, v, exp(cs_last)) per four elements (as ssd_fold's out). cs, sc,
 * dec: M3Q floats of shared memory each. The tables are made while the first rows'
 * copy is in flight. */
template <int T, class Adt, class Scl, class KC, class KF, class VR, class Out>
MB_DEV void m3_fold(int64_t n, Adt adt, Scl scl, KC kcopy, KF kform, VR vrow, Out out, float *cs,
                    float *sc, float *dec, float (*sA)[SSD_NS], float (*sB)[SSD_HP])
{
    const int t = threadIdx.x;
    float ex = 0.0f;
    auto tables = [&] {
        /* the row values loaded by one thread each, then the cumsum serial in
         * registers, eight loads ahead */
        if (t < n) {
            cs[t] = adt(t);
            sc[t] = scl(t);
        }
        __syncthreads();
        if (t == 0) {
            float acc = 0.0f;
            for (int64_t j0 = 0; j0 < n; j0 += 8) {
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) v[u] = j0 + u < n ? cs[j0 + u] : 0.0f;
#pragma unroll
                for (int u = 0; u < 8; u++)
                    if (j0 + u < n) cs[j0 + u] = acc = acc + v[u];
            }
        }
        __syncthreads();
        const float last = cs[n - 1];
        ex = mb_exp(last);
        if (t < n) dec[t] = mb_exp(last - cs[t]);
    };
    ssd_fold<T>(n, tables, kcopy,
                [&](int64_t j, int s, int c) {
                    kform(j, s, c);
                    ssd_scale4(&sA[s][c], sc[j]);
                },
                vrow,
                [&](int64_t j) { return dec[j]; }, [&](int64_t e, float4 v) { out(e, v, ex); },
                sA, sB);
}

/* The identical fold of chunk c (desc) and head h on a block of SSD_IFOLD threads:
 * out(e, v, exp(cs_last)) of S (HP, NS) as m3_fold's. krow (optional): K's row of
 * the chunk's row 0 for row b = krow[b] (K holding a chunk a row: the state's
 * buffers or the last chunks), else the ext row. Bn (optional): the new rows' k
 * formed from the normed B rows Bn and B_bias (H, SSD_NS) by the turns that
 * mb_m3_angles_k parked in TK (m3_form4). beta1: the last row's beta is read (the
 * chunk is sealed: the next ext row exists), else +0. */
#define M3_FOLD_IN                                                                       \
    const int64_t *desc, int64_t H, const float *K, const float *V, const float *DT,        \
        const float *SIG, const float *ADT
#define M3_FOLD_FORM const int64_t *krow, const float *Bn, const float *B_bias, const float *TK
template <class Out>
MB_DEV void m3_fold_at(int64_t c, int64_t h, bool beta1, M3_FOLD_IN, M3_FOLD_FORM, Out out)
{
    __shared__ float cs[M3Q], sc[M3Q], dec[M3Q];
    __shared__ __align__(16) float sA[SSD_FJ][SSD_NS], sB[SSD_FJ][SSD_HP];
    __shared__ __align__(16) float4 sT[SSD_FJ][2 * M3A / 4]; /* new rows' turns */
    const int64_t *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], k0 = krow ? krow[d[0]] : e0;
    const int64_t r0 = Bn ? d[3] : n, tok0 = d[4] - d[3]; /* rows from r0 on are formed */
    m3_fold<SSD_IFOLD>(
        n, [&](int64_t j) { return ADT[(e0 + j) * H + h]; },
        [&](int64_t j) { return m3_scale(DT, SIG, H, (e0 + j) * H + h, j + 1 < n || beta1); },
        [&](int64_t j, int s, int m, bool in) {
            if (j < r0) {
                mb_cp_async16(&sA[s][m], K + ((k0 + j) * H + h) * SSD_NS + m, in ? 16 : 0);
                return;
            }
            mb_cp_async16(&sA[s][m], Bn + (tok0 + j) * SSD_NS + m, in ? 16 : 0);
            if (m < M3_TURNS)
                mb_cp_async16(&sT[s][m / 4].x, TK + ((e0 + j) * H + h) * M3_TURNS + m, in ? 16 : 0);
        },
        [&](int64_t j, int s, int m) {
            if (j < r0) return;
            float4 *x = (float4 *)&sA[s][m];
            *x = m3_form4(*x, *(const float4 *)(B_bias + h * SSD_NS + m),
                          m < 2 * M3A ? sT[s][m / 4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f), m);
        },
        [&](int64_t j) { return V + ((e0 + j) * H + h) * SSD_HP; }, out, cs, sc, dec, sA, sB);
}

/* Block (chunk c, head h), SSD_IFOLD threads. Without hin: chunks with the fold flag
 * (sealed) write S[c, h] and E[c, h] = exp(cs_last). With hin (reports, chunk c is
 * row c, its last row's beta +0): out[c, h] = fma(exp(cs_last), hin[c, h], S). */
MB_KERNEL void MB_BOUNDS_MIN(SSD_IFOLD, 4)
mb_m3_fold_k(M3_FOLD_IN, const float *hin, float *out, float *E, M3_FOLD_FORM)
{
    MB_GRID_WAIT();
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, per = SSD_HP * SSD_NS;
    const bool sealed = desc[c * MB_DESC + 5] != 0;
    if (!hin && !sealed) return;
    m3_fold_at(c, h, sealed, desc, H, K, V, DT, SIG, ADT, krow, Bn, B_bias, TK,
               ssd_fold_put(out + ch * per, hin ? hin + ch * per : nullptr, hin ? nullptr : E + ch));
}

/* The sealed chunks' folds and the state pass in one (mb_m3_fold_k then
 * mb_ssd_chain_k, the same operations; ssd_fold_chain). */
MB_KERNEL void MB_BOUNDS_MIN(SSD_IFOLD, 4)
mb_m3_fold_chain_k(M3_FOLD_IN, M3_FOLD_FORM, SSD_FOLD_CHAIN_PARAMS)
{
    ssd_fold_chain(H, desc, nc, b0, cb, kord, sync, hs, hck, [&](int64_t c, int64_t h, auto out) {
        m3_fold_at(c, h, true, desc, H, K, V, DT, SIG, ADT, krow, Bn, B_bias, TK, out);
    });
}

#if defined(MB_MMA)
/* Inclusive sums of 64 values over a warp, two a lane (lane l: values 2l, 2l + 1). */
MB_DEV void m3_warp_scan(float a0, float a1, float &s0, float &s1)
{
    const int l = threadIdx.x % 32;
    float s = a0 + a1;
    for (int d = 1; d < 32; d *= 2) {
        const float u = MB_SHFL(s, l - d, 32);
        if (l >= d) s += u;
    }
    const float before = MB_SHFL(s, l - 1, 32);
    s0 = (l ? before : 0.0f) + a0;
    s1 = s;
}

/* Fast mode's tables of a chunk's n rows (M3Q floats each, +0 past n): adt = A * dt,
 * the scale sc (its last row's beta read from the next ext row when sealed), cs_i the
 * sum of adt over rows up to i and, where suf is given (M3Q + 1 floats), suf_j the
 * sum over rows from j on. A sum over rows (j, i] is one of these, or summed
 * directly: every adt is <= 0, so sums never cancel, but a difference of two could
 * lose all its digits. m3_tab_load reads a thread's inputs (threads below M3Q: its
 * row's adt and scale, and two rows of warp 0's or 1's scan), m3_tab_store forms the
 * tables from them, so a caller may load a chunk's while it computes another;
 * published by the caller's next barrier. */
struct M3Tab {
    float adt, sc, a0, a1;
};
MB_DEV void m3_tab_rows(int &r0, int &r1) /* the scan's rows of a thread of warp 0 or 1 */
{
    const int l = threadIdx.x % 32;
    r0 = threadIdx.x < 32 ? 2 * l : M3Q - 1 - 2 * l; /* warp 1: suf, from the last row */
    r1 = threadIdx.x < 32 ? r0 + 1 : r0 - 1;
}
MB_DEV M3Tab m3_tab_load(int64_t n, int64_t e0, int64_t H, int64_t h, bool sealed, bool suf,
                         const float *DT, const float *SIG, const float *ADT)
{
    M3Tab v = {0.0f, 0.0f, 0.0f, 0.0f};
    const int t = threadIdx.x;
    if (t >= M3Q) return v;
    const int64_t e = (e0 + t) * H + h;
    if (t < n) {
        v.adt = ADT[e];
        v.sc = m3_scale(DT, SIG, H, e, t + 1 < n || sealed);
    }
    if (t >= 32 && !suf) return v;
    int r0, r1;
    m3_tab_rows(r0, r1);
    v.a0 = r0 < n ? ADT[(e0 + r0) * H + h] : 0.0f;
    v.a1 = r1 < n ? ADT[(e0 + r1) * H + h] : 0.0f;
    return v;
}
MB_DEV void m3_tab_store(const M3Tab &v, float *adt, float *sc, float *cs, float *suf)
{
    const int t = threadIdx.x;
    if (t >= M3Q) return;
    adt[t] = v.adt;
    sc[t] = v.sc;
    if (t >= 32 && !suf) return;
    int r0, r1;
    m3_tab_rows(r0, r1);
    float s0, s1;
    m3_warp_scan(v.a0, v.a1, s0, s1);
    float *o = t < 32 ? cs : suf;
    o[r0] = s0;
    o[r1] = s1;
    if (t == 32) suf[M3Q] = 0.0f;
}
MB_DEV void m3_fast_tables(int64_t n, int64_t e0, int64_t H, int64_t h, bool sealed,
                           const float *DT, const float *SIG, const float *ADT, float *adt,
                           float *sc, float *cs, float *suf)
{
    m3_tab_store(m3_tab_load(n, e0, H, h, sealed, suf, DT, SIG, ADT), adt, sc, cs, suf);
}

/* A chunk's angles of new rows (row j >= r0: token tok0 + j) into th[M3Q][M3A] (+0
 * elsewhere), the head's q and k biases as pairs into bias[2][SSD_NS / 2], by
 * cp.async: complete once the caller's mb_cp_wait<0> and next barrier are past. */
MB_DEV void m3_fast_rot_tables(int64_t n, int64_t r0, int64_t tok0, int64_t H, int64_t h,
                               const float *TH, const float *B_bias, const float *C_bias,
                               float (*th)[M3A], float2 (*bias)[SSD_NS / 2], int T)
{
    for (int e = threadIdx.x; e < M3Q * M3A / 4; e += T) {
        const int j = e / (M3A / 4), a = 4 * (e % (M3A / 4));
        const bool in = j >= r0 && j < n;
        mb_cp_async16(&th[j][a], TH + ((tok0 + (in ? j : r0)) * H + h) * M3A + a, in ? 16 : 0);
    }
    for (int e = threadIdx.x; e < SSD_NS / 2; e += T) { /* 16-byte pieces of both */
        const int w = e / (SSD_NS / 4), m = 4 * (e % (SSD_NS / 4));
        mb_cp_async16((float *)bias[w] + m, (w ? B_bias : C_bias) + h * SSD_NS + m, 16);
    }
}

/* The turns of pairs p and p + 1 of a new row at angles a and b: cos and sin of each. */
MB_DEV float4 m3_turns(int p, float a, float b)
{
    const float2 u = m3_turn(p, a), v = m3_turn(p + 1, b);
    return make_float4(u.x, u.y, v.x, v.y);
}

/* mb_m3_fold_k in fast mode (sealed chunks, without hin; the backward's, its q and k
 * in Q and K): ssd_fast_fold of k's rows times scale_j and v's rows times dec_j. */
MB_KERNEL void MB_BOUNDS_MIN(SSD_FOLD_THREADS, 3)
mb_fast_m3_fold_k(M3_FOLD_IN, const float *hin, float *out, float *E)
{
    __shared__ float adt[M3Q], sc[M3Q], cs[M3Q], suf[M3Q + 1], dec[M3Q];
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2];
    const int t = threadIdx.x;
    if (!d[5] || n == 0) return;
    const float *k = K + (e0 * H + h) * SSD_NS;
    ssd_fast_fold(
        n, [&](int64_t j) { return k + j * H * SSD_NS; }, V + (e0 * H + h) * SSD_HP, H * SSD_HP,
        sc, dec, out + ch * SSD_HP * SSD_NS, [&] {
            m3_fast_tables(n, e0, H, h, true, DT, SIG, ADT, adt, sc, cs, suf);
            __syncthreads();
            if (t < M3Q) dec[t] = t < n ? __expf(suf[t + 1]) : 0.0f;
        });
    if (t == 0) E[ch] = mb_exp(cs[n - 1]);
}

/* Fast mode's fold and state pass in one (a forward's chunks): block (row bl of the
 * group, head h, part s of QS of the state's rows p), M3S_THREADS threads, walks the
 * row's chunks [cbeg[bl], cbeg[bl + 1]) in order, its part of the state in
 * registers: hck[c] receives the state entering chunk c, and a sealed chunk moves it
 * on, h = fma(exp(cs_last), h, S), S the fold's contraction (mb_fast_m3_fold_k's
 * terms) on ssd_fast_fold's tiles and reads (warp w: p = 16 (w % (4 / QS)) + (0..15)
 * of the part, 64 / QS columns m from 64 / QS (w / (4 / QS))). A chunk's rows copy by
 * cp.async, and its table inputs and new k rows' angles load into registers, while
 * the chunk before computes (two chunks of dynamic shared memory, 8 CHUNK bytes:
 * _cuda_ssd.M3S_SMEM); each thread readies what it copied itself (a new k row's
 * turned and biased-only halves, the factors, TF32), so there is no chain kernel and
 * no S between kernels.
 * QS = 2 halves the work a block for rows too few to fill the device. h (B, H, HP,
 * NS) ends as mb_ssd_chain_k leaves it. */
#define M3S_THREADS SSD_FOLD_THREADS
template <int QS>
MB_DEV void m3_state(int64_t H, const int64_t *cbeg, const int64_t *desc, const float *K,
                     const float *V, const float *DT, const float *SIG, const float *ADT,
                     const float *Bn, const float *B_bias, const float *TH, float *h, float *hck,
                     float *sm)
{
    static_assert(M3S_THREADS == 4 * M3Q && 2 * M3A == SSD_NS / 2, "a thread's k pieces");
    constexpr int VW = SSD_HP / QS, VP = VW / 4; /* a v row's floats and 16-byte pieces */
    constexpr int NV = M3Q * VP / M3S_THREADS, PW = 4 / QS, NH = 2 / QS;
    constexpr int CHUNK = M3Q * (VW + SSD_NS); /* v's rows, then k's */
    __shared__ float adt[M3Q], sc[M3Q], cs[M3Q], suf[M3Q + 1];
    const int64_t bl = blockIdx.x / (QS * H), hh = blockIdx.x / QS % H, per = SSD_HP * SSD_NS;
    const int ps = VW * (int)(blockIdx.x % QS), t = threadIdx.x, w = t / 32, g = t % 32 / 4;
    const int t4 = t % 4, pb = 16 * (w % PW) + 2 * g, mb = 32 * NH * (w / PW) + 4 * g;
    const int64_t c0 = cbeg[bl], c1 = cbeg[bl + 1];
    /* thread t's pieces: v's rows t / VP + (M3S_THREADS / VP) u at column vm of the
     * part; k's rows t / 16 + 16 u at columns km (turned pairs km / 2 + (0, 1)) and
     * SSD_NS / 2 + km (biased only) */
    const int vm = 4 * (t % VP), km = 4 * (t % 16);
    const float4 kb0 = *(const float4 *)(B_bias + hh * SSD_NS + km);
    const float4 kb1 = *(const float4 *)(B_bias + hh * SSD_NS + SSD_NS / 2 + km);
    const float4 one = make_float4(1.0f, 0.0f, 1.0f, 0.0f);
    auto sealed = [&](int64_t c) { return c < c1 && desc[c * MB_DESC + 5] != 0; };
    auto issue = [&](int64_t c, float (&ang)[4][2]) { /* rows past n zero-filled */
        const int64_t *d = desc + c * MB_DESC;
        const int64_t e0 = d[1], n = d[2], r0 = d[3], tok0 = d[4] - r0;
        float *Vs = sm + (c & 1) * CHUNK, *Ks = Vs + M3Q * VW;
#pragma unroll
        for (int u = 0; u < NV; u++) {
            const int j = t / VP + (M3S_THREADS / VP) * u;
            mb_cp_async16(Vs + j * VW + ssdf_sw(j, vm),
                          V + ((e0 + (j < n ? j : 0)) * H + hh) * SSD_HP + ps + vm, j < n ? 16 : 0);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = t / 16 + 16 * u;
            const int64_t jc = j < n ? j : 0;
            const float *src = jc >= r0 ? Bn + (tok0 + jc) * SSD_NS
                                        : K + ((d[0] * M3Q + jc) * H + hh) * SSD_NS;
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const int m = SSD_NS / 2 * x + km;
                mb_cp_async16(Ks + j * SSD_NS + ssdf_sw(j, m), src + m, j < n ? 16 : 0);
            }
            const bool turn = j >= r0 && j < n;
            const float *a = TH + ((tok0 + (turn ? j : r0)) * H + hh) * M3A + km / 2;
            ang[u][0] = turn ? a[0] : 0.0f;
            ang[u][1] = turn ? a[1] : 0.0f;
        }
        return m3_tab_load(n, e0, H, hh, true, true, DT, SIG, ADT);
    };
    /* the state (accumulator layout of tile 4 x + q): p = ps + pb + e / 2, m = mb - 4 g
     * + 8 t4 + 4 (e % 2) + 32 x + q */
    float st[4 * NH][4];
    auto at = [&](int x, int e) { return (ps + pb + e / 2) * SSD_NS + mb - 4 * g + 8 * t4 + 4 * (e % 2) + 32 * x; };
    auto put = [&](float *o) { /* the state into a (HP, NS) array */
#pragma unroll
        for (int x = 0; x < NH; x++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                *(float4 *)(o + at(x, e)) = make_float4(st[4 * x][e], st[4 * x + 1][e], st[4 * x + 2][e], st[4 * x + 3][e]);
    };
    float *hs = h + (bl * H + hh) * per;
#pragma unroll
    for (int x = 0; x < NH; x++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float4 v = *(const float4 *)(hs + at(x, e));
            st[4 * x][e] = v.x, st[4 * x + 1][e] = v.y, st[4 * x + 2][e] = v.z, st[4 * x + 3][e] = v.w;
        }
    float ang[4][2] = {}, nang[4][2] = {}; /* chunk c's angles, the next chunk's */
    M3Tab next = {0.0f, 0.0f, 0.0f, 0.0f};
    if (sealed(c0)) next = issue(c0, nang);
    mb_cp_commit();
    for (int64_t c = c0; c < c1; c++) {
        const int64_t *d = desc + c * MB_DESC;
        const int64_t n = d[2], r0 = d[3];
        put(hck + (c * H + hh) * per);
        if (!d[5]) break; /* a row's open chunk, its last */
        m3_tab_store(next, adt, sc, cs, suf);
#pragma unroll
        for (int u = 0; u < 4; u++) ang[u][0] = nang[u][0], ang[u][1] = nang[u][1];
        __syncthreads(); /* the tables are published; the other slot is consumed */
        if (sealed(c + 1)) next = issue(c + 1, nang);
        mb_cp_commit();
        mb_cp_wait<1>(); /* this thread's pieces of chunk c landed */
        float *Vs = sm + (c & 1) * CHUNK, *Ks = Vs + M3Q * VW;
#pragma unroll
        for (int u = 0; u < NV; u++) {
            const int j = t / VP + (M3S_THREADS / VP) * u;
            float4 *x = (float4 *)(Vs + j * VW + ssdf_sw(j, vm));
            *x = ssdf_ready(*x, j < n ? __expf(suf[j + 1]) : 0.0f);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = t / 16 + 16 * u;
            const bool fix = j >= r0 && j < n;
            float4 *x0 = (float4 *)(Ks + j * SSD_NS + ssdf_sw(j, km));
            float4 *x1 = (float4 *)(Ks + j * SSD_NS + ssdf_sw(j, SSD_NS / 2 + km));
            float4 v0 = *x0, v1 = *x1;
            if (fix) {
                v0 = m3_fix_piece(v0, kb0, m3_turns(km / 2, ang[u][0], ang[u][1]));
                v1 = m3_fix_piece(v1, kb1, one);
            }
            *x0 = ssdf_ready(v0, sc[j]);
            *x1 = ssdf_ready(v1, sc[j]);
        }
        const float E = mb_exp(cs[n - 1]);
        __syncthreads(); /* chunk c is ready for all; the tables are read */
        float acc[4 * NH][4] = {};
        const float(*vr)[VW] = (const float(*)[VW])Vs;
#pragma unroll /* fixed offsets: as a loop, two values spill to local memory */
        for (int k = 0; k < M3Q; k += 8)
            if (k < n) ssdf_kstep<NH, VW>(acc, vr, (const float(*)[SSD_NS])Ks, k, t4, pb, mb);
#pragma unroll
        for (int q = 0; q < 4 * NH; q++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[q][e] = fmaf(E, st[q][e], acc[q][e]);
    }
    mb_cp_wait<0>();
    put(hs);
}
#define M3S_PARAMS                                                                        \
    int64_t H, const int64_t *cbeg, const int64_t *desc, const float *K, const float *V,   \
        const float *DT, const float *SIG, const float *ADT, const float *Bn,              \
        const float *B_bias, const float *TH, float *h, float *hck
#define M3S_ARGS H, cbeg, desc, K, V, DT, SIG, ADT, Bn, B_bias, TH, h, hck, sm
MB_KERNEL void MB_BOUNDS_MIN(M3S_THREADS, 2) mb_fast_m3_state_k(M3S_PARAMS)
{
    extern __shared__ __align__(16) float sm[];
    m3_state<1>(M3S_ARGS);
}
MB_KERNEL void MB_BOUNDS_MIN(M3S_THREADS, 2) mb_fast_m3_state2_k(M3S_PARAMS)
{
    extern __shared__ __align__(16) float sm[];
    m3_state<2>(M3S_ARGS);
}
#endif

/* Block (head h, chunk c), SSD_OUT threads (ssd.cu's 64 x 64 tiles of SSD_ORN rows i
 * a thread). The chains are the C reference's: G[i][j] = q_i . (k_j * scale_j) over m;
 * M[i][j] = G * exp(seg[i][j]) for j < i (seg the serial sum of A*dt[j+1..i] from +0,
 * walked down each column's two halves by threads t and t + 64, the second half's
 * thread running the first half's adds too, the same chain); yi = M . v over u < i
 * ascending; ys = q_i . h_prev over m; y = ys * exp(cs_i) + yi, y = y + (D + qk_gamma)
 * * v, y * silu(z) into yg (packed tokens, di wide) for rows r0 <= i < n. yg may be z
 * itself (dip = di): each element of z is read only by the thread that then writes it.
 * G and ys walk m together: a stage copies M3YI_RK columns of the rows of q, k and
 * h_prev by cp.async into a ring of two, v with the first; each thread readies the
 * pieces it copied itself (k scaled), so one barrier a stage suffices. With Bn, the
 * new rows of q and k are formed from the normed C and B rows Cn, Bn, the biases (H,
 * SSD_NS) and the turns that mb_m3_angles_k parked in TK (m3_form4), and the rows
 * before r0 are those of Q and K, the state's buffers (B, M3Q, H, SSD_NS); without
 * it, every row is Q's and K's in the ext layout.
 * Dynamic shared memory: M3YI_SMEM bytes (_cuda_ssd.py), which fits AMD's 64 KiB. */
#define M3YI_RK 8
#define M3YI_RLD 12 /* 12 mod 32 over 8 rows: a quarter-warp's float4 reads on distinct banks */
#define M3_Y_PARAMS                                                                       \
    const int64_t *desc, int64_t H, int64_t di, int64_t dip, const float *Q, const float *K, \
        const float *V, const float *DT, const float *SIG, const float *ADT, const float *QKG, \
        const float *hck, const float *D, const float *zx, float *yg
MB_KERNEL void MB_BOUNDS_MIN(SSD_OUT, 4)
mb_m3_y_k(M3_Y_PARAMS, const float *Bn, const float *Cn, const float *B_bias, const float *C_bias,
          const float *TK)
{
    constexpr int T = SSD_OUT, RN = SSD_ORN, RING = 2 * 3 * 64 * M3YI_RLD;
    static_assert(RN * T == 8 * 64, "the threads' rows cover the tile");
    static_assert(64 * (M3YI_RK / 4) == T && SSD_NS % M3YI_RK == 0,
                  "a thread copies one piece of each factor a stage");
    extern __shared__ __align__(16) float sm[];
    float(*ring)[3][64][M3YI_RLD] = (float(*)[3][64][M3YI_RLD])sm; /* [slot][q, k, h] */
    static_assert(SSD_OUT_ST(false) <= RING, "the output pass's z fits in the ring");
    float(*Mt)[SSD_LD] = (float(*)[SSD_LD])(sm + RING); /* exp(seg), M^T, yi, y */
    float(*Vs)[SSD_LD] = Mt + 64;
    float *adt = &Vs[64][0], *sc = adt + M3Q, *cs = sc + M3Q;
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], ch = c * H + h, ld = H * SSD_NS;
    const int64_t f0 = Bn ? r0 : n, tok0 = d[4] - r0; /* rows from f0 on are formed */
    const int64_t qk0 = Bn ? d[0] * M3Q : e0; /* Q's and K's row of the chunk's row 0 */
    const float *q = Q + (qk0 * H + h) * SSD_NS, *k = K + (qk0 * H + h) * SSD_NS;
    const float *v = V + (e0 * H + h) * SSD_HP, *hp = hck + ch * SSD_HP * SSD_NS;
    const int t = threadIdx.x, tj = t % 64, half = t / 64;
    /* thread t's piece of a stage: row pr, columns pc.. of the stage's */
    const int pr = t / (M3YI_RK / 4), pc = 4 * (t % (M3YI_RK / 4));
    const bool pin = pr < n, pnew = pin && pr >= f0;
    const float *qrow = pnew ? Cn + (tok0 + pr) * SSD_NS : q + (pin ? pr : 0) * ld;
    const float *krow = pnew ? Bn + (tok0 + pr) * SSD_NS : k + (pin ? pr : 0) * ld;
    const float *turns = TK + ((e0 + pr) * H + h) * M3_TURNS; /* a new row's */
    float4 turn = {}; /* the turns of the thread's formed pieces of the stage in flight */
    auto issue = [&](int st) { /* stage st: columns st * M3YI_RK.. (rows past n: +0) */
        const int m = st * M3YI_RK + pc;
        mb_cp_async16(&ring[st % 2][0][pr][pc], qrow + m, pin ? 16 : 0);
        mb_cp_async16(&ring[st % 2][1][pr][pc], krow + m, pin ? 16 : 0);
        mb_cp_async16(&ring[st % 2][2][pr][pc], hp + pr * SSD_NS + m, 16);
        if (pnew && m < M3_TURNS) turn = *(const float4 *)(turns + m);
    };
    issue(0);
    for (int e = t; e < 64 * SSD_HP / 4; e += T) {
        const int r = e / (SSD_HP / 4), p = 4 * (e % (SSD_HP / 4));
        mb_cp_async16(&Vs[r][p], v + (r < n ? r : 0) * H * SSD_HP + p, r < n ? 16 : 0);
    }
    mb_cp_commit();
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
    /* exp(seg) down column j = tj into Mt[j][i] (this thread's half of the rows), four
     * rows to a float4 store (rows up to j are never read); the exps, off the chain
     * of adds, overlap */
    if (tj < n) {
        float s = 0.0f;
        int64_t end;
        auto add = [&](int64_t i, float &a) {
            if (i > tj) a = a + adt[i];
        };
        for (int64_t i0 = ssd_seg_half(half, tj & ~3, n, s, add, &end); i0 < end; i0 += 4) {
            float sv[4];
            bool in[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = i0 + u;
                in[u] = i > tj && i < n;
                if (in[u]) s = s + adt[i];
                sv[u] = s;
            }
            float4 w;
            float ev[4];
            ssd_exp_seg(sv, ev);
            w.x = in[0] ? ev[0] : 0.0f, w.y = in[1] ? ev[1] : 0.0f;
            w.z = in[2] ? ev[2] : 0.0f, w.w = in[3] ? ev[3] : 0.0f;
            *(float4 *)&Mt[tj][i0] = w;
        }
    }
    float acc[2][RN][8], (&g)[RN][8] = acc[0], (&ys)[RN][8] = acc[1]; /* G, then yi; ys */
    ssd_zero(g);
    ssd_zero(ys);
    for (int st = 0; st < SSD_NS / M3YI_RK; st++) {
        mb_cp_wait<0>(); /* this thread's copies of stage st (and v) landed */
        if (pin) {
            const int m = st * M3YI_RK + pc;
            float4 *qx = (float4 *)&ring[st % 2][0][pr][pc];
            float4 *kx = (float4 *)&ring[st % 2][1][pr][pc];
            if (pnew) {
                *qx = m3_form4(*qx, *(const float4 *)(C_bias + h * SSD_NS + m), turn, m);
                *kx = m3_form4(*kx, *(const float4 *)(B_bias + h * SSD_NS + m), turn, m);
            }
            ssd_scale4(&kx->x, sc[pr]);
        }
        __syncthreads(); /* stage st is ready for all; the other slot is consumed */
        if (st + 1 < SSD_NS / M3YI_RK) issue(st + 1);
        mb_cp_commit();
        const float *const kh[2] = {&ring[st % 2][1][t % 8][0], &ring[st % 2][2][t % 8][0]};
        ssd_mma_rows<M3YI_RK, M3YI_RLD, M3YI_RLD, RN, 2, 4>(acc, &ring[st % 2][0][ssd_r<RN>(t)][0], kh);
    }
    /* M, then yi = M . v, parked in M's place */
#pragma unroll
    for (int r = 0; r < RN; r++)
#pragma unroll
        for (int qq = 0; qq < 8; qq++) {
            const int i = ssd_r<RN>(t) + r, j = ssd_cr(t, qq);
            if (j < i && i < n) Mt[j][i] = g[r][qq] * Mt[j][i];
            g[r][qq] = 0.0f;
        }
    __syncthreads();
    ssd_mma64_tri<RN>(g, Mt, Vs, 0, (int)n, 0);
    __syncthreads(); /* M is consumed */
    ssd_park<RN>(Mt, g);
    /* each row's exp(cs_i) and D + qk_gamma (in adt and sc, which are consumed) */
    if (t < n) {
        adt[t] = mb_exp(cs[t]);
        sc[t] = D[h] + QKG[(e0 + t) * H + h];
    }
    __syncthreads();
    /* y = ys * exp(cs_i) + yi, + (D + qk_gamma) * v, in place of yi (each element is
     * its own thread's), then the rows a float4 a thread at a time (coalesced z and
     * stores) into the gate */
#pragma unroll
    for (int r = 0; r < RN; r++) {
        const int i = ssd_r<RN>(t) + r;
#pragma unroll
        for (int qq = 0; qq < 8; qq++) {
            const int p = ssd_cr(t, qq);
            float y = ys[r][qq] * adt[i] + Mt[i][p];
            Mt[i][p] = y + sc[i] * Vs[i][p];
        }
    }
    __syncthreads();
    ssd_out_rows<false, T>(Mt, sm, 0, r0, n, d[4], h * SSD_HP, nullptr, 0, 0.0f, zx, dip, nullptr,
                           yg, di);
}

#if defined(MB_MMA)
/* mb_m3_y_k in fast mode. Block (head h, chunk c), M3Y_THREADS threads; warp w owns
 * rows i = 16 (w % 4) + (0..15) and columns 32 (w / 4) + (0..31) of each 64 x 64
 * product, as m16n8k8 TF32 tiles. The rows of q, k and h_prev are copied as they are
 * by cp.async, 16 state columns a stage in a ring of M3Y_STAGES, v's rows once
 * beside them (M3Y_SMEM bytes of dynamic shared memory); each thread readies the
 * pieces it copied once they land (new rows' q and k biased and turned, every operand
 * rounded to TF32), so one barrier a stage suffices. A tile's k t and t + 4 are a
 * stage's columns 4t and 4t + 1, then 4t + 2 and 4t + 3: one 16-byte read a row.
 *   G = q . k^T and Y = q . h_prev^T over the stages together;
 *   M[i][j] = G scale_j exp(adt_{j+1} + .. + adt_i) for j < i < n (else +0) into
 *   shared memory where the ring was (the exps summed down each column first), Y
 *   scaled by exp(cs_i);
 *   Y += M . v over j below the warp's last row;
 * then y = Y + (D + qk_gamma) v, gated, into yg as mb_m3_y_k writes it. */
#define M3Y_THREADS 256
#define M3Y_K 16   /* state columns a stage */
#define M3Y_LDV 72 /* 8 mod 32: the fragments of M and v on distinct banks */
#define M3Y_STAGES 3
#define M3Y_SMEM (4 * (M3Y_STAGES * 3 * 64 * M3Y_K + 64 * M3Y_LDV))
MB_KERNEL void MB_BOUNDS_MIN(M3Y_THREADS, 3) mb_fast_m3_y_k(M3_Y_PARAMS, M3_ROT_PARAMS)
{
    static_assert(M3Y_THREADS == 64 * M3Y_K / 4, "a piece of each operand a thread");
    static_assert(M3Y_THREADS == 4 * M3Q, "a quarter of a column of M a thread");
    extern __shared__ __align__(16) float sm[];
    float(*ring)[3][64][M3Y_K] = (float(*)[3][64][M3Y_K])sm; /* q, k, h_prev */
    float(*sv)[M3Y_LDV] = (float(*)[M3Y_LDV])(sm + M3Y_STAGES * 3 * 64 * M3Y_K);
    float(*mt)[M3Y_LDV] = (float(*)[M3Y_LDV])sm; /* M, once the ring is consumed */
    __shared__ float adt[M3Q], sc[M3Q], cs[M3Q];
    __shared__ __align__(16) float th[M3Q][M3A];
    __shared__ __align__(16) float2 bias[2][SSD_NS / 2];
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], tok0 = d[4] - r0, ch = c * H + h;
    if (n <= r0) return; /* no outputs */
    const int64_t qk0 = TH ? d[0] * M3Q : e0; /* Q's and K's row of the chunk's row 0 */
    const float *q = Q + (qk0 * H + h) * SSD_NS, *k = K + (qk0 * H + h) * SSD_NS;
    const float *v = V + (e0 * H + h) * SSD_HP, *hp = hck + ch * SSD_HP * SSD_NS;
    const int64_t ld = H * SSD_NS;
    const int t = threadIdx.x, lane = t % 32, w = t / 32, gq = lane / 4, t4 = lane % 4;
    /* thread t's pieces: row cr, columns cm .. cm + 3 of each stage's q, k and h_prev */
    const int cr = t / 4, cm = 4 * (t % 4);
    const bool rin = cr < n, rnew = TH && cr >= r0 && rin;
    const float *src[3] = {rnew ? Cn + (tok0 + cr) * SSD_NS : q + (rin ? cr : 0) * ld,
                           rnew ? Bn + (tok0 + cr) * SSD_NS : k + (rin ? cr : 0) * ld,
                           hp + cr * SSD_NS};
    auto issue = [&](int st) { /* rows past n are zero-filled */
#pragma unroll
        for (int which = 0; which < 3; which++)
            mb_cp_async16(&ring[st % M3Y_STAGES][which][cr][cm], src[which] + M3Y_K * st + cm,
                          which == 2 || rin ? 16 : 0);
    };
    for (int e = t; e < 64 * (SSD_HP / 4); e += M3Y_THREADS) {
        const int r = e / (SSD_HP / 4), p = 4 * (e % (SSD_HP / 4));
        mb_cp_async16(&sv[r][p], v + (r < n ? r : 0) * H * SSD_HP + p, r < n ? 16 : 0);
    }
    for (int st = 0; st < M3Y_STAGES - 1; st++) {
        issue(st);
        mb_cp_commit();
    }
    if (TH) m3_fast_rot_tables(n, r0, tok0, H, h, TH, B_bias, C_bias, th, bias, M3Y_THREADS);
    m3_fast_tables(n, e0, H, h, false, DT, SIG, ADT, adt, sc, cs, nullptr);
    if (TH) {
        mb_cp_commit();
        mb_cp_wait<0>(); /* the first stages with the tables */
    }
    __syncthreads(); /* the tables are published */
    const int ra = 16 * (w % 4) + gq, cb = 32 * (w / 4) + gq; /* fragment row, column */
    float g[4][4] = {}, y[4][4] = {};
    constexpr int steps = SSD_NS / M3Y_K;
#pragma unroll /* the ring's slots and every offset fixed at compile time */
    for (int st = 0; st < steps; st++) {
        mb_cp_wait<M3Y_STAGES - 2>(); /* this thread's pieces of stage st landed */
        const int pp = (M3Y_K * st + cm) / 2;
        const float4 z = rnew ? m3_turns(pp, th[cr][pp % M3A], th[cr][(pp + 1) % M3A])
                              : make_float4(1.0f, 0.0f, 1.0f, 0.0f);
#pragma unroll
        for (int which = 0; which < 3; which++) {
            float4 *px = (float4 *)&ring[st % M3Y_STAGES][which][cr][cm];
            float4 x = *px;
            if (which < 2 && rnew) x = m3_fix_piece(x, *(const float4 *)&bias[which][pp], z);
            *px = ssdf_ready(x, 1.0f);
        }
        __syncthreads(); /* stage st is ready for all; the slot refilled next is consumed */
        if (st + M3Y_STAGES - 1 < steps) issue(st + M3Y_STAGES - 1);
        mb_cp_commit();
        const float(*Qs)[M3Y_K] = ring[st % M3Y_STAGES][0], (*Ks)[M3Y_K] = ring[st % M3Y_STAGES][1];
        const float(*Hs)[M3Y_K] = ring[st % M3Y_STAGES][2];
        const float4 qa = *(const float4 *)&Qs[ra][4 * t4], qb = *(const float4 *)&Qs[ra + 8][4 * t4];
#pragma unroll
        for (int qq = 0; qq < 4; qq++) {
            const int j = cb + 8 * qq;
            const float4 kb = *(const float4 *)&Ks[j][4 * t4], hb = *(const float4 *)&Hs[j][4 * t4];
            mb_mma_tf32(g[qq], __float_as_uint(qa.x), __float_as_uint(qb.x), __float_as_uint(qa.y),
                        __float_as_uint(qb.y), __float_as_uint(kb.x), __float_as_uint(kb.y));
            mb_mma_tf32(y[qq], __float_as_uint(qa.x), __float_as_uint(qb.x), __float_as_uint(qa.y),
                        __float_as_uint(qb.y), __float_as_uint(hb.x), __float_as_uint(hb.y));
            mb_mma_tf32(g[qq], __float_as_uint(qa.z), __float_as_uint(qb.z), __float_as_uint(qa.w),
                        __float_as_uint(qb.w), __float_as_uint(kb.z), __float_as_uint(kb.w));
            mb_mma_tf32(y[qq], __float_as_uint(qa.z), __float_as_uint(qb.z), __float_as_uint(qa.w),
                        __float_as_uint(qb.w), __float_as_uint(hb.z), __float_as_uint(hb.w));
        }
    }
    /* the epilogue's z and D + qk_gamma of the thread's rows ra, ra + 8 (with outputs)
     * load while M forms */
    float zv[2][4][2], dq[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int i = ra + 8 * u;
        const bool out = i >= r0 && i < n;
        const float *zr = zx + (d[4] + i - r0) * dip + h * SSD_HP + cb - gq + 2 * t4;
        dq[u] = out ? D[h] + QKG[(e0 + i) * H + h] : 0.0f;
#pragma unroll
        for (int qq = 0; qq < 4; qq++)
            zv[u][qq][0] = out ? zr[8 * qq] : 0.0f, zv[u][qq][1] = out ? zr[8 * qq + 1] : 0.0f;
    }
    __syncthreads(); /* the ring is consumed: M takes its place */
    { /* exp of the sum of adt over rows (j, i] ascending, column j = t % 64, rows i of
       * quarter t / 64 (the sum carried up to the quarter first) */
        const int j = t % M3Q, i0 = M3Q / 4 * (t / M3Q);
        float s = 0.0f;
#pragma unroll 8
        for (int i = j + 1; i < i0; i++) s += adt[i];
#pragma unroll
        for (int i = i0; i < i0 + M3Q / 4; i++)
            if (i > j) {
                s += adt[i];
                mt[i][j] = __expf(s);
            }
    }
    __syncthreads();
    /* accumulator e of tile qq: row ra + 8 (e / 2), column cb - gq + 8 qq + 2 t4 + e % 2;
     * M rounded to TF32 as it is stored */
    const float ea = __expf(cs[ra]), eb = __expf(cs[ra + 8]);
#pragma unroll
    for (int qq = 0; qq < 4; qq++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = ra + 8 * u, j = cb - gq + 8 * qq + 2 * t4;
            float2 *pm = (float2 *)&mt[i][j];
            const float2 x = *pm;
            const float m0 = j < i && i < n ? g[qq][2 * u] * sc[j] * x.x : 0.0f;
            const float m1 = j + 1 < i && i < n ? g[qq][2 * u + 1] * sc[j + 1] * x.y : 0.0f;
            *pm = make_float2(__uint_as_float(mb_tf32(m0)), __uint_as_float(mb_tf32(m1)));
            y[qq][2 * u] *= u ? eb : ea;
            y[qq][2 * u + 1] *= u ? eb : ea;
        }
    __syncthreads();
    for (int kk = 0; kk < 16 * (w % 4 + 1); kk += 8) {
        const int kl = kk + t4, kh = kl + 4;
        const uint32_t a0 = __float_as_uint(mt[ra][kl]), a1 = __float_as_uint(mt[ra + 8][kl]);
        const uint32_t a2 = __float_as_uint(mt[ra][kh]), a3 = __float_as_uint(mt[ra + 8][kh]);
#pragma unroll
        for (int qq = 0; qq < 4; qq++)
            mb_mma_tf32(y[qq], a0, a1, a2, a3, mb_tf32(sv[kl][cb + 8 * qq]),
                        mb_tf32(sv[kh][cb + 8 * qq]));
    }
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int i = ra + 8 * u;
        if (i < r0 || i >= n) continue;
        const int64_t tok = d[4] + i - r0;
#pragma unroll
        for (int qq = 0; qq < 4; qq++) {
            const int p = cb - gq + 8 * qq + 2 * t4;
            float2 o;
            o.x = (y[qq][2 * u] + dq[u] * sv[i][p]) * mb_silu(zv[u][qq][0]);
            o.y = (y[qq][2 * u + 1] + dq[u] * sv[i][p + 1]) * mb_silu(zv[u][qq][1]);
            *(float2 *)(yg + tok * di + h * SSD_HP + p) = o;
        }
    }
}
#endif

/* k_last, v_last (B, H, ...) from ext row last[b] (each row's last token), k's
 * from K's row klast[b] where given (as krow of mb_m3_fold_k). */
MB_KERNEL void mb_m3_last_k(int64_t B, int64_t H, const int64_t *last, const float *K,
                            const float *V, float *k_last, float *v_last, const int64_t *klast)
{
    const int64_t W = SSD_NS + SSD_HP;
    MB_GRID_LOOP(i, B * H * W) {
        const int64_t bh = i / W, b = bh / H, h = bh % H, w = i % W, e = last[b] * H + h;
        if (w < SSD_NS)
            k_last[bh * SSD_NS + w] = K[((klast ? klast[b] : last[b]) * H + h) * SSD_NS + w];
        else
            v_last[bh * SSD_HP + w - SSD_NS] = V[e * SSD_HP + w - SSD_NS];
    }
}

#endif
