/* Refusal of non-finite device inputs (SPEC 9). */
#include "vendor.h"

MB_DEV bool mb_nonfinite_bits(uint32_t b) { return (b & 0x7f800000u) == 0x7f800000u; }
MB_DEV bool mb_nonfinite(float v) { return mb_nonfinite_bits(__float_as_uint(v)); }

/* The first NaN or +-inf of what a thread reads: it keeps the least bad flat index
 * it saw (bad, all ones for none) and reports it with one integer atomicMin, so the
 * answer is the first bad index whatever the schedule, and an input of NaNs costs an
 * atomic a thread, not one an element. *first must hold all ones before the launch.
 * A prefill's norm runs the same search as it reads x (first_nonfinite_later's
 * in_norm). */
MB_DEV void mb_note_nonfinite(float v, int64_t i, unsigned long long *bad)
{
    if (mb_nonfinite(v) && (unsigned long long)i < *bad) *bad = (unsigned long long)i;
}

MB_DEV void mb_report_nonfinite(unsigned long long *first, unsigned long long bad)
{
    if (first && bad != ~0ull) atomicMin(first, bad);
}

MB_KERNEL void mb_first_nonfinite_k(int64_t n, const uint32_t *x, unsigned long long *first)
{
    unsigned long long bad = ~0ull;
    MB_GRID_LOOP(i, n) mb_note_nonfinite(__uint_as_float(x[i]), i, &bad);
    mb_report_nonfinite(first, bad);
}

/* A decode session's guard, the first kernel of each step (one block), so that a
 * step checks its input without the host waiting for it. g[0] is the guard word
 * (all ones while no step has been refused; the state-writing kernels read it),
 * g[1] the refused step's number, g[2] the count of steps run. The first bad flat
 * index of a step's x and its step number are also written to host (mapped host
 * memory, the number first) for the host to read without a driver call. Once a
 * step is refused the later ones are too, until the host resets g[0]. A step
 * whose norm runs in one block checks its input in that block instead (rmsnorm.cu,
 * fast.cu), and one whose norm runs in in_proj's GEMV, in each of its blocks
 * (gemm.cu): one kernel fewer in the step's graph. */
#define GUARD_LOADS 8

/* A step's check found first (all ones: nothing) with the guard open before it
 * (open): the guard's words and the host's, by one thread of the step. */
MB_DEV void mb_guard_report(bool open, unsigned long long first, unsigned long long *g,
                            volatile unsigned long long *host)
{
    if (open && first != ~0ull) {
        g[0] = first;
        g[1] = g[2];
        host[1] = g[2];
        __threadfence_system();
        host[0] = first;
    }
    g[2] = g[2] + 1;
}

/* The guard's work, by the threads of one block. */
MB_DEV void mb_guard_step(int64_t n, const uint32_t *x, unsigned long long *g,
                          volatile unsigned long long *host)
{
    __shared__ unsigned long long first;
    if (threadIdx.x == 0) first = ~0ull;
    __syncthreads();
    const bool open = g[0] == ~0ull;
    /* GUARD_LOADS loads in flight per thread: one block must not walk x one load at a time. */
    if (open)
        for (int64_t i0 = threadIdx.x; i0 < n; i0 += GUARD_LOADS * blockDim.x) {
            uint32_t v[GUARD_LOADS];
#pragma unroll
            for (int u = 0; u < GUARD_LOADS; u++) {
                const int64_t i = i0 + u * blockDim.x;
                v[u] = i < n ? x[i] : 0u;
            }
#pragma unroll
            for (int u = 0; u < GUARD_LOADS; u++)
                if (mb_nonfinite_bits(v[u]))
                    atomicMin(&first, (unsigned long long)(i0 + u * blockDim.x));
        }
    __syncthreads();
    if (threadIdx.x == 0) mb_guard_report(open, first, g, host);
}

MB_KERNEL void mb_step_guard_k(int64_t n, const uint32_t *x, unsigned long long *g,
                               volatile unsigned long long *host)
{
    MB_GRID_WAIT();
    mb_guard_step(n, x, g, host);
}

#undef GUARD_LOADS
