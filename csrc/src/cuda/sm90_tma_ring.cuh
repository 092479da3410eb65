/*
 * sm90_tma_ring.cuh — the ring of shared-memory stages that a producer warpgroup fills and consumer
 * warpgroups empty, as wgmma_ws_kernel (sm90_wgmma_ws_experts.cuh) and wgmma_fp8_kernel
 * (sm90_fp8_experts.cuh) both run it: each slot's "full" and "empty" mbarriers, either side's place in the
 * ring, the weight rows by TMA and the token rows gathered by cp.async through the tile table. One copy, so
 * that a fix to the ring is made once. sm_90a with CUDA 12 tensor maps (COLIBRI_TMA).
 */
#ifndef COLIBRI_CUDA_SM90_TMA_RING_CUH
#define COLIBRI_CUDA_SM90_TMA_RING_CUH

#include "sm90_wgmma.cuh"

#if COLIBRI_TMA
/* One side's place in a ring of STAGES slots: its slot, and the parity of the phase it waits for there
 * (the producer waits for "empty" phases, starting at parity 1, which a new barrier counts as complete, so
 * the first pass waits for none; the consumers wait for "full" phases from parity 0). */
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

/* Slot s's "full" mbarrier at full0 + s * stride, its "empty" one 8 bytes on. "full" completes with the
 * producer's full_count arrivals (each thread's cp.async, plus thread 0's expect_tx for the TMA bytes);
 * "empty" with one arrival per consumer warp. By one thread; the caller fences and syncs after. */
__device__ __forceinline__ void ring_init(uint32_t full0, uint32_t stride, int stages, unsigned full_count,
                                          unsigned empty_count) {
    for (int sl = 0; sl < stages; sl++) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(full0 + sl * stride), "r"(full_count) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(full0 + sl * stride + 8), "r"(empty_count)
                     : "memory");
    }
}

/* Waits until the phase of parity `parity` of the mbarrier at `bar` has completed (acquire, block scope).
 * A barrier just initialised counts its phase of parity 1 as complete. */
__device__ __forceinline__ void ws_wait(uint32_t bar, uint32_t parity) {
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

/* The producer takes a slot: waits until the consumers have released it, then orders its writes after
 * their reads (the products read the slot through the async proxy; cp.async writes it through the
 * generic one). */
__device__ __forceinline__ void ring_acquire(uint32_t empty, uint32_t parity) {
    ws_wait(empty, parity);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Thread 0 of the producer: the stage's TMA bytes, which "full" waits for besides the arrivals */
__device__ __forceinline__ void ring_expect(uint32_t full, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(bytes) : "memory");
}

/* 128 weight rows from `row` x 64 k from k0 of `expert`, by TMA into shared memory at dst, completing
 * bytes on mbarrier `bar` */
__device__ __forceinline__ void ws_tma_rows(uint32_t dst, uint64_t map, int k0, int row, int expert, uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"(map), "r"(k0), "r"(row), "r"(expert), "r"(bar)
                 : "memory");
#endif
}

/* The x rows of this producer thread's N token rows, positions first + i ROW_STEP of the tile table
 * (row_map[p] / row_div, or p itself without a map); -1 from `end` on. */
template <int N, int ROW_STEP>
__device__ __forceinline__ void ring_token_rows(int (&row)[N], int first, int end, const int32_t *row_map,
                                                int row_div) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int pos = first + i * ROW_STEP;
        row[i] = pos < end ? (row_map ? row_map[pos] / row_div : pos) : -1;
    }
}

/* This thread's 16-byte chunk, elements col.. of x rows row[i] (ld elements apart), into the stage at
 * dst + i ROW_STEP 128 (swizzled by the caller's dst), for the rows r0 + i ROW_STEP < rows; rows of -1
 * and k past the end (!k_ok) write zeros, reading the valid address `any`. */
template <int N, int ROW_STEP, class E>
__device__ __forceinline__ void ring_gather(uint32_t dst, const int (&row)[N], const E *x, int ld, int col, bool k_ok,
                                            const void *any, int r0 = 0, int rows = N * ROW_STEP) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const bool ok = row[i] >= 0 && k_ok;
        const void *src = ok ? (const void *)(x + (size_t)row[i] * ld + col) : any;
        if (r0 + i * ROW_STEP < rows) cp_async16(dst + i * ROW_STEP * 128, src, ok);
    }
}

/* The producer thread's part of the stage is issued: "full" counts it once its cp.async have landed */
__device__ __forceinline__ void ring_commit(uint32_t full) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
}

/* A consumer warp is done with slot's stage (all its lanes past their products) */
__device__ __forceinline__ void ring_release(uint32_t empty) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty) : "memory");
}
#endif /* COLIBRI_TMA */

#endif /* COLIBRI_CUDA_SM90_TMA_RING_CUH */
