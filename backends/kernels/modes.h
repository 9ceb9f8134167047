/* The transcendentals of the two numeric modes (SPEC 3), as policies that kernels
 * shared by both modes take as a template parameter: identical evaluates
 * reference/numerics.h, fast the vendor's hardware approximations. */
#ifndef MB_MODES_H
#define MB_MODES_H

#include "vendor.h"
#include "numerics.h"

struct mb_identical {
    static __device__ __forceinline__ float exp(float x) { return mb_exp(x); }
    static __device__ __forceinline__ float softplus(float x) { return mb_softplus(x); }
    static __device__ __forceinline__ float silu(float x) { return mb_silu(x); }
};

struct mb_fast {
    static __device__ __forceinline__ float exp(float x) { return __expf(x); }
    /* log1pf keeps softplus accurate where exp(x) is tiny (delta near 0). */
    static __device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }
    static __device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
};

#endif
