/*
 * context.cu — the CUDA backend's life cycle and orchestration: init copies the experts to the device
 * in one allocation (each expert 256-byte aligned) and sizes all workspace for workspace_tokens in a
 * second one; forward only enqueues kernels on the caller's stream (route -> permute -> experts ->
 * combine; at decode no permute, and for SWIGLU the down projection does the combine), so it can be
 * captured in a CUDA graph; counters and the bad-id flag live on the device
 * and are read back with a synchronisation. Every entry runs on the context's device and gives the
 * caller's current device back.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backend.cuh"
#include "cuda_supports.h"

#define DEFAULT_WORKSPACE_TOKENS 8192

namespace {

struct DeviceGuard {
    int prev = -1;
    cudaError_t err;
    explicit DeviceGuard(int device) {
        err = cudaGetDevice(&prev);
        if (err == cudaSuccess && prev != device) err = cudaSetDevice(device);
    }
    ~DeviceGuard() {
        int now = -1;
        if (prev >= 0 && cudaGetDevice(&now) == cudaSuccess && now != prev) cudaSetDevice(prev);
    }
};

/* Hands out 256-byte aligned pieces of one buffer; run once with base NULL to measure. */
struct Carver {
    char *base;
    size_t used = 0;
    template <class T> T *take(size_t count) {
        T *p = base ? (T *)(base + used) : NULL;
        used += (count * sizeof(T) + 255) & ~(size_t)255;
        return p;
    }
};

/* E and k are the routing's; the expert pass's buffers take the shared slices too (E + m experts, k + m
 * slots: colibri_cuda_expert_view). */
void carve_workspace(CudaBackend *b, const colibri_moe_context_t *ctx, size_t tokens, Carver &c) {
    const colibri_moe_config_t *cfg = &ctx->cfg;
    const size_t E0 = (size_t)cfg->num_experts, k0 = (size_t)cfg->top_k, H = (size_t)cfg->hidden_size;
    const size_t m = (size_t)ctx->shared_experts, E = E0 + m, k = k0 + m;
    /* the experts' activations are in the compute dtype (fp8 weights: bf16) */
    const size_t F = (size_t)cfg->intermediate_size, wsize = colibri_dtype_size(colibri_cuda_compute_dtype(cfg));
    const size_t positions = tokens * k;
    b->router = ctx->router_weight ? c.take<float>(E0 * H) : NULL;
    b->router_bias = ctx->router_bias ? c.take<float>(E0) : NULL;
    b->router_logit_bias = ctx->router_logit_bias ? c.take<float>(E0) : NULL;
    b->expert_bias = ctx->expert_bias ? c.take<float>((size_t)colibri_all_experts(ctx) * ctx->bias_numel) : NULL;
    b->expert_scales = ctx->expert_scales ? c.take<float>((size_t)colibri_all_experts(ctx) * ctx->scales_numel) : NULL;
    const size_t split = colibri_cuda_route_split_elems(ctx, tokens);
    b->router_split = split ? c.take<__nv_bfloat16>(split) : NULL;
    b->logits = c.take<float>(tokens * E0);
    b->logits_part = c.take<float>(ctx->router_weight ? colibri_cuda_route_part_floats(ctx, b->sm_count, (int64_t)tokens) : 0);
    b->ids = c.take<int32_t>(tokens * k0);
    b->wts = c.take<float>(tokens * k0);
    b->slot_ids = m ? c.take<int32_t>(positions) : NULL;
    b->slot_wts = m ? c.take<float>(positions) : NULL;
    b->shared_gate = ctx->shared_gate ? c.take<float>(H) : NULL;
    b->offsets = c.take<int32_t>(E + 1);
    b->perm = c.take<int32_t>(positions);
    b->inv = c.take<int32_t>(positions);
    b->tiles = c.take<ExpertTile>(positions + E);
    b->num_tiles = c.take<int32_t>(1);
    b->totals = c.take<unsigned long long>(E);
    b->bad_id = c.take<int32_t>(1);
    b->ws_sched = c.take<unsigned>(4);
    b->ws_ready = c.take<unsigned>(positions + E);
    b->route_done = c.take<unsigned>(1);
    b->permute_hist = c.take<int32_t>(colibri_cuda_permute_chunks((int64_t)positions, (int32_t)E) * E);
    b->permute_counts = c.take<int32_t>(E);
    b->permute_done = c.take<unsigned>(1);
    b->xc = c.take<char>(tokens * H * wsize);
    b->inter = cfg->expert_kind == COLIBRI_EXPERT_SWIGLU ? c.take<char>(positions * F * wsize) : NULL;
    b->y = c.take<char>(positions * (size_t)ctx->out_features * wsize);
    /* fp8 weights: the activations the fp8 tensor cores read, fp8_groups scales per row */
    const bool f8 = cfg->weight_dtype == COLIBRI_DTYPE_F8E4M3, glu = cfg->expert_kind == COLIBRI_EXPERT_SWIGLU;
    b->xq = f8 ? c.take<uint8_t>(tokens * H) : NULL;
    b->xq_scales = f8 ? c.take<float>(tokens * (size_t)fp8_groups((int)H)) : NULL;
    b->inter_q = f8 && glu ? c.take<uint8_t>(positions * F) : NULL;
    b->inter_q_scales = f8 && glu ? c.take<float>(positions * (size_t)fp8_groups((int)F)) : NULL;
}

void free_backend(CudaBackend *b) {
    if (!b) return;
    cudaFree(b->d_weights);
    cudaFree(b->d_workspace);
    free(b);
}

colibri_status_t init_on_device(colibri_moe_context_t *ctx, CudaBackend *b, const void *expert_weights,
                                const uint64_t *expert_offsets) {
    const colibri_moe_config_t *cfg = &ctx->cfg;
    colibri_moe_context_t view = colibri_cuda_expert_view(ctx);
    const size_t E = (size_t)cfg->num_experts, wsize = colibri_dtype_size(cfg->weight_dtype);
    const size_t all = (size_t)view.cfg.num_experts, expert_bytes = ctx->expert_numel * wsize;
    b->expert_stride = (expert_bytes + 255) & ~(size_t)255;
    cudaError_t err = cudaMalloc(&b->d_weights, b->expert_stride * all);
    if (err == cudaErrorMemoryAllocation)
        return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cudaMalloc of %zu bytes for the expert weights failed",
                                 b->expert_stride * all);
    COLIBRI_CUDA_CHECK(err);
    for (size_t e = 0; e < all; e++) /* the shared expert's slices after the routed experts */
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->d_weights + e * b->expert_stride,
                                      e < E ? (const char *)expert_weights + expert_offsets[e] * wsize
                                            : (const char *)ctx->shared_packed + (e - E) * expert_bytes,
                                      expert_bytes, cudaMemcpyHostToDevice));

    const size_t tokens = cfg->workspace_tokens ? (size_t)cfg->workspace_tokens : DEFAULT_WORKSPACE_TOKENS;
    if (tokens * (size_t)view.cfg.top_k + all > INT_MAX)
        return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT,
                                 "workspace_tokens * top_k must stay below 2^31 on CUDA (got %zu * %d)", tokens,
                                 view.cfg.top_k);
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&b->sm_count, cudaDevAttrMultiProcessorCount, b->device));
    Carver measure = {NULL};
    carve_workspace(b, ctx, tokens, measure);
    err = cudaMalloc(&b->d_workspace, measure.used);
    if (err == cudaErrorMemoryAllocation)
        return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY,
                                 "cudaMalloc of %zu bytes of workspace for %zu tokens failed; a smaller "
                                 "workspace_tokens needs less", measure.used, tokens);
    COLIBRI_CUDA_CHECK(err);
    Carver place = {b->d_workspace};
    carve_workspace(b, ctx, tokens, place);
    if (b->router)
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->router, ctx->router_weight, E * cfg->hidden_size * sizeof(float),
                                      cudaMemcpyHostToDevice));
    if (b->router_bias)
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->router_bias, ctx->router_bias, E * sizeof(float), cudaMemcpyHostToDevice));
    if (b->router_logit_bias)
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->router_logit_bias, ctx->router_logit_bias, E * sizeof(float),
                                      cudaMemcpyHostToDevice));
    if (b->expert_bias)
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->expert_bias, ctx->expert_bias,
                                      (size_t)colibri_all_experts(ctx) * ctx->bias_numel * sizeof(float),
                                      cudaMemcpyHostToDevice));
    if (b->expert_scales)
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->expert_scales, ctx->expert_scales,
                                      (size_t)colibri_all_experts(ctx) * ctx->scales_numel * sizeof(float),
                                      cudaMemcpyHostToDevice));
    if (b->shared_gate)
        COLIBRI_CUDA_CHECK(cudaMemcpy(b->shared_gate, ctx->shared_gate, cfg->hidden_size * sizeof(float),
                                      cudaMemcpyHostToDevice));
    COLIBRI_CUDA_CHECK(cudaMemset(b->totals, 0, all * sizeof(unsigned long long)));
    COLIBRI_CUDA_CHECK(cudaMemset(b->bad_id, 0, sizeof(int32_t)));
    COLIBRI_CUDA_CHECK(cudaMemset(b->ws_sched, 0, 4 * sizeof(unsigned)));
    COLIBRI_CUDA_CHECK(cudaMemset(b->route_done, 0, sizeof(unsigned)));
    COLIBRI_CUDA_CHECK(cudaMemset(b->permute_counts, 0, all * sizeof(int32_t)));
    COLIBRI_CUDA_CHECK(cudaMemset(b->permute_done, 0, sizeof(unsigned)));
    colibri_status_t st = colibri_cuda_permute_setup(b, view.cfg.num_experts);
    if (st != COLIBRI_OK) return st;
    st = colibri_cuda_experts_setup(b);
    if (st != COLIBRI_OK) return st;
    view.backend = b; /* the tensor maps span every expert the pass reads */
    colibri_cuda_experts_fold_setup(&view, b);
    st = colibri_cuda_route_setup(ctx, b);
    if (st != COLIBRI_OK) return st;
    COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
    ctx->cfg.workspace_tokens = (int32_t)tokens;
    return COLIBRI_OK;
}

} // namespace

extern "C" {

colibri_status_t colibri_cuda_init(colibri_moe_context_t *ctx, const void *expert_weights,
                                   const uint64_t *expert_offsets) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)
        return colibri_set_error(COLIBRI_ERR_CUDA, "no CUDA device is usable (cudaGetDeviceCount: %s)",
                                 err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    if (ctx->cfg.device_id >= count)
        return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "config.device_id %d but only %d CUDA device(s)",
                                 ctx->cfg.device_id, count);
    DeviceGuard guard(ctx->cfg.device_id);
    COLIBRI_CUDA_CHECK(guard.err);
    CudaBackend *b = (CudaBackend *)calloc(1, sizeof *b);
    if (!b) return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate the CUDA backend state");
    b->device = ctx->cfg.device_id;
    colibri_status_t st = init_on_device(ctx, b, expert_weights, expert_offsets);
    if (st != COLIBRI_OK) {
        free_backend(b);
        return st;
    }
    ctx->backend = b;
    return COLIBRI_OK;
}

colibri_status_t colibri_cuda_forward(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                      const void *input, const int32_t *topk_ids, const float *topk_weights,
                                      void *output, void *stream) {
    CudaBackend *b = (CudaBackend *)ctx->backend;
    DeviceGuard guard(b->device);
    COLIBRI_CUDA_CHECK(guard.err);
    cudaStream_t s = (cudaStream_t)stream;
    colibri_status_t st;
    /* the routing runs on the layer's E and k; the expert pass on the view with the shared slices */
    const colibri_moe_context_t view_ = colibri_cuda_expert_view(ctx), *view = &view_;
    const bool shared = ctx->shared_experts > 0;
    const int32_t tile_m = colibri_cuda_experts_tile_m(view, num_tokens, act_dtype, input);
    const bool direct = colibri_cuda_experts_direct(view, num_tokens, tile_m);
    bool permuted = false;
    /* The L2 prefetch of the up projection's first wave runs beside the router's first
     * kernel (colibri_cuda_launch_route), or, where no router kernel runs, before the permutation. First
     * of all, before the router, it was slower: the router then waits for it. With a shared expert the
     * route kernel permutes nothing (its ids lack the shared slots) and prefetches nothing. */
    const bool prefetch_late = topk_ids || !b->router || shared;
    if (!topk_ids) {
        st = colibri_cuda_launch_route(ctx, num_tokens, act_dtype, input, b->ids, b->wts,
                                       direct || shared ? 0 : tile_m, &permuted, s);
        if (st != COLIBRI_OK) return st;
        topk_ids = b->ids;
        topk_weights = b->wts;
    }
    if (shared) {
        st = colibri_cuda_launch_slots(ctx, num_tokens, act_dtype, input, topk_ids, topk_weights, s);
        if (st != COLIBRI_OK) return st;
        topk_ids = b->slot_ids;
        topk_weights = b->slot_wts;
    }
    const int32_t *direct_ids = direct ? topk_ids : NULL;
    if (prefetch_late && (st = colibri_cuda_launch_prefetch(view, num_tokens, tile_m, s)) != COLIBRI_OK) return st;
    if (!direct && !permuted) {
        const bool pairs = colibri_cuda_experts_pairs(view, num_tokens, tile_m);
        const int absorb = colibri_cuda_experts_absorb(view, tile_m);
        if ((st = colibri_cuda_launch_permute(view, num_tokens, topk_ids, tile_m, pairs, absorb, s)) != COLIBRI_OK)
            return st;
    }
    bool combined = false;
    if ((st = colibri_cuda_launch_experts(view, num_tokens, act_dtype, input, tile_m, direct_ids, topk_weights, output,
                                          &combined, s)) != COLIBRI_OK)
        return st;
    if (combined) return COLIBRI_OK;
    return colibri_cuda_launch_combine(view, num_tokens, act_dtype, topk_ids, topk_weights, direct_ids, output, s);
}

colibri_status_t colibri_cuda_route(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                    const void *input, int32_t *topk_ids, float *topk_weights, void *stream) {
    CudaBackend *b = (CudaBackend *)ctx->backend;
    DeviceGuard guard(b->device);
    COLIBRI_CUDA_CHECK(guard.err);
    return colibri_cuda_launch_route(ctx, num_tokens, act_dtype, input, topk_ids, topk_weights, 0, NULL,
                                     (cudaStream_t)stream);
}

colibri_status_t colibri_cuda_expert_counts(colibri_moe_context_t *ctx, uint64_t *counts, int32_t reset) {
    CudaBackend *b = (CudaBackend *)ctx->backend;
    DeviceGuard guard(b->device);
    COLIBRI_CUDA_CHECK(guard.err);
    const size_t bytes = (size_t)ctx->cfg.num_experts * sizeof(unsigned long long);
    COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
    COLIBRI_CUDA_CHECK(cudaMemcpy(counts, b->totals, bytes, cudaMemcpyDeviceToHost));
    if (reset) COLIBRI_CUDA_CHECK(cudaMemset(b->totals, 0, bytes));
    COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
    return COLIBRI_OK;
}

colibri_status_t colibri_cuda_take_device_error(colibri_moe_context_t *ctx) {
    CudaBackend *b = (CudaBackend *)ctx->backend;
    DeviceGuard guard(b->device);
    COLIBRI_CUDA_CHECK(guard.err);
    int32_t bad = 0;
    COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
    COLIBRI_CUDA_CHECK(cudaMemcpy(&bad, b->bad_id, sizeof bad, cudaMemcpyDeviceToHost));
    if (!bad) return COLIBRI_OK;
    COLIBRI_CUDA_CHECK(cudaMemset(b->bad_id, 0, sizeof bad));
    COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
    return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT,
                             "a forward since the last check met an expert id outside [0, %d); those assignments "
                             "contributed nothing to the output", ctx->cfg.num_experts);
}

void colibri_cuda_destroy(colibri_moe_context_t *ctx) {
    CudaBackend *b = (CudaBackend *)ctx->backend;
    if (!b) return;
    DeviceGuard guard(b->device);
    free_backend(b);
    ctx->backend = NULL;
}

const colibri_backend_t colibri_cuda_backend = {
    "cuda", 0, colibri_cuda_supports, colibri_cuda_init, colibri_cuda_forward, colibri_cuda_route,
    colibri_cuda_expert_counts, colibri_cuda_take_device_error, colibri_cuda_destroy,
};

int32_t colibri_cuda_built_impl(void) { return 1; }

int32_t colibri_cuda_device_count_impl(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
    return count;
}

} /* extern "C" */
