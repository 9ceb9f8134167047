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
#define MB_BOUNDS_MIN(threads, blocks) __launch_bounds__(threads, blocks)
#define MB_DEV static __device__ __forceinline__
/* threads a warp at most (AMD's CDNA runs wavefronts of 64) */
#if defined(__HIPCC__)
#define MB_WARP 64
#else
#define MB_WARP 32
#endif

/* v from lane src of each aligned group of width lanes (every lane must take part). */
#if defined(__HIPCC__)
#define MB_SHFL(v, src, width) __shfl((v), (src), (width))
#define MB_SHFL_XOR(v, mask) __shfl_xor((v), (mask))
#else
#define MB_SHFL(v, src, width) __shfl_sync(0xffffffffu, (v), (src), (width))
#define MB_SHFL_XOR(v, mask) __shfl_xor_sync(0xffffffffu, (v), (mask))
#endif

/* Asynchronous global -> shared copies (cp.async on sm_80+), so a block keeps
 * several stages of a tile in flight while it computes on an earlier one. A copy of
 * src_bytes < size zero-fills the rest and reads only src_bytes. HIP copies at once. */
#ifndef MB_CHECK_ALIGNED16 /* p is 16-byte aligned: the emulation checks (tests/emu) */
#define MB_CHECK_ALIGNED16(p)
#endif
#if defined(MB_EMU_CP_ASYNC) /* the host emulation's own (tests/emu/builtins.h) */
#elif defined(__HIPCC__)
MB_DEV void mb_cp_async16(float *dst, const float *src, int src_bytes)
{
    MB_CHECK_ALIGNED16(dst);
    MB_CHECK_ALIGNED16(src);
    for (int i = 0; i < 4; i++) dst[i] = 4 * i < src_bytes ? src[i] : 0.0f;
}
MB_DEV void mb_cp_async4(float *dst, const float *src, int src_bytes)
{
    *dst = src_bytes ? *src : 0.0f;
}
MB_DEV void mb_cp_commit() {}
template <int N> MB_DEV void mb_cp_wait() {}
#else
MB_DEV void mb_cp_async16(float *dst, const float *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::
                 "r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src), "r"(src_bytes));
}
MB_DEV void mb_cp_async4(float *dst, const float *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::
                 "r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src), "r"(src_bytes));
}
MB_DEV void mb_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* Wait until at most N committed groups of this thread are still in flight. */
template <int N> MB_DEV void mb_cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
#endif
/* Four floats read from L2, past the multiprocessor's own cache, where another
 * block of the same kernel published them (behind a flag) */
#if defined(__HIPCC__)
MB_DEV float4 mb_ld_cg4(const float *p)
{
    const volatile float *v = p;
    return make_float4(v[0], v[1], v[2], v[3]);
}
#else
MB_DEV float4 mb_ld_cg4(const float *p) { return __ldcg((const float4 *)p); }
#endif
/* mb_cp_wait<n> for an n known at run time; past 3 it waits as for 3 (for more of
 * the copies than asked, never fewer) */
MB_DEV void mb_cp_wait_n(int n)
{
    if (n <= 0)
        mb_cp_wait<0>();
    else if (n == 1)
        mb_cp_wait<1>();
    else if (n == 2)
        mb_cp_wait<2>();
    else
        mb_cp_wait<3>();
}

/* TF32 tensor cores (fast mode only): MB_MMA where the warp-wide
 * mma.m16n8k8.row.col TF32 product exists (NVIDIA; the emulation defines its own).
 * Thread (g = lane / 4, t = lane % 4) holds A's (g, t), (g + 8, t), (g, t + 4),
 * (g + 8, t + 4), B's (t, g), (t + 4, g) and C's (g, 2t), (g, 2t + 1), (g + 8, 2t),
 * (g + 8, 2t + 1). mb_tf32 rounds an operand to nearest (ties away) by adding half
 * a unit of its 10-bit mantissa, since the tensor core ignores the 13 low bits: one
 * integer add, where cvt.rna.tf32.f32 costs several instructions on sm_90 (inf
 * becomes NaN). */
#if !defined(__HIPCC__)
#define MB_MMA 1
MB_DEV uint32_t mb_tf32(float x) { return __float_as_uint(x) + 0x1000u; }

MB_DEV void mb_mma_tf32(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                        uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

/* A kernel in two schedules, its body a template on the tensor cores: mb_<stem> runs
 * body<false> (identical mode's) and, where MB_MMA is, mb_fast_<stem> body<true>
 * (fast mode's; the mb_fast_ names of fast.cu and modes.h). The arguments may name
 * sm, the launch's dynamic shared memory. */
#define MB_KERNEL_PAIR(bounds, stem, params, body, ...)                               \
    MB_KERNEL void bounds mb_##stem(params)                                            \
    {                                                                                  \
        extern __shared__ __align__(16) float sm[];                                    \
        body<false>(__VA_ARGS__);                                                      \
    }                                                                                  \
    MB_KERNEL_FAST(bounds, stem, (params), body, __VA_ARGS__)
#if defined(MB_MMA)
#define MB_KERNEL_FAST(bounds, stem, params, body, ...)                               \
    MB_KERNEL void bounds mb_fast_##stem params                                        \
    {                                                                                  \
        extern __shared__ __align__(16) float sm[];                                    \
        body<true>(__VA_ARGS__);                                                       \
    }
#else
#define MB_KERNEL_FAST(...)
#endif

/* Stages of the cp.async rings (gemm.cu, rmsnorm.cu): four hide global latency on
 * NVIDIA; AMD's 64 KB of LDS per block holds two (there the copies are synchronous
 * anyway). The loaders size the rings' shared memory from the same number
 * (CudaBackend.stages in mamba/_cuda.py). */
#if defined(__HIPCC__)
#define MB_STAGES 2
#else
#define MB_STAGES 4
#endif

/* Terms per stage of the decode GEMV's two-stage ring (gemm.cu): on the H200 two
 * stages of 256 beat four of 128 at every decode shape (a chunk's hand-off costs
 * about as much as 100 terms of its chain); AMD's 64 KiB of LDS holds two of 128.
 * The loaders size its shared memory from the same number (CudaBackend.gemv_kc). */
#if defined(__HIPCC__)
#define MB_GEMV_KC 128
#else
#define MB_GEMV_KC 256
#endif

/* Stage rows [0, nrows) x k in [k, k + kc) of a row-major matrix (ld floats) into
 * shared memory with row stride sld (a multiple of 4); terms at or past k1 are
 * zero-filled and never read. vec: ld, src and k are 16-byte aligned. Shared by
 * the threads of a block (tid of nthreads); completes at mb_cp_wait. */
MB_DEV void mb_stage_rows(float *dst, int sld, const float *src, int64_t ld, int nrows, int kc,
                          int64_t k, int64_t k1, bool vec, int tid, int nthreads)
{
    const int q = kc / 4;
    if (vec && k + kc <= k1) { /* the common case: whole aligned rows, no edge */
        for (int i = tid; i < nrows * q; i += nthreads) {
            const int r = i / q, c = (i % q) * 4;
            mb_cp_async16(dst + r * sld + c, src + r * ld + k + c, 16);
        }
        return;
    }
    for (int i = tid; i < nrows * q; i += nthreads) {
        const int r = i / q, c = (i % q) * 4;
        const float *s = src + r * ld + k + c;
        float *d = dst + r * sld + c;
        const int64_t left = k1 - (k + c);
        if (vec) {
            mb_cp_async16(d, left > 0 ? s : src, left >= 4 ? 16 : left > 0 ? 4 * (int)left : 0);
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) mb_cp_async4(d + j, left > j ? s + j : src, left > j ? 4 : 0);
        }
    }
}

/* A decode session's guard word (finite.cu): all ones while no step has been
 * refused; a refused step leaves the state alone and writes NaN outputs. Kernels
 * called outside a session get NULL. */
#define MB_QNAN __int_as_float(0x7fc00000)
MB_DEV bool mb_refused(const unsigned long long *guard) { return guard && *guard != ~0ull; }

/* Whether the calling block, by one of its threads, is the last of `blocks` to
 * count itself in *count; the last sets it back to 0 for the next launch. The
 * block's reads before the call are complete, and the fence makes its writes
 * visible to the last block. */
MB_DEV bool mb_last_block(unsigned *count, unsigned blocks)
{
    __threadfence();
    const bool last = atomicAdd(count, 1u) == blocks - 1;
    if (last) *count = 0;
    return last;
}

/* Programmatic dependent launch (sm_90): a decode session's graph launches the
 * kernels _cuda.WAITS names so that each may start while its predecessor runs; such
 * a kernel waits for its predecessor's results, then lets its own successor start
 * (so at most one kernel waits beside the running one, and no grid is placed on the
 * multiprocessors around several earlier ones). Every thread must pass
 * MB_GRID_WAIT() before touching memory other than weights, so a grid completes only
 * after its predecessor did. Without the launch attribute (and on HIP) it returns at
 * once. The emulation defines its own, which counts. */
#ifndef MB_GRID_WAIT
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MB_GRID_WAIT() \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n" ::: "memory")
#else
#define MB_GRID_WAIT() ((void)0)
#endif
#endif

/* First index of a grid-stride loop over n items in x, and its stride. */
#define MB_GRID_LOOP(i, n)                                                          \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);       \
         i += (int64_t)gridDim.x * blockDim.x)

#endif
