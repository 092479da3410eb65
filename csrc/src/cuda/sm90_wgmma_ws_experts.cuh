/*
 * sm90_wgmma_ws_experts.cuh — wgmma_ws_kernel, the warp-specialised 128-row expert tiles of bf16 and fp16
 * weights on Hopper (sm_90a, CUDA 12 tensor maps): a producer warpgroup loads a 4-slot ring
 * (sm90_tma_ring.cuh) by TMA and cp.async, two consumer warpgroups multiply and store; optional cluster
 * multicast, folded tiles and chained projections. Its tensor maps, setup and launch too.
 * docs/cuda-design.md explains it.
 */
#ifndef COLIBRI_CUDA_SM90_WGMMA_WS_EXPERTS_CUH
#define COLIBRI_CUDA_SM90_WGMMA_WS_EXPERTS_CUH

#include "gemv.cuh"
#include "sm90_tma_ring.cuh"
#include "sm90_wgmma.cuh"

#if COLIBRI_TMA
/* ---- Warp-specialised: a producer warpgroup loads, two consumer warpgroups multiply ----
 * Threads 256-383 issue every load (weights by TMA from a (k, row, expert) tensor map, token rows by
 * cp.async through perm) into a 4-slot ring of "full"/"empty" mbarriers; threads 0-255 multiply and
 * store, waiting only for their stage's data, so loads run up to 3 stages ahead and through the
 * epilogue. docs/cuda-design.md ("The Hopper kernel") has the design. The epilogue stages 64 columns a
 * round: a folded tile's extra rows in the ring leave no room for wgmma_kernel's 128. */
#define WS_THREADS (WG_THREADS + 128)
/* setmaxnreg: the producer's registers go to the consumers (a folded item holds 152 accumulators);
 * 56 / 224 made ptxas spill in the MC producer. */
#define WS_PRODUCER_REGS 64
#define WS_CONSUMER_REGS 216

/* An expert's last few rows, folded into its last whole tile (permute_folds) rather than a tile of their
 * own that re-reads the weight block. The producer gathers them into WS_EXTRA_ROWS rows at the front of
 * each stage; the consumers multiply the stage transposed, the weight rows as wgmma's A (64 per
 * product) and all 128 + WS_EXTRA_ROWS token rows as its B (N = 152). Warpgroup w takes weight rows
 * [64w, + 64) and [128 + 64w, + 64) (a GLU's gate and up rows of the same columns: act(gate, up) pairs
 * one thread's registers), else [128w, + 128); accumulators acc[0, 128) and xacc[0, 24). */
#define WS_EXTRA_ROWS 24
#define WS_TN (WG_BM + WS_EXTRA_ROWS) /* token rows of a folded item's products */
#define WS_TH (WS_TN / 2)             /* accumulators per thread of one m64 x WS_TN product */
#define WS_X_BYTES (WS_EXTRA_ROWS * 128)
#define WS_STAGE_BYTES (WS_X_BYTES + WG_STAGE_BYTES)
/* The staging buffer of wgmma_ws_kernel: 64 output columns a round (wgmma_kernel's 128 leave no room for the
 * extra rows): 4 x 51 KB of ring, 18 KB of staging, 223 KB in all. */
#define WS_OUT_COLS 64
#define WS_OUT_ROW_BYTES (WS_OUT_COLS * 2 + 16)
#define WS_OUT_WARP_BYTES (16 * WS_OUT_ROW_BYTES)
#define WS_OUT_BYTES (WG_THREADS / 32 * WS_OUT_WARP_BYTES)
#define WS_SMEM_BYTES (WG_STAGES * WS_STAGE_BYTES + WS_OUT_BYTES + 1024)
static_assert(WS_SMEM_BYTES <= 232448, "wgmma_ws_kernel's shared memory is over the H100/H200 opt-in limit");
static_assert(WS_X_BYTES % 1024 == 0, "the extra rows keep the 128-byte swizzle's period");

#define WS_F4(d, i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
/* the register lists of the m64n152k16 products (folds of 48 rows, m64n176k16, lost: performance.md) */
#if WS_EXTRA_ROWS == 24
#define WS_T_REGS \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
    "%74, %75}"
#define WS_T0_OPERANDS(d) \
    WS_F4(d, 0), WS_F4(d, 4), WS_F4(d, 8), WS_F4(d, 12), WS_F4(d, 16), WS_F4(d, 20), WS_F4(d, 24), \
        WS_F4(d, 28), WS_F4(d, 32), WS_F4(d, 36), WS_F4(d, 40), WS_F4(d, 44), WS_F4(d, 48), WS_F4(d, 52), \
        WS_F4(d, 56), WS_F4(d, 60), WS_F4(d, 64), WS_F4(d, 68), WS_F4(d, 72)
#define WS_T1_OPERANDS(d, x) \
    WS_F4(d, 76), WS_F4(d, 80), WS_F4(d, 84), WS_F4(d, 88), WS_F4(d, 92), WS_F4(d, 96), WS_F4(d, 100), \
        WS_F4(d, 104), WS_F4(d, 108), WS_F4(d, 112), WS_F4(d, 116), WS_F4(d, 120), WS_F4(d, 124), \
        WS_F4(x, 0), WS_F4(x, 4), WS_F4(x, 8), WS_F4(x, 12), WS_F4(x, 16), WS_F4(x, 20)
#define WS_MMA_SHAPE "m64n152k16"
#define WS_MMA_DESCS ", %76, %77, 1, 1, 1, 0, 0;"
#else
#error "the transposed products are written out for 24 extra rows (N = 152)"
#endif
/* d (+)= A B^T for a 64 x 16 A (weight rows) and a WS_TN x 16 B (token rows), both K-major in shared memory */
#define WS_MMA_T(TYPE, OPERANDS, da, db)                                                                     \
    asm volatile("wgmma.mma_async.sync.aligned." WS_MMA_SHAPE ".f32." TYPE "." TYPE " " WS_T_REGS WS_MMA_DESCS \
                 : OPERANDS                                                                                 \
                 : "l"(da), "l"(db))
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* chunk 0's product into acc[0, 76), chunk 1's into acc[76, 128) and xacc */
template <class T> __device__ __forceinline__ void ws_mma_t0(float (&d)[128], uint64_t da, uint64_t db) {
    if constexpr (std::is_same<T, __half>::value) WS_MMA_T("f16", WS_T0_OPERANDS(d), da, db);
    else WS_MMA_T("bf16", WS_T0_OPERANDS(d), da, db);
}
template <class T>
__device__ __forceinline__ void ws_mma_t1(float (&d)[128], float (&x)[WS_EXTRA_ROWS], uint64_t da, uint64_t db) {
    if constexpr (std::is_same<T, __half>::value) WS_MMA_T("f16", WS_T1_OPERANDS(d, x), da, db);
    else WS_MMA_T("bf16", WS_T1_OPERANDS(d, x), da, db);
}
#endif
/* accumulator i of chunk c of a folded item's products */
__device__ __forceinline__ float ws_tacc(const float (&acc)[128], const float (&xacc)[WS_EXTRA_ROWS], int c, int i) {
    const int j = c * WS_TH + i;
    return j < 128 ? acc[j] : xacc[j - 128];
}

/* Stores a folded item's outputs: this thread's weight rows m = 16 w + g (+8) of each chunk (g = lane / 4)
 * for token columns 8j + 2t (+1) (t = lane % 4): column n of the products is the tile's row 128 + n for n <
 * WS_EXTRA_ROWS, else row n - WS_EXTRA_ROWS. Lanes g and g ^ 1 hold neighbouring output columns of the same
 * tokens: one shuffle gives each a pair of columns of one token, a 4-byte store. SWIGLU: chunk 0 the gate
 * rows, chunk 1 the up rows of output columns col0 + m; else chunk c's output columns col0 + 64 c + m (col0:
 * the item's first column plus this warpgroup's 64, SWIGLU, or 128). */
template <class T, class Act>
__device__ __forceinline__ void ws_store_folded(const float (&acc)[128], const float (&xacc)[WS_EXTRA_ROWS], T *out,
                                                int n, int col0, const ExpertTile &tile, const ProjArgs &a) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, odd = g & 1, w = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int c = 0; c < (Act::glu ? 1 : 2); c++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int col = col0 + 64 * c + 16 * w + 8 * h + (g & ~1);
#pragma unroll
            for (int j = 0; j < WS_TN / 8; j++) {
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int i = 4 * j + 2 * h + e;
                    if constexpr (Act::glu) {
                        /* this lane's weight row 16 w + 8 h + g is output column col0 + that */
                        float gv = ws_tacc(acc, xacc, 0, i), uv = ws_tacc(acc, xacc, 1, i);
                        colibri_glu_bias(a, tile.expert, col0 + 16 * w + 8 * h + g, gv, uv);
                        v[e] = Act::apply_fast(gv, uv, a);
                    } else {
                        v[e] = ws_tacc(acc, xacc, c, i);
                    }
                }
                const float other = __shfl_xor_sync(0xffffffffu, odd ? v[0] : v[1], 4);
                const int tok = 8 * j + 2 * t + odd;
                const int pos = tile.begin + (tok < WS_EXTRA_ROWS ? WG_BM + tok : tok - WS_EXTRA_ROWS);
                if (pos < tile.end && col < n)
                    *reinterpret_cast<uint32_t *>(out + (size_t)pos * n + col) =
                        odd ? pack2<T>(other, v[1]) : pack2<T>(v[0], other);
            }
        }
}

/* The ring's mbarriers live in the 16 padding bytes at the end of staging-buffer rows, which neither
 * stmatrix nor the epilogue's reads touch (the ring and the staging buffer take all the room): slot s's "full"
 * barrier in row s, its "empty" one 8 bytes on. */
__device__ __forceinline__ uint32_t ws_full_bar(uint32_t sbase, int slot) {
    return sbase + WG_STAGES * WS_STAGE_BYTES + slot * WS_OUT_ROW_BYTES + WS_OUT_COLS * 2;
}
__device__ __forceinline__ uint32_t ws_empty_bar(uint32_t sbase, int slot) { return ws_full_bar(sbase, slot) + 8; }
/* Word `i` of the item words, in the padding of staging row WG_STAGES + i: 0..WG_STAGES-1, the item whose
 * first stage slot i holds (-1: the producer has no more); WG_STAGES and WG_STAGES + 1, the producer's
 * two alternating words of its next item. */
__device__ __forceinline__ uint32_t ws_item_word(uint32_t sbase, int i) { return ws_full_bar(sbase, WG_STAGES + i); }

/* Items after the first wave go to blocks as they ask (sched[0] counts the asks), not by a fixed stride:
 * a block whose items run short (an expert's last, partial tile) takes the next item in line instead of
 * running ahead of the others, so the blocks at work keep covering a few neighbouring tiles of the same
 * column blocks and share their weight blocks in L2. Which block computes an item does
 * not change its arithmetic: the output is the same bits. */
__device__ __forceinline__ unsigned ws_next_item(unsigned *sched) { return atomicAdd(sched, 1u); }
/* A block (a cluster, with MC) whose last ask got no item counts itself done (sched[1]); the last of the
 * `askers` sets both counters back to 0 for the next launch, when no one will ask again. */
__device__ __forceinline__ void ws_block_done(unsigned *sched, unsigned askers) {
    __threadfence();
    if (atomicAdd(sched + 1, 1u) == askers - 1) {
        atomicExch(sched, 0u);
        atomicExch(sched + 1, 0u);
    }
}

/* Chained projections: the second projection of a SWIGLU forward reads a tile's rows of inter once the
 * first projection's items of that tile are stored (ready[tile] reaches ready_need: one release
 * reduction per stored item, acquire loads by the second's producer), not once the first has ended; its
 * blocks start on finished tiles instead of idling at the grid dependency, and its griddepcontrol.wait
 * moves to its end. The permutation zeroes ready[]; experts_plan.cu's plan_ws_chain says where. */
__device__ __forceinline__ void ws_chain_signal(unsigned *ready) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ready) : "memory");
}
__device__ __forceinline__ void ws_chain_wait(const unsigned *ready, int need) {
    for (;;) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ready) : "memory");
        if ((int)v >= need) return;
        __nanosleep(128);
    }
}

/* With MC (clusters of two blocks): the item word the cluster's rank 0 hands to rank 1 (in rank 1's
 * shared memory, two alternating words) and the pair of mbarriers of each word: "full" (in rank 1,
 * completed by rank 0's remote arrival after its write) and "empty" (in rank 0, completed by rank 1's
 * after its read). Rows 10-13 of the staging rows' padding. */
__device__ __forceinline__ uint32_t ws_chan_word(uint32_t sbase, int b) { return ws_full_bar(sbase, 10 + b); }
__device__ __forceinline__ uint32_t ws_chan_full(uint32_t sbase, int b) { return ws_full_bar(sbase, 12 + b); }
__device__ __forceinline__ uint32_t ws_chan_empty(uint32_t sbase, int b) { return ws_full_bar(sbase, 12 + b) + 8; }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t ws_cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
/* the address in the cluster's shared window of the same offset in block `rank` */
__device__ __forceinline__ uint32_t ws_cluster_addr(uint32_t local, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}
/* An arrival on the mbarrier at `cluster_addr` of the other block: `ordered`, the writes to the cluster's
 * shared memory before it are visible to a thread that waits for it with ws_wait_cluster (release at
 * cluster scope: a fence through the whole memory system, MEMBAR.ALL.GPU); else an arrival as the local
 * ones (release at block scope), which a consumer warp's release of a slot needs no more than (its
 * products are complete after wgmma.wait_group, and the other block only overwrites the slot). */
template <bool ordered> __device__ __forceinline__ void ws_remote_arrive(uint32_t cluster_addr) {
    if constexpr (ordered)
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
    else
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}
/* ws_wait, ordered after writes of the other block of the cluster that preceded its arrival */
__device__ __forceinline__ void ws_wait_cluster(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
/* every thread of both blocks: the cluster's memory operations before it are visible after it */
__device__ __forceinline__ void ws_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
#endif

/* The same 128 rows into the same offset of both blocks of the cluster, completing bytes on each block's
 * mbarrier at `bar`'s offset */
__device__ __forceinline__ void ws_tma_rows_mc(uint32_t dst, uint64_t map, int k0, int row, int expert, uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
                 "l"(map), "r"(k0), "r"(row), "r"(expert), "r"(bar), "h"((unsigned short)3)
                 : "memory");
#endif
}

/* MC: clusters of two blocks; a unit of work is a pair of tiles 2q, 2q + 1 (rank r takes tile 2q + r)
 * for one column block. Where both tiles are of one expert, each rank loads half of every stage's weight
 * rows by a TMA multicast into both blocks (L2 -> SM weight traffic halved). Each block's "empty"
 * barriers count both blocks' consumer warps, so the rings run in step; rank 0 hands units to rank 1. */
template <class T, class Act, bool MC, bool DRAIN>
__global__ void __launch_bounds__(WS_THREADS, 1) wgmma_ws_kernel(const __grid_constant__ CUtensorMap wmap, ProjArgs a) {
    static_assert(!(MC && DRAIN), "the cluster kernel runs the compute-bound tiles only");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = Act::glu ? WG_BN / 2 : WG_BN; /* output columns per item */
    constexpr int P_THREADS = WS_THREADS - WG_THREADS;
    constexpr int A_PER_T = WG_BM * 8 / P_THREADS, ROW_STEP = P_THREADS / 8;
    constexpr int X_PER_T = (WS_EXTRA_ROWS + ROW_STEP - 1) / ROW_STEP;
    constexpr uint32_t HALF_B = WG_B_BYTES / 2;
    /* chained (ws_chain_wait): the first projection lets the second launch only past its own wait, so that the
     * second finds the tile table complete; the second waits for the first at its end, not here */
    const bool signal = a.ready && a.ready_need == 0, chained = a.ready && a.ready_need > 0;
    if (chained) {
        pdl_trigger();
    } else if (signal) {
        pdl_wait();
        pdl_trigger();
    } else {
        pdl_begin();
    }
    /* from L2: a chained second projection reads the table before its dependency wait */
    const int tiles = __ldcg(a.num_tiles), nblocks = (a.n + COLS - 1) / COLS;
    /* units of work: items (tile, column block), or with MC pairs of tiles x column blocks */
    const int pairs = MC ? (tiles + 1) >> 1 : tiles, items = pairs * nblocks;
    const int ktiles = (a.k + WG_BK - 1) / WG_BK;
    const int tid = threadIdx.x;
    const uint32_t rank = MC ? ws_cluster_rank() : 0, peer = rank ^ 1u;
    const int first = MC ? (int)(blockIdx.x >> 1) : (int)blockIdx.x; /* this block's (cluster's) first unit */
    const int askers = MC ? (int)(gridDim.x >> 1) : (int)gridDim.x;

    extern __shared__ char smem[];
    const uint32_t sbase = ((uint32_t)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    if (tid == WG_THREADS) {
        ring_init(ws_full_bar(sbase, 0), WS_OUT_ROW_BYTES, WG_STAGES, P_THREADS + 1, (MC ? 2 : 1) * WG_THREADS / 32);
        if (MC)
            for (int b = 0; b < 2; b++) {
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(ws_chan_full(sbase, b)) : "memory");
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(ws_chan_empty(sbase, b)) : "memory");
            }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    /* the barriers exist (with MC: in both blocks) before anyone waits on them or arrives */
    if constexpr (MC) ws_cluster_sync();
    else __syncthreads();
    /* unit `it` -> this block's tile (-1: none; MC rank 1 past the last tile), its column block, and
     * whether the cluster shares the weight block */
    auto unit = [&](int it, int &ti, int &nb, bool &share) {
        int q;
        wg_item(it, pairs, nblocks, q, nb);
        share = false;
        if constexpr (MC) {
            ti = 2 * q + (int)rank < tiles ? 2 * q + (int)rank : -1;
            share = 2 * q + 1 < tiles && __ldcg(&a.tiles[2 * q].expert) == __ldcg(&a.tiles[2 * q + 1].expert);
        } else {
            ti = q;
        }
    };

    if (tid >= WG_THREADS) {
        /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WS_PRODUCER_REGS));
        const int p = tid - WG_THREADS, c = p & 7, r0 = p >> 3;
        /* thread p copies 16-byte chunk c of rows r0 + i ROW_STEP of A: one swizzled offset for all */
        const uint32_t my_off = swz<64>(r0, c);
        const uint64_t map = reinterpret_cast<uint64_t>(&wmap);
        if (p == 0) asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
        const T *x = reinterpret_cast<const T *>(a.x);
        RingPos<WG_STAGES> ring = {0, 1u};
        /* Items in the order the blocks ask for them (ws_next_item): thread 0 asks one item ahead and the
         * producer warps read its answer through two alternating words of shared memory. */
        unsigned ahead = 0;
        if (p == 0 && rank == 0 && first < items) ahead = ws_next_item(a.sched);
        for (int n_item = 0;; n_item++) {
            const uint32_t word = ws_item_word(sbase, WG_STAGES + (n_item & 1));
            if (p == 0) {
                int it;
                if (rank == 0) {
                    it = n_item == 0 ? first : askers + (int)ahead;
                    if (n_item > 0 && it < items) ahead = ws_next_item(a.sched);
                }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
                if constexpr (MC) {
                    /* rank 0 -> rank 1 through word n_item & 1 of rank 1, its (n_item >> 1)-th use */
                    const int b = n_item & 1;
                    const uint32_t use = (uint32_t)n_item >> 1;
                    if (rank == 0) {
                        if (use > 0) ws_wait_cluster(ws_chan_empty(sbase, b), (use - 1) & 1u);
                        asm volatile("st.shared::cluster.b32 [%0], %1;" ::"r"(ws_cluster_addr(ws_chan_word(sbase, b), peer)),
                                     "r"(it)
                                     : "memory");
                        ws_remote_arrive<true>(ws_cluster_addr(ws_chan_full(sbase, b), peer));
                    } else {
                        ws_wait_cluster(ws_chan_full(sbase, b), use & 1u);
                        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(it) : "r"(ws_chan_word(sbase, b)) : "memory");
                        ws_remote_arrive<true>(ws_cluster_addr(ws_chan_empty(sbase, b), peer));
                    }
                }
#endif
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(word), "r"(it) : "memory");
            }
            asm volatile("bar.sync 1, %0;" ::"n"(P_THREADS) : "memory");
            int it;
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(it) : "r"(word) : "memory");
            if (it >= items) {
                /* no more: the consumers read the end from the next slot, its full phase completed by
                 * 129 plain arrivals once the slot is free */
                ws_wait(ws_empty_bar(sbase, ring.slot), ring.parity);
                const uint32_t full = ws_full_bar(sbase, ring.slot);
                if (p == 0) {
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(ws_item_word(sbase, ring.slot)), "r"(-1) : "memory");
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(full) : "memory");
                }
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(full) : "memory");
                if (p == 0 && rank == 0) ws_block_done(a.sched, (unsigned)askers);
                break;
            }
            int ti, nb;
            bool share;
            unit(it, ti, nb, share);
            const ExpertTile tile = ti >= 0 ? colibri_tile_ldcg(a.tiles + ti) : ExpertTile{0, 0, 0, 0}; /* none: no rows */
            int row[A_PER_T]; /* x row of each of this thread's tile rows; -1 past the tile's end */
            ring_token_rows<A_PER_T, ROW_STEP>(row, tile.begin + r0, tile.end, a.row_map, a.row_div);
            /* a folded tile's rows past its 128 (-1: none): rows r0 + i ROW_STEP of the stage's front */
            const bool folded = tile.end - tile.begin > WG_BM;
            int xrow[X_PER_T];
            ring_token_rows<X_PER_T, ROW_STEP>(xrow, tile.begin + WG_BM + r0, folded ? tile.end : 0, a.row_map,
                                               a.row_div);
            /* the map's rows of the two boxes: SWIGLU gate rows and the up rows of the same columns, else
             * the item's 256 rows */
            const int row0 = nb * COLS, row1 = Act::glu ? a.n + nb * COLS : nb * COLS + WG_BN / 2;
            for (int kt = 0; kt < ktiles; kt++) {
                ring_acquire(ws_empty_bar(sbase, ring.slot), ring.parity);
                /* the stage: the extra rows, the tile's 128 rows (A), the weight rows (B) */
                const uint32_t st = sbase + (uint32_t)ring.slot * WS_STAGE_BYTES + WS_X_BYTES,
                               full = ws_full_bar(sbase, ring.slot);
                const int k0 = kt * WG_BK;
                if (p == 0) {
                    /* the item, for the consumers, at its first stage (published by the arrival below) */
                    if (kt == 0)
                        asm volatile("st.shared.b32 [%0], %1;" ::"r"(ws_item_word(sbase, ring.slot)), "r"(it)
                                     : "memory");
                    /* the stage's 256 weight rows: shared, half from each block (both halves land here);
                     * else both from here; none for no tile */
                    ring_expect(full, ti >= 0 || share ? (uint32_t)WG_B_BYTES : 0u);
                    if (MC && share) {
                        ws_tma_rows_mc(st + WG_A_BYTES + rank * HALF_B, map, k0, rank ? row1 : row0, tile.expert, full);
                    } else if (ti >= 0) {
                        ws_tma_rows(st + WG_A_BYTES, map, k0, row0, tile.expert, full);
                        ws_tma_rows(st + WG_A_BYTES + HALF_B, map, k0, row1, tile.expert, full);
                    }
                }
                if (chained && kt == 0 && ti >= 0) {
                    /* the item's weights are asked for; its token rows (inter) once their tile is stored */
                    if (p == 0) ws_chain_wait(a.ready + ti, a.ready_need);
                    asm volatile("bar.sync 1, %0;" ::"n"(P_THREADS) : "memory");
                }
                const bool k_ok = k0 + c * 8 < a.k;
                ring_gather<A_PER_T, ROW_STEP>(st + my_off, row, x, a.k, k0 + c * 8, k_ok, a.x);
                if (folded)
                    ring_gather<X_PER_T, ROW_STEP>(st - WS_X_BYTES + my_off, xrow, x, a.k, k0 + c * 8, k_ok, a.x, r0,
                                                   WS_EXTRA_ROWS);
                ring_commit(full);
                ring.next();
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        /* with MC the other block's consumers may still arrive on this block's barriers */
        if constexpr (MC) ws_cluster_sync();
#endif
        if (chained) pdl_wait(); /* completes after the first projection, as with the wait at the start */
        return;
    }

    /* ---- consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WS_CONSUMER_REGS));
    const int wg = tid >> 7, lane = tid & 31;
    T *out = reinterpret_cast<T *>(a.out);
    float acc[128], xacc[WS_EXTRA_ROWS]; /* xacc: a folded item's last accumulators (ws_mma_t1) */
    RingPos<WG_STAGES> cons = {0, 0u};
    /* One item's k loop; MODE 0 (false) as in wgmma_kernel (this warpgroup's rows are all past the tile's
     * end): it waits and releases like the other, without products; 1 (true) the products of a tile of at
     * most 128 rows; 2 a folded tile's transposed ones. Each warp releases a slot once its
     * products that read it are complete: the previous stage's after this one's are issued and all but
     * the newest group done (wgmma.wait_group 1), the item's last after wait_group 0. */
    /* this warp's arrival on slot `slot`'s empty barrier (none for -1), once all its lanes are past their
     * waits and products (MMA false: no wgmma.*.aligned has gathered the warp since the wait) */
    auto release = [&](int slot) {
        __syncwarp();
        if (slot >= 0 && lane == 0) {
            ring_release(ws_empty_bar(sbase, slot));
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            /* with MC the other block refills this slot too (its half of a shared weight block) */
            if constexpr (MC) ws_remote_arrive<false>(ws_cluster_addr(ws_empty_bar(sbase, slot), peer));
#endif
        }
    };
    auto k_loop = [&](auto mode_tag) {
        constexpr int MODE = (int)decltype(mode_tag)::value;
        constexpr bool MMA = MODE != 0;
        [[maybe_unused]] int prev = -1; /* the slot whose products may still run (not with DRAIN) */
        for (int kt = 0; kt < ktiles; kt++) {
            ws_wait(ws_full_bar(sbase, cons.slot), cons.parity);
            if constexpr (MMA) {
                /* A was written through the generic proxy (cp.async); wgmma reads through the async proxy */
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                const uint32_t st = sbase + (uint32_t)cons.slot * WS_STAGE_BYTES + WS_X_BYTES; /* the tile's 128 rows */
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                if constexpr (MODE == 1) {
#pragma unroll
                    for (int ks = 0; ks < WG_BK / 16; ks++)
                        wg_mma<T>(acc, wg_desc(st + wg * (WG_A_BYTES / 2) + ks * 32),
                                  wg_desc(st + WG_A_BYTES + ks * 32));
                } else {
                    /* the weight rows' chunks of 64 (8 KB) this warpgroup takes, and all the token rows from
                     * the extra ones on */
                    const uint32_t w0 = st + WG_A_BYTES + (Act::glu ? wg : 2 * wg) * 8192u,
                                   w1 = st + WG_A_BYTES + (Act::glu ? 2 + wg : 2 * wg + 1) * 8192u;
#pragma unroll
                    for (int ks = 0; ks < WG_BK / 16; ks++) {
                        const uint64_t xd = wg_desc(st - WS_X_BYTES + ks * 32);
                        ws_mma_t0<T>(acc, wg_desc(w0 + ks * 32), xd);
                        ws_mma_t1<T>(acc, xacc, wg_desc(w1 + ks * 32), xd);
                    }
                }
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                if constexpr (DRAIN) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                else asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            }
            if constexpr (DRAIN) {
                release(cons.slot);
            } else {
                release(prev);
                prev = cons.slot;
            }
            cons.next();
        }
        if constexpr (!DRAIN) {
            if constexpr (MMA) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            release(prev);
        }
    };
    /* a chained first projection: tile ti's item is stored (both warpgroups' stores issued), counted once */
    auto stored = [&](int ti) {
        if (!signal) return;
        asm volatile("bar.sync 2, %0;" ::"n"(WG_THREADS) : "memory");
        if (tid == 0) ws_chain_signal(a.ready + ti);
    };
    for (;;) {
        /* the item the producer loads next, written before its first stage's full phase completes (-1: none) */
        ws_wait(ws_full_bar(sbase, cons.slot), cons.parity);
        int it;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(it) : "r"(ws_item_word(sbase, cons.slot)) : "memory");
        if (it < 0) break;
        int ti, nb;
        bool share;
        unit(it, ti, nb, share);
        const ExpertTile tile = ti >= 0 ? colibri_tile_ldcg(a.tiles + ti) : ExpertTile{0, 0, 0, 0};
        const int col0 = nb * COLS;
        if (tile.end - tile.begin > WG_BM) {
            /* a folded tile (its extra rows at the stages' front): transposed products, direct stores */
#pragma unroll
            for (int i = 0; i < 128; i++) acc[i] = 0.0f;
#pragma unroll
            for (int i = 0; i < WS_EXTRA_ROWS; i++) xacc[i] = 0.0f;
            k_loop(std::integral_constant<int, 2>{});
            ws_store_folded<T, Act>(acc, xacc, out, a.n, col0 + (Act::glu ? 64 : 128) * wg, tile, a);
            stored(ti);
            continue;
        }
        wg_products(tile, wg, acc, k_loop);
        if (ti < 0) continue; /* MC rank 1 with no tile: the ring kept in step, nothing to store */

        const int prow = tile.begin + (tid >> 5) * 16; /* position of this warp's first row */
        const uint32_t out_buf = sbase + WG_STAGES * WS_STAGE_BYTES + (tid >> 5) * WS_OUT_WARP_BYTES;
#pragma unroll
        for (int part = 0; part < COLS / WS_OUT_COLS; part++)
            if (col0 + part * WS_OUT_COLS < a.n)
                wg_store_part_direct<T, Act, WS_OUT_COLS, WS_OUT_ROW_BYTES>(acc, out_buf, part, out, a.n,
                                                                            col0 + part * WS_OUT_COLS, prow, tile.end, a,
                                                                            tile.expert);
        stored(ti);
    }
    if constexpr (MC) ws_cluster_sync();
    if (chained) pdl_wait();
#endif
}

typedef CUresult (*WsEncodeFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                               const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                               CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The driver's cuTensorMapEncodeTiled (through the runtime: no link to libcuda), or NULL. */
static void *ws_encode_fn() {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return fn;
}

/* Sets up the kernels of (T, Act); *clusters: how many clusters of two of the MC kernel fit at once
 * (0 where none would: the MC kernel is then not used). */
template <class T, class Act> static cudaError_t wgmma_ws_setup_one(int *clusters) {
    cudaError_t e = cudaFuncSetAttribute(wgmma_ws_kernel<T, Act, false, false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, WS_SMEM_BYTES);
    if (e != cudaSuccess) return e;
    e = cudaFuncSetAttribute(wgmma_ws_kernel<T, Act, false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             WS_SMEM_BYTES);
    if (e != cudaSuccess) return e;
    e = cudaFuncSetAttribute(wgmma_ws_kernel<T, Act, true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             WS_SMEM_BYTES);
    if (e != cudaSuccess) return e;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2);
    cfg.blockDim = dim3(WS_THREADS);
    cfg.dynamicSmemBytes = WS_SMEM_BYTES;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, wgmma_ws_kernel<T, Act, true, false>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
    }
    *clusters = *clusters < 0 ? n : (n < *clusters ? n : *clusters);
    return cudaSuccess;
}

/* The 3-d tensor map (k, row, expert) of projection a's weights for wgmma_ws_kernel, in boxes of 64 k x 128
 * rows, 128-byte swizzled (the ring's layout); rows and k past the matrix read 0. GLU: the up matrix
 * follows the gate matrix (a.w_second = n k elements), so the map has 2n rows. Encoded on the host at each
 * launch (a graph keeps it among the kernel's parameters). False where the driver would not encode it. */
template <class T, bool GLU> static bool ws_tensor_map(void *encode, const ProjArgs &a, int experts, CUtensorMap *map) {
    const cuuint64_t dims[3] = {(cuuint64_t)a.k, (cuuint64_t)(GLU ? 2 * a.n : a.n), (cuuint64_t)experts};
    const cuuint64_t strides[2] = {(cuuint64_t)a.k * sizeof(T), (cuuint64_t)a.w_expert_stride};
    const cuuint32_t box[3] = {WG_BK, WG_BN / 2, 1}, unit[3] = {1, 1, 1};
    const CUtensorMapDataType dt =
        std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    return ((WsEncodeFn)encode)(map, dt, 3, (void *)a.w, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* One block per SM (at most one per item the tile table can hold), as wgmma_launch; with `clusters` > 0,
 * that many clusters of two of the MC kernel (at most one per pair of tiles and column block); else, with
 * `drain`, the kernel that drains every stage (DRAIN). */
template <class T, class Act>
static cudaError_t wgmma_ws_launch(const CUtensorMap &map, const ProjArgs &a, int64_t slots, int sms, int clusters,
                                   bool drain, cudaStream_t stream) {
    constexpr int COLS = Act::glu ? WG_BN / 2 : WG_BN;
    const int64_t nblocks = (a.n + COLS - 1) / COLS;
    if (clusters > 0) {
        const int64_t most = (slots + 1) / 2 * nblocks;
        return colibri_launch_clusters(wgmma_ws_kernel<T, Act, true, false>, 2, dim3((unsigned)(2 * (most < clusters ? most : clusters))),
                                       dim3(WS_THREADS), WS_SMEM_BYTES, stream, map, a);
    }
    const int64_t most = slots * nblocks;
    const dim3 grid((unsigned)(most < sms ? most : sms));
    if (drain)
        return colibri_launch(wgmma_ws_kernel<T, Act, false, true>, grid, dim3(WS_THREADS), WS_SMEM_BYTES, stream, map,
                              a);
    return colibri_launch(wgmma_ws_kernel<T, Act, false, false>, grid, dim3(WS_THREADS), WS_SMEM_BYTES, stream, map, a);
}
#endif /* COLIBRI_TMA */

#endif /* COLIBRI_CUDA_SM90_WGMMA_WS_EXPERTS_CUH */
