/*
 * internal.h — what the front end (colibri.c) and the backends (cpu/, cuda/) share: the context
 * struct, the helpers of common.c and the backend interface. Not installed; not part of the API.
 *
 * The front end validates everything that can be checked on the host (config, pointers, sizes,
 * and on the CPU the routing ids and weights), copies the router to fp32, and splits a forward into
 * chunks of at most cfg.workspace_tokens tokens. A backend therefore sees only valid arguments and
 * 1 <= num_tokens <= cfg.workspace_tokens.
 */
#ifndef COLIBRI_INTERNAL_H
#define COLIBRI_INTERNAL_H

#include "colibri.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The shared expert runs as `shared_experts` extra experts E, E + 1, ... of width F that every token
 * takes after its k routed ones (slot weight 1, or the shared gate): a SwiGLU splits along its
 * intermediate dimension, so the backends' grouped expert path computes it with no second pass, and
 * zero rows pad its last slice (silu(0) * 0 = 0). Their weights are the front end's repacked copy. */
struct colibri_moe_context {
    colibri_moe_config_t cfg;      /* validated copy; workspace_tokens filled in by the backend's init */
    uint64_t expert_numel;         /* elements of one expert */
    int32_t out_features;          /* H for SWIGLU, F for LINEAR */
    int32_t bias_numel;            /* elements of one expert's bias row: 2F + H (SWIGLU) or F */
    int32_t shared_experts;        /* m = ceil(Fs / F) extra experts, 0 without a shared expert */
    void *shared_packed;           /* [m, expert_numel] weight_dtype host copy of the shared expert, or NULL */
    float *expert_bias;            /* [E + m, bias_numel] fp32 host copy (zero rows for the shared), or NULL */
    float *router_weight;          /* [E, H] fp32 host copy, or NULL */
    float *router_logit_bias;      /* [E] fp32 host copy, or NULL */
    float *router_bias;            /* [E] fp32 host copy (SIGMOID_BIAS only), or NULL */
    float *shared_gate;            /* [H] fp32 host copy, or NULL */
    uint64_t scales_numel;         /* fp8 weights: scales of one expert (colibri_scales_numel), else 0 */
    float *expert_scales;          /* fp8 weights: [E + m, scales_numel] fp32 host copy (the shared slices'
                                      grids after the routed experts'), else NULL */
    const struct colibri_backend *ops; /* the backend this context runs on */
    void *backend;                 /* backend-owned state */
};

/* Blocks of `block` (0: one block of all) along a dimension of n elements: a scale grid's extent. */
static inline int32_t colibri_scale_blocks(int32_t n, int32_t block) { return block > 0 ? (n + block - 1) / block : 1; }

/* Where the scale grid of an expert's matrix starts in its scales row: SWIGLU gate (0), up (1), down (2);
 * LINEAR w (0). Grids are [colibri_scale_blocks(N, bn), colibri_scale_blocks(K, bk)] row-major. */
static inline uint64_t colibri_scale_grid_offset(const colibri_moe_config_t *c, int matrix) {
    const uint64_t first = (uint64_t)colibri_scale_blocks(c->intermediate_size, c->scale_block_n) *
                           (uint64_t)colibri_scale_blocks(c->hidden_size, c->scale_block_k);
    return (uint64_t)matrix * first;
}

/* Experts the backends run: the routed ones and the shared expert's slices. */
static inline int32_t colibri_all_experts(const struct colibri_moe_context *ctx) {
    return ctx->cfg.num_experts + ctx->shared_experts;
}

/* Records a formatted message for colibri_last_error() on this thread and returns status. */
colibri_status_t colibri_set_error(colibri_status_t status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Checks that the caller's routing is usable: ids in [0, E), weights finite. Host pointers only. */
colibri_status_t colibri_check_routing(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                       const int32_t *topk_ids, const float *topk_weights,
                                       const char *who);

/* A backend: the operations the front end dispatches to, one table per backend (cpu/moe_cpu.c;
 * cuda/context.cu, or cuda_stub.c in a build without nvcc). init sets ctx->backend and, if it was 0,
 * ctx->cfg.workspace_tokens. */
typedef struct colibri_backend {
    const char *name;
    int host_memory;  /* 1: its pointers are host memory, so the front end checks given routing first */
    /* COLIBRI_OK where this backend computes the layer that config and weights describe (both validated
     * by the front end), else COLIBRI_ERR_UNSUPPORTED with the reason recorded. Asked before any copy. */
    colibri_status_t (*supports)(const colibri_moe_config_t *config, const colibri_moe_weights_t *weights);
    colibri_status_t (*init)(colibri_moe_context_t *ctx, const void *expert_weights, const uint64_t *expert_offsets);
    colibri_status_t (*forward)(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                const void *input, const int32_t *topk_ids, const float *topk_weights,
                                void *output, void *stream);
    colibri_status_t (*route)(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                              const void *input, int32_t *topk_ids, float *topk_weights, void *stream);
    colibri_status_t (*expert_counts)(colibri_moe_context_t *ctx, uint64_t *counts, int32_t reset);
    colibri_status_t (*take_device_error)(colibri_moe_context_t *ctx);
    void (*destroy)(colibri_moe_context_t *ctx);
} colibri_backend_t;

extern const colibri_backend_t colibri_cpu_backend;
extern const colibri_backend_t colibri_cuda_backend;

int32_t colibri_cuda_built_impl(void);
int32_t colibri_cuda_device_count_impl(void);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_INTERNAL_H */
