/* The few vendor-specific spellings the kernels need, so that one source builds
 * with nvcc and with hipcc. Kernels are extern "C" so the loaders find them by
 * their plain names, and take only 64-bit scalars and pointers so that a launch
 * is an array of 8-byte values on either vendor. */
#ifndef MB_VENDOR_H
#define MB_VENDOR_H

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif
#include <stdint.h>

#define MB_KERNEL extern "C" __global__
#define MB_BOUNDS(threads) __launch_bounds__(threads)
#define MB_DEV static __device__ __forceinline__

/* v from lane src of each aligned group of width lanes (every lane must take part). */
#if defined(__HIPCC__)
#define MB_SHFL(v, src, width) __shfl((v), (src), (width))
#else
#define MB_SHFL(v, src, width) __shfl_sync(0xffffffffu, (v), (src), (width))
#endif

/* First index of a grid-stride loop over n items in x, and its stride. */
#define MB_GRID_LOOP(i, n)                                                          \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);       \
         i += (int64_t)gridDim.x * blockDim.x)

#endif
