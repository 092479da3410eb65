/*
 * route.cu — built-in routing on the GPU: router logits [T, E] = x @ router^T in fp32 (the memory-bound
 * gemv of gemv.cuh: the router is small and re-read from L2 for each group of 8 tokens), then one warp
 * per token turns a row of logits into top-k ids and weights (colibri.h, colibri_routing_t).
 * A custom routing_fn is called here too, on the caller's stream, with device pointers.
 */
#include <math.h>

#include "gemv.cuh"

/* Selection order: higher score first, ties to the lower id. NaN scores rank last, like -inf. */
__device__ __forceinline__ bool ranks_before(float s, int e, float best_s, int best_e) {
    return s > best_s || (s == best_s && e < best_e);
}

__device__ __forceinline__ float selection_score(colibri_routing_t routing, float logit, const float *bias, int e) {
    float s = logit;
    if (routing == COLIBRI_ROUTING_SIGMOID_BIAS) s = 1.0f / (1.0f + expf(-logit)) + bias[e];
    return isnan(s) ? -INFINITY : s;
}

/* One warp per token. Pick k times the best score ranked after the previous pick: no set of chosen
 * ids to keep, and any E and k work. Lane 0 then forms the weights from the chosen logits. */
__global__ void __launch_bounds__(256) topk_kernel(const float *logits, const float *bias, int T, int E, int k,
                                                   colibri_routing_t routing, int renormalize, float scale,
                                                   int32_t *ids, float *wts) {
    pdl_begin();
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    const float *l = logits + (size_t)t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.0f;
    if (routing == COLIBRI_ROUTING_SOFTMAX_TOPK) {
        for (int e = lane; e < E; e += 32) sum += expf(l[e] - mx);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }

    int32_t *ids_t = ids + (size_t)t * k;
    float *w_t = wts + (size_t)t * k;
    float prev_s = INFINITY;
    int prev_e = -1;
    for (int j = 0; j < k; j++) {
        float best_s = -INFINITY;
        int best_e = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            const float s = selection_score(routing, l[e], bias, e);
            const bool after_prev = s < prev_s || (s == prev_s && e > prev_e);
            if (after_prev && ranks_before(s, e, best_s, best_e)) { best_s = s; best_e = e; }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float os = __shfl_xor_sync(0xffffffffu, best_s, off);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
            if (ranks_before(os, oe, best_s, best_e)) { best_s = os; best_e = oe; }
        }
        prev_s = best_s;
        prev_e = best_e;
        if (lane == 0) {
            const float lg = l[best_e];
            ids_t[j] = best_e;
            w_t[j] = routing == COLIBRI_ROUTING_SOFTMAX_TOPK ? expf(lg - mx) / sum
                     : routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0f / (1.0f + expf(-lg))
                                                               : lg;
        }
    }
    if (lane != 0) return;
    float norm = 1.0f;
    if (routing == COLIBRI_ROUTING_TOPK_SOFTMAX) {
        /* ids come out in descending logit order, so the first is the max */
        const float m = w_t[0];
        float s = 0.0f;
        for (int j = 0; j < k; j++) { w_t[j] = expf(w_t[j] - m); s += w_t[j]; }
        norm = s;
    } else if (renormalize) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w_t[j];
        norm = s;
    }
    for (int j = 0; j < k; j++) w_t[j] = w_t[j] / norm * scale;
}

static cudaError_t launch_topk(const colibri_moe_config_t *c, const float *logits, const float *bias, int64_t T,
                               int32_t *ids, float *wts, cudaStream_t stream) {
    return colibri_launch(topk_kernel, dim3((unsigned)((T + 7) / 8)), dim3(256), 0, stream, logits, bias, (int)T,
                          c->num_experts, c->top_k, c->routing, c->renormalize, c->routed_scaling_factor, ids, wts);
}

static cudaError_t launch_logits(const colibri_moe_context_t *ctx, int64_t T, colibri_dtype_t act_dtype,
                                 const void *input, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    ProjArgs a = {};
    a.w = (const char *)b->router;
    a.n = ctx->cfg.num_experts;
    a.k = ctx->cfg.hidden_size;
    a.x = input;
    a.row_div = 1;
    a.out = b->logits;
    a.positions = (int32_t)T;
    const bool vec = a.k % 8 == 0 && colibri_aligned16(input);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_dtype(act_dtype, [&](auto tx) {
        err = gemv_launch<float, typename decltype(tx)::type, float, false>(a, (T + GEMV_GROUP - 1) / GEMV_GROUP,
                                                                           vec, stream);
    });
    return err;
}

colibri_status_t colibri_cuda_launch_route(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                           colibri_dtype_t act_dtype, const void *input, int32_t *topk_ids,
                                           float *topk_weights, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    if (b->router) COLIBRI_CUDA_CHECK(launch_logits(ctx, num_tokens, act_dtype, input, stream));
    if (c->routing_fn) {
        colibri_status_t st = c->routing_fn(c->routing_user_data, num_tokens, c->num_experts, c->top_k, act_dtype,
                                            input, b->router ? b->logits : NULL, topk_ids, topk_weights, stream);
        if (st != COLIBRI_OK)
            return colibri_set_error(COLIBRI_ERR_ROUTING, "the routing_fn returned status %d (%s)", (int)st,
                                     colibri_status_string(st));
        return COLIBRI_OK;
    }
    COLIBRI_CUDA_CHECK(launch_topk(c, b->logits, b->router_bias, num_tokens, topk_ids, topk_weights, stream));
    return COLIBRI_OK;
}
