/*
 * sm90_wgmma.cuh — the pieces the Hopper (sm_90a) expert kernels share: the 128-row tile's shape, the
 * shared-memory descriptors and bf16/fp16 m64n256k16 products, the epilogue's staging through stmatrix,
 * and the order of the work items. The kernels: sm90_wgmma_experts.cuh, sm90_wgmma_ws_experts.cuh (and
 * sm90_fp8_experts.cuh, which takes the tile order and descriptors).
 */
#ifndef COLIBRI_CUDA_SM90_WGMMA_CUH
#define COLIBRI_CUDA_SM90_WGMMA_CUH

#include <type_traits>

#include "activation.cuh"
#include "gemv.cuh"
#include "sm80_mma.cuh"

/* wgmma_ws_kernel (sm90_wgmma_ws_experts.cuh) needs CUDA 12's tensor maps; with an older toolkit (CUDA 11.8 stacks, which
 * build no sm_90a image anyway) it is left out. */
#if CUDART_VERSION >= 12000
#include <cuda.h>
#define COLIBRI_TMA 1
#else
#define COLIBRI_TMA 0
#endif

#define WG_BM 128
#define WG_BN 256 /* weight rows per block */
#define WG_BK 64
#define WG_STAGES 4
#define WG_THREADS 256
#define WG_A_BYTES (WG_BM * WG_BK * 2)
#define WG_B_BYTES (WG_BN * WG_BK * 2)
#define WG_STAGE_BYTES (WG_A_BYTES + WG_B_BYTES)
/* The output staging buffer behind the ring: per warp its 16 rows x 128 output columns of an item,
 * each row padded by 16 bytes so that the 8 rows one stmatrix phase writes start in 8 different
 * 16-byte bank groups (rows of 272 bytes: group r + c for row r, chunk c). */
#define WG_OUT_COLS 128
#define WG_OUT_ROW_BYTES (WG_OUT_COLS * 2 + 16)
#define WG_OUT_WARP_BYTES (16 * WG_OUT_ROW_BYTES)
#define WG_OUT_BYTES (WG_THREADS / 32 * WG_OUT_WARP_BYTES)
/* + 1024: the dynamic shared memory is aligned up to the swizzle's 1024-byte period. 227 KB in all,
 * the opt-in limit of an H100/H200 block. */
#define WG_SMEM_BYTES (WG_STAGES * WG_STAGE_BYTES + WG_OUT_BYTES + 1024)

/* Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address >> 4,
 * leading offset 1 (unused for this layout), 1024 bytes between groups of 8 rows, swizzle mode 1. */
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

#define WG_D_REGS                                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "  \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
    "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "  \
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, "     \
    "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "      \
    "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define WG_D_OPERANDS(d)                                                                                   \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),            \
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),          \
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),          \
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),          \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),          \
        "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),          \
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),          \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),          \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),          \
        "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),          \
        "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),          \
        "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),          \
        "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),          \
        "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]),    \
        "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]),   \
        "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),   \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]),   \
        "+f"(d[127])
/* d (+)= A B^T for a 64 x 16 A and a 256 x 16 B, both K-major in shared memory. */
#define WG_MMA_M64N256K16(TYPE, d, da, db)                                                                  \
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " WG_D_REGS                 \
                 ", %128, %129, 1, 1, 1, 0, 0;"                                                             \
                 : WG_D_OPERANDS(d)                                                                         \
                 : "l"(da), "l"(db))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <class T> __device__ __forceinline__ void wg_mma(float (&d)[128], uint64_t da, uint64_t db) {
    if constexpr (std::is_same<T, __half>::value) WG_MMA_M64N256K16("f16", d, da, db);
    else WG_MMA_M64N256K16("bf16", d, da, db);
}

/* Four 8x8 b16 matrices in the accumulator layout, lane l giving the address of row l % 8 of matrix l / 8. */
__device__ __forceinline__ void wg_stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}
/* shared -> global copy of `bytes` (a multiple of 16) by the bulk-copy engine, in this thread's bulk group */
__device__ __forceinline__ void wg_bulk_store(void *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
#endif

/* The output step's pieces, shared by wgmma_kernel and wgmma_ws_kernel. Accumulator layout of
 * m64nNk16: thread (warp w of the group, lane l) holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1)
 * in acc[4j + {0,1}] (acc[4j + {2,3}] for row + 8): the fragments of stmatrix. SWIGLU's up column for
 * gate column j is 128 columns, 64 registers, further on. wg_stage_part writes this warp's 16 rows x
 * output columns [COLS part, + COLS) (a GLU: Act::apply_fast(gate, up)) to `buf`, rows ROW_BYTES apart
 * (wgmma_kernel: 128 columns, WG_OUT_ROW_BYTES; wgmma_ws_kernel: 64, WS_OUT_ROW_BYTES). */
template <class T, class Act, int COLS, int ROW_BYTES>
__device__ __forceinline__ void wg_stage_part(const float (&acc)[128], uint32_t buf, int part, const ProjArgs &a,
                                              int expert, int col0) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int lane = threadIdx.x & 31;
    /* lane l's row address for stmatrix: row l % 8 (+8 for matrices 1 and 3), chunk +1 for 2 and 3 */
    const uint32_t lane_off = ((lane & 7) + (lane & 8)) * ROW_BYTES + (lane >> 4) * 16;
#pragma unroll
    for (int jj = 0; jj < COLS / 16; jj++) {
        uint32_t r[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int i = 4 * (part * COLS / 8 + 2 * jj + (q >> 1)) + 2 * (q & 1);
            float v0 = acc[i], v1 = acc[i + 1];
            if constexpr (Act::glu) {
                /* acc[i]'s output column: col0 (the item's first) + 8 (i / 4) + 2 (lane % 4) */
                float u0 = acc[64 + i], u1 = acc[64 + i + 1];
                const int col = col0 + 8 * (i >> 2) + 2 * (lane & 3);
                colibri_glu_bias(a, expert, col, v0, u0);
                colibri_glu_bias(a, expert, col + 1, v1, u1);
                v0 = Act::apply_fast(v0, u0, a);
                v1 = Act::apply_fast(v1, u1, a);
            }
            r[q] = pack2<T>(v0, v1);
        }
        wg_stmatrix_x4(buf + lane_off + jj * 32, r[0], r[1], r[2], r[3]);
    }
#endif
}

/* Stores this warp's 16 rows (positions prow + r below tile_end) x output columns [col, + COLS) (col < n;
 * fewer where n ends first) of an [*, n] output through its staging buffer `buf`: once the bulk copies
 * of the buffer's previous use have read it, the rows are staged and handed to the bulk-copy engine, a
 * row per lane, and the warp goes on while they are written. */
template <class T, class Act, int COLS, int ROW_BYTES>
__device__ __forceinline__ void wg_store_part(const float (&acc)[128], uint32_t buf, int part, T *out, int n, int col,
                                              int prow, int tile_end, const ProjArgs &a, int expert) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int lane = threadIdx.x & 31;
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncwarp();
    wg_stage_part<T, Act, COLS, ROW_BYTES>(acc, buf, part, a, expert, col - part * COLS);
    /* stmatrix wrote through the generic proxy; the bulk copy reads through the async proxy */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane < 16 && prow + lane < tile_end)
        wg_bulk_store(out + (size_t)(prow + lane) * n + col, buf + lane * ROW_BYTES, (uint32_t)min(COLS, n - col) * 2);
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

/* As wg_store_part, without the bulk-copy engine: the rows staged with stmatrix are read back as 16-byte
 * chunks and written with coalesced 16-byte stores, so that a round needs no wait for the engine's reads
 * of the buffer before the next one (wgmma_ws_kernel's 64-column rounds through the bulk copies made the
 * fine-grained T=256-2048 rows 0.98x; these, 1.00x). */
template <class T, class Act, int COLS, int ROW_BYTES>
__device__ __forceinline__ void wg_store_part_direct(const float (&acc)[128], uint32_t buf, int part, T *out, int n,
                                                     int col, int prow, int tile_end, const ProjArgs &a,
                                                     int expert) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CHUNKS = COLS / 8; /* 16-byte chunks per row */
    const int lane = threadIdx.x & 31;
    __syncwarp(); /* the last round's reads of the buffer are done */
    wg_stage_part<T, Act, COLS, ROW_BYTES>(acc, buf, part, a, expert, col - part * COLS);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * CHUNKS / 32; i++) {
        const int idx = i * 32 + lane, r = idx / CHUNKS, ch = idx % CHUNKS, c = col + ch * 8;
        if (c < n && prow + r < tile_end) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(buf + r * ROW_BYTES + ch * 16)
                         : "memory");
            *reinterpret_cast<uint4 *>(out + (size_t)(prow + r) * n + c) = v;
        }
    }
#endif
}

/* Work item `it` of a projection with `tiles` tiles and `nblocks` column blocks: items run in groups of
 * WG_GROUP_N column blocks, column block fastest inside a group, so that the ~one item per SM in flight
 * at a time cover a few tiles x WG_GROUP_N column blocks: an expert's weight block is read from HBM
 * once for all its tiles and a tile's token rows once for WG_GROUP_N column blocks (tile-fastest order
 * re-read every token row for every column block: 64 MB per block for Mixtral's up GEMM at T=4096,
 * more than L2 holds). */
#define WG_GROUP_N 16
__device__ __forceinline__ void wg_item(int it, int tiles, int nblocks, int &tile, int &nb) {
    const int group = it / (tiles * WG_GROUP_N), r = it - group * tiles * WG_GROUP_N;
    const int width = min(WG_GROUP_N, nblocks - group * WG_GROUP_N);
    tile = r / width;
    nb = group * WG_GROUP_N + r % width;
}

/* An item's products into acc, for both kernels: zeroes acc and runs this warpgroup's k loop, with
 * products or, where its 64 rows of the item's tile are all past the tile's end (every row, for the empty
 * tile of wgmma_ws_kernel's MC rank 1 with none), without (wgmma_kernel's k_loop says why). */
template <class KLoop>
__device__ __forceinline__ void wg_products(const ExpertTile &tile, int wg, float (&acc)[128], KLoop &k_loop) {
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    if (tile.end - tile.begin > wg * (WG_BM / 2)) k_loop(std::true_type{});
    else k_loop(std::false_type{});
}

#endif /* COLIBRI_CUDA_SM90_WGMMA_CUH */
