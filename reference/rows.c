/* Ragged-batch bookkeeping: the blocks compute on the real tokens only, packed. */
#include <string.h>
#include "ops.h"

int64_t mb_row_offsets(int64_t B, int64_t L, const int64_t *lengths, int64_t *off)
{
    off[0] = 0;
    for (int64_t b = 0; b < B; b++)
        off[b + 1] = off[b] + (lengths ? lengths[b] : L);
    return off[B];
}

void mb_pack_rows(int64_t B, int64_t L, int64_t n, const int64_t *off, const float *padded, float *packed)
{
    for (int64_t b = 0; b < B; b++)
        memcpy(packed + off[b] * n, padded + b * L * n, (size_t)((off[b + 1] - off[b]) * n) * sizeof(float));
}

void mb_unpack_rows(int64_t B, int64_t L, int64_t n, const int64_t *off, const float *packed, float *padded)
{
    for (int64_t b = 0; b < B; b++) {
        int64_t len = off[b + 1] - off[b];
        memcpy(padded + b * L * n, packed + off[b] * n, (size_t)(len * n) * sizeof(float));
        memset(padded + (b * L + len) * n, 0, (size_t)((L - len) * n) * sizeof(float));
    }
}
