/*
 * colibri.c — the front end of the library: validation of everything the caller hands in, and
 * dispatch to the context's backend (its colibri_backend_t). Forward is split here into chunks of at
 * most workspace_tokens tokens so backends never allocate per call.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int32_t colibri_cuda_built(void) { return colibri_cuda_built_impl(); }
int32_t colibri_cuda_device_count(void) { return colibri_cuda_device_count_impl(); }

static colibri_status_t validate_config(const colibri_moe_config_t *c) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (c->expert_kind != COLIBRI_EXPERT_SWIGLU && c->expert_kind != COLIBRI_EXPERT_LINEAR)
        return colibri_set_error(bad, "config.expert_kind %d is not a known expert kind", (int)c->expert_kind);
    if (colibri_dtype_size(c->weight_dtype) == 0)
        return colibri_set_error(bad, "config.weight_dtype %d is not a known dtype", (int)c->weight_dtype);
    if (c->num_experts < 1)
        return colibri_set_error(bad, "config.num_experts must be >= 1, got %d", c->num_experts);
    if (c->top_k < 1 || c->top_k > c->num_experts)
        return colibri_set_error(bad, "config.top_k must be in [1, num_experts=%d], got %d", c->num_experts, c->top_k);
    if (c->hidden_size < 1)
        return colibri_set_error(bad, "config.hidden_size must be >= 1, got %d", c->hidden_size);
    if (c->intermediate_size < 1)
        return colibri_set_error(bad, "config.intermediate_size must be >= 1, got %d", c->intermediate_size);
    if (c->routing != COLIBRI_ROUTING_SOFTMAX_TOPK && c->routing != COLIBRI_ROUTING_TOPK_SOFTMAX &&
        c->routing != COLIBRI_ROUTING_SIGMOID_BIAS)
        return colibri_set_error(bad, "config.routing %d is not a known routing", (int)c->routing);
    if (c->renormalize != 0 && c->renormalize != 1)
        return colibri_set_error(bad, "config.renormalize must be 0 or 1, got %d", c->renormalize);
    if (!(c->routed_scaling_factor > 0.0f) || !isfinite(c->routed_scaling_factor))
        return colibri_set_error(bad, "config.routed_scaling_factor must be finite and > 0, got %g",
                                 (double)c->routed_scaling_factor);
    if (c->workspace_tokens < 0)
        return colibri_set_error(bad, "config.workspace_tokens must be >= 0, got %d", c->workspace_tokens);
    if (c->device != COLIBRI_DEVICE_CPU && c->device != COLIBRI_DEVICE_CUDA)
        return colibri_set_error(bad, "config.device %d is not a known device", (int)c->device);
    if (c->device_id < 0)
        return colibri_set_error(bad, "config.device_id must be >= 0, got %d", c->device_id);
    if (c->num_threads < 0)
        return colibri_set_error(bad, "config.num_threads must be >= 0, got %d", c->num_threads);
    return COLIBRI_OK;
}

static float *copy_finite_floats(const float *src, size_t n, const char *name, colibri_status_t *st) {
    float *dst = (float *)malloc(n * sizeof(float));
    if (!dst) {
        *st = colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes for %s", n * sizeof(float), name);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(src[i])) {
            free(dst);
            *st = colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "%s[%zu] is not finite (%g)", name, i, (double)src[i]);
            return NULL;
        }
        dst[i] = src[i];
    }
    *st = COLIBRI_OK;
    return dst;
}

static void free_context(colibri_moe_context_t *ctx) {
    free(ctx->router_weight);
    free(ctx->router_bias);
    free(ctx);
}

colibri_status_t colibri_moe_context_init(colibri_moe_context_t **out_ctx, const colibri_moe_config_t *config,
                                          const void *expert_weights, const uint64_t *expert_offsets,
                                          uint64_t expert_weights_numel, const float *router_weight,
                                          const float *router_bias) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (!out_ctx) return colibri_set_error(bad, "out_ctx is NULL");
    *out_ctx = NULL;
    if (!config) return colibri_set_error(bad, "config is NULL");
    if (!expert_weights) return colibri_set_error(bad, "expert_weights is NULL");
    if (!expert_offsets) return colibri_set_error(bad, "expert_offsets is NULL");
    colibri_status_t st = validate_config(config);
    if (st != COLIBRI_OK) return st;
    if (config->routing == COLIBRI_ROUTING_SIGMOID_BIAS && router_weight && !router_bias && !config->routing_fn)
        return colibri_set_error(bad, "SIGMOID_BIAS routing needs router_bias");

    uint64_t numel = colibri_expert_numel(config->expert_kind, config->hidden_size, config->intermediate_size);
    for (int32_t e = 0; e < config->num_experts; e++) {
        if (expert_offsets[e] > expert_weights_numel || expert_weights_numel - expert_offsets[e] < numel)
            return colibri_set_error(bad,
                                     "expert %d at offset %llu with %llu elements does not fit in the packed "
                                     "buffer of %llu elements",
                                     e, (unsigned long long)expert_offsets[e], (unsigned long long)numel,
                                     (unsigned long long)expert_weights_numel);
    }

    colibri_moe_context_t *ctx = (colibri_moe_context_t *)calloc(1, sizeof *ctx);
    if (!ctx) return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate the context");
    ctx->cfg = *config;
    ctx->expert_numel = numel;
    ctx->out_features = config->expert_kind == COLIBRI_EXPERT_SWIGLU ? config->hidden_size : config->intermediate_size;
    if (router_weight) {
        ctx->router_weight = copy_finite_floats(router_weight, (size_t)config->num_experts * (size_t)config->hidden_size,
                                                "router_weight", &st);
        if (st != COLIBRI_OK) { free_context(ctx); return st; }
        if (router_bias) {
            ctx->router_bias = copy_finite_floats(router_bias, (size_t)config->num_experts, "router_bias", &st);
            if (st != COLIBRI_OK) { free_context(ctx); return st; }
        }
    }

    ctx->ops = config->device == COLIBRI_DEVICE_CPU ? &colibri_cpu_backend : &colibri_cuda_backend;
    st = ctx->ops->init(ctx, expert_weights, expert_offsets);
    if (st != COLIBRI_OK) { free_context(ctx); return st; }
    if (ctx->cfg.workspace_tokens < 1) {
        colibri_moe_context_destroy(ctx);
        return colibri_set_error(COLIBRI_ERR_INTERNAL, "backend left workspace_tokens unset");
    }
    *out_ctx = ctx;
    return COLIBRI_OK;
}

colibri_status_t colibri_moe_forward(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                     const void *input, const int32_t *topk_ids, const float *topk_weights,
                                     void *output, void *stream) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (!ctx) return colibri_set_error(bad, "ctx is NULL");
    if (num_tokens < 0) return colibri_set_error(bad, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    size_t act_size = colibri_dtype_size(act_dtype);
    if (act_size == 0) return colibri_set_error(bad, "act_dtype %d is not a known dtype", (int)act_dtype);
    if (num_tokens == 0) return COLIBRI_OK;
    if (!input) return colibri_set_error(bad, "input is NULL");
    if (!output) return colibri_set_error(bad, "output is NULL");
    if ((topk_ids == NULL) != (topk_weights == NULL))
        return colibri_set_error(bad, "topk_ids and topk_weights must be given together (got %s without %s)",
                                 topk_ids ? "topk_ids" : "topk_weights", topk_ids ? "topk_weights" : "topk_ids");
    if (!topk_ids && !ctx->router_weight && !ctx->cfg.routing_fn)
        return colibri_set_error(bad, "no routing: the context has no router weights and no routing_fn, so "
                                      "topk_ids and topk_weights must be given");
    if (ctx->ops->host_memory && topk_ids) {
        colibri_status_t st = colibri_check_routing(ctx, num_tokens, topk_ids, topk_weights, "input");
        if (st != COLIBRI_OK) return st;
    }

    const int64_t chunk = ctx->cfg.workspace_tokens, k = ctx->cfg.top_k;
    const size_t in_row = (size_t)ctx->cfg.hidden_size * act_size, out_row = (size_t)ctx->out_features * act_size;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += chunk) {
        const int64_t n = num_tokens - t0 < chunk ? num_tokens - t0 : chunk;
        const char *in = (const char *)input + (size_t)t0 * in_row;
        char *out = (char *)output + (size_t)t0 * out_row;
        const int32_t *ids = topk_ids ? topk_ids + t0 * k : NULL;
        const float *wts = topk_weights ? topk_weights + t0 * k : NULL;
        colibri_status_t st = ctx->ops->forward(ctx, n, act_dtype, in, ids, wts, out, stream);
        if (st != COLIBRI_OK) return st;
    }
    return COLIBRI_OK;
}

colibri_status_t colibri_moe_route(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                   const void *input, int32_t *topk_ids, float *topk_weights, void *stream) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (!ctx) return colibri_set_error(bad, "ctx is NULL");
    if (num_tokens < 0) return colibri_set_error(bad, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    size_t act_size = colibri_dtype_size(act_dtype);
    if (act_size == 0) return colibri_set_error(bad, "act_dtype %d is not a known dtype", (int)act_dtype);
    if (!ctx->router_weight && !ctx->cfg.routing_fn)
        return colibri_set_error(bad, "no routing: the context has no router weights and no routing_fn");
    if (num_tokens == 0) return COLIBRI_OK;
    if (!input || !topk_ids || !topk_weights)
        return colibri_set_error(bad, "%s is NULL", !input ? "input" : !topk_ids ? "topk_ids" : "topk_weights");
    const int64_t chunk = ctx->cfg.workspace_tokens, k = ctx->cfg.top_k;
    const size_t in_row = (size_t)ctx->cfg.hidden_size * act_size;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += chunk) {
        const int64_t n = num_tokens - t0 < chunk ? num_tokens - t0 : chunk;
        const char *in = (const char *)input + (size_t)t0 * in_row;
        colibri_status_t st = ctx->ops->route(ctx, n, act_dtype, in, topk_ids + t0 * k, topk_weights + t0 * k, stream);
        if (st != COLIBRI_OK) return st;
    }
    return COLIBRI_OK;
}

colibri_status_t colibri_moe_context_expert_counts(colibri_moe_context_t *ctx, uint64_t *counts, int32_t reset) {
    if (!ctx) return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "ctx is NULL");
    if (!counts) return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "counts is NULL");
    if (reset != 0 && reset != 1) return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "reset must be 0 or 1");
    return ctx->ops->expert_counts(ctx, counts, reset);
}

colibri_status_t colibri_moe_context_take_device_error(colibri_moe_context_t *ctx) {
    if (!ctx) return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "ctx is NULL");
    return ctx->ops->take_device_error(ctx);
}

void colibri_moe_context_destroy(colibri_moe_context_t *ctx) {
    if (!ctx) return;
    ctx->ops->destroy(ctx);
    free_context(ctx);
}
