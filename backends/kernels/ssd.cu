/* What the chunked scans of Mamba-2 (ssd2.cu) and Mamba-3 (ssd3.cu) share.
 *
 * Each row is seen as one extended sequence on the absolute chunk grid: the open
 * chunk's rows held in the state buffers, then the new tokens. The call gathers it
 * into "ext" arrays (row b at ext rows [eoff[b], eoff[b] + T_b)), computes every
 * chunk from there, and stores the chunk left open back into the state buffers.
 * Chunks are described on the host by MB_DESC int64 fields each (_cuda.py):
 *   b: the row; e0: ext row of the chunk's row 0; n: rows in the chunk;
 *   r0: the first row with an output (the rows before it came from the state);
 *   tok: packed token index of row r0; fold: 1 when the chunk folds into h. */
#ifndef MB_SSD_CU
#define MB_SSD_CU

#include "vendor.h"
#include "numerics.h"

#define MB_DESC 6
#define SSD_NS 128 /* state dimension (both blocks) */
#define SSD_HP 64  /* head dimension (both blocks) */

/* ext rows [eoff[b], eoff[b] + t0[b]) of width W from the state buffer rows
 * (B, Q, W). Grid (x over Q * W, y over rows). */
MB_KERNEL void mb_ssd_load_k(int64_t B, const int64_t *eoff, const int64_t *t0, int64_t Q,
                             int64_t W, const float *buf, float *ext)
{
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        MB_GRID_LOOP(i, t0[b] * W) {
            ext[eoff[b] * W + i] = buf[b * Q * W + i];
        }
    }
}

/* The open chunk back into the state buffer (B, Q, W): per row, st[4 b ..] =
 * (base, lo, hi, zero): buffer rows [lo, hi) take ext rows base + [lo, hi); with
 * zero, rows [hi, Q) become +0 (a chunk closed in this call); other rows are left
 * as they were. Grid (x over Q * W, y over rows). */
MB_KERNEL void mb_ssd_store_k(int64_t B, const int64_t *st, int64_t Q, int64_t W,
                              const float *ext, float *buf)
{
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t base = st[4 * b], lo = st[4 * b + 1], hi = st[4 * b + 2], zero = st[4 * b + 3];
        MB_GRID_LOOP(i, Q * W) {
            const int64_t j = i / W;
            if (j >= lo && j < hi)
                buf[b * Q * W + i] = ext[base * W + i];
            else if (zero && j >= hi)
                buf[b * Q * W + i] = 0.0f;
        }
    }
}

/* The state passes take four consecutive elements of h a thread (float4): a bound
 * on registers is a bound on loads in flight, and float4 loads carry four times the
 * bytes. h, S and hck are pool allocations or a device state piece, which intake
 * refuses unless 16-byte aligned (_intake.aligned). */
MB_DEV float4 ssd_fma4(float e, float4 v, float4 s)
{
    float4 r;
    r.x = fmaf(e, v.x, s.x);
    r.y = fmaf(e, v.y, s.y);
    r.z = fmaf(e, v.z, s.z);
    r.w = fmaf(e, v.w, s.w);
    return r;
}

/* The state pass, serial over each row's chunks [cbeg[b], cbeg[b + 1]): hck[c]
 * receives the state entering chunk c, and a folding chunk moves it on by
 * h = fma(E[c, h], h, S[c, h]) (E = exp(dA_cs_last), S the chunk's contraction).
 * h (B, H, HP, NS) ends as the state entering the last chunk's successor. hck may
 * be S itself, so each group of SSD_CHAIN_RUN chunks is read before any of it is
 * written, which also keeps that many loads in flight per thread instead of one. */
#define SSD_CHAIN_RUN 8
MB_KERNEL void MB_BOUNDS_MIN(256, 2) /* 68 registers; unbounded, ptxas takes 134 */
mb_ssd_chain_k(int64_t B, int64_t H, const int64_t *cbeg, const int64_t *desc, const float *E,
               const float *S, float *h, float *hck)
{
    MB_CHECK_ALIGNED16(h);
    MB_CHECK_ALIGNED16(S);
    MB_CHECK_ALIGNED16(hck);
    const float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t per = SSD_HP * SSD_NS, cs = H * per; /* cs: a chunk's stride */
    MB_GRID_LOOP(q, B * cs / 4) {
        const int64_t i = 4 * q, b = i / cs, hh = (i / per) % H, e = i % per, c1 = cbeg[b + 1];
        float4 v = *(float4 *)(h + i);
        for (int64_t c0 = cbeg[b]; c0 < c1; c0 += SSD_CHAIN_RUN) {
            float4 sv[SSD_CHAIN_RUN];
            float ev[SSD_CHAIN_RUN];
            bool fold[SSD_CHAIN_RUN];
#pragma unroll
            for (int k = 0; k < SSD_CHAIN_RUN; k++) {
                const int64_t ch = (c0 + k) * H + hh;
                fold[k] = c0 + k < c1 && desc[(c0 + k) * MB_DESC + 5] != 0;
                sv[k] = fold[k] ? *(const float4 *)(S + ch * per + e) : zero;
                ev[k] = fold[k] ? E[ch] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < SSD_CHAIN_RUN; k++) {
                if (c0 + k < c1) *(float4 *)(hck + ((c0 + k) * H + hh) * per + e) = v;
                if (fold[k]) v = ssd_fma4(ev[k], v, sv[k]); /* fold is false past c1 */
            }
        }
        *(float4 *)(h + i) = v;
    }
}

/* The backward's state pass: dh leaving each chunk (HP, NS) but a row's last,
 * serial over the row's chunks [cbeg[b], cbeg[b + 1]) in reverse: the last chunk
 * passes its own Sd back, every earlier chunk c receives it as dh[c] and passes
 * fma(E[c], dh[c], Sd[c]) on (not formed for the row's first chunk, which has no
 * predecessor). Four elements a thread and loads run ahead as in mb_ssd_chain_k,
 * and dh may be Sd itself (each element is read before it is written). */
MB_KERNEL void mb_ssd_dchain_k(int64_t B, int64_t H, const int64_t *cbeg, const float *E,
                               const float *Sd, float *dh)
{
    MB_CHECK_ALIGNED16(Sd);
    MB_CHECK_ALIGNED16(dh);
    const float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t per = SSD_HP * SSD_NS;
    MB_GRID_LOOP(q, B * H * per / 4) {
        const int64_t i = 4 * q, b = i / (H * per), hh = (i / per) % H, e = i % per;
        const int64_t c0 = cbeg[b], last = cbeg[b + 1] - 1;
        float4 v = *(const float4 *)(Sd + (last * H + hh) * per + e);
        for (int64_t ct = last - 1; ct >= c0; ct -= SSD_CHAIN_RUN) {
            float4 sv[SSD_CHAIN_RUN];
            float ev[SSD_CHAIN_RUN];
#pragma unroll
            for (int k = 0; k < SSD_CHAIN_RUN; k++) {
                const int64_t c = ct - k, ch = c * H + hh;
                sv[k] = c > c0 ? *(const float4 *)(Sd + ch * per + e) : zero;
                ev[k] = c > c0 ? E[ch] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < SSD_CHAIN_RUN; k++) {
                const int64_t c = ct - k;
                if (c >= c0) *(float4 *)(dh + (c * H + hh) * per + e) = v;
                if (c > c0) v = ssd_fma4(ev[k], v, sv[k]);
            }
        }
    }
}

/* New rows into ext: ext row eoff[b] + t0[b] + t takes packed row off[b] + t of
 * src (W floats of a row of ld). Grid (x over the row's tokens * W, y over rows). */
MB_KERNEL void mb_ssd_put_k(int64_t B, const int64_t *off, const int64_t *eoff, const int64_t *t0,
                            int64_t W, const float *src, int64_t ld, float *ext)
{
    MB_GRID_WAIT();
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
        const int64_t o = off[b], e = eoff[b] + t0[b];
        MB_GRID_LOOP(i, (off[b + 1] - o) * W) {
            const int64_t t = i / W, c = i % W;
            ext[(e + t) * W + c] = src[(o + t) * ld + c];
        }
    }
}

/* Register-tiled chunk products. A thread holds acc[RN][CN] of a product whose
 * operands are staged k-major in shared memory: its rows at a + k lda + RG g + (0..3)
 * for g < RN / 4, its columns at b + k ldb + CG g + (0..3) for g < CN / 4, so the
 * operands of a term are a few float4 reads shared by many fmas. Each output is one
 * chain: one fmaf(row operand, column operand, acc) per term, k ascending; a caller
 * continues a chain across stages by keeping acc. */
template <int RN, int RG, int CN, int CG>
MB_DEV void ssd_frag(float (&x)[RN], float (&y)[CN], const float *a, int lda, const float *b,
                     int ldb, int k)
{
#pragma unroll
    for (int g = 0; g < RN / 4; g++) {
        const float4 v = *(const float4 *)(a + k * lda + g * RG);
        x[4 * g] = v.x; x[4 * g + 1] = v.y; x[4 * g + 2] = v.z; x[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int g = 0; g < CN / 4; g++) {
        const float4 v = *(const float4 *)(b + k * ldb + g * CG);
        y[4 * g] = v.x; y[4 * g + 1] = v.y; y[4 * g + 2] = v.z; y[4 * g + 3] = v.w;
    }
}

/* One term of every output; odd rows run backwards so consecutive fmas share an
 * operand register. */
template <int RN, int CN>
MB_DEV void ssd_fma(float (&acc)[RN][CN], const float (&x)[RN], const float (&y)[CN])
{
#pragma unroll
    for (int r = 0; r < RN; r++)
#pragma unroll
        for (int qq = 0; qq < CN; qq++) {
            const int q = r & 1 ? CN - 1 - qq : qq;
            acc[r][q] = fmaf(x[r], y[q], acc[r][q]);
        }
}

/* acc continued over the terms k in [k0, k1); the operands of k + 1 are read while the
 * fmas of k run. */
template <int RN, int RG, int CN, int CG>
MB_DEV void ssd_mma(float (&acc)[RN][CN], const float *a, int lda, const float *b, int ldb,
                    int k0, int k1)
{
    if (k0 >= k1) return;
    float x[2][RN], y[2][CN];
    ssd_frag<RN, RG, CN, CG>(x[0], y[0], a, lda, b, ldb, k0);
    int k = k0;
    for (; k + 2 <= k1; k += 2) {
        ssd_frag<RN, RG, CN, CG>(x[1], y[1], a, lda, b, ldb, k + 1);
        ssd_fma(acc, x[0], y[0]);
        if (k + 2 < k1) ssd_frag<RN, RG, CN, CG>(x[0], y[0], a, lda, b, ldb, k + 2);
        ssd_fma(acc, x[1], y[1]);
    }
    if (k < k1) ssd_fma(acc, x[0], y[0]);
}

/* ssd_mma for RN consecutive rows where row r takes term k only when k < lim + r (the
 * causal masks): the terms every row takes, then the few that only some rows take. */
template <int RN, int CN, int CG>
MB_DEV void ssd_mma_tri(float (&acc)[RN][CN], const float *a, int lda, const float *b, int ldb,
                        int k0, int k1, int lim)
{
    const int kf = lim < k0 ? k0 : lim < k1 ? lim : k1;
    const int ke = lim + RN - 1 < k1 ? lim + RN - 1 : k1;
    ssd_mma<RN, 4, CN, CG>(acc, a, lda, b, ldb, k0, kf);
    for (int k = kf; k < ke; k++) {
        float x[RN], y[CN];
        ssd_frag<RN, 4, CN, CG>(x, y, a, lda, b, ldb, k);
#pragma unroll
        for (int r = 0; r < RN; r++)
            if (k < lim + r)
#pragma unroll
                for (int q = 0; q < CN; q++) acc[r][q] = fmaf(x[r], y[q], acc[r][q]);
    }
}

/* The 64 x 64 tiles of mb_m2_g_k, mb_m2_y_k and mb_m3_y_k: 512 / RN threads, thread
 * t holding rows ssd_r<RN>(t) + (0..RN-1) and columns ssd_c(t) + (0..3), + 32 + (0..3),
 * of operands staged [k][SSD_LD]. The padding keeps the float4 stores of a transposing
 * stage (8 consecutive k a quarter-warp) on distinct banks. RN = 8 (SSD_UT threads)
 * holds the most outputs a thread; RN = 4 runs twice the warps on half the registers. */
#define SSD_UT 64
#define SSD_LD 68
template <int RN = 8> MB_DEV int ssd_r(int t) { return RN * (t / 8); }
/* The identical output kernels' tiles (mb_m2_y_k, mb_m3_y_k): 4 rows a thread */
#define SSD_ORN 4
#define SSD_OUT 128

/* A column's seg walk down a tile of ni rows, split between two threads at row 32:
 * the first row of this thread's half (half 0 from first, half 1 from 32 or first),
 * its end in *end, and s carried by add(ii, s) over the rows the second half does
 * not walk itself (the first half's adds: the same chain). */
template <class Add>
MB_DEV int64_t ssd_seg_half(int half, int64_t first, int64_t ni, float &s, Add add, int64_t *end)
{
    int64_t ii = first;
    if (half)
        for (; ii < 32 && ii < ni; ii++) add(ii, s);
    *end = half || ni < 32 ? ni : 32;
    return ii;
}
MB_DEV int ssd_c(int t) { return 4 * (t % 8); }
/* column q < 8 of thread t */
MB_DEV int ssd_cq(int t, int q) { return ssd_c(t) + (q < 4 ? q : 28 + q); }

template <int RN = 8>
MB_DEV void ssd_mma64(float (&acc)[RN][8], const float (*a)[SSD_LD], const float (*b)[SSD_LD],
                      int k0, int k1)
{
    const int t = threadIdx.x;
    ssd_mma<RN, 4, 8, 32>(acc, &a[0][ssd_r<RN>(t)], SSD_LD, &b[0][ssd_c(t)], SSD_LD, k0, k1);
}

template <int RN>
MB_DEV void ssd_mma64_tri(float (&acc)[RN][8], const float (*a)[SSD_LD],
                          const float (*b)[SSD_LD], int k0, int k1, int lim)
{
    const int t = threadIdx.x;
    ssd_mma_tri<RN, 8, 32>(acc, &a[0][ssd_r<RN>(t)], SSD_LD, &b[0][ssd_c(t)], SSD_LD, k0, k1,
                           lim + ssd_r<RN>(t));
}

/* ssd_mma64 on operands staged as they lie in memory (rows k-contiguous, as cp.async
 * copies them; lda, ldb multiples of 4, 4 mod 32 at best): acc[f][r][q] continued over
 * the K terms of row a + r lda and row b[f] + 8 q ldb, four terms a float4 of each row,
 * for NB right factors b[f] sharing the left one. Thread t passes its rows
 * ssd_r<RN>(t) and column rows t % 8 (a quarter-warp reads 8 consecutive rows:
 * distinct banks), so its outputs are columns t % 8 + 8 q. */
template <int K, int LDA, int LDB, int RN, int NB, int QG = 8>
MB_DEV void ssd_mma_rows(float (&acc)[NB][RN][8], const float *a, const float *const (&b)[NB])
{
#pragma unroll
    for (int k = 0; k < K; k += 4) {
        float4 x[RN];
#pragma unroll
        for (int r = 0; r < RN; r++) x[r] = *(const float4 *)(a + r * LDA + k);
        float xs[4][RN];
#pragma unroll
        for (int r = 0; r < RN; r++) {
            xs[0][r] = x[r].x, xs[1][r] = x[r].y;
            xs[2][r] = x[r].z, xs[3][r] = x[r].w;
        }
#pragma unroll
        for (int f = 0; f < NB; f++)
#pragma unroll
            for (int q0 = 0; q0 < 8; q0 += QG) {
                float4 y[QG];
#pragma unroll
                for (int q = 0; q < QG; q++) y[q] = *(const float4 *)(b[f] + 8 * (q0 + q) * LDB + k);
                if constexpr (QG == 8) {
                    float ys[4][8];
#pragma unroll
                    for (int q = 0; q < 8; q++) {
                        ys[0][q] = y[q].x, ys[1][q] = y[q].y;
                        ys[2][q] = y[q].z, ys[3][q] = y[q].w;
                    }
#pragma unroll
                    for (int u = 0; u < 4; u++) ssd_fma(acc[f], xs[u], ys[u]);
                } else { /* fewer registers live */
#pragma unroll
                    for (int u = 0; u < 4; u++)
#pragma unroll
                        for (int r = 0; r < RN; r++)
#pragma unroll
                            for (int q = 0; q < QG; q++) {
                                const float4 w = y[q];
                                const float yu = u == 0 ? w.x : u == 1 ? w.y : u == 2 ? w.z : w.w;
                                acc[f][r][q0 + q] = fmaf(xs[u][r], yu, acc[f][r][q0 + q]);
                            }
                }
            }
    }
}
MB_DEV int ssd_cr(int t, int q) { return t % 8 + 8 * q; } /* ssd_mma_rows' column q */

/* The identical output kernels' rings: SSD_RK state columns a stage, a slot holding
 * 64 rows of each factor, SSD_RLD floats apart (4 mod 32 over 8 rows: a quarter-warp's
 * float4 reads on distinct banks). ssd_mma_stage: the thread's products of a slot. */
#define SSD_RK 16
#define SSD_RLD 20
template <int RN>
MB_DEV void ssd_mma_stage(float (&acc)[RN][8], const float (*slot)[64][SSD_RLD])
{
    const int t = threadIdx.x;
    const float *const b[1] = {&slot[1][t % 8][0]};
    ssd_mma_rows<SSD_RK, SSD_RLD, SSD_RLD, RN, 1>(*(float(*)[1][RN][8])acc,
                                                   &slot[0][ssd_r<RN>(t)][0], b);
}

/* The four floats at x (16-byte aligned) times f, in place: a copied piece readied by
 * the thread that copied it. */
MB_DEV void ssd_scale4(float *x, float f)
{
    float4 w = *(float4 *)x;
    w.x = w.x * f, w.y = w.y * f, w.z = w.z * f, w.w = w.w * f;
    *(float4 *)x = w;
}

/* exp of a seg walk's N values (mb_exp's bits): seg sums dA <= 0, so they mostly lie
 * in [MB_EXP_LO, 0], where mb_exp_core gives the same bits cheaper; one branch for
 * the group keeps its exps side by side. */
template <int N>
MB_DEV void ssd_exp_seg(const float (&s)[N], float (&e)[N])
{
    bool core = true;
#pragma unroll
    for (int k = 0; k < N; k++) core = core && s[k] >= MB_EXP_LO && s[k] <= 0.0f;
    if (core) {
#pragma unroll
        for (int k = 0; k < N; k++) e[k] = mb_exp_core(s[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) e[k] = mb_exp(s[k]);
    }
}

/* The output kernels' last pass over a 64-row tile: Y[i - i0] in shared memory holds
 * rows i0 + (0..63); those in [r0, n) (token tok0 + i - r0) are written at column
 * col.., y = Y + x * D with XD (x's row i at x + i ldx), into yb and gated, y *
 * silu(z), into yg (either may be null; z of token tok at z + tok ldz, 16-byte aligned
 * when ldz is a multiple of 4; yg may be z itself, each z read by the thread that
 * writes it). Thread t of T takes the float4 pieces t + T u, all at column 4 (t % 16);
 * their z and x are first copied by cp.async into st (SSD_OUT_ST(XD) floats, 16-byte
 * aligned, each thread reading back only its own pieces), so that no load waits
 * behind a store to yb or yg (they may alias, as far as the compiler knows). */
#define SSD_OUT_ST(XD) ((XD) ? 2 : 1) * 64 * SSD_HP
template <bool XD, int T>
MB_DEV void ssd_out_rows(const float (*Y)[SSD_LD], float *st, int64_t i0, int64_t r0,
                         int64_t n, int64_t tok0, int64_t col, const float *x, int64_t ldx,
                         float D, const float *z, int64_t ldz, float *yb, float *yg,
                         int64_t ldy)
{
    constexpr int PR = SSD_HP / 4, U = 64 * PR / T, RS = T / PR; /* pieces a row */
    const int t = threadIdx.x, p = 4 * (t % PR);
    float *sz = st + 4 * t, *sx = sz + 64 * SSD_HP; /* piece u at + 4 T u */
    const bool zvec = (ldz & 3) == 0;
#pragma unroll 4
    for (int u = 0; u < U; u++) {
        const int64_t i = i0 + t / PR + RS * u;
        if (i < r0 || i >= n) continue;
        if (XD) mb_cp_async16(sx + 4 * T * u, x + i * ldx + col + p, 16);
        if (!yg) continue;
        const float *zr = z + (tok0 + i - r0) * ldz + col + p;
        if (zvec)
            mb_cp_async16(sz + 4 * T * u, zr, 16);
        else
            for (int k = 0; k < 4; k++) mb_cp_async4(sz + 4 * T * u + k, zr + k, 4);
    }
    mb_cp_commit();
    mb_cp_wait<0>();
#pragma unroll 2
    for (int u = 0; u < U; u++) {
        const int64_t i = i0 + t / PR + RS * u;
        if (i < r0 || i >= n) continue;
        float4 y = *(const float4 *)&Y[i - i0][p];
        if (XD) {
            const float4 xv = *(const float4 *)(sx + 4 * T * u);
            y.x = y.x + xv.x * D, y.y = y.y + xv.y * D;
            y.z = y.z + xv.z * D, y.w = y.w + xv.w * D;
        }
        const int64_t o = (tok0 + i - r0) * ldy + col + p;
        if (yb) *(float4 *)(yb + o) = y;
        if (!yg) continue;
        const float4 zv = *(const float4 *)(sz + 4 * T * u);
        y.x = y.x * mb_silu(zv.x), y.y = y.y * mb_silu(zv.y);
        y.z = y.z * mb_silu(zv.z), y.w = y.w * mb_silu(zv.w);
        *(float4 *)(yg + o) = y;
    }
}

template <int RN> MB_DEV void ssd_zero(float (&acc)[RN][8])
{
#pragma unroll
    for (int r = 0; r < RN; r++)
#pragma unroll
        for (int q = 0; q < 8; q++) acc[r][q] = 0.0f;
}

/* Stages read SSD_BATCH values a thread before storing any, so that their loads are
 * in flight together rather than one global latency each. */
#define SSD_BATCH 16

/* dst[k][r] = src(r, k) for k < KN, r < 64 (a transposing stage): thread t takes k =
 * t % KN (consecutive threads read consecutive k) and KN rows from KN (t / KN), stored
 * four to a float4. */
template <int KN, class F> MB_DEV void ssd_stage_t(float (*dst)[SSD_LD], F src)
{
    const int k = threadIdx.x % KN, rb = threadIdx.x / KN * KN;
#pragma unroll 1
    for (int r0 = rb; r0 < rb + KN; r0 += SSD_BATCH) {
        float v[SSD_BATCH];
#pragma unroll
        for (int u = 0; u < SSD_BATCH; u++) v[u] = src(r0 + u, k);
#pragma unroll
        for (int u = 0; u < SSD_BATCH; u += 4) {
            float4 w;
            w.x = v[u], w.y = v[u + 1], w.z = v[u + 2], w.w = v[u + 3];
            *(float4 *)&dst[k][r0 + u] = w;
        }
    }
}

/* A thread's RN x 8 outputs parked in a 64 x 64 tile, row-major. */
template <int RN> MB_DEV void ssd_park(float (*dst)[SSD_LD], const float (&acc)[RN][8])
{
    const int t = threadIdx.x;
#pragma unroll
    for (int r = 0; r < RN; r++)
#pragma unroll
        for (int g = 0; g < 2; g++) {
            float4 w;
            w.x = acc[r][4 * g], w.y = acc[r][4 * g + 1], w.z = acc[r][4 * g + 2], w.w = acc[r][4 * g + 3];
            *(float4 *)&dst[ssd_r<RN>(t) + r][ssd_c(t) + 32 * g] = w;
        }
}

/* dst[k][c] = src(k, c) for k < nk, c < 64: thread t takes column c = t. */
template <class F> MB_DEV void ssd_stage(float (*dst)[SSD_LD], int nk, F src)
{
    const int c = threadIdx.x;
#pragma unroll 1
    for (int k0 = 0; k0 < nk; k0 += SSD_BATCH) {
        float v[SSD_BATCH];
#pragma unroll
        for (int u = 0; u < SSD_BATCH; u++) v[u] = k0 + u < nk ? src(k0 + u, c) : 0.0f;
#pragma unroll
        for (int u = 0; u < SSD_BATCH; u++)
            if (k0 + u < nk) dst[k0 + u][c] = v[u];
    }
}

#define SSD_FOLD_THREADS 256
#define SSD_IFOLD 128 /* the identical folds' blocks: two of ssd_fold's virtual threads a thread */
#define SSD_FJ 32 /* rows of a fold's shared buffers: two stages of SSD_FJ / 2 */

/* ssd_fold's A side for rows as they lie at row(j), and scaled by scale(j) */
template <class R> MB_DEV auto ssd_rows_a(R row, float (*sA)[SSD_NS])
{
    return [=](int64_t j, int s, int c, bool in) { mb_cp_async16(&sA[s][c], row(j) + c, in ? 16 : 0); };
}
template <class S> MB_DEV auto ssd_scale_a(S scale, float (*sA)[SSD_NS])
{
    return [=](int64_t j, int s, int c) { ssd_scale4(&sA[s][c], scale(j)); };
}

/* A chunk's contraction S[p][m] = sum over its rows j ascending of a(j, m) b(j, p)
 * (one fmaf each, from +0), a(j, m) the A row j that acopy and afix make in sA and
 * b(j, p) = brow(j)[p] * bscale(j), each product rounded once. Rows are copied by
 * cp.async into a ring of two stages of SSD_FJ / 2 rows in sA, sB (rows 16-byte
 * aligned): acopy(j, s, c, in) issues the copy of A's piece c .. c + 3 of row j into
 * sA[s][c] (in false: +0), afix(j, s, c) readies it once landed (ssd_rows_a, ssd_scale_a:
 * the rows as they lie, scaled); a stage's copy is in flight while the stage before it
 * is readied and multiplied, and the first one while tables() fills what the fixes
 * read (its barriers its own; the loop's first barrier publishes it). Each thread
 * readies the pieces it copied itself.
 * Virtual thread u of SSD_FOLD_THREADS owns m = 4 (u / 8) + (0..3) and p = 4 (u % 8)
 * + (0..3), + 32 + (0..3); a block of T threads runs SSD_FOLD_THREADS / T of them a
 * thread. Writes out(e, v), v = S at e = p * SSD_NS + m .. + 3 (m a multiple of 4). */
template <int T = SSD_FOLD_THREADS, class Tab, class AC, class AF, class BR, class BS, class Out>
MB_DEV void ssd_fold(int64_t n, Tab tables, AC acopy, AF afix, BR brow, BS bscale, Out out,
                     float (*sA)[SSD_NS], float (*sB)[SSD_HP])
{
    constexpr int V = SSD_FOLD_THREADS / T, FS = SSD_FJ / 2;
    constexpr int PA = SSD_NS / 4, PB = SSD_HP / 4; /* 16-byte pieces a row */
    constexpr int NA = FS * PA / T, NB = FS * PB / T;
    static_assert(NA * T == FS * PA && NB * T == FS * PB, "whole pieces a thread");
    const int t = threadIdx.x;
    /* A's piece u of this thread, row r and column c: each warp's pieces lie in one
     * half of the columns, so that a fix that differs between the halves does not
     * diverge */
    static_assert((FS * PA / 2) % T == 0, "whole warps a half");
    auto apiece = [&](int u, int &r, int &c) {
        const int e = t + T * u, w = e / (FS * PA / 2), q = e % (FS * PA / 2);
        r = q / (PA / 2);
        c = 4 * (q % (PA / 2) + PA / 2 * w);
    };
    auto copy = [&](int64_t j0, int st) { /* rows past n: +0 */
        const int nj = n - j0 < FS ? (int)(n - j0) : FS;
#pragma unroll
        for (int u = 0; u < NA; u++) {
            int r, c;
            apiece(u, r, c);
            acopy(r < nj ? j0 + r : j0, st * FS + r, c, r < nj);
        }
#pragma unroll
        for (int u = 0; u < NB; u++) {
            const int e = t + T * u, r = e / PB, c = 4 * (e % PB);
            mb_cp_async16(&sB[st * FS + r][c], brow(r < nj ? j0 + r : j0) + c, r < nj ? 16 : 0);
        }
        mb_cp_commit();
    };
    copy(0, 0);
    tables();
    float acc[V][4][8];
#pragma unroll
    for (int v = 0; v < V; v++)
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int q = 0; q < 8; q++) acc[v][r][q] = 0.0f;
    int st = 0;
    for (int64_t j0 = 0; j0 < n; j0 += FS, st ^= 1) {
        const int nj = n - j0 < FS ? (int)(n - j0) : FS;
        __syncthreads(); /* the other stage is consumed (the first time: the tables) */
        if (j0 + FS < n) {
            copy(j0 + FS, st ^ 1);
            mb_cp_wait<1>();
        } else {
            mb_cp_wait<0>();
        }
#pragma unroll
        for (int u = 0; u < NA; u++) {
            int r, c;
            apiece(u, r, c);
            if (r < nj) afix(j0 + r, st * FS + r, c);
        }
#pragma unroll
        for (int u = 0; u < NB; u++) {
            const int e = t + T * u, r = e / PB;
            if (r < nj) ssd_scale4(&sB[st * FS + r][4 * (e % PB)], bscale(j0 + r));
        }
        __syncthreads();
#pragma unroll
        for (int v = 0; v < V; v++) {
            const int u = t + v * T;
            ssd_mma<4, 4, 8, 32>(acc[v], &sA[st * FS][4 * (u / 8)], SSD_NS,
                                 &sB[st * FS][4 * (u % 8)], SSD_HP, 0, nj);
        }
    }
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int u = t + v * T, m0 = 4 * (u / 8), p0 = 4 * (u % 8);
#pragma unroll
        for (int q = 0; q < 8; q++)
            out((p0 + (q < 4 ? q : 28 + q)) * SSD_NS + m0,
                make_float4(acc[v][0][q], acc[v][1][q], acc[v][2][q], acc[v][3][q]));
    }
}

/* o[e .. e + 3] = v, or fma(ex, hi, v) elementwise where hi is given (a fold onto an
 * entering state); o and hi 16-byte aligned at e. */
MB_DEV void ssd_put4(float *o, const float *hi, float ex, int64_t e, float4 v)
{
    if (hi) {
        const float4 h = *(const float4 *)(hi + e);
        v = make_float4(fmaf(ex, h.x, v.x), fmaf(ex, h.y, v.y), fmaf(ex, h.z, v.z), fmaf(ex, h.w, v.w));
    }
    *(float4 *)(o + e) = v;
}

/* The fold kernels' out: S (or its fold onto hi) at o, and exp(cs_last) into *E where
 * E is given. */
MB_DEV auto ssd_fold_put(float *o, const float *hi, float *E)
{
    return [=](int64_t e, float4 v, float ex) {
        ssd_put4(o, hi, ex, e, v);
        if (E && e == 0) *E = ex;
    };
}

/* A prefill's sealed-chunk folds and its state pass in one kernel (the fold kernel
 * then mb_ssd_chain_k, the same operations), one block of SSD_IFOLD threads a
 * (chunk, head). Blocks take them in the order of kord (the rows' first chunks, then
 * their second ones, ...), H heads a chunk, by a ticket (sync[nc H]), so that a
 * block waits only on blocks already running. Each runs fold(c, h, out) of its
 * chunk (out(e, v, exp(cs_last)) as ssd_fold's), waits for the flag sync[(c - 1) H
 * + h] of the block that published the state entering chunk c in hck (a row's first
 * chunk: the state hs itself, which it copies to hck), and publishes fma(exp(cs_last),
 * entering, S) (a chunk without the fold flag: the entering state) as the next
 * chunk's in hck, or, after a row's last chunk, into hs. S never goes to memory.
 * Rows b0 + r, r from 0, hold chunks [cb[r], cb[r + 1]); sync: nc H + 1 words of zero
 * (its memset precedes the launch, so no MB_GRID_WAIT). */
#define SSD_FOLD_CHAIN_PARAMS                                                           \
    int64_t nc, int64_t b0, const int64_t *cb, const int64_t *kord, unsigned *sync,     \
        float *hs, float *hck
template <class Fold>
MB_DEV void ssd_fold_chain(int64_t H, const int64_t *desc, SSD_FOLD_CHAIN_PARAMS, Fold fold)
{
    __shared__ unsigned ticket;
    const int t = threadIdx.x;
    if (t == 0) ticket = atomicAdd(&sync[nc * H], 1u);
    __syncthreads();
    const int64_t c = kord[ticket / H], h = ticket % H, per = SSD_HP * SSD_NS;
    const int64_t r = desc[c * MB_DESC] - b0, first = cb[r], end = cb[r + 1];
    float *hr = hs + (r * H + h) * per, *here = hck + (c * H + h) * per;
    const float *in = c == first ? hr : here;
    float *o = c + 1 < end ? hck + ((c + 1) * H + h) * per : hr;
    /* the thread's outputs held until the entering state is in; its loads then go
     * out NL at a time ahead of their stores (a round trip to L2 for NL pieces, not
     * for each), NL as the registers allow */
    constexpr int NO = SSD_HP * SSD_NS / 4 / SSD_IFOLD, NL = 8;
    int oe[NO];
    float4 ov[NO];
    float ex = 0.0f;
    const bool folds = desc[c * MB_DESC + 5];
    int k = 0;
    if (folds)
        fold(c, h, [&](int64_t e, float4 v, float x) { oe[k] = e, ov[k++] = v, ex = x; });
#pragma unroll
    for (int i = 0; i < NO; i++)
        if (!folds) oe[i] = 4 * (t + SSD_IFOLD * i);
    if (t == 0 && c != first) {
        volatile unsigned *f = &sync[(c - 1) * H + h];
        while (*f == 0) {
        }
        __threadfence();
    }
    __syncthreads();
#pragma unroll
    for (int i0 = 0; i0 < NO; i0 += NL) {
        float4 hv[NL];
#pragma unroll
        for (int i = 0; i < NL; i++) hv[i] = mb_ld_cg4(in + oe[i0 + i]);
#pragma unroll
        for (int i = 0; i < NL; i++) {
            if (c == first) *(float4 *)(here + oe[i0 + i]) = hv[i];
            *(float4 *)(o + oe[i0 + i]) = folds ? ssd_fma4(ex, hv[i], ov[i0 + i]) : hv[i];
        }
    }
    __threadfence();
    __syncthreads();
    if (t == 0 && c + 1 < end) atomicExch(&sync[c * H + h], 1u);
}

#if defined(MB_MMA)
/* Fast mode's chunk contraction (both blocks): o[p * SSD_NS + m] = sum over rows j < n
 * of (k_j[m] fm_j) (vp_j[p] fp_j), k_j = krow(j) (SSD_NS wide) and vp_j = vp + j ldv
 * (SSD_HP wide) copied as they are by cp.async into a ring of SSDF_STAGES stages of
 * SSDF_ROWS rows. Each thread readies the 16-byte pieces it copied itself once they
 * land (the factors, +0 from n to a whole stage, and the rounding to TF32), so one
 * barrier a stage suffices. The products run on m16n8k8 TF32 tiles: warp w of eight owns p = 16 (w %
 * 4) + (0..15), the tile rows g and g + 8 being p = 2g and 2g + 1 there (one 8-byte
 * read), and m = 64 (w / 4) + (0..63), tile q's column g being m = 4g + q, or 32 + 4g +
 * q - 4 from q = 4 (two 16-byte reads a row). Pieces sit at 16-byte column c ^ 2 (j %
 * 4) of their row, which puts every read of a quarter warp on distinct banks. Every
 * thread of the block (SSD_FOLD_THREADS) calls it; tables(), which fills fm and fp,
 * runs while the first stages copy. */
#define SSDF_ROWS 16
#define SSDF_STAGES 3
MB_DEV int ssdf_sw(int j, int m) { return m ^ 8 * (j % 4); } /* the swizzled column of m */
/* v times f, each rounded to TF32 (the bits mb_mma_tf32 takes, kept as floats) */
MB_DEV float4 ssdf_ready(float4 v, float f)
{
    return make_float4(__uint_as_float(mb_tf32(v.x * f)), __uint_as_float(mb_tf32(v.y * f)),
                       __uint_as_float(mb_tf32(v.z * f)), __uint_as_float(mb_tf32(v.w * f)));
}
/* One 8-row step of the products from row k on: rows k + t4 and k + t4 + 4 of v
 * (LDV floats a row; the lane's tile rows p = pb and pb + 1, one 8-byte read) and of
 * k (SSD_NS floats a row; columns mb + 32 x + (0..3), one 16-byte read, x < NH) into
 * acc[4 x + q]: the lane's column of tile 4 x + q is m = mb + 32 x + q (mb holds its
 * 4 g). Rows sit swizzled by ssdf_sw. */
template <int NH, int LDV>
MB_DEV void ssdf_kstep(float (*acc)[4], const float (*V)[LDV], const float (*K)[SSD_NS], int k,
                       int t4, int pb, int mb)
{
    const int kl = k + t4, kh = kl + 4; /* kl % 4 == kh % 4 == t4 */
    const float2 al = *(const float2 *)&V[kl][ssdf_sw(t4, pb)];
    const float2 ah = *(const float2 *)&V[kh][ssdf_sw(t4, pb)];
#pragma unroll
    for (int x = 0; x < NH; x++) {
        const float4 bl = *(const float4 *)&K[kl][ssdf_sw(t4, mb + 32 * x)];
        const float4 bh = *(const float4 *)&K[kh][ssdf_sw(t4, mb + 32 * x)];
        const float b[2][4] = {{bl.x, bl.y, bl.z, bl.w}, {bh.x, bh.y, bh.z, bh.w}};
#pragma unroll
        for (int q = 0; q < 4; q++)
            mb_mma_tf32(acc[4 * x + q], __float_as_uint(al.x), __float_as_uint(al.y),
                        __float_as_uint(ah.x), __float_as_uint(ah.y), __float_as_uint(b[0][q]),
                        __float_as_uint(b[1][q]));
    }
}
template <class KRow, class Tables>
MB_DEV void ssd_fast_fold(int64_t n, KRow krow, const float *vp, int64_t ldv, const float *fm,
                          const float *fp, float *o, Tables tables)
{
    static_assert(2 * SSD_FOLD_THREADS == SSDF_ROWS * SSD_NS / 4, "two k pieces a thread");
    static_assert(SSD_FOLD_THREADS == SSDF_ROWS * SSD_HP / 4, "one v piece a thread");
    __shared__ __align__(16) float sk[SSDF_STAGES][SSDF_ROWS][SSD_NS];
    __shared__ __align__(16) float sv[SSDF_STAGES][SSDF_ROWS][SSD_HP];
    const int t = threadIdx.x;
    const int steps = (int)((n + SSDF_ROWS - 1) / SSDF_ROWS);
    /* thread t's pieces: k's rows t / 32 and t / 32 + 8 at column km, v's row t / 16 at vm */
    const int kr = t / 32, km = 4 * (t % 32), vr = t / 16, vm = 4 * (t % 16);
    auto issue = [&](int st) { /* rows past n are zero-filled */
        float(*K)[SSD_NS] = sk[st % SSDF_STAGES];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int r = kr + 8 * u;
            const int64_t j = (int64_t)st * SSDF_ROWS + r;
            mb_cp_async16(&K[r][ssdf_sw(r, km)], krow(j < n ? j : 0) + km, j < n ? 16 : 0);
        }
        const int64_t j = (int64_t)st * SSDF_ROWS + vr;
        mb_cp_async16(&sv[st % SSDF_STAGES][vr][ssdf_sw(vr, vm)], vp + (j < n ? j : 0) * ldv + vm,
                      j < n ? 16 : 0);
    };
    auto ready = [&](float *x, float f) { *(float4 *)x = ssdf_ready(*(const float4 *)x, f); };
    for (int st = 0; st < SSDF_STAGES - 1; st++) {
        if (st < steps) issue(st);
        mb_cp_commit();
    }
    tables();
    __syncthreads(); /* the tables are published */
    const int g = t % 32 / 4, t4 = t % 4, w = t / 32, pb = 16 * (w % 4) + 2 * g, mb = 64 * (w / 4) + 4 * g;
    float acc[8][4] = {};
    for (int st = 0; st < steps; st++) {
        mb_cp_wait<SSDF_STAGES - 2>(); /* this thread's pieces of stage st landed */
        float(*K)[SSD_NS] = sk[st % SSDF_STAGES];
        float(*V)[SSD_HP] = sv[st % SSDF_STAGES];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int r = kr + 8 * u, j = st * SSDF_ROWS + r;
            ready(&K[r][ssdf_sw(r, km)], fm[j]);
        }
        ready(&V[vr][ssdf_sw(vr, vm)], fp[st * SSDF_ROWS + vr]);
        __syncthreads(); /* stage st is ready for all; the slot refilled next is consumed */
        if (st + SSDF_STAGES - 1 < steps) issue(st + SSDF_STAGES - 1);
        mb_cp_commit();
#pragma unroll
        for (int k = 0; k < SSDF_ROWS; k += 8) ssdf_kstep<2, SSD_HP>(acc, V, K, k, t4, pb, mb);
    }
    mb_cp_wait<0>();
    /* accumulator e of tile 4 hh + q: p = pb + e / 2, m = 64 (w / 4) + 8 t4 + 4 (e % 2) +
     * 32 hh + q */
#pragma unroll
    for (int e = 0; e < 4; e++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            *(float4 *)&o[(pb + e / 2) * SSD_NS + 64 * (w / 4) + 8 * t4 + 4 * (e % 2) + 32 * hh] =
                make_float4(acc[4 * hh][e], acc[4 * hh + 1][e], acc[4 * hh + 2][e], acc[4 * hh + 3][e]);
}
#endif

#endif
