/*
 * sm90_ring.cuh — the producer ring of the warp-specialised Hopper kernels (wgmma_ws_kernel in
 * sm90_wgmma_ws_experts.cuh, wgmma_fp8_kernel in sm90_fp8_experts.cuh): a producer warpgroup fills
 * shared-memory slots in order (weights by TMA, token rows gathered by cp.async) and consumer warps drain
 * them in the same order. Each slot has a "full" mbarrier (the producers' cp.async arrivals, one more for
 * the TMA bytes) and an "empty" one (an arrival per consumer warp). A fix to the protocol is made here once.
 */
#ifndef COLIBRI_CUDA_SM90_RING_CUH
#define COLIBRI_CUDA_SM90_RING_CUH

#include "sm80_mma.cuh"

/* A position in a ring of STAGES slots, and the parity of the phase to wait for there: a producer starts
 * at parity 1 (a barrier just initialised counts that phase as complete, so its first pass waits for
 * none), a consumer at 0. */
template <int STAGES> struct RingPos {
    int slot;
    uint32_t parity;
    __device__ __forceinline__ void next() {
        if (++slot == STAGES) {
            slot = 0;
            parity ^= 1u;
        }
    }
};

/* Slot barriers for `producers` cp.async arrivals plus the one that expects the TMA bytes, and `consumers`
 * warps' releases; one thread initialises them, and a barrier of the block (or cluster) follows. */
__device__ __forceinline__ void ring_init_slot(uint32_t full, uint32_t empty, int producers, int consumers) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(full), "r"(producers + 1) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty), "r"(consumers) : "memory");
}

/* Waits until the phase of parity `parity` of the mbarrier at `bar` has completed (acquire, block scope).
 * A barrier just initialised counts its phase of parity 1 as complete. */
__device__ __forceinline__ void ring_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    uint32_t done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}

/* Producer: waits for the slot to be empty, then orders the consumers' reads of it (through the async
 * proxy: the products) before this thread's writes (through the generic one: cp.async). */
__device__ __forceinline__ void ring_acquire(uint32_t empty, uint32_t parity) {
    ring_wait(empty, parity);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Producer thread 0, before the stage's TMA: its arrival on `full`, expecting `bytes` of weights. */
__device__ __forceinline__ void ring_expect(uint32_t full, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(bytes) : "memory");
}

/* 128 weight rows from `row` x 64 k from k0 of `expert`, by TMA into shared memory at dst, completing
 * bytes on mbarrier `bar` */
__device__ __forceinline__ void ring_tma_rows(uint32_t dst, uint64_t map, int k0, int row, int expert, uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"(map), "r"(k0), "r"(row), "r"(expert), "r"(bar)
                 : "memory");
#endif
}

/* The same 128 rows into the same offset of both blocks of the cluster, completing bytes on each block's
 * mbarrier at `bar`'s offset */
__device__ __forceinline__ void ring_tma_rows_mc(uint32_t dst, uint64_t map, int k0, int row, int expert, uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
                 "l"(map), "r"(k0), "r"(row), "r"(expert), "r"(bar), "h"((unsigned short)3)
                 : "memory");
#endif
}

/* A producer thread's token rows of a stage: 16-byte chunk c (k from k0 + c * 16 / sizeof(E)) of x rows
 * row[i] (-1: none, zero-filled from `none`) into dst + i * ROW_STEP rows of 128 bytes. */
template <int N, int ROW_STEP, class E>
__device__ __forceinline__ void ring_gather(uint32_t dst, const E *x, const int (&row)[N], int k, int k0, int c,
                                            bool k_ok, const void *none) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const bool ok = row[i] >= 0 && k_ok;
        const void *src = ok ? (const void *)(x + (size_t)row[i] * k + k0 + c * (16 / (int)sizeof(E))) : none;
        cp_async16(dst + i * ROW_STEP * 128, src, ok);
    }
}

/* Producer: this thread's arrival on `full` once its cp.async of the stage have landed. */
__device__ __forceinline__ void ring_arrive_cp_async(uint32_t full) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
}

/* A plain arrival on a slot barrier: a consumer warp's release of `empty` (lane 0, after __syncwarp). */
__device__ __forceinline__ void ring_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

#endif /* COLIBRI_CUDA_SM90_RING_CUH */
