/* The register tile every CPU contraction runs on: R rows by V vectors of columns,
 * each output one dot v1 chain (SPEC 4.4): ascending k from +0, lanes across columns
 * only. R and V must be constants at the call (the function is always inlined) so
 * that the R * V accumulators stay in registers. */
#ifndef MB_TILE_H
#define MB_TILE_H
#include <stdint.h>
#include "simd.h"

#define MB_TILE_MAXR 16
#define MB_TILE_MAXV 16

/* mb_tile, with the chains seeded from out (rows r < nr) when more is set: a chain
 * stored by one call and continued by the next gives the same bits as one call over
 * the k of both. */
static inline __attribute__((always_inline)) void mb_tile_more(const int R, const int V, int64_t K,
                                                               int dK, const float *const *a,
                                                               int64_t sak, const float *b,
                                                               int64_t ldb, float *out,
                                                               int64_t ldo, int nr, int more)
{
    if (R > MB_TILE_MAXR || V > MB_TILE_MAXV) /* folds away: R and V are constants */
        __builtin_trap();
    mb_vf c[MB_TILE_MAXR][MB_TILE_MAXV];
    MB_UNROLL
    for (int r = 0; r < R; r++)
        MB_UNROLL
        for (int j = 0; j < V; j++)
            c[r][j] = more && r < nr ? mb_vld(out + r * ldo + j * MB_VW) : mb_vzero();
    const float *bk = b;
    for (int64_t k = 0; k < K; k++, bk += ldb) {
        mb_vf bv[MB_TILE_MAXV];
        MB_UNROLL
        for (int j = 0; j < V; j++) bv[j] = mb_vld(bk + j * MB_VW);
        MB_UNROLL
        for (int r = 0; r < R; r++) {
            const mb_vf v = mb_vbc(a[r] + k * sak);
            MB_UNROLL
            for (int j = 0; j < V; j++) c[r][j] = mb_vfma(v, bv[j], c[r][j]);
        }
    }
    if (dK)
        MB_UNROLL
        for (int r = 1; r < R; r++)
            for (int64_t k = K; k < K + (r < nr ? r : 0); k++) {
                const mb_vf v = mb_vbc(a[r] + k * sak);
                MB_UNROLL
                for (int j = 0; j < V; j++)
                    c[r][j] = mb_vfma(v, mb_vld(b + k * ldb + j * MB_VW), c[r][j]);
            }
    MB_UNROLL
    for (int r = 0; r < R; r++)
        if (r < nr)
            MB_UNROLL
            for (int j = 0; j < V; j++) mb_vst(out + r * ldo + j * MB_VW, c[r][j]);
}

/* out[r * ldo + j] = chain over k < K + r * dK of a[r][k * sak] * b[k * ldb + j], for
 * r < R and j < V * MB_VW; only rows r < nr are stored. dK is 0, or 1 for a causal
 * product: the rows share the first K terms and row r then finishes its own r more.
 * Rows past nr may repeat a valid row pointer; they run the shared terms only and
 * their results are dropped. */
static inline __attribute__((always_inline)) void mb_tile(const int R, const int V, int64_t K,
                                                          int dK, const float *const *a,
                                                          int64_t sak, const float *b,
                                                          int64_t ldb, float *out,
                                                          int64_t ldo, int nr)
{
    mb_tile_more(R, V, K, dK, a, sak, b, ldb, out, ldo, nr, 0);
}

#endif
