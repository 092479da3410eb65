/*
 * colibri.c — the front end of the library: validation of everything the caller hands in, and
 * dispatch to the context's backend (its colibri_backend_t). Forward is split here into chunks of at
 * most workspace_tokens tokens so backends never allocate per call.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "internal.h"
#include "routing.h"

int32_t colibri_cuda_built(void) { return colibri_cuda_built_impl(); }
int32_t colibri_cuda_device_count(void) { return colibri_cuda_device_count_impl(); }

static colibri_status_t validate_config(const colibri_moe_config_t *c) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (c->expert_kind != COLIBRI_EXPERT_SWIGLU && c->expert_kind != COLIBRI_EXPERT_LINEAR)
        return colibri_set_error(bad, "config.expert_kind %d is not a known expert kind", (int)c->expert_kind);
    if (colibri_dtype_size(c->weight_dtype) == 0)
        return colibri_set_error(bad, "config.weight_dtype %d is not a known dtype", (int)c->weight_dtype);
    if (c->num_experts < 1 || c->num_experts > COLIBRI_MAX_EXPERTS)
        return colibri_set_error(bad, "config.num_experts must be in [1, %d], got %d", COLIBRI_MAX_EXPERTS,
                                 c->num_experts);
    if (c->top_k < 1 || c->top_k > c->num_experts)
        return colibri_set_error(bad, "config.top_k must be in [1, num_experts=%d], got %d", c->num_experts, c->top_k);
    if (c->hidden_size < 1)
        return colibri_set_error(bad, "config.hidden_size must be >= 1, got %d", c->hidden_size);
    if (c->intermediate_size < 1)
        return colibri_set_error(bad, "config.intermediate_size must be >= 1, got %d", c->intermediate_size);
    if (!colibri_route_known(c->routing))
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
    if (c->n_group < 0)
        return colibri_set_error(bad, "config.n_group must be >= 0, got %d", c->n_group);
    if (c->n_group > 1) {
        const int32_t size = c->num_experts / c->n_group;
        if (c->num_experts % c->n_group)
            return colibri_set_error(bad, "config.n_group=%d does not divide num_experts=%d", c->n_group,
                                     c->num_experts);
        if (c->topk_group < 1 || c->topk_group > c->n_group)
            return colibri_set_error(bad, "config.topk_group must be in [1, n_group=%d], got %d", c->n_group,
                                     c->topk_group);
        if (c->top_k > c->topk_group * size)
            return colibri_set_error(bad, "config.top_k=%d exceeds the %d experts of topk_group=%d groups",
                                     c->top_k, c->topk_group * size, c->topk_group);
        if (c->group_score != COLIBRI_GROUP_SCORE_MAX && c->group_score != COLIBRI_GROUP_SCORE_TOP2_SUM)
            return colibri_set_error(bad, "config.group_score %d is not a known group score", (int)c->group_score);
        if (c->group_score == COLIBRI_GROUP_SCORE_TOP2_SUM && size < 2)
            return colibri_set_error(bad, "config.group_score TOP2_SUM needs groups of 2 or more experts, got %d",
                                     size);
    }
    if (c->activation != COLIBRI_ACTIVATION_SILU && c->activation != COLIBRI_ACTIVATION_SWIGLU_OAI)
        return colibri_set_error(bad, "config.activation %d is not a known activation", (int)c->activation);
    if (c->activation != COLIBRI_ACTIVATION_SILU && c->expert_kind != COLIBRI_EXPERT_SWIGLU)
        return colibri_set_error(bad, "config.activation applies to SWIGLU experts only");
    if (c->activation == COLIBRI_ACTIVATION_SWIGLU_OAI &&
        (!(c->activation_alpha > 0.0f) || !isfinite(c->activation_alpha) || !(c->activation_limit > 0.0f) ||
         !isfinite(c->activation_limit)))
        return colibri_set_error(bad, "config.activation_alpha and activation_limit must be finite and > 0, got %g, %g",
                                 (double)c->activation_alpha, (double)c->activation_limit);
    if (c->expert_bias != 0 && c->expert_bias != 1)
        return colibri_set_error(bad, "config.expert_bias must be 0 or 1, got %d", c->expert_bias);
    if (c->shared_intermediate_size < 0)
        return colibri_set_error(bad, "config.shared_intermediate_size must be >= 0, got %d",
                                 c->shared_intermediate_size);
    if (c->shared_intermediate_size > 0 && c->expert_kind != COLIBRI_EXPERT_SWIGLU)
        return colibri_set_error(bad, "a shared expert needs SWIGLU experts");
    if (c->shared_gate != 0 && c->shared_gate != 1)
        return colibri_set_error(bad, "config.shared_gate must be 0 or 1, got %d", c->shared_gate);
    if (c->shared_gate && c->shared_intermediate_size == 0)
        return colibri_set_error(bad, "config.shared_gate is 1 but there is no shared expert");
    if (colibri_dtype_scaled(c->weight_dtype)) {
        if (c->scale_block_n < 0 || c->scale_block_k < 0)
            return colibri_set_error(bad, "config.scale_block_n and scale_block_k must be >= 0, got %d, %d",
                                     c->scale_block_n, c->scale_block_k);
        /* the shared expert runs as slices of width F: each slice must start on a scale block */
        const int32_t F = c->intermediate_size, bn = c->scale_block_n, bk = c->scale_block_k;
        if (c->shared_intermediate_size > F && ((bn > 0 && F % bn) || (bk > 0 && F % bk)))
            return colibri_set_error(COLIBRI_ERR_UNSUPPORTED,
                                     "an fp8 shared expert wider than intermediate_size=%d needs it to be a multiple "
                                     "of the scale block (%d, %d)", F, bn, bk);
    } else if (c->scale_block_n != 0 || c->scale_block_k != 0) {
        return colibri_set_error(bad, "config.scale_block_n and scale_block_k apply to fp8 weights only (got %d, %d)",
                                 c->scale_block_n, c->scale_block_k);
    }
    return COLIBRI_OK;
}

colibri_status_t colibri_moe_config_check(const colibri_moe_config_t *config) {
    if (!config) return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "config is NULL");
    return validate_config(config);
}

/* The backend of each device; config.device is validated before it is looked up here. */
static const colibri_backend_t *const backends[] = {
    [COLIBRI_DEVICE_CPU] = &colibri_cpu_backend,
    [COLIBRI_DEVICE_CUDA] = &colibri_cuda_backend,
};

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
    free(ctx->expert_scales);
    free(ctx->router_weight);
    free(ctx->router_logit_bias);
    free(ctx->router_bias);
    free(ctx->shared_gate);
    free(ctx->expert_bias);
    free(ctx->shared_packed);
    free(ctx);
}

/* A weight is given exactly when the config asks for it, so nothing given is silently unused. */
static colibri_status_t check_given(const void *ptr, int wanted, const char *name, const char *why) {
    if (wanted && !ptr) return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "weights.%s is NULL but %s", name, why);
    if (!wanted && ptr)
        return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "weights.%s is given but the config does not use it "
                                 "(%s)", name, why);
    return COLIBRI_OK;
}

/* The first non-finite weight of an expert's buffer (kind, width F), named by matrix, row and column:
 * "expert 3's down [12, 40] is NaN". Returns OK when every weight is finite. */
static colibri_status_t check_expert_finite(colibri_dtype_t dtype, const void *weights, colibri_expert_kind_t kind,
                                            int32_t H, int32_t F, const char *what, int32_t index) {
    const uint64_t numel = colibri_expert_numel(kind, H, F), i = colibri_first_nonfinite(dtype, weights, numel);
    if (i == numel) return COLIBRI_OK;
    const uint64_t fh = (uint64_t)F * (uint64_t)H, m = kind == COLIBRI_EXPERT_SWIGLU ? i / fh : 0, at = i - m * fh;
    static const char *const swiglu_names[3] = {"gate", "up", "down"};
    const uint64_t cols = m == 2 ? (uint64_t)F : (uint64_t)H; /* down is [H, F], the others [F, H] */
    uint32_t bits = 0;
    memcpy(&bits, (const char *)weights + i * colibri_dtype_size(dtype), colibri_dtype_size(dtype));
    const int negative = dtype == COLIBRI_DTYPE_F32 ? bits >> 31 : dtype == COLIBRI_DTYPE_F8E4M3 ? 0 : bits >> 15 & 1;
    const int nan = dtype == COLIBRI_DTYPE_F32 ? (bits & 0x7fffffffu) > 0x7f800000u
                    : dtype == COLIBRI_DTYPE_F16 ? (bits & 0x7fff) > 0x7c00
                    : dtype == COLIBRI_DTYPE_BF16 ? (bits & 0x7fff) > 0x7f80 : 1;
    char value[48];
    if (dtype == COLIBRI_DTYPE_F8E4M3) snprintf(value, sizeof value, "the fp8 NaN code 0x%02x", (unsigned)bits);
    else snprintf(value, sizeof value, "%s", nan ? "NaN" : negative ? "-Inf" : "+Inf");
    char who[48];
    if (index >= 0) snprintf(who, sizeof who, "%s %d's", what, (int)index);
    else snprintf(who, sizeof who, "%s's", what);
    return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "%s %s [%llu, %llu] is %s: weights must be finite", who,
                             kind == COLIBRI_EXPERT_SWIGLU ? swiglu_names[m] : "w", (unsigned long long)(at / cols),
                             (unsigned long long)(at % cols), value);
}

/* The shared expert's m slices of width F as experts of the packed layout: gate and up rows
 * [i F, i F + F) and those columns of down, zero past Fs. */
static void *repack_shared(const colibri_moe_config_t *c, const void *shared, int32_t m, uint64_t numel) {
    const size_t es = colibri_dtype_size(c->weight_dtype);
    const int64_t H = c->hidden_size, F = c->intermediate_size, Fs = c->shared_intermediate_size;
    char *dst = (char *)calloc((size_t)m * numel, es);
    if (!dst) return NULL;
    const char *gate = (const char *)shared, *up = gate + (size_t)(Fs * H) * es, *down = up + (size_t)(Fs * H) * es;
    for (int32_t i = 0; i < m; i++) {
        char *e = dst + (size_t)i * numel * es;
        const int64_t f0 = (int64_t)i * F, rows = Fs - f0 < F ? Fs - f0 : F;
        memcpy(e, gate + (size_t)(f0 * H) * es, (size_t)(rows * H) * es);
        memcpy(e + (size_t)(F * H) * es, up + (size_t)(f0 * H) * es, (size_t)(rows * H) * es);
        for (int64_t h = 0; h < H; h++)
            memcpy(e + (size_t)(2 * F * H + h * F) * es, down + (size_t)(h * Fs + f0) * es, (size_t)rows * es);
    }
    return dst;
}

/* The shared expert's scale grids cut like its weights (repack_shared): slice i's row blocks of gate and
 * up, and column blocks of down, are the shared grids' blocks from i F on (validate_config checked that F
 * is a multiple of the blocks where that matters); blocks past the shared grid scale zero rows: 0. */
static void repack_shared_scales(const colibri_moe_config_t *c, const float *shared, int32_t m, uint64_t numel,
                                 float *dst) {
    const int32_t H = c->hidden_size, F = c->intermediate_size, Fs = c->shared_intermediate_size;
    const int32_t bn = c->scale_block_n, bk = c->scale_block_k;
    const int32_t sr = colibri_scale_blocks(Fs, bn), kc = colibri_scale_blocks(H, bk);      /* shared gate, up */
    const int32_t hr = colibri_scale_blocks(H, bn), sc = colibri_scale_blocks(Fs, bk);      /* shared down */
    const int32_t fr = colibri_scale_blocks(F, bn), fc = colibri_scale_blocks(F, bk);       /* a slice's */
    const float *gate = shared, *up = gate + (size_t)sr * kc, *down = up + (size_t)sr * kc;
    for (int32_t i = 0; i < m; i++) {
        float *g = dst + (size_t)i * numel, *u = g + (size_t)fr * kc, *d = u + (size_t)fr * kc;
        for (int32_t r = 0; r < fr; r++) {
            const int32_t from = bn > 0 ? (int32_t)((int64_t)i * F / bn) + r : 0;
            for (int32_t q = 0; q < kc; q++) {
                g[(size_t)r * kc + q] = from < sr ? gate[(size_t)from * kc + q] : 0.0f;
                u[(size_t)r * kc + q] = from < sr ? up[(size_t)from * kc + q] : 0.0f;
            }
        }
        for (int32_t r = 0; r < hr; r++)
            for (int32_t q = 0; q < fc; q++) {
                const int32_t from = bk > 0 ? (int32_t)((int64_t)i * F / bk) + q : 0;
                d[(size_t)r * fc + q] = from < sc ? down[(size_t)r * sc + from] : 0.0f;
            }
    }
}

colibri_status_t colibri_moe_context_create(colibri_moe_context_t **out_ctx, const colibri_moe_config_t *config,
                                            const colibri_moe_weights_t *w) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (!out_ctx) return colibri_set_error(bad, "out_ctx is NULL");
    *out_ctx = NULL;
    if (!config) return colibri_set_error(bad, "config is NULL");
    if (!w) return colibri_set_error(bad, "weights is NULL");
    if (!w->expert_weights) return colibri_set_error(bad, "weights.expert_weights is NULL");
    if (!w->expert_offsets) return colibri_set_error(bad, "weights.expert_offsets is NULL");
    colibri_status_t st = validate_config(config);
    if (st != COLIBRI_OK) return st;
    const colibri_moe_config_t *c = config;
    const int sigmoid = colibri_route_uses_bias(c->routing);
    if (sigmoid && w->router_weight && !w->router_bias && !c->routing_fn)
        return colibri_set_error(bad, "SIGMOID_BIAS routing needs router_bias");
    if (!sigmoid && (st = check_given(w->router_bias, 0, "router_bias", "only SIGMOID_BIAS routing uses it")))
        return st;
    if ((st = check_given(w->expert_bias, c->expert_bias, "expert_bias", "config.expert_bias is 1")) ||
        (st = check_given(w->shared_weights, c->shared_intermediate_size > 0, "shared_weights",
                          "config.shared_intermediate_size > 0")) ||
        (st = check_given(w->shared_gate_weight, c->shared_gate, "shared_gate_weight", "config.shared_gate is 1")))
        return st;
    const int fp8 = colibri_dtype_scaled(c->weight_dtype);
    if ((st = check_given(w->expert_scales, fp8, "expert_scales", "the weights are fp8")) ||
        (st = check_given(w->shared_scales, fp8 && c->shared_intermediate_size > 0, "shared_scales",
                          "the weights are fp8 and there is a shared expert")))
        return st;
    if (w->router_logit_bias && !w->router_weight)
        return colibri_set_error(bad, "weights.router_logit_bias is given without router_weight");
    if ((st = backends[c->device]->supports(c, w)) != COLIBRI_OK) return st;

    uint64_t numel = colibri_expert_numel(c->expert_kind, c->hidden_size, c->intermediate_size);
    for (int32_t e = 0; e < c->num_experts; e++) {
        if (w->expert_offsets[e] > w->expert_weights_numel || w->expert_weights_numel - w->expert_offsets[e] < numel)
            return colibri_set_error(bad,
                                     "expert %d at offset %llu with %llu elements does not fit in the packed "
                                     "buffer of %llu elements",
                                     e, (unsigned long long)w->expert_offsets[e], (unsigned long long)numel,
                                     (unsigned long long)w->expert_weights_numel);
    }
    /* before anything is allocated: a layer holding a NaN would compute NaN for every token routed to it */
    const size_t wsize = colibri_dtype_size(c->weight_dtype);
    for (int32_t e = 0; e < c->num_experts; e++)
        if ((st = check_expert_finite(c->weight_dtype, (const char *)w->expert_weights + w->expert_offsets[e] * wsize,
                                      c->expert_kind, c->hidden_size, c->intermediate_size, "expert", e)))
            return st;
    if (c->shared_intermediate_size > 0 &&
        (st = check_expert_finite(c->weight_dtype, w->shared_weights, COLIBRI_EXPERT_SWIGLU, c->hidden_size,
                                  c->shared_intermediate_size, "the shared expert", -1)))
        return st;

    colibri_moe_context_t *ctx = (colibri_moe_context_t *)calloc(1, sizeof *ctx);
    if (!ctx) return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate the context");
    ctx->cfg = *config;
    if (ctx->cfg.n_group < 1) ctx->cfg.n_group = 1;
    ctx->expert_numel = numel;
    ctx->out_features = c->expert_kind == COLIBRI_EXPERT_SWIGLU ? c->hidden_size : c->intermediate_size;
    ctx->bias_numel = c->expert_kind == COLIBRI_EXPERT_SWIGLU ? 2 * c->intermediate_size + c->hidden_size
                                                              : c->intermediate_size;
    const int64_t E = c->num_experts, H = c->hidden_size;
    if (c->shared_intermediate_size > 0) {
        ctx->shared_experts = (c->shared_intermediate_size + c->intermediate_size - 1) / c->intermediate_size;
        ctx->shared_packed = repack_shared(c, w->shared_weights, ctx->shared_experts, numel);
        if (!ctx->shared_packed) {
            free_context(ctx);
            return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate the shared expert's copy");
        }
    }
    if (fp8) {
        /* checked finite like the other fp32 weights; the shared slices' grids follow the routed experts' */
        const uint64_t n = colibri_scales_numel(c->expert_kind, c->hidden_size, c->intermediate_size,
                                                c->scale_block_n, c->scale_block_k);
        const size_t routed = (size_t)E * n, all = (size_t)colibri_all_experts(ctx) * n;
        ctx->scales_numel = n;
        ctx->expert_scales = copy_finite_floats(w->expert_scales, routed, "expert_scales", &st);
        float *grown = st == COLIBRI_OK ? (float *)realloc(ctx->expert_scales, all * sizeof(float)) : NULL;
        if (st == COLIBRI_OK && !grown) st = colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate expert_scales");
        if (st != COLIBRI_OK) { free_context(ctx); return st; }
        ctx->expert_scales = grown;
        if (ctx->shared_experts > 0) {
            const uint64_t sn = colibri_scales_numel(COLIBRI_EXPERT_SWIGLU, c->hidden_size,
                                                     c->shared_intermediate_size, c->scale_block_n, c->scale_block_k);
            float *shared = copy_finite_floats(w->shared_scales, (size_t)sn, "shared_scales", &st);
            if (st != COLIBRI_OK) { free_context(ctx); return st; }
            repack_shared_scales(c, shared, ctx->shared_experts, n, grown + routed);
            free(shared);
        }
    }
    if (c->expert_bias) {
        const size_t row = (size_t)ctx->bias_numel, all = (size_t)colibri_all_experts(ctx) * row;
        ctx->expert_bias = copy_finite_floats(w->expert_bias, (size_t)E * row, "expert_bias", &st);
        float *grown = st == COLIBRI_OK ? (float *)realloc(ctx->expert_bias, all * sizeof(float)) : NULL;
        if (st == COLIBRI_OK && !grown) st = colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate expert_bias");
        if (st != COLIBRI_OK) { free_context(ctx); return st; }
        ctx->expert_bias = grown;
        memset(grown + (size_t)E * row, 0, all * sizeof(float) - (size_t)E * row * sizeof(float));
    }
    struct { const float *src; size_t n; const char *name; float **dst; } copies[] = {
        {w->router_weight, (size_t)(E * H), "router_weight", &ctx->router_weight},
        {w->router_logit_bias, (size_t)E, "router_logit_bias", &ctx->router_logit_bias},
        {w->router_weight ? w->router_bias : NULL, (size_t)E, "router_bias", &ctx->router_bias},
        {w->shared_gate_weight, (size_t)H, "shared_gate_weight", &ctx->shared_gate},
    };
    for (size_t i = 0; i < sizeof copies / sizeof copies[0]; i++) {
        if (!copies[i].src) continue;
        *copies[i].dst = copy_finite_floats(copies[i].src, copies[i].n, copies[i].name, &st);
        if (st != COLIBRI_OK) { free_context(ctx); return st; }
    }

    ctx->ops = backends[c->device];
    st = ctx->ops->init(ctx, w->expert_weights, w->expert_offsets);
    if (st != COLIBRI_OK) { free_context(ctx); return st; }
    if (ctx->cfg.workspace_tokens < 1) {
        colibri_moe_context_destroy(ctx);
        return colibri_set_error(COLIBRI_ERR_INTERNAL, "backend left workspace_tokens unset");
    }
    *out_ctx = ctx;
    return COLIBRI_OK;
}

colibri_status_t colibri_moe_context_init(colibri_moe_context_t **out_ctx, const colibri_moe_config_t *config,
                                          const void *expert_weights, const uint64_t *expert_offsets,
                                          uint64_t expert_weights_numel, const float *router_weight,
                                          const float *router_bias) {
    colibri_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.expert_weights = expert_weights;
    w.expert_offsets = expert_offsets;
    w.expert_weights_numel = expert_weights_numel;
    w.router_weight = router_weight;
    /* this entry point has always ignored router_bias outside SIGMOID_BIAS routing, after checking that
     * it is finite like every weight it is given */
    const int sigmoid = config && colibri_route_uses_bias(config->routing);
    if (!sigmoid && router_weight && router_bias && config && config->num_experts > 0) {
        colibri_status_t st;
        free(copy_finite_floats(router_bias, (size_t)config->num_experts, "router_bias", &st));
        if (st != COLIBRI_OK) {
            if (out_ctx) *out_ctx = NULL;
            return st;
        }
    }
    w.router_bias = sigmoid ? router_bias : NULL;
    return colibri_moe_context_create(out_ctx, config, &w);
}

/* Bytes of an activation element, 0 for a dtype activations cannot have (fp8 is for weights only). */
static size_t activation_size(colibri_dtype_t dtype) {
    const colibri_dtype_info_t d = colibri_dtype_info(dtype);
    return d.activation ? d.size : 0;
}

colibri_status_t colibri_moe_forward(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                     const void *input, const int32_t *topk_ids, const float *topk_weights,
                                     void *output, void *stream) {
    const colibri_status_t bad = COLIBRI_ERR_INVALID_ARGUMENT;
    if (!ctx) return colibri_set_error(bad, "ctx is NULL");
    if (num_tokens < 0) return colibri_set_error(bad, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    const size_t act_size = activation_size(act_dtype);
    if (act_size == 0)
        return colibri_set_error(bad, "act_dtype %d is not an activation dtype (fp32, fp16 or bf16)", (int)act_dtype);
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
    const size_t act_size = activation_size(act_dtype);
    if (act_size == 0)
        return colibri_set_error(bad, "act_dtype %d is not an activation dtype (fp32, fp16 or bf16)", (int)act_dtype);
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
