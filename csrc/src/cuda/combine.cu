/*
 * combine.cu — the weighted top-k sum: out[t] = sum_j topk_weights[t, j] * y[inv[t*k + j]], j in order,
 * accumulated in fp32 and written once in the activation dtype (y: the compute dtype, cuda_backend.cuh).
 * A fixed order and no float atomics make the output bitwise identical from run to run. Assignments
 * whose id was out of range (inv = -1) contribute nothing. When no permute ran (direct mode, gemv.cuh),
 * inv is NULL, y row t*k + j belongs to assignment t*k + j, and the ids say which are out of range.
 * Expert biases: each y row's expert's output bias is added in fp32 before its weight (BIAS, a variant
 * of its own).
 */
#include "cuda_backend.cuh"

#define COMBINE_THREADS 256

template <class TY, class TA, int V, bool BIAS>
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const TY *y, const int32_t *inv, const int32_t *ids,
                                                                  int E, const float *wts, int k, int O, TA *out,
                                                                  const float *bias, int bias_stride) {
    pdl_begin();
    const int t = blockIdx.x;
    const int col = (blockIdx.y * COMBINE_THREADS + threadIdx.x) * V;
    if (col >= O) return;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0.0f;
    for (int j = 0; j < k; j++) {
        const int i = t * k + j;
        const int p = inv ? inv[i] : (unsigned)ids[i] < (unsigned)E ? i : -1;
        if (p < 0) continue;
        const float w = wts[(size_t)t * k + j];
        float v[V];
        load_f32<TY, V>(y + (size_t)p * O + col, v);
        if constexpr (BIAS) {
            const float *b = bias + (size_t)ids[i] * bias_stride + col;
#pragma unroll
            for (int q = 0; q < V; q++) v[q] += __ldg(b + q);
        }
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = fmaf(w, v[i], acc[i]);
    }
    store_from_f32<TA, V>(out + (size_t)t * O + col, acc);
}

template <class TY, class TA, bool BIAS>
static cudaError_t launch_combine(const TY *y, const int32_t *inv, const int32_t *ids, int E, const float *wts,
                                  int64_t T, int k, int O, TA *out, const float *bias, int bias_stride,
                                  cudaStream_t stream) {
    if (O % 8 == 0 && colibri_aligned16(out)) {
        const dim3 grid((unsigned)T, (unsigned)((O / 8 + COMBINE_THREADS - 1) / COMBINE_THREADS));
        return colibri_launch(combine_kernel<TY, TA, 8, BIAS>, grid, dim3(COMBINE_THREADS), 0, stream, y, inv, ids, E,
                              wts, k, O, out, bias, bias_stride);
    } else {
        const dim3 grid((unsigned)T, (unsigned)((O + COMBINE_THREADS - 1) / COMBINE_THREADS));
        return colibri_launch(combine_kernel<TY, TA, 1, BIAS>, grid, dim3(COMBINE_THREADS), 0, stream, y, inv, ids, E,
                              wts, k, O, out, bias, bias_stride);
    }
}

colibri_status_t colibri_cuda_launch_combine(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             colibri_dtype_t act_dtype, const int32_t *topk_ids,
                                             const float *topk_weights, const int32_t *direct_ids, void *output,
                                             cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const float *bias = colibri_cuda_output_bias(ctx);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_dtype(colibri_cuda_compute_dtype(&ctx->cfg), [&](auto ty) {
        colibri_dispatch_dtype(act_dtype, [&](auto ta) {
            using TY = typename decltype(ty)::type;
            using TA = typename decltype(ta)::type;
            const int32_t *inv = direct_ids ? NULL : b->inv;
            if (bias)
                err = launch_combine<TY, TA, true>((const TY *)b->y, inv, topk_ids, ctx->cfg.num_experts, topk_weights,
                                                   num_tokens, ctx->cfg.top_k, ctx->out_features, (TA *)output, bias,
                                                   ctx->bias_numel, stream);
            else
                err = launch_combine<TY, TA, false>((const TY *)b->y, inv, topk_ids, ctx->cfg.num_experts,
                                                    topk_weights, num_tokens, ctx->cfg.top_k, ctx->out_features,
                                                    (TA *)output, NULL, 0, stream);
        });
    });
    COLIBRI_CUDA_CHECK(err);
    return COLIBRI_OK;
}
