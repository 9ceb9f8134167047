/* Y = X . W^T under dot v1 (SPEC 4.4): every output is a serial ascending fmaf chain
 * from +0 over each leaf of 8192 k, leaves joined by the pairwise tree. Vectors run
 * across outputs only, never across k, so every ISA copy gives the same bits.
 *
 * Two paths. Large M: a task packs one NR-column panel of the right operand k-major
 * (transposing W's rows, or copying the rows of a k-major B) and runs a block of rows
 * of the left operand past it in MR x NR register tiles (left operand broadcast, read
 * in place with any strides). Small M (decode): a GEMV that reads W rows in place,
 * transposing 8x8 blocks in registers, four chains in flight. Both share W's rows
 * between threads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "gemm.h"
#include "fpenv.h"
#include "tile.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_SIMD 1
#endif

#define LEAF 8192
/* Large path tile: MR rows of X by NV vectors of packed W columns; MR * NV
 * accumulators stay in registers (16 of them under AVX2, 32 under AVX-512). */
#if MB_VW == 16
#define MR 8
#else
#define MR 6
#endif
#define NV 2
#define NR (NV * MB_VW)
#define GM 4       /* small path: at most GM rows of X ... */
#define GR 32      /* ... by GR rows of W per tile */
#define SMALL_M 4  /* M up to this takes the GEMV path */
#define MIN_PAR (1 << 16) /* multiply-adds below which a second thread costs more than it gives */
#define KC 256     /* k per slab of the strided-left path: a slab of panel stays in L1 */
#define TNB 128    /* rows per task of that path (a multiple of MR) */

typedef void (*leaf_fn)(const void *arg, int64_t k0, int64_t kl, float *t);

/* n outputs under dot v1 into t. Leaves are merged as they arrive whenever the top
 * two cover equal counts, and the rest fold right to left at the end: that is the
 * level-by-level adjacent pairing of SPEC 4.4, with an odd tail carried up. */
static void dot_v1_tile(leaf_fn f, const void *arg, int64_t K, int n, float *t)
{
    if (K <= LEAF) {
        f(arg, 0, K, t);
        return;
    }
    float stk[64][MR * NR > GM * GR ? MR * NR : GM * GR];
    int64_t cnt[64];
    int sp = 0;
    for (int64_t k0 = 0; k0 < K; k0 += LEAF) {
        f(arg, k0, K - k0 < LEAF ? K - k0 : LEAF, stk[sp]);
        cnt[sp++] = 1;
        while (sp >= 2 && (cnt[sp - 1] == cnt[sp - 2] || k0 + LEAF >= K)) {
            for (int i = 0; i < n; i++) stk[sp - 2][i] = stk[sp - 2][i] + stk[sp - 1][i];
            cnt[sp - 2] += cnt[sp - 1];
            sp--;
        }
    }
    memcpy(t, stk[0], (size_t)n * sizeof(float));
}

/* ---- large M: packed panels ------------------------------------------------- */

typedef struct {
    const float *x[MR]; /* rows past M repeat the last one; their outputs are dropped */
    int64_t sx;         /* their stride along k */
    const float *wp;    /* panel: wp[k*NR + j] = column n0 + j of the right operand at k, zero past N */
} tile_arg;

/* The tile's MR x NR chains over k in [k0, k0 + kl), the first mr rows stored into
 * out (rows ldo apart). */
static inline __attribute__((always_inline)) void tile_run(const tile_arg *a, int64_t k0,
                                                           int64_t kl, float *out,
                                                           int64_t ldo, int mr)
{
    const float *x[MR];
    for (int i = 0; i < MR; i++) x[i] = a->x[i] + k0 * a->sx;
    if (a->sx == 1) /* rows in place */
        mb_tile(MR, NV, kl, 0, x, 1, a->wp + k0 * NR, NR, out, ldo, mr);
    else /* rows packed k-major */
        mb_tile(MR, NV, kl, 0, x, MR, a->wp + k0 * NR, NR, out, ldo, mr);
}

static void tile_leaf(const void *arg, int64_t k0, int64_t kl, float *t)
{
    tile_run(arg, k0, kl, t, NR, MR);
}

#ifdef MB_SIMD
/* 4x4 transposes in both 128-bit lanes at once: v[j] = (r0[j], r1[j], r2[j], r3[j])
 * in each lane. */
static inline void tr8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 *v)
{
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    v[0] = _mm256_shuffle_ps(t0, t2, 0x44); v[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    v[2] = _mm256_shuffle_ps(t1, t3, 0x44); v[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

/* v[j] = (w[0][k+j], ..., w[7][k+j]) for j < 8. The 128-bit halves are placed by the
 * loads (rows i and i+4 share a register), so only 16 in-lane shuffles remain. */
static inline void load_tr8(const float *const *w, int64_t k, __m256 *v)
{
#define LD2(a, b, o) _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(w[a] + k + o)), \
                                          _mm_loadu_ps(w[b] + k + o), 1)
    tr8(LD2(0, 4, 0), LD2(1, 5, 0), LD2(2, 6, 0), LD2(3, 7, 0), v);
    tr8(LD2(0, 4, 4), LD2(1, 5, 4), LD2(2, 6, 4), LD2(3, 7, 4), v + 4);
#undef LD2
}

/* The same for the last rem < 8 columns; masked loads read nothing past them. */
static inline void load_tr8_tail(const float *const *w, int64_t k, int rem, __m256 *v)
{
    __m128i lo = _mm_cmpgt_epi32(_mm_set1_epi32(rem), _mm_setr_epi32(0, 1, 2, 3));
    __m128i hi = _mm_cmpgt_epi32(_mm_set1_epi32(rem), _mm_setr_epi32(4, 5, 6, 7));
#define LD2(a, b, o, m) _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_maskload_ps(w[a] + k + o, m)), \
                                             _mm_maskload_ps(w[b] + k + o, m), 1)
    tr8(LD2(0, 4, 0, lo), LD2(1, 5, 0, lo), LD2(2, 6, 0, lo), LD2(3, 7, 0, lo), v);
    tr8(LD2(0, 4, 4, hi), LD2(1, 5, 4, hi), LD2(2, 6, 4, hi), LD2(3, 7, 4, hi), v + 4);
#undef LD2
}
#endif

/* The panel of W^T at row n0: wp[k*NR + j] = W[n0 + j][k], zero past N. */
static void pack_panel(int64_t N, int64_t K, const float *W, int64_t ldw, int64_t n0, float *wp)
{
    const float *row[NR];
    int nr = N - n0 < NR ? (int)(N - n0) : NR;
    for (int j = 0; j < NR; j++) row[j] = W + (n0 + (j < nr ? j : nr - 1)) * ldw;
    int64_t k = 0;
#ifdef MB_SIMD
    for (; k + 16 <= K; k += 16) /* whole cache lines of each row, as in the GEMV */
        for (int h = 0; h < NR; h += 8)
            for (int64_t kk = k; kk < k + 16; kk += 8) {
                __m256 v[8];
                load_tr8(row + h, kk, v);
                for (int j = 0; j < 8; j++) _mm256_store_ps(wp + (kk + j) * NR + h, v[j]);
            }
#endif
    for (; k < K; k++)
        for (int j = 0; j < NR; j++) wp[k * NR + j] = row[j][k];
    for (int j = nr; j < NR; j++)
        for (k = 0; k < K; k++) wp[k * NR + j] = 0.0f;
}

/* The same panel from a k-major B (N columns, rows ldb apart): a copy. */
static void pack_rows(int64_t N, int64_t K, const float *B, int64_t ldb, int64_t n0, float *wp)
{
    const int nr = N - n0 < NR ? (int)(N - n0) : NR;
    for (int64_t k = 0; k < K; k++) {
        const float *b = B + k * ldb + n0;
        float *o = wp + k * NR;
        if (nr == NR)
            memcpy(o, b, NR * sizeof(float));
        else
            for (int j = 0; j < NR; j++) o[j] = j < nr ? b[j] : 0.0f;
    }
}

/* The operands of the packed path: the left one A[m*sam + k*sak]; the right one W
 * (N, K) row-major (trans) or B (K, N) row-major. */
typedef struct {
    const float *a;
    int64_t sam, sak;
    const float *w;
    int64_t ldw;
    int trans;
} operands;

/* Rows [m0, m0 + MR) of the left operand k-major into ap (ap[k*MR + i]; rows past M
 * repeat the last one): one streaming pass instead of strided broadcasts. */
static void pack_left(int64_t M, int64_t K, const operands *op, int64_t m0, float *ap)
{
    const int mr = M - m0 < MR ? (int)(M - m0) : MR;
    const float *x[MR];
    for (int i = 0; i < MR; i++) x[i] = op->a + (m0 + (i < mr ? i : mr - 1)) * op->sam;
    if (op->sam == 1 && mr == MR) /* A^T: MR consecutive floats per k */
        for (int64_t k = 0; k < K; k++) memcpy(ap + k * MR, x[0] + k * op->sak, MR * sizeof(float));
    else
        for (int64_t k = 0; k < K; k++)
            for (int i = 0; i < MR; i++) ap[k * MR + i] = x[i][k * op->sak];
}

/* Rows [m0, m1) of a strided left operand against every panel of a k-major right one,
 * K within one leaf, k in slabs of KC: per slab the block's rows are packed (they
 * stay in L2) and each panel's slab (in L1) runs past them; the chains continue from
 * slab to slab through ob, the block's outputs at stride ldo. */
static void tn_block(int64_t M, int64_t N, int64_t K, const operands *op, int64_t m0,
                     int64_t m1, float *wp, float *ap, float *ob, int64_t ldo, float *Y,
                     int64_t ldy)
{
    const int64_t np = (N + NR - 1) / NR;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kl = K - k0 < KC ? K - k0 : KC;
        operands o = *op;
        o.a += k0 * op->sak;
        for (int64_t m = m0; m < m1; m += MR) pack_left(M, kl, &o, m, ap + (m - m0) * kl);
        for (int64_t p = 0; p < np; p++) {
            pack_rows(N, kl, op->w + k0 * op->ldw, op->ldw, p * NR, wp);
            for (int64_t m = m0; m < m1; m += MR) {
                const float *x[MR];
                for (int i = 0; i < MR; i++) x[i] = ap + (m - m0) * kl + i;
                mb_tile_more(MR, NV, kl, 0, x, MR, wp, NR, ob + (m - m0) * ldo + p * NR, ldo, MR,
                             k0 > 0);
            }
        }
    }
    for (int64_t m = m0; m < m1; m++)
        memcpy(Y + m * ldy, ob + (m - m0) * ldo, (size_t)N * sizeof(float));
}

static int gemm_packed(int64_t M, int64_t N, int64_t K, const operands *op, float *Y, int64_t ldy)
{
    /* A task is a block of rows of the left operand against one panel of the right
     * one: the panel is packed by the thread that uses it, into its own scratch, and
     * stays hot in L2 (K*64 bytes) while the block's tiles stream past it. Blocks are
     * tall enough that repacking a panel per block costs a few percent, short enough
     * to give both cores work. A left operand with strided rows (sak != 1) is packed
     * too, once per task: its tasks take every panel in turn, in slabs of k (tn_block)
     * within a leaf, else with blocks short enough that the packed rows stay in L2
     * beside the panel. */
    const int pl = op->sak != 1, slab = pl && K <= LEAF && !op->trans;
    int64_t np = (N + NR - 1) / NR, kl = K < LEAF ? K : LEAF;
    int64_t mb = (1 << (pl ? 17 : 18)) / kl / MR * MR;
    mb = pl ? (mb < MR ? MR : mb > 128 ? 128 / MR * MR : mb) : (mb < 96 ? 96 : mb > 384 ? 384 : mb);
    int par = M * N * K >= MIN_PAR, nt = par ? mb_max_threads() : 1;
    if (slab) { /* blocks of about TNB rows, as many as a multiple of the threads */
        const int64_t nb = ((M + TNB - 1) / TNB + nt - 1) / nt * nt;
        mb = ((M + nb - 1) / nb + MR - 1) / MR * MR;
    }
    int64_t nmb = (M + mb - 1) / mb, ntask = pl ? nmb : nmb * np;
    /* whole cache lines per thread: the panel, the packed left rows, the slab path's
     * outputs */
    const int64_t per = slab ? (NR * KC + mb * KC + mb * np * NR + 15) & ~(int64_t)15
                             : ((NR + (pl ? mb : 0)) * K + 15) & ~(int64_t)15;
    float *scratch = aligned_alloc(64, (size_t)(nt * per) * sizeof(float));
    if (!scratch) return 0;
#pragma omp parallel num_threads(nt) if (par)
    {
        mb_fpenv fe = mb_fpenv_enter();
        float *wp = scratch + mb_thread_num() * per;
        float *ap = wp + NR * (slab ? KC : K), *ob = ap + mb * KC;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            const int64_t m0 = (pl ? task : task / np) * mb, m1 = m0 + mb < M ? m0 + mb : M;
            const int64_t p0 = pl ? 0 : task % np, p1 = pl ? np : p0 + 1;
            if (slab) {
                tn_block(M, N, K, op, m0, m1, wp, ap, ob, np * NR, Y, ldy);
                continue;
            }
            if (pl)
                for (int64_t m = m0; m < m1; m += MR) pack_left(M, K, op, m, ap + (m - m0) * K);
            for (int64_t p = p0; p < p1; p++) {
                int nr = N - p * NR < NR ? (int)(N - p * NR) : NR;
                tile_arg a;
                float t[MR * NR];
                if (op->trans)
                    pack_panel(N, K, op->w, op->ldw, p * NR, wp);
                else
                    pack_rows(N, K, op->w, op->ldw, p * NR, wp);
                a.wp = wp;
                a.sx = pl ? MR : 1;
                for (int64_t m = m0; m < m1; m += MR) {
                    int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                    for (int i = 0; i < MR; i++)
                        a.x[i] = pl ? ap + (m - m0) * K + i : op->a + (m + (i < mr ? i : mr - 1)) * op->sam;
                    if (K <= LEAF && nr == NR) { /* one leaf, whole columns: straight into Y */
                        tile_run(&a, 0, K, Y + m * ldy + p * NR, ldy, mr);
                        continue;
                    }
                    dot_v1_tile(tile_leaf, &a, K, MR * NR, t);
                    for (int i = 0; i < mr; i++)
                        memcpy(Y + (m + i) * ldy + p * NR, t + i * NR, (size_t)nr * sizeof(float));
                }
            }
        }
        mb_fpenv_exit(fe);
    }
    free(scratch);
    return 1;
}

/* ---- small M: W rows read in place ------------------------------------------ */

typedef struct {
    int m;               /* rows of X in use, 1..GM */
    const float *x[GM];
    const float *w[GR];  /* rows past N repeat the last one; their outputs are dropped */
} gemv_arg;

#ifdef MB_SIMD
/* Columns kk..kk+n of 8 rows of W, transposed, into the M chains of those rows. */
static inline __attribute__((always_inline)) void gemv_step(const gemv_arg *a, int mm, const float *const *w,
                                                            int64_t kk, int n, __m256 *acc)
{
    __m256 v[8];
    if (n == 8) load_tr8(w, kk, v);
    else load_tr8_tail(w, kk, n, v);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < mm; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(a->x[i] + kk + j), v[j], acc[i]);
}

/* mm (rows of X) and nb (8-row blocks of W in flight) are constants here so the
 * mm*nb accumulators stay in registers; mm*nb = 4 independent chains. */
static inline __attribute__((always_inline)) void gemv_leaf_m(const gemv_arg *a, int mm, int nb, int64_t k0,
                                                              int64_t kl, float *t)
{
    for (int b0 = 0; b0 < GR / 8; b0 += nb) {
        __m256 acc[4][GM];
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < mm; i++) acc[b][i] = _mm256_setzero_ps();
        int64_t k = k0;
        /* Whole 64-byte lines of each row per step: rows 4 KiB apart share L1 sets,
         * and a line left half-read would be evicted and fetched twice. */
        for (; k + 16 <= k0 + kl; k += 16)
            for (int b = 0; b < nb; b++) {
                gemv_step(a, mm, a->w + 8 * (b0 + b), k, 8, acc[b]);
                gemv_step(a, mm, a->w + 8 * (b0 + b), k + 8, 8, acc[b]);
            }
        for (; k < k0 + kl; k += 8)
            for (int b = 0; b < nb; b++)
                gemv_step(a, mm, a->w + 8 * (b0 + b), k, k0 + kl - k < 8 ? (int)(k0 + kl - k) : 8, acc[b]);
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < mm; i++) _mm256_storeu_ps(t + i * GR + 8 * (b0 + b), acc[b][i]);
    }
}
#endif

static void gemv_leaf(const void *arg, int64_t k0, int64_t kl, float *t)
{
    const gemv_arg *a = arg;
#ifdef MB_SIMD
    switch (a->m) {
    case 1: gemv_leaf_m(a, 1, 4, k0, kl, t); return;
    case 2: gemv_leaf_m(a, 2, 2, k0, kl, t); return;
    case 3: gemv_leaf_m(a, 3, 1, k0, kl, t); return;
    default: gemv_leaf_m(a, 4, 1, k0, kl, t); return;
    }
#else
    for (int i = 0; i < a->m * GR; i++) t[i] = 0.0f;
    for (int64_t k = k0; k < k0 + kl; k++)
        for (int r = 0; r < GR; r++)
            for (int i = 0; i < a->m; i++) t[i * GR + r] = fmaf(a->x[i][k], a->w[r][k], t[i * GR + r]);
#endif
}

static void gemm_rows(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
                      const float *W, int64_t ldw, float *Y, int64_t ldy)
{
    int64_t ng = (N + GR - 1) / GR;
#pragma omp parallel if (M * N * K >= MIN_PAR)
    {
        mb_fpenv fe = mb_fpenv_enter();
#pragma omp for schedule(guided) /* other loads may hold a core: balance late */
        for (int64_t g = 0; g < ng; g++) {
            int64_t n0 = g * GR;
            int nr = N - n0 < GR ? (int)(N - n0) : GR;
            gemv_arg a;
            float t[GM * GR];
            for (int r = 0; r < GR; r++) a.w[r] = W + (n0 + (r < nr ? r : nr - 1)) * ldw;
            for (int64_t m = 0; m < M; m += GM) { /* W is read once per GM rows of X */
                a.m = M - m < GM ? (int)(M - m) : GM;
                for (int i = 0; i < a.m; i++) a.x[i] = X + (m + i) * ldx;
                dot_v1_tile(gemv_leaf, &a, K, a.m * GR, t);
                for (int i = 0; i < a.m; i++)
                    memcpy(Y + (m + i) * ldy + n0, t + i * GR, (size_t)nr * sizeof(float));
            }
        }
        mb_fpenv_exit(fe);
    }
}

void MB_ISA_FN(mb_gemm)(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
                        const float *W, int64_t ldw, float *Y, int64_t ldy)
{
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        for (int64_t m = 0; m < M; m++) memset(Y + m * ldy, 0, (size_t)N * sizeof(float));
        return;
    }
    /* The packed path falls back to the in-place one if its scratch is refused. */
    const operands op = {X, ldx, 1, W, ldw, 1};
    if (M <= SMALL_M || !gemm_packed(M, N, K, &op, Y, ldy))
        gemm_rows(M, N, K, X, ldx, W, ldw, Y, ldy);
}

int MB_ISA_FN(mb_gemm_kn)(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                          int64_t sak, const float *B, int64_t ldb, float *Y, int64_t ldy)
{
    if (M <= 0 || N <= 0)
        return 1;
    if (K <= 0) {
        for (int64_t m = 0; m < M; m++) memset(Y + m * ldy, 0, (size_t)N * sizeof(float));
        return 1;
    }
    const operands op = {A, sam, sak, B, ldb, 0};
    return gemm_packed(M, N, K, &op, Y, ldy);
}
