/*
 * sm80_mma.cuh — tensor-core pieces for sm_80 on (bf16 and fp16 operands), shared by the expert kernels
 * (sm80_mma_experts.cuh, sm90_*.cuh) and route.cu (route_mma_kernel): the XOR-swizzled shared-memory
 * rows, cp.async, ldmatrix, mma.sync m16n8k16, the epilogue's packing.
 */
#ifndef COLIBRI_CUDA_SM80_MMA_CUH
#define COLIBRI_CUDA_SM80_MMA_CUH

#include "cuda_backend.cuh"

/* Two floats rounded to T and packed into one 32-bit register (an epilogue's pair of columns). */
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    T v[2] = {from_f32<T>(lo), from_f32<T>(hi)};
    return *reinterpret_cast<uint32_t *>(v);
}

/* One smem row holds BK 16-bit elements. Chunk c (16 bytes) of row r lives at chunk c ^ (r & 7) for
 * 128-byte rows and c ^ ((r >> 1) & 3) for 64-byte rows: either way the 8 rows one ldmatrix phase reads
 * hit 8 different 16-byte bank groups. */
template <int BK> __device__ __forceinline__ uint32_t swz(int r, int c) {
    if constexpr (BK == 128) return (uint32_t)(r * 256 + ((c ^ (r & 7)) << 4)); /* c ^ (r & 7): within 128 bytes */
    if constexpr (BK == 64) return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4));
    else return (uint32_t)(r * 64 + ((c ^ ((r >> 1) & 3)) << 4));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <class T> __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                                    uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                             uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The A fragments of one 16-element k step (ks, of the stage at st): MI tiles of 16 rows from row r0. */
template <int BK, int MI>
__device__ __forceinline__ void mma_a_frags(uint32_t st, int r0, int ks, uint32_t (&af)[MI][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < MI; i++) ldmatrix_x4(st + swz<BK>(r0 + i * 16 + (lane & 15), ks * 2 + (lane >> 4)), af[i]);
}

/* One 16-element k step of the B rows [r0, r0 + 8 NI) at b (a matrix of the stage) against the A fragments
 * af: acc[i][j] += A tile i x B columns [r0 + 8j, + 8). */
template <class T, int BK, int MI, int NI>
__device__ __forceinline__ void mma_b_step(uint32_t b, int r0, int ks, const uint32_t (&af)[MI][4],
                                           float (&acc)[MI][NI][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int jp = 0; jp < NI / 2; jp++) {
        uint32_t bf[4];
        ldmatrix_x4(b + swz<BK>(r0 + jp * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)), bf);
#pragma unroll
        for (int i = 0; i < MI; i++) {
            mma16816<T>(acc[i][2 * jp], af[i], bf[0], bf[1]);
            mma16816<T>(acc[i][2 * jp + 1], af[i], bf[2], bf[3]);
        }
    }
}

#endif
