/*
 * load_probe.cu — which load brings the 128-row streaming tiles' weights into shared memory fastest?
 * (NOTES.md v29). Not part of the library: a standalone probe, built and run on the GPU machine:
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o load_probe csrc/dev/cuda/load_probe.cu
 *   ./load_probe [reps]
 *
 * The weights of Mixtral's up projection (8 experts, a gate and an up matrix of 14336 x 4096 bf16 each: 1.88 GB
 * in one allocation, as the library keeps them) are streamed into shared memory by persistent blocks, item by
 * item, as wgmma_ws_kernel's streaming items at Mixtral T=256 do: an item is 128 gate rows and the 128 up rows
 * of the same columns over all of k (2 MB), items blockIdx.x + i gridDim.x. Nothing is multiplied and no token
 * rows move: the consumer only waits for each stage and gives it back. The loads:
 *  - tma P S: per 32 KB stage, two 2-d TMA boxes of 64 k x 128 rows, 128-byte swizzle (the library's boxes),
 *    L2 promotion P (none, 128 or 256 bytes), S stages in a ring of mbarriers; a producer thread issues, a
 *    consumer thread waits for the bytes and releases the slot;
 *  - bulk C S: the same 32 KB stages read as if the weights were laid out tile by tile (each stage's bytes
 *    contiguous; the same bytes of the same allocation, in another order): 1-d bulk copies of C bytes;
 *  - tma pair S / tma nosw256 S: stages of 64 gate and 64 up rows x 128 k (256 bytes of each row): two swizzled
 *    boxes of 64 k issued back to back per row block, or one unswizzled box of 128 k (not a layout wgmma reads);
 *  - cp BK S: 256 threads' 16-byte cp.async into S stages of BK k (BK = 64: 128 bytes of each of the 256 rows,
 *    32 KB; BK = 128: 256 bytes, 64 KB, as mma_kernel's long tiles), S - 1 stages in flight (mma_kernel's ring);
 *  - flat: every byte read into registers by a grid-stride loop (8 loads in flight per thread);
 *  - copy: cudaMemcpyAsync of the same 1.88 GB to another buffer, counted as bench_gpu.py counts its copy rate
 *    (bytes read + written over the time).
 * One block per SM (the ring kernels take enough shared memory for that; "x2": two blocks per SM, each with its own ring of the stages named).
 * Timed by CUDA events around each launch after an L2 flush (a 512 MB memset, as bench_gpu.py), the variants
 * interleaved round by round; prints the median time and the rate (bytes read / time) of each.
 */
#include "probe_check.h"
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#define E 8
#define N 14336
#define K 4096
#define ROWS_PER_ITEM 128
#define ITEMS (E * (N / ROWS_PER_ITEM))
#define KSTEP 64
#define KSTEPS (K / KSTEP)
#define STAGE_BYTES (2 * ROWS_PER_ITEM * KSTEP * 2) /* 32 KB */

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

/* MODE 0: TMA boxes of 64 k x 128 rows through `map`; 1: bulk copies of `piece` bytes from the tile-by-tile
 * order; 2: stages of 64 gate and 64 up rows x 128 k, each row's two 128-byte halves by two swizzled boxes of 64
 * rows issued back to back; 3: the same stages by unswizzled boxes of 128 k x 64 rows (256-byte rows in shared
 * memory, a layout wgmma's descriptors do not read: a probe of the access alone) */
template <int MODE>
__global__ void __launch_bounds__(64) ring_kernel(const __grid_constant__ CUtensorMap map, const char *w, int stages,
                                                  int piece, unsigned *sink) {
    extern __shared__ char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * 8];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(bars), empty0 = full0 + 8 * 8;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < stages; s++) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full0 + 8 * s) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(empty0 + 8 * s) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int slot = 0;
    if (tid == 0) { /* producer */
        uint32_t parity = 1;
        for (int item = blockIdx.x; item < ITEMS; item += gridDim.x) {
            const int e = item / (N / ROWS_PER_ITEM), nb = item % (N / ROWS_PER_ITEM);
            const int row_g = e * 2 * N + nb * ROWS_PER_ITEM, row_u = row_g + N;
            for (int ks = 0; ks < KSTEPS; ks++) {
                bar_wait(empty0 + 8 * slot, parity);
                const uint32_t full = full0 + 8 * slot, dst = base + (uint32_t)slot * STAGE_BYTES;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(STAGE_BYTES)
                             : "memory");
                if (MODE >= 2) {
                    /* 64 gate and 64 up rows x 128 k: rows row + 64 h, k 128 (ks / 2) */
                    const int h = ks & 1, k0 = (ks >> 1) * 2 * KSTEP;
                    const int rg = row_g + 64 * h, ru = row_u + 64 * h;
                    if (MODE == 2) {
                        /* four 128-byte swizzled boxes of 64 k x 64 rows: each row's 256 bytes back to back */
                        const int rr[4] = {rg, rg, ru, ru}, kk[4] = {k0, k0 + KSTEP, k0, k0 + KSTEP};
#pragma unroll
                        for (int b = 0; b < 4; b++)
                            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                         " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst + b * STAGE_BYTES / 4),
                                         "l"(&map), "r"(kk[b]), "r"(rr[b]), "r"(full)
                                         : "memory");
                    } else {
                        /* two unswizzled boxes of 128 k x 64 rows (256-byte rows) */
                        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                     " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                                     "l"(&map), "r"(k0), "r"(rg), "r"(full)
                                     : "memory");
                        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                     " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst + STAGE_BYTES / 2),
                                     "l"(&map), "r"(k0), "r"(ru), "r"(full)
                                     : "memory");
                    }
                } else if (MODE == 0) {
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                                 "l"(&map), "r"(ks * KSTEP), "r"(row_g), "r"(full)
                                 : "memory");
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst + STAGE_BYTES / 2),
                                 "l"(&map), "r"(ks * KSTEP), "r"(row_u), "r"(full)
                                 : "memory");
                } else {
                    const char *src = w + ((size_t)item * KSTEPS + ks) * STAGE_BYTES;
                    for (int p = 0; p < STAGE_BYTES; p += piece)
                        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                                     " [%0], [%1], %2, [%3];" ::"r"(dst + p),
                                     "l"(src + p), "r"(piece), "r"(full)
                                     : "memory");
                }
                if (++slot == stages) slot = 0, parity ^= 1u;
            }
        }
    } else if (tid == 32) { /* consumer */
        uint32_t parity = 0, acc = 0;
        for (int item = blockIdx.x; item < ITEMS; item += gridDim.x)
            for (int ks = 0; ks < KSTEPS; ks++) {
                bar_wait(full0 + 8 * slot, parity);
                uint32_t v;
                asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base + (uint32_t)slot * STAGE_BYTES + 4 * (ks & 7)));
                acc += v;
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty0 + 8 * slot) : "memory");
                if (++slot == stages) slot = 0, parity ^= 1u;
            }
        if (acc == 0x12345678u) *sink = acc;
    }
}

__device__ __forceinline__ void cp16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

/* 256 threads, stages of BK k of the item's 256 rows; thread t copies chunks t + 256 i (row c / (BK / 8)) */
template <int BK, int STAGES> __global__ void __launch_bounds__(256) cp_kernel(const char *w, unsigned *sink) {
    extern __shared__ char smem_raw[];
    constexpr int CPR = BK / 8, SB = 256 * BK * 2; /* 256 rows of CPR chunks over 256 threads: CPR chunks each */
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const int my_items = (ITEMS - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int total = my_items * (K / BK);
    auto issue = [&](int s) {
        if (s < total) {
            const int item = blockIdx.x + (s / (K / BK)) * gridDim.x, ks = s % (K / BK);
            const int e = item / (N / ROWS_PER_ITEM), nb = item % (N / ROWS_PER_ITEM);
            const size_t row_g = (size_t)e * 2 * N + nb * ROWS_PER_ITEM;
            const uint32_t st = base + (uint32_t)(s % STAGES) * SB;
#pragma unroll
            for (int i = 0; i < CPR; i++) {
                const int c = tid + 256 * i, r = c / CPR, col = c % CPR;
                const size_t row = r < ROWS_PER_ITEM ? row_g + r : row_g + N + (r - ROWS_PER_ITEM);
                cp16(st + (uint32_t)c * 16, w + (row * K + (size_t)ks * BK) * 2 + col * 16);
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    for (int s = 0; s < STAGES - 1; s++) issue(s);
    uint32_t acc = 0;
    for (int s = 0; s < total; s++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        __syncthreads();
        uint32_t v;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base + (uint32_t)(s % STAGES) * SB + 4 * (tid & 31)));
        acc += v;
        issue(s + STAGES - 1);
    }
    asm volatile("cp.async.wait_all;");
    if (acc == 0x12345678u) *sink = acc;
}

__global__ void flat_kernel(const uint4 *p, long long n, unsigned *sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = __ldcs(p + (i0 + u * stride < n ? i0 + u * stride : i0));
#pragma unroll
        for (int u = 0; u < 8; u++) acc += v[u].x ^ v[u].w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

typedef CUresult (*EncodeFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                             const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                             CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

struct Variant {
    std::string name;
    std::function<void()> launch;
    std::vector<float> ts;
};

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    const size_t wbytes = (size_t)E * 2 * N * K * 2, flush_bytes = 512u << 20;
    char *w, *w2, *flush;
    unsigned *sink;
    CHECK(cudaMalloc(&w, wbytes));
    CHECK(cudaMalloc(&w2, wbytes));
    CHECK(cudaMalloc(&flush, flush_bytes));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(w, 1, wbytes));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    void *fn = NULL;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (!fn || found != cudaDriverEntryPointSuccess) {
        fprintf(stderr, "no cuTensorMapEncodeTiled\n");
        return 1;
    }
    CUtensorMap maps[5]; /* promotions none, 128, 256; 3: 64 k x 64 rows (256); 4: 128 k x 64 rows, unswizzled */
    const CUtensorMapL2promotion promo[3] = {CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B};
    const cuuint64_t dims[2] = {K, (cuuint64_t)E * 2 * N}, strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {KSTEP, ROWS_PER_ITEM}, unit[2] = {1, 1};
    for (int i = 0; i < 3; i++)
        if (((EncodeFn)fn)(&maps[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, dims, strides, box, unit,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo[i],
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
            fprintf(stderr, "encode failed\n");
            return 1;
        }
    const cuuint32_t box64[2] = {KSTEP, 64}, box128[2] = {2 * KSTEP, 64};
    if (((EncodeFn)fn)(&maps[3], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, dims, strides, box64, unit,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS ||
        ((EncodeFn)fn)(&maps[4], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, dims, strides, box128, unit,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        fprintf(stderr, "encode failed (64-row boxes)\n");
        return 1;
    }

    /* the opt-in limit counts the kernel's static barriers too, so the dynamic part gets what they leave */
    int optin = 0;
    CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    for (const void *k : {(const void *)ring_kernel<0>, (const void *)ring_kernel<1>, (const void *)ring_kernel<2>,
                          (const void *)ring_kernel<3>}) {
        cudaFuncAttributes fa;
        CHECK(cudaFuncGetAttributes(&fa, k));
        CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - (int)fa.sharedSizeBytes));
    }
    std::vector<Variant> vs;
    /* per block: the ring plus 1 KB for the alignment; at least 116 KB so that one block fits per SM (x2: 2) */
    auto ring = [&](int mode, int promo_i, int piece, int stages, int per_sm) {
        const size_t need = (size_t)stages * STAGE_BYTES + 1024;
        const size_t smem = std::max(need, (size_t)(per_sm == 1 ? 116 : 76) * 1024);
        std::string name = mode == 0   ? "tma p" + std::to_string(promo_i == 0 ? 0 : promo_i == 1 ? 128 : 256)
                           : mode == 1 ? "bulk " + std::to_string(piece / 1024) + "K"
                           : mode == 2 ? "tma pair"
                                       : "tma nosw256";
        name += " s" + std::to_string(stages) + (per_sm == 2 ? " x2" : "");
        const CUtensorMap *m = &maps[promo_i];
        vs.push_back({name, [=]() {
                          if (mode == 0)
                              ring_kernel<0><<<sms * per_sm, 64, smem>>>(*m, w, stages, piece, sink);
                          else if (mode == 1)
                              ring_kernel<1><<<sms * per_sm, 64, smem>>>(*m, w, stages, piece, sink);
                          else if (mode == 2)
                              ring_kernel<2><<<sms * per_sm, 64, smem>>>(*m, w, stages, piece, sink);
                          else
                              ring_kernel<3><<<sms * per_sm, 64, smem>>>(*m, w, stages, piece, sink);
                      }});
    };
    for (int s : {2, 3, 4, 5, 6}) ring(0, 2, 0, s, 1);
    ring(0, 0, 0, 4, 1);
    ring(0, 1, 0, 4, 1);
    for (int s : {3, 4}) ring(2, 3, 0, s, 1);
    for (int s : {3, 4}) ring(3, 4, 0, s, 1);
    ring(0, 2, 0, 2, 2);
    ring(0, 2, 0, 3, 2);
    for (int s : {2, 3, 4, 6}) ring(1, 0, STAGE_BYTES, s, 1);
    ring(1, 0, 8192, 4, 1);
    ring(1, 0, 2048, 4, 1);
    ring(1, 0, STAGE_BYTES, 3, 2);
#define CPV(BK, S)                                                                                                 \
    do {                                                                                                           \
        const size_t smem = std::max((size_t)(S) * 256 * (BK) * 2 + 1024, (size_t)116 * 1024);                     \
        CHECK(cudaFuncSetAttribute(cp_kernel<BK, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));     \
        vs.push_back({"cp bk" #BK " s" #S, [=]() { cp_kernel<BK, S><<<sms, 256, smem>>>(w, sink); }});             \
    } while (0)
    CPV(64, 3);
    CPV(64, 4);
    CPV(64, 6);
    CPV(128, 2);
    CPV(128, 3);
    vs.push_back({"flat", [=]() { flat_kernel<<<sms * 4, 256>>>((const uint4 *)w, (long long)(wbytes / 16), sink); }});
    vs.push_back({"copy (r+w)", [=]() { CHECK(cudaMemcpyAsync(w2, w, wbytes, cudaMemcpyDeviceToDevice)); }});

    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int r = 0; r < reps + 2; r++)
        for (Variant &v : vs) {
            CHECK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
            CHECK(cudaEventRecord(a));
            v.launch();
            CHECK(cudaEventRecord(b));
            CHECK(cudaEventSynchronize(b));
            const cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) {
                fprintf(stderr, "%s: %s\n", v.name.c_str(), cudaGetErrorString(err));
                return 1;
            }
            float ms;
            CHECK(cudaEventElapsedTime(&ms, a, b));
            if (r >= 2) v.ts.push_back(ms);
        }
    printf("%d SMs, %.3f GB of weights (%d items of 2 x %d rows x %d k), median of %d, rate = bytes read / time\n", sms,
           wbytes / 1e9, ITEMS, ROWS_PER_ITEM, K, reps);
    for (Variant &v : vs) {
        std::sort(v.ts.begin(), v.ts.end());
        const float med = v.ts[v.ts.size() / 2];
        const double bytes = v.name.rfind("copy", 0) == 0 ? 2.0 * wbytes : (double)wbytes;
        printf("%-16s %8.1f us  %5.2f TB/s  (min %.1f, max %.1f)\n", v.name.c_str(), med * 1e3, bytes / (med * 1e-3) / 1e12,
               v.ts.front() * 1e3, v.ts.back() * 1e3);
    }
    return 0;
}
