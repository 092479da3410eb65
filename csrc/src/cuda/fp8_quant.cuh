/*
 * fp8_quant.cuh — activations to fp8 e4m3 for the fp8 tensor-core path (sm90_fp8_experts.cuh), as DeepSeek's
 * kernels quantise them: each row in groups of FP8_GROUP columns with one fp32 scale per group
 * (amax / 448), value = fp8 * scale. The tokens before the first projection, the bf16 intermediate
 * before the second.
 */
#ifndef COLIBRI_CUDA_FP8_QUANT_CUH
#define COLIBRI_CUDA_FP8_QUANT_CUH

#include <cuda_fp8.h>

#include "cuda_backend.cuh"

#define FP8_MAX 448.0f  /* largest finite e4m3 */

/* x [rows, k] -> q [rows, k] fp8 and scales [rows, fp8_groups(k)]. One warp per (row, group): lane l takes
 * columns 4l..4l+3 of the group, one 8- or 16-byte load and one 4-byte store. k % 16 == 0 (the tensor-core
 * path's rule), so a lane's four columns are all inside the row or all past it; `vec`: x is 16-byte aligned
 * (else four scalar loads). A group of zeros gets scale 0 and zeros; NaN stays NaN (the amax skips it, the conversion keeps it); an infinite input turns
 * its group to NaN. */
template <class TX>
__global__ void __launch_bounds__(256) fp8_quant_kernel(const TX *x, int64_t rows, int k, bool vec, uint8_t *q,
                                                          float *scales) {
    pdl_begin();
    const int groups = fp8_groups(k), lane = threadIdx.x & 31;
    const int64_t units = rows * groups, warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t u = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5); u < units; u += warps) {
        const int64_t row = u / groups;
        const int col = (int)(u - row * groups) * FP8_GROUP + 4 * lane;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const bool in = col < k;
        if (in && vec) {
            load_f32<TX, 4>(x + row * k + col, v);
        } else if (in) {
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = to_f32(x[row * k + col + i]);
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const float inv = amax > 0.0f ? FP8_MAX / amax : 0.0f;
        if (in) {
            const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] * inv, v[1] * inv), __NV_SATFINITE, __NV_E4M3);
            const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] * inv, v[3] * inv), __NV_SATFINITE, __NV_E4M3);
            *reinterpret_cast<uint32_t *>(q + row * k + col) = lo | hi << 16;
        }
        if (lane == 0) scales[u] = amax / FP8_MAX;
    }
}

/* Enqueues fp8_quant_kernel over x's rows (at most 8 blocks of 8 warps per SM, which loop). */
template <class TX>
static cudaError_t fp8_quant_launch(const TX *x, int64_t rows, int32_t k, uint8_t *q, float *scales, int sms,
                                    cudaStream_t stream) {
    const int64_t blocks = (rows * fp8_groups(k) + 7) / 8, most = 8 * (int64_t)sms;
    return colibri_launch(fp8_quant_kernel<TX>, dim3((unsigned)(blocks < most ? blocks : most)), dim3(256), 0, stream,
                          x, rows, (int)k, colibri_aligned16(x), q, scales);
}

#endif /* COLIBRI_CUDA_FP8_QUANT_CUH */
