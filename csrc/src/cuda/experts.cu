/*
 * experts.cu — the expert FFNs over tokens grouped by expert (permute.cu's tile table).
 *
 * colibri_cuda_experts_tile_m picks the path per forward: the gemv (gemv.cuh) for at most 8 assignments,
 * fp32 weights or rows that are not 16-byte multiples; else mma_kernel (mma.sync tiles of 16-64 rows,
 * here) or, for 128-row tiles on sm_90a, wgmma (wgmma.cuh). Also the launchers (project,
 * project_combine) and the L2 prefetch beside the router. Outputs: inter [T*k, F] and y [T*k, O] in the
 * weight dtype, rows in sorted order (direct mode: assignment order). See docs/cuda-design.md.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "gemv.cuh"
#include "mma.cuh"

#define MMA_BN 128
#define MMA_THREADS 256
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

template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    T v[2] = {from_f32<T>(lo), from_f32<T>(hi)};
    return *reinterpret_cast<uint32_t *>(v);
}

template <int BM> constexpr int mma_warps_m() { return BM >= 32 ? 2 : 1; }
template <int BM, bool GLU, int BK, int BN = MMA_BN> constexpr size_t mma_stage_bytes() {
    return (size_t)(BM + BN * (GLU ? 2 : 1)) * BK * 2;
}
/* A BK=32 stage reads only 64 contiguous bytes of each weight row, and the next piece of that row
 * follows a k step later, by which time HBM has long closed the page: the memory-bound tiles (up to 64
 * rows) streamed weights at about half of copy bandwidth. BK=64 doubles each run, where three stages
 * of it still let two blocks share an SM (the bytes in flight per SM stay about the same): 1.6-1.7x
 * at T=64 on an H200. The GLU tiles of 64 rows keep BK=32 rather than drop to one
 * block per SM, and so do the 128-row tiles, where the GEMM is compute-bound: BK=64 with 3 stages
 * measured 2-7% slower there.
 * LONG: the tiles of up to 32 rows take BK=128, 256-byte runs, even where three stages of it leave one
 * block per SM (the bytes in flight stay the same). Measured on an H200: Mixtral T=16
 * and T=64 (K = 4096 and 14336; 16- and 32-row tiles) 1.06-1.09x, the fine-grained experts' 16-row
 * tiles (K = 1408-2048, T=16 and 64) 1.00-1.05x, but their 32-row tiles (T=256) 0.97-1.00x and their
 * 16-row tiles of a short grid (Qwen T=4) 0.95x: the launch asks for LONG from K = MMA_LONG_K on, or
 * with 16-row tiles whose grid is a few waves (mma16_long). */
template <int BM, bool GLU, int BN = MMA_BN, bool LONG = false> constexpr int mma_bk() {
    if (LONG && BM <= MMA_LONG_K_MAX_BM && 3 * mma_stage_bytes<BM, GLU, 128, BN>() <= MMA_SMEM_ONE_PER_SM) return 128;
    return BM < 128 && 3 * mma_stage_bytes<BM, GLU, 64, BN>() <= MMA_SMEM_TWO_PER_SM ? 64 : 32;
}
/* Narrow tiles (BN < 128, small batches): as many stages (4 or 3) as still let three blocks share an SM. */
template <int BM, bool GLU, int BK, int BN = MMA_BN> constexpr int mma_stages() {
    if constexpr (BN < MMA_BN) return 4 * mma_stage_bytes<BM, GLU, BK, BN>() <= MMA_SMEM_THREE_PER_SM ? 4 : 3;
    return BK == 32 || 4 * mma_stage_bytes<BM, GLU, BK>() <= MMA_SMEM_TWO_PER_SM ? 4 : 3;
}
template <int BM, bool GLU, int BK, int BN = MMA_BN> constexpr size_t mma_smem_bytes() {
    return (size_t)mma_stages<BM, GLU, BK, BN>() * mma_stage_bytes<BM, GLU, BK, BN>();
}

/* BN columns of weights per block, 2 * BN threads: each warp's share (16 or 32 columns) is the same
 * for every BN. */
template <class T, int BM, bool GLU, int BK, int BN = MMA_BN>
__global__ void __launch_bounds__(2 * BN) mma_kernel(ProjArgs a) {
    constexpr int THREADS = 2 * BN;
    constexpr int WARPS_M = mma_warps_m<BM>(), WARPS_N = THREADS / 32 / WARPS_M;
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N, MI = WTM / 16, NI = WTN / 8;
    constexpr int NMAT = GLU ? 2 : 1, STAGES = mma_stages<BM, GLU, BK, BN>();
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
                if (GLU) {
                    v0 = silu_f32(v0) * acc[NMAT - 1][i][j][2 * h];
                    v1 = silu_f32(v1) * acc[NMAT - 1][i][j][2 * h + 1];
                }
                *reinterpret_cast<uint32_t *>(out + (size_t)p * a.n + col) = pack2<T>(v0, v1);
            }
        }
    }
}

#include "wgmma.cuh"

template <class T, int BM, bool GLU, int BK, int BN = MMA_BN> static cudaError_t mma_setup_one() {
    return cudaFuncSetAttribute(mma_kernel<T, BM, GLU, BK, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)mma_smem_bytes<BM, GLU, BK, BN>());
}

/* The BN-column kernels of BM-row tiles: BK=32, the BK=64 one where mma_bk picks it and the device has
 * the shared memory (wide_k), the long-K one likewise (long_k). */
template <class T, int BM, bool GLU, int BN> static cudaError_t mma_setup_bn(bool wide_k, bool long_k) {
    cudaError_t e = mma_setup_one<T, BM, GLU, 32, BN>();
    if constexpr (mma_bk<BM, GLU, BN>() > 32)
        if (e == cudaSuccess && wide_k) e = mma_setup_one<T, BM, GLU, mma_bk<BM, GLU, BN>(), BN>();
    if constexpr (mma_bk<BM, GLU, BN, true>() != mma_bk<BM, GLU, BN>())
        if (e == cudaSuccess && long_k) e = mma_setup_one<T, BM, GLU, mma_bk<BM, GLU, BN, true>(), BN>();
    return e;
}

/* for 16-row tiles also the narrow kernels */
template <class T, int BM, bool GLU> static cudaError_t mma_setup_bm(bool wide_k, bool long_k) {
    cudaError_t e = mma_setup_bn<T, BM, GLU, MMA_BN>(wide_k, long_k);
    if constexpr (BM == 16)
        if (e == cudaSuccess) e = mma_setup_bn<T, BM, GLU, MMA_NARROW_BN>(wide_k, long_k);
    return e;
}

template <class T, bool GLU> static cudaError_t mma_setup_all(bool wide_k, bool long_k) {
    cudaError_t e;
    if ((e = mma_setup_bm<T, 16, GLU>(wide_k, long_k)) != cudaSuccess) return e;
    if ((e = mma_setup_bm<T, 32, GLU>(wide_k, long_k)) != cudaSuccess) return e;
    if ((e = mma_setup_bm<T, 64, GLU>(wide_k, long_k)) != cudaSuccess) return e;
    return mma_setup_bm<T, 128, GLU>(wide_k, long_k);
}

/* The BK of the BN-column kernel of BM-row tiles that runs for (wide_k, long_k): the long-K one where it
 * differs and the projection takes it, the BK=64 one where the device has its shared memory, else 32. */
template <int BM, bool GLU, int BN> static int mma_pick_bk(bool wide_k, bool long_k) {
    constexpr int LBK = mma_bk<BM, GLU, BN, true>(), WBK = mma_bk<BM, GLU, BN>();
    return LBK != WBK && long_k ? LBK : WBK > 32 && wide_k ? WBK : 32;
}

template <class T, int BM, bool GLU, int BN>
static cudaError_t mma_launch_bn(const ProjArgs &a, int64_t slots, bool wide_k, bool long_k, cudaStream_t stream) {
    const dim3 grid((unsigned)slots, (unsigned)((a.n + BN - 1) / BN));
    constexpr int LBK = mma_bk<BM, GLU, BN, true>(), WBK = mma_bk<BM, GLU, BN>();
    const int bk = mma_pick_bk<BM, GLU, BN>(wide_k, long_k);
    if constexpr (LBK != WBK)
        if (bk == LBK)
            return colibri_launch(mma_kernel<T, BM, GLU, LBK, BN>, grid, dim3(2 * BN),
                                  mma_smem_bytes<BM, GLU, LBK, BN>(), stream, a);
    if constexpr (WBK > 32)
        if (bk == WBK)
            return colibri_launch(mma_kernel<T, BM, GLU, WBK, BN>, grid, dim3(2 * BN),
                                  mma_smem_bytes<BM, GLU, WBK, BN>(), stream, a);
    return colibri_launch(mma_kernel<T, BM, GLU, 32, BN>, grid, dim3(2 * BN), mma_smem_bytes<BM, GLU, 32, BN>(),
                          stream, a);
}

/* long_k: the device fits the BK=128 kernels and the projection takes them (see mma_bk) */
template <class T, bool GLU>
static cudaError_t mma_launch(const ProjArgs &a, int tile_m, int64_t slots, bool wide_k, bool long_k, bool narrow,
                              cudaStream_t stream) {
    switch (tile_m) {
    case 16:
        if (narrow) return mma_launch_bn<T, 16, GLU, MMA_NARROW_BN>(a, slots, wide_k, long_k, stream);
        return mma_launch_bn<T, 16, GLU, MMA_BN>(a, slots, wide_k, long_k, stream);
    case 32: return mma_launch_bn<T, 32, GLU, MMA_BN>(a, slots, wide_k, long_k, stream);
    case 64: return mma_launch_bn<T, 64, GLU, MMA_BN>(a, slots, wide_k, long_k, stream);
    default: return mma_launch_bn<T, 128, GLU, MMA_BN>(a, slots, wide_k, long_k, stream);
    }
}

/* Blocks of one 16-row kernel an SM holds (0 if the query fails). */
template <bool GLU, int BK, int BN> static int mma16_occupancy() {
    int blocks = 0;
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, mma_kernel<__nv_bfloat16, 16, GLU, BK, BN>, 2 * BN, mma_smem_bytes<16, GLU, BK, BN>());
    return e == cudaSuccess ? blocks : 0;
}

/* Blocks of the 16-row kernel (BN = 128, or narrow) one SM holds, for the wave estimate below: the
 * kernel mma_launch_bn picks for (wide_k, long_k). */
template <bool GLU, int BN> static int mma16_blocks_per_sm(bool wide_k, bool long_k) {
    if (long_k) return mma16_occupancy<GLU, mma_bk<16, GLU, BN, true>(), BN>();
    if (wide_k) return mma16_occupancy<GLU, mma_bk<16, GLU, BN>(), BN>();
    return mma16_occupancy<GLU, 32, BN>();
}

#if COLIBRI_TMA
/* Whether environment variable `name` is set to something other than "" or "0" (the switches below). */
static bool env_on(const char *name) {
    const char *v = getenv(name);
    return v && v[0] && strcmp(v, "0") != 0;
}
#endif

/* The BK=64 kernels take up to 3 * 288 rows * 128 bytes of shared memory per block: more than devices
 * with about 100 KB per block (sm_86, sm_89) allow; those keep BK=32 everywhere. */
colibri_status_t colibri_cuda_experts_setup(CudaBackend *b) {
    int optin = 0;
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, b->device));
    b->mma_wide_k = (size_t)optin >= MMA_SMEM_TWO_PER_SM;
    b->mma_long_k = (size_t)optin >= MMA_SMEM_ONE_PER_SM;
    const bool w = b->mma_wide_k, l = b->mma_long_k;
    COLIBRI_CUDA_CHECK((mma_setup_all<__nv_bfloat16, true>(w, l)));
    COLIBRI_CUDA_CHECK((mma_setup_all<__nv_bfloat16, false>(w, l)));
    COLIBRI_CUDA_CHECK((mma_setup_all<__half, true>(w, l)));
    COLIBRI_CUDA_CHECK((mma_setup_all<__half, false>(w, l)));
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&b->sm_count, cudaDevAttrMultiProcessorCount, b->device));
    b->wgmma = wgmma_available(b->device);
    int major = 0;
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, b->device));
    b->l2_prefetch = major == 9; /* the plan assumes a Hopper L2 and SM (see COLIBRI_PREFETCH_BYTES) */
    if (b->wgmma) {
        COLIBRI_CUDA_CHECK((wgmma_setup_one<__nv_bfloat16, true>()));
        COLIBRI_CUDA_CHECK((wgmma_setup_one<__nv_bfloat16, false>()));
        COLIBRI_CUDA_CHECK((wgmma_setup_one<__half, true>()));
        COLIBRI_CUDA_CHECK((wgmma_setup_one<__half, false>()));
#if COLIBRI_TMA
        /* the warp-specialised kernel where the driver encodes tensor maps, else wgmma_kernel (also with
         * COLIBRI_CUDA_NO_WS=1: how the harness checks wgmma_kernel on an H100/H200) */
        b->tma_encode = env_on("COLIBRI_CUDA_NO_WS") ? NULL : ws_encode_fn();
        int clusters = -1;
        if (b->tma_encode && (wgmma_ws_setup_one<__nv_bfloat16, true>(&clusters) != cudaSuccess ||
                              wgmma_ws_setup_one<__nv_bfloat16, false>(&clusters) != cudaSuccess ||
                              wgmma_ws_setup_one<__half, true>(&clusters) != cudaSuccess ||
                              wgmma_ws_setup_one<__half, false>(&clusters) != cudaSuccess)) {
            (void)cudaGetLastError();
            b->tma_encode = NULL;
        }
        /* COLIBRI_CUDA_NO_MC=1: the tiles an expert shares stay on the one-block kernel (harness, timing) */
        b->ws_clusters = b->tma_encode && !env_on("COLIBRI_CUDA_NO_MC") && clusters > 0 ? clusters : 0;
#endif
    }
    for (int lk = 0; lk < 2; lk++) {
        b->mma16_blocks_per_sm[0][0][lk] = mma16_blocks_per_sm<false, MMA_BN>(w, lk && l);
        b->mma16_blocks_per_sm[0][1][lk] = mma16_blocks_per_sm<false, MMA_NARROW_BN>(w, lk && l);
        b->mma16_blocks_per_sm[1][0][lk] = mma16_blocks_per_sm<true, MMA_BN>(w, lk && l);
        b->mma16_blocks_per_sm[1][1][lk] = mma16_blocks_per_sm<true, MMA_NARROW_BN>(w, lk && l);
    }
    return COLIBRI_OK;
}

/* Whether a 16-row projection of n outputs runs the narrow kernel: when its grid over the experts
 * likely touched (top-k of num_tokens tokens spread evenly over E) ends in a clearly fuller last wave
 * than the BN = 128 grid does. Small batches leave most of a wave idle with BN = 128 (Qwen T=4: 0.6 of
 * one wave) or a ragged last one (Mixtral T=16: 3.4 waves). */
static double mma16_touched(const colibri_moe_config_t *c, int64_t num_tokens) {
    const double E = c->num_experts;
    return E * (1.0 - pow(1.0 - (double)c->top_k / E, (double)num_tokens));
}

/* Waves of the 16-row grid of n outputs (BN = 128 or narrow; long_k: the BK=128 kernel) on this device. */
static double mma16_waves(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, bool glu, int32_t n,
                          bool narrow, bool long_k) {
    const int bn = narrow ? MMA_NARROW_BN : MMA_BN, per_sm = b->mma16_blocks_per_sm[glu][narrow][long_k];
    if (per_sm <= 0) return 0.0;
    return mma16_touched(c, num_tokens) * ((n + bn - 1) / bn) / ((double)b->sm_count * per_sm);
}

static bool mma_narrow(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, bool glu, int32_t n,
                       bool long_k) {
    double fill[2];
    for (int narrow = 0; narrow < 2; narrow++) {
        const double waves = mma16_waves(b, c, num_tokens, glu, n, narrow, long_k);
        if (waves <= 0.0) return false;
        fill[narrow] = waves / ceil(waves);
    }
    return fill[1] > fill[0] + 0.05;
}

/* Whether a 16-row projection of short rows (K < MMA_LONG_K) takes BK=128: only where its BN = 128 grid
 * is at least MMA16_LONG_MIN_WAVES waves of that kernel, whose blocks per SM are fewer. Qwen T=4 (15
 * experts touched, 1.2 waves of it) read 0.097 against 0.092 ms with BK=128; T=16 and 64 (3-13
 * waves) gained 1-5%. */
#define MMA16_LONG_MIN_WAVES 2.0
static bool mma16_long(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, bool glu, int32_t n) {
    return mma16_waves(b, c, num_tokens, glu, n, false, true) >= MMA16_LONG_MIN_WAVES;
}

/* Where the tensor cores could run, the few-tokens path serves at most this many assignments: with so
 * few experts touched a tensor-core grid (a row of blocks per expert, each looping over all of K)
 * leaves SMs idle, while the gemv spreads an expert over N/8 short blocks. On an H200 the gemv was
 * faster up to T*k = 8, the 16-row tile from T*k = 16 on (1.11-1.47x); the gemv up to T*k = 24 made
 * DeepSeek T=4 0.84x, Qwen T=4 0.90x. */
#define GEMV_MAX_ASSIGNMENTS 8

/* Direct mode with short rows (at most this many bytes of weights per warp and row: fine-grained experts,
 * 2.8-8 KB) launches about GEMV_LOOP_BLOCKS_PER_SM blocks per SM (what the registers of the 1- and
 * 2-row kernels allow) whose warps loop over rows, rather than a block per 8 rows: a block's setup (its
 * expert found in the ids: an L2 round trip and a few barriers) and its wait for a free slot are then
 * paid once per slot, not once per 8 rows. Measured: DeepSeek T=1 0.052 -> 0.046 ms,
 * Qwen 0.040 -> 0.036; 2 blocks per SM for the up projection, leaving a slot for the down one to
 * start early, was no faster. Long rows (Mixtral: 16-28 KB per warp) keep a block per 8 rows. */
#define GEMV_SHORT_ROW_BYTES 8192
#define GEMV_LOOP_BLOCKS_PER_SM 3

#define WS_SMALL_TILE_MIN_EXPERTS 32

/* 1..GEMV_GROUP: the few-tokens path (gemv.cuh) with that many token rows per pass: the smallest of 2,
 * 4, 8 at or above 1.5x the mean assignments per expert (1 for at most one per expert on average
 * when the experts outnumber the assignments 4 to 1). 16..128: the tensor-core tile height, ~1.5x the
 * mean assignments per expert so that most experts fit in one tile and their weights are read once
 * (tiles of just the mean were slower: 1.42 against 1.26 ms for Mixtral at T=64); but 32 rather than
 * 64 where 1.3x the mean still fits 32 rows, as the 64-row GLU tile keeps BK=32 (DeepSeek T=256 1.37x
 * with 32). */
int32_t colibri_cuda_experts_tile_m(const colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                    const void *input) {
    const colibri_moe_config_t *c = &ctx->cfg;
    const bool tensor_cores = c->weight_dtype != COLIBRI_DTYPE_F32 && c->hidden_size % 8 == 0 &&
                              c->intermediate_size % 8 == 0 && (act_dtype != c->weight_dtype || colibri_aligned16(input));
    const int64_t assignments = num_tokens * c->top_k, E = c->num_experts;
    if (!tensor_cores || assignments <= GEMV_MAX_ASSIGNMENTS) {
        if (4 * assignments <= E) return 1;
        const int64_t want3 = assignments * 3; /* 2 * (1.5 * mean) * E */
        return want3 <= 4 * E ? 2 : want3 <= 8 * E ? 4 : GEMV_GROUP;
    }
    const int64_t want = (assignments * 3 / 2 + E - 1) / E;
    int32_t tile = want <= 16 ? 16 : want <= 32 ? 32 : want <= 64 ? 64 : 128;
    if (want > 32 && want <= 64 && assignments * 13 / 10 <= 32 * E) tile = 32;
    /* With many experts, tiles of 32 or 64 rows go to the 128-row warp-specialised kernel instead (its
     * producer streams the weights of a partial tile well, and its items hand out by a counter): measured
     * on an H200: DeepSeek-V2-Lite / Qwen1.5-MoE T=256 1.05-1.08x over the 32-row
     * mma_kernel, T=384 1.46x over the 64-row one, but Mixtral (8 experts) T=64 0.98x, so not below
     * WS_SMALL_TILE_MIN_EXPERTS. */
    if (tile >= 32 && tile < WG_BM && E >= WS_SMALL_TILE_MIN_EXPERTS && ((const CudaBackend *)ctx->backend)->tma_encode)
        tile = WG_BM;
    return tile;
}

/* Few enough assignments that the few-tokens path finds each block's expert itself (no permute). */
bool colibri_cuda_experts_direct(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
    return tile_m <= GEMV_GROUP && num_tokens * ctx->cfg.top_k <= GEMV_DIRECT_MAX &&
           ctx->cfg.num_experts <= GEMV_DIRECT_MAX_E;
}

/* Whether the 128-row tiles of a projection of `assignments` stream their weights from HBM: the experts
 * have fewer assignments than a tile on average (wgmma_launch's `streaming`, and the prefetch plan). */
static bool wg_streaming(const colibri_moe_config_t *c, int64_t assignments) {
    return assignments < (int64_t)WG_BM * c->num_experts;
}

/* Whether the 128-row tiles of a projection of `assignments` run on the cluster kernel (wgmma_ws_kernel
 * with MC: an expert's weight block multicast to the two tiles of a pair, wgmma.cuh): where they are
 * compute-bound (not streaming) and the experts have at most WS_MC_MAX_TILES tiles each on average
 * (on an H200, against the one-block kernel: Mixtral T=512 1.12x, T=1024 1.07x). With more tiles per
 * expert the one-block kernel's tiles share the weight blocks in L2 among themselves and the pairs'
 * coupled k steps cost more than the halved L2 reads save (0.97-0.99x). */
#define WS_MC_MAX_TILES 2
/* Where every item's k loop is long (hidden and intermediate sizes both at least WS_MC_LONG_K: 64 stages
 * of 64 or more), the limit counts tiles with their folded rows, 128 + b->ws_fold each: the cluster kernel
 * then takes Mixtral up to 2 x 152 rows per expert (T = 1216), where the one-block kernel was 1.02-1.18x
 * slower (T = 1152, 1216; 280 rows per expert); with shorter k loops (DeepSeek-V2-Lite T = 3072, 2048 x
 * 1408 experts) the cluster kernel was 0.97x there. */
#define WS_MC_LONG_K 4096
/* The streaming projections (wg_streaming) of at most this many k elements run wgmma_ws_kernel's DRAIN
 * kernel (4 stages in flight, each stage's products waited for): measured on an H200,
 * DeepSeek-V2-Lite / Qwen1.5-MoE T = 1024 1.01-1.02x, T = 256 1.00-1.02x; on Mixtral (k = 4096 and 14336)
 * T = 256 0.99x, and 0.98-0.99x even with its products left out. */
#define WS_DRAIN_MAX_K 2048

#if COLIBRI_TMA
static bool ws_multicast(const colibri_moe_config_t *c, const CudaBackend *b, int64_t assignments) {
    const bool long_k = c->hidden_size >= WS_MC_LONG_K && c->intermediate_size >= WS_MC_LONG_K;
    const int64_t rows = WG_BM + (long_k ? b->ws_fold : 0);
    return !wg_streaming(c, assignments) && assignments <= (int64_t)WS_MC_MAX_TILES * rows * c->num_experts;
}
#endif

bool colibri_cuda_experts_pairs(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
#if COLIBRI_TMA
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    return tile_m == WG_BM && b->ws_clusters > 0 && ws_multicast(&ctx->cfg, b, num_tokens * ctx->cfg.top_k);
#else
    (void)ctx, (void)num_tokens, (void)tile_m;
    return false;
#endif
}

/* Rows an expert's last whole tile may absorb (wgmma.cuh's folded tiles), so that a few rows do not cost a
 * tile re-reading the expert's weights: on an H200 Mixtral T=1024 1.17x, fine-grained T=4096 1.03-1.05x. */
int colibri_cuda_experts_absorb(const colibri_moe_context_t *ctx, int32_t tile_m) {
    return tile_m == WG_BM ? ((const CudaBackend *)ctx->backend)->ws_fold : 0;
}

#if COLIBRI_TMA
/* Whether the tensor maps of every projection wgmma_ws_kernel would run encode (project()'s arguments) */
template <class TW> static bool ws_maps_encode(const colibri_moe_context_t *ctx, const CudaBackend *b) {
    const colibri_moe_config_t *c = &ctx->cfg;
    const int32_t H = c->hidden_size, F = c->intermediate_size;
    const size_t mat = (size_t)F * H * sizeof(TW);
    CUtensorMap map;
    ProjArgs a = {};
    a.w = b->d_weights;
    a.w_expert_stride = b->expert_stride;
    a.n = F;
    a.k = H;
    if (c->expert_kind != COLIBRI_EXPERT_SWIGLU) return ws_tensor_map<TW, false>(b->tma_encode, a, c->num_experts, &map);
    a.w_second = mat;
    if (!ws_tensor_map<TW, true>(b->tma_encode, a, c->num_experts, &map)) return false;
    a.w = b->d_weights + 2 * mat;
    a.w_second = 0;
    a.n = H;
    a.k = F;
    return ws_tensor_map<TW, false>(b->tma_encode, a, c->num_experts, &map);
}
#endif

/* An expert's last rows fold into its last whole tile (permute_scan's absorb) only where every projection of
 * 128-row tiles will run wgmma_ws_kernel, the one kernel that multiplies them: 16-bit weights, the map
 * encoder, and this context's tensor maps encoding (checked once here, so that project() never meets a
 * folded table it cannot run; it refuses one rather than drop rows). */
void colibri_cuda_experts_fold_setup(const colibri_moe_context_t *ctx, CudaBackend *b) {
    b->ws_fold = 0;
#if COLIBRI_TMA
    const colibri_moe_config_t *c = &ctx->cfg;
    if (!b->tma_encode || c->hidden_size % 8 || c->intermediate_size % 8) return;
    bool ok = false;
    if (c->weight_dtype == COLIBRI_DTYPE_BF16) ok = ws_maps_encode<__nv_bfloat16>(ctx, b);
    else if (c->weight_dtype == COLIBRI_DTYPE_F16) ok = ws_maps_encode<__half>(ctx, b);
    b->ws_fold = ok ? WS_EXTRA_ROWS : 0;
#else
    (void)ctx;
#endif
}

/* The mma_kernel variant of a projection of n outputs and k-element rows over tile_m-row tiles: the
 * BK=128 kernel (long_k, see mma_bk) and, for 16-row tiles, the narrow one. */
static void mma_variant(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, int32_t tile_m,
                        bool glu, int32_t n, int32_t k, bool *long_k, bool *narrow) {
    *long_k = b->mma_long_k && (k >= MMA_LONG_K || (tile_m == 16 && mma16_long(b, c, num_tokens, glu, n)));
    *narrow = tile_m == 16 && mma_narrow(b, c, num_tokens, glu, n, *long_k);
}

/* One projection over the tile table (or, direct_ids given, over the distinct experts of those ids):
 * x rows -> out [positions, n], weights at byte offset `first` (and `first + second` for the up matrix of
 * a GLU) inside each expert. `bookkeeping`: this projection keeps the direct mode's counters. */
template <class TW, class TX, bool GLU>
static cudaError_t project(const colibri_moe_context_t *ctx, int64_t assignments, int32_t tile_m, size_t first,
                           size_t second, int32_t n, int32_t k, const void *x, const int32_t *row_map, void *out,
                           bool x_aligned, const int32_t *direct_ids, bool bookkeeping, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int64_t active = assignments < ctx->cfg.num_experts ? assignments : ctx->cfg.num_experts;
    int64_t slots = assignments / tile_m + active;
    ProjArgs a = {};
    a.w = b->d_weights + first;
    a.w_expert_stride = b->expert_stride;
    a.w_second = second;
    a.n = n;
    a.k = k;
    a.x = x;
    a.row_map = row_map;
    a.row_div = ctx->cfg.top_k;
    a.out = out;
    a.tiles = b->tiles;
    a.num_tiles = b->num_tiles;
    a.sched = b->ws_sched + (row_map ? 0 : 2);
    if (direct_ids) {
        /* positions are assignment indices: x row t = position / k for the first projection, which reads
         * the tokens (row_map given), the position itself for the second, which reads inter */
        a.row_div = row_map ? ctx->cfg.top_k : 1;
        a.tiles = NULL;
        a.num_tiles = NULL;
        a.row_map = NULL;
        a.ids = direct_ids;
        a.num_ids = (int32_t)assignments;
        a.num_experts = ctx->cfg.num_experts;
        a.totals = bookkeeping ? b->totals : NULL;
        a.bad_id = bookkeeping ? b->bad_id : NULL;
        a.early = !bookkeeping;
        slots = active;
    }
    if (tile_m <= GEMV_GROUP) {
        int row_blocks = 0;
        const size_t row_bytes = (size_t)k * sizeof(TW) * (GLU ? 2 : 1);
        if (direct_ids && row_bytes <= GEMV_SHORT_ROW_BYTES)
            row_blocks = (int)(((int64_t)GEMV_LOOP_BLOCKS_PER_SM * b->sm_count + slots - 1) / slots);
        return gemv_launch<TW, TX, TW, GLU>(a, slots, tile_m, k % 8 == 0 && x_aligned, row_blocks, stream);
    }
    if constexpr (sizeof(TW) == 2 && std::is_same<TW, TX>::value) {
#if COLIBRI_TMA
        /* GLU: the map takes the up matrix as the gate matrix's next n rows */
        CUtensorMap map;
        if (tile_m == WG_BM && b->tma_encode && (!GLU || second == (size_t)n * k * sizeof(TW)) &&
            ws_tensor_map<TW, GLU>(b->tma_encode, a, ctx->cfg.num_experts, &map)) {
            const int clusters = ws_multicast(&ctx->cfg, b, assignments) ? b->ws_clusters : 0;
            /* a SWIGLU forward's two projections chained per tile (wgmma.cuh, ws_chain_wait): both run here, the
             * maps of both having encoded at init (ws_fold; below, a table of 128-row tiles that does not
             * run here is refused); the second waits for the first's column blocks of F in each tile. Where
             * those are at most one group of WG_GROUP_N (F <= 2048), the first projection's items complete
             * the tiles one after another (wg_item); else only where the cluster kernel runs: Mixtral's
             * one-block kernel at 3-6 tiles per expert is bound by L2's bandwidth, which
             * the second projection's early items then take from its last ones (0.97-0.99x; 1.00x at 8
             * tiles), where on the cluster kernel (2-2.25) they gained 1.02-1.04x */
            const int32_t up_blocks = (ctx->cfg.intermediate_size + WG_BN / 2 - 1) / (WG_BN / 2);
            if (!direct_ids && b->ws_fold > 0 && ctx->cfg.expert_kind == COLIBRI_EXPERT_SWIGLU &&
                (up_blocks <= WG_GROUP_N || clusters > 0)) {
                a.ready = b->ws_ready;
                a.ready_need = GLU ? 0 : up_blocks;
            }
            const bool drain = wg_streaming(&ctx->cfg, assignments) && k <= WS_DRAIN_MAX_K;
            return wgmma_ws_launch<TW, GLU>(map, a, slots, b->sm_count, clusters, drain, stream);
        }
        /* the tile table may hold extra rows (colibri_cuda_experts_absorb) that only wgmma_ws_kernel computes */
        if (!direct_ids && colibri_cuda_experts_absorb(ctx, tile_m) > 0) return cudaErrorNotSupported;
#endif
        if (tile_m == WG_BM && b->wgmma)
            return wgmma_launch<TW, GLU>(a, slots, b->sm_count, wg_streaming(&ctx->cfg, assignments), stream);
        a.early = !bookkeeping; /* the second projection issues its first weights before its wait */
        bool long_k, narrow;
        mma_variant(b, &ctx->cfg, assignments / ctx->cfg.top_k, tile_m, GLU, n, k, &long_k, &narrow);
        return mma_launch<TW, GLU>(a, tile_m, slots, b->mma_wide_k, long_k, narrow, stream);
    }
    return cudaErrorInvalidValue;
}

/* Direct mode's down projection with the combine folded in (gemv_combine_kernel), as a ProjArgs like
 * project()'s and the output rows per block: about GEMV_LOOP_BLOCKS_PER_SM blocks per SM where the
 * rows are short (the rows x assignments pairs spread over them), else one pair per warp (long rows:
 * Mixtral's 28 KB). */
template <class TW, class TA>
static cudaError_t project_combine(const colibri_moe_context_t *ctx, int64_t assignments, size_t first,
                                   const int32_t *direct_ids, const float *topk_weights, TA *out,
                                   cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int32_t H = ctx->cfg.hidden_size, F = ctx->cfg.intermediate_size;
    ProjArgs a = {};
    a.w = b->d_weights + first;
    a.w_expert_stride = b->expert_stride;
    a.n = H;
    a.k = F;
    a.x = b->inter;
    a.row_div = 1;
    a.ids = direct_ids;
    a.num_ids = (int32_t)assignments;
    a.num_experts = ctx->cfg.num_experts;
    int64_t rows;
    if ((size_t)F * sizeof(TW) <= GEMV_SHORT_ROW_BYTES) {
        const int64_t blocks = (int64_t)GEMV_LOOP_BLOCKS_PER_SM * b->sm_count;
        rows = (H + blocks - 1) / blocks;
    } else {
        rows = (GEMV_WARPS + assignments - 1) / assignments;
    }
    rows = rows < 1 ? 1 : rows > GEMV_COMBINE_ROWS ? GEMV_COMBINE_ROWS : rows;
    return gemv_combine_launch<TW, TA>(a, topk_weights, ctx->cfg.top_k, (int)rows, out, stream);
}

colibri_status_t colibri_cuda_launch_experts(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             colibri_dtype_t act_dtype, const void *input, int32_t tile_m,
                                             const int32_t *direct_ids, const float *topk_weights, void *output,
                                             bool *combined, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const int64_t assignments = num_tokens * c->top_k;
    const int32_t H = c->hidden_size, F = c->intermediate_size;
    const size_t wsize = colibri_dtype_size(c->weight_dtype), mat = (size_t)F * H * wsize;
    const bool swiglu = c->expert_kind == COLIBRI_EXPERT_SWIGLU;
    const colibri_dtype_t out_dtype = act_dtype;
    /* the down projection of direct mode sums the top-k itself where its rows allow 16-byte loads */
    const bool fold = swiglu && direct_ids && assignments <= GEMV_COMBINE_MAX && F % 8 == 0;
    *combined = false;
    /* the tensor-core path reads x in the weight dtype */
    if (tile_m > GEMV_GROUP && act_dtype != c->weight_dtype) {
        colibri_status_t st = colibri_cuda_launch_convert(input, act_dtype, b->xc, c->weight_dtype,
                                                          num_tokens * H, stream);
        if (st != COLIBRI_OK) return st;
        input = b->xc;
        act_dtype = c->weight_dtype;
    }
    const bool in_aligned = colibri_aligned16(input);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_dtype(c->weight_dtype, [&](auto tw) {
        using TW = typename decltype(tw)::type;
        colibri_dispatch_dtype(act_dtype, [&](auto tx) {
            using TX = typename decltype(tx)::type;
            if (swiglu)
                err = project<TW, TX, true>(ctx, assignments, tile_m, 0, mat, F, H, input, b->perm, b->inter,
                                            in_aligned, direct_ids, true, stream);
            else
                err = project<TW, TX, false>(ctx, assignments, tile_m, 0, 0, F, H, input, b->perm, b->y,
                                             in_aligned, direct_ids, true, stream);
        });
        if (err == cudaSuccess && fold) {
            colibri_dispatch_dtype(out_dtype, [&](auto ta) {
                using TA = typename decltype(ta)::type;
                err = project_combine<TW, TA>(ctx, assignments, 2 * mat, direct_ids, topk_weights, (TA *)output,
                                              stream);
            });
        } else if (err == cudaSuccess && swiglu) {
            err = project<TW, TW, false>(ctx, assignments, tile_m, 2 * mat, 0, H, F, b->inter, NULL, b->y, true,
                                         direct_ids, false, stream);
        }
    });
    COLIBRI_CUDA_CHECK(err);
    *combined = fold;
    return COLIBRI_OK;
}

/* L2 prefetch of the up projection's first wave during the routing. From T = 16 to
 * 256 tokens the expert GEMMs are memory-bound, and HBM idles through the 10-25 us of router gemv,
 * top-k and permutation before them, because no expert kernel knows its experts
 * before the tile table exists. Guessing that every expert is touched (true from T = 64 on for E =
 * 60-64, k = 4-6, and for Mixtral from T = 16; 67-79% of the fine-grained experts at T = 16), a small
 * kernel running beside the router fetches into L2 the first k steps of the weight rows the first wave
 * of blocks starts on, about COLIBRI_PREFETCH_BYTES of them (L2: 50 MB on an H100/H200). */
#define COLIBRI_PREFETCH_BYTES (24u << 20)
#define PREFETCH_THREADS 256
/* Shared memory of an H100/H200 SM, for the blocks of the 32- and 64-row kernels one SM holds (the
 * 16-row ones have their occupancy measured at setup): the plan runs only on compute capability 9.x,
 * and there the registers of the kernels it meets allow as many blocks (ptxas of nvcc 13: 104-168 for
 * one or two blocks of 256 threads). */
#define PREFETCH_SM_SMEM (228 * 1024)

/* The first projection's grid as its first wave sees it: `blocks` blocks run at once, each reading `cols`
 * rows of each matrix from k = 0 on in steps of `step` bytes; the blocks go through `group` column
 * blocks of a tile before the next tile (mma_kernel: 1, its grid's x is the tile; wgmma_kernel: its
 * items' WG_GROUP_N), the tiles in expert order. blocks 0: no prefetch. */
struct PrefetchWave {
    int blocks, cols, group, step;
};

/* The mma_kernel of BM-row tiles and BN columns that mma_launch_bn picks for (wide_k, long_k). */
template <int BM, bool GLU, int BN> static PrefetchWave mma_wave(const CudaBackend *b, bool long_k) {
    constexpr int LBK = mma_bk<BM, GLU, BN, true>(), WBK = mma_bk<BM, GLU, BN>();
    const int bk = mma_pick_bk<BM, GLU, BN>(b->mma_wide_k, long_k);
    const size_t smem = bk == LBK   ? mma_smem_bytes<BM, GLU, LBK, BN>()
                        : bk == WBK ? mma_smem_bytes<BM, GLU, WBK, BN>()
                                    : mma_smem_bytes<BM, GLU, 32, BN>();
    /* 1 KB of an SM's shared memory is reserved per block */
    const int by_smem = (int)(PREFETCH_SM_SMEM / (smem + 1024)), by_threads = 2048 / (2 * BN);
    const int per_sm = BM == 16 ? b->mma16_blocks_per_sm[GLU][BN != MMA_BN][long_k]
                                : by_smem < by_threads ? by_smem : by_threads;
    return PrefetchWave{b->sm_count * per_sm, BN, 1, bk * 2};
}

template <bool GLU> static PrefetchWave mma_wave_of(const CudaBackend *b, int32_t tile_m, bool long_k, bool narrow) {
    switch (tile_m) {
    case 16: return narrow ? mma_wave<16, GLU, MMA_NARROW_BN>(b, long_k) : mma_wave<16, GLU, MMA_BN>(b, long_k);
    case 32: return mma_wave<32, GLU, MMA_BN>(b, long_k);
    default: return mma_wave<64, GLU, MMA_BN>(b, long_k);
    }
}

/* The first projection's wave where it is a tensor-core GEMM (16-bit weights, more than GEMV_MAX_ASSIGNMENTS
 * assignments) that streams its weights: tiles of up to 64 rows, or wgmma's tiles of 128 where the
 * experts have fewer assignments than a tile on average (wgmma_launch's `streaming`; mma_kernel's
 * 128-row tiles, which a cc 9.x device runs only without the sm_90a image, were not measured). The
 * compute-bound tiles re-read their weights from L2 and need it for themselves; the gemv's few experts
 * leave no wave to speak of. */
static PrefetchWave prefetch_wave(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const bool glu = c->expert_kind == COLIBRI_EXPERT_SWIGLU;
    const int64_t assignments = num_tokens * c->top_k;
    if (!b->l2_prefetch || tile_m <= GEMV_GROUP || colibri_dtype_size(c->weight_dtype) != 2) return PrefetchWave{};
    if (tile_m > 64) {
        if (!b->wgmma || !wg_streaming(c, assignments)) return PrefetchWave{};
        return PrefetchWave{b->sm_count, glu ? WG_BN / 2 : WG_BN, WG_GROUP_N, WG_BK * 2};
    }
    bool long_k, narrow;
    mma_variant(b, c, num_tokens, tile_m, glu, c->intermediate_size, c->hidden_size, &long_k, &narrow);
    return glu ? mma_wave_of<true>(b, tile_m, long_k, narrow) : mma_wave_of<false>(b, tile_m, long_k, narrow);
}

/* Tiles come about one per touched expert (tile_m is ~1.5x the mean assignments per expert), more where
 * experts overflow theirs. The first wave covers `group`-wide column blocks of the first tiles, or, when
 * it reaches past the last tile, blocks / tiles column blocks of every tile (on average: wgmma's last
 * group is partial): rows [0, rows) of the experts of its tiles.
 * Then whole k steps of those rows up to the budget, or, where one k step of them is more, one k step of
 * fewer rows (the first column blocks, dispatched first). */
PrefetchPlan colibri_cuda_prefetch_plan(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
    PrefetchPlan p = {};
    const PrefetchWave w = prefetch_wave(ctx, num_tokens, tile_m);
    if (w.blocks <= 0) return p;
    const colibri_moe_config_t *c = &ctx->cfg;
    const double E = c->num_experts, n = c->intermediate_size;
    const double tiles = fmax(mma16_touched(c, num_tokens), (double)(num_tokens * c->top_k) / tile_m);
    const double width = fmin(w.group, ceil(n / w.cols));
    double wave_tiles = ceil(w.blocks / width), col_blocks = width;
    if (wave_tiles > tiles) {
        wave_tiles = tiles;
        col_blocks = ceil(w.blocks / tiles);
    }
    p.experts = (int32_t)fmin(E, ceil(wave_tiles * E / tiles - 1e-9));
    p.matrices = c->expert_kind == COLIBRI_EXPERT_SWIGLU ? 2 : 1;
    p.rows = (int32_t)fmin(n, col_blocks * w.cols);
    const size_t budget = COLIBRI_PREFETCH_BYTES, sets = (size_t)p.experts * p.matrices;
    const size_t row_bytes = (size_t)c->hidden_size * 2;
    size_t bytes = budget / (sets * p.rows) / w.step * w.step;
    if (bytes == 0) {
        bytes = w.step;
        p.rows = (int32_t)(budget / (sets * bytes));
    }
    p.bytes = (uint32_t)(bytes < row_bytes ? bytes : row_bytes);
    if (p.rows == 0) p = PrefetchPlan{};
    return p;
}

/* Bytes [0, bytes) (a multiple of 16) of rows [0, rows) of matrices [0, nmat) of experts [0, ...) into L2,
 * a row per thread and step: count = experts * nmat * rows. It reads only the weights, which no kernel
 * writes, so it lets its dependents launch at once and waits for the kernel before it only at its end:
 * the kernel after it, which waits for it, then still waits for that one. */
__global__ void __launch_bounds__(PREFETCH_THREADS) weights_prefetch_kernel(const char *w, size_t expert_stride,
                                                                            size_t second, int nmat, int rows,
                                                                            size_t row_bytes, uint32_t bytes,
                                                                            int count) {
    pdl_trigger();
    for (int i = blockIdx.x * PREFETCH_THREADS + threadIdx.x; i < count; i += gridDim.x * PREFETCH_THREADS) {
        const int set = i / rows;
        const char *row = w + (size_t)(set / nmat) * expert_stride + (size_t)(set % nmat) * second +
                          (size_t)(i - set * rows) * row_bytes;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDACC_VER_MAJOR__ >= 12
        /* the bulk-copy engine fetches the whole run: one instruction per row */
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(bytes) : "memory");
#else
        for (uint32_t off = 0; off < bytes; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
#endif
    }
    pdl_wait();
}

colibri_status_t colibri_cuda_launch_prefetch(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m,
                                              cudaStream_t stream) {
    const PrefetchPlan p = colibri_cuda_prefetch_plan(ctx, num_tokens, tile_m);
    if (p.experts == 0) return COLIBRI_OK;
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    /* the budget bounds count: at most COLIBRI_PREFETCH_BYTES / 64 rows */
    const int count = p.experts * p.matrices * p.rows;
    int blocks = (count + PREFETCH_THREADS - 1) / PREFETCH_THREADS;
    blocks = blocks < 2 * b->sm_count ? blocks : 2 * b->sm_count;
    const size_t row_bytes = (size_t)c->hidden_size * 2, mat = (size_t)c->intermediate_size * row_bytes;
    COLIBRI_CUDA_CHECK(colibri_launch(weights_prefetch_kernel, dim3((unsigned)blocks), dim3(PREFETCH_THREADS), 0,
                                      stream, (const char *)b->d_weights, b->expert_stride, mat, p.matrices, p.rows,
                                      row_bytes, p.bytes, count));
    return COLIBRI_OK;
}
