/* The Mamba-3 SISO backward (docs/numerics.md "Backward (Mamba-3)"), the GPU twin of
 * chunk_bwd and head_bwd in reference/back3.c, on the forward's chunk layout (ssd.cu
 * descriptors of a zero-state prefill without lengths: t0 = 0, so ext rows are the
 * packed tokens). The forward's own kernels (ssd3.cu) recompute q, k, v, dt, sig,
 * A*dt, the angles (mb_m3_angles_k), the chunk states hck (HP, NS per chunk and
 * head), E = exp(cs_last) and the gated output; mb_m3b_chunk_k recomputes the
 * output before the gate from the same pieces.
 *
 * The C reference walks each (row, head) over its chunks in reverse because of dh,
 * the gradient of the state leaving a chunk. dh entering chunk k is
 * fma(exp(cs_last_k), dh leaving it, Sd_k) with Sd_k = sum_i q_rot_i dye_i^T, a
 * function of the chunk alone, so every chunk's own part runs in parallel and only
 * that fma chain is serial. Each value is produced by the C reference's own
 * sequence of operations:
 *   mb_m3b_rotate_k  the forward's rotation at the parked angles, keeping them.
 *   mb_m3b_sd_k      Sd_k per (chunk, head); dy = dg * silu(z) throughout.
 *                    (mb_fast_m3b_sd_k: fast mode's, on the tensor cores)
 *   (ssd.cu's mb_ssd_dchain_k: dh leaving each chunk, serial over a row's chunks.)
 *   mb_m3b_f0_k      per folding chunk: the one chain of dot(dh^T, h^T).
 *   mb_m3b_chunk_k   per (chunk, head): the gradients of z, v, q_rot, k_rot * scale,
 *                    qk_gamma, the scales and A*dt; each token's angle terms
 *                    (mb_fast_m3b_chunk_k: fast mode's, on the tensor cores).
 *   mb_m3b_theta_k   the angle gradient, their sum over each row's tokens in reverse.
 *   mb_m3b_token_k   per (token, head): dt, trap and dd_A's gradients.
 *   mb_m3b_unrot_k   per (token, head, pair): unrotated q and k gradients, the
 *                    per-head angle term.
 *   mb_m3b_heads_k   per token: q, k and angle gradients summed over the heads.
 * Per-token arrays are (M, H, ...) with M the packed tokens.
 *
 * The chunk products run as 64 x 64 tiles: thread (ti, tj) of 16 x 16 owns rows
 * 4 ti..+3 and columns 4 tj..+3, each output one fmaf chain over k in the
 * reference's direction, terms the reference does not have skipped; the operands
 * are staged 16 k at a time as (k, 64) tiles, the next step's loads in flight
 * during the current step's products. Fast mode's twins run the same source with
 * the products on the TF32 tensor cores (b3_tc). */
#include "ssd3.cu" /* and grad.cu (mb_dsilu), included before this file */

#define B3_THREADS 256
#define B3_PER (SSD_NS * SSD_HP)
/* Strictly lower triangles (j < i) of (M3Q, M3Q) tiles, packed row by row. */
#define B3_NTRI (M3Q * (M3Q - 1) / 2)
#define B3_TRI(i, j) ((i) * ((i) - 1) / 2 + (j))
#define B3_K 16                  /* k values per staged step */
#define B3_LD (M3Q + 4)          /* a staged row: 64 values, 16-byte aligned */
#define B3_TILE (B3_K * B3_LD)
#define B3_RS (M3Q + 1)          /* row stride of the (M3Q, 64) arrays kept whole */
/* mb_m3b_chunk_k's dynamic shared memory, in floats: eight row vectors, one (M3Q, 64)
 * array, three triangles and three staged tiles (_cuda_back3.py CHUNK_SMEM; under
 * AMD's 64 KiB) */
#define B3_SMEM (8 * M3Q + M3Q * B3_RS + 3 * B3_NTRI + 3 * B3_TILE)
#define B3_AHEAD 16 /* tokens whose loads run ahead of mb_m3b_theta_k's chain */
#define B3_F0W 4    /* mb_m3b_f0_k's chains (warps) per block */
#define B3_F0M 8    /* rows of dh^T it stages per step */

#if M3Q != 64 || SSD_HP != 64 || SSD_NS % B3_K != 0 || M3A != 32
#error "the chunk tiles assume 64-row chunks, 64-wide heads, NS a multiple of B3_K, 32 angles"
#endif

/* Ext row i of a chunk starting at e0, head h: the index of its per-head values. */
#define B3_EH(i) ((e0 + (i)) * H + h)

/* One thread per (token, head, angle), after mb_m3_angles_k parked each token's angle
 * in q's slot r: the forward's rotation (m3_rotate_token), keeping the angle in ANG
 * (M, H, M3A) for mb_m3b_unrot_k; a block's rows (whole, blockDim a multiple of M3A)
 * read all their angles before the pairs overwrite them, as in mb_m3_rotate_k. */
MB_KERNEL void mb_m3b_rotate_k(int64_t M, int64_t H, const float *Bn, const float *Cn,
                               const float *B_bias, const float *C_bias, float *Q, float *K,
                               float *ANG)
{
    const int64_t n = M * H * M3A;
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x; i0 < n;
         i0 += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = i0 + threadIdx.x, e = i / M3A, r = i % M3A;
        const float th = i < n ? Q[e * SSD_NS + r] : 0.0f;
        __syncthreads();
        if (i < n) {
            ANG[i] = th;
            m3_rotate_token(m3_turn_of(th), e % H, e / H, r, Bn, Cn, B_bias, C_bias,
                            Q + e * SSD_NS, K + e * SSD_NS);
        }
    }
}

/* A staged operand: element (x, kk) of step s, x in [0, M3Q) along the product's rows
 * or columns, kk in [0, B3_K) along k. KC: the source runs along kk, so consecutive
 * threads take consecutive kk (coalesced loads); else consecutive x. */
template <bool KC, class F> struct b3_src {
    F f;
};
template <bool KC, class F> MB_DEV b3_src<KC, F> b3_in(F f) { return b3_src<KC, F>{f}; }
struct b3_none {};

/* The (x, kk) of this thread's u-th element of a tile. */
template <bool KC> MB_DEV void b3_xk(int u, int &x, int &kk)
{
    const int e = threadIdx.x + u * B3_THREADS;
    x = KC ? e / B3_K : e % M3Q;
    kk = KC ? e % B3_K : e / M3Q;
}
template <bool KC, class F> MB_DEV void b3_fetch(const b3_src<KC, F> &src, int s, float (&r)[4])
{
#pragma unroll
    for (int u = 0; u < 4; u++) {
        int x, kk;
        b3_xk<KC>(u, x, kk);
        r[u] = src.f(s, x, kk);
    }
}
template <bool KC, class F> MB_DEV void b3_put(const b3_src<KC, F> &, float *t, const float (&r)[4])
{
#pragma unroll
    for (int u = 0; u < 4; u++) {
        int x, kk;
        b3_xk<KC>(u, x, kk);
        t[kk * B3_LD + x] = r[u];
    }
}
MB_DEV void b3_fetch(const b3_none &, int, float (&)[4]) {}
MB_DEV void b3_put(const b3_none &, float *, const float (&)[4]) {}

/* Steps s = 0 .. ns - 1 (ns the same in every thread): the tiles of operands a, b, c
 * at T, T + B3_TILE, T + 2 B3_TILE, then body(s) on them. Step s + 1's loads are
 * issued before body(s) runs; the tiles are rewritten once every thread is done with
 * the previous step. */
template <class A, class B, class C, class Body>
MB_DEV void b3_steps(int ns, float *T, const A &a, const B &b, const C &c, Body body)
{
    float ra[4], rb[4], rc[4];
    if (ns > 0) {
        b3_fetch(a, 0, ra);
        b3_fetch(b, 0, rb);
        b3_fetch(c, 0, rc);
    }
    for (int s = 0; s < ns; s++) {
        __syncthreads();
        b3_put(a, T, ra);
        b3_put(b, T + B3_TILE, rb);
        b3_put(c, T + 2 * B3_TILE, rc);
        __syncthreads();
        if (s + 1 < ns) {
            b3_fetch(a, s + 1, ra);
            b3_fetch(b, s + 1, rb);
            b3_fetch(c, s + 1, rc);
        }
        body(s);
    }
}

/* acc[r][q] = fmaf(A[kk][4 ti + r], B[kk][4 tj + q], acc[r][q]) over a staged step's kk,
 * ascending (descending with DESC), where keep(kk, r). */
template <bool DESC, class Keep>
MB_DEV void b3_mma(float (&acc)[4][4], const float *A, const float *B, Keep keep)
{
    const int ti = threadIdx.x / 16, tj = threadIdx.x % 16;
#pragma unroll
    for (int t = 0; t < B3_K; t++) {
        const int kk = DESC ? B3_K - 1 - t : t;
        const float4 a4 = *reinterpret_cast<const float4 *>(A + kk * B3_LD + 4 * ti);
        const float4 b4 = *reinterpret_cast<const float4 *>(B + kk * B3_LD + 4 * tj);
        const float a[4] = {a4.x, a4.y, a4.z, a4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
        for (int r = 0; r < 4; r++)
            if (keep(kk, r))
#pragma unroll
                for (int q = 0; q < 4; q++) acc[r][q] = fmaf(a[r], b[q], acc[r][q]);
    }
}

struct b3_every {
    __device__ bool operator()(int, int) const { return true; }
};

/* Fast mode's tiles (TC): warp w owns rows 16 (w / 2)..+15 and columns 32 (w % 2)..+31
 * as four m16n8k8 TF32 products, acc[r] the accumulators of columns 8 r..+7
 * (vendor.h's layout). A staged step's 16 terms are two products: term t (t + 4) of
 * product u is k = 2 t + u (+ 8), which puts the eight rows of a fragment's lanes on
 * distinct banks (B3_LD = 4 mod 32). The identical schedule: thread (ti, tj) owns
 * rows 4 ti..+3 and columns 4 tj..+3. */
template <bool TC> MB_DEV int b3_row(int r, int q)
{
    return TC ? 16 * (threadIdx.x / 64) + threadIdx.x % 32 / 4 + 8 * (q / 2)
              : 4 * (threadIdx.x / 16) + r;
}
template <bool TC> MB_DEV int b3_col(int r, int q)
{
    return TC ? 32 * (threadIdx.x / 32 % 2) + 8 * r + 2 * (threadIdx.x % 4) + q % 2
              : 4 * (threadIdx.x % 16) + q;
}

/* Declared for every vendor; only fast mode's kernel, built where MB_MMA is, calls it. */
MB_DEV void b3_tc(float (&acc)[4][4], const float *A, const float *B);
#if defined(MB_MMA)
MB_DEV void b3_tc(float (&acc)[4][4], const float *A, const float *B)
{
    const int g = threadIdx.x % 32 / 4;
    const float *a = A + 16 * (threadIdx.x / 64) + g, *b = B + 32 * (threadIdx.x / 32 % 2) + g;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int lo = (2 * (threadIdx.x % 4) + u) * B3_LD, hi = lo + 8 * B3_LD;
        const uint32_t a0 = mb_tf32(a[lo]), a1 = mb_tf32(a[lo + 8]);
        const uint32_t a2 = mb_tf32(a[hi]), a3 = mb_tf32(a[hi + 8]);
#pragma unroll
        for (int r = 0; r < 4; r++)
            mb_mma_tf32(acc[r], a0, a1, a2, a3, mb_tf32(b[lo + 8 * r]), mb_tf32(b[hi + 8 * r]));
    }
}
#endif

/* A full product's step (every k a term). */
template <bool TC> MB_DEV void b3_full(float (&acc)[4][4], const float *A, const float *B)
{
    if constexpr (TC)
        b3_tc(acc, A, B);
    else
        b3_mma<false>(acc, A, B, b3_every());
}

/* Step k0 of a chain over k < i, ascending (row i). The staged operands are zero
 * where a term is absent, so the tensor cores take whole steps, skipping those of no
 * term for the warp's rows. */
template <bool TC> MB_DEV void b3_below(float (&acc)[4][4], const float *T, int k0)
{
    const int i0 = TC ? 16 * (threadIdx.x / 64) : 4 * (threadIdx.x / 16);
    if constexpr (TC) {
        if (k0 < i0 + 15) b3_tc(acc, T, T + B3_TILE);
    } else if (k0 + B3_K <= i0) {
        b3_full<false>(acc, T, T + B3_TILE);
    } else if (k0 < i0 + 3) {
        b3_mma<false>(acc, T, T + B3_TILE, [&](int kk, int r) { return k0 + kk < i0 + r; });
    }
}

/* Step k0 of a chain over j < k < n, descending (row j). */
template <bool TC> MB_DEV void b3_above(float (&acc)[4][4], const float *T, int k0, int n)
{
    const int j0 = TC ? 16 * (threadIdx.x / 64) : 4 * (threadIdx.x / 16);
    if constexpr (TC) {
        if (k0 + B3_K - 1 > j0) b3_tc(acc, T, T + B3_TILE);
    } else if (k0 > j0 + 3 && k0 + B3_K <= n) {
        b3_mma<true>(acc, T, T + B3_TILE, b3_every());
    } else if (k0 + B3_K - 1 > j0) {
        b3_mma<true>(acc, T, T + B3_TILE,
                     [&](int kk, int r) { return k0 + kk > j0 + r && k0 + kk < n; });
    }
}

/* f(r, q, i, j) for each accumulator (r, q) of a tile, at row i and column j of the
 * chunk: the epilogues below, in either schedule. */
template <bool TC, class F> MB_DEV void b3_each(F f)
{
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int q = 0; q < 4; q++) f(r, q, b3_row<TC>(r, q), b3_col<TC>(r, q));
}

/* cs of a chunk's n rows: the serial cumsum of adt from +0 (thread 0), then a barrier. */
MB_DEV void b3_cumsum(const float *adt, int n, float *cs)
{
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++) {
            acc = acc + adt[i];
            cs[i] = acc;
        }
    }
    __syncthreads();
}

/* dy = dg * silu(z) of row i (packed token tok + i), column p of head h. */
#define B3_DY(i, p)                                                                   \
    (dyg[(tok + (i)) * di + h * SSD_HP + (p)] * mb_silu(zx[(tok + (i)) * dip + h * SSD_HP + (p)]))

/* Block (chunk c, head h): Sd[c, h][m][p] = sum over the chunk's rows i ascending of
 * q_rot_i[m] * (dy_i[p] * exp(cs_i)), as two (64, 64) halves of m (TC: on the tensor
 * cores). */
#define B3_SD_PARAMS                                                                   \
    const int64_t *desc, int64_t H, int64_t di, int64_t dip, const float *Q, const float *ADT, \
        const float *zx, const float *dyg, float *Sd
template <bool TC> MB_DEV void b3_sd(B3_SD_PARAMS)
{
    __shared__ __align__(16) float T[2 * B3_TILE];
    __shared__ float ev[M3Q], DYE[M3Q * B3_RS];
    const int64_t c = blockIdx.x, h = blockIdx.y, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], tok = d[4];
    const int n = (int)d[2], tid = threadIdx.x;
    if (tid < n) ev[tid] = ADT[B3_EH(tid)];
    __syncthreads();
    b3_cumsum(ev, n, ev);
    if (tid < n) ev[tid] = mb_exp(ev[tid]);
    __syncthreads();
    for (int x = tid; x < n * SSD_HP; x += B3_THREADS) {
        const int i = x / SSD_HP, p = x % SSD_HP;
        DYE[i * B3_RS + p] = B3_DY(i, p) * ev[i];
    }
    __syncthreads();
    const int ni = (n + B3_K - 1) / B3_K;
    for (int m0 = 0; m0 < SSD_NS; m0 += M3Q) {
        float acc[4][4] = {};
        b3_steps(ni, T, b3_in<false>([&](int s, int x, int kk) {
                     const int i = B3_K * s + kk;
                     return i < n ? Q[B3_EH(i) * SSD_NS + m0 + x] : 0.0f;
                 }),
                 b3_in<false>([&](int s, int x, int kk) {
                     const int i = B3_K * s + kk;
                     return i < n ? DYE[i * B3_RS + x] : 0.0f;
                 }),
                 b3_none(), [&](int s) {
                     const int k0 = B3_K * s;
                     if (TC || k0 + B3_K <= n)
                         b3_full<TC>(acc, T, T + B3_TILE);
                     else
                         b3_mma<false>(acc, T, T + B3_TILE,
                                       [&](int kk, int) { return k0 + kk < n; });
                 });
        float *o = Sd + (c * H + h) * B3_PER;
        b3_each<TC>([&](int r, int q, int m, int p) { o[(m0 + m) * SSD_HP + p] = acc[r][q]; });
    }
}

MB_KERNEL_PAIR(MB_BOUNDS(B3_THREADS), m3b_sd_k, B3_SD_PARAMS, b3_sd, desc, H, di, dip, Q, ADT, zx,
               dyg, Sd)

/* Warp w of a block: chunk-head ch = blockIdx.x * B3_F0W + w (of NCH), if it folds:
 * F0c[ch] = the one chain over (m, p) row-major of dh^T[m][p] * h^T[m][p] (dh leaving
 * the chunk, h entering it). Rows m0 .. m0 + B3_F0M - 1 of both are staged per step,
 * the next step's loads in flight while every lane runs the chain (lane 0 stores it). */
MB_KERNEL void MB_BOUNDS(32 * B3_F0W)
mb_m3b_f0_k(int64_t NCH, const int64_t *desc, int64_t H, const float *hck, const float *dhL,
            float *F0c)
{
    __shared__ __align__(16) float sl[B3_F0W][B3_F0M][B3_LD], sh[B3_F0W][B3_F0M][B3_LD];
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t ch = blockIdx.x * B3_F0W + w;
    const bool on = ch < NCH && desc[(ch / H) * MB_DESC + 5] != 0;
    const float *hp = hck + ch * B3_PER, *dl = dhL + ch * B3_PER;
    constexpr int U = B3_F0M * SSD_HP / 32;
    float rl[U], rh[U];
    auto fetch = [&](int m0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int e = lane + 32 * u;
            rl[u] = on ? dl[(m0 + e / SSD_HP) * SSD_HP + e % SSD_HP] : 0.0f;
            rh[u] = on ? hp[(e / B3_F0M) * SSD_NS + m0 + e % B3_F0M] : 0.0f;
        }
    };
    fetch(0);
    float acc = 0.0f;
    for (int m0 = 0; m0 < SSD_NS; m0 += B3_F0M) {
        __syncthreads();
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int e = lane + 32 * u;
            sl[w][e / SSD_HP][e % SSD_HP] = rl[u];
            sh[w][e % B3_F0M][e / B3_F0M] = rh[u];
        }
        __syncthreads();
        if (m0 + B3_F0M < SSD_NS) fetch(m0 + B3_F0M);
        for (int m = 0; m < B3_F0M; m++)
#pragma unroll
            for (int p = 0; p < SSD_HP; p += 4) {
                const float4 a = *reinterpret_cast<const float4 *>(&sl[w][m][p]);
                const float4 b = *reinterpret_cast<const float4 *>(&sh[w][m][p]);
                acc = fmaf(a.x, b.x, acc);
                acc = fmaf(a.y, b.y, acc);
                acc = fmaf(a.z, b.z, acc);
                acc = fmaf(a.w, b.w, acc);
            }
    }
    if (on && lane == 0) F0c[ch] = acc;
}

/* Pair a of a rotated gradient row, (d0, d1), and the rotated row x: l = d1 x[2a] -
 * d0 x[2a+1] into th[a] (q's), or th[a] = th[a] + l (k's, add). */
MB_DEV void b3_angle(float d0, float d1, const float *x, float *th, int a, bool add)
{
    const float l = d1 * x[2 * a] - d0 * x[2 * a + 1];
    th[a] = add ? th[a] + l : l;
}

/* Block (chunk c, head h), B3_THREADS threads, B3_SMEM floats of dynamic shared
 * memory. dyg: the gradient of the gated output (M, di); dhL: dh leaving the chunk
 * (NS, HP) and F0c its chain with h (mb_m3b_f0_k), read only when the chunk folds.
 * Writes dz and dv into dzx's z and x columns, and per token and head dQKG, dQ (of
 * q_rot), dK (of k_rot, times the scale), dsc (of the scale), dadt (of A*dt) and
 * per angle TH = lq + lk, lq = dq[2a+1] q[2a] - dq[2a] q[2a+1] with q, dq the rotated
 * q and its gradient (likewise k). TC: the products on the tensor cores (fast mode),
 * else fmaf chains in the reference's order. Two blocks per multiprocessor (128
 * registers): one alone leaves its barriers and loads unhidden. */
#define B3_CHUNK_PARAMS                                                                       \
    const int64_t *desc, int64_t H, int64_t di, int64_t dip, const float *Q, const float *K,  \
        const float *V, const float *DT, const float *SIG, const float *ADT, const float *QKG, \
        const float *hck, const float *dhL, const float *F0c, const float *D, const float *zx, \
        const float *dyg, float *dzx, float *dQKG, float *dQ, float *dK, float *dsc,         \
        float *dadt, float *TH
template <bool TC> MB_DEV void b3_chunk(float *sm, B3_CHUNK_PARAMS)
{
    float *cs = sm, *ev = cs + M3Q, *sc = ev + M3Q, *dec = sc + M3Q, *av = dec + M3Q;
    float *Fv = av + M3Q, *Rv = Fv + M3Q, *adt = Rv + M3Q;
    float *DY = sm + 8 * M3Q;      /* dy (M3Q, B3_RS); then dvd, then halves of dks */
    float *DG = DY + M3Q * B3_RS;  /* triangles: dG, G then Mm = G * Lm, dseg */
    float *MM = DG + B3_NTRI, *W = MM + B3_NTRI, *YS = W;
    float *T = W + B3_NTRI;        /* the staged tiles */
    const int64_t c = blockIdx.x, h = blockIdx.y, ch = c * H + h, *d = desc + c * MB_DESC;
    const int64_t e0 = d[1], tok = d[4];
    const int n = (int)d[2], ni = (n + B3_K - 1) / B3_K, nj = (n - 1 + B3_K - 1) / B3_K;
    const bool fold = d[5] != 0;
    const int tid = threadIdx.x;
    const float *hp = hck + ch * B3_PER, *dl = dhL + ch * B3_PER, Dh = D[h];

    /* the row vectors (rows past n +0); dy */
    if (tid < n) adt[tid] = ADT[B3_EH(tid)];
    for (int x = tid; x < M3Q * SSD_HP; x += B3_THREADS) {
        const int i = x / SSD_HP, p = x % SSD_HP;
        DY[i * B3_RS + p] = i < n ? B3_DY(i, p) : 0.0f;
    }
    __syncthreads();
    b3_cumsum(adt, n, cs);
    const float cl = cs[n - 1];
    if (tid < M3Q) {
        const int i = tid;
        ev[i] = i < n ? mb_exp(cs[i]) : 0.0f;
        /* the last row's scale is only used by the fold (the next chunk's beta) */
        sc[i] = i + 1 < n || (i + 1 == n && fold) ? m3_scale(DT, SIG, H, B3_EH(i), true) : 0.0f;
        dec[i] = fold && i < n ? mb_exp(cl - cs[i]) : 0.0f;
    }
    __syncthreads();

    /* G = q_rot . ks^T and Ys = q_rot . h over m */
    float ga[4][4] = {}, ya[4][4] = {};
    b3_steps(SSD_NS / B3_K, T, b3_in<true>([&](int s, int x, int kk) {
                 return x < n ? Q[B3_EH(x) * SSD_NS + B3_K * s + kk] : 0.0f;
             }),
             b3_in<true>([&](int s, int x, int kk) {
                 return x < n ? K[B3_EH(x) * SSD_NS + B3_K * s + kk] * sc[x] : 0.0f;
             }),
             b3_in<true>([&](int s, int x, int kk) { return hp[x * SSD_NS + B3_K * s + kk]; }),
             [&](int) {
                 b3_full<TC>(ga, T, T + B3_TILE);
                 b3_full<TC>(ya, T, T + 2 * B3_TILE);
             });
    /* G into Mm's triangle; a_i = (dy . Ys) * exp(cs_i), Ys parked in dseg's triangle
     * and the tiles (free until the next step) */
    __syncthreads();
    b3_each<TC>([&](int r, int q, int i, int j) {
        if (j < i && i < n) MM[B3_TRI(i, j)] = ga[r][q];
        YS[i * B3_RS + j] = ya[r][q];
    });
    __syncthreads();
    if (tid < n) {
        float b = 0.0f;
        for (int p = 0; p < SSD_HP; p++) b = fmaf(DY[tid * B3_RS + p], YS[tid * B3_RS + p], b);
        av[tid] = b * ev[tid];
    }

    /* dP = dy . v^T over p (its diagonal is dqk_gamma = dy . v) */
    float pa[4][4] = {};
    b3_steps(SSD_HP / B3_K, T, b3_in<true>([&](int s, int x, int kk) {
                 return DY[x * B3_RS + B3_K * s + kk];
             }),
             b3_in<true>([&](int s, int x, int kk) {
                 return x < n ? V[B3_EH(x) * SSD_HP + B3_K * s + kk] : 0.0f;
             }),
             b3_none(), [&](int) { b3_full<TC>(pa, T, T + B3_TILE); });
    b3_each<TC>([&](int r, int q, int i, int j) {
        if (i == j && i < n) dQKG[(tok + i) * H + h] = pa[r][q];
    });
    /* seg_ij = the serial sum of A*dt over j < u <= i (down column j); then per pair
     * Lm = exp(seg), dseg = (dP * G) * Lm, dG = dP * Lm, Mm = G * Lm */
    if (tid < n) {
        float s = 0.0f;
        for (int i = tid + 1; i < n; i++) {
            s = s + adt[i];
            W[B3_TRI(i, tid)] = s;
        }
    }
    __syncthreads();
    b3_each<TC>([&](int r, int q, int i, int j) {
        const int o = B3_TRI(i, j);
        if (j < i && i < n) {
            const float lm = mb_exp(W[o]), dp = pa[r][q], g = MM[o];
            W[o] = (dp * g) * lm;
            DG[o] = dp * lm;
            MM[o] = g * lm;
        }
    });
    __syncthreads();
    /* dseg's inclusive row prefix sums */
    if (tid < n)
        for (int j = 1; j < tid; j++) W[B3_TRI(tid, j)] = W[B3_TRI(tid, j - 1)] + W[B3_TRI(tid, j)];

    /* the output before the gate, ypre = (Ys * exp(cs) + Mm . v) + (D + qk_gamma) * v,
     * and dz = (dg * ypre) * silu'(z); Mm . v over u < i ascending */
    float yi[4][4] = {};
    b3_steps(nj, T, b3_in<true>([&](int s, int x, int kk) {
                 const int u = B3_K * s + kk;
                 return u < x && x < n ? MM[B3_TRI(x, u)] : 0.0f;
             }),
             b3_in<false>([&](int s, int x, int kk) {
                 const int u = B3_K * s + kk;
                 return u < n ? V[B3_EH(u) * SSD_HP + x] : 0.0f;
             }),
             b3_none(), [&](int s) { b3_below<TC>(yi, T, B3_K * s); });
    b3_each<TC>([&](int r, int q, int i, int p) {
        if (i >= n) return;
        const int64_t o = (tok + i) * dip + h * SSD_HP + p;
        float y = ya[r][q] * ev[i] + yi[r][q];
        y = y + (Dh + QKG[B3_EH(i)]) * V[B3_EH(i) * SSD_HP + p];
        dzx[o] = (dyg[(tok + i) * di + h * SSD_HP + p] * y) * mb_dsilu(zx[o]);
    });

    /* R_l = sum_{i>=l} of row i's prefix up to l - 1 (i ascending) */
    __syncthreads();
    if (tid < n) {
        float r = 0.0f;
        if (tid > 0)
            for (int i = tid; i < n; i++) r = r + W[B3_TRI(i, tid - 1)];
        Rv[tid] = r;
    }

    /* dq_rot_i = (dye_i . h) + sum_{j<i} dG_ij ks_j, per half of m */
    for (int m0 = 0; m0 < SSD_NS; m0 += M3Q) {
        float t1[4][4] = {}, t2[4][4] = {};
        b3_steps(SSD_HP / B3_K, T, b3_in<false>([&](int s, int x, int kk) {
                     return DY[x * B3_RS + B3_K * s + kk] * ev[x];
                 }),
                 b3_in<false>([&](int s, int x, int kk) {
                     return hp[(B3_K * s + kk) * SSD_NS + m0 + x];
                 }),
                 b3_none(), [&](int) { b3_full<TC>(t1, T, T + B3_TILE); });
        b3_steps(nj, T, b3_in<true>([&](int s, int x, int kk) {
                     const int j = B3_K * s + kk;
                     return j < x && x < n ? DG[B3_TRI(x, j)] : 0.0f;
                 }),
                 b3_in<false>([&](int s, int x, int kk) {
                     const int j = B3_K * s + kk;
                     return j < n ? K[B3_EH(j) * SSD_NS + m0 + x] * sc[j] : 0.0f;
                 }),
                 b3_none(), [&](int s) { b3_below<TC>(t2, T, B3_K * s); });
        /* columns j, j + 1 of a row are one angle pair, in both schedules */
        b3_each<TC>([&](int r, int q, int i, int j) {
            if (i >= n || q % 2) return;
            const float d0 = t1[r][q] + t2[r][q], d1 = t1[r][q + 1] + t2[r][q + 1];
            dQ[B3_EH(i) * SSD_NS + m0 + j] = d0;
            dQ[B3_EH(i) * SSD_NS + m0 + j + 1] = d1;
            if (m0 == 0) b3_angle(d0, d1, Q + B3_EH(i) * SSD_NS, TH + B3_EH(i) * M3A, j / 2, false);
        });
    }

    /* the fold's dvd_j = ks_j . dh over m */
    float dv[4][4] = {};
    if (fold)
        b3_steps(SSD_NS / B3_K, T, b3_in<true>([&](int s, int x, int kk) {
                     return x < n ? K[B3_EH(x) * SSD_NS + B3_K * s + kk] * sc[x] : 0.0f;
                 }),
                 b3_in<false>([&](int s, int x, int kk) {
                     return dl[(B3_K * s + kk) * SSD_HP + x];
                 }),
                 b3_none(), [&](int) { b3_full<TC>(dv, T, T + B3_TILE); });

    /* dv_j = ((sum_{i>j} Mm_ij dy_i, i descending) + (D + qk_gamma_j) dy_j) + dvd_j dec_j */
    float tv[4][4] = {};
    b3_steps(ni, T, b3_in<false>([&](int s, int x, int kk) {
                 const int i = B3_K * (ni - 1 - s) + kk;
                 return x < i && i < n ? MM[B3_TRI(i, x)] : 0.0f;
             }),
             b3_in<false>([&](int s, int x, int kk) {
                 return DY[(B3_K * (ni - 1 - s) + kk) * B3_RS + x];
             }),
             b3_none(), [&](int s) { b3_above<TC>(tv, T, B3_K * (ni - 1 - s), n); });
    b3_each<TC>([&](int r, int q, int j, int p) {
        if (j >= n) return;
        float t = tv[r][q] + (Dh + QKG[B3_EH(j)]) * DY[j * B3_RS + p];
        if (fold) t = t + dv[r][q] * dec[j];
        dzx[(tok + j) * dip + di + h * SSD_HP + p] = t;
    });
    /* F_j = dot(dvd_j, v_j) * dec_j, dvd in dy's space */
    __syncthreads();
    if (fold) {
        b3_each<TC>([&](int r, int q, int i, int j) { DY[i * B3_RS + j] = dv[r][q]; });
        __syncthreads();
        if (tid < n) {
            const float *v = V + B3_EH(tid) * SSD_HP;
            float acc = 0.0f;
            for (int p = 0; p < SSD_HP; p++) acc = fmaf(DY[tid * B3_RS + p], v[p], acc);
            Fv[tid] = acc * dec[tid];
        }
    }

    /* per half of m: dks_j = (sum_{i>j} dG_ij q_rot_i, i descending) + vd_j . dh;
     * dk_rot = dks * scale; dsc_j = dks_j . k_rot_j continues over the halves */
    float dsa = 0.0f;
    for (int m0 = 0; m0 < SSD_NS; m0 += M3Q) {
        float tk[4][4] = {}, fk[4][4] = {};
        b3_steps(ni, T, b3_in<false>([&](int s, int x, int kk) {
                     const int i = B3_K * (ni - 1 - s) + kk;
                     return x < i && i < n ? DG[B3_TRI(i, x)] : 0.0f;
                 }),
                 b3_in<false>([&](int s, int x, int kk) {
                     const int i = B3_K * (ni - 1 - s) + kk;
                     return i < n ? Q[B3_EH(i) * SSD_NS + m0 + x] : 0.0f;
                 }),
                 b3_none(), [&](int s) { b3_above<TC>(tk, T, B3_K * (ni - 1 - s), n); });
        if (fold)
            b3_steps(SSD_HP / B3_K, T, b3_in<true>([&](int s, int x, int kk) {
                         return x < n ? V[B3_EH(x) * SSD_HP + B3_K * s + kk] * dec[x] : 0.0f;
                     }),
                     b3_in<true>([&](int s, int x, int kk) {
                         return dl[(m0 + x) * SSD_HP + B3_K * s + kk];
                     }),
                     b3_none(), [&](int) { b3_full<TC>(fk, T, T + B3_TILE); });
        __syncthreads(); /* every read of dy's space (F, the previous half) done */
        b3_each<TC>([&](int r, int q, int j, int m) {
            if (q % 2) return;
            float t0 = tk[r][q], t1 = tk[r][q + 1];
            if (fold) {
                t0 = t0 + fk[r][q];
                t1 = t1 + fk[r][q + 1];
            }
            DY[j * B3_RS + m] = t0;
            DY[j * B3_RS + m + 1] = t1;
            if (j >= n) return;
            const float d0 = t0 * sc[j], d1 = t1 * sc[j];
            dK[B3_EH(j) * SSD_NS + m0 + m] = d0;
            dK[B3_EH(j) * SSD_NS + m0 + m + 1] = d1;
            if (m0 == 0) b3_angle(d0, d1, K + B3_EH(j) * SSD_NS, TH + B3_EH(j) * M3A, m / 2, true);
        });
        __syncthreads();
        if (tid < n) {
            const float *k = K + B3_EH(tid) * SSD_NS + m0;
            for (int m = 0; m < M3Q; m++) dsa = fmaf(DY[tid * B3_RS + m], k[m], dsa);
        }
    }
    if (tid < n) dsc[(tok + tid) * H + h] = dsa;

    /* dadt_l = ((sum_{i>=l} a_i + R_l) + F0) + sum_{j<l} F_j */
    __syncthreads();
    if (tid == 0) {
        float sa = 0.0f;
        for (int l = n - 1; l >= 0; l--) {
            sa = sa + av[l];
            Rv[l] = sa + Rv[l];
        }
        const float F0 = fold ? F0c[ch] * mb_exp(cl) : 0.0f;
        float pf = 0.0f;
        for (int l = 0; l < n; l++) {
            float v = Rv[l];
            if (fold) {
                v = v + F0;
                if (l > 0) {
                    pf = pf + Fv[l - 1];
                    v = v + pf;
                }
            }
            dadt[(tok + l) * H + h] = v;
        }
    }
}

MB_KERNEL_PAIR(MB_BOUNDS_MIN(B3_THREADS, 2), m3b_chunk_k, B3_CHUNK_PARAMS, b3_chunk, sm, desc, H,
               di, dip, Q, K, V, DT, SIG, ADT, QKG, hck, dhL, F0c, D, zx, dyg, dzx, dQKG, dQ,
               dK, dsc, dadt, TH)

/* One thread per (row b of L tokens, head h, angle a), tokens in reverse: TH (M, H,
 * M3A) holds each token's lq + lk (mb_m3b_chunk_k) and becomes Th_t = Th_{t+1} +
 * (lq + lk) from +0, B3_AHEAD tokens loaded ahead of the chain. */
MB_KERNEL void mb_m3b_theta_k(int64_t B, int64_t L, int64_t H, float *TH)
{
    MB_GRID_LOOP(i, B * H * M3A) {
        const int64_t b = i / (H * M3A), h = (i / M3A) % H, a = i % M3A;
        float *o = TH + (b * L * H + h) * M3A + a; /* token t at o[t * H * M3A] */
        float th = 0.0f;
        for (int64_t t0 = L - 1; t0 >= 0; t0 -= B3_AHEAD) {
            float l[B3_AHEAD];
#pragma unroll
            for (int u = 0; u < B3_AHEAD; u++) l[u] = t0 - u >= 0 ? o[(t0 - u) * H * M3A] : 0.0f;
#pragma unroll
            for (int u = 0; u < B3_AHEAD; u++)
                if (t0 - u >= 0) {
                    th = th + l[u];
                    o[(t0 - u) * H * M3A] = th;
                }
        }
    }
}

/* One thread per (token m of a row of L, head h): the gradients of dd_dt, trap and
 * dd_A into dzx. gamma_t = dt sig feeds scale_t and qk_gamma; beta_{t-1} = dt (1 - sig).
 * TH: the angle gradient (mb_m3b_theta_k). BT, CT: B_bias and C_bias transposed (NS,
 * H), so that a warp's heads read one row. */
MB_KERNEL void mb_m3b_token_k(int64_t M, int64_t L, int64_t H, int64_t di, int64_t dip,
                              const float *zx, const float *Bn, const float *Cn,
                              const float *BT, const float *CT, const float *dt_bias,
                              const float *DT, const float *SIG, const float *TA, const float *TH,
                              const float *dQKG, const float *dsc, const float *dadt, float *dzx)
{
    const int64_t oDT = 2 * di + 2 * SSD_NS, oA = oDT + H, oTR = oA + H;
    MB_GRID_LOOP(mh, M * H) {
        const int64_t m = mh / H, h = mh % H;
        const float dt = DT[mh], sig = SIG[mh];
        const float *c = Cn + m * SSD_NS, *k = Bn + m * SSD_NS;
        float acc = 0.0f;
        for (int j = 0; j < SSD_NS; j++) acc = fmaf(c[j] + CT[j * H + h], k[j] + BT[j * H + h], acc);
        const float dgam = dsc[mh] + dQKG[mh] * acc, da = dadt[mh];
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

/* One thread per (token m, head h, pair a of dimensions 2a, 2a + 1), after
 * mb_m3b_token_k: dQ, dK hold the rotated gradients on entry and the unrotated,
 * biased q and k gradients on return, R(theta)^T d + (dqk_gamma * gamma) * (k or q),
 * at the angles ANG; TH becomes the per-head angle term TH * dt. */
MB_KERNEL void mb_m3b_unrot_k(int64_t M, int64_t H, const float *Bn, const float *Cn,
                              const float *B_bias, const float *C_bias, const float *DT,
                              const float *SIG, const float *ANG, const float *dQKG, float *TH,
                              float *dQ, float *dK)
{
    MB_GRID_LOOP(i, M * H * (SSD_NS / 2)) {
        const int64_t mh = i / (SSD_NS / 2), m = mh / H, h = mh % H, a = i % (SSD_NS / 2);
        const float dt = DT[mh], dacc = dQKG[mh] * (dt * SIG[mh]);
        float *dq = dQ + mh * SSD_NS + 2 * a, *dk = dK + mh * SSD_NS + 2 * a;
        const float q0 = dq[0], q1 = dq[1], k0 = dk[0], k1 = dk[1];
        float oq0 = q0, oq1 = q1, ok0 = k0, ok1 = k1;
        if (a < M3A) {
            const int64_t e = mh * M3A + a;
            const float th = ANG[e], cs = mb_cos(th), sn = mb_sin(th);
            oq0 = q0 * cs + q1 * sn;
            oq1 = q1 * cs - q0 * sn;
            ok0 = k0 * cs + k1 * sn;
            ok1 = k1 * cs - k0 * sn;
            TH[e] = TH[e] * dt;
        }
        const float *c = Cn + m * SSD_NS + 2 * a, *k = Bn + m * SSD_NS + 2 * a;
        const float *cb = C_bias + h * SSD_NS + 2 * a, *kb = B_bias + h * SSD_NS + 2 * a;
        dq[0] = oq0 + dacc * (k[0] + kb[0]);
        dq[1] = oq1 + dacc * (k[1] + kb[1]);
        dk[0] = ok0 + dacc * (c[0] + cb[0]);
        dk[1] = ok1 + dacc * (c[1] + cb[1]);
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
#undef B3_K
#undef B3_LD
#undef B3_TILE
#undef B3_RS
#undef B3_AHEAD
#undef B3_F0W
#undef B3_F0M
#undef B3_EH
#undef B3_DY