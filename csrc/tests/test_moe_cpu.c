/*
 * test_moe_cpu.c — the CPU backend against a float64 reference written here, independently of the
 * library: every routing (given ids, the three built-in routings with renormalize on and off and a
 * scaling factor != 1, a custom routing_fn with and without router logits) x expert kind x weight
 * dtype x activation dtype, at T = 0, 1, 7, 64, 513, on fresh random inputs and outputs poisoned
 * with NaN before each call. Then dtype conversions exhaustively, chunking, determinism, expert
 * counters and every kind of bad input.
 *
 * Usage: test_moe_cpu [seed]   (default: from the clock; printed so that a failure reproduces)
 * A failing check prints what failed; the test exits non-zero if any check failed.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"

/* ------------------------------------------------------------------------------------------------
 * checks and random numbers
 * ---------------------------------------------------------------------------------------------- */

static int failures, checks;

#define CHECK(cond, ...)                                                                                   \
    do {                                                                                                   \
        checks++;                                                                                          \
        if (!(cond)) {                                                                                     \
            failures++;                                                                                    \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                         \
            printf(__VA_ARGS__);                                                                           \
            printf("\n");                                                                                  \
        }                                                                                                  \
    } while (0)

#define CHECK_STATUS(call, want)                                                                           \
    do {                                                                                                   \
        colibri_status_t st_ = (call);                                                                     \
        CHECK(st_ == (want), "%s returned %s (want %s): %s", #call, colibri_status_string(st_),            \
              colibri_status_string(want), colibri_last_error());                                          \
    } while (0)

static uint64_t rng_state;

static uint64_t rng_next(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

static double uniform(double lo, double hi) { return lo + (hi - lo) * (double)(rng_next() >> 11) * 0x1p-53; }
static int32_t randint(int32_t lo, int32_t hi) { return lo + (int32_t)(rng_next() % (uint64_t)(hi - lo + 1)); }

/* ------------------------------------------------------------------------------------------------
 * dtypes, decoded exactly into doubles (written here, independently of the library)
 * ---------------------------------------------------------------------------------------------- */

static const colibri_dtype_t DTYPES[3] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16};
static const char *dtype_name(colibri_dtype_t d) { return d == COLIBRI_DTYPE_F32 ? "fp32" : d == COLIBRI_DTYPE_F16 ? "fp16" : "bf16"; }

static double half_to_double(uint16_t h) {
    const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (exponent == 0x1f) return mantissa ? NAN : sign * INFINITY;
    if (exponent == 0) return sign * ldexp(mantissa, -24);
    return sign * ldexp(mantissa + 1024, exponent - 25);
}

static double bf16_to_double(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp8 e4m3 ("e4m3fn"): bias 7, no infinities, S.1111.111 is NaN. */
static double f8_to_double(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const double sign = (b & 0x80) ? -1.0 : 1.0;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) return sign * ldexp(m, -9);
    return sign * ldexp(8 + m, e - 10);
}

static double decode(const void *p, colibri_dtype_t d, size_t i) {
    if (d == COLIBRI_DTYPE_F32) return ((const float *)p)[i];
    if (d == COLIBRI_DTYPE_F8E4M3) return f8_to_double(((const uint8_t *)p)[i]);
    uint16_t h = ((const uint16_t *)p)[i];
    return d == COLIBRI_DTYPE_F16 ? half_to_double(h) : bf16_to_double(h);
}

/* Stores v (|v| well inside the dtype's range) by truncation: the test only needs representable values,
 * which it then decodes exactly for the reference. */
static void encode_trunc(void *p, colibri_dtype_t d, size_t i, double v) {
    if (d == COLIBRI_DTYPE_F8E4M3) { /* |v| < 448 */
        const uint8_t sign = signbit(v) ? 0x80 : 0;
        const double a = fabs(v);
        int e2;
        frexp(a, &e2); /* a = f 2^e2, f in [0.5, 1): the leading bit is 2^(e2 - 1) */
        if (isnan(v)) ((uint8_t *)p)[i] = 0x7f;
        else if (a < 0x1p-6) ((uint8_t *)p)[i] = (uint8_t)(sign | (uint8_t)(a * 0x1p9)); /* subnormal */
        else ((uint8_t *)p)[i] = (uint8_t)(sign | (e2 - 1 + 7) << 3 | ((int)ldexp(a, 4 - e2) & 7));
        return;
    }
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (d == COLIBRI_DTYPE_F32) {
        ((float *)p)[i] = f;
    } else if (d == COLIBRI_DTYPE_BF16) {
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
        const double a = fabs((double)f);
        if (a >= 0x1p-14) ((uint16_t *)p)[i] = (uint16_t)(sign | ((((u >> 23) & 0xff) - 112) << 10) | ((u >> 13) & 0x3ff));
        else ((uint16_t *)p)[i] = (uint16_t)(sign | (uint16_t)(a * 0x1p24)); /* subnormal, truncated */
    }
}

static void poison(void *p, colibri_dtype_t d, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (d == COLIBRI_DTYPE_F8E4M3) { ((uint8_t *)p)[i] = 0x7f; continue; }
        if (d == COLIBRI_DTYPE_F32) ((float *)p)[i] = NAN;
        else ((uint16_t *)p)[i] = d == COLIBRI_DTYPE_F16 ? 0x7e00 : 0x7fc0;
    }
}

/* ------------------------------------------------------------------------------------------------
 * a layer: config + weights, and its float64 reference
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    colibri_moe_config_t cfg;
    void *weights;       /* packed, cfg.weight_dtype, with a gap between experts */
    uint64_t *offsets;   /* [E] */
    uint64_t numel;
    double *wd;          /* [E, expert_numel] decoded weights */
    float *router;       /* [E, H] or NULL */
    float *bias;         /* [E] or NULL (SIGMOID_BIAS's selection bias) */
    int out;             /* output width */
    /* the appended features (layer_add_features) */
    float *logit_bias;   /* [E] or NULL */
    float *expert_bias;  /* [E, bias_numel] or NULL */
    int bias_numel;
    void *shared;        /* [3 * Fs * H] cfg.weight_dtype, or NULL */
    double *sd;          /* decoded */
    float *shared_gate;  /* [H] or NULL */
    float *scales;       /* fp8: [E, scales per expert] (layer_scale_fp8), else NULL */
    float *shared_scales;
} layer_t;

static void layer_free(layer_t *L) {
    free(L->weights);
    free(L->offsets);
    free(L->wd);
    free(L->router);
    free(L->bias);
    free(L->logit_bias);
    free(L->expert_bias);
    free(L->shared);
    free(L->sd);
    free(L->shared_gate);
    free(L->scales);
    free(L->shared_scales);
    memset(L, 0, sizeof *L);
}

/* Random weights of scale 1/sqrt(fan-in) so that every stage stays O(1); experts packed in reverse
 * order with a gap, so that offsets are really used. */
static void layer_make(layer_t *L, colibri_expert_kind_t kind, colibri_dtype_t wdtype, int E, int k, int H, int F,
                       int with_router, int with_bias) {
    memset(L, 0, sizeof *L);
    colibri_moe_config_t *c = &L->cfg;
    c->expert_kind = kind;
    c->weight_dtype = wdtype;
    c->num_experts = E;
    c->top_k = k;
    c->hidden_size = H;
    c->intermediate_size = F;
    c->routed_scaling_factor = 1.0f;
    c->device = COLIBRI_DEVICE_CPU;
    L->out = kind == COLIBRI_EXPERT_SWIGLU ? H : F;
    const uint64_t n = colibri_expert_numel(kind, H, F), gap = 3;
    L->numel = (uint64_t)E * (n + gap);
    L->weights = malloc(L->numel * colibri_dtype_size(wdtype));
    L->offsets = malloc((size_t)E * sizeof *L->offsets);
    L->wd = malloc((size_t)E * n * sizeof *L->wd);
    for (uint64_t i = 0; i < L->numel; i++) encode_trunc(L->weights, wdtype, i, NAN); /* gaps must never be read */
    for (int e = 0; e < E; e++) {
        L->offsets[e] = (uint64_t)(E - 1 - e) * (n + gap) + gap;
        for (uint64_t i = 0; i < n; i++) {
            const int fan_in = kind == COLIBRI_EXPERT_SWIGLU && i >= 2ull * H * F ? F : H;
            encode_trunc(L->weights, wdtype, L->offsets[e] + i, uniform(-1, 1) * sqrt(3.0 / fan_in));
            L->wd[e * n + i] = decode(L->weights, wdtype, L->offsets[e] + i);
        }
    }
    if (with_router) {
        L->router = malloc((size_t)E * H * sizeof(float));
        for (int i = 0; i < E * H; i++) L->router[i] = (float)(uniform(-1, 1) * sqrt(3.0 / H) * 2.0);
    }
    if (with_bias) {
        L->bias = malloc((size_t)E * sizeof(float));
        for (int e = 0; e < E; e++) L->bias[e] = (float)uniform(-0.3, 0.3);
    }
    /* the last expert routes exactly like the first, so every token has an exact tie to break (lower id first) */
    if (with_router && E >= 3) {
        memcpy(L->router + (size_t)(E - 1) * H, L->router, (size_t)H * sizeof(float));
        if (with_bias) L->bias[E - 1] = L->bias[0];
    }
}

/* Features of colibri_moe_config_t's appended fields, as flags of a test case. */
enum {
    F_GROUPS = 1,      /* n_group > 1 (group score from the case's routing: MAX for softmax, TOP2_SUM for sigmoid) */
    F_LOGIT_BIAS = 2,  /* router_logit_bias */
    F_EXPERT_BIAS = 4, /* expert biases */
    F_OAI = 8,         /* the SWIGLU_OAI activation */
    F_SHARED = 16,     /* a shared expert */
    F_SHARED_GATE = 32 /* ... with a sigmoid gate */
};

/* Adds the features to a layer from layer_make; E must suit F_GROUPS (several groups of >= 2). */
static void layer_add_features(layer_t *L, int features, int n_group) {
    colibri_moe_config_t *c = &L->cfg;
    const int E = c->num_experts, H = c->hidden_size, F = c->intermediate_size;
    if (features & F_GROUPS) {
        c->n_group = n_group;
        c->topk_group = randint(1, n_group);
        while (c->top_k > c->topk_group * (E / n_group)) c->topk_group++;
        c->group_score = c->routing == COLIBRI_ROUTING_SIGMOID_BIAS ? COLIBRI_GROUP_SCORE_TOP2_SUM : COLIBRI_GROUP_SCORE_MAX;
    }
    if (features & F_LOGIT_BIAS) {
        L->logit_bias = malloc((size_t)E * sizeof(float));
        for (int e = 0; e < E; e++) L->logit_bias[e] = (float)uniform(-1, 1);
        if (E >= 3) L->logit_bias[E - 1] = L->logit_bias[0]; /* keep layer_make's exact tie */
    }
    if (features & F_EXPERT_BIAS) {
        c->expert_bias = 1;
        L->bias_numel = c->expert_kind == COLIBRI_EXPERT_SWIGLU ? 2 * F + H : F;
        L->expert_bias = malloc((size_t)E * L->bias_numel * sizeof(float));
        for (int i = 0; i < E * L->bias_numel; i++) L->expert_bias[i] = (float)uniform(-0.5, 0.5);
    }
    if (features & F_OAI) {
        c->activation = COLIBRI_ACTIVATION_SWIGLU_OAI;
        c->activation_alpha = 1.702f;
        c->activation_limit = (float)uniform(0.3, 1.5); /* small enough that both clamps bite */
    }
    if (features & F_SHARED) {
        const int Fs = randint(8, 2 * F + 5); /* one to three slices of F, the last padded */
        c->shared_intermediate_size = Fs;
        const size_t n = 3 * (size_t)Fs * H;
        L->shared = malloc(n * colibri_dtype_size(c->weight_dtype));
        L->sd = malloc(n * sizeof *L->sd);
        for (size_t i = 0; i < n; i++) {
            encode_trunc(L->shared, c->weight_dtype, i, uniform(-1, 1) * sqrt(3.0 / (i >= 2 * (size_t)Fs * H ? Fs : H)));
            L->sd[i] = decode(L->shared, c->weight_dtype, i);
        }
    }
    if (features & F_SHARED_GATE) {
        c->shared_gate = 1;
        L->shared_gate = malloc((size_t)H * sizeof(float));
        for (int i = 0; i < H; i++) L->shared_gate[i] = (float)(uniform(-1, 1) * sqrt(3.0 / H) * 2.0);
    }
}

/* Scales of blocks bn x bk (0: whole dimension) along n elements: the grid's extent. */
static int blocks_of(int n, int b) { return b > 0 ? (n + b - 1) / b : 1; }

/* Multiplies the matrix [N, K] of decoded fp8 values at m by its random scale grid (written to grid,
 * returned past its end), as colibri.h defines fp8 weights. */
static float *scale_matrix(double *m, int N, int K, int bn, int bk, float *grid) {
    const int rows = blocks_of(N, bn), cols = blocks_of(K, bk);
    for (int i = 0; i < rows * cols; i++) grid[i] = (float)uniform(0.5, 2.0);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++)
            m[(size_t)n * K + k] *= grid[(bn > 0 ? n / bn : 0) * cols + (bk > 0 ? k / bk : 0)];
    return grid + rows * cols;
}

/* Gives an fp8 layer (layer_make, layer_add_features with COLIBRI_DTYPE_F8E4M3) random scale grids of
 * blocks bn x bk and folds them into the decoded weights the reference uses. */
static void layer_scale_fp8(layer_t *L, int bn, int bk) {
    colibri_moe_config_t *c = &L->cfg;
    const int E = c->num_experts, H = c->hidden_size, F = c->intermediate_size, Fs = c->shared_intermediate_size;
    const int swiglu = c->expert_kind == COLIBRI_EXPERT_SWIGLU;
    c->scale_block_n = bn, c->scale_block_k = bk;
    const size_t per = swiglu ? 2 * (size_t)blocks_of(F, bn) * blocks_of(H, bk) + (size_t)blocks_of(H, bn) * blocks_of(F, bk)
                              : (size_t)blocks_of(F, bn) * blocks_of(H, bk);
    CHECK(colibri_scales_numel(c->expert_kind, H, F, bn, bk) == per, "colibri_scales_numel %llu, want %zu",
          (unsigned long long)colibri_scales_numel(c->expert_kind, H, F, bn, bk), per);
    L->scales = malloc((size_t)E * per * sizeof(float));
    const uint64_t n = colibri_expert_numel(c->expert_kind, H, F);
    for (int e = 0; e < E; e++) {
        double *w = L->wd + (size_t)e * n;
        float *g = scale_matrix(w, F, H, bn, bk, L->scales + (size_t)e * per); /* gate, or LINEAR's w */
        if (swiglu) scale_matrix(w + 2 * (size_t)F * H, H, F, bn, bk, scale_matrix(w + (size_t)F * H, F, H, bn, bk, g));
    }
    if (L->shared) {
        L->shared_scales = malloc(colibri_scales_numel(COLIBRI_EXPERT_SWIGLU, H, Fs, bn, bk) * sizeof(float));
        float *g = scale_matrix(L->sd, Fs, H, bn, bk, L->shared_scales);
        g = scale_matrix(L->sd + (size_t)Fs * H, Fs, H, bn, bk, g);
        scale_matrix(L->sd + 2 * (size_t)Fs * H, H, Fs, bn, bk, g);
    }
}

/* The layers with appended features go through colibri_moe_context_create, the others through
 * colibri_moe_context_init, so both entry points stay tested. */
static colibri_status_t layer_init(const layer_t *L, colibri_moe_context_t **ctx) {
    if (!L->logit_bias && !L->expert_bias && !L->shared && !L->cfg.n_group && !L->cfg.activation && !L->scales)
        return colibri_moe_context_init(ctx, &L->cfg, L->weights, L->offsets, L->numel, L->router, L->bias);
    colibri_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.expert_weights = L->weights, w.expert_offsets = L->offsets, w.expert_weights_numel = L->numel;
    w.expert_bias = L->expert_bias, w.router_weight = L->router, w.router_logit_bias = L->logit_bias;
    w.router_bias = L->bias, w.shared_weights = L->shared, w.shared_gate_weight = L->shared_gate;
    w.expert_scales = L->scales, w.shared_scales = L->shared_scales;
    return colibri_moe_context_create(ctx, &L->cfg, &w);
}

/* act(g, u) of colibri_activation_t in doubles. */
static double ref_act(const colibri_moe_config_t *c, double g, double u) {
    if (c->activation == COLIBRI_ACTIVATION_SILU) return g / (1.0 + exp(-g)) * u;
    const double limit = c->activation_limit, gc = fmin(g, limit), uc = fmax(fmin(u, limit), -limit);
    return (uc + 1.0) * gc / (1.0 + exp(-(double)c->activation_alpha * gc));
}

/* The shared expert on x, added to y with weight g (1, or the gate's sigmoid). */
static void ref_shared(const layer_t *L, const double *x, double *y) {
    const int H = L->cfg.hidden_size, Fs = L->cfg.shared_intermediate_size;
    const double *gate = L->sd, *up = L->sd + (size_t)Fs * H, *down = L->sd + 2 * (size_t)Fs * H;
    double g = 1.0;
    if (L->shared_gate) {
        double d = 0;
        for (int i = 0; i < H; i++) d += (double)L->shared_gate[i] * x[i];
        g = 1.0 / (1.0 + exp(-d));
    }
    double *h = malloc((size_t)Fs * sizeof *h);
    for (int f = 0; f < Fs; f++) {
        double a = 0, b = 0;
        for (int i = 0; i < H; i++) a += gate[(size_t)f * H + i] * x[i], b += up[(size_t)f * H + i] * x[i];
        h[f] = a / (1.0 + exp(-a)) * b;
    }
    for (int o = 0; o < H; o++) {
        double d = 0;
        for (int f = 0; f < Fs; f++) d += down[(size_t)o * Fs + f] * h[f];
        y[o] += g * d;
    }
    free(h);
}

/* y = expert e applied to x (doubles), width L->out. */
static void ref_expert(const layer_t *L, int e, const double *x, double *y, double *h) {
    const int H = L->cfg.hidden_size, F = L->cfg.intermediate_size;
    const double *w = L->wd + (size_t)e * colibri_expert_numel(L->cfg.expert_kind, H, F);
    const float *b = L->expert_bias ? L->expert_bias + (size_t)e * L->bias_numel : NULL;
    if (L->cfg.expert_kind == COLIBRI_EXPERT_LINEAR) {
        for (int f = 0; f < F; f++) {
            double s = b ? b[f] : 0;
            for (int i = 0; i < H; i++) s += w[(size_t)f * H + i] * x[i];
            y[f] = s;
        }
        return;
    }
    const double *gate = w, *up = w + (size_t)F * H, *down = w + 2 * (size_t)F * H;
    for (int f = 0; f < F; f++) {
        double g = b ? b[f] : 0, u = b ? b[F + f] : 0;
        for (int i = 0; i < H; i++) {
            g += gate[(size_t)f * H + i] * x[i];
            u += up[(size_t)f * H + i] * x[i];
        }
        h[f] = ref_act(&L->cfg, g, u);
    }
    for (int o = 0; o < H; o++) {
        double s = b ? b[2 * F + o] : 0;
        for (int f = 0; f < F; f++) s += down[(size_t)o * F + f] * h[f];
        y[o] = s;
    }
}

/* out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for the tokens with use[t] (all if use is NULL). */
static void ref_forward(const layer_t *L, int T, const double *x, const int32_t *ids, const double *w, const int *use,
                        double *out) {
    const int H = L->cfg.hidden_size, k = L->cfg.top_k, O = L->out;
    double *y = malloc((size_t)O * sizeof *y), *h = malloc((size_t)L->cfg.intermediate_size * sizeof *h);
    for (int t = 0; t < T; t++) {
        for (int o = 0; o < O; o++) out[(size_t)t * O + o] = 0;
        if (use && !use[t]) continue;
        for (int j = 0; j < k; j++) {
            ref_expert(L, ids[t * k + j], x + (size_t)t * H, y, h);
            for (int o = 0; o < O; o++) out[(size_t)t * O + o] += w[t * k + j] * y[o];
        }
        if (L->shared) ref_shared(L, x + (size_t)t * H, out + (size_t)t * O);
    }
    free(y);
    free(h);
}

/* Reference routing in doubles. score gets the selection score of every expert (for near-tie checks),
 * -inf outside the kept groups. Returns 0 when the kept groups are ambiguous (a near-tie of group scores
 * at the boundary), else 1. */
static int ref_route(const layer_t *L, const double *x, int32_t *ids, double *w, double *score) {
    const colibri_moe_config_t *c = &L->cfg;
    const int E = c->num_experts, k = c->top_k, H = c->hidden_size;
    double logit[64], prob[64];
    for (int e = 0; e < E; e++) {
        double s = 0;
        for (int i = 0; i < H; i++) s += (double)L->router[(size_t)e * H + i] * x[i];
        logit[e] = s + (L->logit_bias ? L->logit_bias[e] : 0.0);
    }
    double max = logit[0], sum = 0;
    for (int e = 1; e < E; e++) max = fmax(max, logit[e]);
    for (int e = 0; e < E; e++) {
        switch (c->routing) {
        case COLIBRI_ROUTING_SOFTMAX_TOPK: sum += prob[e] = exp(logit[e] - max); break;
        case COLIBRI_ROUTING_TOPK_SOFTMAX: score[e] = logit[e]; break;
        case COLIBRI_ROUTING_SIGMOID_BIAS:
            prob[e] = 1.0 / (1.0 + exp(-logit[e]));
            score[e] = prob[e] + L->bias[e];
            break;
        }
    }
    if (c->routing == COLIBRI_ROUTING_SOFTMAX_TOPK)
        for (int e = 0; e < E; e++) score[e] = prob[e] /= sum;
    int groups_clear = 1;
    if (c->n_group > 1) {
        const int G = c->n_group, size = E / G;
        double gs[64], sorted[64];
        for (int g = 0; g < G; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (int i = 0; i < size; i++) {
                const double v = score[g * size + i];
                if (v > a) b = a, a = v;
                else if (v > b) b = v;
            }
            gs[g] = sorted[g] = c->group_score == COLIBRI_GROUP_SCORE_TOP2_SUM ? a + b : a;
        }
        for (int i = 0; i < G; i++) /* descending */
            for (int j = i + 1; j < G; j++)
                if (sorted[j] > sorted[i]) { const double t = sorted[i]; sorted[i] = sorted[j]; sorted[j] = t; }
        if (c->topk_group < G && sorted[c->topk_group - 1] != sorted[c->topk_group] &&
            sorted[c->topk_group - 1] - sorted[c->topk_group] <= 1e-4 * (fabs(sorted[0]) + 1e-3))
            groups_clear = 0;
        for (int g = 0; g < G; g++) {
            int rank = 0;
            for (int h = 0; h < G; h++) rank += gs[h] > gs[g] || (gs[h] == gs[g] && h < g);
            if (rank >= c->topk_group)
                for (int i = 0; i < size; i++) score[g * size + i] = -INFINITY;
        }
    }
    int taken[64] = {0};
    for (int j = 0; j < k; j++) { /* selection sort: the largest remaining, ties to the lower id */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || score[e] > score[best])) best = e;
        taken[best] = 1;
        ids[j] = best;
    }
    double wsum = 0;
    for (int j = 0; j < k; j++) {
        w[j] = c->routing == COLIBRI_ROUTING_TOPK_SOFTMAX ? exp(logit[ids[j]] - logit[ids[0]]) : prob[ids[j]];
        wsum += w[j];
    }
    const int renorm = c->routing == COLIBRI_ROUTING_TOPK_SOFTMAX || c->renormalize;
    for (int j = 0; j < k; j++) w[j] = (renorm ? w[j] / wsum : w[j]) * c->routed_scaling_factor;
    return groups_clear;
}

/* A token's routing is unambiguous when every adjacent pair of its top k + 1 reference scores differs
 * by more than what fp32 logits can move them (about 1e-6 here), or not at all: an exact tie comes
 * from identical router rows, which give identical fp32 scores too, and must go to the lower id. */
static int clear_routing(const layer_t *L, const int32_t *ids, const double *score) {
    const int E = L->cfg.num_experts, k = L->cfg.top_k;
    double smax = 0;
    for (int e = 0; e < E; e++)
        if (isfinite(score[e])) smax = fmax(smax, fabs(score[e]));
    const double eps = 1e-4 * (smax + 1e-3);
    for (int j = 0; j + 1 < k; j++)
        if (score[ids[j]] != score[ids[j + 1]] && score[ids[j]] - score[ids[j + 1]] <= eps) return 0;
    if (k < E)
        for (int e = 0; e < E; e++) {
            int chosen = 0;
            for (int j = 0; j < k; j++) chosen |= ids[j] == e;
            if (!chosen && score[ids[k - 1]] != score[e] && score[ids[k - 1]] - score[e] <= eps) return 0;
        }
    return 1;
}

/* ------------------------------------------------------------------------------------------------
 * comparing outputs
 * ---------------------------------------------------------------------------------------------- */

/* Limits on max|out - ref| / max|ref|. The reference is exact for the dtypes the layer stores (inputs
 * and weights are decoded exactly), so what remains is (a) fp32 arithmetic: sums of a few hundred terms
 * whose relative rounding is ~sqrt(n) * 6e-8 ~ 1e-6, times a cancellation factor of a few, and (b) the
 * rounding of the output to the activation dtype: 2^-24 (fp32), 2^-11 = 4.9e-4 (fp16), 2^-8 = 3.9e-3
 * (bf16) of each element, which is at most that of max|ref|, and (c) for bf16 weights with bf16
 * activations on CPUs with AVX512-BF16, the SwiGLU intermediate kept in bf16: 2^-8 relative per element,
 * random in sign, so it adds about 1e-3 to the output. Each limit is the sum with a margin of 2-4x,
 * tight enough that a wrong weight, slot or row shows up. */
static double error_limit(colibri_dtype_t act) {
    return act == COLIBRI_DTYPE_F32 ? 1e-5 : act == COLIBRI_DTYPE_F16 ? 2e-3 : 1e-2;
}

/* Normalised max error over the rows with use[t] (all if NULL); INFINITY if any such output is not
 * finite (NaN from the poison or from the library never passes). */
static double max_error(const void *out, colibri_dtype_t act, const double *ref, int T, int O, const int *use) {
    double scale = 0, err = 0;
    for (int t = 0; t < T; t++)
        for (int o = 0; use && !use[t] ? 0 : o < O; o++) scale = fmax(scale, fabs(ref[(size_t)t * O + o]));
    for (int t = 0; t < T; t++) {
        if (use && !use[t]) continue;
        for (int o = 0; o < O; o++) {
            const double v = decode(out, act, (size_t)t * O + o);
            if (!isfinite(v)) return INFINITY;
            err = fmax(err, fabs(v - ref[(size_t)t * O + o]));
        }
    }
    return scale > 0 ? err / scale : err;
}

static int all_finite(const void *out, colibri_dtype_t act, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(decode(out, act, i))) return 0;
    return 1;
}

/* ------------------------------------------------------------------------------------------------
 * a custom routing function: ids from a hash of each token's first element, records its arguments
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    int E, k;
    colibri_dtype_t act;
    int misbehave;        /* 0: good, 1: id out of range, 2: NaN weight, 3: returns an error */
    int calls, bad_args;  /* calls made, calls whose arguments were not what the context says */
    int tokens_seen;
    float *logits_seen;   /* [tokens, E] copy of the logits it was given */
    int logits_null;      /* calls that got NULL logits */
} custom_router_t;

static uint32_t token_hash(const void *hidden, colibri_dtype_t act, int H, int64_t t) {
    const size_t sz = colibri_dtype_size(act);
    const unsigned char *p = (const unsigned char *)hidden + (size_t)t * H * sz;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < sz; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

static int custom_hidden_size; /* H of the layer under test, for token_hash */

static void custom_ids(const void *hidden, colibri_dtype_t act, int64_t t, int E, int k, int32_t *ids, float *w) {
    const uint32_t base = token_hash(hidden, act, custom_hidden_size, t);
    for (int j = 0; j < k; j++) {
        ids[j] = (int32_t)((base + 7u * (uint32_t)j) % (uint32_t)E); /* may repeat an expert: allowed */
        w[j] = 1.0f / (float)(j + 2) - 0.2f;
    }
}

static colibri_status_t custom_route(void *user, int64_t T, int32_t E, int32_t k, colibri_dtype_t act,
                                     const void *hidden, const float *logits, int32_t *ids, float *w, void *stream) {
    custom_router_t *r = (custom_router_t *)user;
    r->calls++;
    if (E != r->E || k != r->k || act != r->act || stream != NULL || !hidden || !ids || !w || T < 1) r->bad_args++;
    if (!logits) r->logits_null++;
    else if (r->logits_seen) memcpy(r->logits_seen + (size_t)r->tokens_seen * E, logits, (size_t)T * E * sizeof(float));
    r->tokens_seen += (int)T;
    if (r->misbehave == 3) return COLIBRI_ERR_INTERNAL;
    for (int64_t t = 0; t < T; t++) custom_ids(hidden, act, t, E, k, ids + t * k, w + t * k);
    if (r->misbehave == 1) ids[(T - 1) * k] = E;
    if (r->misbehave == 2) w[0] = NAN;
    return COLIBRI_OK;
}

/* ------------------------------------------------------------------------------------------------
 * the main matrix: routing x kind x weight dtype x act dtype x T
 * ---------------------------------------------------------------------------------------------- */

typedef enum { GIVEN_IDS, BUILTIN, CUSTOM_WITH_ROUTER, CUSTOM_WITHOUT_ROUTER } routing_source_t;

typedef struct {
    const char *name;
    routing_source_t source;
    colibri_routing_t routing;
    int renormalize;
    float scaling;
    int features;    /* F_* flags; the SWIGLU-only ones are dropped for LINEAR layers */
} routing_case_t;

static const routing_case_t ROUTING_CASES[] = {
    {"given ids", GIVEN_IDS, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 1.0f, 0},
    {"softmax_topk", BUILTIN, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 1.0f, 0},
    {"softmax_topk renorm", BUILTIN, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 1.0f, 0},
    {"topk_softmax scaled", BUILTIN, COLIBRI_ROUTING_TOPK_SOFTMAX, 1, 1.5f, 0},
    {"sigmoid_bias renorm scaled", BUILTIN, COLIBRI_ROUTING_SIGMOID_BIAS, 1, 2.5f, 0},
    {"sigmoid_bias", BUILTIN, COLIBRI_ROUTING_SIGMOID_BIAS, 0, 1.0f, 0},
    {"custom fn + router", CUSTOM_WITH_ROUTER, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 1.0f, 0},
    {"custom fn, no router", CUSTOM_WITHOUT_ROUTER, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 1.0f, 0},
    /* the model families' features */
    {"groups max + shared (DeepSeek-V2)", BUILTIN, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 2.5f, F_GROUPS | F_SHARED},
    {"sigmoid groups top2 + shared (DeepSeek-V3)", BUILTIN, COLIBRI_ROUTING_SIGMOID_BIAS, 1, 2.5f, F_GROUPS | F_SHARED},
    {"shared with gate (Qwen2-MoE)", BUILTIN, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 1.0f, F_SHARED | F_SHARED_GATE},
    {"logit bias, oai, expert bias (gpt-oss)", BUILTIN, COLIBRI_ROUTING_TOPK_SOFTMAX, 0, 1.0f,
     F_LOGIT_BIAS | F_OAI | F_EXPERT_BIAS},
    {"given ids, expert bias, gated shared", GIVEN_IDS, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 1.0f,
     F_EXPERT_BIAS | F_SHARED | F_SHARED_GATE},
};
enum { NUM_ROUTING_CASES = sizeof ROUTING_CASES / sizeof ROUTING_CASES[0] };
static const int TOKEN_COUNTS[] = {0, 1, 7, 64, 513};
enum { MAX_T = 513 };

static void random_input(void *x, double *xd, colibri_dtype_t act, int T, int H) {
    for (size_t i = 0; i < (size_t)T * H; i++) {
        encode_trunc(x, act, i, uniform(-1, 1));
        xd[i] = decode(x, act, i);
    }
}

typedef struct {
    double worst[3]; /* per act dtype */
    int tokens_compared, tokens_near_tie;
} matrix_stats_t;

static void run_case(const layer_t *L, colibri_moe_context_t *ctx, const routing_case_t *rc, custom_router_t *cr,
                     colibri_dtype_t act, int T, matrix_stats_t *stats, const char *label) {
    const int H = L->cfg.hidden_size, E = L->cfg.num_experts, k = L->cfg.top_k, O = L->out;
    const size_t asz = colibri_dtype_size(act);
    void *x = malloc((size_t)(T ? T : 1) * H * asz), *out = malloc((size_t)(T ? T : 1) * O * asz),
         *out2 = malloc((size_t)(T ? T : 1) * O * asz);
    double *xd = malloc((size_t)(T ? T : 1) * H * sizeof *xd), *ref = malloc((size_t)(T ? T : 1) * O * sizeof *ref);
    int32_t *ids = malloc((size_t)(T ? T : 1) * k * sizeof *ids), *ref_ids = malloc((size_t)(T ? T : 1) * k * sizeof *ref_ids);
    float *w = malloc((size_t)(T ? T : 1) * k * sizeof *w);
    double *wd = malloc((size_t)(T ? T : 1) * k * sizeof *wd), *ref_w = malloc((size_t)(T ? T : 1) * k * sizeof *ref_w);
    double score[64];
    int *clear = malloc((size_t)(T ? T : 1) * sizeof *clear);
    random_input(x, xd, act, T, H);
    const double limit = error_limit(act);
    double err;
    int a = act == COLIBRI_DTYPE_F32 ? 0 : act == COLIBRI_DTYPE_F16 ? 1 : 2;

    if (T == 0) { /* valid and does nothing: the poison stays */
        poison(out, act, (size_t)O);
        CHECK_STATUS(colibri_moe_forward(ctx, 0, act, x, NULL, NULL, out, NULL), COLIBRI_OK);
        CHECK(isnan(decode(out, act, 0)), "%s T=0 wrote the output", label);
        goto done;
    }

    switch (rc->source) {
    case GIVEN_IDS:
        for (int i = 0; i < T * k; i++) {
            ids[i] = randint(0, E - 1); /* repeats within a token are allowed */
            w[i] = (float)uniform(-1, 1);
            wd[i] = w[i];
        }
        poison(out, act, (size_t)T * O);
        CHECK_STATUS(colibri_moe_forward(ctx, T, act, x, ids, w, out, NULL), COLIBRI_OK);
        ref_forward(L, T, xd, ids, wd, NULL, ref);
        err = max_error(out, act, ref, T, O, NULL);
        CHECK(err <= limit, "%s: error %.3g > %.3g", label, err, limit);
        stats->worst[a] = fmax(stats->worst[a], err);
        break;

    case BUILTIN: {
        /* 1. colibri_moe_route against the reference routing, on tokens without near-ties */
        for (int i = 0; i < T * k; i++) ids[i] = -1, w[i] = NAN;
        CHECK_STATUS(colibri_moe_route(ctx, T, act, x, ids, w, NULL), COLIBRI_OK);
        int mismatched = 0;
        double wmax = 0, werr = 0;
        for (int t = 0; t < T; t++) {
            const int groups_clear = ref_route(L, xd + (size_t)t * H, ref_ids + t * k, ref_w + t * k, score);
            clear[t] = groups_clear && clear_routing(L, ref_ids + t * k, score);
            stats->tokens_compared++;
            if (!clear[t]) {
                stats->tokens_near_tie++;
                continue;
            }
            for (int j = 0; j < k; j++) {
                mismatched += ids[t * k + j] != ref_ids[t * k + j];
                wmax = fmax(wmax, fabs(ref_w[t * k + j]));
                werr = fmax(werr, isfinite(w[t * k + j]) ? fabs(w[t * k + j] - ref_w[t * k + j]) : INFINITY);
            }
        }
        CHECK(mismatched == 0, "%s: %d routed ids differ from the reference", label, mismatched);
        CHECK(werr <= 1e-5 * wmax, "%s: routing weights off by %.3g (scale %.3g)", label, werr, wmax);
        /* 2. forward with those ids given */
        for (int i = 0; i < T * k; i++) wd[i] = w[i];
        int ids_ok = 1;
        for (int i = 0; i < T * k; i++) ids_ok &= ids[i] >= 0 && ids[i] < E;
        CHECK(ids_ok, "%s: route returned ids out of range", label);
        if (!ids_ok) goto done;
        poison(out, act, (size_t)T * O);
        CHECK_STATUS(colibri_moe_forward(ctx, T, act, x, ids, w, out, NULL), COLIBRI_OK);
        ref_forward(L, T, xd, ids, wd, NULL, ref);
        err = max_error(out, act, ref, T, O, NULL);
        CHECK(err <= limit, "%s (routed ids given): error %.3g > %.3g", label, err, limit);
        stats->worst[a] = fmax(stats->worst[a], err);
        /* 3. the full forward, router inside: the same routing, so bitwise the same output; and against
         *    the reference routing where it is unambiguous */
        poison(out2, act, (size_t)T * O);
        CHECK_STATUS(colibri_moe_forward(ctx, T, act, x, NULL, NULL, out2, NULL), COLIBRI_OK);
        CHECK(memcmp(out, out2, (size_t)T * O * asz) == 0, "%s: forward with its own routing differs from forward "
                                                           "with colibri_moe_route's ids", label);
        ref_forward(L, T, xd, ref_ids, ref_w, clear, ref);
        err = max_error(out2, act, ref, T, O, clear);
        CHECK(err <= limit && all_finite(out2, act, (size_t)T * O), "%s (router inside): error %.3g > %.3g", label, err, limit);
        stats->worst[a] = fmax(stats->worst[a], err);
        break;
    }

    case CUSTOM_WITH_ROUTER:
    case CUSTOM_WITHOUT_ROUTER: {
        cr->act = act;
        cr->calls = cr->bad_args = cr->tokens_seen = cr->logits_null = 0;
        poison(out, act, (size_t)T * O);
        CHECK_STATUS(colibri_moe_forward(ctx, T, act, x, NULL, NULL, out, NULL), COLIBRI_OK);
        const int chunks = (T + L->cfg.workspace_tokens - 1) / L->cfg.workspace_tokens;
        CHECK(cr->calls == chunks && cr->bad_args == 0 && cr->tokens_seen == T,
              "%s: routing_fn called %d times over %d tokens, %d with wrong arguments", label, cr->calls,
              cr->tokens_seen, cr->bad_args);
        if (rc->source == CUSTOM_WITHOUT_ROUTER) {
            CHECK(cr->logits_null == cr->calls, "%s: routing_fn got logits without a router", label);
        } else {
            CHECK(cr->logits_null == 0, "%s: routing_fn got NULL logits with a router", label);
            /* each logit against its own scale, the sum of |terms|: an fp32 dot product's rounding is
             * relative to that, not to the result, which cancellation can make tiny (one expert, T=1) */
            double lerr = 0, lscale = 0;
            int lbad = 0;
            for (int t = 0; t < T; t++)
                for (int e = 0; e < E; e++) {
                    double s = 0, a = 0;
                    for (int i = 0; i < H; i++) {
                        const double term = (double)L->router[(size_t)e * H + i] * xd[(size_t)t * H + i];
                        s += term;
                        a += fabs(term);
                    }
                    const double d = fabs(s - cr->logits_seen[(size_t)t * E + e]);
                    if (!(d <= 1e-5 * a)) lbad++;
                    lerr = fmax(lerr, d);
                    lscale = fmax(lscale, a);
                }
            CHECK(lbad == 0, "%s: %d router logits off by more than 1e-5 of their sum of |terms| (worst %.3g, "
                             "largest sum %.3g)", label, lbad, lerr, lscale);
        }
        for (int t = 0; t < T; t++) custom_ids(x, act, t, E, k, ids + t * k, w + t * k);
        for (int i = 0; i < T * k; i++) wd[i] = w[i];
        ref_forward(L, T, xd, ids, wd, NULL, ref);
        err = max_error(out, act, ref, T, O, NULL);
        CHECK(err <= limit, "%s: error %.3g > %.3g", label, err, limit);
        stats->worst[a] = fmax(stats->worst[a], err);
        break;
    }
    }
done:
    free(x), free(out), free(out2), free(xd), free(ref), free(ids), free(ref_ids), free(w), free(wd), free(ref_w);
    free(clear);
}

/* Shapes small enough for the float64 reference at T = 513, yet with H and F not multiples of the
 * vector width, and E from 1 to 16. */
static void random_shape(int *E, int *k, int *H, int *F, int k_equals_E, int n_group) {
    do {
        *E = n_group > 1 ? n_group * randint(2, 4) : randint(1, 16);
        *k = k_equals_E ? *E : randint(1, *E < 8 ? *E : 8);
        *H = randint(64, 256);
        *F = randint(32, 384);
    } while ((double)*k * *H * *F > (k_equals_E ? 2e5 : 8e4));
}

static void test_matrix(void) {
    matrix_stats_t stats = {{0, 0, 0}, 0, 0};
    /* COLIBRI_TEST_QUICK (make test-valgrind, ~50x slower) leaves out T = 513, most of the run's time;
     * test_chunking_and_determinism still covers forwards of several chunks. */
    const size_t num_token_counts = sizeof TOKEN_COUNTS / sizeof TOKEN_COUNTS[0] - (getenv("COLIBRI_TEST_QUICK") != NULL);
    for (int rci = 0; rci < NUM_ROUTING_CASES; rci++) {
        const routing_case_t *rc = &ROUTING_CASES[rci];
        for (int kind = 0; kind < 2; kind++)
            for (int wdi = 0; wdi < 3; wdi++) {
                int E, k, H, F;
                const int features = kind ? rc->features & ~(F_OAI | F_SHARED | F_SHARED_GATE) : rc->features;
                const int n_group = features & F_GROUPS ? randint(2, 4) : 0;
                random_shape(&E, &k, &H, &F, rci == 2 && kind == 0 && wdi == 0, n_group);
                layer_t L;
                const int router = rc->source != GIVEN_IDS && rc->source != CUSTOM_WITHOUT_ROUTER;
                layer_make(&L, (colibri_expert_kind_t)kind, DTYPES[wdi], E, k, H, F, router,
                           rc->routing == COLIBRI_ROUTING_SIGMOID_BIAS);
                L.cfg.routing = rc->routing;
                L.cfg.renormalize = rc->renormalize;
                L.cfg.routed_scaling_factor = rc->scaling;
                layer_add_features(&L, features, n_group);
                custom_router_t cr = {E, k, COLIBRI_DTYPE_F32, 0, 0, 0, 0, NULL, 0};
                if (rc->source == CUSTOM_WITH_ROUTER || rc->source == CUSTOM_WITHOUT_ROUTER) {
                    L.cfg.routing_fn = custom_route;
                    L.cfg.routing_user_data = &cr;
                    cr.logits_seen = malloc((size_t)MAX_T * E * sizeof(float));
                    custom_hidden_size = H;
                }
                colibri_moe_context_t *ctx = NULL;
                CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_OK);
                if (ctx) {
                    L.cfg.workspace_tokens = 256; /* the backend default, for the chunk count check */
                    for (int ai = 0; ai < 3; ai++)
                        for (size_t ti = 0; ti < num_token_counts; ti++) {
                            char label[200];
                            snprintf(label, sizeof label, "[%s, %s, w %s, act %s, T=%d, E=%d k=%d H=%d F=%d]",
                                     rc->name, kind ? "linear" : "swiglu", dtype_name(DTYPES[wdi]),
                                     dtype_name(DTYPES[ai]), TOKEN_COUNTS[ti], E, k, H, F);
                            run_case(&L, ctx, rc, &cr, DTYPES[ai], TOKEN_COUNTS[ti], &stats, label);
                        }
                }
                colibri_moe_context_destroy(ctx);
                free(cr.logits_seen);
                layer_free(&L);
            }
    }
    /* the near-tie exclusion must leave most tokens compared, or the routing checks assert little */
    CHECK(stats.tokens_near_tie * 10 < stats.tokens_compared, "%d of %d tokens had near-ties",
          stats.tokens_near_tie, stats.tokens_compared);
    printf("matrix: worst normalised error fp32 %.2e (limit %.0e), fp16 %.2e (limit %.0e), bf16 %.2e (limit %.0e); "
           "%d of %d routed tokens skipped as near-ties\n",
           stats.worst[0], error_limit(COLIBRI_DTYPE_F32), stats.worst[1], error_limit(COLIBRI_DTYPE_F16),
           stats.worst[2], error_limit(COLIBRI_DTYPE_BF16), stats.tokens_near_tie, stats.tokens_compared);
}

/* ------------------------------------------------------------------------------------------------
 * dtype conversions, exhaustively, through a 1 x 1 LINEAR layer (y = w x)
 * ---------------------------------------------------------------------------------------------- */

static int same_value(double a, double b) { return (isnan(a) && isnan(b)) || a == b; }

static void test_conversions(void) {
    for (int di = 1; di < 3; di++) {
        const colibri_dtype_t d = DTYPES[di];
        double *value_of = malloc(0x10000 * sizeof *value_of);
        uint16_t *all = malloc(0x10000 * sizeof *all);
        for (uint32_t h = 0; h < 0x10000; h++) all[h] = (uint16_t)h, value_of[h] = decode(all, d, h);

        /* every finite 16-bit pattern as a weight: w * 1 = w, written as fp32 (the others are refused:
         * test_nonfinite_weights; here they become 0) */
        uint16_t *finite = malloc(0x10000 * sizeof *finite);
        for (uint32_t h = 0; h < 0x10000; h++) finite[h] = isfinite(value_of[h]) ? (uint16_t)h : 0;
        layer_t L;
        memset(&L, 0, sizeof L);
        L.cfg = (colibri_moe_config_t){.expert_kind = COLIBRI_EXPERT_LINEAR, .weight_dtype = d, .num_experts = 1, .top_k = 1,
                                       .hidden_size = 1, .intermediate_size = 0x10000, .routed_scaling_factor = 1.0f,
                                       .workspace_tokens = 0, .device = COLIBRI_DEVICE_CPU};
        uint64_t off = 0;
        colibri_moe_context_t *ctx = NULL;
        CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, finite, &off, 0x10000, NULL, NULL), COLIBRI_OK);
        float *out = malloc(0x10000 * sizeof *out), one = 1.0f, wt = 1.0f;
        int32_t id = 0;
        poison(out, COLIBRI_DTYPE_F32, 0x10000);
        CHECK_STATUS(colibri_moe_forward(ctx, 1, COLIBRI_DTYPE_F32, &one, &id, &wt, out, NULL), COLIBRI_OK);
        int bad = 0;
        for (uint32_t h = 0; h < 0x10000; h++) bad += !same_value(out[h], value_of[finite[h]]);
        free(finite);
        CHECK(bad == 0, "%s weights: %d of 65536 patterns decoded wrongly", dtype_name(d), bad);
        colibri_moe_context_destroy(ctx);

        /* every pattern as an input activation, through a 1 x 1 fp32 weight of 1: comes back unchanged */
        const float unit = 1.0f;
        L.cfg = (colibri_moe_config_t){.expert_kind = COLIBRI_EXPERT_LINEAR, .weight_dtype = COLIBRI_DTYPE_F32, .num_experts = 1, .top_k = 1,
                                       .hidden_size = 1, .intermediate_size = 1, .routed_scaling_factor = 1.0f,
                                       .workspace_tokens = 4096, .device = COLIBRI_DEVICE_CPU};
        CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, &unit, &off, 1, NULL, NULL), COLIBRI_OK);
        int32_t *ids = calloc(0x10000, sizeof *ids);
        float *wts = malloc(0x10000 * sizeof *wts);
        uint16_t *back = malloc(0x10000 * sizeof *back);
        for (int i = 0; i < 0x10000; i++) wts[i] = 1.0f;
        poison(back, d, 0x10000);
        CHECK_STATUS(colibri_moe_forward(ctx, 0x10000, d, all, ids, wts, back, NULL), COLIBRI_OK);
        bad = 0;
        for (uint32_t h = 0; h < 0x10000; h++) bad += !same_value(value_of[back[h]], value_of[h]);
        CHECK(bad == 0, "%s inputs: %d of 65536 patterns did not come back", dtype_name(d), bad);
        free(back);
        colibri_moe_context_destroy(ctx);

        /* outputs: fp32 values at, halfway between and just either side of the halfway point of every pair of
         * neighbouring 16-bit values, written by a LINEAR layer of F = n rows holding them as fp32 weights,
         * applied to x = 1. The result must be the nearest value, ties to the even pattern; past the largest
         * finite value, infinity. (NaN and infinities as outputs: the inputs' round trip above.) */
        float *vals = malloc(4 * 0x10000 * sizeof *vals);
        uint16_t *want = malloc(4 * 0x10000 * sizeof *want);
        int n = 0;
        for (uint32_t h = 0; h < 0x10000; h++) {
            if (!isfinite(value_of[h])) continue;
            vals[n] = (float)value_of[h], want[n++] = (uint16_t)h;
            if (h + 1 > 0xffff || isnan(value_of[h + 1])) continue;
            /* the largest finite value's upper neighbour is infinity: round up from max + half an ulp */
            const double upper = isinf(value_of[h + 1]) ? 2 * value_of[h] - value_of[h - 1] : value_of[h + 1];
            const float mid = (float)((value_of[h] + upper) / 2); /* exact: one bit more than 16-bit */
            vals[n] = mid, want[n++] = (uint16_t)(h & 1 ? h + 1 : h);
            vals[n] = nextafterf(mid, 0.0f), want[n++] = (uint16_t)h; /* toward zero: the smaller magnitude */
            vals[n] = nextafterf(mid, signbit(mid) ? -INFINITY : INFINITY), want[n++] = (uint16_t)(h + 1);
        }
        L.cfg = (colibri_moe_config_t){.expert_kind = COLIBRI_EXPERT_LINEAR, .weight_dtype = COLIBRI_DTYPE_F32, .num_experts = 1, .top_k = 1,
                                       .hidden_size = 1, .intermediate_size = n, .routed_scaling_factor = 1.0f,
                                       .workspace_tokens = 0, .device = COLIBRI_DEVICE_CPU};
        CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, vals, &off, (uint64_t)n, NULL, NULL), COLIBRI_OK);
        uint16_t x_one[2], *got = malloc((size_t)n * sizeof *got); /* room for an fp32 */
        encode_trunc(x_one, d, 0, 1.0);
        poison(got, d, (size_t)n);
        CHECK_STATUS(colibri_moe_forward(ctx, 1, d, x_one, &id, &wt, got, NULL), COLIBRI_OK);
        bad = 0;
        for (int i = 0; i < n; i++) {
            const double g = value_of[got[i]], v = value_of[want[i]];
            const int ok = got[i] == want[i] || (isnan(g) && isnan(v)) || (g == 0 && v == 0);
            if (!ok && bad++ < 5) printf("  %s output of %.9g: got 0x%04x, want 0x%04x\n", dtype_name(d), (double)vals[i], got[i], want[i]);
        }
        CHECK(bad == 0, "%s outputs: %d of %d values rounded wrongly", dtype_name(d), bad, n);
        free(got);
        free(want);
        free(vals);
        free(ids);
        free(wts);
        free(out);
        colibri_moe_context_destroy(ctx);
        free(value_of);
        free(all);
    }
}

/* ------------------------------------------------------------------------------------------------
 * fp8 e4m3 weights with scale grids
 * ---------------------------------------------------------------------------------------------- */

static int error_mentions(const char *word);

static void test_fp8(void) {
    /* every code but the NaN ones (refused: test_nonfinite_weights; 0 here) as a weight with per-channel
     * scales: out = fp32(value * scale) */
    {
        uint8_t all[256];
        float scale[256], out[256], one = 1.0f, wt = 1.0f;
        for (int i = 0; i < 256; i++) all[i] = (i & 0x7f) == 0x7f ? 0 : (uint8_t)i, scale[i] = i % 2 ? (float)uniform(0.01, 100) : 1.0f;
        colibri_moe_config_t c = {.expert_kind = COLIBRI_EXPERT_LINEAR, .weight_dtype = COLIBRI_DTYPE_F8E4M3,
                                  .num_experts = 1, .top_k = 1, .hidden_size = 1, .intermediate_size = 256,
                                  .routed_scaling_factor = 1.0f, .device = COLIBRI_DEVICE_CPU, .scale_block_n = 1};
        uint64_t off = 0;
        int32_t id = 0;
        colibri_moe_weights_t w;
        memset(&w, 0, sizeof w);
        w.expert_weights = all, w.expert_offsets = &off, w.expert_weights_numel = 256, w.expert_scales = scale;
        colibri_moe_context_t *ctx = NULL;
        CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_OK);
        poison(out, COLIBRI_DTYPE_F32, 256);
        if (ctx) CHECK_STATUS(colibri_moe_forward(ctx, 1, COLIBRI_DTYPE_F32, &one, &id, &wt, out, NULL), COLIBRI_OK);
        int bad = 0;
        for (int i = 0; i < 256; i++) bad += !same_value(out[i], (double)(float)(f8_to_double(all[i]) * scale[i]));
        CHECK(bad == 0, "fp8 weights: %d of 256 codes decoded or scaled wrongly", bad);
        CHECK(isnan(f8_to_double(0x7f)) && f8_to_double(0x7e) == 448 && f8_to_double(0x01) == 0x1p-9 &&
                  f8_to_double(0xb8) == -1.0, "the test's own fp8 decoding");
        colibri_moe_context_destroy(ctx);
    }

    /* layers of every scale layout (blocks that do and do not divide H and F; shapes with a partial
     * block) against the float64 reference of the dequantised weights: the CPU is exact to fp32 */
    static const struct { int bn, bk, H, F; } layouts[] = {
        {128, 128, 200, 256}, {16, 32, 96, 64}, {1, 0, 72, 40}, {0, 0, 64, 48}, {0, 24, 100, 48}, {5, 0, 64, 45},
    };
    const int quick = getenv("COLIBRI_TEST_QUICK") != NULL;
    static const int tokens[] = {1, 7, 64, 513};
    const colibri_dtype_t acts[] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F16};
    matrix_stats_t stats = {{0, 0, 0}, 0, 0};
    for (size_t li = 0; li < sizeof layouts / sizeof layouts[0]; li++)
        for (int kind = 0; kind < 2; kind++) {
            /* SWIGLU: DeepSeek-V3's routing with groups and a shared expert, or given ids with biases and a
             * gated shared expert; LINEAR: softmax top-k */
            const routing_case_t *rc = &ROUTING_CASES[kind ? 1 : li % 2 ? 9 : 12];
            const int features = kind ? 0 : rc->features, n_group = features & F_GROUPS ? 2 : 0;
            const int E = n_group ? 6 : 5, k = 2, H = layouts[li].H, F = layouts[li].F;
            layer_t L;
            const int router = rc->source != GIVEN_IDS;
            layer_make(&L, (colibri_expert_kind_t)kind, COLIBRI_DTYPE_F8E4M3, E, k, H, F, router,
                       rc->routing == COLIBRI_ROUTING_SIGMOID_BIAS);
            L.cfg.routing = rc->routing;
            L.cfg.renormalize = rc->renormalize;
            L.cfg.routed_scaling_factor = rc->scaling;
            layer_add_features(&L, features, n_group);
            layer_scale_fp8(&L, layouts[li].bn, layouts[li].bk);
            colibri_moe_context_t *ctx = NULL;
            CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_OK);
            for (int ai = 0; ctx && ai < 3; ai++)
                for (size_t ti = 0; ti < sizeof tokens / sizeof tokens[0] - quick; ti++) {
                    char label[200];
                    snprintf(label, sizeof label, "[fp8 blocks (%d, %d), %s, %s, act %s, T=%d, E=%d k=%d H=%d F=%d Fs=%d]",
                             layouts[li].bn, layouts[li].bk, rc->name, kind ? "linear" : "swiglu",
                             dtype_name(acts[ai]), tokens[ti], E, k, H, F, L.cfg.shared_intermediate_size);
                    run_case(&L, ctx, rc, NULL, acts[ai], tokens[ti], &stats, label);
                }
            colibri_moe_context_destroy(ctx);
            layer_free(&L);
        }
    printf("fp8: worst normalised error fp32 %.2e (limit %.0e), fp16 %.2e, bf16 %.2e\n", stats.worst[0],
           error_limit(COLIBRI_DTYPE_F32), stats.worst[1], stats.worst[2]);

    /* bad input: each refused with a message that names it */
    layer_t L;
    layer_make(&L, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_F8E4M3, 4, 2, 64, 48, 1, 0);
    layer_scale_fp8(&L, 16, 16);
    colibri_moe_context_t *ctx = NULL;
    colibri_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.expert_weights = L.weights, w.expert_offsets = L.offsets, w.expert_weights_numel = L.numel, w.router_weight = L.router;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &L.cfg, &w), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("expert_scales"), "%s", colibri_last_error());
    w.expert_scales = L.scales;
    L.scales[5] = INFINITY;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &L.cfg, &w), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("expert_scales[5]"), "%s", colibri_last_error());
    L.scales[5] = 1.0f;
    colibri_moe_config_t c = L.cfg;
    c.scale_block_k = -1;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("scale_block"), "%s", colibri_last_error());
    c = L.cfg;
    c.shared_intermediate_size = 100; /* wider than F = 48, which is not a multiple of the 16 x 32 blocks */
    c.scale_block_k = 32;
    w.shared_weights = L.weights, w.shared_scales = L.scales;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_ERR_UNSUPPORTED);
    CHECK(error_mentions("multiple of the scale block"), "%s", colibri_last_error());
    c = L.cfg;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_ERR_INVALID_ARGUMENT); /* shared given, unused */
    CHECK(error_mentions("shared_weights"), "%s", colibri_last_error());
    w.shared_weights = NULL;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("shared_scales"), "%s", colibri_last_error());
    w.shared_scales = NULL;
    c.weight_dtype = COLIBRI_DTYPE_BF16; /* scales for weights that are not fp8 */
    CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("scale_block"), "%s", colibri_last_error());
    c.scale_block_n = c.scale_block_k = 0;
    CHECK_STATUS(colibri_moe_context_create(&ctx, &c, &w), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("expert_scales"), "%s", colibri_last_error());
    CHECK(ctx == NULL, "a refused create left a context");
    CHECK_STATUS(colibri_moe_context_create(&ctx, &L.cfg, &w), COLIBRI_OK);
    float x[64] = {0}, out[64];
    int32_t ids[2] = {0, 1};
    float wts[2] = {0.5f, 0.5f};
    if (ctx) {
        CHECK_STATUS(colibri_moe_forward(ctx, 1, COLIBRI_DTYPE_F8E4M3, x, ids, wts, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
        CHECK(error_mentions("act_dtype"), "%s", colibri_last_error());
        CHECK_STATUS(colibri_moe_route(ctx, 1, COLIBRI_DTYPE_F8E4M3, x, ids, wts, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    }
    colibri_moe_context_destroy(ctx);
    layer_free(&L);
}

/* ------------------------------------------------------------------------------------------------
 * chunking, determinism and thread counts, expert counters
 * ---------------------------------------------------------------------------------------------- */

/* Forwards T tokens of input x (act) through a fresh context of L with the given workspace and
 * threads, ids NULL for the built-in router; returns the output (to free). */
static void *forward_with(layer_t *L, int workspace, int threads, colibri_dtype_t act, int T, const void *x,
                          const int32_t *ids, const float *w) {
    L->cfg.workspace_tokens = workspace;
    L->cfg.num_threads = threads;
    colibri_moe_context_t *ctx = NULL;
    void *out = malloc((size_t)T * L->out * colibri_dtype_size(act));
    poison(out, act, (size_t)T * L->out);
    CHECK_STATUS(layer_init(L, &ctx), COLIBRI_OK);
    if (ctx) CHECK_STATUS(colibri_moe_forward(ctx, T, act, x, ids, w, out, NULL), COLIBRI_OK);
    colibri_moe_context_destroy(ctx);
    return out;
}

static void test_chunking_and_determinism(void) {
    const int T = 64;
    /* Variant 2 is bf16 x bf16 with E = k = 2, so both experts get all 64 tokens: whole forwards take
     * the token-lane kernel (>= 32 tokens per expert) while chunks of 5 take the row kernel, and the
     * two must agree bit for bit. */
    for (int variant = 0; variant < 3; variant++) {
        layer_t L;
        const colibri_dtype_t act = variant == 2 ? COLIBRI_DTYPE_BF16 : variant ? COLIBRI_DTYPE_F16 : COLIBRI_DTYPE_F32;
        if (variant == 0) layer_make(&L, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, 8, 2, 100, 72, 1, 0);
        else if (variant == 1) layer_make(&L, COLIBRI_EXPERT_LINEAR, COLIBRI_DTYPE_F16, 6, 3, 70, 45, 1, 1);
        else layer_make(&L, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, 2, 2, 100, 72, 1, 0);
        L.cfg.routing = variant == 1 ? COLIBRI_ROUTING_SIGMOID_BIAS : COLIBRI_ROUTING_SOFTMAX_TOPK;
        L.cfg.renormalize = 1;
        const size_t out_bytes = (size_t)T * L.out * colibri_dtype_size(act);
        void *x = malloc((size_t)T * L.cfg.hidden_size * colibri_dtype_size(act));
        double *xd = malloc((size_t)T * L.cfg.hidden_size * sizeof *xd);
        random_input(x, xd, act, T, L.cfg.hidden_size);
        int32_t *ids = malloc((size_t)T * L.cfg.top_k * sizeof *ids);
        float *w = malloc((size_t)T * L.cfg.top_k * sizeof *w);
        for (int i = 0; i < T * L.cfg.top_k; i++) ids[i] = randint(0, L.cfg.num_experts - 1), w[i] = (float)uniform(-1, 1);
        for (int given = 0; given < 2; given++) {
            const int32_t *gi = given ? ids : NULL;
            const float *gw = given ? w : NULL;
            void *base = forward_with(&L, 0, 0, act, T, x, gi, gw);
            const int workspaces[] = {5, 1, 64}, threads[] = {1, 2, 3};
            for (int i = 0; i < 3; i++) {
                void *chunked = forward_with(&L, workspaces[i], 0, act, T, x, gi, gw);
                CHECK(memcmp(base, chunked, out_bytes) == 0, "variant %d given %d: workspace_tokens %d changes the output",
                      variant, given, workspaces[i]);
                free(chunked);
                void *threaded = forward_with(&L, 0, threads[i], act, T, x, gi, gw);
                CHECK(memcmp(base, threaded, out_bytes) == 0, "variant %d given %d: num_threads %d changes the output",
                      variant, given, threads[i]);
                free(threaded);
            }
            /* two runs on one context */
            L.cfg.workspace_tokens = 0;
            L.cfg.num_threads = 0;
            colibri_moe_context_t *ctx = NULL;
            CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_OK);
            void *again = malloc(out_bytes);
            for (int run = 0; run < 2 && ctx; run++) {
                poison(again, act, (size_t)T * L.out);
                CHECK_STATUS(colibri_moe_forward(ctx, T, act, x, gi, gw, again, NULL), COLIBRI_OK);
                CHECK(memcmp(base, again, out_bytes) == 0, "variant %d given %d: run %d differs", variant, given, run);
            }
            colibri_moe_context_destroy(ctx);
            free(again);
            free(base);
        }
        free(x), free(xd), free(ids), free(w);
        layer_free(&L);
    }
}

static void test_expert_counts(void) {
    layer_t L;
    layer_make(&L, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_F32, 5, 2, 64, 32, 1, 0);
    L.cfg.workspace_tokens = 7; /* counts must add up over chunks */
    colibri_moe_context_t *ctx = NULL;
    CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_OK);
    if (!ctx) { layer_free(&L); return; }
    const int T = 40, k = 2, E = 5;
    float *x = malloc((size_t)T * 64 * sizeof *x), *out = malloc((size_t)T * 64 * sizeof *out), w[80];
    double *xd = malloc((size_t)T * 64 * sizeof *xd);
    int32_t ids[80], routed[80];
    uint64_t counts[5], want[5] = {0};
    random_input(x, xd, COLIBRI_DTYPE_F32, T, 64);
    CHECK_STATUS(colibri_moe_context_expert_counts(ctx, counts, 0), COLIBRI_OK);
    CHECK(counts[0] + counts[1] + counts[2] + counts[3] + counts[4] == 0, "a new context has non-zero counts");
    for (int i = 0; i < T * k; i++) ids[i] = i % 3 == 0 ? 4 : randint(0, 3), w[i] = 0.5f, want[ids[i]]++;
    CHECK_STATUS(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_OK);
    CHECK_STATUS(colibri_moe_route(ctx, T, COLIBRI_DTYPE_F32, x, routed, w, NULL), COLIBRI_OK); /* not counted */
    CHECK_STATUS(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, NULL, NULL, out, NULL), COLIBRI_OK);
    for (int i = 0; i < T * k; i++) want[routed[i]]++;
    CHECK_STATUS(colibri_moe_context_expert_counts(ctx, counts, 1), COLIBRI_OK);
    for (int e = 0; e < E; e++)
        CHECK(counts[e] == want[e], "expert %d counted %llu, want %llu", e, (unsigned long long)counts[e],
              (unsigned long long)want[e]);
    CHECK_STATUS(colibri_moe_context_expert_counts(ctx, counts, 0), COLIBRI_OK);
    CHECK(counts[0] + counts[1] + counts[2] + counts[3] + counts[4] == 0, "reset left counts");
    colibri_moe_context_destroy(ctx);
    free(x), free(out), free(xd);
    layer_free(&L);
}

/* ------------------------------------------------------------------------------------------------
 * bad input: every refusal returns the right status, says why, and leaves the output untouched
 * ---------------------------------------------------------------------------------------------- */

static int error_mentions(const char *word) { return strstr(colibri_last_error(), word) != NULL; }

static int still_poisoned(const float *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isnan(out[i])) return 0;
    return 1;
}

static void expect_bad_config(const layer_t *base, void (*mutate)(colibri_moe_config_t *), const char *word) {
    layer_t L = *base;
    mutate(&L.cfg);
    colibri_moe_context_t *ctx = (colibri_moe_context_t *)&L; /* must be overwritten with NULL */
    CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(ctx == NULL, "a failed init left *out_ctx set");
    CHECK(error_mentions(word), "message \"%s\" does not mention %s", colibri_last_error(), word);
}

static void top_k_zero(colibri_moe_config_t *c) { c->top_k = 0; }
static void top_k_above_e(colibri_moe_config_t *c) { c->top_k = c->num_experts + 1; }
static void no_experts(colibri_moe_config_t *c) { c->num_experts = 0; }
static void too_many_experts(colibri_moe_config_t *c) { c->num_experts = COLIBRI_MAX_EXPERTS + 1, c->top_k = 1; }
static void hidden_zero(colibri_moe_config_t *c) { c->hidden_size = 0; }
static void intermediate_negative(colibri_moe_config_t *c) { c->intermediate_size = -3; }
static void unknown_kind(colibri_moe_config_t *c) { c->expert_kind = (colibri_expert_kind_t)7; }
static void unknown_wdtype(colibri_moe_config_t *c) { c->weight_dtype = (colibri_dtype_t)9; }
static void unknown_routing(colibri_moe_config_t *c) { c->routing = (colibri_routing_t)5; }
static void unknown_device(colibri_moe_config_t *c) { c->device = (colibri_device_t)4; }
static void renormalize_two(colibri_moe_config_t *c) { c->renormalize = 2; }
static void scaling_zero(colibri_moe_config_t *c) { c->routed_scaling_factor = 0.0f; }
static void scaling_negative(colibri_moe_config_t *c) { c->routed_scaling_factor = -1.0f; }
static void scaling_nan(colibri_moe_config_t *c) { c->routed_scaling_factor = NAN; }
static void scaling_inf(colibri_moe_config_t *c) { c->routed_scaling_factor = INFINITY; }
static void workspace_negative(colibri_moe_config_t *c) { c->workspace_tokens = -1; }
static void threads_negative(colibri_moe_config_t *c) { c->num_threads = -2; }
static void sigmoid_without_bias(colibri_moe_config_t *c) { c->routing = COLIBRI_ROUTING_SIGMOID_BIAS; }

static void test_bad_input(void) {
    layer_t L;
    layer_make(&L, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, 4, 2, 64, 48, 1, 0);
    const int T = 6, H = 64, k = 2, E = 4;
    colibri_moe_context_t *ctx = NULL;

    /* init */
    CHECK_STATUS(colibri_moe_context_init(NULL, &L.cfg, L.weights, L.offsets, L.numel, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_context_init(&ctx, NULL, L.weights, L.offsets, L.numel, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, NULL, L.offsets, L.numel, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("expert_weights"), "%s", colibri_last_error());
    CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, L.weights, NULL, L.numel, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    expect_bad_config(&L, top_k_zero, "top_k");
    expect_bad_config(&L, top_k_above_e, "top_k");
    expect_bad_config(&L, no_experts, "num_experts");
    expect_bad_config(&L, too_many_experts, "num_experts");
    /* colibri_moe_config_check: the config alone, as create checks it */
    CHECK_STATUS(colibri_moe_config_check(&L.cfg), COLIBRI_OK);
    CHECK_STATUS(colibri_moe_config_check(NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    {
        colibri_moe_config_t c = L.cfg;
        c.top_k = 0;
        CHECK_STATUS(colibri_moe_config_check(&c), COLIBRI_ERR_INVALID_ARGUMENT);
        CHECK(error_mentions("config.top_k"), "%s", colibri_last_error());
        c = L.cfg, c.n_group = 3; /* does not divide E = 4 */
        CHECK_STATUS(colibri_moe_config_check(&c), COLIBRI_ERR_INVALID_ARGUMENT);
        CHECK(error_mentions("n_group"), "%s", colibri_last_error());
    }
    expect_bad_config(&L, hidden_zero, "hidden_size");
    expect_bad_config(&L, intermediate_negative, "intermediate_size");
    expect_bad_config(&L, unknown_kind, "expert_kind");
    expect_bad_config(&L, unknown_wdtype, "weight_dtype");
    expect_bad_config(&L, unknown_routing, "routing");
    expect_bad_config(&L, unknown_device, "device");
    expect_bad_config(&L, renormalize_two, "renormalize");
    expect_bad_config(&L, scaling_zero, "routed_scaling_factor");
    expect_bad_config(&L, scaling_negative, "routed_scaling_factor");
    expect_bad_config(&L, scaling_nan, "routed_scaling_factor");
    expect_bad_config(&L, scaling_inf, "routed_scaling_factor");
    expect_bad_config(&L, workspace_negative, "workspace_tokens");
    expect_bad_config(&L, threads_negative, "num_threads");
    expect_bad_config(&L, sigmoid_without_bias, "router_bias");

    /* experts that do not fit in the buffer */
    CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, L.weights, L.offsets, L.numel - 1, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(ctx == NULL && error_mentions("does not fit"), "%s", colibri_last_error());
    const uint64_t saved = L.offsets[1];
    L.offsets[1] = UINT64_MAX - 5; /* offset + size overflows */
    CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, L.weights, L.offsets, L.numel, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    L.offsets[1] = saved;

    /* a router with a NaN */
    L.router[3] = NAN;
    CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(ctx == NULL && error_mentions("router_weight"), "%s", colibri_last_error());
    L.router[3] = 0.25f;

    /* a CUDA context where CUDA was not built */
    if (!colibri_cuda_built()) {
        L.cfg.device = COLIBRI_DEVICE_CUDA;
        CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_ERR_UNSUPPORTED);
        CHECK(ctx == NULL && error_mentions("CUDA"), "%s", colibri_last_error());
        CHECK(colibri_cuda_device_count() == 0, "no CUDA backend, yet %d devices", colibri_cuda_device_count());
        L.cfg.device = COLIBRI_DEVICE_CPU;
    } else if (colibri_cuda_device_count() == 0) { /* built with CUDA, run where there is no GPU */
        L.cfg.device = COLIBRI_DEVICE_CUDA;
        const colibri_status_t st = layer_init(&L, &ctx);
        CHECK(st != COLIBRI_OK && ctx == NULL && colibri_last_error()[0] != '\0',
              "a CUDA context without a GPU: %s, \"%s\"", colibri_status_string(st), colibri_last_error());
        L.cfg.device = COLIBRI_DEVICE_CPU;
    }

    /* forward and route on a good context */
    CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_OK);
    if (!ctx) { layer_free(&L); return; }
    float x[6 * 64], out[6 * 64], w[12];
    int32_t ids[12];
    uint64_t counts[4];
    for (int i = 0; i < T * H; i++) x[i] = (float)uniform(-1, 1);
    for (int i = 0; i < T * k; i++) ids[i] = i % E, w[i] = 0.5f;
#define EXPECT_UNTOUCHED(call, status, word)                                                              \
    do {                                                                                                   \
        poison(out, COLIBRI_DTYPE_F32, (size_t)T * H);                                                     \
        CHECK_STATUS(call, status);                                                                        \
        CHECK(still_poisoned(out, (size_t)T * H), "%s wrote the output", #call);                           \
        CHECK(error_mentions(word), "message \"%s\" does not mention %s", colibri_last_error(), word);     \
    } while (0)
    EXPECT_UNTOUCHED(colibri_moe_forward(NULL, T, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "ctx");
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, NULL, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "input");
    CHECK_STATUS(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK(error_mentions("output"), "%s", colibri_last_error());
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, -1, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "num_tokens");
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, (colibri_dtype_t)3, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "act_dtype");
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, NULL, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "together");
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, NULL, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "together");
    CHECK_STATUS(colibri_moe_forward(ctx, 0, COLIBRI_DTYPE_F32, NULL, NULL, NULL, NULL, NULL), COLIBRI_OK);
    ids[T * k - 1] = E; /* the last id: nothing may be written before the check */
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "out of range");
    ids[T * k - 1] = -1;
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "out of range");
    ids[T * k - 1] = 0;
    w[5] = NAN;
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "not finite");
    w[5] = -INFINITY;
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "not finite");
    w[5] = 0.5f;
    CHECK_STATUS(colibri_moe_route(ctx, T, COLIBRI_DTYPE_F32, x, NULL, w, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_route(ctx, T, COLIBRI_DTYPE_F32, x, ids, NULL, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_route(ctx, T, COLIBRI_DTYPE_F32, NULL, ids, w, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_route(NULL, T, COLIBRI_DTYPE_F32, x, ids, w, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_context_expert_counts(ctx, NULL, 0), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_context_expert_counts(ctx, counts, 2), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_context_expert_counts(NULL, counts, 0), COLIBRI_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(colibri_moe_context_take_device_error(ctx), COLIBRI_OK);
    colibri_moe_context_destroy(ctx);
    colibri_moe_context_destroy(NULL);

    /* no routing source: no router, no routing_fn, no ids */
    CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, L.weights, L.offsets, L.numel, NULL, NULL), COLIBRI_OK);
    EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, NULL, NULL, out, NULL), COLIBRI_ERR_INVALID_ARGUMENT, "routing");
    CHECK_STATUS(colibri_moe_route(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, NULL), COLIBRI_ERR_INVALID_ARGUMENT);
    colibri_moe_context_destroy(ctx);

    /* a routing_fn that misbehaves: COLIBRI_ERR_ROUTING, output untouched */
    custom_router_t cr = {E, k, COLIBRI_DTYPE_F32, 0, 0, 0, 0, NULL, 0};
    custom_hidden_size = H;
    L.cfg.routing_fn = custom_route;
    L.cfg.routing_user_data = &cr;
    CHECK_STATUS(colibri_moe_context_init(&ctx, &L.cfg, L.weights, L.offsets, L.numel, NULL, NULL), COLIBRI_OK);
    const char *why[] = {"", "out of range", "not finite", "routing_fn failed"};
    for (cr.misbehave = 1; cr.misbehave <= 3 && ctx; cr.misbehave++) {
        EXPECT_UNTOUCHED(colibri_moe_forward(ctx, T, COLIBRI_DTYPE_F32, x, NULL, NULL, out, NULL), COLIBRI_ERR_ROUTING,
                         why[cr.misbehave]);
        CHECK_STATUS(colibri_moe_route(ctx, T, COLIBRI_DTYPE_F32, x, ids, w, NULL), COLIBRI_ERR_ROUTING);
    }
    CHECK_STATUS(colibri_moe_context_expert_counts(ctx, counts, 0), COLIBRI_OK);
    CHECK(counts[0] + counts[1] + counts[2] + counts[3] == 0, "failed forwards were counted");
    colibri_moe_context_destroy(ctx);
    layer_free(&L);
#undef EXPECT_UNTOUCHED
}

/* Non-finite weights: colibri_first_nonfinite on buffers around its block size, aligned or not, and
 * colibri_moe_context_create refusing a NaN or an infinity in any matrix of an expert or the shared
 * expert, named by expert, matrix, row and column. */
/* Writes a non-finite weight i as its bits (which: 0 NaN, 1 +Inf, 2 -Inf; fp8 has only NaN codes), any
 * alignment. */
static void put_nonfinite(void *p, colibri_dtype_t d, size_t i, int which) {
    const uint32_t f32[3] = {0x7fc00000u, 0x7f800000u, 0xff800000u};
    const uint16_t f16[3] = {0x7e00, 0x7c00, 0xfc00}, bf16[3] = {0x7fc0, 0x7f80, 0xff80};
    const uint8_t f8[3] = {0x7f, 0xff, 0x7f};
    const void *bits = d == COLIBRI_DTYPE_F32 ? (const void *)&f32[which] : d == COLIBRI_DTYPE_F16 ? (const void *)&f16[which]
                     : d == COLIBRI_DTYPE_BF16 ? (const void *)&bf16[which] : (const void *)&f8[which];
    memcpy((char *)p + i * colibri_dtype_size(d), bits, colibri_dtype_size(d));
}

static void test_nonfinite_weights(void) {
    const colibri_dtype_t dtypes[] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F8E4M3};
    const uint64_t sizes[] = {1, 7, 65535, 65536, 65537, 3 * 65536 + 7};
    for (int d = 0; d < 4; d++) {
        const colibri_dtype_t dt = dtypes[d];
        const size_t es = colibri_dtype_size(dt);
        for (int s = 0; s < 6; s++)
            for (int misalign = 0; misalign < 2; misalign++) {
                const uint64_t n = sizes[s];
                unsigned char *raw = malloc((size_t)(n + 1) * es), *values = malloc((size_t)n * es);
                unsigned char *buf = raw + (misalign ? 1 : 0);
                for (uint64_t i = 0; i < n; i++) encode_trunc(values, dt, i, uniform(-448, 448));
                memcpy(buf, values, (size_t)n * es);
                free(values);
                CHECK(colibri_first_nonfinite(dt, buf, n) == n, "dtype %d n=%llu: all finite, got %llu", (int)dt,
                      (unsigned long long)n, (unsigned long long)colibri_first_nonfinite(dt, buf, n));
                /* two bad values: the first must be found, whichever block each is in */
                const uint64_t first = (uint64_t)randint(0, (int32_t)(n - 1)), later = first + (n - first) / 2;
                put_nonfinite(buf, dt, later, 0);
                put_nonfinite(buf, dt, first, randint(0, 2));
                CHECK(colibri_first_nonfinite(dt, buf, n) == first, "dtype %d n=%llu misaligned=%d: first at %llu, got %llu",
                      (int)dt, (unsigned long long)n, misalign, (unsigned long long)first,
                      (unsigned long long)colibri_first_nonfinite(dt, buf, n));
                free(raw);
            }
        /* the largest finite values are finite: 448 (fp8 0x7e), 65504 (fp16), FLT_MAX (f32, bf16 0x7f7f) */
        unsigned char edge[8] = {0};
        if (dt == COLIBRI_DTYPE_F8E4M3) edge[0] = 0x7e, edge[1] = 0xfe;
        if (dt == COLIBRI_DTYPE_F16) edge[0] = 0xff, edge[1] = 0x7b, edge[2] = 0xff, edge[3] = 0xfb;
        if (dt == COLIBRI_DTYPE_BF16) edge[0] = 0x7f, edge[1] = 0x7f, edge[2] = 0x7f, edge[3] = 0xff;
        if (dt == COLIBRI_DTYPE_F32) edge[0] = 0xff, edge[1] = 0xff, edge[2] = 0x7f, edge[3] = 0x7f;
        const uint64_t edges = dt == COLIBRI_DTYPE_F32 ? 1 : 2;
        CHECK(colibri_first_nonfinite(dt, edge, edges) == edges, "dtype %d: the largest finite value refused", (int)dt);
    }

    const char *matrices[2][3] = {{"gate", "up", "down"}, {"w", "w", "w"}};
    for (int d = 0; d < 4; d++)
        for (int kind = 0; kind < 2; kind++)
            for (int m = 0; m < (kind ? 1 : 3); m++)
                for (int shared = 0; shared < (kind ? 1 : 2); shared++) {
                    const colibri_dtype_t dt = dtypes[d];
                    const colibri_expert_kind_t ek = kind ? COLIBRI_EXPERT_LINEAR : COLIBRI_EXPERT_SWIGLU;
                    const int E = 4, H = 24, F = 16;
                    layer_t L;
                    layer_make(&L, ek, dt, E, 2, H, F, 1, 0);
                    if (shared) layer_add_features(&L, F_SHARED, 1);
                    if (dt == COLIBRI_DTYPE_F8E4M3) layer_scale_fp8(&L, 0, 0);
                    colibri_moe_context_t *ctx = NULL;
                    CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_OK);
                    colibri_moe_context_destroy(ctx);
                    ctx = NULL;
                    /* one bad weight at a random place of matrix m of a random expert (or of the shared expert) */
                    const int Fm = shared ? L.cfg.shared_intermediate_size : F, e = randint(0, E - 1);
                    const int rows = m == 2 ? H : Fm, cols = m == 2 ? Fm : H, r = randint(0, rows - 1), col = randint(0, cols - 1);
                    const uint64_t at = (uint64_t)m * Fm * H + (uint64_t)r * cols + col;
                    void *target = shared ? L.shared : L.weights;
                    const uint64_t index = shared ? at : L.offsets[e] + at;
                    put_nonfinite(target, dt, index, randint(0, 2));
                    CHECK_STATUS(layer_init(&L, &ctx), COLIBRI_ERR_INVALID_ARGUMENT);
                    char want[96];
                    if (shared) snprintf(want, sizeof want, "the shared expert's %s [%d, %d] is ", matrices[kind][m], r, col);
                    else snprintf(want, sizeof want, "expert %d's %s [%d, %d] is ", e, matrices[kind][m], r, col);
                    CHECK(ctx == NULL && error_mentions(want), "dtype %d: want \"%s\", got \"%s\"", (int)dt, want,
                          colibri_last_error());
                    layer_free(&L);
                }
}

static void test_strings(void) {
    const colibri_status_t all[] = {COLIBRI_OK, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_UNSUPPORTED,
                                    COLIBRI_ERR_CUDA, COLIBRI_ERR_ROUTING, COLIBRI_ERR_INTERNAL};
    for (int i = 0; i < 7; i++)
        for (int j = 0; j < i; j++)
            CHECK(strcmp(colibri_status_string(all[i]), colibri_status_string(all[j])) != 0, "statuses %d and %d share a name", i, j);
    CHECK(strcmp(colibri_status_string(COLIBRI_OK), "ok") == 0, "%s", colibri_status_string(COLIBRI_OK));
    CHECK(strstr(colibri_status_string(COLIBRI_ERR_ROUTING), "routing") != NULL, "%s", colibri_status_string(COLIBRI_ERR_ROUTING));
    CHECK(strcmp(colibri_status_string((colibri_status_t)99), "unknown status") == 0, "%s", colibri_status_string((colibri_status_t)99));
    CHECK(strcmp(colibri_version(), COLIBRI_VERSION_STRING) == 0, "version %s", colibri_version());
    CHECK(colibri_dtype_size(COLIBRI_DTYPE_F32) == 4 && colibri_dtype_size(COLIBRI_DTYPE_BF16) == 2 &&
              colibri_dtype_size(COLIBRI_DTYPE_F16) == 2 && colibri_dtype_size(COLIBRI_DTYPE_F8E4M3) == 1 &&
              colibri_dtype_size((colibri_dtype_t)5) == 0, "dtype sizes");
    CHECK(colibri_expert_numel(COLIBRI_EXPERT_SWIGLU, 3, 5) == 45 && colibri_expert_numel(COLIBRI_EXPERT_LINEAR, 3, 5) == 15 &&
              colibri_expert_numel(COLIBRI_EXPERT_LINEAR, 0, 5) == 0, "expert_numel");
}

int main(int argc, char **argv) {
    const uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    rng_state = seed ? seed : 1;
    printf("test_moe_cpu: seed %llu (rerun with: test_moe_cpu %llu)\n", (unsigned long long)seed, (unsigned long long)seed);
    const clock_t start = clock();
    test_strings();
    test_bad_input();
    test_nonfinite_weights();
    test_conversions();
    test_expert_counts();
    test_chunking_and_determinism();
    test_fp8();
    test_matrix();
    printf("test_moe_cpu: %d checks, %d failed (%.1f s CPU)\n", checks, failures, (double)(clock() - start) / CLOCKS_PER_SEC);
    return failures ? 1 : 0;
}
