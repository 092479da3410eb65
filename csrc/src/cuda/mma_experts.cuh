/*
 * mma_experts.cuh — the expert tiles of 16-128 rows on mma.sync (sm_80 on): mma_kernel, the tile
 * shapes it is built in (BK, stages, shared memory per block) and its setup and launch. experts.cu
 * launches it; experts_plan.cu reads its tile shapes. See docs/cuda-design.md.
 */
#ifndef COLIBRI_CUDA_MMA_EXPERTS_CUH
#define COLIBRI_CUDA_MMA_EXPERTS_CUH

#include "gemv.cuh"
#include "mma.cuh"

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

/* BN columns of weights per block, 2 * BN threads: each warp's share (16 or 32 columns) is the same
 * for every BN. */
template <class T, int BM, class Act, int BK, int BN = MMA_BN>
__global__ void __launch_bounds__(2 * BN) mma_kernel(ProjArgs a) {
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
    const T *b_src[NMAT][B_PER_T];
    bool b_ok[B_PER_T];
    const char *wexp = a.w + (size_t)tile.expert * a.w_expert_stride;
#pragma unroll
    for (int i = 0; i < B_PER_T; i++) {
        const int idx = tid + i * THREADS, n = n0 + idx / CPR;
        b_ok[i] = n < a.n;
#pragma unroll
        for (int m = 0; m < NMAT; m++)
            b_src[m][i] = reinterpret_cast<const T *>(wexp + m * a.w_second) + (size_t)(b_ok[i] ? n : 0) * a.k +
                          (idx % CPR) * 8;
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
            for (int i = 0; i < B_PER_T; i++) {
                const int idx = tid + i * THREADS;
                const bool ok = b_ok[i] && k0 + (idx % CPR) * 8 < a.k;
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

template <class T, int BM, class Act, int BK, int BN = MMA_BN> static cudaError_t mma_setup_one() {
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

template <class T, int BM, class Act, int BN>
static cudaError_t mma_launch_bn(const ProjArgs &a, int64_t slots, bool wide_k, bool long_k, cudaStream_t stream) {
    const dim3 grid((unsigned)slots, (unsigned)((a.n + BN - 1) / BN));
    constexpr int LBK = mma_bk<BM, Act, BN, true>(), WBK = mma_bk<BM, Act, BN>();
    const int bk = mma_pick_bk<BM, Act, BN>(wide_k, long_k);
    if constexpr (LBK != WBK)
        if (bk == LBK)
            return colibri_launch(mma_kernel<T, BM, Act, LBK, BN>, grid, dim3(2 * BN),
                                  mma_smem_bytes<BM, Act, LBK, BN>(), stream, a);
    if constexpr (WBK > 32)
        if (bk == WBK)
            return colibri_launch(mma_kernel<T, BM, Act, WBK, BN>, grid, dim3(2 * BN),
                                  mma_smem_bytes<BM, Act, WBK, BN>(), stream, a);
    return colibri_launch(mma_kernel<T, BM, Act, 32, BN>, grid, dim3(2 * BN), mma_smem_bytes<BM, Act, 32, BN>(),
                          stream, a);
}

/* long_k: the device fits the BK=128 kernels and the projection takes them (see mma_bk) */
template <class T, class Act>
static cudaError_t mma_launch(const ProjArgs &a, int tile_m, int64_t slots, bool wide_k, bool long_k, bool narrow,
                              cudaStream_t stream) {
    switch (tile_m) {
    case 16:
        if (narrow) return mma_launch_bn<T, 16, Act, MMA_NARROW_BN>(a, slots, wide_k, long_k, stream);
        return mma_launch_bn<T, 16, Act, MMA_BN>(a, slots, wide_k, long_k, stream);
    case 32: return mma_launch_bn<T, 32, Act, MMA_BN>(a, slots, wide_k, long_k, stream);
    case 64: return mma_launch_bn<T, 64, Act, MMA_BN>(a, slots, wide_k, long_k, stream);
    default: return mma_launch_bn<T, 128, Act, MMA_BN>(a, slots, wide_k, long_k, stream);
    }
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

#endif /* COLIBRI_CUDA_MMA_EXPERTS_CUH */
