/* The Mamba-3 SISO backward (docs/numerics.md "Backward (Mamba-3)"), the GPU twin of
 * chunk_bwd and head_bwd in reference/back3.c, on the forward's chunk layout (ssd.cu
 * descriptors of a zero-state prefill without lengths: t0 = 0, so ext rows are the
 * packed tokens). The forward's own kernels (ssd3.cu) recompute q, k, v, dt, sig,
 * A*dt, the angles' cos and sin (m3_rotate), the chunk states hck (HP, NS per chunk
 * and head), E = exp(cs_last) and the gated output; mb_m3b_chunk_k recomputes the
 * output before the gate from the same pieces.
 *
 * The C reference walks each (row, head) over its chunks in reverse because of dh,
 * the gradient of the state leaving a chunk. dh entering chunk k is
 * fma(exp(cs_last_k), dh leaving it, Sd_k) with Sd_k = sum_i q_rot_i dye_i^T, a
 * function of the chunk alone, so every chunk's own part runs in parallel and only
 * that fma chain is serial. Each value is produced by the C reference's own
 * sequence of operations:
 *   mb_m3b_rotate_k  the forward's rotation, keeping each token's cos and sin.
 *   mb_m3b_sd_k      Sd_k per (chunk, head), from dy = dg * silu(z) (mb_m2_gate_k).
 *   (ssd.cu's mb_ssd_dchain_k: dh leaving each chunk, serial over a row's chunks.)
 *   mb_m3b_chunk_k   per (chunk, head): the gradients of z, v, q_rot, k_rot * scale,
 *                    qk_gamma, the scales and A*dt.
 *   mb_m3b_theta_k   the angle gradient, serial over each row's tokens in reverse.
 *   mb_m3b_token_k   per (token, head): unrotated q and k gradients, dt, trap, dd_A.
 *   mb_m3b_heads_k   per token: q, k and angle gradients summed over the heads.
 * Per-token arrays are (M, H, ...) with M the packed tokens. */
#include "ssd3.cu" /* and grad.cu (mb_dsilu), included before this file */

#define B3_THREADS 256
#define B3_PER (SSD_NS * SSD_HP)
/* Strictly lower triangles (j < i) of (M3Q, M3Q) tiles, packed row by row. */
#define B3_NTRI (M3Q * (M3Q - 1) / 2)
#define B3_TRI(i, j) ((i) * ((i) - 1) / 2 + (j))
/* mb_m3b_chunk_k's dynamic shared memory, in floats: eight row vectors, two (M3Q, HP)
 * tiles and three triangles (_cuda_back3.py CHUNK_SMEM; under AMD's 64 KiB) */
#define B3_SMEM (8 * M3Q + 2 * M3Q * SSD_HP + 3 * B3_NTRI)

/* Ext row i of a chunk starting at e0, head h: the index of its per-head values. */
#define B3_EH(i) ((e0 + (i)) * H + h)

/* One thread per (row, head, angle): the forward's m3_rotate, keeping cos and sin. */
MB_KERNEL void mb_m3b_rotate_k(int64_t B, int64_t H, const int64_t *off, const int64_t *eoff,
                               const int64_t *t0, const float *Bn, const float *Cn,
                               const float *B_bias, const float *C_bias, const float *TA,
                               const float *DT, float *theta, float *Q, float *K, float *rot)
{
    MB_GRID_LOOP(i, B * H * M3A) {
        m3_rotate(i, H, off, eoff, t0, Bn, Cn, B_bias, C_bias, TA, DT, theta, Q, K, NULL, rot);
    }
}

/* cs of a chunk's n rows: the serial cumsum of A*dt from +0 (thread 0), then a barrier. */
MB_DEV void b3_cumsum(const float *ADT, int64_t e0, int64_t n, int64_t H, int64_t h, float *cs)
{
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            acc = acc + ADT[B3_EH(i)];
            cs[i] = acc;
        }
    }
    __syncthreads();
}

/* Block (chunk c, head h): Sd[c, h][m][p] = sum over the chunk's rows i ascending of
 * q_rot_i[m] * (dy_i[p] * exp(cs_i)). */
MB_KERNEL void MB_BOUNDS(B3_THREADS)
mb_m3b_sd_k(const int64_t *desc, int64_t H, int64_t di, const float *Q, const float *ADT,
            const float *dY, float *Sd)
{
    __shared__ float ev[M3Q];
    const int64_t c = blockIdx.x, h = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    b3_cumsum(ADT, e0, n, H, h, ev);
    if (threadIdx.x < n) ev[threadIdx.x] = mb_exp(ev[threadIdx.x]);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < B3_PER; e += B3_THREADS) {
        const int64_t m = e / SSD_HP, p = e % SSD_HP;
        const float *y = dY + tok * di + h * SSD_HP + p;
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++)
            acc = fmaf(Q[B3_EH(i) * SSD_NS + m], y[i * di] * ev[i], acc);
        Sd[(c * H + h) * B3_PER + e] = acc;
    }
}

/* Block (chunk c, head h), B3_THREADS threads, B3_SMEM floats of dynamic shared
 * memory. dyg: the gradient of the gated output (M, di), dY = dyg * silu(z); dhL: dh
 * leaving the chunk (NS, HP; read only when the chunk folds). Writes dz and dv into
 * dzx's z and x columns, and per token and head dQKG, dQ (of q_rot), dK (of k_rot,
 * times the scale), dsc (of the scale) and dadt (of A*dt). */
MB_KERNEL void MB_BOUNDS(B3_THREADS)
mb_m3b_chunk_k(const int64_t *desc, int64_t H, int64_t di, int64_t dip, const float *Q,
               const float *K, const float *V, const float *DT, const float *SIG,
               const float *ADT, const float *QKG, const float *hck, const float *dhL,
               const float *D, const float *zx, const float *dyg, const float *dY, float *dzx,
               float *dQKG, float *dQ, float *dK, float *dsc, float *dadt)
{
    extern __shared__ float sm[];
    float *cs = sm, *ev = cs + M3Q, *sc = ev + M3Q, *dec = sc + M3Q, *av = dec + M3Q;
    float *Fv = av + M3Q, *Rv = Fv + M3Q, *F0 = Rv + M3Q;
    float *DY = sm + 8 * M3Q;       /* dy rows (M3Q, HP) */
    float *X = DY + M3Q * SSD_HP;   /* Ys = q_rot . h (M3Q, HP), then dvd */
    float *DG = X + M3Q * SSD_HP;   /* triangles: dG */
    float *MM = DG + B3_NTRI;       /* (q_rot . ks^T) * Lm */
    float *W = MM + B3_NTRI;        /* dseg, then its inclusive row prefix sums */
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], tok = d[4];
    const bool fold = d[5] != 0;
    const int tid = threadIdx.x;
    const float *hp = hck + ch * B3_PER, *dl = dhL + ch * B3_PER;

    /* the row vectors; dy; Ys = q_rot . h */
    b3_cumsum(ADT, e0, n, H, h, cs);
    const float cl = cs[n - 1];
    for (int64_t i = tid; i < n; i += B3_THREADS) {
        ev[i] = mb_exp(cs[i]);
        /* the last row's scale is only used by the fold (the next chunk's beta) */
        sc[i] = i + 1 < n || fold ? m3_scale(DT, SIG, H, B3_EH(i), true) : 0.0f;
        if (fold) dec[i] = mb_exp(cl - cs[i]);
    }
    for (int64_t x = tid; x < n * SSD_HP; x += B3_THREADS) {
        const int64_t i = x / SSD_HP, p = x % SSD_HP;
        DY[x] = dY[(tok + i) * di + h * SSD_HP + p];
        const float *q = Q + B3_EH(i) * SSD_NS, *hr = hp + p * SSD_NS;
        float ys = 0.0f;
        for (int m = 0; m < SSD_NS; m++) ys = fmaf(q[m], hr[m], ys);
        X[x] = ys;
    }
    __syncthreads();

    /* dqk_gamma = dy . v; a_i = (dy . Ys) * exp(cs_i); per pair j < i: G, Lm, dP = dy_i . v_j,
     * dseg = (dP * G) * Lm, dG = dP * Lm, Mm = G * Lm */
    for (int64_t i = tid; i < n; i += B3_THREADS) {
        const float *v = V + B3_EH(i) * SSD_HP, *dy = DY + i * SSD_HP, *ys = X + i * SSD_HP;
        float a = 0.0f, b = 0.0f;
        for (int p = 0; p < SSD_HP; p++) a = fmaf(dy[p], v[p], a);
        for (int p = 0; p < SSD_HP; p++) b = fmaf(dy[p], ys[p], b);
        dQKG[(tok + i) * H + h] = a;
        av[i] = b * ev[i];
    }
    for (int64_t x = tid; x < n * n; x += B3_THREADS) {
        const int64_t i = x / n, j = x % n;
        if (j >= i) continue;
        const float *q = Q + B3_EH(i) * SSD_NS, *k = K + B3_EH(j) * SSD_NS;
        const float *v = V + B3_EH(j) * SSD_HP, *dy = DY + i * SSD_HP, s = sc[j];
        float g = 0.0f;
        for (int m = 0; m < SSD_NS; m++) g = fmaf(q[m], k[m] * s, g);
        float seg = 0.0f;
        for (int64_t u = j + 1; u <= i; u++) seg = seg + ADT[B3_EH(u)];
        const float lm = mb_exp(seg);
        float dp = 0.0f;
        for (int p = 0; p < SSD_HP; p++) dp = fmaf(dy[p], v[p], dp);
        W[B3_TRI(i, j)] = (dp * g) * lm;
        DG[B3_TRI(i, j)] = dp * lm;
        MM[B3_TRI(i, j)] = g * lm;
    }
    __syncthreads();

    /* dq_rot_i = (dye_i . h) + sum_{j<i} dG_ij ks_j; the output before the gate,
     * ypre = (Ys * exp(cs) + Mm . v) + (D + qk_gamma) * v, and dz = (dg * ypre) * silu'(z);
     * F0 = dot(dh^T, h^T) * exp(cs_last); the inclusive row prefix sums of dseg */
    for (int64_t x = tid; x < n * SSD_NS; x += B3_THREADS) {
        const int64_t i = x / SSD_NS, m = x % SSD_NS;
        const float *dy = DY + i * SSD_HP, e = ev[i];
        float t1 = 0.0f;
        for (int p = 0; p < SSD_HP; p++) t1 = fmaf(dy[p] * e, hp[p * SSD_NS + m], t1);
        float t2 = 0.0f;
        for (int64_t j = 0; j < i; j++)
            t2 = fmaf(DG[B3_TRI(i, j)], K[B3_EH(j) * SSD_NS + m] * sc[j], t2);
        dQ[((tok + i) * H + h) * SSD_NS + m] = t1 + t2;
    }
    const float Dh = D[h];
    for (int64_t x = tid; x < n * SSD_HP; x += B3_THREADS) {
        const int64_t i = x / SSD_HP, p = x % SSD_HP, o = (tok + i) * dip + h * SSD_HP + p;
        float yi = 0.0f;
        for (int64_t u = 0; u < i; u++) yi = fmaf(MM[B3_TRI(i, u)], V[B3_EH(u) * SSD_HP + p], yi);
        float y = X[x] * ev[i] + yi;
        y = y + (Dh + QKG[B3_EH(i)]) * V[B3_EH(i) * SSD_HP + p];
        dzx[o] = (dyg[(tok + i) * di + h * SSD_HP + p] * y) * mb_dsilu(zx[o]);
    }
    if (fold && tid == B3_THREADS - 1) {
        /* one chain over (m, p) row-major */
        float acc = 0.0f;
        for (int m = 0; m < SSD_NS; m++)
            for (int p = 0; p < SSD_HP; p++) acc = fmaf(dl[m * SSD_HP + p], hp[p * SSD_NS + m], acc);
        *F0 = acc * mb_exp(cl);
    }
    for (int64_t i = tid; i < n; i += B3_THREADS)
        for (int64_t j = 1; j < i; j++) W[B3_TRI(i, j)] = W[B3_TRI(i, j - 1)] + W[B3_TRI(i, j)];
    __syncthreads();

    /* the fold's dvd_j = ks_j . dh, over Ys (read above) */
    if (fold) {
        for (int64_t x = tid; x < n * SSD_HP; x += B3_THREADS) {
            const int64_t j = x / SSD_HP, p = x % SSD_HP;
            const float *k = K + B3_EH(j) * SSD_NS, s = sc[j];
            float acc = 0.0f;
            for (int m = 0; m < SSD_NS; m++) acc = fmaf(k[m] * s, dl[m * SSD_HP + p], acc);
            X[x] = acc;
        }
        __syncthreads();
    }

    /* dks_j = sum_{i>j} dG_ij q_rot_i (i descending) + vd_j . dh; dv_j; F_j */
    for (int64_t x = tid; x < n * SSD_NS; x += B3_THREADS) {
        const int64_t j = x / SSD_NS, m = x % SSD_NS;
        float t = 0.0f;
        for (int64_t i = n - 1; i > j; i--) t = fmaf(DG[B3_TRI(i, j)], Q[B3_EH(i) * SSD_NS + m], t);
        if (fold) {
            const float *v = V + B3_EH(j) * SSD_HP, e = dec[j];
            float f = 0.0f;
            for (int p = 0; p < SSD_HP; p++) f = fmaf(v[p] * e, dl[m * SSD_HP + p], f);
            t = t + f;
        }
        dK[((tok + j) * H + h) * SSD_NS + m] = t;
    }
    for (int64_t x = tid; x < n * SSD_HP; x += B3_THREADS) {
        const int64_t j = x / SSD_HP, p = x % SSD_HP;
        float t = 0.0f;
        for (int64_t i = n - 1; i > j; i--) t = fmaf(MM[B3_TRI(i, j)], DY[i * SSD_HP + p], t);
        float dv = t + (Dh + QKG[B3_EH(j)]) * DY[x];
        if (fold) dv = dv + X[x] * dec[j];
        dzx[(tok + j) * dip + di + h * SSD_HP + p] = dv;
    }
    if (fold)
        for (int64_t j = tid; j < n; j += B3_THREADS) {
            const float *v = V + B3_EH(j) * SSD_HP, *dvd = X + j * SSD_HP;
            float acc = 0.0f;
            for (int p = 0; p < SSD_HP; p++) acc = fmaf(dvd[p], v[p], acc);
            Fv[j] = acc * dec[j];
        }
    __syncthreads();

    /* dsc_j = dks_j . k_rot_j; R_l = sum_{i>=l} of row i's prefix up to l - 1 (i ascending) */
    for (int64_t j = tid; j < n; j += B3_THREADS) {
        const float *dk = dK + ((tok + j) * H + h) * SSD_NS, *k = K + B3_EH(j) * SSD_NS;
        float acc = 0.0f;
        for (int m = 0; m < SSD_NS; m++) acc = fmaf(dk[m], k[m], acc);
        dsc[(tok + j) * H + h] = acc;
        float r = 0.0f;
        if (j > 0)
            for (int64_t i = j; i < n; i++) r = r + W[B3_TRI(i, j - 1)];
        Rv[j] = r;
    }
    __syncthreads();

    /* dk_rot = dks * scale; dadt_l = ((sum_{i>=l} a_i + R_l) + F0) + sum_{j<l} F_j */
    for (int64_t x = tid; x < n * SSD_NS; x += B3_THREADS) {
        float *o = dK + ((tok + x / SSD_NS) * H + h) * SSD_NS + x % SSD_NS;
        *o = *o * sc[x / SSD_NS];
    }
    if (tid == 0) {
        float sa = 0.0f;
        for (int64_t l = n - 1; l >= 0; l--) {
            sa = sa + av[l];
            Rv[l] = sa + Rv[l];
        }
        float pf = 0.0f;
        for (int64_t l = 0; l < n; l++) {
            float v = Rv[l];
            if (fold) {
                v = v + *F0;
                if (l > 0) {
                    pf = pf + Fv[l - 1];
                    v = v + pf;
                }
            }
            dadt[(tok + l) * H + h] = v;
        }
    }
}

/* One thread per (row b of L tokens, head h, angle a), tokens in reverse:
 * Th_t = Th_{t+1} + (lq + lk) from +0, lq = dq[2a+1] q[2a] - dq[2a] q[2a+1] with q, dq
 * the rotated q and its gradient (likewise k), into TH (M, H, M3A). */
MB_KERNEL void mb_m3b_theta_k(int64_t B, int64_t L, int64_t H, const float *Q, const float *K,
                              const float *dQ, const float *dK, float *TH)
{
    MB_GRID_LOOP(i, B * H * M3A) {
        const int64_t b = i / (H * M3A), h = (i / M3A) % H, a = i % M3A;
        float th = 0.0f;
        for (int64_t t = L - 1; t >= 0; t--) {
            const int64_t e = (b * L + t) * H + h;
            const float *q = Q + e * SSD_NS, *k = K + e * SSD_NS;
            const float *dq = dQ + e * SSD_NS, *dk = dK + e * SSD_NS;
            const float lq = dq[2 * a + 1] * q[2 * a] - dq[2 * a] * q[2 * a + 1];
            const float lk = dk[2 * a + 1] * k[2 * a] - dk[2 * a] * k[2 * a + 1];
            th = th + (lq + lk);
            TH[e * M3A + a] = th;
        }
    }
}

/* Block per (token m of a row of L, head h), SSD_NS threads (one per dimension).
 * dQ, dK hold the rotated gradients on entry and the unrotated, biased q and k
 * gradients on return: R(theta)^T d + (dqk_gamma * gamma) * (k or q). Thread 0: dt,
 * trap and dd_A's gradients into dzx; threads < M3A: TH * dt into dTA. rot: cos and
 * sin per (token, head, angle). */
MB_KERNEL void MB_BOUNDS(SSD_NS)
mb_m3b_token_k(int64_t M, int64_t L, int64_t H, int64_t di, int64_t dip, const float *zx,
               const float *Bn, const float *Cn, const float *B_bias, const float *C_bias,
               const float *dt_bias, const float *DT, const float *SIG, const float *TA,
               const float *rot, const float *TH, const float *dQKG, const float *dsc,
               const float *dadt, float *dQ, float *dK, float *dTA, float *dzx)
{
    const int64_t oDT = 2 * di + 2 * SSD_NS, oA = oDT + H, oTR = oA + H;
    const int i = threadIdx.x;
    for (int64_t mh = blockIdx.x; mh < M * H; mh += gridDim.x) {
        const int64_t m = mh / H, h = mh % H;
        float *dq = dQ + mh * SSD_NS, *dk = dK + mh * SSD_NS;
        const float qb = Cn[m * SSD_NS + i] + C_bias[h * SSD_NS + i];
        const float kb = Bn[m * SSD_NS + i] + B_bias[h * SSD_NS + i];
        const float dt = DT[mh], sig = SIG[mh], dqkg = dQKG[mh], dacc = dqkg * (dt * sig);
        float oq = dq[i], ok = dk[i];
        if (i < 2 * M3A) {
            const int a = i / 2;
            const float cs = rot[(mh * M3A + a) * 2], sn = rot[(mh * M3A + a) * 2 + 1];
            const float q0 = dq[2 * a], q1 = dq[2 * a + 1], k0 = dk[2 * a], k1 = dk[2 * a + 1];
            oq = i % 2 == 0 ? q0 * cs + q1 * sn : q1 * cs - q0 * sn;
            ok = i % 2 == 0 ? k0 * cs + k1 * sn : k1 * cs - k0 * sn;
        }
        __syncthreads(); /* every read of the pair before any write */
        dq[i] = oq + dacc * kb;
        dk[i] = ok + dacc * qb;
        if (i < M3A) dTA[mh * M3A + i] = TH[mh * M3A + i] * dt;
        if (i == 0) {
            /* gamma_t = dt sig feeds scale_t and qk_gamma; beta_{t-1} = dt (1 - sig) */
            const float *c = Cn + m * SSD_NS, *k = Bn + m * SSD_NS;
            const float *cb = C_bias + h * SSD_NS, *kbh = B_bias + h * SSD_NS;
            float acc = 0.0f;
            for (int j = 0; j < SSD_NS; j++) acc = fmaf(c[j] + cb[j], k[j] + kbh[j], acc);
            const float dgam = dsc[mh] + dqkg * acc, da = dadt[mh];
            const float *zr = zx + m * dip;
            const float x = zr[oA + h], Araw = m3_heavy_tail(x);
            const float A = Araw > -1e-4f ? -1e-4f : Araw;
            float ddt = dgam * sig, dsig = dgam * dt;
            if (m % L > 0) {
                ddt = ddt + dsc[mh - H] * (1.0f - sig);
                dsig = dsig - dsc[mh - H] * dt;
            }
            ddt = ddt + A * da;
            float tt = 0.0f;
            for (int a = 0; a < M3A; a++) tt = fmaf(TH[mh * M3A + a], TA[m * M3A + a], tt);
            ddt = ddt + tt;
            float *dz = dzx + m * dip;
            const float u = zr[oDT + h] + dt_bias[h];
            dz[oDT + h] = u <= 20.0f ? ddt * mb_sigmoid(u) : ddt;
            dz[oTR + h] = (dsig * sig) * (1.0f - sig);
            /* A = -(x >= 0 ? 1 + x : 1 / (1 - x)), floored: no gradient where the floor binds */
            const float dA = da * dt;
            float dx = 0.0f;
            if (!(Araw > -1e-4f)) {
                const float f = 1.0f / (1.0f - x);
                dx = x >= 0.0f ? -dA : -(dA * (f * f));
            }
            dz[oA + h] = dx;
        }
    }
}

/* Per token m, over the heads ascending from +0: dCn, dBn (M, NS) from dQ and dK;
 * the angles' dzx columns (oANG) = ((sum_h dTA) * PI) * (1 - th * th), th =
 * tanh(angle). One thread per (token, column). */
MB_KERNEL void mb_m3b_heads_k(int64_t M, int64_t H, int64_t dip, int64_t oANG, const float *zx,
                              const float *dQ, const float *dK, const float *dTA, float *dCn,
                              float *dBn, float *dzx)
{
    const int64_t W = 2 * SSD_NS + M3A;
    MB_GRID_LOOP(x, M * W) {
        const int64_t m = x / W, j = x % W;
        float acc = 0.0f;
        if (j < 2 * SSD_NS) {
            const float *src = j < SSD_NS ? dQ : dK;
            const int64_t col = j % SSD_NS;
            for (int64_t h = 0; h < H; h++) acc = acc + src[(m * H + h) * SSD_NS + col];
            (j < SSD_NS ? dCn : dBn)[m * SSD_NS + col] = acc;
        } else {
            const int64_t a = j - 2 * SSD_NS;
            for (int64_t h = 0; h < H; h++) acc = acc + dTA[(m * H + h) * M3A + a];
            const float th = mb_tanh(zx[m * dip + oANG + a]);
            dzx[m * dip + oANG + a] = (acc * MB_PI) * (1.0f - th * th);
        }
    }
}

#undef B3_THREADS
#undef B3_PER
#undef B3_SMEM
#undef B3_NTRI
#undef B3_TRI
#undef B3_EH
