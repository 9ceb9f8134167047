/* numeric_mode="fast": Y = X . W^T (+ res) on Hopper's warpgroup tensor cores, for
 * the machine code nvcc builds for sm_90a only (elsewhere the kernel is absent and
 * the loader keeps fast.cu's mma.sync GEMM).
 *
 * A block computes a 128 x 256 tile of Y. Warpgroup 0 is the producer: one thread
 * streams 32-term slices of X (128 rows) and W (256 rows) into WG_STAGES shared-
 * memory stages by TMA (the tensor maps, made by the host per call, describe X and
 * W as TF32 with the 128-byte swizzle, so the copy itself rounds every operand to
 * TF32, to nearest, and fills terms past K, rows past M or N with zeros).
 * Warpgroups 1 and 2 take rows 0-63 and 64-127 of the tile, each as four
 * wgmma.m64n256k8 a stage, their 128 accumulators a thread summed in fp32 in one
 * fixed order (no atomics: the same bits on every run), one stage's products left in
 * flight while the next stage's issue. Barriers: full[s] (the stage's bytes
 * arrived), empty[s] (the 256 consumer threads are done with it).
 * Blocks walk the tiles in groups of WG_GROUP row tiles, so the blocks resident
 * together share W's tiles in L2. */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_BM 128
#define WG_BN 256
#define WG_BK 32
#define WG_STAGES 4
#define WG_GROUP 8
#define WG_A_BYTES (WG_BM * WG_BK * 4)
#define WG_B_BYTES (WG_BN * WG_BK * 4)

struct __align__(64) mb_tmap { uint64_t v[16]; }; /* a CUtensorMap's 128 opaque bytes */

MB_DEV uint32_t mb_smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

MB_DEV void mb_bar_init(uint64_t *b, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mb_smem_addr(b)), "r"(count));
}
MB_DEV void mb_bar_expect(uint64_t *b, int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mb_smem_addr(b)),
                 "r"(bytes) : "memory");
}
MB_DEV void mb_bar_arrive(uint64_t *b)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(mb_smem_addr(b)) : "memory");
}
/* Wait for the completion of b's phase of this parity. */
MB_DEV void mb_bar_wait(uint64_t *b, int parity)
{
    asm volatile("{\n.reg .pred p;\nWAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}" ::"r"(mb_smem_addr(b)), "r"(parity) : "memory");
}
/* The box of tm at (c0 along K, c1 along rows) into dst; its bytes complete b's phase. */
MB_DEV void mb_tma_load(void *dst, const mb_tmap *tm, int c0, int c1, uint64_t *b)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(mb_smem_addr(dst)), "l"((uint64_t)tm),
                 "r"(c0), "r"(c1), "r"(mb_smem_addr(b)) : "memory");
}
/* wgmma's view of K-major rows of 128 bytes, 128-byte swizzle: 8-row atoms 1024
 * bytes apart. Stepping 8 terms (32 bytes) along K moves the start address only. */
MB_DEV uint64_t mb_wg_desc(const void *p)
{
    return (uint64_t)((mb_smem_addr(p) & 0x3FFFF) >> 4) | (uint64_t)1 << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

#define MB_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                 "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
/* d = A . B^T (+ d when acc) over 8 terms: A 64 rows, B 256 rows, both from shared
 * memory. */
MB_DEV void mb_wgmma_256(float d[128], uint64_t a, uint64_t b, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
                 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
                 "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
                 "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
                 "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127},"
                 " %128, %129, p, 1, 1;\n}"
                 : MB_D8(0), MB_D8(8), MB_D8(16), MB_D8(24), MB_D8(32), MB_D8(40), MB_D8(48),
                   MB_D8(56), MB_D8(64), MB_D8(72), MB_D8(80), MB_D8(88), MB_D8(96), MB_D8(104),
                   MB_D8(112), MB_D8(120)
                 : "l"(a), "l"(b), "r"(acc));
}
#undef MB_D8

/* Dynamic shared memory: _cuda.py WGMMA_SMEM (the stages, their barriers, and 1 KiB
 * to align the stages to the swizzle's 1024-byte atoms). */
MB_KERNEL void MB_BOUNDS_MIN(384, 1)
mb_fast_wgmma_k(int64_t M, int64_t N, int64_t K, const __grid_constant__ mb_tmap tmx,
                const __grid_constant__ mb_tmap tmw, float *Y, int64_t ldy, const float *res,
                int64_t ldr)
{
    extern __shared__ unsigned char wg_raw[];
    unsigned char *sm = (unsigned char *)(((uintptr_t)wg_raw + 1023) & ~(uintptr_t)1023);
    float *As = (float *)sm, *Bs = (float *)(sm + WG_STAGES * WG_A_BYTES);
    uint64_t *full = (uint64_t *)(sm + WG_STAGES * (WG_A_BYTES + WG_B_BYTES));
    uint64_t *empty = full + WG_STAGES;
    const int tid = threadIdx.x, wg = tid / 128;
    const int64_t tm = (M + WG_BM - 1) / WG_BM, tn = (N + WG_BN - 1) / WG_BN;
    const int64_t t = blockIdx.x, per = WG_GROUP * tn, first = t / per * WG_GROUP;
    const int64_t rows = tm - first < WG_GROUP ? tm - first : WG_GROUP;
    const int m0 = (int)((first + t % per % rows) * WG_BM), n0 = (int)(t % per / rows * WG_BN);
    const int chunks = (int)((K + WG_BK - 1) / WG_BK);
    if (tid == 0) {
        for (int s = 0; s < WG_STAGES; s++) {
            mb_bar_init(full + s, 1);
            mb_bar_init(empty + s, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) { /* the producer: few registers, so the consumers may have 232 */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0)
            for (int c = 0; c < chunks; c++) {
                const int s = c % WG_STAGES, round = c / WG_STAGES;
                mb_bar_wait(empty + s, (round & 1) ^ 1); /* round 0: a fresh barrier passes */
                mb_bar_expect(full + s, WG_A_BYTES + WG_B_BYTES);
                mb_tma_load(As + s * WG_BM * WG_BK, &tmx, c * WG_BK, m0, full + s);
                mb_tma_load(Bs + s * WG_BN * WG_BK, &tmw, c * WG_BK, n0, full + s);
            }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int half = wg - 1, lane = tid % 32, w = tid / 32 % 4, g = lane / 4, t4 = lane % 4;
    float d[128]; /* the first products write it */
    for (int c = 0; c < chunks; c++) {
        const int s = c % WG_STAGES;
        mb_bar_wait(full + s, c / WG_STAGES & 1);
        const float *A = As + (s * WG_BM + half * 64) * WG_BK, *B = Bs + s * WG_BN * WG_BK;
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int k = 0; k < WG_BK; k += 8) mb_wgmma_256(d, mb_wg_desc(A + k), mb_wg_desc(B + k), c | k);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        /* the previous stage's products are done (this one's stay in flight): free it */
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (c > 0) mb_bar_arrive(empty + (c - 1) % WG_STAGES);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    /* d[4 j + e]: row 16 w + g (+8 for e >= 2) of this half, column 8 j + 2 t4 + (e & 1).
     * A whole tile adds res in a pass of its own, its loads ahead of their sums: between
     * stores to Y (which the compiler must assume may alias res), or behind the bounds'
     * branches, each load would wait for the one before. An edge tile adds it as it
     * stores. */
    const bool pair = ((ldy | ldr) & 1) == 0 && (((uintptr_t)Y | (uintptr_t)res) & 7) == 0;
    const bool whole = res && pair && m0 + WG_BM <= M && n0 + WG_BN <= N;
    if (whole) {
        const float *rb = res + (int64_t)(m0 + half * 64 + 16 * w + g) * ldr + n0 + 2 * t4;
#pragma unroll
        for (int j0 = 0; j0 < WG_BN / 8; j0 += 8) {
            float2 r[8][2];
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int u = 0; u < 2; u++)
                    r[j][u] = *(const float2 *)(rb + 8 * u * ldr + 8 * (j0 + j));
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    float *o = d + 4 * (j0 + j) + 2 * u;
                    o[0] = r[j][u].x + o[0], o[1] = r[j][u].y + o[1];
                }
        }
    }
#pragma unroll
    for (int j = 0; j < WG_BN / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            const int64_t m = m0 + half * 64 + 16 * w + g + (e ? 8 : 0), n = n0 + 8 * j + 2 * t4;
            mb_put_pair(Y, ldy, whole ? nullptr : res, ldr, M, N, m, n, d[4 * j + e],
                        d[4 * j + e + 1], pair);
        }
}
#endif
