/*
 * sm90_wgmma_experts.cuh — wgmma_kernel, the 128-row expert tiles of bf16 and fp16 weights on Hopper
 * (sm_90a) where every thread both loads and multiplies: for drivers without the tensor-map encoder
 * (else sm90_wgmma_ws_experts.cuh runs). Used in place of mma_kernel where the sm_90a image runs, since
 * mma.sync's operands go through registers there (docs/performance.md has the rates).
 */
#ifndef COLIBRI_CUDA_SM90_WGMMA_EXPERTS_CUH
#define COLIBRI_CUDA_SM90_WGMMA_EXPERTS_CUH

#include "gemv.cuh"
#include "sm90_wgmma.cuh"

/* Persistent: block b computes items b, b + gridDim.x, ...; the cp.async ring runs on across items,
 * so the next item's first stages load while this one's last products and epilogue run.
 * AHEAD: stages the loader runs ahead of the products. 2 (the compute-bound tiles): a slot is refilled
 * while the products of the stage before it may still run (wgmma.wait_group 1). 3 (tiles of experts
 * with fewer rows than one tile on average, where the weights stream from HBM): 48 KB more in flight
 * per SM, bought with wgmma.wait_group 0 at every stage, whose drain the memory-bound tiles can
 * afford. */
template <class T, class Act, int AHEAD>
__global__ void __launch_bounds__(WG_THREADS, 1) wgmma_kernel(ProjArgs a) {
    static_assert(AHEAD == 2 || AHEAD == 3, "a free ring slot is left for the products");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = Act::glu ? WG_BN / 2 : WG_BN; /* output columns per item */
    constexpr int A_PER_T = WG_BM * 8 / WG_THREADS, B_PER_T = WG_BN * 8 / WG_THREADS;
    constexpr int ROW_STEP = WG_THREADS / 8; /* rows between one thread's copies */
    pdl_begin();
    const int tiles = *a.num_tiles, nblocks = (a.n + COLS - 1) / COLS, items = tiles * nblocks;
    const int ktiles = (a.k + WG_BK - 1) / WG_BK;
    const int tid = threadIdx.x, wg = tid >> 7;

    extern __shared__ char smem[];
    const uint32_t sbase = ((uint32_t)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;

    /* The loader runs AHEAD stages ahead of the products, possibly in the next item. Thread tid
     * copies 16-byte chunk c of rows r0 + i * ROW_STEP of A and of B; all those rows share r & 7, so
     * one swizzled offset serves them all. */
    const int c = tid & 7, r0 = tid >> 3;
    const uint32_t my_off = swz<64>(r0, c);
    const T *a_src[A_PER_T];
    const T *b_src[B_PER_T];
    bool a_ok[A_PER_T], b_ok[B_PER_T];
    int ld_item = blockIdx.x, ld_kt = 0;
    auto loader_item = [&]() {
        int ti, nb;
        wg_item(ld_item, tiles, nblocks, ti, nb);
        const ExpertTile tile = a.tiles[ti];
#pragma unroll
        for (int i = 0; i < A_PER_T; i++) {
            const int p = tile.begin + r0 + i * ROW_STEP;
            a_ok[i] = p < tile.end;
            const int row = a_ok[i] ? (a.row_map ? a.row_map[p] / a.row_div : p) : 0;
            a_src[i] = reinterpret_cast<const T *>(a.x) + (size_t)row * a.k + c * 8;
        }
        const char *wexp = a.w + (size_t)tile.expert * a.w_expert_stride;
#pragma unroll
        for (int i = 0; i < B_PER_T; i++) {
            const int r = r0 + i * ROW_STEP, m = Act::glu ? r / COLS : 0, n = nb * COLS + (Act::glu ? r % COLS : r);
            b_ok[i] = n < a.n;
            b_src[i] = reinterpret_cast<const T *>(wexp + m * a.w_second) + (size_t)(b_ok[i] ? n : 0) * a.k + c * 8;
        }
    };
    /* copies the loader's next stage into ring slot `slot` and moves the loader on */
    auto load_next = [&](int slot) {
        if (ld_item >= items) return;
        const uint32_t st = sbase + (uint32_t)slot * WG_STAGE_BYTES + my_off;
        const int k0 = ld_kt * WG_BK;
        const bool k_ok = k0 + c * 8 < a.k;
#pragma unroll
        for (int i = 0; i < A_PER_T; i++) {
            const bool ok = a_ok[i] && k_ok;
            cp_async16(st + i * ROW_STEP * 128, ok ? (const void *)(a_src[i] + k0) : a.x, ok);
        }
#pragma unroll
        for (int i = 0; i < B_PER_T; i++) {
            const bool ok = b_ok[i] && k_ok;
            cp_async16(st + WG_A_BYTES + i * ROW_STEP * 128, ok ? (const void *)(b_src[i] + k0) : (const void *)a.w,
                       ok);
        }
        if (++ld_kt == ktiles) {
            ld_kt = 0;
            ld_item += gridDim.x;
            if (ld_item < items) loader_item();
        }
    };

    if (ld_item < items) loader_item();
#pragma unroll
    for (int s = 0; s < AHEAD; s++) {
        load_next(s);
        cp_async_commit();
    }

    T *out = reinterpret_cast<T *>(a.out);
    const int lane = tid & 31;
    float acc[128];
    int stage = 0; /* ring position of the products' next stage */
    /* The k loop of one item. MMA false: this warpgroup's 64 rows of the tile are all past its end (a
     * tile of at most 64 rows, the last of an expert whose rows are not a multiple of 128): it only
     * keeps the loads and the barriers going, and warpgroup 0's products have the tensor cores of the
     * SM to themselves. Two copies of the loop, not a branch around the wgmma inside it, which would
     * make ptxas serialise every wgmma. */
    auto k_loop = [&](auto mma_tag) {
        constexpr bool MMA = decltype(mma_tag)::value;
        for (int kt = 0; kt < ktiles; kt++) {
            cp_async_wait<AHEAD - 1>();
            /* cp.async wrote through the generic proxy; wgmma reads through the async proxy */
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            /* also: every warpgroup is past its wait for the products of the slot refilled below */
            __syncthreads();
            if constexpr (MMA) {
                const uint32_t st = sbase + (uint32_t)stage * WG_STAGE_BYTES;
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int ks = 0; ks < WG_BK / 16; ks++)
                    wg_mma<T>(acc, wg_desc(st + wg * (WG_A_BYTES / 2) + ks * 32),
                              wg_desc(st + WG_A_BYTES + ks * 32));
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            }
            /* refill the slot of WG_STAGES - AHEAD stages ago while these products run */
            load_next((stage + AHEAD) % WG_STAGES);
            cp_async_commit();
            if constexpr (MMA) {
                if constexpr (AHEAD == 2) asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                else asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            }
            stage = (stage + 1) % WG_STAGES;
        }
    };
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        int ti, nb;
        wg_item(it, tiles, nblocks, ti, nb);
        const ExpertTile tile = a.tiles[ti];
        wg_products(tile, wg, acc, k_loop);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");

        /* Each warp writes its 16 rows x 128 columns to its part of the staging buffer and the bulk-copy
         * engine stores them while the threads go on to the next item's products; the second 128 columns
         * of a linear item (no room for them there) go through a ring slot that is free until the next
         * item's first k steps, with 16-byte stores. */
        const int prow = tile.begin + (tid >> 5) * 16; /* position of this warp's first row */
        const uint32_t out_buf = sbase + WG_STAGES * WG_STAGE_BYTES + (tid >> 5) * WG_OUT_WARP_BYTES;
        const int col0 = nb * COLS;
        /* the previous item's bulk copies have read the buffer (long done: an item ago) */
        wg_store_part<T, Act, WG_OUT_COLS, WG_OUT_ROW_BYTES>(acc, out_buf, 0, out, a.n, col0, prow, tile.end, a,
                                                             tile.expert);
        if constexpr (!Act::glu) {
            /* the ring slot the loader fills next (the last but one the products read; the last with
             * AHEAD 3): free once both warpgroups are past their wait_group 0 (this barrier) until the
             * loader refills it, after the next item's first __syncthreads */
            __syncthreads();
            const uint32_t spare = sbase + (uint32_t)((stage + AHEAD) % WG_STAGES) * WG_STAGE_BYTES +
                                   (tid >> 5) * WG_OUT_WARP_BYTES;
            wg_stage_part<T, Act, WG_OUT_COLS, WG_OUT_ROW_BYTES>(acc, spare, 1, a, tile.expert, col0);
            __syncwarp();
            const int c16 = lane & 15, col = col0 + WG_OUT_COLS + c16 * 8;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int r = 2 * i + (lane >> 4);
                if (col < a.n && prow + r < tile.end) {
                    uint4 v;
                    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                 : "r"(spare + r * WG_OUT_ROW_BYTES + c16 * 16)
                                 : "memory");
                    *reinterpret_cast<uint4 *>(out + (size_t)(prow + r) * a.n + col) = v;
                }
            }
        }
    }
    /* the last bulk copies are complete (written, not only read) before the block ends */
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    cp_async_wait<0>();
#endif
}

template <class T, class Act> static cudaError_t wgmma_setup_one() {
    cudaError_t e = cudaFuncSetAttribute(wgmma_kernel<T, Act, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         WG_SMEM_BYTES);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(wgmma_kernel<T, Act, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM_BYTES);
}

/* One block per SM (at most one per item the tile table can hold). `streaming`: the experts have fewer
 * rows than one tile on average, so the weights stream from HBM: the loader runs 3 stages ahead. */
template <class T, class Act>
static cudaError_t wgmma_launch(const ProjArgs &a, int64_t slots, int sms, bool streaming, cudaStream_t stream) {
    constexpr int COLS = Act::glu ? WG_BN / 2 : WG_BN;
    const int64_t most = slots * ((a.n + COLS - 1) / COLS);
    const dim3 grid((unsigned)(most < sms ? most : sms));
    if (streaming) return colibri_launch(wgmma_kernel<T, Act, 3>, grid, dim3(WG_THREADS), WG_SMEM_BYTES, stream, a);
    return colibri_launch(wgmma_kernel<T, Act, 2>, grid, dim3(WG_THREADS), WG_SMEM_BYTES, stream, a);
}

#endif /* COLIBRI_CUDA_SM90_WGMMA_EXPERTS_CUH */
