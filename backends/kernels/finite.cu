/* First NaN or +-inf of a device buffer (SPEC 9): an integer atomicMin of the
 * flat index, so the answer is the first bad index whatever the schedule. *first
 * must hold all ones before the launch. */
#include "vendor.h"

MB_KERNEL void mb_first_nonfinite_k(int64_t n, const uint32_t *x, unsigned long long *first)
{
    MB_GRID_LOOP(i, n) {
        if ((x[i] & 0x7f800000u) == 0x7f800000u) atomicMin(first, (unsigned long long)i);
    }
}
