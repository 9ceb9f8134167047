// Probe (not built): cycles a term of the decode chain schedules; nvcc -O3 -std=c++17 --fmad=false -arch=sm_90 -Ibackends/kernels -Ireference bench/chain_rate.cu -o cr && ./cr
// Chain rate probe: cycles per term of dot v1's serial chain over shared memory,
// GEMV layout (warp 0 lane r walks row r; x broadcast), K terms from a staged tile
// of KC terms reused K/KC times. Loaders (warps 1..7) optionally stream cp.async.
#include "chain.h"
#include <cstdio>
#include <cstdlib>
#define KC 256
#define LD (KC + 4)
#define LDX(p) (*(const float4 *)(p))
#define FMA4(a, b) { acc = fmaf((a).x, (b).x, acc); acc = fmaf((a).y, (b).y, acc); acc = fmaf((a).z, (b).z, acc); acc = fmaf((a).w, (b).w, acc); }

// 4 buffers of 4 terms; each refilled right after it is walked, 16 terms ahead
template <bool SQ> __device__ __forceinline__ float chain4(float acc, const float *x, const float *w, int kc)
{
    float4 a[4], v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) { a[i] = LDX(x + 4 * i); v[i] = SQ ? a[i] : LDX(w + 4 * i); }
#pragma unroll 1
    for (int k = 0; k < kc; k += 16) {
        const bool more = k + 16 < kc;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            FMA4(a[i], v[i])
            if (more) { a[i] = LDX(x + k + 16 + 4 * i); v[i] = SQ ? a[i] : LDX(w + k + 16 + 4 * i); }
        }
    }
    return acc;
}
// 8 buffers of 4 terms, 32 ahead (kc multiple of 32)
template <bool SQ> __device__ __forceinline__ float chain8(float acc, const float *x, const float *w, int kc)
{
    float4 a[8], v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) { a[i] = LDX(x + 4 * i); v[i] = SQ ? a[i] : LDX(w + 4 * i); }
#pragma unroll 1
    for (int k = 0; k < kc; k += 32) {
        const bool more = k + 32 < kc;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            FMA4(a[i], v[i])
            if (more) { a[i] = LDX(x + k + 32 + 4 * i); v[i] = SQ ? a[i] : LDX(w + k + 32 + 4 * i); }
        }
    }
    return acc;
}
// 16 buffers of 4 terms, 64 ahead (kc multiple of 64)
template <bool SQ> __device__ __forceinline__ float chain16(float acc, const float *x, const float *w, int kc)
{
    float4 a[16], v[16];
#pragma unroll
    for (int i = 0; i < 16; i++) { a[i] = LDX(x + 4 * i); v[i] = SQ ? a[i] : LDX(w + 4 * i); }
#pragma unroll 1
    for (int k = 0; k < kc; k += 64) {
        const bool more = k + 64 < kc;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            FMA4(a[i], v[i])
            if (more) { a[i] = LDX(x + k + 64 + 4 * i); v[i] = SQ ? a[i] : LDX(w + k + 64 + 4 * i); }
        }
    }
    return acc;
}
// registers only: the same 16 terms again and again (the fma's own rate)
__device__ __forceinline__ float chainreg(float acc, const float *x, const float *w, int kc)
{
    float4 a[2], v[2];
    for (int i = 0; i < 2; i++) { a[i] = LDX(x + 4 * i); v[i] = LDX(w + 4 * i); }
#pragma unroll 1
    for (int k = 0; k < kc; k += 8) { FMA4(a[0], v[0]) FMA4(a[1], v[1]) }
    return acc;
}

template <int V, bool SQ>
__global__ void __launch_bounds__(256) probe(const float *g, float *out, long long *cyc, int K, int load)
{
    extern __shared__ __align__(16) float sm[];
    float *Ws = sm, *Xs = sm + 32 * LD, *Rs = Xs + LD; // Rs: loaders' ring, 2 x 32 x LD
    const int tid = threadIdx.x, lane = tid % 32, w = tid / 32;
    for (int i = tid; i < 32 * LD; i += 256) Ws[i] = g[i % 4096] * 0.001f;
    for (int i = tid; i < LD; i += 256) Xs[i] = g[(i * 7) % 4096];
    __syncthreads();
    if (w == 0) {
        float acc = 0.0f;
        const float *x = Xs, *wr = SQ ? Xs : Ws + lane * LD;
        long long t0 = clock64();
        for (int c = 0; c < K / KC; c++) {
            if (V == 0) acc = mb_chain_tile<SQ>(acc, x, wr, KC);
            else if (V == 1) acc = chain4<SQ>(acc, x, wr, KC);
            else if (V == 2) acc = chain8<SQ>(acc, x, wr, KC);
            else if (V == 4) acc = chain16<SQ>(acc, x, wr, KC);
            else acc = chainreg(acc, x, wr, KC);
        }
        long long t1 = clock64();
        out[blockIdx.x * 32 + lane] = acc;
        if (lane == 0) cyc[blockIdx.x] = t1 - t0;
    } else if (load) { // keep the shared-memory pipe busy as the GEMV's loaders do
        for (int c = 0; c < K / KC; c++) {
            mb_stage_rows(Rs + (c % 2) * 32 * LD, LD, g, 4096 / KC * 0 + KC, 32, KC, 0, KC, true, tid - 32, 224);
            mb_cp_commit();
            mb_cp_wait<1>();
        }
        mb_cp_wait<0>();
    }
}

template <int V, bool SQ> void run(const char *name, const float *g, float *o, long long *c, int K, int load, int blocks)
{
    const int smem = (32 * LD + LD + 2 * 32 * LD) * 4;
    cudaFuncSetAttribute(probe<V, SQ>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    long long h[132];
    double best = 1e30, sum = 0;
    for (int r = 0; r < 5; r++) {
        probe<V, SQ><<<blocks, 256, smem>>>(g, o, c, K, load);
        cudaError_t e = cudaDeviceSynchronize();
        if (e) { printf("%s: %s\n", name, cudaGetErrorString(e)); exit(1); }
        cudaMemcpy(h, c, blocks * 8, cudaMemcpyDeviceToHost);
        double m = 0; for (int b = 0; b < blocks; b++) m += h[b]; m /= blocks;
        if (r) { best = m < best ? m : best; sum += m; }
    }
    printf("%-12s K %5d load %d blocks %3d: %.3f cycles/term (best %.3f)\n", name, K, load, blocks, sum / 4 / K, best / K);
}
int main()
{
    float *g, *o; long long *c;
    cudaMalloc(&g, 4096 * 4 + 64 * 1024 * 4); cudaMalloc(&o, 132 * 32 * 4); cudaMalloc(&c, 132 * 8);
    float *hg = (float *)malloc(4096 * 4); for (int i = 0; i < 4096; i++) hg[i] = (float)((i * 2654435761u) % 1000) / 1000.0f;
    cudaMemcpy(g, hg, 4096 * 4, cudaMemcpyHostToDevice);
    for (int load = 1; load < 2; load++)
        for (int blocks : {132}) {
            run<0, false>("tile (now)", g, o, c, 2048, load, blocks);
            run<1, false>("4x4 ahead16", g, o, c, 2048, load, blocks);
            run<2, false>("8x4 ahead32", g, o, c, 2048, load, blocks);
            run<4, false>("16x4 ahead64", g, o, c, 2048, load, blocks);
            run<4, true>("sq 16x4", g, o, c, 2048, load, blocks);
            run<3, false>("registers", g, o, c, 2048, load, blocks);
            run<0, true>("sq tile", g, o, c, 2048, load, blocks);
            run<1, true>("sq 4x4", g, o, c, 2048, load, blocks);
            run<2, true>("sq 8x4", g, o, c, 2048, load, blocks);
        }
    return 0;
}
