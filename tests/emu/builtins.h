/* The CUDA built-ins the kernels use, for g++ (tests/emu). The kernels compile under
 * vendor.h's HIP spelling, whose cp.async stand-ins are plain copies; each GPU thread
 * is a fiber of fibers.cpp, and a block's fibers run one at a time on one OS thread. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <vector>

#define __global__ __attribute__((used)) /* build.py lists the kernels by this mark */
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/* thread_local, not static: one copy for the fibers of a block, and `extern
 * __shared__` (dynamic shared memory, defined in fibers.cpp) stays valid C++. */
#define __shared__ thread_local

struct dim3 { unsigned x, y, z; };
extern "C" dim3 threadIdx, blockIdx, blockDim, gridDim;

/* Park the calling fiber until every live thread of its block (or of its warp of
 * 32) has arrived. */
extern "C" void __syncthreads(void);
extern "C" void mb_emu_warp_sync(void);
extern "C" uint64_t mb_emu_lane[];  /* one exchange word per thread of the block */

/* A 16-byte copy from or to an address the GPU would fault on (cp.async): the
 * launch fails with what. */
extern "C" void mb_emu_fault(const char *what);
#define MB_CHECK_ALIGNED16(p) \
    if ((uintptr_t)(p) & 15) mb_emu_fault("a 16-byte copy at a misaligned address: " #p)

/* cp.async as the hardware may run it: a thread's copies land only when one of its
 * waits covers their group (vendor.h mb_cp_wait), so a kernel that reads a copy's
 * destination before that reads what was there before. mb_emu_cp_reset forgets a
 * finished block's copies. MB_EMU_WAIT_SLACK (a test's negative control) leaves
 * that many more groups in flight at every wait. */
#define MB_EMU_CP_ASYNC
#ifndef MB_EMU_WAIT_SLACK
#define MB_EMU_WAIT_SLACK 0
#endif
struct mb_emu_copy { float *dst; const float *src; int bytes, floats, group; };
extern std::vector<mb_emu_copy> mb_emu_copies[]; /* per thread of the block (fibers.cpp) */
extern int mb_emu_commits[];
void mb_emu_cp_reset(unsigned threads);
static inline void mb_cp_async16(float *dst, const float *src, int src_bytes)
{
    MB_CHECK_ALIGNED16(dst);
    MB_CHECK_ALIGNED16(src);
    mb_emu_copies[threadIdx.x].push_back({dst, src, src_bytes, 4, mb_emu_commits[threadIdx.x]});
}
static inline void mb_cp_async4(float *dst, const float *src, int src_bytes)
{
    mb_emu_copies[threadIdx.x].push_back({dst, src, src_bytes, 1, mb_emu_commits[threadIdx.x]});
}
static inline void mb_cp_commit() { mb_emu_commits[threadIdx.x]++; }
template <int N> static inline void mb_cp_wait()
{
    std::vector<mb_emu_copy> &q = mb_emu_copies[threadIdx.x], left;
    for (const mb_emu_copy &c : q) {
        /* uncommitted, or among the N newest committed groups */
        if (c.group >= mb_emu_commits[threadIdx.x] - N - MB_EMU_WAIT_SLACK) {
            left.push_back(c);
            continue;
        }
        for (int i = 0; i < c.floats; i++) c.dst[i] = 4 * i < c.bytes ? c.src[i] : 0.0f;
    }
    q.swap(left);
}

/* Counts the threads that pass it: the driver checks that a kernel launched as a
 * programmatic dependent waits in every thread (vendor.h). */
extern "C" void mb_emu_grid_wait(void);
#define MB_GRID_WAIT() mb_emu_grid_wait()

/* CUDA's __shfl_sync semantics: src is taken modulo width within the caller's
 * segment of width lanes. */
template <class T> static inline T __shfl(T v, int src, int width = 32)
{
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves one register");
    const unsigned me = threadIdx.x, from = (me & ~(width - 1u)) + (src & (width - 1));
    memcpy(&mb_emu_lane[me], &v, sizeof v);
    mb_emu_warp_sync();
    T r;
    memcpy(&r, &mb_emu_lane[from], sizeof r);
    mb_emu_warp_sync(); /* no lane overwrites its word before every lane has read */
    return r;
}
template <class T> static inline T __shfl_xor(T v, int mask, int width = 32)
{
    return __shfl(v, (int)(threadIdx.x & (width - 1)) ^ mask, width);
}

/* __syncthreads that also returns whether pred is non-zero in every thread of the
 * (one-dimensional) block. */
static inline int __syncthreads_and(int pred)
{
    mb_emu_lane[threadIdx.x] = pred != 0;
    __syncthreads();
    int all = 1;
    for (unsigned i = 0; i < blockDim.x; i++) all &= mb_emu_lane[i] != 0;
    __syncthreads(); /* no thread overwrites its word before every thread has read */
    return all;
}

struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float4 __ldcg(const float4 *p) { return *p; }

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }

/* Fibers never run at the same time, so a read-modify-write is atomic. */
static inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v)
{
    const unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}
static inline unsigned atomicAdd(unsigned *p, unsigned v)
{
    const unsigned old = *p;
    *p = old + v;
    return old;
}
static inline unsigned atomicExch(unsigned *p, unsigned v)
{
    const unsigned old = *p;
    *p = v;
    return old;
}
static inline void __threadfence(void) {}
static inline void __threadfence_system(void) {}

/* mma.m16n8k8 TF32 (vendor.h's fragment layout) across the 32 fibers of the caller's
 * warp: operands truncated to TF32 as the tensor core reads them, each output's eight
 * products summed in double and added to c (fast mode promises accuracy, not bits). */
#define MB_MMA 1
static inline uint32_t mb_tf32(float x) { return __float_as_uint(x) + 0x1000u; }
static inline void mb_mma_tf32(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                               uint32_t b0, uint32_t b1)
{
    thread_local uint32_t ops[1024][6]; /* a block's fibers share one OS thread */
    const unsigned me = threadIdx.x, base = me & ~31u, g = me % 32 / 4, t = me % 4;
    const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
    memcpy(ops[me], mine, sizeof mine);
    mb_emu_warp_sync();
    auto tf = [](uint32_t u) { return (double)__uint_as_float(u & 0xffffe000u); };
    float r[4];
    for (unsigned e = 0; e < 4; e++) {
        const unsigned row = g + 8 * (e / 2), col = 2 * t + e % 2;
        double sum = 0.0;
        for (unsigned k = 0; k < 8; k++)
            sum += tf(ops[base + row % 8 * 4 + k % 4][row / 8 + 2 * (k / 4)]) *
                   tf(ops[base + col * 4 + k % 4][4 + k / 4]);
        r[e] = (float)((double)c[e] + sum);
    }
    mb_emu_warp_sync(); /* no lane overwrites its operands before every lane has read */
    memcpy(c, r, sizeof r);
}

/* fast mode's hardware approximations (never compared bitwise); glibc declares an
 * __expf and a __sincosf of its own, hence the macros */
#define __expf expf
#define __sincosf mb_emu_sincosf
static inline float __fdividef(float a, float b) { return a / b; }
static inline void mb_emu_sincosf(float x, float *s, float *c)
{
    *s = sinf(x);
    *c = cosf(x);
}
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
