/*
 * fuzz_moe.c — libFuzzer target for the public C API (built and run by `make fuzz`, under ASan+UBSan).
 *
 * The fuzzer's bytes become one layer and a few calls on it: a config (every field, valid or not: kinds,
 * dtypes, E, k, H, F small, routing, scaling NaN/Inf, chunk sizes, CPU or CUDA), a packed buffer whose
 * size and offsets may not fit, raw weight and router bits (so NaN and Inf), NULL pointers, built by
 * colibri_moe_context_init (appended config fields zero) or by colibri_moe_context_create (group limit,
 * activation, expert biases, logit bias, shared expert and gate, fp8 scale grids, each weight given or
 * not), and then
 * forwards, routes and counter reads with random token counts, raw expert ids (out of range too) and
 * weights, optionally through a routing_fn that misbehaves on a chosen call. Every buffer is allocated to
 * its exact size, so ASan sees any read or write past it. The properties checked, besides "no crash":
 *   - every call returns a known status, with a message when it is not COLIBRI_OK;
 *   - a call succeeds exactly when its inputs are valid (an independent oracle of the header's rules);
 *   - a failed forward leaves its output untouched; a successful one writes every byte (two runs over
 *     outputs poisoned differently must agree: the library is deterministic);
 *   - routing that succeeds gives ids in [0, E).
 * A violated property aborts with a message, which libFuzzer reports as a crash with its input.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

#define REQUIRE(cond, ...)                                                                          \
    do {                                                                                            \
        if (!(cond)) {                                                                              \
            fprintf(stderr, "fuzz_moe: property failed: %s: ", #cond);                            \
            fprintf(stderr, __VA_ARGS__);                                                           \
            fprintf(stderr, " (last error: \"%s\")\n", colibri_last_error());                     \
            abort();                                                                                \
        }                                                                                           \
    } while (0)

/* ------------------------------------------------------------------------------------------------
 * the fuzzer's bytes, consumed front to back; zeros once they run out
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t n;
} bytes_t;

static uint8_t take_u8(bytes_t *b) {
    if (!b->n) return 0;
    b->n--;
    return *b->p++;
}

static void take_into(bytes_t *b, void *dst, size_t n) {
    const size_t have = n < b->n ? n : b->n;
    memcpy(dst, b->p, have);
    memset((char *)dst + have, 0, n - have);
    b->p += have;
    b->n -= have;
}

/* A value in [lo, lo + span). */
static int32_t take_range(bytes_t *b, int32_t lo, int32_t span) { return lo + (int32_t)(take_u8(b) % span); }

/* An exact-size heap copy of n bytes (1 byte when n is 0, so the pointer is never NULL by accident). */
static void *take_buffer(bytes_t *b, size_t n) {
    void *p = malloc(n ? n : 1);
    if (p) take_into(b, p, n);
    return p;
}

static const float SPECIAL_FLOATS[] = {1.0f, 0.5f, 2.5f, 0.0f, -1.0f, NAN, INFINITY, -INFINITY, 1e30f, 1e-30f};
enum { NUM_SPECIAL_FLOATS = sizeof SPECIAL_FLOATS / sizeof SPECIAL_FLOATS[0] };

static float take_special_float(bytes_t *b) { return SPECIAL_FLOATS[take_u8(b) % NUM_SPECIAL_FLOATS]; }

/* n floats: raw bits, or values from SPECIAL_FLOATS and small numbers (so that finite inputs are common). */
static float *take_floats(bytes_t *b, size_t n) {
    float *f = (float *)take_buffer(b, n * sizeof(float));
    if (f && take_u8(b) % 2)
        for (size_t i = 0; i < n; i++) {
            const uint8_t v = take_u8(b);
            f[i] = v < 16 ? take_special_float(b) : (float)(v - 136) / 64.0f;
        }
    return f;
}

static int all_finite(const float *f, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(f[i])) return 0;
    return 1;
}

/* Weight i of a buffer of dtype is finite: decoded as each format defines it (an unknown dtype's
 * buffer is never read, so any). */
static int weight_finite(colibri_dtype_t dtype, const void *p, size_t i) {
    const unsigned char *bytes = (const unsigned char *)p;
    switch (dtype) {
    case COLIBRI_DTYPE_F32: { float v; memcpy(&v, bytes + 4 * i, 4); return isfinite(v); }
    case COLIBRI_DTYPE_BF16: {
        uint16_t h; memcpy(&h, bytes + 2 * i, 2);
        const uint32_t bits = (uint32_t)h << 16;
        float v; memcpy(&v, &bits, 4);
        return isfinite(v);
    }
    case COLIBRI_DTYPE_F16: { uint16_t h; memcpy(&h, bytes + 2 * i, 2); return (h >> 10 & 0x1f) != 0x1f; }
    case COLIBRI_DTYPE_F8E4M3: return (bytes[i] & 0x7f) != 0x7f; /* e4m3fn: S.1111.111 is NaN, no inf */
    }
    return 1;
}

static int weights_finite(colibri_dtype_t dtype, const void *p, size_t first, size_t n) {
    for (size_t i = first; i < first + n; i++)
        if (!weight_finite(dtype, p, i)) return 0;
    return 1;
}

/* Mostly finite weights, so that most layers get past the finiteness check: a non-finite weight's top
 * exponent bit is cleared unless the input keeps it. */
static void mostly_finite(bytes_t *b, colibri_dtype_t dtype, void *p, size_t n) {
    const size_t size = colibri_dtype_size(dtype);
    if (!p || !size || take_u8(b) % 4 == 0) return;
    unsigned char *bytes = (unsigned char *)p;
    for (size_t i = 0; i < n; i++)
        if (!weight_finite(dtype, p, i)) bytes[i * size + size - 1] &= 0xbf; /* the top exponent bit in every format */
}

/* ------------------------------------------------------------------------------------------------
 * a routing_fn that is good until the call numbered fail_at, where it does `misbehave`
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    int32_t E, k;
    int calls, fail_at;
    int misbehave; /* 0: never, 1: an id out of range, 2: a NaN weight, 3: an error status */
} router_t;

static colibri_status_t fuzz_route(void *user, int64_t T, int32_t E, int32_t k, colibri_dtype_t act, const void *hidden,
                                   const float *logits, int32_t *ids, float *w, void *stream) {
    router_t *r = (router_t *)user;
    (void)logits;
    REQUIRE(T >= 1 && E == r->E && k == r->k && colibri_dtype_size(act) && hidden && ids && w && !stream,
            "routing_fn called with T=%lld E=%d k=%d", (long long)T, E, k);
    const int call = r->calls++;
    if (r->misbehave == 3 && call == r->fail_at) return COLIBRI_ERR_INTERNAL;
    for (int64_t i = 0; i < T * k; i++) {
        ids[i] = (int32_t)((i * 7 + call) % E);
        w[i] = 1.0f / (float)(1 + i % 3);
    }
    if (call == r->fail_at && r->misbehave == 1) ids[(T - 1) * k] = E;
    if (call == r->fail_at && r->misbehave == 2) w[T * k - 1] = NAN;
    return COLIBRI_OK;
}

/* ------------------------------------------------------------------------------------------------
 * one layer
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    int create; /* built by colibri_moe_context_create, else by colibri_moe_context_init */
    colibri_moe_config_t cfg;
    void *weights;
    uint64_t *offsets;
    uint64_t numel;
    float *router, *bias;
    /* create only: colibri_moe_weights_t's other pointers, and that struct itself NULL */
    float *expert_bias, *logit_bias, *gate;
    void *shared;
    float *scales, *shared_scales; /* fp8 scale grids */
    int null_out_ctx, null_config, null_weights, null_offsets, null_weight_struct;
    router_t router_fn;
} layer_t;

static int known_kind(colibri_expert_kind_t k) { return k == COLIBRI_EXPERT_SWIGLU || k == COLIBRI_EXPERT_LINEAR; }

static size_t nonneg(int32_t v) { return v > 0 ? (size_t)v : 0; }

/* fp8 scale grids, from colibri.h's definition (written here, not taken from the library) */
static size_t blocks_of(size_t n, int32_t b) { return b > 0 ? (n + (size_t)b - 1) / (size_t)b : 1; }
static size_t grid_numel(const colibri_moe_config_t *c, size_t F) {
    const size_t H = nonneg(c->hidden_size), first = blocks_of(F, c->scale_block_n) * blocks_of(H, c->scale_block_k);
    return c->expert_kind == COLIBRI_EXPERT_LINEAR ? first
                                                   : 2 * first + blocks_of(H, c->scale_block_n) * blocks_of(F, c->scale_block_k);
}

/* The appended config fields, valid or not, and the weights they ask for: each given exactly when asked,
 * or (half the time) some flipped; a buffer given where none is asked has the size it would have. */
static void layer_take_appended(bytes_t *b, layer_t *L) {
    colibri_moe_config_t *c = &L->cfg;
    if (take_u8(b) % 4) {
        /* mostly plausible values, so that layers with several features at once get created and run */
        const int32_t E = c->num_experts > 0 ? c->num_experts : 1;
        int32_t divisors[16], n = 0;
        for (int32_t d = 1; d <= E && n < 16; d++)
            if (E % d == 0) divisors[n++] = d;
        c->n_group = take_u8(b) % 4 ? divisors[take_u8(b) % n] : 0;
        /* enough groups for k experts, most of the time */
        const int32_t size = E / (c->n_group > 1 ? c->n_group : 1), need = (c->top_k + size - 1) / size;
        c->topk_group = take_range(b, 1, c->n_group > 1 ? c->n_group : 1);
        if (take_u8(b) % 4 && c->topk_group < need && need <= c->n_group) c->topk_group = need;
        c->group_score = (colibri_group_score_t)take_range(b, 0, 2);
        c->activation = c->expert_kind == COLIBRI_EXPERT_SWIGLU ? (colibri_activation_t)take_range(b, 0, 2)
                                                                : COLIBRI_ACTIVATION_SILU;
        c->activation_alpha = (float)take_range(b, 1, 8) / 2.0f;
        c->activation_limit = (float)take_range(b, 1, 16) / 2.0f;
        c->expert_bias = take_range(b, 0, 2);
        c->shared_intermediate_size = c->expert_kind == COLIBRI_EXPERT_SWIGLU ? take_range(b, 0, 13) : 0;
        c->shared_gate = c->shared_intermediate_size ? take_range(b, 0, 2) : 0;
    } else {
        c->n_group = take_range(b, -1, 11);
        c->topk_group = take_range(b, -1, (int32_t)nonneg(c->n_group) + 3);
        c->group_score = (colibri_group_score_t)take_range(b, 0, 3);
        c->activation = (colibri_activation_t)take_range(b, 0, 3);
        c->activation_alpha = take_special_float(b);
        c->activation_limit = take_special_float(b);
        c->expert_bias = take_range(b, 0, 3);
        c->shared_intermediate_size = take_range(b, -1, 13);
        c->shared_gate = take_range(b, 0, 3);
    }

    const uint8_t flips = take_u8(b), flip = flips & 0x80 ? flips : 0;
    const size_t E = nonneg(c->num_experts), H = nonneg(c->hidden_size), F = nonneg(c->intermediate_size);
    const size_t Fs = nonneg(c->shared_intermediate_size);
    const size_t bias_row = c->expert_kind == COLIBRI_EXPERT_LINEAR ? F : 2 * F + H;
    if ((c->expert_bias == 1) ^ (flip & 1)) L->expert_bias = take_floats(b, E * bias_row);
    if ((c->shared_intermediate_size > 0) ^ (flip >> 1 & 1)) {
        /* fp32 through take_floats so that finite weights are common; 16-bit dtypes as raw bits */
        if (c->weight_dtype == COLIBRI_DTYPE_F32 || !colibri_dtype_size(c->weight_dtype))
            L->shared = take_floats(b, 3 * Fs * H);
        else
            L->shared = take_buffer(b, 3 * Fs * H * colibri_dtype_size(c->weight_dtype));
        mostly_finite(b, c->weight_dtype, L->shared, 3 * Fs * H);
    }
    if ((c->shared_gate == 1) ^ (flip >> 2 & 1)) L->gate = take_floats(b, H);
    if (flips & 0x40) L->logit_bias = take_floats(b, E); /* with or without a router */

    /* fp8 scale blocks: mostly whole, per channel or small blocks; sometimes any value (other dtypes too) */
    const uint8_t blocks = take_u8(b);
    if (c->weight_dtype == COLIBRI_DTYPE_F8E4M3 || blocks < 16) {
        c->scale_block_n = blocks % 2 ? 0 : take_range(b, blocks < 16 ? -1 : 0, 6);
        c->scale_block_k = blocks % 4 > 1 ? 0 : take_range(b, blocks < 16 ? -1 : 0, 6);
    }
    const int fp8 = c->weight_dtype == COLIBRI_DTYPE_F8E4M3;
    const uint8_t given = take_u8(b), flip8 = given & 0x80 ? given : 0;
    if (c->scale_block_n >= 0 && c->scale_block_k >= 0) {
        if (fp8 ^ (flip8 & 1)) L->scales = take_floats(b, E * grid_numel(c, F));
        if ((fp8 && Fs > 0) ^ (flip8 >> 1 & 1)) {
            colibri_moe_config_t shared = *c;
            shared.expert_kind = COLIBRI_EXPERT_SWIGLU;
            L->shared_scales = take_floats(b, grid_numel(&shared, Fs));
        }
    }
}

static void layer_take(bytes_t *b, layer_t *L) {
    memset(L, 0, sizeof *L);
    L->create = take_u8(b) % 2;
    colibri_moe_config_t *c = &L->cfg;
    c->expert_kind = (colibri_expert_kind_t)take_range(b, 0, 3);
    c->weight_dtype = (colibri_dtype_t)take_range(b, 0, 5); /* 4: unknown */
    c->num_experts = take_range(b, -1, 11);
    c->top_k = take_range(b, -1, (c->num_experts > 0 ? c->num_experts : 0) + 3);
    c->hidden_size = take_range(b, -1, 19);
    c->intermediate_size = take_range(b, -1, 19);
    c->routing = (colibri_routing_t)take_range(b, 0, 4);
    c->renormalize = take_range(b, 0, 3);
    c->routed_scaling_factor = take_special_float(b);
    c->workspace_tokens = take_range(b, -1, 7);
    const uint8_t device = take_u8(b);
    c->device = device < 16 ? COLIBRI_DEVICE_CUDA : device < 20 ? (colibri_device_t)7 : COLIBRI_DEVICE_CPU;
    c->device_id = take_u8(b) < 8 ? -1 : 0;
    c->num_threads = take_range(b, -1, 4);
    if (take_u8(b) % 3 == 0) {
        L->router_fn = (router_t){c->num_experts, c->top_k, 0, take_range(b, 0, 4), take_range(b, 0, 4)};
        c->routing_fn = fuzz_route;
        c->routing_user_data = &L->router_fn;
    }

    const uint8_t nulls = take_u8(b);
    L->null_out_ctx = nulls == 1, L->null_config = nulls == 2, L->null_weights = nulls == 3, L->null_offsets = nulls == 4;
    L->null_weight_struct = L->create && nulls == 5;

    /* the buffer: E experts back to back (in order, reversed or at raw offsets), maybe too short */
    const int E = c->num_experts > 0 ? c->num_experts : 0;
    const uint64_t per_expert = colibri_expert_numel(c->expert_kind, c->hidden_size, c->intermediate_size);
    const uint64_t gap = take_u8(b) % 4, shortfall = take_u8(b) % 8 == 0;
    const uint64_t packed = (uint64_t)E * (per_expert + gap);
    L->numel = packed > shortfall ? packed - shortfall : 0;
    const size_t wsize = colibri_dtype_size(c->weight_dtype) ? colibri_dtype_size(c->weight_dtype) : 4;
    L->weights = take_buffer(b, (size_t)L->numel * wsize);
    mostly_finite(b, c->weight_dtype, L->weights, (size_t)L->numel);
    L->offsets = (uint64_t *)malloc((size_t)(E ? E : 1) * sizeof *L->offsets);
    const uint8_t layout = take_u8(b) % 4;
    for (int e = 0; e < E; e++) {
        const int slot = layout == 1 ? E - 1 - e : e;
        L->offsets[e] = (uint64_t)slot * (per_expert + gap) + gap;
        if (layout == 3) take_into(b, &L->offsets[e], sizeof L->offsets[e]); /* raw: almost never fits */
        if (layout == 2) L->offsets[e] = take_u8(b) % (L->numel + 2);
    }
    const uint8_t router = take_u8(b);
    if (router % 4 != 0 && c->hidden_size > 0) L->router = take_floats(b, (size_t)E * (size_t)c->hidden_size);
    if (router / 4 % 2) L->bias = take_floats(b, (size_t)E);
    if (L->create) layer_take_appended(b, L);
}

static void layer_free(layer_t *L) {
    free(L->weights);
    free(L->offsets);
    free(L->router);
    free(L->bias);
    free(L->expert_bias);
    free(L->logit_bias);
    free(L->gate);
    free(L->shared);
    free(L->scales);
    free(L->shared_scales);
}

/* The header's rules for the config fields that predate the appended ones, written independently of
 * colibri.c; the same for init and create. */
static int base_config_ok(const colibri_moe_config_t *c) {
    if (!known_kind(c->expert_kind) || !colibri_dtype_size(c->weight_dtype)) return 0;
    if (c->num_experts < 1 || c->num_experts > COLIBRI_MAX_EXPERTS || c->top_k < 1 || c->top_k > c->num_experts) return 0;
    if (c->hidden_size < 1 || c->intermediate_size < 1) return 0;
    if ((unsigned)c->routing > COLIBRI_ROUTING_SIGMOID_BIAS || (unsigned)c->renormalize > 1) return 0;
    if (!(c->routed_scaling_factor > 0.0f) || !isfinite(c->routed_scaling_factor)) return 0;
    if (c->workspace_tokens < 0 || c->num_threads < 0 || c->device_id < 0) return 0;
    if (c->device != COLIBRI_DEVICE_CPU) return 0; /* this build has no CUDA backend */
    return 1;
}

static int experts_fit(const layer_t *L) {
    const colibri_moe_config_t *c = &L->cfg;
    const uint64_t n = colibri_expert_numel(c->expert_kind, c->hidden_size, c->intermediate_size);
    for (int e = 0; e < c->num_experts; e++)
        if (L->offsets[e] > L->numel || L->numel - L->offsets[e] < n) return 0;
    return 1;
}

/* "Every weight must be finite": each expert's elements (not the gaps between them) */
static int experts_finite(const layer_t *L) {
    const colibri_moe_config_t *c = &L->cfg;
    const uint64_t n = colibri_expert_numel(c->expert_kind, c->hidden_size, c->intermediate_size);
    for (int e = 0; e < c->num_experts; e++)
        if (!weights_finite(c->weight_dtype, L->weights, (size_t)L->offsets[e], (size_t)n)) return 0;
    return 1;
}

/* The header's rules for init, written independently of colibri.c. */
static int init_should_succeed(const layer_t *L) {
    const colibri_moe_config_t *c = &L->cfg;
    if (L->null_out_ctx || L->null_config || L->null_weights || L->null_offsets) return 0;
    if (!base_config_ok(c) || !experts_fit(L) || !experts_finite(L)) return 0;
    if (c->weight_dtype == COLIBRI_DTYPE_F8E4M3) return 0; /* fp8 needs scale grids, which init cannot take */
    if (L->router) {
        if (!all_finite(L->router, (size_t)c->num_experts * (size_t)c->hidden_size)) return 0;
        if (L->bias && !all_finite(L->bias, (size_t)c->num_experts)) return 0;
        if (c->routing == COLIBRI_ROUTING_SIGMOID_BIAS && !L->bias && !c->routing_fn) return 0;
    }
    return 1;
}

/* The header's rules for create, written independently of colibri.c: the appended fields' comments,
 * colibri_routing_t's group limit, and "a weight the config asks for must be given, and one it does
 * not ask for must be NULL". The fp32 arrays it copies must be finite, as the router always was. */
static int create_should_succeed(const layer_t *L) {
    const colibri_moe_config_t *c = &L->cfg;
    if (L->null_out_ctx || L->null_config || L->null_weight_struct || L->null_weights || L->null_offsets) return 0;
    if (!base_config_ok(c) || !experts_fit(L) || !experts_finite(L)) return 0;
    const size_t E = (size_t)c->num_experts, H = (size_t)c->hidden_size, F = (size_t)c->intermediate_size;

    /* "0 or 1: no group limit; else E % n_group == 0", with the topk_group and group_score it uses */
    if (c->n_group != 0 && c->n_group != 1) {
        if (c->num_experts % c->n_group) return 0;
        if (c->topk_group < 1 || c->topk_group > c->n_group) return 0;
        const int32_t size = c->num_experts / c->n_group;
        if (c->top_k > c->topk_group * size) return 0;
        if (c->group_score != COLIBRI_GROUP_SCORE_MAX && c->group_score != COLIBRI_GROUP_SCORE_TOP2_SUM) return 0;
        if (c->group_score == COLIBRI_GROUP_SCORE_TOP2_SUM && size < 2) return 0; /* no two highest */
    }
    if (c->activation != COLIBRI_ACTIVATION_SILU && c->activation != COLIBRI_ACTIVATION_SWIGLU_OAI) return 0;
    if (c->activation != COLIBRI_ACTIVATION_SILU && c->expert_kind != COLIBRI_EXPERT_SWIGLU) return 0;
    if (c->activation == COLIBRI_ACTIVATION_SWIGLU_OAI &&
        !(c->activation_alpha > 0.0f && isfinite(c->activation_alpha) && c->activation_limit > 0.0f &&
          isfinite(c->activation_limit)))
        return 0;
    if ((unsigned)c->expert_bias > 1 || (unsigned)c->shared_gate > 1) return 0;
    /* the shared expert is a SWIGLU expert of output width H, added to routed outputs of width H */
    if (c->shared_intermediate_size < 0) return 0;
    if (c->shared_intermediate_size > 0 && c->expert_kind != COLIBRI_EXPERT_SWIGLU) return 0;
    if (c->shared_gate && c->shared_intermediate_size == 0) return 0; /* a gate on no expert */
    /* fp8: blocks >= 0 (0 = whole dimension), and a shared expert cut into slices of width F must cut
     * between blocks; other dtypes: blocks 0 */
    const int fp8 = c->weight_dtype == COLIBRI_DTYPE_F8E4M3;
    const int32_t bn = c->scale_block_n, bk = c->scale_block_k;
    if (!fp8 && (bn || bk)) return 0;
    if (fp8 && (bn < 0 || bk < 0)) return 0;
    if (fp8 && c->shared_intermediate_size > c->intermediate_size &&
        ((bn > 0 && c->intermediate_size % bn) || (bk > 0 && c->intermediate_size % bk)))
        return 0;

    /* given exactly when asked */
    if ((L->scales != NULL) != fp8) return 0;
    if ((L->shared_scales != NULL) != (fp8 && c->shared_intermediate_size > 0)) return 0;
    if (L->scales && !all_finite(L->scales, E * grid_numel(c, F))) return 0;
    if (L->shared_scales) {
        colibri_moe_config_t shared = *c;
        shared.expert_kind = COLIBRI_EXPERT_SWIGLU;
        if (!all_finite(L->shared_scales, grid_numel(&shared, (size_t)c->shared_intermediate_size))) return 0;
    }
    if ((L->expert_bias != NULL) != (c->expert_bias == 1)) return 0;
    if ((L->shared != NULL) != (c->shared_intermediate_size > 0)) return 0;
    if (L->shared && !weights_finite(c->weight_dtype, L->shared, 0, 3 * (size_t)c->shared_intermediate_size * H))
        return 0;
    if ((L->gate != NULL) != (c->shared_gate == 1)) return 0;
    if (L->bias && c->routing != COLIBRI_ROUTING_SIGMOID_BIAS) return 0;
    if (L->logit_bias && !L->router) return 0; /* added to logits there are none of */
    const size_t bias_row = c->expert_kind == COLIBRI_EXPERT_LINEAR ? F : 2 * F + H;
    if (L->expert_bias && !all_finite(L->expert_bias, E * bias_row)) return 0;
    if (L->gate && !all_finite(L->gate, H)) return 0;
    if (L->router) { /* as for init */
        if (!all_finite(L->router, E * H)) return 0;
        if (L->logit_bias && !all_finite(L->logit_bias, E)) return 0;
        if (L->bias && !all_finite(L->bias, E)) return 0;
        if (c->routing == COLIBRI_ROUTING_SIGMOID_BIAS && !L->bias && !c->routing_fn) return 0;
    }
    return 1;
}

static void require_status(colibri_status_t st, int should_succeed, const char *call) {
    REQUIRE(st >= COLIBRI_OK && st <= COLIBRI_ERR_INTERNAL, "%s returned unknown status %d", call, (int)st);
    REQUIRE(st != COLIBRI_OK || should_succeed, "%s accepted invalid input", call);
    REQUIRE(st == COLIBRI_OK || !should_succeed || st == COLIBRI_ERR_OUT_OF_MEMORY, "%s refused valid input: %s", call,
            colibri_status_string(st));
    REQUIRE(st == COLIBRI_OK || colibri_last_error()[0] != '\0', "%s failed without a message", call);
}

/* ------------------------------------------------------------------------------------------------
 * calls on a context
 * ---------------------------------------------------------------------------------------------- */

static int64_t chunk_tokens(const layer_t *L) {
    return L->cfg.workspace_tokens ? L->cfg.workspace_tokens : 256; /* the CPU backend's default */
}

/* Whether the routing_fn fails during a T-token call: it is called once per chunk, counted from 0. */
static int routing_fn_fails(const layer_t *L, int64_t T) {
    const router_t *r = &L->router_fn;
    if (!L->cfg.routing_fn || !r->misbehave || T < 1) return 0;
    return r->fail_at < (T + chunk_tokens(L) - 1) / chunk_tokens(L);
}

/* Runs call() on out poisoned with two patterns; checks fully written on success and untouched on
 * failure, except for the first routing_error_bytes when the failure is COLIBRI_ERR_ROUTING (the chunks
 * computed before the routing_fn failed, see colibri_moe_forward). */
typedef colibri_status_t (*call_fn)(void *args, void *out);

static colibri_status_t call_checked(call_fn call, void *args, void *out, size_t out_bytes, layer_t *L,
                                     size_t routing_error_bytes) {
    unsigned char *first = (unsigned char *)malloc(out_bytes ? out_bytes : 1);
    memset(out, 0xa5, out_bytes);
    L->router_fn.calls = 0;
    const colibri_status_t st = call(args, out);
    if (st != COLIBRI_OK) {
        const size_t may_write = st == COLIBRI_ERR_ROUTING ? routing_error_bytes : 0;
        for (size_t i = may_write; i < out_bytes; i++)
            REQUIRE(((unsigned char *)out)[i] == 0xa5, "a failed call (%s) wrote byte %zu of %zu (%zu allowed)",
                    colibri_status_string(st), i, out_bytes, may_write);
    } else if (out_bytes) {
        memcpy(first, out, out_bytes);
        memset(out, 0x5a, out_bytes);
        L->router_fn.calls = 0;
        REQUIRE(call(args, out) == COLIBRI_OK, "a call that succeeded failed when repeated");
        REQUIRE(memcmp(first, out, out_bytes) == 0, "output not fully written (or not deterministic)");
    }
    free(first);
    return st;
}

typedef struct {
    colibri_moe_context_t *ctx;
    int64_t T;
    colibri_dtype_t act;
    const void *input;
    const int32_t *ids;
    const float *weights;
    int32_t *ids_out; /* route only */
    float *weights_out;
} call_args_t;

static colibri_status_t do_forward(void *a, void *out) {
    const call_args_t *c = (const call_args_t *)a;
    return colibri_moe_forward(c->ctx, c->T, c->act, c->input, c->ids, c->weights, out, NULL);
}

static colibri_status_t do_route(void *a, void *out) {
    const call_args_t *c = (const call_args_t *)a;
    (void)out; /* ids_out and weights_out live in one block, passed as out */
    return colibri_moe_route(c->ctx, c->T, c->act, c->input, c->ids_out, c->weights_out, NULL);
}

static void fuzz_calls(bytes_t *b, layer_t *L, colibri_moe_context_t *ctx) {
    const colibri_moe_config_t *cfg = &L->cfg;
    const int32_t E = cfg->num_experts, k = cfg->top_k, H = cfg->hidden_size;
    const int32_t O = cfg->expert_kind == COLIBRI_EXPERT_SWIGLU ? H : cfg->intermediate_size;
    const int has_routing = L->router != NULL || cfg->routing_fn != NULL;
    for (int op = take_range(b, 1, 6); op > 0 && b->n; op--) {
        call_args_t a = {ctx, take_range(b, -1, 13), (colibri_dtype_t)take_range(b, 0, 5), NULL, NULL, NULL, NULL, NULL};
        const int64_t T = a.T > 0 ? a.T : 0;
        const size_t act_size = colibri_dtype_size(a.act) ? colibri_dtype_size(a.act) : 4;
        const uint8_t nulls = take_u8(b);
        const int null_ctx = nulls == 1, null_input = nulls == 2, null_out = nulls == 3;
        a.ctx = null_ctx ? NULL : ctx;
        void *input = take_buffer(b, (size_t)T * H * act_size);
        a.input = null_input ? NULL : input;
        /* fp8 is a weight dtype only */
        const int valid_call = !null_ctx && a.T >= 0 && colibri_dtype_size(a.act) && a.act != COLIBRI_DTYPE_F8E4M3 &&
                               (T == 0 || !null_input);
        const uint8_t kind = take_u8(b) % 4;

        if (kind < 2) { /* forward: routing given (both, one or none), raw or in range */
            const uint8_t given = take_u8(b) % 4;
            int32_t *ids = (int32_t *)take_buffer(b, (size_t)T * k * sizeof(int32_t));
            int in_range = 1;
            for (int64_t i = 0; i < T * k; i++) {
                if (take_u8(b) % 8) ids[i] = (int32_t)((uint32_t)ids[i] % (uint32_t)E);
                in_range &= ids[i] >= 0 && ids[i] < E;
            }
            float *w = take_floats(b, (size_t)T * k);
            a.ids = given & 1 ? ids : NULL;
            a.weights = given & 2 ? w : NULL;
            const int routing_ok = a.ids ? a.weights && in_range && all_finite(w, (size_t)T * k)
                                         : !a.weights && has_routing && !routing_fn_fails(L, T);
            const size_t out_bytes = (size_t)T * O * act_size;
            void *out = malloc(out_bytes ? out_bytes : 1);
            if (null_out) {
                const colibri_status_t st = colibri_moe_forward(a.ctx, a.T, a.act, a.input, a.ids, a.weights, NULL, NULL);
                require_status(st, valid_call && T == 0, "forward(output=NULL)");
            } else {
                const int64_t done = (int64_t)L->router_fn.fail_at * chunk_tokens(L);
                const size_t written = (size_t)(done < T ? done : T) * O * act_size;
                const colibri_status_t st = call_checked(do_forward, &a, out, out_bytes, L, written);
                require_status(st, valid_call && (T == 0 || routing_ok), "forward");
            }
            free(out);
            free(ids);
            free(w);
        } else if (kind == 2) { /* route into one exact block: ids then weights */
            const size_t n = (size_t)T * k;
            char *block = (char *)malloc(n * (sizeof(int32_t) + sizeof(float)) + 1);
            a.ids_out = null_out ? NULL : (int32_t *)block;
            a.weights_out = (float *)(block + n * sizeof(int32_t));
            const colibri_status_t st =
                call_checked(do_route, &a, block, n * (sizeof(int32_t) + sizeof(float)), L, n * (sizeof(int32_t) + sizeof(float)));
            require_status(st, valid_call && has_routing && (T == 0 || (!null_out && !routing_fn_fails(L, T))), "route");
            for (size_t i = 0; st == COLIBRI_OK && i < n; i++)
                REQUIRE(a.ids_out[i] >= 0 && a.ids_out[i] < E, "route gave id %d outside [0, %d)", a.ids_out[i], E);
            free(block);
        } else { /* counters */
            uint64_t *counts = (uint64_t *)malloc((size_t)E * sizeof *counts);
            const int32_t reset = take_range(b, 0, 3);
            require_status(colibri_moe_context_expert_counts(a.ctx, null_out ? NULL : counts, reset),
                           !null_ctx && !null_out && reset < 2, "expert_counts");
            require_status(colibri_moe_context_take_device_error(a.ctx), !null_ctx, "take_device_error");
            free(counts);
        }
        free(input);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    bytes_t b = {data, size};
    layer_t L;
    layer_take(&b, &L);
    colibri_moe_context_t *ctx = (colibri_moe_context_t *)&L; /* any non-NULL value: init and create must reset it */
    colibri_status_t st;
    if (L.create) {
        const colibri_moe_weights_t w = {L.null_weights ? NULL : L.weights, L.null_offsets ? NULL : L.offsets, L.numel,
                                         L.expert_bias, L.router, L.logit_bias, L.bias, L.shared, L.gate,
                                         L.scales, L.shared_scales};
        st = colibri_moe_context_create(L.null_out_ctx ? NULL : &ctx, L.null_config ? NULL : &L.cfg,
                                        L.null_weight_struct ? NULL : &w);
        require_status(st, create_should_succeed(&L), "context_create");
    } else {
        st = colibri_moe_context_init(L.null_out_ctx ? NULL : &ctx, L.null_config ? NULL : &L.cfg,
                                      L.null_weights ? NULL : L.weights, L.null_offsets ? NULL : L.offsets, L.numel,
                                      L.router, L.bias);
        require_status(st, init_should_succeed(&L), "context_init");
    }
    if (!L.null_out_ctx) REQUIRE((st == COLIBRI_OK) == (ctx != NULL), "%s left ctx %p with status %d",
                                    L.create ? "create" : "init", (void *)ctx, (int)st);
    if (st == COLIBRI_OK) {
        fuzz_calls(&b, &L, ctx);
        colibri_moe_context_destroy(ctx);
    }
    layer_free(&L);
    return 0;
}
