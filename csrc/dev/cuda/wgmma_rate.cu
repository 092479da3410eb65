/*
 * wgmma_rate.cu — how fast Hopper's tensor cores run wgmma.mma_async m64nNk16 (bf16 in, fp32 accumulators,
 * A and B from shared memory in the 128-byte swizzle) for the N the kernels use, in the pattern of
 * wgmma_ws_kernel's consumers: two warpgroups per block, one block per SM, each warpgroup issuing a stage of
 * products (P products of N columns over 4 steps of k16), a commit, and wait_group 1, again and again.
 * Written to price a folded item (NOTES.md v24): plain items issue 4 x m64n256k16 a stage; folded ones
 * 8 x m64n152k16 (1.19x the multiply-adds); n136 and n144 priced the products sized to 8 and 16 extra rows
 * (v25 A: 1.125x and 1.191x a plain stage, 1.06x per multiply-add).
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o wgmma_rate csrc/dev/cuda/wgmma_rate.cu
 *   ./wgmma_rate        # one line per pattern: ms, TFLOP/s, and time per multiply-add against 4 x n256
 *
 * mma_N's register list holds N / 2 fp32 accumulators per thread (R_n, F_n below).
 */
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x)                                                                                                 \
    do {                                                                                                      \
        cudaError_t e_ = (x);                                                                                 \
        if (e_ != cudaSuccess) {                                                                              \
            printf("%s: %s\n", #x, cudaGetErrorString(e_));                                                   \
            return 1;                                                                                         \
        }                                                                                                     \
    } while (0)

__device__ __forceinline__ uint64_t desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

/* The register lists: R_n names the asm operands %0..%n-1 and F_n(d) binds them to d[0..n-1], built 8 at a
 * time (R8_i, F8(d, i): operands i..i+7). */
#define R8_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define R8_8 "%8, %9, %10, %11, %12, %13, %14, %15"
#define R8_16 "%16, %17, %18, %19, %20, %21, %22, %23"
#define R8_24 "%24, %25, %26, %27, %28, %29, %30, %31"
#define R8_32 "%32, %33, %34, %35, %36, %37, %38, %39"
#define R8_40 "%40, %41, %42, %43, %44, %45, %46, %47"
#define R8_48 "%48, %49, %50, %51, %52, %53, %54, %55"
#define R8_56 "%56, %57, %58, %59, %60, %61, %62, %63"
#define R8_64 "%64, %65, %66, %67, %68, %69, %70, %71"
#define R8_72 "%72, %73, %74, %75, %76, %77, %78, %79"
#define R8_80 "%80, %81, %82, %83, %84, %85, %86, %87"
#define R8_88 "%88, %89, %90, %91, %92, %93, %94, %95"
#define R8_96 "%96, %97, %98, %99, %100, %101, %102, %103"
#define R8_104 "%104, %105, %106, %107, %108, %109, %110, %111"
#define R8_112 "%112, %113, %114, %115, %116, %117, %118, %119"
#define R8_120 "%120, %121, %122, %123, %124, %125, %126, %127"
#define F8(d, i)                                                                                              \
    "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]),     \
        "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define R_32 R8_0 ", " R8_8 ", " R8_16 ", " R8_24
#define F_32(d) F8(d, 0), F8(d, 8), F8(d, 16), F8(d, 24)
#define R_64 R_32 ", " R8_32 ", " R8_40 ", " R8_48 ", " R8_56
#define F_64(d) F_32(d), F8(d, 32), F8(d, 40), F8(d, 48), F8(d, 56)
#define R_72 R_64 ", " R8_64
#define F_72(d) F_64(d), F8(d, 64)
#define R_80 R_72 ", " R8_72
#define F_80(d) F_72(d), F8(d, 72)
#define R_88 R_80 ", " R8_80
#define F_88(d) F_80(d), F8(d, 80)
#define R_96 R_88 ", " R8_88
#define F_96(d) F_88(d), F8(d, 88)
#define R_68 R_64 ", %64, %65, %66, %67"
#define F_68(d) F_64(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
#define R_76 R_72 ", %72, %73, %74, %75"
#define F_76(d) F_72(d), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75])
#define R_128 R_96 ", " R8_96 ", " R8_104 ", " R8_112 ", " R8_120
#define F_128(d) F_96(d), F8(d, 96), F8(d, 104), F8(d, 112), F8(d, 120)
/* d (+)= A B^T, m64nNk16, bf16, both from shared memory (descriptors da, db), with R accumulators */
#define MMA(N, R, R1)                                                                                         \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" R_##R "}, %" #R ", %" #R1       \
                 ", 1, 1, 1, 0, 0;"                                                                           \
                 : F_##R(d)                                                                                   \
                 : "l"(da), "l"(db))

__device__ __forceinline__ void mma_64(float (&d)[32], uint64_t da, uint64_t db) { MMA(64, 32, 33); }
__device__ __forceinline__ void mma_128(float (&d)[64], uint64_t da, uint64_t db) { MMA(128, 64, 65); }
__device__ __forceinline__ void mma_136(float (&d)[68], uint64_t da, uint64_t db) { MMA(136, 68, 69); }
__device__ __forceinline__ void mma_144(float (&d)[72], uint64_t da, uint64_t db) { MMA(144, 72, 73); }
__device__ __forceinline__ void mma_152(float (&d)[76], uint64_t da, uint64_t db) { MMA(152, 76, 77); }
__device__ __forceinline__ void mma_160(float (&d)[80], uint64_t da, uint64_t db) { MMA(160, 80, 81); }
__device__ __forceinline__ void mma_176(float (&d)[88], uint64_t da, uint64_t db) { MMA(176, 88, 89); }
__device__ __forceinline__ void mma_192(float (&d)[96], uint64_t da, uint64_t db) { MMA(192, 96, 97); }
__device__ __forceinline__ void mma_256(float (&d)[128], uint64_t da, uint64_t db) { MMA(256, 128, 129); }

/* the product of N columns (the N above) */
template <int N> __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t da, uint64_t db) {
    if constexpr (N == 64) mma_64(d, da, db);
    else if constexpr (N == 128) mma_128(d, da, db);
    else if constexpr (N == 136) mma_136(d, da, db);
    else if constexpr (N == 144) mma_144(d, da, db);
    else if constexpr (N == 152) mma_152(d, da, db);
    else if constexpr (N == 160) mma_160(d, da, db);
    else if constexpr (N == 176) mma_176(d, da, db);
    else if constexpr (N == 192) mma_192(d, da, db);
    else mma_256(d, da, db);
}

/* P products of N columns per k16 step: each its own accumulators (P = 2: the folded item's two chunks) */
template <int N, int P> __global__ void __launch_bounds__(256, 1) rate_kernel(int stages, float *sink) {
    extern __shared__ __align__(1024) unsigned char smem[];
    for (int i = threadIdx.x; i < 96 * 1024 / 4; i += blockDim.x) reinterpret_cast<uint32_t *>(smem)[i] = 0;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
    const int wg = threadIdx.x >> 7;
    float d0[N / 2], d1[P == 2 ? N / 2 : 1]; /* one set of accumulators per product of a step */
#pragma unroll
    for (int i = 0; i < N / 2; i++) d0[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < (P == 2 ? N / 2 : 1); i++) d1[i] = 0.0f;
    for (int s = 0; s < stages; s++) {
        const uint32_t st = base + (uint32_t)(s & 1) * 32768u; /* two stages of 32 KB, alternating */
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            const uint64_t a0 = desc(st + wg * 8192u + ks * 32), a1 = desc(st + 4096u + wg * 8192u + ks * 32),
                           b = desc(st + 16384u + ks * 32);
            mma<N>(d0, a0, b);
            if constexpr (P == 2) mma<N>(d1, a1, b);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 2; i++) s += d0[i] + (P == 2 ? d1[i] : 0.0f);
    if (s != 0.0f) sink[blockIdx.x * blockDim.x + threadIdx.x] = s; /* never: the operands are zeros */
}

template <int N, int P>
static int run(const char *what, int sms, int stages, float *sink, double &ref_ns_per_mac) {
    auto k = rate_kernel<N, P>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float best = 1e30f;
    for (int rep = 0; rep < 7; rep++) {
        CK(cudaEventRecord(e0));
        k<<<sms, 256, 160 * 1024>>>(stages, sink);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep > 0 && ms < best) best = ms; /* the first is a warm-up */
    }
    const double macs = (double)sms * 2 /* warpgroups */ * stages * 4 * P * 64.0 * N * 16;
    const double ns_per_mac = best * 1e6 / macs;
    if (ref_ns_per_mac == 0) ref_ns_per_mac = ns_per_mac;
    printf("%-28s %8.3f ms  %6.1f TFLOP/s  time per multiply-add x %.3f  (stage x %.3f of 4 x n256)\n", what,
           best, 2 * macs / best / 1e9, ns_per_mac / ref_ns_per_mac,
           ns_per_mac * P * N / (ref_ns_per_mac * 256));
    return 0;
}

int main(int argc, char **argv) {
    int sms = 0, dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int stages = argc > 1 ? atoi(argv[1]) : 20000;
    float *sink;
    CK(cudaMalloc(&sink, (size_t)sms * 256 * 4));
    double ref = 0;
    printf("%d SMs, %d stages of 4 k16 steps per warpgroup, two warpgroups per SM; best of 6\n", sms, stages);
    if (run<256, 1>("4 x m64n256k16 (plain item)", sms, stages, sink, ref)) return 1;
    if (run<152, 2>("8 x m64n152k16 (folded item)", sms, stages, sink, ref)) return 1;
    if (run<136, 2>("8 x m64n136k16 (8 extra rows)", sms, stages, sink, ref)) return 1;
    if (run<144, 2>("8 x m64n144k16 (16 extra rows)", sms, stages, sink, ref)) return 1;
    if (run<128, 2>("8 x m64n128k16", sms, stages, sink, ref)) return 1;
    if (run<176, 2>("8 x m64n176k16 (fold48)", sms, stages, sink, ref)) return 1;
    if (run<160, 2>("8 x m64n160k16", sms, stages, sink, ref)) return 1;
    if (run<192, 1>("4 x m64n192k16", sms, stages, sink, ref)) return 1;
    if (run<152, 1>("4 x m64n152k16", sms, stages, sink, ref)) return 1;
    if (run<128, 1>("4 x m64n128k16", sms, stages, sink, ref)) return 1;
    if (run<64, 2>("8 x m64n64k16", sms, stages, sink, ref)) return 1;
    if (run<256, 1>("4 x m64n256k16 (again)", sms, stages, sink, ref)) return 1;
    return 0;
}

