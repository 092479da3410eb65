/*
 * colibri.h — the whole public surface of Colibri, a Mixture-of-Experts layer engine.
 *
 * One context holds one MoE layer: E routed experts whose weights live in one packed buffer (row e of
 * the checkpoint's `experts` tensor is expert e, addressed through expert_offsets[]), an optional
 * router [E, H], an optional shared expert, and workspace sized at init. colibri_moe_forward computes,
 * for each token t,
 *
 *     output[t] = sum_{j < k} topk_weights[t, j] * expert_{topk_ids[t, j]}(input[t])  [+ shared(input[t])]
 *
 * where the routing (topk_ids, topk_weights) is given by the caller or computed from the router
 * (colibri_routing_t). Expert kinds (weights row-major, as torch.nn.Linear.weight; b: the optional
 * fp32 expert biases, colibri_moe_weights_t.expert_bias):
 *     SWIGLU: gate [F, H], up [F, H], down [H, F] back to back;
 *             y = down(act(gate x + b_gate, up x + b_up)) + b_down, width H (colibri_activation_t)
 *     LINEAR: w [F, H];  y = w x + b, width F
 * The shared expert (config.shared_intermediate_size = Fs > 0) is a SWIGLU expert with SILU and no
 * biases, gate [Fs, H], up [Fs, H], down [H, Fs], applied to every token with weight 1, or with weight
 * sigmoid(shared_gate . x) when config.shared_gate is 1 (Qwen2-MoE); routed_scaling_factor does not
 * apply to it. Dot products accumulate in fp32 whatever the storage dtypes. With 16-bit weights a
 * backend may round the SWIGLU intermediate and each expert's output to the weight dtype between
 * steps, as PyTorch does in bf16 (the CPU does so for bf16 x bf16, CUDA for 16-bit weights); the
 * tests' error limits per dtype allow for it.
 *
 * fp8 weights (weight_dtype COLIBRI_DTYPE_F8E4M3): every matrix [N, K] of an expert (and of the shared
 * expert) comes with an fp32 scale grid [ceil(N / bn), ceil(K / bk)], row-major, bn = scale_block_n and
 * bk = scale_block_k (0: the whole dimension; (128, 128) is DeepSeek-V3's block layout, (1, 0) per
 * output channel, (0, 0) per tensor); the layer computes with w[n, k] = fp8(w)[n, k] * scale[n / bn, k / bk]
 * exactly (the CPU does, in fp32). A GPU may quantise activations to fp8 per token and 128 inputs for
 * the fp8 tensor cores (as DeepSeek's kernels do), and rounds intermediates to bf16; the tests' fp8
 * limits allow for it. An expert's grids lie back to back: gate, up, down (SWIGLU) or w (LINEAR).
 *
 * Errors travel as values: every call returns a colibri_status_t; colibri_status_string() names it
 * and colibri_last_error() gives the message of the last failure on the calling thread. The library
 * never exits and never prints. Enums are append-only.
 *
 * The block between COLIBRI_CDEF_BEGIN and COLIBRI_CDEF_END is read verbatim by the cffi builder
 * (backend_src/colibri/_ffi_build.py): keep it free of preprocessor lines.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#define COLIBRI_VERSION_STRING "0.1.0"

#ifdef __cplusplus
extern "C" {
#endif

/* COLIBRI_CDEF_BEGIN */

typedef enum {
    COLIBRI_OK = 0,
    COLIBRI_ERR_INVALID_ARGUMENT = 1, /* a NULL pointer, a bad size, an expert id out of range, ... */
    COLIBRI_ERR_OUT_OF_MEMORY = 2,
    COLIBRI_ERR_UNSUPPORTED = 3,      /* e.g. a CUDA context in a library built without CUDA */
    COLIBRI_ERR_CUDA = 4,             /* a CUDA runtime call failed; the message says which */
    COLIBRI_ERR_ROUTING = 5,          /* a custom routing function failed or returned bad routing */
    COLIBRI_ERR_INTERNAL = 6
} colibri_status_t;

typedef enum {
    COLIBRI_DTYPE_F32 = 0,
    COLIBRI_DTYPE_F16 = 1,
    COLIBRI_DTYPE_BF16 = 2,
    COLIBRI_DTYPE_F8E4M3 = 3   /* weights only: fp8 e4m3 as OCP's "e4m3fn" (no inf, 0x7f/0xff NaN, max 448),
                                  dequantised as value * scale (colibri_moe_config_t.scale_block_n) */
} colibri_dtype_t;

typedef enum {
    COLIBRI_EXPERT_SWIGLU = 0,
    COLIBRI_EXPERT_LINEAR = 1
} colibri_expert_kind_t;

/* act(g, u) of SWIGLU experts (g, u: the gate and up projections, biases added):
 *   SILU       : silu(g) * u = g * sigmoid(g) * u                                  (most models)
 *   SWIGLU_OAI : g' = min(g, limit); u' = clamp(u, -limit, limit);
 *                (u' + 1) * g' * sigmoid(alpha * g')                                (gpt-oss) */
typedef enum {
    COLIBRI_ACTIVATION_SILU = 0,
    COLIBRI_ACTIVATION_SWIGLU_OAI = 1
} colibri_activation_t;

/* Built-in routing. Router logits l = router_weight @ x + router_logit_bias (the bias only if given),
 * a score p_e per expert and a selection score s_e:
 *   SOFTMAX_TOPK : p = softmax(l), s = l                                  (Mixtral, Qwen, DeepSeek-V2)
 *   TOPK_SOFTMAX : p = l,          s = l                                  (gpt-oss)
 *   SIGMOID_BIAS : p = sigmoid(l), s = p + router_bias (a correction used
 *                  for selection only; required, and only used here)      (DeepSeek-V3, GLM-4.5)
 * Group limit (n_group > 1, DeepSeek): the E experts form n_group groups of E / n_group consecutive
 * ids; a group's score is the max of its s_e (GROUP_SCORE_MAX) or the sum of its two highest
 * (GROUP_SCORE_TOP2_SUM); only the experts of the topk_group best groups can be selected.
 * Selection: ids = the k highest s_e (among the allowed groups). Weights: w_j = p[ids_j], except
 * TOPK_SOFTMAX where w = softmax(l[ids]); renormalize (SOFTMAX_TOPK, SIGMOID_BIAS) -> w /= sum(w);
 * then w *= routed_scaling_factor. Ties (scores and group scores) go to the lower id; ids come out in
 * descending order of s. */
typedef enum {
    COLIBRI_ROUTING_SOFTMAX_TOPK = 0,
    COLIBRI_ROUTING_TOPK_SOFTMAX = 1,
    COLIBRI_ROUTING_SIGMOID_BIAS = 2
} colibri_routing_t;

typedef enum {
    COLIBRI_GROUP_SCORE_MAX = 0,
    COLIBRI_GROUP_SCORE_TOP2_SUM = 1
} colibri_group_score_t;

typedef enum {
    COLIBRI_DEVICE_CPU = 0,
    COLIBRI_DEVICE_CUDA = 1
} colibri_device_t;

typedef struct colibri_moe_context colibri_moe_context_t; /* opaque */

/* A custom router, called by colibri_moe_forward when the caller gives no topk_ids. Pointers are on
 * the context's device (device pointers for CUDA, with `stream` the caller's cudaStream_t; the function
 * must only enqueue work on it). router_logits is NULL when the context has no router weights.
 * The function writes topk_ids (each in [0, E)) and topk_weights and returns COLIBRI_OK, or any
 * other status to fail the forward with COLIBRI_ERR_ROUTING. */
typedef colibri_status_t (*colibri_routing_fn_t)(
    void *user_data,
    int64_t num_tokens,          /* T */
    int32_t num_experts,         /* E */
    int32_t top_k,               /* k */
    colibri_dtype_t act_dtype,
    const void *hidden_states,   /* [T, H], act_dtype */
    const float *router_logits,  /* [T, E] fp32, or NULL */
    int32_t *topk_ids,           /* [T, k] out */
    float *topk_weights,         /* [T, k] out */
    void *stream);

typedef struct {
    colibri_expert_kind_t expert_kind;
    colibri_dtype_t weight_dtype;     /* dtype of the packed expert weights */
    int32_t num_experts;              /* E >= 1 */
    int32_t top_k;                    /* 1 <= k <= E */
    int32_t hidden_size;              /* H >= 1 */
    int32_t intermediate_size;        /* F >= 1 (LINEAR: the output width) */
    colibri_routing_t routing;        /* built-in routing, used when routing_fn is NULL */
    int32_t renormalize;              /* 0 or 1, see colibri_routing_t */
    float routed_scaling_factor;      /* > 0, finite; 1.0 for most models */
    int32_t workspace_tokens;         /* forward works in chunks of at most this many tokens
                                         (workspace is sized for it at init); 0 = backend default */
    colibri_device_t device;
    int32_t device_id;                /* CUDA ordinal; ignored on the CPU */
    int32_t num_threads;              /* CPU threads; 0 = OpenMP's default */
    colibri_routing_fn_t routing_fn;  /* NULL = built-in routing */
    void *routing_user_data;
    /* Appended fields: zero gives the behaviour the layer had without them. */
    int32_t n_group;                  /* 0 or 1: no group limit; else E % n_group == 0 */
    int32_t topk_group;               /* groups kept, 1 <= topk_group <= n_group, k <= topk_group * E / n_group */
    colibri_group_score_t group_score;
    colibri_activation_t activation;  /* SWIGLU experts only */
    float activation_alpha;           /* SWIGLU_OAI: > 0, finite (gpt-oss 1.702) */
    float activation_limit;           /* SWIGLU_OAI: > 0, finite (gpt-oss 7.0) */
    int32_t expert_bias;              /* 1: colibri_moe_weights_t.expert_bias is given */
    int32_t shared_intermediate_size; /* Fs >= 0; 0 = no shared expert */
    int32_t shared_gate;              /* 1: the shared expert's output is scaled by sigmoid(shared_gate . x) */
    int32_t scale_block_n;            /* fp8 weights: rows of a matrix one scale covers, 0 = all; else 0 */
    int32_t scale_block_k;            /* fp8 weights: columns one scale covers, 0 = all; else 0 */
} colibri_moe_config_t;

/* Every weight of a layer, HOST pointers (see colibri_moe_context_create). */
typedef struct {
    const void *expert_weights;       /* packed buffer, weight_dtype, expert_weights_numel elements */
    const uint64_t *expert_offsets;   /* [E] element offset of expert e in expert_weights */
    uint64_t expert_weights_numel;    /* every expert must lie inside the buffer */
    const float *expert_bias;         /* config.expert_bias: [E, 2F + H] (SWIGLU: gate, up, down biases)
                                         or [E, F] (LINEAR), fp32; else NULL */
    const float *router_weight;       /* [E, H] fp32, or NULL */
    const float *router_logit_bias;   /* [E] fp32 added to the logits, or NULL */
    const float *router_bias;         /* [E] fp32, SIGMOID_BIAS's selection-only correction, else NULL */
    const void *shared_weights;       /* shared expert, weight_dtype: gate [Fs,H], up [Fs,H], down [H,Fs] */
    const float *shared_gate_weight;  /* [H] fp32 when config.shared_gate, else NULL */
    const float *expert_scales;       /* fp8 weights: [E, colibri_scales_numel(kind, H, F, bn, bk)] fp32, the
                                         scale grids of each expert (see the top of the file); else NULL */
    const float *shared_scales;       /* fp8 weights with a shared expert: its gate, up and down grids
                                         (colibri_scales_numel(SWIGLU, H, Fs, bn, bk) fp32); else NULL */
} colibri_moe_weights_t;

/* The most experts a layer may have: far above any model's (hundreds), so that a config read from a
 * file cannot make a loader allocate per-expert structures without bound. */
#define COLIBRI_MAX_EXPERTS 65536

/* Checks a config as colibri_moe_context_create does, without weights or a device: OK, or
 * INVALID_ARGUMENT (UNSUPPORTED for a layout no backend computes) with colibri_last_error() naming the
 * first bad field. The Python binding validates its LayerConfig with it. */
colibri_status_t colibri_moe_config_check(const colibri_moe_config_t *config);

/* Creates a context for one MoE layer. All pointers are HOST pointers.
 * On the CPU the routed experts' weights are used in place (borrowed: they must outlive the context,
 * e.g. a memory-mapped checkpoint); on CUDA they are copied to the device once. The shared expert's
 * weights are copied (cut into slices of width F), and the router, its biases, the expert biases and
 * the shared gate are copied (as fp32), in both cases. router_weight
 * may be NULL only if every forward passes topk_ids or the config has a routing_fn. A weight the
 * config asks for must be given, and one it does not ask for must be NULL (so nothing given is
 * silently unused). Every weight must be finite: a NaN or an infinity (fp8: a NaN code) anywhere in the
 * routed experts, the shared expert or the fp32 arrays is refused with INVALID_ARGUMENT naming the first
 * one (expert, matrix, row and column); the experts are read once for it, in parallel. */
colibri_status_t colibri_moe_context_create(
    colibri_moe_context_t **out_ctx,      /* receives the new context; set to NULL on failure */
    const colibri_moe_config_t *config,
    const colibri_moe_weights_t *weights);

/* colibri_moe_context_create for a layer of routed experts without biases or shared expert; router_bias
 * (selection only) is used by SIGMOID_BIAS routing and ignored by the others. */
colibri_status_t colibri_moe_context_init(
    colibri_moe_context_t **out_ctx,
    const colibri_moe_config_t *config,
    const void *expert_weights,           /* packed buffer, weight_dtype, expert_weights_numel elements */
    const uint64_t *expert_offsets,       /* [E] element offset of expert e in expert_weights */
    uint64_t expert_weights_numel,        /* every expert must lie inside the buffer */
    const float *router_weight,           /* [E, H] fp32, or NULL */
    const float *router_bias);            /* [E] fp32, or NULL */

/* Runs the layer on num_tokens tokens. Pointers are on the context's device. topk_ids and
 * topk_weights are given together or both NULL (then the router or routing_fn decides). Every element
 * of output is written. num_tokens == 0 is valid and does nothing. On the CPU, ids are checked
 * before any output is written; only a routing_fn failing on a later chunk (num_tokens above
 * workspace_tokens) leaves the earlier chunks' output written. On CUDA the call only enqueues work on `stream` (a cudaStream_t;
 * NULL = the legacy default stream), never synchronises and allocates nothing, so it can be captured
 * in a CUDA graph; there an id out of range contributes nothing and is recorded (see
 * colibri_moe_context_take_device_error). A context's device workspace serves one call at a time: the
 * forwards and routings of one context must run in order on the GPU (one stream, or streams ordered by
 * events); two that overlap race on it (wrong outputs, or a forward that never ends: its down projection
 * waits on per-tile counters the other one resets). Separate contexts may run at once. */
colibri_status_t colibri_moe_forward(
    colibri_moe_context_t *ctx,
    int64_t num_tokens,                   /* T >= 0 */
    colibri_dtype_t act_dtype,            /* dtype of input and output */
    const void *input,                    /* [T, H], act_dtype */
    const int32_t *topk_ids,              /* [T, k] in [0, E), or NULL */
    const float *topk_weights,            /* [T, k] fp32, or NULL */
    void *output,                         /* [T, H] (SWIGLU) or [T, F] (LINEAR), act_dtype */
    void *stream);

/* Computes only the routing of num_tokens tokens (as forward would without given ids) into topk_ids
 * and topk_weights, on the context's device (CUDA: enqueued on stream). Needs router weights or a
 * routing_fn. Lets callers and tests inspect routing; forward never needs it. */
colibri_status_t colibri_moe_route(
    colibri_moe_context_t *ctx,
    int64_t num_tokens,                   /* T >= 0 */
    colibri_dtype_t act_dtype,
    const void *input,                    /* [T, H], act_dtype */
    int32_t *topk_ids,                    /* [T, k] out */
    float *topk_weights,                  /* [T, k] out */
    void *stream);

/* Copies into counts the number of (token, expert) assignments each expert received over all forwards
 * since init or the last reset (ids out of range are not counted), then resets them if reset is 1.
 * CUDA: synchronises the context's device. */
colibri_status_t colibri_moe_context_expert_counts(
    colibri_moe_context_t *ctx,
    uint64_t *counts,                     /* [E] host, out */
    int32_t reset);

/* CUDA: synchronises the context's device and returns COLIBRI_ERR_INVALID_ARGUMENT (with a message)
 * if a forward since the last call met an expert id out of range, clearing the record. The CPU
 * reports such ids from forward itself, so there this returns COLIBRI_OK. */
colibri_status_t colibri_moe_context_take_device_error(colibri_moe_context_t *ctx);

void colibri_moe_context_destroy(colibri_moe_context_t *ctx); /* NULL is fine */

const char *colibri_status_string(colibri_status_t status);
const char *colibri_last_error(void);     /* message of the last failure on this thread, "" if none */
const char *colibri_version(void);
int32_t colibri_cuda_built(void);         /* 1 if this library was built with the CUDA backend */
int32_t colibri_cuda_device_count(void);  /* 0 without CUDA or without a device */
size_t colibri_dtype_size(colibri_dtype_t dtype);           /* 0 for an unknown dtype */
uint64_t colibri_expert_numel(colibri_expert_kind_t kind, int32_t hidden_size,
                              int32_t intermediate_size);   /* elements of one expert, 0 if invalid */
uint64_t colibri_scales_numel(colibri_expert_kind_t kind, int32_t hidden_size, int32_t intermediate_size,
                              int32_t scale_block_n, int32_t scale_block_k); /* fp8 scales of one expert, 0 if invalid */
/* The index of the first of n weights of dtype that is NaN or infinite (fp8 e4m3: a NaN code, 0x7f or
 * 0xff), or n when all are finite (and for an unknown dtype). colibri_moe_context_create refuses a
 * layer whose experts or shared expert hold one. */
uint64_t colibri_first_nonfinite(colibri_dtype_t dtype, const void *weights, uint64_t n);

/* COLIBRI_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_H */
