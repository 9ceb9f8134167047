/* The Mamba-1 backward's own kernels, the GPU twin of reference/back1.c: every value
 * is produced by the same float operations in the same order (docs/numerics.md,
 * "Backward (Mamba-1)"), so only the schedule differs from the CPU's.
 *
 * The scan's gradient needs, per (row, channel c, state n), dh in reverse time and h
 * in forward time; two reductions cross them: A_log's chain runs over flat tokens per
 * (c, n), dB and dC chain over the channels per (token, n). Three passes share the
 * work, each recomputing dA = exp(delta A) where it needs it (the same operations,
 * so the same bits), so no per-(token, c, n) value ever goes to global memory:
 * - mb_m1b_dhc_k: dh alone, in reverse over each row, kept at every M1B_TC-token
 *   chunk boundary (the carries dhk);
 * - mb_m1b_fwd_k: per (c, n) and 8192-token leaf of flat tokens, chunk by chunk: dh
 *   of the chunk from its carry, then h forward, A_log's chain, and h entering every
 *   chunk (the carries hk). h entering a leaf that starts inside a row comes from
 *   mb_m1b_lead_k;
 * - mb_m1b_chunk_k: per chunk, every channel: dh and h again from their carries, the
 *   per-token pieces (chains over n) and dB, dC (chains over channels, continued
 *   from group to group of channels in registers).
 * The lane kernels run one lane per state, M1B_SCH channels a block, as scan1.cu
 * does; their inputs go through shared memory with coalesced loads. The host cuts
 * the rows into windows of whole rows (the carries' memory); A_log's chains continue
 * from window to window through their leaves. */
#include "vendor.h"
#include "numerics.h"

#define NS 16
#define M1B_TC 32               /* tokens per chunk (any value gives the same bits) */
#define M1B_SCH 8               /* channels per block of the lane kernels */
#define M1B_LT (M1B_SCH * NS)   /* their threads */
/* channels per group of mb_m1b_chunk_k (any value gives the same bits): under hipcc
 * its shared memory stays within AMD's 64 KiB of LDS (_hip.py m1b_group) */
#if defined(__HIPCC__)
#define M1B_G 8
#else
#define M1B_G 16
#endif
#define M1B_SG M1B_G            /* tokens per sub-group of it: one a lane row */
#define M1B_CT (M1B_G * NS)     /* its threads */
/* Rows of 16 states padded to M1B_P floats, tokens to M1B_TOK (16 banks apart), so
 * that a lane's column, a channel's row (float4) and a state's column of a token pair
 * each read without bank conflicts; rows and tokens stay 16-byte aligned. */
#define M1B_P (NS + 4)
#define M1B_TOK (M1B_G * M1B_P + 16)
#define M1B_IN (M1B_TC * M1B_G) /* floats of one staged input of a group */
#define M1B_BUF (4 * M1B_IN + M1B_G * M1B_P)
/* its dynamic shared memory in floats (mamba/_cuda_back1.py CHUNK_SMEM) */
#define M1B_SMEM ((M1B_TC + 2 * M1B_SG) * M1B_TOK + 2 * M1B_BUF + M1B_TC * 2 * NS)

/* Step 5's state update (reference/block1.h mb_m1_h_next): h' = fma(dA, h, (delta B_n) u). */
MB_DEV float m1b_h_next(float dA, float h, float delta, float bn, float u)
{
    return fmaf(dA, h, (delta * bn) * u);
}

/* One step n of the three chains over n of a (token, channel): y's C . h, and the
 * state gradient's terms w . a and dh . B, interleaved so that they overlap. */
MB_DEV void m1b_chains3(float &acc, float &sA, float &sB, float c, float h, float w, float a,
                        float d, float b)
{
    acc = fmaf(c, h, acc);
    sA = fmaf(w, a, sA);
    sB = fmaf(d, b, sB);
}

MB_DEV int64_t m1b_min(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* dt_proj's output plus bias (in place: spre) and delta = softplus(spre). */
MB_KERNEL void mb_m1b_prep_k(int64_t M, int64_t di, float *dtp, const float *dt_b, float *delta)
{
    MB_WALK(ix, M, di, 1) {
        const int64_t i = ix.m * di + ix.c;
        const float s = dtp[i] + dt_b[ix.c];
        dtp[i] = s;
        delta[i] = mb_softplus(s);
    }
}

/* dys = dyg * silu(z), z the second half of in_proj's output row. */
MB_KERNEL void mb_m1b_gate_k(int64_t M, int64_t di, const float *dyg, const float *xz, float *dys)
{
    MB_WALK(ix, M, di, 1) {
        const int64_t i = ix.m * di + ix.c;
        dys[i] = dyg[i] * mb_silu(xz[ix.m * 2 * di + di + ix.c]);
    }
}

/* A lane of the lane kernels (block x: channels [M1B_SCH x, M1B_SCH (x + 1))): state
 * n of the block's channel k; a channel past di runs on a copy of the last one and
 * stores nothing, so every thread reaches every barrier. */
struct m1b_lane {
    int n, k;
    int64_t c0, c, at; /* the block's first channel, the lane's, and c NS + n */
    bool live;
    float a;           /* A = -exp(A_log) */
};

MB_DEV m1b_lane m1b_lane_of(int64_t di, const float *A_log)
{
    m1b_lane l;
    l.n = threadIdx.x % NS;
    l.k = threadIdx.x / NS;
    l.c0 = (int64_t)blockIdx.x * M1B_SCH;
    l.live = l.c0 + l.k < di;
    l.c = l.live ? l.c0 + l.k : di - 1;
    l.at = l.c * NS + l.n;
    l.a = -mb_exp(A_log[l.at]);
    return l;
}

/* The inputs of up to M1B_TC tokens of one row for a block of the lane kernels. */
struct m1b_stage {
    float v[3][M1B_SCH][M1B_TC + 1]; /* per (token, channel): x0, x1, x2 */
    float bc[M1B_TC][2 * NS];        /* the tokens' B | C */
};

/* Stage nt tokens from flat token m: x0..x2 (x1, x2 may be NULL) of the block's
 * channels, consecutive threads on consecutive channels, and the B | C rows; one
 * cp.async group, committed here, so the block works on one stage while the next
 * loads (mb_cp_wait, then a barrier, before reading it). */
MB_DEV void m1b_stage_in(m1b_stage &s, const m1b_lane &l, int64_t m, int nt, int64_t di,
                         int64_t R, const float *xdbl, const float *x0, const float *x1,
                         const float *x2)
{
    const int64_t XR = R + 2 * NS;
    for (int e = threadIdx.x; e < nt * M1B_SCH; e += M1B_LT) {
        const int q = e / M1B_SCH, k = e % M1B_SCH;
        const int64_t i = (m + q) * di + (l.c0 + k < di ? l.c0 + k : di - 1);
        mb_cp_async4(&s.v[0][k][q], x0 + i, 4);
        if (x1) mb_cp_async4(&s.v[1][k][q], x1 + i, 4);
        if (x2) mb_cp_async4(&s.v[2][k][q], x2 + i, 4);
    }
    for (int e = threadIdx.x; e < nt * 2 * NS; e += M1B_LT)
        mb_cp_async4(&s.bc[e / (2 * NS)][e % (2 * NS)],
                     xdbl + (m + e / (2 * NS)) * XR + R + e % (2 * NS), 4);
    mb_cp_commit();
}

/* dh back over staged tokens i = nt - 1 down to ia: dh_i = fma(dA_{i+1}, dh_{i+1},
 * C_i[n] dys_i); (dA1, dh) hold the next token's on entry and token ia's on exit. KEEP:
 * each token's dA into rA[i] (registers once inlined), its dh into sdh[i][tid]. FULL:
 * a whole chunk (ia = 0, nt = M1B_TC), its loop free of guards so that the tokens'
 * independent exps interleave. */
template <bool FULL, bool KEEP>
MB_DEV void m1b_back(const m1b_stage &s, const m1b_lane &l, int ia, int nt, float &dA1, float &dh,
                     float *rA, float (*sdh)[M1B_LT])
{
#pragma unroll
    for (int i = M1B_TC - 1; i >= 0; i--)
        if (FULL || (i >= ia && i < nt)) {
            const float dA = mb_exp(s.v[0][l.k][i] * l.a);
            dh = fmaf(dA1, dh, s.bc[i][NS + l.n] * s.v[1][l.k][i]);
            dA1 = dA;
            if (KEEP) {
                rA[i] = dA;
                sdh[i][threadIdx.x] = dh;
            }
        }
}

/* Grid (x over channels / M1B_SCH, y over the window's rows b0 + y). dh_t = fma(dA_{t+1},
 * dh_{t+1}, C_t[n] dys_t) from the row's end (dA = dh = +0 past it); dh of the token
 * after chunk k (+0 for the last) lands at dhk[(y nch + k) di 16 + c 16 + n]. */
MB_KERNEL void MB_BOUNDS(M1B_LT)
mb_m1b_dhc_k(int64_t L, int64_t di, int64_t R, int64_t b0, int64_t nb, const float *delta,
             const float *dys, const float *xdbl, const float *A_log, float *dhk)
{
    __shared__ m1b_stage st[2];
    const m1b_lane l = m1b_lane_of(di, A_log);
    const int64_t per = di * NS, nch = (L + M1B_TC - 1) / M1B_TC;
    for (int64_t y = blockIdx.y; y < nb; y += gridDim.y) {
        const int64_t mr = (b0 + y) * L;
        float dA1 = 0.0f, dh = 0.0f;
        if (nch > 1)
            m1b_stage_in(st[(nch - 1) & 1], l, mr + (nch - 1) * M1B_TC,
                         (int)(L - (nch - 1) * M1B_TC), di, R, xdbl, delta, dys, NULL);
        for (int64_t k = nch - 1;; k--) {
            if (l.live) dhk[(y * nch + k) * per + l.at] = dh;
            if (k == 0) break;
            if (k > 1) m1b_stage_in(st[(k - 1) & 1], l, mr + (k - 1) * M1B_TC, M1B_TC, di, R,
                                    xdbl, delta, dys, NULL);
            else mb_cp_commit();
            mb_cp_wait<1>();
            __syncthreads();
            const int nt = (int)m1b_min(L - k * M1B_TC, M1B_TC);
            if (nt == M1B_TC)
                m1b_back<true, false>(st[k & 1], l, 0, nt, dA1, dh, NULL, NULL);
            else
                m1b_back<false, false>(st[k & 1], l, 0, nt, dA1, dh, NULL, NULL);
            __syncthreads();
        }
    }
}

/* Grid as mb_m1b_dhc_k's. h entering every leaf start (flat token a multiple of 8192)
 * strictly inside row b0 + y, at hL[(start / 8192) di 16 + c 16 + n]: the row's h
 * from +0, as the forward computes it, up to its last such start. */
MB_KERNEL void MB_BOUNDS(M1B_LT)
mb_m1b_lead_k(int64_t L, int64_t di, int64_t R, int64_t b0, int64_t nb, const float *delta,
              const float *u, const float *xdbl, const float *A_log, float *hL)
{
    __shared__ m1b_stage st;
    const m1b_lane l = m1b_lane_of(di, A_log);
    const int64_t per = di * NS;
    for (int64_t y = blockIdx.y; y < nb; y += gridDim.y) {
        const int64_t mr = (b0 + y) * L, last = (mr + L - 1) / MB_DOT_LEAF * MB_DOT_LEAF - mr;
        float h = 0.0f;
        for (int64_t t0 = 0; t0 < last; t0 += M1B_TC) {
            const int nt = (int)m1b_min(last - t0, M1B_TC);
            m1b_stage_in(st, l, mr + t0, nt, di, R, xdbl, delta, u, NULL);
            mb_cp_wait<0>();
            __syncthreads();
#pragma unroll
            for (int i = 0; i < M1B_TC; i++)
                if (i < nt) {
                    const int64_t m = mr + t0 + i;
                    if (i + t0 > 0 && m % MB_DOT_LEAF == 0 && l.live)
                        hL[m / MB_DOT_LEAF * per + l.at] = h;
                    const float dl = st.v[0][l.k][i];
                    h = m1b_h_next(mb_exp(dl * l.a), h, dl, st.bc[i][l.n], st.v[1][l.k][i]);
                }
            __syncthreads();
        }
        if (last > 0 && l.live) hL[(mr + last) / MB_DOT_LEAF * per + l.at] = h;
    }
}

/* A piece of mb_m1b_fwd_k's walk: the tokens of one chunk inside its leaf. */
struct m1b_piece {
    int64_t mc, ck;  /* the chunk's first flat token; its carries' offset */
    int nt, ia, ie;  /* the chunk's tokens; the piece's, [ia, ie) */
    bool first, tail; /* the chunk starts its row; a token follows it in the row */
};

MB_DEV m1b_piece m1b_piece_at(int64_t m, int64_t s1, int64_t L, int64_t b0, int64_t nch,
                              int64_t per)
{
    m1b_piece q;
    const int64_t b = m / L, t0 = m % L / M1B_TC * M1B_TC;
    q.mc = b * L + t0;
    q.ck = ((b - b0) * nch + t0 / M1B_TC) * per;
    q.nt = (int)m1b_min(L - t0, M1B_TC);
    q.ia = (int)(m - q.mc);
    q.ie = (int)m1b_min(q.nt, q.ia + (s1 - m));
    q.first = t0 == 0;
    q.tail = t0 + q.nt < L;
    return q;
}

/* h forward over staged tokens [ia, ie) from dA (rA) and dh (sdh) of m1b_back<*, true>,
 * and A_log's chain g = fma((dh h_prev) dA, delta, g). FULL as m1b_back's. */
template <bool FULL>
MB_DEV void m1b_fwd(const m1b_stage &s, const m1b_lane &l, int ia, int ie, const float *rA,
                    const float (*sdh)[M1B_LT], float &h, float &g)
{
#pragma unroll
    for (int i = 0; i < M1B_TC; i++)
        if (FULL || (i >= ia && i < ie)) {
            const float dl = s.v[0][l.k][i], hp = h;
            h = m1b_h_next(rA[i], hp, dl, s.bc[i][l.n], s.v[2][l.k][i]);
            g = fmaf((sdh[i][threadIdx.x] * hp) * rA[i], dl, g);
        }
}

/* Grid (x over channels / M1B_SCH, y over the 8192-leaves p that meet the window's
 * flat tokens [m0, m1)). One lane walks the leaf's tokens in the window in flat order,
 * chunk piece by chunk piece: dh of the piece from the chunk's carry (reverse, each
 * token's dA and dh kept), then h forward (+0 at a row's start, hL at a leaf start
 * inside a row), w = (dh h_prev) dA and A_log's chain g = fma(w, delta, g), which
 * starts at +0 on the leaf's first token or else continues leaves[p]. h entering
 * every chunk that starts in the leaf lands at hk (dhk's layout); g at leaves[p].
 * The next piece's inputs load while the block works on this one. */
MB_KERNEL void MB_BOUNDS_MIN(M1B_LT, 4)
mb_m1b_fwd_k(int64_t L, int64_t di, int64_t R, int64_t b0, int64_t nb, const float *delta,
             const float *u, const float *dys, const float *xdbl, const float *A_log,
             const float *dhk, const float *hL, float *hk, float *leaves)
{
    __shared__ m1b_stage st[2];
    __shared__ float sdh[M1B_TC][M1B_LT]; /* each lane's own dh of the piece */
    const m1b_lane l = m1b_lane_of(di, A_log);
    const int64_t per = di * NS, nch = (L + M1B_TC - 1) / M1B_TC;
    const int64_t m0 = b0 * L, m1 = m0 + nb * L, p0 = m0 / MB_DOT_LEAF;
    for (int64_t p = p0 + blockIdx.y; p <= (m1 - 1) / MB_DOT_LEAF; p += gridDim.y) {
        const int64_t s0 = p * MB_DOT_LEAF > m0 ? p * MB_DOT_LEAF : m0;
        const int64_t s1 = m1b_min(m1, (p + 1) * MB_DOT_LEAF);
        float h = s0 % L == 0 ? 0.0f : hL[p * per + l.at];
        float g = s0 % MB_DOT_LEAF == 0 ? 0.0f : leaves[p * per + l.at];
        m1b_piece q = m1b_piece_at(s0, s1, L, b0, nch, per);
        m1b_stage_in(st[0], l, q.mc, q.nt, di, R, xdbl, delta, dys, u);
        float ndh = dhk[q.ck + l.at];
        float ndl = q.tail ? delta[(q.mc + q.nt) * di + l.c] : 0.0f;
        for (int64_t m = s0, it = 0; m < s1; it++) {
            const m1b_piece c = q;
            float dh = ndh, dA1 = c.tail ? mb_exp(ndl * l.a) : 0.0f;
            m += c.ie - c.ia;
            if (m < s1) {
                q = m1b_piece_at(m, s1, L, b0, nch, per);
                m1b_stage_in(st[(it + 1) & 1], l, q.mc, q.nt, di, R, xdbl, delta, dys, u);
                ndh = dhk[q.ck + l.at];
                ndl = q.tail ? delta[(q.mc + q.nt) * di + l.c] : 0.0f;
            } else {
                mb_cp_commit();
            }
            mb_cp_wait<1>();
            __syncthreads();
            const m1b_stage &sc = st[it & 1];
            const bool full = c.ia == 0 && c.ie == M1B_TC;
            float rA[M1B_TC];
            if (full)
                m1b_back<true, true>(sc, l, 0, M1B_TC, dA1, dh, rA, sdh);
            else
                m1b_back<false, true>(sc, l, c.ia, c.nt, dA1, dh, rA, sdh);
            if (c.ia == 0) {
                if (c.first) h = 0.0f;
                if (l.live) hk[c.ck + l.at] = h;
            }
            if (full)
                m1b_fwd<true>(sc, l, 0, M1B_TC, rA, sdh, h, g);
            else
                m1b_fwd<false>(sc, l, c.ia, c.ie, rA, sdh, h, g);
            __syncthreads();
        }
        if (l.live) leaves[p * per + l.at] = g;
    }
}

/* A group's inputs, held in registers while the block works on the group before it. */
struct m1b_pre {
    float in[2][3]; /* delta, u, dys of staged elements tid and tid + M1B_CT */
    float dh, h, dl1, alog; /* the lane's carries, delta of the token after, A_log */
};

MB_DEV void m1b_pre_load(m1b_pre &p, int64_t c0, int64_t di, int64_t mc, int nt, bool tail,
                         int64_t ck, const float *delta, const float *u, const float *dys,
                         const float *dhk, const float *hk, const float *A_log)
{
    const int tid = threadIdx.x;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int e = tid + r * M1B_CT, q = e / M1B_G;
        const int64_t c = c0 + e % M1B_G < di ? c0 + e % M1B_G : di - 1;
        const int64_t i = (mc + (q < nt ? q : 0)) * di + c;
        p.in[r][0] = delta[i];
        p.in[r][1] = u[i];
        p.in[r][2] = dys[i];
    }
    const int64_t c = c0 + tid / NS < di ? c0 + tid / NS : di - 1, at = c * NS + tid % NS;
    p.dh = dhk[ck + at];
    p.h = hk[ck + at];
    p.dl1 = tail ? delta[(mc + nt) * di + c] : 0.0f;
    p.alog = A_log[at];
}

/* Store a group's inputs in its buffer: delta, u, dys and delta u (dB's factor,
 * rounded once as reference/back1.c's fold_bc rounds it) per (token, channel), A per
 * (channel, state); returns the lane's A. */
MB_DEV float m1b_pre_store(const m1b_pre &p, float *buf)
{
    const int tid = threadIdx.x;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int e = tid + r * M1B_CT;
        buf[e] = p.in[r][0];
        buf[M1B_IN + e] = p.in[r][1];
        buf[2 * M1B_IN + e] = p.in[r][2];
        buf[3 * M1B_IN + e] = p.in[r][0] * p.in[r][1];
    }
    const float a = -mb_exp(p.alog);
    buf[4 * M1B_IN + tid / NS * M1B_P + tid % NS] = a;
    return a;
}

/* One chunk of mb_m1b_chunk_k (below): nt tokens from flat token mc, carries at ck.
 * FULL: nt = M1B_TC, the token loops free of guards. */
template <bool FULL>
MB_DEV void m1b_chunk(float *sm, int64_t di, int64_t R, int64_t M, int64_t mc, int64_t ck, int ntv,
                      bool tail, const float *delta, const float *u, const float *xz,
                      const float *xdbl, const float *spre, const float *dyg, const float *dys,
                      const float *A_log, const float *D, const float *dhk, const float *hk,
                      float *yg, float *dxz, float *ds, float *dus, float *dxdbl, float *parts)
{
    float *DH = sm, *H = DH + M1B_TC * M1B_TOK, *W = H + M1B_SG * M1B_TOK;
    float *IN = W + M1B_SG * M1B_TOK, *BC = IN + 2 * M1B_BUF;
    const int tid = threadIdx.x, hi = tid / NS, lo = tid % NS, nt = FULL ? M1B_TC : ntv;
    const int64_t XR = R + 2 * NS, ngrp = (di + M1B_G - 1) / M1B_G;
    const int64_t P = (di + MB_DOT_LEAF - 1) / MB_DOT_LEAF;
    __syncthreads(); /* the previous chunk's last reads */
    for (int e = tid; e < nt * 2 * NS; e += M1B_CT)
        BC[e] = xdbl[(mc + e / (2 * NS)) * XR + R + e % (2 * NS)];
    m1b_pre pre;
    m1b_pre_load(pre, 0, di, mc, nt, tail, ck, delta, u, dys, dhk, hk, A_log);
    float a = m1b_pre_store(pre, IN);
    __syncthreads();
    float aB[M1B_TC / M1B_SG], aC[M1B_TC / M1B_SG];
#pragma unroll
    for (int s = 0; s < M1B_TC / M1B_SG; s++) aB[s] = aC[s] = 0.0f;
    for (int64_t grp = 0; grp < ngrp; grp++) {
        const int64_t c0 = grp * M1B_G;
        const float *buf = IN + (grp & 1) * M1B_BUF;
        const float *sdl = buf, *su = sdl + M1B_IN, *sdy = su + M1B_IN, *sdlu = sdy + M1B_IN;
        const float *sa = sdlu + M1B_IN;
        float dh = pre.dh, h = pre.h, dA1 = tail ? mb_exp(pre.dl1 * a) : 0.0f;
        if (grp + 1 < ngrp)
            m1b_pre_load(pre, c0 + M1B_G, di, mc, nt, tail, ck, delta, u, dys, dhk, hk, A_log);
        if (c0 > 0 && c0 % MB_DOT_LEAF == 0)
#pragma unroll
            for (int s = 0; s < M1B_TC / M1B_SG; s++) {
                const int iq = s * M1B_SG + hi;
                if (iq < nt) {
                    float *o = parts + ((c0 / MB_DOT_LEAF - 1) * M + mc + iq) * 2 * NS + lo;
                    o[0] = aB[s];
                    o[NS] = aC[s];
                }
                aB[s] = aC[s] = 0.0f;
            }
        /* the lane: dh of the chunk, reverse */
        float rA[M1B_TC];
#pragma unroll
        for (int i = M1B_TC - 1; i >= 0; i--)
            if (i < nt) {
                const float dA = mb_exp(sdl[i * M1B_G + hi] * a);
                dh = fmaf(dA1, dh, BC[i * 2 * NS + NS + lo] * sdy[i * M1B_G + hi]);
                dA1 = dA;
                rA[i] = dA;
                DH[i * M1B_TOK + hi * M1B_P + lo] = dh;
            }
        const float anext = grp + 1 < ngrp ? m1b_pre_store(pre, IN + ((grp + 1) & 1) * M1B_BUF)
                                           : 0.0f;
        const int gn = (int)m1b_min(di - c0, M1B_G);
#pragma unroll
        for (int s = 0; s < M1B_TC / M1B_SG; s++) {
            if (s * M1B_SG >= nt) break;
            const int iq = s * M1B_SG + hi;
            const bool out = iq < nt && lo < gn;
            const int64_t e = (mc + iq) * di + c0 + lo;
            float z = 0.0f, dg = 0.0f, sp = 0.0f;
            if (out) {
                z = xz[(mc + iq) * 2 * di + di + c0 + lo];
                dg = dyg[e];
                sp = spre[e];
            }
            /* the lane: h forward over the sub-group */
#pragma unroll
            for (int q = 0; q < M1B_SG; q++) {
                const int i = s * M1B_SG + q;
                if (i < nt) {
                    const float hp = h;
                    h = m1b_h_next(rA[i], hp, sdl[i * M1B_G + hi], BC[i * 2 * NS + lo],
                                   su[i * M1B_G + hi]);
                    H[q * M1B_TOK + hi * M1B_P + lo] = h;
                    W[q * M1B_TOK + hi * M1B_P + lo] =
                        (DH[i * M1B_TOK + hi * M1B_P + lo] * hp) * rA[i];
                }
            }
            __syncthreads();
            if (out) { /* the chains over n of (token iq, channel c0 + lo) */
                const float4 *hr = (const float4 *)(H + hi * M1B_TOK + lo * M1B_P);
                const float4 *wr = (const float4 *)(W + hi * M1B_TOK + lo * M1B_P);
                const float4 *dr = (const float4 *)(DH + iq * M1B_TOK + lo * M1B_P);
                const float4 *ar = (const float4 *)(sa + lo * M1B_P);
                const float4 *Bv = (const float4 *)(BC + iq * 2 * NS), *Cv = Bv + NS / 4;
                float acc = 0.0f, sA = 0.0f, sB = 0.0f;
#pragma unroll
                for (int v = 0; v < NS / 4; v++) {
                    const float4 h4 = hr[v], w4 = wr[v], d4 = dr[v], a4 = ar[v];
                    const float4 b4 = Bv[v], c4 = Cv[v];
                    m1b_chains3(acc, sA, sB, c4.x, h4.x, w4.x, a4.x, d4.x, b4.x);
                    m1b_chains3(acc, sA, sB, c4.y, h4.y, w4.y, a4.y, d4.y, b4.y);
                    m1b_chains3(acc, sA, sB, c4.z, h4.z, w4.z, a4.z, d4.z, b4.z);
                    m1b_chains3(acc, sA, sB, c4.w, h4.w, w4.w, a4.w, d4.w, b4.w);
                }
                const float uu = su[iq * M1B_G + lo];
                const float y1 = acc + uu * D[c0 + lo];
                yg[e] = y1 * mb_silu(z);
                dxz[(mc + iq) * 2 * di + di + c0 + lo] = (dg * y1) * mb_dsilu(z);
                ds[e] = (sA + sB * uu) * mb_sigmoid(sp);
                dus[e] = sB * sdl[iq * M1B_G + lo];
            }
            if (iq < nt) { /* dB[lo], dC[lo] of token iq over the group's channels */
                const float *dr = DH + iq * M1B_TOK + lo, *hr = H + hi * M1B_TOK + lo;
                const float4 *fu = (const float4 *)(sdlu + iq * M1B_G);
                const float4 *fy = (const float4 *)(sdy + iq * M1B_G);
                float b = aB[s], c = aC[s];
#pragma unroll
                for (int v = 0; v < M1B_G / 4; v++) {
                    const float4 u4 = fu[v], y4 = fy[v];
                    const float uv[4] = {u4.x, u4.y, u4.z, u4.w}, yv[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        if (4 * v + q < gn) {
                            b = fmaf(dr[(4 * v + q) * M1B_P], uv[q], b);
                            c = fmaf(yv[q], hr[(4 * v + q) * M1B_P], c);
                        }
                }
                aB[s] = b;
                aC[s] = c;
            }
            __syncthreads();
        }
        a = anext;
    }
#pragma unroll
    for (int s = 0; s < M1B_TC / M1B_SG; s++) {
        const int iq = s * M1B_SG + hi;
        if (iq >= nt) continue;
        float *o = P > 1 ? parts + ((P - 1) * M + mc + iq) * 2 * NS + lo
                         : dxdbl + (mc + iq) * XR + R + lo;
        o[0] = aB[s];
        o[NS] = aC[s];
    }
}

/* Grid (x over the window's chunks j: row b0 + j / nch, tokens [k TC, min((k + 1) TC,
 * L)), k = j % nch), M1B_CT threads, M1B_SMEM floats of dynamic shared memory. The
 * channels go by in groups of M1B_G; thread tid plays three parts, each on its own
 * slice of a group: a lane (channel tid / 16, state tid % 16: dh of the chunk from
 * its carry, reverse, into DH; then h from its carry, forward, into H and W, a
 * sub-group of tokens at a time), the chains over n of (token tid / 16 of the
 * sub-group, channel tid % 16), as reference/back1.c token_fwd and token_out: y's
 * chain, sA = sum w A, sB = sum dh B, then yg, dz (into dxz's second half), ds
 * (before dt_proj's bias and softplus) and the scan's part of du; and dB[n], dC[n] of
 * (token tid / 16, n = tid % 16), dot v1 over channels of dh[c][n] (delta u)[c] and
 * dys[c] h[c][n], continued in registers from group to group. Past 8192 channels each
 * leaf lands in parts[(leaf M + m) 32 + j] for mb_dot_fold_k; else in dxdbl. */
MB_KERNEL void MB_BOUNDS_MIN(M1B_CT, 2)
mb_m1b_chunk_k(int64_t L, int64_t di, int64_t R, int64_t b0, int64_t nb, int64_t M,
               const float *delta, const float *u, const float *xz, const float *xdbl,
               const float *spre, const float *dyg, const float *dys, const float *A_log,
               const float *D, const float *dhk, const float *hk, float *yg, float *dxz,
               float *ds, float *dus, float *dxdbl, float *parts)
{
    extern __shared__ __align__(16) float sm[]; /* M1B_SMEM floats */
    const int64_t per = di * NS, nch = (L + M1B_TC - 1) / M1B_TC;
    for (int64_t j = blockIdx.x; j < nb * nch; j += gridDim.x) {
        const int64_t t0 = j % nch * M1B_TC, mc = (b0 + j / nch) * L + t0;
        const int nt = (int)m1b_min(L - t0, M1B_TC);
        if (nt == M1B_TC)
            m1b_chunk<true>(sm, di, R, M, mc, j * per, nt, t0 + nt < L, delta, u, xz, xdbl, spre,
                            dyg, dys, A_log, D, dhk, hk, yg, dxz, ds, dus, dxdbl, parts);
        else
            m1b_chunk<false>(sm, di, R, M, mc, j * per, nt, false, delta, u, xz, xdbl, spre, dyg,
                             dys, A_log, D, dhk, hk, yg, dxz, ds, dus, dxdbl, parts);
    }
}

/* dA_log[c][n] = (the join of the P leaves) * A, A = -exp(A_log). */
MB_KERNEL void mb_m1b_alog_k(int64_t per, int64_t P, const float *leaves, const float *A_log,
                             float *gA)
{
    MB_GRID_LOOP(i, per) gA[i] = mb_dot_fold(P, leaves + i, per) * -mb_exp(A_log[i]);
}

/* du = (x_proj's + the scan's) + the D skip's. */
MB_KERNEL void mb_m1b_du_k(int64_t M, int64_t di, float *dux, const float *dus,
                           const float *dys, const float *D)
{
    MB_WALK(ix, M, di, 1) {
        const int64_t i = ix.m * di + ix.c;
        dux[i] = (dux[i] + dus[i]) + dys[i] * D[ix.c];
    }
}

#undef NS
#undef M1B_TC
#undef M1B_SCH
#undef M1B_LT
#undef M1B_G
#undef M1B_SG
#undef M1B_CT
#undef M1B_P
#undef M1B_TOK
#undef M1B_IN
#undef M1B_BUF
#undef M1B_SMEM
