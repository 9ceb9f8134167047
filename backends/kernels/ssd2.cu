/* The Mamba-2 SSD (SPEC 6), the GPU twin of ssd_task and fold in
 * reference/block2.c, on the ext layout of ssd.cu: U (ext rows of the post-conv
 * xBC, CD wide: x | B | C) and DTR (ext rows of in_proj's dt, H wide).
 *   mb_m2_prep_k   dt = clamp(softplus(dt_raw + dt_bias)), dA = dt * A, the
 *                  serial cumsum cs, per (chunk, head).
 *   mb_m2_g_k      G = C . B^T per chunk (dot v1, k = 128), causal entries only, a
 *                  64 x 64 tile per block.
 *   mb_m2_fold_k   S = (B * exp(cs_last - cs))^T . Xd per (chunk, head); with hin,
 *                  the fold fma(exp(cs_last), hin, S) itself (the h_last report).
 *   mb_m2_fold_chain_k a prefill's folds and state pass in one (ssd_fold_chain).
 *   mb_m2_y_k      Y = Y_diag + Y_off + x * D of a chunk and head per block, and
 *                  (or) g = Y * silu(z).
 * Every sum is the C reference's serial chain, each output's own (the products in
 * ssd.cu's register tiles). Fast mode's mb_fast_m2_fold_k and mb_fast_m2_y_k compute
 * the same on the tensor cores, in any order. */
#include "ssd.cu"

#define M2Q 256

/* Block (chunk c, heads h0 .. h0 + M2_PREP_HEADS - 1), M2Q threads: thread j takes
 * row j's dt and dA of each of the block's heads (independent, so their loads are in
 * flight together), then thread k walks head k's serial cumsum in shared memory. dt,
 * dA and cs are (chunks, H, M2Q). lo and hi travel as float bit patterns. */
#define M2_PREP_HEADS 8
MB_KERNEL void MB_BOUNDS(M2Q) mb_m2_prep_k(const int64_t *desc, int64_t H, const float *DTR,
                                          const float *dt_bias, const float *A_log,
                                          int64_t lo_bits, int64_t hi_bits, float *dt, float *dA,
                                          float *cs)
{
    __shared__ float sa[M2_PREP_HEADS][M2Q + 1], sc[M2_PREP_HEADS][M2Q + 1];
    const float lo = __int_as_float((int)lo_bits), hi = __int_as_float((int)hi_bits);
    const int64_t c = blockIdx.x, h0 = (int64_t)blockIdx.y * M2_PREP_HEADS, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2];
    const int nh = H - h0 < M2_PREP_HEADS ? (int)(H - h0) : M2_PREP_HEADS, j = threadIdx.x;
    if (j < n) {
        float raw[M2_PREP_HEADS];
#pragma unroll
        for (int k = 0; k < M2_PREP_HEADS; k++) raw[k] = k < nh ? DTR[(e0 + j) * H + h0 + k] : 0.0f;
#pragma unroll
        for (int k = 0; k < M2_PREP_HEADS; k++) {
            if (k >= nh) break;
            const int64_t h = h0 + k, i = (c * H + h) * M2Q + j;
            const float A = -mb_exp(A_log[h]);
            const float t = mb_clamp(mb_softplus(raw[k] + dt_bias[h]), lo, hi);
            const float a = t * A;
            dt[i] = t;
            dA[i] = a;
            sa[k][j] = a;
        }
    }
    __syncthreads();
    if (j < nh) {
        float acc = 0.0f;
        for (int64_t r = 0; r < n; r++) {
            acc = acc + sa[j][r];
            sc[j][r] = acc;
        }
    }
    __syncthreads();
    for (int k = 0; k < nh; k++)
        if (j < n) cs[(c * H + h0 + k) * M2Q + j] = sc[k][j];
}

#define G_TILES 10 /* the lower triangle of a chunk's 4 x 4 grid of 64 x 64 tiles */

/* Block (tile, chunk c), SSD_UT threads: G[c][i][j] = dot(C_i, B_j) for r0 <= i < n,
 * j <= i, of the tile's rows and columns; C and B staged 64 of their 128 columns at
 * a time. */
MB_KERNEL void MB_BOUNDS(SSD_UT)
mb_m2_g_k(const int64_t *desc, int64_t di, int64_t CD, const float *U, float *G)
{
    __shared__ __align__(16) float Ct[64][SSD_LD], Bt[64][SSD_LD];
    const int64_t c = blockIdx.y, *d = desc + c * MB_DESC, e0 = d[1], n = d[2], r0 = d[3];
    int ti = 0, tj = blockIdx.x;
    while (tj > ti) tj -= ++ti;
    const int64_t i0 = 64 * ti, j0 = 64 * tj;
    if (i0 >= n || i0 + 64 <= r0) return;
    const float *u = U + e0 * CD + di;
    float acc[8][8];
    ssd_zero(acc);
    for (int m0 = 0; m0 < SSD_NS; m0 += 64) {
        __syncthreads(); /* the previous columns are consumed */
        ssd_stage_t<64>(Ct, [&](int r, int k) {
            return i0 + r < n ? u[(i0 + r) * CD + SSD_NS + m0 + k] : 0.0f;
        });
        ssd_stage_t<64>(Bt, [&](int r, int k) { return j0 + r < n ? u[(j0 + r) * CD + m0 + k] : 0.0f; });
        __syncthreads();
        ssd_mma64(acc, Ct, Bt, 0, 64);
    }
    const int t = threadIdx.x;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int64_t i = i0 + ssd_r(t) + r;
        if (i < r0 || i >= n) continue;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const int64_t j = j0 + ssd_cq(t, q);
            if (j <= i) G[(c * M2Q + i) * M2Q + j] = acc[r][q];
        }
    }
}

/* The fold of chunk c (desc, n > 0 rows) and head h on a block of SSD_IFOLD threads:
 * out(e, v, exp(cs_last)) of S (HP, NS) as ssd_fold's, S's terms (B_j[m] * dec_j)
 * (x_j[p] * dt_j), each product rounded once as in block2.c. */
#define M2_FOLD_IN                                                                          \
    const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *dt,  \
        const float *cs
template <class Out> MB_DEV void m2_fold_at(int64_t c, int64_t h, M2_FOLD_IN, Out out)
{
    __shared__ float dec[M2Q];
    __shared__ __align__(16) float sA[SSD_FJ][SSD_NS], sB[SSD_FJ][SSD_HP];
    const int64_t ch = c * H + h, *d = desc + c * MB_DESC, e0 = d[1], n = d[2];
    const float *csc = cs + ch * M2Q, *dtc = dt + ch * M2Q, *u = U + e0 * CD;
    float ex = 0.0f;
    ssd_fold<SSD_IFOLD>(
        n,
        [&] {
            const float last = csc[n - 1];
            ex = mb_exp(last);
            for (int64_t j = threadIdx.x; j < n; j += SSD_IFOLD) dec[j] = mb_exp(last - csc[j]);
        },
        ssd_rows_a([&](int64_t j) { return u + j * CD + di; }, sA),
        ssd_scale_a([&](int64_t j) { return dec[j]; }, sA),
        [&](int64_t j) { return u + j * CD + h * SSD_HP; }, [&](int64_t j) { return dtc[j]; },
        [&](int64_t e, float4 v) { out(e, v, ex); }, sA, sB);
}

/* Block (chunk c, head h), SSD_IFOLD threads. Without hin: chunks with the fold flag
 * write S[c, h] (HP, NS) and E[c, h] = exp(cs_last). With hin (reports, chunk c is
 * row c): out[c, h] = fma(exp(cs_last), hin[c, h], S), or hin when n = 0. */
#define M2_FOLD_PARAMS M2_FOLD_IN, const float *hin, float *out, float *E
MB_KERNEL void MB_BOUNDS_MIN(SSD_IFOLD, 4) mb_m2_fold_k(M2_FOLD_PARAMS)
{
    MB_GRID_WAIT();
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, per = SSD_HP * SSD_NS;
    if (!hin && !desc[c * MB_DESC + 5]) return;
    if (desc[c * MB_DESC + 2] == 0) {
        for (int64_t e = threadIdx.x; e < per; e += SSD_IFOLD) out[ch * per + e] = hin[ch * per + e];
        return;
    }
    m2_fold_at(c, h, desc, H, di, CD, U, dt, cs,
               ssd_fold_put(out + ch * per, hin ? hin + ch * per : nullptr, hin ? nullptr : E + ch));
}

/* A forward's full chunks' folds and its state pass in one (ssd_fold_chain) */
MB_KERNEL void MB_BOUNDS_MIN(SSD_IFOLD, 4) mb_m2_fold_chain_k(M2_FOLD_IN, SSD_FOLD_CHAIN_PARAMS)
{
    ssd_fold_chain(H, desc, nc, b0, cb, kord, sync, hs, hck, [&](int64_t c, int64_t h, auto out) {
        m2_fold_at(c, h, desc, H, di, CD, U, dt, cs, out);
    });
}

#if defined(MB_MMA)
/* mb_m2_fold_k in fast mode (a forward's chunks, without hin): ssd_fast_fold of B's
 * rows times dec_j and x's rows times dt_j. */
MB_KERNEL void MB_BOUNDS_MIN(SSD_FOLD_THREADS, 3) mb_fast_m2_fold_k(M2_FOLD_PARAMS)
{
    __shared__ float dec[M2Q], dts[M2Q];
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2];
    if (!d[5] || n == 0) return;
    const float *csc = cs + ch * M2Q, *u = U + e0 * CD;
    ssd_fast_fold(
        n, [&](int64_t j) { return u + di + j * CD; }, u + h * SSD_HP, CD, dec, dts,
        out + ch * SSD_HP * SSD_NS,
        [&] {
            const float last = csc[n - 1];
            for (int64_t j = threadIdx.x; j < M2Q; j += SSD_FOLD_THREADS) { /* rows past n: no terms */
                dec[j] = j < n ? __expf(last - csc[j]) : 0.0f;
                dts[j] = j < n ? dt[ch * M2Q + j] : 0.0f;
            }
        });
    if (threadIdx.x == 0) E[ch] = mb_exp(csc[n - 1]);
}
#endif

/* Block (head h, chunk c), SSD_OUT threads; the chunk's rows in tiles of 64, each
 * tile's outputs in registers (ssd.cu's 64 x 64 tiles of SSD_ORN rows a thread,
 * columns p):
 *   Y_diag = M . Xd, the chain over j <= i ascending, by column tiles of 64: G's tile
 *   and x's rows are copied as they lie by cp.async (each thread scales the x pieces
 *   it copied by dt: Xd), then threads t and t + 64 walk column j = j0 + t of M =
 *   G * exp(seg) down the row tile's two halves (seg[i][j] the serial sum of
 *   dA[j+1..i] from +0, carried in segc from the tile above; the second half's
 *   thread runs the first half's adds too, the same chain; rows before r0, which came
 *   from the state, only advance it) into Mt; parked in Mt;
 *   Y_off = C_i . h_prev, the chain over m, C's and h_prev's rows copied SSD_RK
 *   columns a stage into a ring of two where G and x were (ssd_mma_stage);
 *   y = (Y_diag + Y_off * exp(cs_i)) + x * D into yb (packed tokens, di wide), rows
 *   r0 <= i < n, and gated, y * silu(z), into yg (z: the first di columns of zx's
 *   token rows, NP apart); either output may be null.
 * Dynamic shared memory: M2YI_SMEM bytes (_cuda_ssd.py), which fits AMD's 64 KiB. */
#define M2_Y_PARAMS                                                                         \
    const int64_t *desc, int64_t H, int64_t di, int64_t CD, const float *U, const float *G,     \
        const float *dt, const float *dA, const float *cs, const float *hck, const float *D,   \
        const float *zx, int64_t NP, float *yb, float *yg
MB_KERNEL void MB_BOUNDS_MIN(SSD_OUT, 4) mb_m2_y_k(M2_Y_PARAMS)
{
    constexpr int T = SSD_OUT, RN = SSD_ORN;
    static_assert(RN * T == 8 * 64, "the threads' rows cover the tile");
    extern __shared__ __align__(16) float sm[];
    float(*Gr)[64] = (float(*)[64])sm;        /* G's tile [i][j] */
    float(*Xs)[SSD_LD] = (float(*)[SSD_LD])(sm + 64 * 64); /* x * dt [j][p] */
    float(*ring)[2][64][SSD_RLD] = (float(*)[2][64][SSD_RLD])sm; /* [slot][C, h_prev] */
    float(*Mt)[SSD_LD] = Xs + 64; /* M^T, then Y */
    float *dAs = &Mt[64][0], *dts = dAs + M2Q, *segc = dts + M2Q;
    static_assert(2 * 2 * 64 * SSD_RLD <= 64 * (64 + SSD_LD), "the ring fits where G and x were");
    static_assert(SSD_OUT_ST(true) <= 64 * (64 + SSD_LD), "so does the output pass's x and z");
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], ch = c * H + h;
    const float *g = G + c * M2Q * M2Q, *u = U + e0 * CD;
    const float *hp = hck + ch * SSD_HP * SSD_NS;
    const int t = threadIdx.x, tj = t % 64, half = t / 64;
    for (int64_t i = t; i < n; i += T) {
        dAs[i] = dA[ch * M2Q + i];
        dts[i] = dt[ch * M2Q + i];
    }
    for (int64_t i0 = 0; i0 < n; i0 += 64) {
        const bool out = n > r0 && i0 + 64 > r0; /* the tile has outputs */
        const int64_t ni = n - i0 < 64 ? n - i0 : 64;
        float acc[RN][8];
        ssd_zero(acc);
        for (int64_t j0 = 0; j0 <= i0; j0 += 64) {
            const int nj = n - j0 < 64 ? (int)(n - j0) : 64;
            __syncthreads(); /* the previous operands are consumed (dAs is written) */
            /* thread t copies rows t / 16 + 8 u at column 4 (t % 16) of each (rows past
             * n: +0) */
            const int cc = 4 * (t % 16);
#pragma unroll
            for (int uu = 0; uu < 64 * 16 / T; uu++) {
                const int r = t / 16 + T / 16 * uu;
                const bool gi = r < ni, xi = out && r < nj;
                mb_cp_async16(&Gr[r][cc], g + (i0 + (gi ? r : 0)) * M2Q + j0 + cc, gi ? 16 : 0);
                if (out)
                    mb_cp_async16(&Xs[r][cc], u + (j0 + (xi ? r : 0)) * CD + h * SSD_HP + cc,
                                  xi ? 16 : 0);
            }
            mb_cp_commit();
            mb_cp_wait<0>();
            if (out) {
#pragma unroll
                for (int uu = 0; uu < 64 * 16 / T; uu++) {
                    const int r = t / 16 + T / 16 * uu;
                    if (r < nj) ssd_scale4(&Xs[r][cc], dts[j0 + r]);
                }
            }
            __syncthreads(); /* G and Xd are in */
            const int64_t j = j0 + tj;
            float s = 0.0f; /* the column's seg at the tile's end (second half) */
            if (tj < nj) {
                /* column j's rows i0 + ii of this thread's half, eight at a time: the
                 * chain of adds first, then the eight exps, which overlap; stored four
                 * rows to a float4 (rows before j, past n or before r0 are never read) */
                s = j0 < i0 ? segc[j] : 0.0f;
                int64_t end;
                auto add = [&](int64_t ii, float &a) {
                    if (i0 + ii > j) a = a + dAs[i0 + ii];
                };
                for (int64_t ii0 = ssd_seg_half(half, j0 < i0 ? 0 : tj & ~7, ni, s, add, &end);
                     ii0 < end; ii0 += 8) {
                    float sv[8];
                    bool in[8];
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        const int64_t i = i0 + ii0 + k;
                        if (i > j && i < n) s = s + dAs[i];
                        sv[k] = s;
                        in[k] = i >= j && i < n && i >= r0;
                    }
                    float ev[8];
                    ssd_exp_seg(sv, ev);
#pragma unroll
                    for (int g = 0; g < 2; g++) {
                        float mv[4];
#pragma unroll
                        for (int k = 0; k < 4; k++)
                            mv[k] = in[4 * g + k] ? Gr[ii0 + 4 * g + k][tj] * ev[4 * g + k] : 0.0f;
                        float4 v;
                        v.x = mv[0], v.y = mv[1], v.z = mv[2], v.w = mv[3];
                        *(float4 *)&Mt[tj][ii0 + 4 * g] = v;
                    }
                }
            }
            __syncthreads(); /* Mt is in; both halves have read segc[j] */
            if (half && tj < nj) segc[j] = s;
            if (out) {
                if (j0 < i0)
                    ssd_mma64<RN>(acc, Mt, Xs, 0, nj);
                else
                    ssd_mma64_tri<RN>(acc, Mt, Xs, 0, nj, 1);
            }
        }
        if (!out) continue;
        __syncthreads(); /* M, G and Xd are consumed */
        ssd_park<RN>(Mt, acc);
        ssd_zero(acc);
        /* stage st: columns SSD_RK st.. of C's rows i0.. and of h_prev's rows p; thread
         * t copies rows t / 4 + 32 v at column 4 (t % 4) */
        auto issue = [&](int st) {
            const int m0 = st * SSD_RK, c4 = 4 * (t % 4);
#pragma unroll
            for (int v = 0; v < 64 * 4 / T; v++) {
                const int r = t / 4 + T / 4 * v;
                const bool in = r < ni;
                mb_cp_async16(&ring[st % 2][0][r][c4],
                              u + (i0 + (in ? r : 0)) * CD + di + SSD_NS + m0 + c4, in ? 16 : 0);
                mb_cp_async16(&ring[st % 2][1][r][c4], hp + r * SSD_NS + m0 + c4, 16);
            }
        };
        issue(0);
        mb_cp_commit();
        for (int st = 0; st < SSD_NS / SSD_RK; st++) {
            mb_cp_wait<0>();
            __syncthreads(); /* stage st landed for all; the other slot is consumed */
            if (st + 1 < SSD_NS / SSD_RK) issue(st + 1);
            mb_cp_commit();
            ssd_mma_stage<RN>(acc, ring[st % 2]);
        }
        /* Y_diag + Y_off * exp(cs_i) in place of the parked Y_diag (seen by all since
         * the stages' barriers), then the rows a float4 a thread at a time (coalesced
         * x, z and stores), + x * D and the gate */
#pragma unroll
        for (int r = 0; r < RN; r++) {
            const float e = mb_exp(cs[ch * M2Q + i0 + ssd_r<RN>(t) + r]);
#pragma unroll
            for (int q = 0; q < 8; q++) {
                float *y = &Mt[ssd_r<RN>(t) + r][ssd_cr(t, q)];
                *y = *y + acc[r][q] * e;
            }
        }
        __syncthreads();
        ssd_out_rows<true, T>(Mt, sm, i0, r0, n, d[4], h * SSD_HP, u, CD, D[h], zx, NP, yb, yg,
                              di);
    }
}

#if defined(MB_MMA)
/* mb_m2_y_k in fast mode. Block (head h, chunk c, row tile z of 64 rows), M2Y_THREADS
 * threads; warp w owns rows 16 (w % 4) + (0..15) and columns p = 32 (w / 4) + (0..31)
 * of the tile, as m16n8k8 TF32 products over K slices of 32 terms copied as they are
 * by cp.async into a ring of two stages (each a row-operand tile [64][M2Y_LD] and a
 * column operand, [64][M2Y_LD] or [32][M2Y_LDX]):
 *   4 slices of Y_off = C_i . h_prev (m = 32 s..+31), then the rows scaled by exp(cs_i);
 *   Y_diag over j <= i: G_ij exp(cs_i - cs_j) and x_j dt_j formed as the fragments
 *   are loaded (zero where j > i, i < r0 or either lies past n);
 * then y = Y + x D, gated, into yb and yg as mb_m2_y_k writes them. */
#define M2Y_THREADS 256
#define M2Y_LD 36  /* 4 mod 32: a fragment's 32 lanes on distinct banks */
#define M2Y_LDX 68
MB_KERNEL void MB_BOUNDS(M2Y_THREADS) mb_fast_m2_y_k(M2_Y_PARAMS)
{
    __shared__ __align__(16) float sr[2][64][M2Y_LD], sc[2][64 * M2Y_LD];
    __shared__ float css[M2Q], dts[M2Q];
    const int64_t h = blockIdx.x, c = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], n = d[2], r0 = d[3], ch = c * H + h, i0 = 64 * (int64_t)blockIdx.z;
    if (i0 >= n || i0 + 64 <= r0) return; /* no outputs in this tile */
    const float *g = G + c * M2Q * M2Q, *u = U + e0 * CD, *hp = hck + ch * SSD_HP * SSD_NS;
    const int t = threadIdx.x, lane = t % 32, w = t / 32, gq = lane / 4, t4 = lane % 4;
    for (int64_t i = t; i < M2Q; i += M2Y_THREADS) {
        css[i] = i < n ? cs[ch * M2Q + i] : 0.0f;
        dts[i] = i < n ? dt[ch * M2Q + i] : 0.0f;
    }
    const int64_t jend = n < i0 + 64 ? n : i0 + 64; /* columns j < jend */
    const int steps = 4 + (int)((jend + 31) / 32);
    auto issue = [&](int st) {
        float(*R)[M2Y_LD] = sr[st % 2];
        float *Cl = sc[st % 2];
        for (int e = t; e < 64 * 8; e += M2Y_THREADS) { /* 64 rows of 8 16-byte pieces */
            const int r = e / 8, q = 4 * (e % 8);
            const int64_t i = i0 + r;
            if (st < 4) { /* C rows i0.., h rows p, columns m = 32 st + q */
                const int m = 32 * st + q;
                mb_cp_async16(&R[r][q], u + (i < n ? i : 0) * CD + di + SSD_NS + m, i < n ? 16 : 0);
                mb_cp_async16(&Cl[r * M2Y_LD + q], hp + r * SSD_NS + m, 16);
            } else { /* G rows i0.., columns j0 + q; x rows j0 + r / 2 */
                const int64_t j0 = 32 * (int64_t)(st - 4);
                mb_cp_async16(&R[r][q], g + (i < n ? i : 0) * M2Q + j0 + q, i < n ? 16 : 0);
                const int64_t j = j0 + e / 16;
                const int qx = 4 * (e % 16);
                mb_cp_async16(&Cl[(e / 16) * M2Y_LDX + qx], u + (j < n ? j : 0) * CD + h * SSD_HP + qx,
                              j < n ? 16 : 0);
            }
        }
    };
    issue(0);
    mb_cp_commit();
    const int ra = 16 * (w % 4) + gq, pb = 32 * (w / 4) + gq; /* fragment row, column */
    const int64_t ia = i0 + ra, ib = ia + 8;
    const bool oa = ia >= r0 && ia < n, ob = ib >= r0 && ib < n; /* rows with outputs */
    float ca = 0.0f, cb = 0.0f; /* cs of the rows, once css is seen (css, dts: +0 past n) */
    float acc[4][4] = {};
    for (int st = 0; st < steps; st++) {
        mb_cp_wait<0>();
        __syncthreads(); /* stage st landed for all; the other slot is consumed */
        if (st + 1 < steps) issue(st + 1);
        mb_cp_commit();
        const float(*R)[M2Y_LD] = sr[st % 2];
        const float *Cl = sc[st % 2];
        if (st == 4) { /* Y_off is complete: scale its rows */
            ca = css[ia], cb = css[ib];
            const float ea = __expf(ca), eb = __expf(cb);
#pragma unroll
            for (int q = 0; q < 4; q++) acc[q][0] *= ea, acc[q][1] *= ea, acc[q][2] *= eb, acc[q][3] *= eb;
        }
        const int64_t j0 = 32 * (int64_t)(st - 4);
#pragma unroll
        for (int k = 0; k < 32; k += 8) {
            const int kl = k + t4, kh = kl + 4;
            float a[4] = {R[ra][kl], R[ra + 8][kl], R[ra][kh], R[ra + 8][kh]};
            float b[2][4];
            if (st < 4) {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    b[0][q] = Cl[(pb + 8 * q) * M2Y_LD + kl], b[1][q] = Cl[(pb + 8 * q) * M2Y_LD + kh];
            } else {
                const int64_t jl = j0 + kl, jh = j0 + kh;
                const bool ok[4] = {oa && jl <= ia, ob && jl <= ib, oa && jh <= ia, ob && jh <= ib};
                const float ci[4] = {ca - css[jl], cb - css[jl], ca - css[jh], cb - css[jh]};
#pragma unroll
                for (int e = 0; e < 4; e++) a[e] = ok[e] ? a[e] * __expf(ci[e]) : 0.0f;
                const float xl = dts[jl], xh = dts[jh];
#pragma unroll
                for (int q = 0; q < 4; q++)
                    b[0][q] = Cl[kl * M2Y_LDX + pb + 8 * q] * xl, b[1][q] = Cl[kh * M2Y_LDX + pb + 8 * q] * xh;
            }
            const uint32_t a0 = mb_tf32(a[0]), a1 = mb_tf32(a[1]), a2 = mb_tf32(a[2]), a3 = mb_tf32(a[3]);
#pragma unroll
            for (int q = 0; q < 4; q++) mb_mma_tf32(acc[q], a0, a1, a2, a3, mb_tf32(b[0][q]), mb_tf32(b[1][q]));
        }
    }
    /* accumulator e of tile q: row ra + 8 (e / 2), column pb - gq + 8 q + 2 t4 + e % 2 */
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
        const int64_t i = e ? ib : ia;
        if (!(e ? ob : oa)) continue;
        const int64_t tok = d[4] + i - r0;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int p = pb - gq + 8 * q + 2 * t4;
            const float *xr = u + i * CD + h * SSD_HP + p;
            float y0 = acc[q][e] + xr[0] * D[h], y1 = acc[q][e + 1] + xr[1] * D[h];
            if (yb) yb[tok * di + h * SSD_HP + p] = y0, yb[tok * di + h * SSD_HP + p + 1] = y1;
            if (yg) {
                const float *zr = zx + tok * NP + h * SSD_HP + p;
                yg[tok * di + h * SSD_HP + p] = y0 * mb_silu(zr[0]);
                yg[tok * di + h * SSD_HP + p + 1] = y1 * mb_silu(zr[1]);
            }
        }
    }
}
#endif

#undef M2Q
#undef G_TILES
