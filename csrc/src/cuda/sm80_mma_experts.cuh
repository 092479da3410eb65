/*
 * sm80_mma_experts.cuh — the expert tiles of 16-128 rows on mma.sync (sm_80 on; bf16 and fp16 weights,
 * and fp8 weights widened to bf16): mma_kernel, the tile
 * shapes it is built in (BK, stages, shared memory per block) and its setup and launch. experts.cu
 * launches it; experts_plan.cu reads its tile shapes. fp8 weights (mma_kernel given a ScaleGrid): each
 * stage's e4m3 rows land in the first half of their bf16 region and are widened there, times their
 * scales, before the products (mma_f8_widen). See docs/cuda-design.md.
 */
#ifndef COLIBRI_CUDA_SM80_MMA_EXPERTS_CUH
#define COLIBRI_CUDA_SM80_MMA_EXPERTS_CUH

#include "gemv.cuh"
#include "sm80_mma.cuh"

#define MMA_BN 128
/* Shared memory one block may take so that two fit on an H200 SM (228 KB, 1 KB reserved per block). */
#define MMA_SMEM_TWO_PER_SM (113 * 1024)
#define MMA_SMEM_THREE_PER_SM (75 * 1024)
#define MMA_SMEM_ONE_PER_SM (226 * 1024)
/* Tiles of 16 rows, and of up to MMA_LONG_K_MAX_BM rows from K = MMA_LONG_K elements on, read 256
 * contiguous bytes of each weight row per stage (BK = 128) where the device has the shared memory for
 * it (see mma_bk). */
#define MMA_LONG_K 4096
#define MMA_LONG_K_MAX_BM 32
/* The narrow 16-row kernel (BN = 64 columns, 128 threads) runs where its grid fills the last wave of
 * the GPU clearly better than BN = 128 does (mma_narrow). */
#define MMA_NARROW_BN 64

template <int BM> constexpr int mma_warps_m() { return BM >= 32 ? 2 : 1; }
template <int BM, class Act, int BK, int BN = MMA_BN> constexpr size_t mma_stage_bytes() {
    return (size_t)(BM + BN * (Act::glu ? 2 : 1)) * BK * 2;
}
/* BK: the k elements of a stage. Longer runs of each weight row keep HBM's pages open (BK=32 reads 64
 * bytes a row and streamed at half of copy bandwidth): 64 where three stages still let two blocks share
 * an SM, but 32 for 64-row GLU tiles and the compute-bound 128-row ones; LONG (the launch's choice, see
 * mma16_long): 128 for tiles of up to 32 rows even at one block per SM. Figures: docs/performance.md. */
template <int BM, class Act, int BN = MMA_BN, bool LONG = false> constexpr int mma_bk() {
    if (LONG && BM <= MMA_LONG_K_MAX_BM && 3 * mma_stage_bytes<BM, Act, 128, BN>() <= MMA_SMEM_ONE_PER_SM) return 128;
    return BM < 128 && 3 * mma_stage_bytes<BM, Act, 64, BN>() <= MMA_SMEM_TWO_PER_SM ? 64 : 32;
}
/* Narrow tiles (BN < 128, small batches): as many stages (4 or 3) as still let three blocks share an SM. */
template <int BM, class Act, int BK, int BN = MMA_BN> constexpr int mma_stages() {
    if constexpr (BN < MMA_BN) return 4 * mma_stage_bytes<BM, Act, BK, BN>() <= MMA_SMEM_THREE_PER_SM ? 4 : 3;
    return BK == 32 || 4 * mma_stage_bytes<BM, Act, BK>() <= MMA_SMEM_TWO_PER_SM ? 4 : 3;
}
template <int BM, class Act, int BK, int BN = MMA_BN> constexpr size_t mma_smem_bytes() {
    return (size_t)mma_stages<BM, Act, BK, BN>() * mma_stage_bytes<BM, Act, BK, BN>();
}

/* fp8 weights: a stage's e4m3 rows of BK bytes lie packed at the start of their matrix's bf16 region
 * (BN rows of BK 16-bit elements, swizzled), the raw 16-byte chunk c of row r at r BK + 16 c. Each thread
 * copies F8_PER_T chunks of each matrix and widens the same ones: into registers (its own cp.async
 * groups are complete), then, once every thread has read its chunks (the block barrier between),
 * times the scale of the chunk's block as bf16 into the swizzled rows mma_b_step reads. */
template <int BK, int BN> constexpr int mma_f8_per_t() { return BN * BK / 16 / (2 * BN); }

template <int BK, int BN, int NMAT>
__device__ __forceinline__ void mma_f8_read(uint32_t b, uint32_t b_bytes, uint4 (&raw)[NMAT][mma_f8_per_t<BK, BN>()]) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int i = 0; i < mma_f8_per_t<BK, BN>(); i++) {
            const uint32_t at = b + m * b_bytes + (uint32_t)(tid + i * 2 * BN) * 16;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(raw[m][i].x), "=r"(raw[m][i].y), "=r"(raw[m][i].z), "=r"(raw[m][i].w)
                         : "r"(at));
        }
}

/* The widening of mma_f8_read's chunks: row r = idx / (BK / 16) of the stage (output column n0 + r), its
 * k elements k0 + 16 (idx % (BK / 16)) + 0..15; chunks past n or K were zero-filled and take no scale. */
template <int BK, int BN, int NMAT>
__device__ __forceinline__ void mma_f8_widen(uint32_t b, uint32_t b_bytes, const uint4 (&raw)[NMAT][mma_f8_per_t<BK, BN>()],
                                             const ScaleGrid &g, int expert, int n0, int n, int k0, int k) {
    constexpr int CPR = BK / 16;
    const int tid = threadIdx.x;
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int i = 0; i < mma_f8_per_t<BK, BN>(); i++) {
            const int idx = tid + i * 2 * BN, r = idx / CPR, c = idx % CPR, kc = k0 + 16 * c;
            const bool ok = n0 + r < n && kc < k;
            const float s = ok ? __ldg(g.row(expert, m, n0 + r) + (kc >> g.k_shift)) : 0.0f;
            Pack<F8E4M3, 16> q;
            *reinterpret_cast<uint4 *>(&q) = raw[m][i];
            float f[16];
            f8_to_f32<16>(q, f);
            uint32_t h[8];
#pragma unroll
            for (int j = 0; j < 8; j++) h[j] = pack2<__nv_bfloat16>(f[2 * j] * s, f[2 * j + 1] * s);
            const uint32_t row = b + m * b_bytes;
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(row + swz<BK>(r, 2 * c)), "r"(h[0]),
                         "r"(h[1]), "r"(h[2]), "r"(h[3]));
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(row + swz<BK>(r, 2 * c + 1)), "r"(h[4]),
                         "r"(h[5]), "r"(h[6]), "r"(h[7]));
        }
}

/* The weight type of mma_kernel with these trailing parameters: T, or fp8 given a ScaleGrid. */
template <class T, class... S> struct MmaWeight { using type = T; };
template <class T> struct MmaWeight<T, ScaleGrid> { using type = F8E4M3; };

/* BN columns of weights per block, 2 * BN threads: each warp's share (16 or 32 columns) is the same
 * for every BN. S: nothing (16-bit weights of T), or fp8 weights' ScaleGrid (T bf16): a parameter pack
 * rather than a wrapper around a shared body, which moved ptxas's registers in the 16-bit kernels. */
template <class T, int BM, class Act, int BK, int BN = MMA_BN, class... S>
__global__ void __launch_bounds__(2 * BN) mma_kernel(ProjArgs a, S... scales) {
    using TW = typename MmaWeight<T, S...>::type;
    constexpr bool F8 = is_fp8<TW>;
    constexpr int THREADS = 2 * BN;
    constexpr int WARPS_M = mma_warps_m<BM>(), WARPS_N = THREADS / 32 / WARPS_M;
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N, MI = WTM / 16, NI = WTN / 8;
    constexpr int NMAT = Act::glu ? 2 : 1, STAGES = mma_stages<BM, Act, BK, BN>();
    constexpr int CPR = BK / 8; /* 16-byte chunks per smem row */
    constexpr int A_CHUNKS = BM * CPR, B_CHUNKS = BN * CPR;
    constexpr int A_PER_T = (A_CHUNKS + THREADS - 1) / THREADS, B_PER_T = B_CHUNKS / THREADS;
    constexpr uint32_t A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    constexpr uint32_t STAGE_BYTES = A_BYTES + NMAT * B_BYTES;

    /* a.early (the second projection): the tile table was complete before the first projection's
     * blocks passed their wait, and they let this kernel launch only after it (below), so this block
     * reads its tile (from L2) and issues its first stages' weights before it waits for x, the first
     * projection's output: those loads run in the first projection's last wave. */
    if (!a.early) {
        pdl_wait();
        pdl_trigger(); /* after the wait: the next kernel may read the tile table early */
    }
    if ((int)blockIdx.x >= __ldcg(a.num_tiles)) return;
    const ExpertTile tile = colibri_tile_ldcg(a.tiles + blockIdx.x);
    const int n0 = blockIdx.y * BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;

    extern __shared__ __align__(128) char smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);

    /* the rows this thread copies stay the same for every k tile */
    const T *a_src[A_PER_T];
    bool a_ok[A_PER_T];
#pragma unroll
    for (int i = 0; i < A_PER_T; i++) {
        const int idx = tid + i * THREADS, r = idx / CPR, p = tile.begin + r;
        a_ok[i] = idx < A_CHUNKS && p < tile.end;
        const int row = a_ok[i] ? (a.row_map ? a.row_map[p] / a.row_div : p) : 0;
        a_src[i] = reinterpret_cast<const T *>(a.x) + (size_t)row * a.k + (idx % CPR) * 8;
    }
    /* the weight chunks this thread copies: 8 16-bit elements, or (fp8) 16 bytes of F8_CPR a row */
    constexpr int F8_CPR = BK / 16, B_CHUNK = F8 ? 16 : 8, B_CPR = F8 ? F8_CPR : CPR;
    constexpr int B_N = F8 ? mma_f8_per_t<BK, BN>() : B_PER_T;
    const TW *b_src[NMAT][B_N];
    bool b_ok[B_N];
    const char *wexp = a.w + (size_t)tile.expert * a.w_expert_stride;
#pragma unroll
    for (int i = 0; i < B_N; i++) {
        const int idx = tid + i * THREADS, n = n0 + idx / B_CPR;
        b_ok[i] = n < a.n;
#pragma unroll
        for (int m = 0; m < NMAT; m++)
            b_src[m][i] = reinterpret_cast<const TW *>(wexp + m * a.w_second) + (size_t)(b_ok[i] ? n : 0) * a.k +
                          (idx % B_CPR) * B_CHUNK;
    }

    const int ktiles = (a.k + BK - 1) / BK;
    auto load_a = [&](int kt) {
        const uint32_t st = sbase + (uint32_t)(kt % STAGES) * STAGE_BYTES;
        const int k0 = kt * BK;
#pragma unroll
        for (int i = 0; i < A_PER_T; i++) {
            const int idx = tid + i * THREADS;
            if (idx < A_CHUNKS) {
                const bool ok = a_ok[i] && k0 + (idx % CPR) * 8 < a.k;
                cp_async16(st + swz<BK>(idx / CPR, idx % CPR), ok ? (const void *)(a_src[i] + k0) : a.x, ok);
            }
        }
    };
    auto load_b = [&](int kt) {
        const uint32_t st = sbase + (uint32_t)(kt % STAGES) * STAGE_BYTES;
        const int k0 = kt * BK;
#pragma unroll
        for (int m = 0; m < NMAT; m++) {
#pragma unroll
            for (int i = 0; i < B_N; i++) {
                const int idx = tid + i * THREADS;
                const bool ok = b_ok[i] && k0 + (idx % B_CPR) * B_CHUNK < a.k;
                if constexpr (F8) /* packed raw rows (mma_f8_read) */
                    cp_async16(st + A_BYTES + m * B_BYTES + (uint32_t)idx * 16,
                               ok ? (const void *)(b_src[m][i] + k0) : (const void *)a.w, ok);
                else
                    cp_async16(st + A_BYTES + m * B_BYTES + swz<BK>(idx / CPR, idx % CPR),
                               ok ? (const void *)(b_src[m][i] + k0) : (const void *)a.w, ok);
            }
        }
    };

    float acc[NMAT][MI][NI][4];
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NI; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[m][i][j][q] = 0.0f;

    if (a.early) {
        /* the first stages' weights now, their x rows after the wait: stage s's group then holds them
         * both (stage 0's also the other stages' weights), complete by the time the loop waits for it */
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if (s < ktiles) load_b(s);
        pdl_wait();
        pdl_trigger();
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) {
            load_a(s);
            if (!a.early) load_b(s);
        }
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<STAGES - 2>();
        if constexpr (F8) {
            /* this thread's raw chunks of stage kt (its own copies, complete) before the barrier, their
             * bf16 rows over every thread's after it; then a second barrier before the products */
            const uint32_t sw = sbase + (uint32_t)(kt % STAGES) * STAGE_BYTES + A_BYTES;
            uint4 raw[NMAT][mma_f8_per_t<BK, BN>()];
            mma_f8_read<BK, BN, NMAT>(sw, B_BYTES, raw);
            __syncthreads();
            mma_f8_widen<BK, BN, NMAT>(sw, B_BYTES, raw, scales..., tile.expert, n0, a.n, kt * BK, a.k);
        }
        __syncthreads();
        if (kt + STAGES - 1 < ktiles) {
            load_a(kt + STAGES - 1);
            load_b(kt + STAGES - 1);
        }
        cp_async_commit();
        const uint32_t st = sbase + (uint32_t)(kt % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            uint32_t af[MI][4];
            mma_a_frags<BK>(st, wm * WTM, ks, af);
#pragma unroll
            for (int m = 0; m < NMAT; m++) mma_b_step<T, BK>(st + A_BYTES + m * B_BYTES, wn * WTN, ks, af, acc[m]);
        }
    }
    cp_async_wait<0>();

    T *out = reinterpret_cast<T *>(a.out);
#pragma unroll
    for (int i = 0; i < MI; i++) {
#pragma unroll
        for (int j = 0; j < NI; j++) {
            const int col = n0 + wn * WTN + j * 8 + (lane & 3) * 2;
            if (col >= a.n) continue;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int p = tile.begin + wm * WTM + i * 16 + (lane >> 2) + h * 8;
                if (p >= tile.end) continue;
                float v0 = acc[0][i][j][2 * h], v1 = acc[0][i][j][2 * h + 1];
                if constexpr (Act::glu) {
                    float u0 = acc[NMAT - 1][i][j][2 * h], u1 = acc[NMAT - 1][i][j][2 * h + 1];
                    colibri_glu_bias(a, tile.expert, col, v0, u0);
                    colibri_glu_bias(a, tile.expert, col + 1, v1, u1);
                    v0 = Act::apply(v0, u0, a);
                    v1 = Act::apply(v1, u1, a);
                }
                *reinterpret_cast<uint32_t *>(out + (size_t)p * a.n + col) = pack2<T>(v0, v1);
            }
        }
    }
}

/* Sets the dynamic shared memory of mma_kernel of T, or of its fp8 variant for T = F8E4M3. */
template <class T, int BM, class Act, int BK, int BN = MMA_BN> static cudaError_t mma_setup_one() {
    if constexpr (is_fp8<T>)
        return cudaFuncSetAttribute(mma_kernel<__nv_bfloat16, BM, Act, BK, BN, ScaleGrid>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)mma_smem_bytes<BM, Act, BK, BN>());
    else
        return cudaFuncSetAttribute(mma_kernel<T, BM, Act, BK, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)mma_smem_bytes<BM, Act, BK, BN>());
}

/* The BN-column kernels of BM-row tiles: BK=32, the BK=64 one where mma_bk picks it and the device has
 * the shared memory (wide_k), the long-K one likewise (long_k). */
template <class T, int BM, class Act, int BN> static cudaError_t mma_setup_bn(bool wide_k, bool long_k) {
    cudaError_t e = mma_setup_one<T, BM, Act, 32, BN>();
    if constexpr (mma_bk<BM, Act, BN>() > 32)
        if (e == cudaSuccess && wide_k) e = mma_setup_one<T, BM, Act, mma_bk<BM, Act, BN>(), BN>();
    if constexpr (mma_bk<BM, Act, BN, true>() != mma_bk<BM, Act, BN>())
        if (e == cudaSuccess && long_k) e = mma_setup_one<T, BM, Act, mma_bk<BM, Act, BN, true>(), BN>();
    return e;
}

/* for 16-row tiles also the narrow kernels */
template <class T, int BM, class Act> static cudaError_t mma_setup_bm(bool wide_k, bool long_k) {
    cudaError_t e = mma_setup_bn<T, BM, Act, MMA_BN>(wide_k, long_k);
    if constexpr (BM == 16)
        if (e == cudaSuccess) e = mma_setup_bn<T, BM, Act, MMA_NARROW_BN>(wide_k, long_k);
    return e;
}

template <class T, class Act> static cudaError_t mma_setup_all(bool wide_k, bool long_k) {
    cudaError_t e;
    if ((e = mma_setup_bm<T, 16, Act>(wide_k, long_k)) != cudaSuccess) return e;
    if ((e = mma_setup_bm<T, 32, Act>(wide_k, long_k)) != cudaSuccess) return e;
    if ((e = mma_setup_bm<T, 64, Act>(wide_k, long_k)) != cudaSuccess) return e;
    return mma_setup_bm<T, 128, Act>(wide_k, long_k);
}

/* The BK of the BN-column kernel of BM-row tiles that runs for (wide_k, long_k): the long-K one where it
 * differs and the projection takes it, the BK=64 one where the device has its shared memory, else 32. */
template <int BM, class Act, int BN> static int mma_pick_bk(bool wide_k, bool long_k) {
    constexpr int LBK = mma_bk<BM, Act, BN, true>(), WBK = mma_bk<BM, Act, BN>();
    return LBK != WBK && long_k ? LBK : WBK > 32 && wide_k ? WBK : 32;
}

/* mma_kernel of T, or its fp8 variant (bf16 x and out) with the scales g for T = F8E4M3 */
template <class T, int BM, class Act, int BK, int BN>
static cudaError_t mma_launch_one(const ProjArgs &a, dim3 grid, const ScaleGrid &g, cudaStream_t stream) {
    if constexpr (is_fp8<T>)
        return colibri_launch(mma_kernel<__nv_bfloat16, BM, Act, BK, BN, ScaleGrid>, grid, dim3(2 * BN), mma_smem_bytes<BM, Act, BK, BN>(),
                              stream, a, g);
    else
        return colibri_launch(mma_kernel<T, BM, Act, BK, BN>, grid, dim3(2 * BN), mma_smem_bytes<BM, Act, BK, BN>(),
                              stream, a);
}

template <class T, int BM, class Act, int BN>
static cudaError_t mma_launch_bn(const ProjArgs &a, int64_t slots, bool wide_k, bool long_k, const ScaleGrid &g,
                                 cudaStream_t stream) {
    const dim3 grid((unsigned)slots, (unsigned)((a.n + BN - 1) / BN));
    constexpr int LBK = mma_bk<BM, Act, BN, true>(), WBK = mma_bk<BM, Act, BN>();
    const int bk = mma_pick_bk<BM, Act, BN>(wide_k, long_k);
    if constexpr (LBK != WBK)
        if (bk == LBK) return mma_launch_one<T, BM, Act, LBK, BN>(a, grid, g, stream);
    if constexpr (WBK > 32)
        if (bk == WBK) return mma_launch_one<T, BM, Act, WBK, BN>(a, grid, g, stream);
    return mma_launch_one<T, BM, Act, 32, BN>(a, grid, g, stream);
}

/* long_k: the device fits the BK=128 kernels and the projection takes them (see mma_bk). T = F8E4M3: fp8
 * weights with the scales g, x and out bf16 (rows of K a multiple of 16). */
template <class T, class Act>
static cudaError_t mma_launch(const ProjArgs &a, int tile_m, int64_t slots, bool wide_k, bool long_k, bool narrow,
                              const ScaleGrid &g, cudaStream_t stream) {
    switch (tile_m) {
    case 16:
        if (narrow) return mma_launch_bn<T, 16, Act, MMA_NARROW_BN>(a, slots, wide_k, long_k, g, stream);
        return mma_launch_bn<T, 16, Act, MMA_BN>(a, slots, wide_k, long_k, g, stream);
    case 32: return mma_launch_bn<T, 32, Act, MMA_BN>(a, slots, wide_k, long_k, g, stream);
    case 64: return mma_launch_bn<T, 64, Act, MMA_BN>(a, slots, wide_k, long_k, g, stream);
    default: return mma_launch_bn<T, 128, Act, MMA_BN>(a, slots, wide_k, long_k, g, stream);
    }
}
template <class T, class Act>
static cudaError_t mma_launch(const ProjArgs &a, int tile_m, int64_t slots, bool wide_k, bool long_k, bool narrow,
                              cudaStream_t stream) {
    return mma_launch<T, Act>(a, tile_m, slots, wide_k, long_k, narrow, ScaleGrid{}, stream);
}

/* Blocks of one 16-row kernel an SM holds (0 if the query fails). */
template <class Act, int BK, int BN> static int mma16_occupancy() {
    int blocks = 0;
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, mma_kernel<__nv_bfloat16, 16, Act, BK, BN>, 2 * BN, mma_smem_bytes<16, Act, BK, BN>());
    return e == cudaSuccess ? blocks : 0;
}

/* Blocks of the 16-row kernel (BN = 128, or narrow) one SM holds, for the wave estimate below: the
 * kernel mma_launch_bn picks for (wide_k, long_k). */
template <class Act, int BN> static int mma16_blocks_per_sm(bool wide_k, bool long_k) {
    if (long_k) return mma16_occupancy<Act, mma_bk<16, Act, BN, true>(), BN>();
    if (wide_k) return mma16_occupancy<Act, mma_bk<16, Act, BN>(), BN>();
    return mma16_occupancy<Act, 32, BN>();
}

#endif /* COLIBRI_CUDA_SM80_MMA_EXPERTS_CUH */
