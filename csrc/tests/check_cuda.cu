/*
 * check_cuda.cu — the CUDA backend's correctness harness, through the public API only: every routing x
 * expert kind x weight and activation dtype x T on fresh random inputs against float64 (errors normalised
 * by max|reference|, bounded per dtype; outputs poisoned with NaN first, non-finite fails), plus bitwise
 * determinism, graph replay, ids out of range, expert counters, chunking and back-to-back forwards, and
 * the layer features (feature_cases: logit bias, group limit, expert biases, SWIGLU_OAI, shared expert)
 * and fp8 weights (fp8_cases: block, channel and tensor scales, against the dequantised weights).
 * Shapes reach every kernel path: gemv, each tensor-core tile height, 128-row wgmma tiles and folds.
 *   make test-cuda      (--quick; CUDA_HARNESS_ARGS= runs all of it; exit status 0 only if all passed)
 *   COLIBRI_CHECK_ONLY=text runs the cases whose name contains text; COLIBRI_CUDA_NO_WS=1 (read by the
 *   library) puts the 128-row tiles on wgmma_kernel rather than wgmma_ws_kernel.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <random>
#include <vector>

#include "colibri.h"

static int failures = 0, checks = 0;

/* COLIBRI_CHECK_ONLY=text: only the cases whose name contains it (e.g. " T=64 " for a sanitizer run
 * of a few cases). The cases skipped draw no random numbers, so the others' inputs differ from a full run. */
static bool case_skipped(const char *name) {
    const char *only = getenv("COLIBRI_CHECK_ONLY");
    return only && *only && !strstr(name, only);
}

#define CUDA_OK(call)                                                                                   \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));       \
            exit(2);                                                                                   \
        }                                                                                              \
    } while (0)
#define COL_OK(call)                                                                                    \
    do {                                                                                               \
        colibri_status_t s_ = (call);                                                                  \
        if (s_ != COLIBRI_OK) {                                                                        \
            fprintf(stderr, "%s:%d %s: %s: %s\n", __FILE__, __LINE__, #call, colibri_status_string(s_),   \
                    colibri_last_error());                                                             \
            exit(2);                                                                                   \
        }                                                                                              \
    } while (0)

static void expect(bool ok, const char *what) {
    checks++;
    if (!ok) {
        failures++;
        printf("FAIL %s\n", what);
    }
}

static const char *dtype_name(colibri_dtype_t d) {
    return d == COLIBRI_DTYPE_F32 ? "f32" : d == COLIBRI_DTYPE_F16 ? "f16" : d == COLIBRI_DTYPE_BF16 ? "bf16" : "f8";
}

/* Rounds v to dtype d and stores it at buf[i]; returns the stored value as a double. */
static double put(void *buf, colibri_dtype_t d, size_t i, double v) {
    switch (d) {
    case COLIBRI_DTYPE_F32: ((float *)buf)[i] = (float)v; return ((float *)buf)[i];
    case COLIBRI_DTYPE_F16: ((__half *)buf)[i] = __float2half((float)v); return __half2float(((__half *)buf)[i]);
    case COLIBRI_DTYPE_BF16:
        ((__nv_bfloat16 *)buf)[i] = __float2bfloat16((float)v);
        return __bfloat162float(((__nv_bfloat16 *)buf)[i]);
    }
    return 0;
}
static double get(const void *buf, colibri_dtype_t d, size_t i) {
    switch (d) {
    case COLIBRI_DTYPE_F32: return ((const float *)buf)[i];
    case COLIBRI_DTYPE_F16: return __half2float(((const __half *)buf)[i]);
    case COLIBRI_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)buf)[i]);
    }
    return 0;
}

/* Normalised error bound for the coarser of the two dtypes (bf16 keeps 8 bits, fp16 11). fp8 weights
 * as bf16: their dequantised values are exact in the fp32 products, but inter and y are bf16. */
static double limit_for(colibri_dtype_t w, colibri_dtype_t a) {
    auto one = [](colibri_dtype_t d) {
        return d == COLIBRI_DTYPE_BF16 || d == COLIBRI_DTYPE_F8E4M3 ? 2e-2 : d == COLIBRI_DTYPE_F16 ? 4e-3 : 2e-5;
    };
    return std::max(one(w), one(a));
}

struct Shape {
    int E, k, H, F;
    bool router_bf16; /* router weights that bf16 holds exactly (a checkpoint's bf16 router, upcast) */
    int bn = 0, bk = 0; /* fp8 weights: the scale blocks (colibri.h; 0 = the whole dimension) */
};

/* fp8 weights on the fp8 tensor cores (sm90_fp8_experts.cuh: sm_90a, from 9 assignments on, H and F multiples of
 * 16, scale blocks of multiples of 128 or per output channel) compute with the activations quantised to e4m3
 * per 128 columns, x and the SWIGLU intermediate: up to 2^-4 relative per element, partly averaging out in
 * the sums. Against the float64 forward of the dequantised weights, normalised by max|reference|: at most
 * 5.5e-2 over the 255 fp8 cases on an H100 (1.6e-2 to 4.5e-2 for single projections, check_fp8_gemm.cu,
 * which also holds the kernels to 8e-3 against the activations they were given). The gemv and mma_kernel
 * (fp8 weights widened to bf16 tiles) keep bf16's. */
#define FP8_TC_LIMIT 8e-2
static bool fp8_tensor_cores(colibri_dtype_t w, int H, int F, int bn, int bk, int64_t assignments) {
    const bool fit = (bn == 1 && bk == 0) || ((bn == 0 || bn % 128 == 0) && (bk == 0 || bk % 128 == 0));
    /* COLIBRI_CUDA_NO_WS=1 (read by the library too) keeps them off: mma_kernel's bf16 tiles instead */
    const char *no_ws = getenv("COLIBRI_CUDA_NO_WS");
    const bool on = !(no_ws && no_ws[0] && strcmp(no_ws, "0") != 0);
    return w == COLIBRI_DTYPE_F8E4M3 && assignments > 8 && H % 16 == 0 && F % 16 == 0 && fit && on;
}

struct Layer {
    Shape s;
    colibri_expert_kind_t kind;
    colibri_dtype_t wdt;
    std::vector<char> packed;      /* host packed buffer with gaps between experts */
    std::vector<uint64_t> offsets;
    std::vector<double> w;         /* [E, numel] the stored weights as doubles; fp8: empty (expert_w) */
    std::vector<float> scales;     /* fp8: [E, scales_numel] the scale grids */
    std::vector<float> router, bias;
    uint64_t numel, total, scales_numel = 0;
};

static int scale_blocks(int n, int block) { return block > 0 ? (n + block - 1) / block : 1; }

/* e4m3 codes of u(-1, 1) * 400 on a grid of 2^16 points, one in 32 of u(-1, 1) / 32 instead (subnormals and
 * small values): a random weight is a table entry, 4 per draw of the generator. */
static const std::vector<uint8_t> &f8_table() {
    static std::vector<uint8_t> t;
    if (t.empty()) {
        t.resize(1 << 16);
        for (int i = 0; i < (1 << 16); i++) {
            const double v = ((i >> 5) + 0.5) / 2048.0 * 2.0 - 1.0;
            t[i] = __nv_cvt_float_to_fp8((float)((i & 31) ? v * 400.0 : v / 32.0), __NV_SATFINITE, __NV_E4M3);
        }
    }
    return t;
}
static double f8_value(uint8_t q) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3))); }

/* fp8 weights of one [N, K] matrix at q and its scale grid at grid (blocks bn, bk): random e4m3 values
 * times a random scale per block, about u(-1, 1) * 1.7 / sqrt(K) in all, like the other dtypes' weights. */
static void put_f8_matrix(uint8_t *q, float *grid, int N, int K, int bn, int bk, std::mt19937_64 &rng) {
    std::uniform_real_distribution<double> u(-0.7, 0.7);
    const int rows = scale_blocks(N, bn), cols = scale_blocks(K, bk);
    for (int i = 0; i < rows * cols; i++) grid[i] = (float)(1.7 / sqrt((double)K) / 400.0 * exp(u(rng)));
    const std::vector<uint8_t> &t = f8_table();
    uint64_t bits = 0;
    for (size_t i = 0; i < (size_t)N * K; i++) {
        if (i % 4 == 0) bits = rng();
        q[i] = t[(bits >> (16 * (i % 4))) & 0xffff];
    }
}

/* The scale of weight (n, c) of a matrix whose grid starts at grid: its block's. */
static double f8_scale(const float *grid, int n, int c, int K, int bn, int bk) {
    return grid[(bn > 0 ? n / bn : 0) * scale_blocks(K, bk) + (bk > 0 ? c / bk : 0)];
}

/* Expert e's weights as doubles (the dequantised ones for fp8, decoded into buf). */
static const double *expert_w(const Layer &L, int e, std::vector<double> &buf) {
    if (L.wdt != COLIBRI_DTYPE_F8E4M3) return &L.w[(size_t)e * L.numel];
    buf.resize(L.numel);
    const uint8_t *q = (const uint8_t *)L.packed.data() + L.offsets[e];
    const float *grid = &L.scales[(size_t)e * L.scales_numel];
    const int H = L.s.H, F = L.s.F, bn = L.s.bn, bk = L.s.bk;
    const size_t first = (size_t)scale_blocks(F, bn) * scale_blocks(H, bk);
    const int mats = L.kind == COLIBRI_EXPERT_SWIGLU ? 3 : 1;
    for (int m = 0; m < mats; m++) {
        const int N = m < 2 ? F : H, K = m < 2 ? H : F;
        const size_t at = (size_t)m * F * H;
        for (int n = 0; n < N; n++)
            for (int c = 0; c < K; c++)
                buf[at + (size_t)n * K + c] =
                    f8_value(q[at + (size_t)n * K + c]) * f8_scale(grid + m * first, n, c, K, bn, bk);
    }
    return buf.data();
}

static Layer make_layer(Shape s, colibri_expert_kind_t kind, colibri_dtype_t wdt, std::mt19937_64 &rng) {
    Layer L;
    L.s = s;
    L.kind = kind;
    L.wdt = wdt;
    L.numel = colibri_expert_numel(kind, s.H, s.F);
    const uint64_t gap = 3;
    L.total = (L.numel + gap) * s.E;
    L.packed.assign(L.total * colibri_dtype_size(wdt), 0);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    if (wdt == COLIBRI_DTYPE_F8E4M3) {
        /* gate [F, H], up [F, H], down [H, F] (or w [F, H]), each with its grid */
        L.scales_numel = colibri_scales_numel(kind, s.H, s.F, s.bn, s.bk);
        L.scales.resize(L.scales_numel * s.E);
        const size_t first = (size_t)scale_blocks(s.F, s.bn) * scale_blocks(s.H, s.bk);
        for (int e = 0; e < s.E; e++) {
            L.offsets.push_back((uint64_t)e * (L.numel + gap) + (e % 2));
            uint8_t *q = (uint8_t *)L.packed.data() + L.offsets[e];
            float *grid = &L.scales[(size_t)e * L.scales_numel];
            for (int m = 0; m < (kind == COLIBRI_EXPERT_SWIGLU ? 3 : 1); m++)
                put_f8_matrix(q + (size_t)m * s.F * s.H, grid + m * first, m < 2 ? s.F : s.H, m < 2 ? s.H : s.F, s.bn,
                              s.bk, rng);
        }
    } else {
        L.w.resize(L.numel * s.E);
        for (int e = 0; e < s.E; e++) {
            L.offsets.push_back((uint64_t)e * (L.numel + gap) + (e % 2));
            for (uint64_t i = 0; i < L.numel; i++) {
                /* gate/up/linear rows have H inputs, down rows F */
                const double fan = (kind == COLIBRI_EXPERT_SWIGLU && i >= 2ull * s.H * s.F) ? s.F : s.H;
                L.w[e * L.numel + i] = put(L.packed.data(), wdt, L.offsets[e] + i, u(rng) * 1.7 / sqrt(fan));
            }
        }
    }
    L.router.resize((size_t)s.E * s.H);
    for (auto &r : L.router) {
        r = (float)(u(rng) * 3.0 / sqrt((double)s.H));
        if (s.router_bf16) r = __bfloat162float(__float2bfloat16(r));
    }
    L.bias.resize(s.E);
    for (auto &b : L.bias) b = (float)(u(rng) * 0.2);
    return L;
}

static int out_features(const Layer &L) { return L.kind == COLIBRI_EXPERT_SWIGLU ? L.s.H : L.s.F; }

/* float64 forward of the given routing; ids outside [0, E) contribute nothing */
static std::vector<double> ref_forward(const Layer &L, const std::vector<double> &x, int T, const std::vector<int> &ids,
                                       const std::vector<float> &wts) {
    const int H = L.s.H, F = L.s.F, k = L.s.k, O = out_features(L);
    std::vector<double> out((size_t)T * O, 0.0);
#pragma omp parallel for schedule(dynamic, 4)
    for (int t = 0; t < T; t++) {
        std::vector<double> h(F), y(O), wbuf;
        const double *xt = &x[(size_t)t * H];
        for (int j = 0; j < k; j++) {
            const int e = ids[(size_t)t * k + j];
            if (e < 0 || e >= L.s.E) continue;
            const double *we = expert_w(L, e, wbuf);
            if (L.kind == COLIBRI_EXPERT_SWIGLU) {
                for (int f = 0; f < F; f++) {
                    double g = 0, u = 0;
                    for (int i = 0; i < H; i++) {
                        g += we[(size_t)f * H + i] * xt[i];
                        u += we[(size_t)F * H + (size_t)f * H + i] * xt[i];
                    }
                    h[f] = g / (1.0 + exp(-g)) * u;
                }
                for (int o = 0; o < O; o++) {
                    double s = 0;
                    for (int f = 0; f < F; f++) s += we[2 * (size_t)F * H + (size_t)o * F + f] * h[f];
                    y[o] = s;
                }
            } else {
                for (int o = 0; o < O; o++) {
                    double s = 0;
                    for (int i = 0; i < H; i++) s += we[(size_t)o * H + i] * xt[i];
                    y[o] = s;
                }
            }
            for (int o = 0; o < O; o++) out[(size_t)t * O + o] += wts[(size_t)t * k + j] * y[o];
        }
    }
    return out;
}

struct RouteRef {
    std::vector<int> ids;
    std::vector<double> wts;
    std::vector<char> clear; /* the top k+1 scores are apart by more than the fp32 logits can be off */
};

static RouteRef ref_route(const Layer &L, const std::vector<double> &x, int T, colibri_routing_t routing, int renorm,
                          double scale) {
    const int E = L.s.E, k = L.s.k, H = L.s.H;
    RouteRef r;
    r.ids.resize((size_t)T * k);
    r.wts.resize((size_t)T * k);
    r.clear.resize(T);
#pragma omp parallel for
    for (int t = 0; t < T; t++) {
        std::vector<double> l(E), sel(E);
        for (int e = 0; e < E; e++) {
            double s = 0;
            for (int i = 0; i < H; i++) s += (double)L.router[(size_t)e * H + i] * x[(size_t)t * H + i];
            l[e] = s;
        }
        const double mx = *std::max_element(l.begin(), l.end());
        double sum = 0;
        for (int e = 0; e < E; e++) sum += exp(l[e] - mx);
        for (int e = 0; e < E; e++)
            sel[e] = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0 / (1.0 + exp(-l[e])) + L.bias[e] : l[e];
        std::vector<int> order(E);
        for (int e = 0; e < E; e++) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return sel[a] > sel[b]; });
        bool clear = true;
        for (int j = 0; j < k && j + 1 < E; j++) clear = clear && sel[order[j]] - sel[order[j + 1]] > 1e-4;
        r.clear[t] = clear;
        double wsum = 0;
        for (int j = 0; j < k; j++) {
            const int e = order[j];
            r.ids[(size_t)t * k + j] = e;
            double w = routing == COLIBRI_ROUTING_SOFTMAX_TOPK ? exp(l[e] - mx) / sum
                       : routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0 / (1.0 + exp(-l[e]))
                                                                 : exp(l[e] - l[order[0]]);
            r.wts[(size_t)t * k + j] = w;
            wsum += w;
        }
        const bool normalise = routing == COLIBRI_ROUTING_TOPK_SOFTMAX || renorm;
        for (int j = 0; j < k; j++) r.wts[(size_t)t * k + j] = (normalise ? r.wts[(size_t)t * k + j] / wsum
                                                                          : r.wts[(size_t)t * k + j]) * scale;
    }
    return r;
}

/* Writes ids (t + j) % E and weights 1/k on the device: the custom router of the routing_fn case. */
__global__ void simple_router(int T, int E, int k, int32_t *ids, float *wts) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * k) return;
    ids[i] = (i / k + i % k) % E;
    wts[i] = 1.0f / k;
}
static int routing_fn_calls = 0;
static colibri_status_t simple_routing_fn(void *user, int64_t T, int32_t E, int32_t k, colibri_dtype_t, const void *,
                                          const float *, int32_t *ids, float *wts, void *stream) {
    (void)user;
    routing_fn_calls++;
    simple_router<<<(unsigned)((T * k + 255) / 256), 256, 0, (cudaStream_t)stream>>>((int)T, E, k, ids, wts);
    return cudaGetLastError() == cudaSuccess ? COLIBRI_OK : COLIBRI_ERR_CUDA;
}

static bool all_finite(const void *out, colibri_dtype_t adt, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!std::isfinite(get(out, adt, i))) return false;
    return true;
}

/* max |out - ref| / max |ref|, or +inf if any output is not finite */
static double normalised_error(const void *out, colibri_dtype_t adt, const std::vector<double> &ref) {
    double scale = 1e-30, err = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        const double o = get(out, adt, i);
        if (!std::isfinite(o)) return INFINITY;
        scale = std::max(scale, fabs(ref[i]));
        err = std::max(err, fabs(o - ref[i]));
    }
    return err / scale;
}

struct Dev {
    void *in = nullptr, *out = nullptr, *out2 = nullptr;
    int32_t *ids = nullptr;
    float *wts = nullptr;
};

enum { GIVEN = -1, CUSTOM = -2, COUNTS = -3 /* given ids with these rows per expert (run_case's per_expert) */ };

/* The limit of a forward of `assignments` (T times the slots, shared slices included) on shape s. */
static double case_limit(colibri_dtype_t w, colibri_dtype_t a, const Shape &s, int64_t assignments) {
    return fp8_tensor_cores(w, s.H, s.F, s.bn, s.bk, assignments) ? FP8_TC_LIMIT : limit_for(w, a);
}

struct Worst {
    double err = 0, ratio = 0;
};
static Worst worst[4][3]; /* [weight dtype (fp8 = 3)][act dtype] */

/* The weights of L for colibri_moe_context_create (routed experts, fp8 scales; the caller adds the rest). */
static colibri_moe_weights_t layer_weights(const Layer &L) {
    colibri_moe_weights_t w = {};
    w.expert_weights = L.packed.data();
    w.expert_offsets = L.offsets.data();
    w.expert_weights_numel = L.total;
    w.expert_scales = L.wdt == COLIBRI_DTYPE_F8E4M3 ? L.scales.data() : nullptr;
    return w;
}

/* " blocks=bn,bk" for fp8 weights (a case's name), else "" */
static const char *blocks_name(colibri_dtype_t wdt, const Shape &s) {
    static thread_local char b[40];
    b[0] = 0;
    if (wdt == COLIBRI_DTYPE_F8E4M3) snprintf(b, sizeof b, " blocks=%d,%d", s.bn, s.bk);
    return b;
}

static void run_case(Shape s, colibri_expert_kind_t kind, colibri_dtype_t wdt, colibri_dtype_t adt, int routing,
                     int renorm, int T, int workspace, std::mt19937_64 &rng, const std::vector<int> *per_expert = nullptr) {
    char name[240];
    snprintf(name, sizeof name, "E=%d k=%d H=%d F=%d %s w=%s%s a=%s routing=%d renorm=%d T=%d ws=%d", s.E, s.k, s.H,
             s.F, kind == COLIBRI_EXPERT_SWIGLU ? "swiglu" : "linear", dtype_name(wdt), blocks_name(wdt, s),
             dtype_name(adt), routing, renorm, T, workspace);
    if (case_skipped(name)) return;
    if (routing == COUNTS) {
        int sum = 0;
        for (int e = 0; e < s.E; e++) sum += (*per_expert)[e];
        if (sum != T * s.k) {
            expect(false, "COUNTS: the rows per expert sum to T * k");
            return;
        }
    }
    Layer L = make_layer(s, kind, wdt, rng);
    const int k = s.k, H = s.H, O = out_features(L);
    const double scale = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 2.5 : 1.0;
    colibri_moe_config_t cfg = {};
    cfg.expert_kind = kind;
    cfg.weight_dtype = wdt;
    cfg.num_experts = s.E;
    cfg.top_k = k;
    cfg.hidden_size = H;
    cfg.intermediate_size = s.F;
    cfg.routing = routing >= 0 ? (colibri_routing_t)routing : COLIBRI_ROUTING_SOFTMAX_TOPK;
    cfg.renormalize = renorm;
    cfg.routed_scaling_factor = (float)scale;
    cfg.workspace_tokens = workspace;
    cfg.device = COLIBRI_DEVICE_CUDA;
    cfg.scale_block_n = s.bn;
    cfg.scale_block_k = s.bk;
    if (routing == CUSTOM) cfg.routing_fn = simple_routing_fn;
    colibri_moe_context_t *ctx = nullptr;
    const bool given = routing == GIVEN || routing == COUNTS;
    colibri_moe_weights_t wt = layer_weights(L);
    wt.router_weight = given ? nullptr : L.router.data();
    wt.router_bias = cfg.routing == COLIBRI_ROUTING_SIGMOID_BIAS ? L.bias.data() : nullptr;
    COL_OK(colibri_moe_context_create(&ctx, &cfg, &wt));

    const size_t asz = colibri_dtype_size(adt);
    std::vector<char> hin((size_t)T * H * asz);
    std::vector<double> x((size_t)T * H);
    std::normal_distribution<double> nd(0.0, 1.0);
    for (size_t i = 0; i < x.size(); i++) x[i] = put(hin.data(), adt, i, nd(rng));
    Dev d;
    CUDA_OK(cudaMalloc(&d.in, hin.size()));
    CUDA_OK(cudaMalloc(&d.out, (size_t)T * O * asz));
    CUDA_OK(cudaMalloc(&d.out2, (size_t)T * O * asz));
    CUDA_OK(cudaMalloc(&d.ids, (size_t)T * k * 4));
    CUDA_OK(cudaMalloc(&d.wts, (size_t)T * k * 4));
    CUDA_OK(cudaMemcpy(d.in, hin.data(), hin.size(), cudaMemcpyHostToDevice));

    std::vector<int> ids((size_t)T * k);
    std::vector<float> wts((size_t)T * k);
    if (routing == GIVEN) {
        /* half the tokens pile onto expert 0 so that it spans many tiles */
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (int t = 0; t < T; t++) {
            std::vector<int> perm(s.E);
            for (int e = 0; e < s.E; e++) perm[e] = e;
            std::shuffle(perm.begin(), perm.end(), rng);
            if (u(rng) < 0.5) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));
            for (int j = 0; j < k; j++) {
                ids[(size_t)t * k + j] = perm[j];
                wts[(size_t)t * k + j] = (float)(u(rng) + 0.1);
            }
        }
    } else if (routing == COUNTS) {
        /* (*per_expert)[e] assignments of expert e: the ids sorted by expert, slot j of token t the (j T + t)-th
         * (a token's k experts differ while no count exceeds T), the tokens then shuffled */
        std::vector<int> flat;
        for (int e = 0; e < s.E; e++) flat.insert(flat.end(), (size_t)(*per_expert)[e], e);
        std::vector<int> order(T);
        for (int t = 0; t < T; t++) order[t] = t;
        std::shuffle(order.begin(), order.end(), rng);
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++) {
                ids[(size_t)order[t] * k + j] = flat[(size_t)j * T + t];
                wts[(size_t)order[t] * k + j] = (float)(u(rng) + 0.1);
            }
    }
    if (given) {
        CUDA_OK(cudaMemcpy(d.ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d.wts, wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
    } else {
        CUDA_OK(cudaMemset(d.ids, 0xff, (size_t)T * k * 4));
        CUDA_OK(cudaMemset(d.wts, 0xff, (size_t)T * k * 4));
        COL_OK(colibri_moe_route(ctx, T, adt, d.in, d.ids, d.wts, nullptr));
        CUDA_OK(cudaMemcpy(ids.data(), d.ids, ids.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(wts.data(), d.wts, wts.size() * 4, cudaMemcpyDeviceToHost));
        if (routing >= 0) {
            RouteRef r = ref_route(L, x, T, (colibri_routing_t)routing, renorm, scale);
            int compared = 0, id_bad = 0, w_bad = 0;
            for (int t = 0; t < T; t++) {
                if (!r.clear[t]) continue;
                compared++;
                for (int j = 0; j < k; j++) {
                    const size_t i = (size_t)t * k + j;
                    if (ids[i] != r.ids[i]) id_bad++;
                    else if (!(fabs(wts[i] - r.wts[i]) <= 2e-5 * (1 + fabs(r.wts[i])))) w_bad++;
                }
            }
            char what[300];
            snprintf(what, sizeof what, "%s: route ids (%d wrong) and weights (%d off) on %d/%d clear tokens", name,
                     id_bad, w_bad, compared, T);
            expect(id_bad == 0 && w_bad == 0 && compared >= T * 8 / 10, what);
        } else {
            bool ok = routing_fn_calls > 0;
            for (size_t i = 0; i < ids.size(); i++)
                ok = ok && ids[i] == (int)((i / k + i % k) % s.E) && wts[i] == 1.0f / k;
            char what[300];
            snprintf(what, sizeof what, "%s: routing_fn called on the stream with device pointers", name);
            expect(ok, what);
        }
    }

    const std::vector<double> ref = ref_forward(L, x, T, ids, wts);
    const size_t obytes = (size_t)T * O * asz;
    CUDA_OK(cudaMemset(d.out, 0xff, obytes));
    COL_OK(colibri_moe_forward(ctx, T, adt, d.in, d.ids, d.wts, d.out, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<char> hout(obytes), hout2(obytes);
    CUDA_OK(cudaMemcpy(hout.data(), d.out, obytes, cudaMemcpyDeviceToHost));
    const double err = normalised_error(hout.data(), adt, ref), lim = case_limit(wdt, adt, s, (int64_t)T * s.k);
    {
        char what[300];
        snprintf(what, sizeof what, "%s: forward error %.3g > limit %.3g", name, err, lim);
        expect(err <= lim, what);
        Worst &w = worst[wdt][adt];
        w.err = std::max(w.err, err);
        w.ratio = std::max(w.ratio, err / lim);
    }
    /* same inputs again: bitwise identical; without ids (routing inside forward): identical too */
    CUDA_OK(cudaMemset(d.out2, 0xff, obytes));
    if (given) COL_OK(colibri_moe_forward(ctx, T, adt, d.in, d.ids, d.wts, d.out2, nullptr));
    else COL_OK(colibri_moe_forward(ctx, T, adt, d.in, nullptr, nullptr, d.out2, nullptr));
    CUDA_OK(cudaMemcpy(hout2.data(), d.out2, obytes, cudaMemcpyDeviceToHost));
    {
        char what[300];
        snprintf(what, sizeof what, "%s: second forward%s bitwise equal", name,
                 given ? "" : " (routing inside forward)");
        expect(memcmp(hout.data(), hout2.data(), obytes) == 0, what);
    }
    COL_OK(colibri_moe_context_take_device_error(ctx));

    /* counters: two forwards since init, every id valid */
    std::vector<uint64_t> counts(s.E), want(s.E, 0);
    for (int i : ids) want[i] += 2;
    COL_OK(colibri_moe_context_expert_counts(ctx, counts.data(), 1));
    {
        char what[300];
        snprintf(what, sizeof what, "%s: expert counts", name);
        expect(counts == want, what);
    }
    colibri_moe_context_destroy(ctx);
    cudaFree(d.in);
    cudaFree(d.out);
    cudaFree(d.out2);
    cudaFree(d.ids);
    cudaFree(d.wts);
    printf("ok   %-100s err %.3g (limit %.3g)\n", name, err, lim);
    fflush(stdout);
}

/* The case "<what> E=.. k=.. H=.. F=.. w=.. a=.. T=.." (graph_and_bad_ids, back_to_back): its name, a SWIGLU
 * layer of shape s, and a CUDA context of it with the built-in routing (softmax top-k, renormalised) that
 * forward runs inside; NULL, and nothing made, where COLIBRI_CHECK_ONLY skips the case. */
static colibri_moe_context_t *routed_case(const char *what, Shape s, colibri_dtype_t wdt, colibri_dtype_t adt, int T,
                                          std::mt19937_64 &rng, char (&name)[160], Layer &L) {
    snprintf(name, sizeof name, "%s E=%d k=%d H=%d F=%d w=%s%s a=%s T=%d", what, s.E, s.k, s.H, s.F, dtype_name(wdt),
             blocks_name(wdt, s), dtype_name(adt), T);
    if (case_skipped(name)) return nullptr;
    L = make_layer(s, COLIBRI_EXPERT_SWIGLU, wdt, rng);
    colibri_moe_config_t cfg = {};
    cfg.expert_kind = COLIBRI_EXPERT_SWIGLU;
    cfg.weight_dtype = wdt;
    cfg.num_experts = s.E;
    cfg.top_k = s.k;
    cfg.hidden_size = s.H;
    cfg.intermediate_size = s.F;
    cfg.routing = COLIBRI_ROUTING_SOFTMAX_TOPK;
    cfg.renormalize = 1;
    cfg.routed_scaling_factor = 1.0f;
    cfg.device = COLIBRI_DEVICE_CUDA;
    cfg.scale_block_n = s.bn;
    cfg.scale_block_k = s.bk;
    colibri_moe_context_t *ctx = nullptr;
    colibri_moe_weights_t wt = layer_weights(L);
    wt.router_weight = L.router.data();
    COL_OK(colibri_moe_context_create(&ctx, &cfg, &wt));
    return ctx;
}

/* Capture forward (routing inside) into a graph, replay it on new inputs, compare with eager. Also ids
 * out of range: flagged by take_device_error, skipped in the output, not counted. */
static void graph_and_bad_ids(Shape s, colibri_dtype_t wdt, colibri_dtype_t adt, int T, std::mt19937_64 &rng) {
    char name[160];
    Layer L;
    colibri_moe_context_t *ctx = routed_case("graph", s, wdt, adt, T, rng, name, L);
    if (!ctx) return;
    const size_t asz = colibri_dtype_size(adt), ibytes = (size_t)T * s.H * asz, obytes = (size_t)T * s.H * asz;
    std::vector<char> hin(ibytes), a(obytes), b(obytes);
    std::vector<double> x((size_t)T * s.H);
    std::normal_distribution<double> nd(0.0, 1.0);
    void *in, *out;
    CUDA_OK(cudaMalloc(&in, ibytes));
    CUDA_OK(cudaMalloc(&out, obytes));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    std::vector<int> rids((size_t)T * s.k);
    std::vector<float> rwts((size_t)T * s.k);
    int32_t *d_rids;
    float *d_rwts;
    CUDA_OK(cudaMalloc(&d_rids, rids.size() * 4));
    CUDA_OK(cudaMalloc(&d_rwts, rwts.size() * 4));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    COL_OK(colibri_moe_forward(ctx, T, adt, in, nullptr, nullptr, out, st));
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; rep++) {
        for (size_t i = 0; i < x.size(); i++) x[i] = put(hin.data(), adt, i, nd(rng));
        /* st does not wait for the legacy stream, and a copy from pageable memory may return before its
         * DMA lands: copy and poison on st itself */
        CUDA_OK(cudaMemcpyAsync(in, hin.data(), ibytes, cudaMemcpyHostToDevice, st));
        CUDA_OK(cudaMemsetAsync(out, 0xff, obytes, st));
        CUDA_OK(cudaGraphLaunch(exec, st));
        CUDA_OK(cudaStreamSynchronize(st));
        CUDA_OK(cudaMemcpy(a.data(), out, obytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemsetAsync(out, 0xff, obytes, st));
        COL_OK(colibri_moe_forward(ctx, T, adt, in, nullptr, nullptr, out, st));
        CUDA_OK(cudaStreamSynchronize(st));
        CUDA_OK(cudaMemcpy(b.data(), out, obytes, cudaMemcpyDeviceToHost));
        char what[200];
        snprintf(what, sizeof what, "%s: replay %d bitwise equal to eager and finite", name, rep);
        expect(memcmp(a.data(), b.data(), obytes) == 0 && all_finite(a.data(), adt, (size_t)T * s.H), what);
        /* and right: each replay's fresh inputs against the float64 forward of their routing (state kept
         * in the context between forwards, such as wgmma_ws_kernel's item counters, must not leak) */
        CUDA_OK(cudaMemsetAsync(d_rids, 0xff, rids.size() * 4, st)); /* on st, as above */
        COL_OK(colibri_moe_route(ctx, T, adt, in, d_rids, d_rwts, st));
        CUDA_OK(cudaStreamSynchronize(st));
        CUDA_OK(cudaMemcpy(rids.data(), d_rids, rids.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(rwts.data(), d_rwts, rwts.size() * 4, cudaMemcpyDeviceToHost));
        const double rerr = normalised_error(a.data(), adt, ref_forward(L, x, T, rids, rwts));
        const double rlim = case_limit(wdt, adt, s, (int64_t)T * s.k);
        snprintf(what, sizeof what, "%s: replay %d error %.3g <= limit %.3g", name, rep, rerr, rlim);
        expect(rerr <= rlim, what);
    }
    cudaFree(d_rids);
    cudaFree(d_rwts);
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));

    /* ids out of range: slot 0 of every token gets E, -1 or E + 100, and every slot of token 5 and of every
     * 17th after it (an output row of zeros, which no expert's row reaches: a permutation that writes such
     * rows must still leave it zero) */
    std::vector<int> ids((size_t)T * s.k);
    std::vector<float> wts((size_t)T * s.k, 0.5f);
    std::vector<uint64_t> want(s.E, 0), counts(s.E);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < s.k; j++) {
            int e = (t * 7 + j * 3) % s.E;
            if (j == 0 || t % 17 == 5) e = t % 3 == 0 ? s.E : t % 3 == 1 ? -1 : s.E + 100;
            ids[(size_t)t * s.k + j] = e;
            if (e >= 0 && e < s.E) want[e]++;
        }
    const std::vector<double> ref = ref_forward(L, x, T, ids, wts);
    int32_t *d_ids;
    float *d_wts;
    CUDA_OK(cudaMalloc(&d_ids, ids.size() * 4));
    CUDA_OK(cudaMalloc(&d_wts, wts.size() * 4));
    CUDA_OK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_wts, wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
    COL_OK(colibri_moe_context_expert_counts(ctx, counts.data(), 1));
    CUDA_OK(cudaMemsetAsync(out, 0xff, obytes, st));
    COL_OK(colibri_moe_forward(ctx, T, adt, in, d_ids, d_wts, out, st));
    const colibri_status_t flagged = colibri_moe_context_take_device_error(ctx);
    const colibri_status_t cleared = colibri_moe_context_take_device_error(ctx);
    CUDA_OK(cudaMemcpy(a.data(), out, obytes, cudaMemcpyDeviceToHost));
    COL_OK(colibri_moe_context_expert_counts(ctx, counts.data(), 0));
    const double err = normalised_error(a.data(), adt, ref);
    char what[300];
    snprintf(what, sizeof what, "%s: bad ids flagged (%s), then cleared (%s), skipped (err %.3g), not counted", name,
             colibri_status_string(flagged), colibri_status_string(cleared), err);
    expect(flagged == COLIBRI_ERR_INVALID_ARGUMENT && cleared == COLIBRI_OK && err <= case_limit(wdt, adt, s, (int64_t)T * s.k) &&
               counts == want,
           what);
    printf("ok   %s\n", name);
    cudaFree(d_ids);
    cudaFree(d_wts);
    cudaFree(in);
    cudaFree(out);
    CUDA_OK(cudaStreamDestroy(st));
    colibri_moe_context_destroy(ctx);
}

/* Forwards of different tokens enqueued back to back on one stream (routing inside), against the same
 * forwards run one at a time: bitwise equal. Under programmatic dependent launch the next forward's
 * kernels start while this one's end, so whatever state a forward keeps in the workspace between its
 * kernels (counters reset within the forward, flags) must be back at its start by then. */
static void back_to_back(Shape s, colibri_dtype_t wdt, colibri_dtype_t adt, int T, std::mt19937_64 &rng) {
    char name[160];
    Layer L;
    colibri_moe_context_t *ctx = routed_case("burst", s, wdt, adt, T, rng, name, L);
    if (!ctx) return;
    constexpr int N = 8;
    const size_t asz = colibri_dtype_size(adt), bytes = (size_t)T * s.H * asz;
    std::vector<char> hin(N * bytes), one(N * bytes), burst(N * bytes);
    std::normal_distribution<double> nd(0.0, 1.0);
    for (size_t i = 0; i < (size_t)N * T * s.H; i++) put(hin.data(), adt, i, nd(rng));
    char *in, *out;
    CUDA_OK(cudaMalloc(&in, N * bytes));
    CUDA_OK(cudaMalloc(&out, N * bytes));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CUDA_OK(cudaMemcpyAsync(in, hin.data(), N * bytes, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemsetAsync(out, 0xff, N * bytes, st));
    for (int i = 0; i < N; i++) {
        COL_OK(colibri_moe_forward(ctx, T, adt, in + i * bytes, nullptr, nullptr, out + i * bytes, st));
        CUDA_OK(cudaStreamSynchronize(st));
    }
    CUDA_OK(cudaMemcpy(one.data(), out, N * bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemsetAsync(out, 0xff, N * bytes, st));
    for (int i = 0; i < N; i++)
        COL_OK(colibri_moe_forward(ctx, T, adt, in + i * bytes, nullptr, nullptr, out + i * bytes, st));
    CUDA_OK(cudaStreamSynchronize(st));
    CUDA_OK(cudaMemcpy(burst.data(), out, N * bytes, cudaMemcpyDeviceToHost));
    COL_OK(colibri_moe_context_take_device_error(ctx));
    /* the forwards must differ from each other for the check to mean anything */
    int distinct = 0;
    for (int i = 1; i < N; i++) distinct += memcmp(one.data() + i * bytes, one.data() + (i - 1) * bytes, bytes) != 0;
    char what[240];
    snprintf(what, sizeof what, "%s: %d forwards back to back bitwise equal to one at a time, finite, %d of %d "
             "consecutive pairs distinct", name, N, distinct, N - 1);
    expect(memcmp(one.data(), burst.data(), N * bytes) == 0 && all_finite(burst.data(), adt, (size_t)N * T * s.H) &&
               distinct == N - 1,
           what);
    printf("ok   %s\n", name);
    cudaFree(in);
    cudaFree(out);
    CUDA_OK(cudaStreamDestroy(st));
    colibri_moe_context_destroy(ctx);
}

/* ---- the layer features of colibri.h's appended config fields (router logit bias, group limit, expert
 * biases, SWIGLU_OAI, shared expert) against their own float64 forward and routing ---- */
struct Feat {
    int n_group = 0, topk_group = 0;
    colibri_group_score_t gscore = COLIBRI_GROUP_SCORE_MAX;
    bool logit_bias = false, oai = false, ebias = false, sgate = false;
    int Fs = 0; /* shared expert width, 0: none */
};

struct FeatLayer {
    Layer L;
    Feat f;
    int bias_numel = 0;
    std::vector<float> logit_bias, ebias, sgate; /* as given to the library */
    std::vector<char> shared;                     /* gate [Fs, H], up [Fs, H], down [H, Fs], weight dtype */
    std::vector<double> sw;                       /* the same as doubles (fp8: dequantised) */
    std::vector<float> sscales;                   /* fp8: the shared expert's gate, up and down grids */
    float alpha = 1.702f, limit = 0.8f;           /* a limit that clamps many gate and up sums */
};

static FeatLayer make_feat_layer(Shape s, colibri_expert_kind_t kind, colibri_dtype_t wdt, const Feat &f,
                                 std::mt19937_64 &rng) {
    FeatLayer X;
    X.L = make_layer(s, kind, wdt, rng);
    X.f = f;
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    X.bias_numel = kind == COLIBRI_EXPERT_SWIGLU ? 2 * s.F + s.H : s.F;
    if (f.logit_bias) {
        X.logit_bias.resize(s.E);
        for (auto &b : X.logit_bias) b = (float)(u(rng) * 0.5);
    }
    if (f.ebias) {
        X.ebias.resize((size_t)s.E * X.bias_numel);
        for (auto &b : X.ebias) b = (float)(u(rng) * 0.3);
    }
    if (f.Fs) {
        const size_t n = 3 * (size_t)f.Fs * s.H;
        X.shared.assign(n * colibri_dtype_size(wdt), 0);
        X.sw.resize(n);
        if (wdt == COLIBRI_DTYPE_F8E4M3) {
            X.sscales.resize(colibri_scales_numel(COLIBRI_EXPERT_SWIGLU, s.H, f.Fs, s.bn, s.bk));
            const size_t first = (size_t)scale_blocks(f.Fs, s.bn) * scale_blocks(s.H, s.bk);
            uint8_t *q = (uint8_t *)X.shared.data();
            for (int m = 0; m < 3; m++) {
                const int N = m < 2 ? f.Fs : s.H, K = m < 2 ? s.H : f.Fs;
                const size_t at = (size_t)m * f.Fs * s.H;
                float *grid = X.sscales.data() + m * first;
                put_f8_matrix(q + at, grid, N, K, s.bn, s.bk, rng);
                for (int r = 0; r < N; r++)
                    for (int c = 0; c < K; c++)
                        X.sw[at + (size_t)r * K + c] =
                            f8_value(q[at + (size_t)r * K + c]) * f8_scale(grid, r, c, K, s.bn, s.bk);
            }
        } else {
            for (size_t i = 0; i < n; i++) {
                const double fan = i >= 2 * (size_t)f.Fs * s.H ? f.Fs : s.H;
                X.sw[i] = put(X.shared.data(), wdt, i, u(rng) * 1.7 / sqrt(fan));
            }
        }
        if (f.sgate) {
            X.sgate.resize(s.H);
            for (auto &g : X.sgate) g = (float)(u(rng) * 2.0 / sqrt((double)s.H));
        }
    }
    return X;
}

/* float64 act(g, u) of the layer */
static double ref_act(const FeatLayer &X, double g, double u) {
    if (!X.f.oai) return g / (1.0 + exp(-g)) * u;
    const double l = X.limit, gc = std::min(g, l), uc = std::min(std::max(u, -l), l);
    return (uc + 1.0) * gc / (1.0 + exp(-(double)X.alpha * gc));
}

/* float64 forward of the given routing with the layer's biases, activation and shared expert */
static std::vector<double> ref_forward_feat(const FeatLayer &X, const std::vector<double> &x, int T,
                                            const std::vector<int> &ids, const std::vector<float> &wts) {
    const Layer &L = X.L;
    const int H = L.s.H, F = L.s.F, k = L.s.k, O = out_features(L), Fs = X.f.Fs;
    std::vector<double> out((size_t)T * O, 0.0);
#pragma omp parallel for schedule(dynamic, 4)
    for (int t = 0; t < T; t++) {
        std::vector<double> h(std::max(F, Fs)), y(O), wbuf;
        const double *xt = &x[(size_t)t * H];
        for (int j = 0; j < k; j++) {
            const int e = ids[(size_t)t * k + j];
            if (e < 0 || e >= L.s.E) continue;
            const double *we = expert_w(L, e, wbuf);
            const float *b = X.ebias.empty() ? nullptr : &X.ebias[(size_t)e * X.bias_numel];
            if (L.kind == COLIBRI_EXPERT_SWIGLU) {
                for (int f = 0; f < F; f++) {
                    double g = b ? b[f] : 0.0, u = b ? b[F + f] : 0.0;
                    for (int i = 0; i < H; i++) {
                        g += we[(size_t)f * H + i] * xt[i];
                        u += we[(size_t)F * H + (size_t)f * H + i] * xt[i];
                    }
                    h[f] = ref_act(X, g, u);
                }
                for (int o = 0; o < O; o++) {
                    double s = b ? b[2 * F + o] : 0.0;
                    for (int f = 0; f < F; f++) s += we[2 * (size_t)F * H + (size_t)o * F + f] * h[f];
                    y[o] = s;
                }
            } else {
                for (int o = 0; o < O; o++) {
                    double s = b ? b[o] : 0.0;
                    for (int i = 0; i < H; i++) s += we[(size_t)o * H + i] * xt[i];
                    y[o] = s;
                }
            }
            for (int o = 0; o < O; o++) out[(size_t)t * O + o] += wts[(size_t)t * k + j] * y[o];
        }
        if (Fs) { /* the shared expert: SiLU, no biases, weight 1 or sigmoid(gate . x) */
            double gw = 1.0;
            if (X.f.sgate) {
                double d = 0;
                for (int i = 0; i < H; i++) d += (double)X.sgate[i] * xt[i];
                gw = 1.0 / (1.0 + exp(-d));
            }
            const double *sg = X.sw.data(), *su = sg + (size_t)Fs * H, *sd = su + (size_t)Fs * H;
            for (int f = 0; f < Fs; f++) {
                double g = 0, u = 0;
                for (int i = 0; i < H; i++) g += sg[(size_t)f * H + i] * xt[i], u += su[(size_t)f * H + i] * xt[i];
                h[f] = g / (1.0 + exp(-g)) * u;
            }
            for (int o = 0; o < O; o++) {
                double s = 0;
                for (int f = 0; f < Fs; f++) s += sd[(size_t)o * Fs + f] * h[f];
                out[(size_t)t * O + o] += gw * s;
            }
        }
    }
    return out;
}

/* float64 routing with the logit bias and the group limit; a token is clear where the kept groups and its
 * top k + 1 scores are apart by more than the fp32 logits can be off */
static RouteRef ref_route_feat(const FeatLayer &X, const std::vector<double> &x, int T, colibri_routing_t routing,
                               int renorm, double scale) {
    const Layer &L = X.L;
    const int E = L.s.E, k = L.s.k, H = L.s.H, G = X.f.n_group > 1 ? X.f.n_group : 1, size = E / G;
    RouteRef r;
    r.ids.resize((size_t)T * k);
    r.wts.resize((size_t)T * k);
    r.clear.resize(T);
#pragma omp parallel for
    for (int t = 0; t < T; t++) {
        std::vector<double> l(E), sel(E), gs(G);
        for (int e = 0; e < E; e++) {
            double s = X.logit_bias.empty() ? 0.0 : X.logit_bias[e];
            for (int i = 0; i < H; i++) s += (double)L.router[(size_t)e * H + i] * x[(size_t)t * H + i];
            l[e] = s;
        }
        const double mx = *std::max_element(l.begin(), l.end());
        double sum = 0;
        for (int e = 0; e < E; e++) sum += exp(l[e] - mx);
        for (int e = 0; e < E; e++)
            sel[e] = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0 / (1.0 + exp(-l[e])) + L.bias[e] : l[e];
        bool clear = true;
        if (G > 1) {
            for (int g = 0; g < G; g++) {
                std::vector<double> v(sel.begin() + g * size, sel.begin() + (g + 1) * size);
                std::sort(v.rbegin(), v.rend());
                gs[g] = X.f.gscore == COLIBRI_GROUP_SCORE_TOP2_SUM ? v[0] + v[1] : v[0];
            }
            std::vector<int> go(G);
            for (int g = 0; g < G; g++) go[g] = g;
            std::stable_sort(go.begin(), go.end(), [&](int a, int b) { return gs[a] > gs[b]; });
            if (X.f.topk_group < G) clear = gs[go[X.f.topk_group - 1]] - gs[go[X.f.topk_group]] > 1e-4;
            for (int j = X.f.topk_group; j < G; j++)
                for (int i = 0; i < size; i++) sel[go[j] * size + i] = -INFINITY;
        }
        std::vector<int> order(E);
        for (int e = 0; e < E; e++) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return sel[a] > sel[b]; });
        for (int j = 0; j < k && j + 1 < E; j++) clear = clear && sel[order[j]] - sel[order[j + 1]] > 1e-4;
        r.clear[t] = clear;
        double wsum = 0;
        for (int j = 0; j < k; j++) {
            const int e = order[j];
            r.ids[(size_t)t * k + j] = e;
            double w = routing == COLIBRI_ROUTING_SOFTMAX_TOPK ? exp(l[e] - mx) / sum
                       : routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0 / (1.0 + exp(-l[e]))
                                                                 : exp(l[e] - l[order[0]]);
            r.wts[(size_t)t * k + j] = w;
            wsum += w;
        }
        const bool normalise = routing == COLIBRI_ROUTING_TOPK_SOFTMAX || renorm;
        for (int j = 0; j < k; j++)
            r.wts[(size_t)t * k + j] = (normalise ? r.wts[(size_t)t * k + j] / wsum : r.wts[(size_t)t * k + j]) * scale;
    }
    return r;
}

/* One layer with features: routing (built-in: against ref_route_feat), forward with routing inside and with
 * the routed ids given (against ref_forward_feat, and bitwise equal to each other), a graph replay bitwise
 * equal to eager, expert counts of the routed experts only, and a NaN input that must stay NaN in its
 * token's output row only. routing GIVEN: random distinct ids. */
static void feature_case(const char *tag, Shape s, colibri_expert_kind_t kind, colibri_dtype_t wdt,
                         colibri_dtype_t adt, int routing, int renorm, int T, const Feat &f, std::mt19937_64 &rng) {
    char name[280];
    snprintf(name, sizeof name, "feature %s E=%d k=%d H=%d F=%d %s w=%s%s a=%s routing=%d T=%d groups=%d/%d lbias=%d "
             "oai=%d ebias=%d Fs=%d sgate=%d", tag, s.E, s.k, s.H, s.F, kind == COLIBRI_EXPERT_SWIGLU ? "swiglu" : "linear",
             dtype_name(wdt), blocks_name(wdt, s), dtype_name(adt), routing, T, f.n_group, f.topk_group, f.logit_bias,
             f.oai, f.ebias, f.Fs, f.sgate);
    if (case_skipped(name)) return;
    FeatLayer X = make_feat_layer(s, kind, wdt, f, rng);
    const Layer &L = X.L;
    const int k = s.k, H = s.H, O = out_features(L);
    const double scale = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 2.5 : 1.0;
    const bool given = routing == GIVEN;
    colibri_moe_config_t cfg = {};
    cfg.expert_kind = kind;
    cfg.weight_dtype = wdt;
    cfg.num_experts = s.E;
    cfg.top_k = k;
    cfg.hidden_size = H;
    cfg.intermediate_size = s.F;
    cfg.routing = given ? COLIBRI_ROUTING_SOFTMAX_TOPK : (colibri_routing_t)routing;
    cfg.renormalize = renorm;
    cfg.routed_scaling_factor = (float)scale;
    cfg.device = COLIBRI_DEVICE_CUDA;
    cfg.n_group = f.n_group;
    cfg.topk_group = f.topk_group;
    cfg.group_score = f.gscore;
    cfg.activation = f.oai ? COLIBRI_ACTIVATION_SWIGLU_OAI : COLIBRI_ACTIVATION_SILU;
    cfg.activation_alpha = X.alpha;
    cfg.activation_limit = X.limit;
    cfg.expert_bias = f.ebias;
    cfg.shared_intermediate_size = f.Fs;
    cfg.shared_gate = f.sgate;
    cfg.scale_block_n = s.bn;
    cfg.scale_block_k = s.bk;
    colibri_moe_weights_t wt = layer_weights(L);
    wt.shared_scales = X.sscales.empty() ? nullptr : X.sscales.data();
    wt.expert_bias = f.ebias ? X.ebias.data() : nullptr;
    wt.router_weight = given ? nullptr : L.router.data();
    wt.router_logit_bias = f.logit_bias && !given ? X.logit_bias.data() : nullptr;
    wt.router_bias = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? L.bias.data() : nullptr;
    wt.shared_weights = f.Fs ? X.shared.data() : nullptr;
    wt.shared_gate_weight = f.sgate ? X.sgate.data() : nullptr;
    colibri_moe_context_t *ctx = nullptr;
    const colibri_status_t made = colibri_moe_context_create(&ctx, &cfg, &wt);
    if (made == COLIBRI_ERR_UNSUPPORTED) { /* refused, not computed differently: say so and move on */
        printf("skip %s: %s\n", name, colibri_last_error());
        return;
    }
    COL_OK(made);
    const size_t asz = colibri_dtype_size(adt), obytes = (size_t)T * O * asz;
    std::vector<char> hin((size_t)T * H * asz);
    std::vector<double> x((size_t)T * H);
    std::normal_distribution<double> nd(0.0, 1.0);
    for (size_t i = 0; i < x.size(); i++) x[i] = put(hin.data(), adt, i, nd(rng));
    Dev d;
    CUDA_OK(cudaMalloc(&d.in, hin.size()));
    CUDA_OK(cudaMalloc(&d.out, obytes));
    CUDA_OK(cudaMalloc(&d.out2, obytes));
    CUDA_OK(cudaMalloc(&d.ids, (size_t)T * k * 4));
    CUDA_OK(cudaMalloc(&d.wts, (size_t)T * k * 4));
    CUDA_OK(cudaMemcpy(d.in, hin.data(), hin.size(), cudaMemcpyHostToDevice));
    std::vector<int> ids((size_t)T * k);
    std::vector<float> wts((size_t)T * k);
    if (given) {
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (int t = 0; t < T; t++) {
            std::vector<int> perm(s.E);
            for (int e = 0; e < s.E; e++) perm[e] = e;
            std::shuffle(perm.begin(), perm.end(), rng);
            for (int j = 0; j < k; j++) ids[(size_t)t * k + j] = perm[j], wts[(size_t)t * k + j] = (float)(u(rng) + 0.1);
        }
        CUDA_OK(cudaMemcpy(d.ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d.wts, wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
    } else {
        CUDA_OK(cudaMemset(d.ids, 0xff, (size_t)T * k * 4));
        COL_OK(colibri_moe_route(ctx, T, adt, d.in, d.ids, d.wts, nullptr));
        CUDA_OK(cudaMemcpy(ids.data(), d.ids, ids.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(wts.data(), d.wts, wts.size() * 4, cudaMemcpyDeviceToHost));
        RouteRef r = ref_route_feat(X, x, T, (colibri_routing_t)routing, renorm, scale);
        int compared = 0, id_bad = 0, w_bad = 0;
        for (int t = 0; t < T; t++) {
            if (!r.clear[t]) continue;
            compared++;
            for (int j = 0; j < k; j++) {
                const size_t i = (size_t)t * k + j;
                if (ids[i] != r.ids[i]) id_bad++;
                else if (!(fabs(wts[i] - r.wts[i]) <= 2e-5 * (1 + fabs(r.wts[i])))) w_bad++;
            }
        }
        char what[400];
        snprintf(what, sizeof what, "%s: route ids (%d wrong) and weights (%d off) on %d/%d clear tokens", name, id_bad,
                 w_bad, compared, T);
        expect(id_bad == 0 && w_bad == 0 && compared >= T * 7 / 10, what);
    }
    const std::vector<double> ref = ref_forward_feat(X, x, T, ids, wts);
    std::vector<char> a(obytes), b(obytes);
    CUDA_OK(cudaMemset(d.out, 0xff, obytes));
    COL_OK(colibri_moe_forward(ctx, T, adt, d.in, d.ids, d.wts, d.out, nullptr));
    CUDA_OK(cudaMemcpy(a.data(), d.out, obytes, cudaMemcpyDeviceToHost));
    const int slices = f.Fs ? (f.Fs + s.F - 1) / s.F : 0;
    const double err = normalised_error(a.data(), adt, ref), lim = case_limit(wdt, adt, s, (int64_t)T * (s.k + slices));
    char what[400];
    snprintf(what, sizeof what, "%s: forward error %.3g > limit %.3g", name, err, lim);
    expect(err <= lim, what);
    Worst &w = worst[wdt][adt];
    w.err = std::max(w.err, err);
    w.ratio = std::max(w.ratio, err / lim);
    /* routing inside forward (or the same given ids again): bitwise the same */
    CUDA_OK(cudaMemset(d.out2, 0xff, obytes));
    if (given) COL_OK(colibri_moe_forward(ctx, T, adt, d.in, d.ids, d.wts, d.out2, nullptr));
    else COL_OK(colibri_moe_forward(ctx, T, adt, d.in, nullptr, nullptr, d.out2, nullptr));
    CUDA_OK(cudaMemcpy(b.data(), d.out2, obytes, cudaMemcpyDeviceToHost));
    snprintf(what, sizeof what, "%s: second forward bitwise equal", name);
    expect(memcmp(a.data(), b.data(), obytes) == 0, what);
    /* a graph of the forward (routing inside where built in), replayed: bitwise the same as eager */
    {
        cudaStream_t st;
        CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        COL_OK(colibri_moe_forward(ctx, T, adt, d.in, given ? d.ids : nullptr, given ? d.wts : nullptr, d.out2, st));
        CUDA_OK(cudaStreamEndCapture(st, &graph));
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaMemsetAsync(d.out2, 0xff, obytes, st));
        CUDA_OK(cudaGraphLaunch(exec, st));
        CUDA_OK(cudaStreamSynchronize(st));
        CUDA_OK(cudaMemcpy(b.data(), d.out2, obytes, cudaMemcpyDeviceToHost));
        snprintf(what, sizeof what, "%s: graph replay bitwise equal to eager", name);
        expect(memcmp(a.data(), b.data(), obytes) == 0, what);
        CUDA_OK(cudaGraphExecDestroy(exec));
        CUDA_OK(cudaGraphDestroy(graph));
        CUDA_OK(cudaStreamDestroy(st));
    }
    COL_OK(colibri_moe_context_take_device_error(ctx));
    /* three forwards (one replayed), counted for the routed experts only */
    std::vector<uint64_t> counts(s.E), want(s.E, 0);
    for (int i : ids) want[i] += 3;
    COL_OK(colibri_moe_context_expert_counts(ctx, counts.data(), 1));
    snprintf(what, sizeof what, "%s: expert counts", name);
    expect(counts == want, what);
    /* NaN in token 0's input: its output row holds NaN, the other rows are unchanged (given ids) */
    {
        const double nan = NAN;
        put(hin.data(), adt, 0, nan);
        CUDA_OK(cudaMemcpy(d.in, hin.data(), hin.size(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(d.out2, 0, obytes));
        COL_OK(colibri_moe_forward(ctx, T, adt, d.in, d.ids, d.wts, d.out2, nullptr));
        CUDA_OK(cudaMemcpy(b.data(), d.out2, obytes, cudaMemcpyDeviceToHost));
        bool row0_nan = false;
        for (int o = 0; o < O; o++) row0_nan = row0_nan || std::isnan(get(b.data(), adt, o));
        const size_t row = (size_t)O * asz;
        snprintf(what, sizeof what, "%s: NaN input stays NaN in its row only", name);
        expect(row0_nan && memcmp(a.data() + row, b.data() + row, obytes - row) == 0, what);
    }
    colibri_moe_context_destroy(ctx);
    cudaFree(d.in);
    cudaFree(d.out);
    cudaFree(d.out2);
    cudaFree(d.ids);
    cudaFree(d.wts);
    printf("ok   %-100s err %.3g (limit %.3g)\n", name, err, lim);
    fflush(stdout);
}

/* The model families' feature sets over shapes that reach every expert path (T = 1 to 4096). */
static void feature_cases(bool quick, std::mt19937_64 &rng) {
    const colibri_dtype_t dts[3] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16};
    const std::vector<int> Ts = quick ? std::vector<int>{1, 7, 64, 513} : std::vector<int>{1, 2, 7, 64, 128, 513, 4096};
    /* gpt-oss-like: logit bias, top-k then softmax, the clamped SwiGLU, gate/up/down biases */
    Feat oss;
    oss.logit_bias = oss.oai = oss.ebias = true;
    Feat lin; /* LINEAR experts with their output bias */
    lin.logit_bias = lin.ebias = true;
    const Shape oss_shape = {32, 4, 256, 192}, small = {8, 2, 136, 88};
    for (colibri_dtype_t w : dts)
        for (int T : Ts) {
            if (quick && w == COLIBRI_DTYPE_F16) continue;
            const colibri_dtype_t a = w == COLIBRI_DTYPE_F32 ? COLIBRI_DTYPE_BF16 : w;
            feature_case("gpt-oss", oss_shape, COLIBRI_EXPERT_SWIGLU, w, a, COLIBRI_ROUTING_TOPK_SOFTMAX, 0, T, oss, rng);
            feature_case("oai-small", small, COLIBRI_EXPERT_SWIGLU, w, w, COLIBRI_ROUTING_TOPK_SOFTMAX, 0, T, oss, rng);
            feature_case("linear-bias", small, COLIBRI_EXPERT_LINEAR, w, a, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, lin, rng);
        }
    /* odd rows: the scalar gemv with biases; given ids with biases */
    feature_case("oai-odd", {5, 3, 36, 20}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16,
                 COLIBRI_ROUTING_TOPK_SOFTMAX, 0, 7, oss, rng);
    feature_case("oai-given", oss_shape, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, GIVEN, 0, 300,
                 oss, rng);
    /* DeepSeek-V3-like: 256 experts in 8 groups, 4 kept, top-2 sums, sigmoid scores with the correction */
    Feat ds;
    ds.n_group = 8;
    ds.topk_group = 4;
    ds.gscore = COLIBRI_GROUP_SCORE_TOP2_SUM;
    const Shape ds_shape = {256, 8, 128, 64};
    for (colibri_dtype_t w : {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_F32})
        for (int T : Ts) {
            if (quick && (w != COLIBRI_DTYPE_BF16 || T > 64)) continue;
            feature_case("deepseek-v3", ds_shape, COLIBRI_EXPERT_SWIGLU, w, w, COLIBRI_ROUTING_SIGMOID_BIAS, 1, T, ds,
                         rng);
        }
    /* the warp top-k of E <= 64 (the rank path) with groups: max and top-2 scores, a logit bias too */
    Feat g64 = ds;
    g64.gscore = COLIBRI_GROUP_SCORE_MAX;
    g64.topk_group = 3;
    g64.logit_bias = true;
    Feat g64b = ds;
    g64b.n_group = 4;
    g64b.topk_group = 2;
    for (int T : {1, 7, 64, 513}) {
        if (quick && T > 7) continue;
        feature_case("groups-64", {64, 6, 128, 64}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16,
                     COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, g64, rng);
        feature_case("groups-48", {48, 4, 128, 64}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F32,
                     COLIBRI_ROUTING_SIGMOID_BIAS, 1, T, g64b, rng);
    }
    /* shared experts: Qwen2-MoE-like (Fs = 2.5 F: three slices, the last half zero rows; the sigmoid gate)
     * and DeepSeek-V3-like (Fs = F, weight 1, with the group limit); given ids too */
    Feat qs;
    qs.Fs = 160;
    qs.sgate = true;
    Feat dss = ds;
    dss.Fs = 64;
    for (colibri_dtype_t w : dts)
        for (int T : Ts) {
            if (quick && (w == COLIBRI_DTYPE_F16 || T == 513)) continue;
            const colibri_dtype_t a = w == COLIBRI_DTYPE_F32 ? COLIBRI_DTYPE_BF16 : w;
            feature_case("qwen2-shared", {16, 4, 128, 64}, COLIBRI_EXPERT_SWIGLU, w, a, COLIBRI_ROUTING_SOFTMAX_TOPK, 0,
                         T, qs, rng);
            if (T != 1 && T != 64 && T != 4096) continue;
            feature_case("deepseek-shared", ds_shape, COLIBRI_EXPERT_SWIGLU, w, w, COLIBRI_ROUTING_SIGMOID_BIAS, 1, T,
                         dss, rng);
        }
    /* Qwen3-Next's 512 experts, top-10, a gated shared expert (the top-k holds every logit in registers), and
     * 600 experts (the logits past 512 read from L2 at each pick) */
    Feat qn = qs;
    qn.Fs = 64;
    for (int T : {1, 7, 64})
        feature_case("qwen3next-shared", {512, 10, 128, 64}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16,
                     COLIBRI_DTYPE_BF16, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, qn, rng);
    feature_case("experts-600", {600, 8, 64, 32}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F32,
                 COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 7, Feat{}, rng);
    feature_case("shared-given", {16, 4, 128, 64}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, GIVEN,
                 0, 300, qs, rng);
    feature_case("shared-odd", {5, 3, 36, 20}, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16,
                 COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 7, qs, rng);
}

/* fp8 e4m3 weights with their scale grids (DeepSeek's 128 x 128 blocks, per output channel, per tensor, small
 * blocks) against the float64 forward of the dequantised weights, at the bf16 limit (inter and y are bf16).
 * Partial blocks (H = 320: 2.5 blocks of 128, F = 192: 1.5); T from decode (direct mode, the down
 * projection with the combine folded in) to 4096 (the permuted tiles); every activation dtype; scalar rows
 * (H, F not multiples of 16); the layer features, a shared expert and a DeepSeek-V3-like layer; graph
 * replay, ids out of range, back-to-back forwards. */
static void fp8_cases(bool quick, std::mt19937_64 &rng) {
    const colibri_dtype_t f8 = COLIBRI_DTYPE_F8E4M3, bf16 = COLIBRI_DTYPE_BF16;
    const colibri_dtype_t dts[3] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16};
    const int blocks[4][2] = {{128, 128}, {1, 0}, {0, 0}, {16, 64}};
    const int routings[6][2] = {{GIVEN, 0}, {COLIBRI_ROUTING_SOFTMAX_TOPK, 1}, {COLIBRI_ROUTING_SOFTMAX_TOPK, 0},
                                {COLIBRI_ROUTING_TOPK_SOFTMAX, 0}, {COLIBRI_ROUTING_SIGMOID_BIAS, 1}, {CUSTOM, 0}};
    const std::vector<int> Ts = quick ? std::vector<int>{1, 7, 64} : std::vector<int>{1, 2, 7, 32, 64, 128, 513, 4096};
    int r = 0;
    for (const auto &b : blocks)
        for (int kind = 0; kind < 2; kind++)
            for (colibri_dtype_t a : dts)
                for (int T : Ts) {
                    if (quick && (a != bf16 || kind)) continue;
                    Shape s = {8, 2, 320, 192, false, b[0], b[1]};
                    r = (r + 1) % 6;
                    run_case(s, (colibri_expert_kind_t)kind, f8, a, routings[r][0], routings[r][1], T, 0, rng);
                }
    /* scalar rows: H = 36 (3 blocks of 16, the last partial), F = 20 */
    for (const auto &b : {std::make_pair(16, 16), std::make_pair(1, 0)})
        for (int T : {1, 7, 64}) {
            if (quick && T == 64) continue;
            run_case({5, 3, 36, 20, false, b.first, b.second}, COLIBRI_EXPERT_SWIGLU, f8, bf16,
                     COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, 0, rng);
        }
    /* decode of 16-byte rows (T = 1, 2: the down projection sums the top-k; 7: direct mode; 64: tiles),
     * 64 experts from 8 tokens to 512, and chunks of 200 tokens */
    const Shape decode = {8, 4, 1024, 1408, false, 128, 128}, wide = {64, 6, 256, 128, false, 128, 128};
    for (int T : {1, 2, 7, 64}) {
        if (quick && T > 2) continue;
        run_case(decode, COLIBRI_EXPERT_SWIGLU, f8, bf16, routings[T % 2][0], routings[T % 2][1], T, 0, rng);
        run_case(wide, COLIBRI_EXPERT_SWIGLU, f8, COLIBRI_DTYPE_F16, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T * 8, 0, rng);
    }
    run_case(wide, COLIBRI_EXPERT_SWIGLU, f8, bf16, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, quick ? 513 : 4096, 200, rng);
    const Shape aligned = {8, 2, 320, 192, false, 128, 128};
    for (int T : {1, 7, 513}) {
        if (quick && T == 513) continue;
        graph_and_bad_ids(aligned, f8, bf16, T, rng);
    }
    for (int T : {1, 4, 7}) back_to_back(aligned, f8, bf16, T, rng);
    back_to_back(decode, f8, bf16, 1, rng);

    /* the layer features with fp8 weights: gpt-oss's (logit bias, clamped SwiGLU, expert biases), LINEAR
     * with biases, shared experts (Qwen2-like: Fs = 2.5 F, three slices cut on 64-row blocks; DeepSeek-like) */
    Feat oss;
    oss.logit_bias = oss.oai = oss.ebias = true;
    Feat lin;
    lin.logit_bias = lin.ebias = true;
    Feat qs;
    qs.Fs = 160;
    qs.sgate = true;
    Feat ds;
    ds.n_group = 8;
    ds.topk_group = 4;
    ds.gscore = COLIBRI_GROUP_SCORE_TOP2_SUM;
    Feat dss = ds;
    dss.Fs = 64;
    const std::vector<int> fTs = quick ? std::vector<int>{1, 64} : std::vector<int>{1, 7, 64, 513, 4096};
    for (int T : fTs) {
        const colibri_dtype_t a = T % 2 ? bf16 : COLIBRI_DTYPE_F32;
        feature_case("gpt-oss", {32, 4, 256, 192, false, 128, 128}, COLIBRI_EXPERT_SWIGLU, f8, a,
                     COLIBRI_ROUTING_TOPK_SOFTMAX, 0, T, oss, rng);
        feature_case("linear-bias", {8, 2, 136, 96, false, 1, 0}, COLIBRI_EXPERT_LINEAR, f8, a,
                     COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, lin, rng);
        feature_case("qwen2-shared", {16, 4, 128, 64, false, 64, 64}, COLIBRI_EXPERT_SWIGLU, f8, a,
                     COLIBRI_ROUTING_SOFTMAX_TOPK, 0, T, qs, rng);
        feature_case("qwen2-shared", {16, 4, 128, 64, false, 1, 0}, COLIBRI_EXPERT_SWIGLU, f8, a,
                     COLIBRI_ROUTING_SOFTMAX_TOPK, 0, T, qs, rng);
        feature_case("deepseek-shared", {256, 8, 128, 64, false, 128, 128}, COLIBRI_EXPERT_SWIGLU, f8, bf16,
                     COLIBRI_ROUTING_SIGMOID_BIAS, 1, T, dss, rng);
    }
    /* DeepSeek-V3-like: 256 experts of F = 2048 in 8 groups (4 kept, top-2 sums), sigmoid scores with the
     * correction, 128 x 128 blocks, a shared expert of 2048; H = 256 keeps the host reference quick */
    Feat v3 = ds;
    v3.Fs = 2048;
    for (int T : {1, 4, 16, 64}) {
        if (quick && T > 4) continue;
        feature_case("deepseek-v3", {256, 8, 256, 2048, false, 128, 128}, COLIBRI_EXPERT_SWIGLU, f8, bf16,
                     COLIBRI_ROUTING_SIGMOID_BIAS, 1, T, v3, rng);
    }
}

/* fp8 weights on the fp8 tensor cores: a Mixtral-like layer (8 experts, top-2; H and F cut to 512 and 1024
 * so the host reference stays quick) and a DeepSeek-V3-like one (256 experts, top-8, 128 x 128 blocks) from
 * T = 128 to 4096, every activation dtype; rows per expert from 0 and 1 to several tiles (partial tiles on
 * both warpgroups); per-channel and per-tensor scales; LINEAR experts. */
static void fp8_tensor_core_cases(bool quick, std::mt19937_64 &rng) {
    const colibri_dtype_t f8 = COLIBRI_DTYPE_F8E4M3;
    const colibri_dtype_t dts[3] = {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16};
    const std::vector<int> Ts = quick ? std::vector<int>{128} : std::vector<int>{128, 1024, 4096};
    int i = 0;
    for (int T : Ts) {
        const colibri_dtype_t a = dts[i++ % 3];
        run_case({8, 2, 512, 1024, false, 128, 128}, COLIBRI_EXPERT_SWIGLU, f8, a, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, 0,
                 rng);
        run_case({256, 8, 384, 256, false, 128, 128}, COLIBRI_EXPERT_SWIGLU, f8, a, COLIBRI_ROUTING_SIGMOID_BIAS, 1, T,
                 0, rng);
    }
    /* rows per expert: none, one, one short of, at and past a tile, a warpgroup's 64, several tiles */
    const std::vector<int> rows = {1, 0, 127, 128, 129, 300, 5, 64};
    for (const auto &b : {std::make_pair(128, 128), std::make_pair(1, 0), std::make_pair(0, 0)})
        for (int kind = 0; kind < 2; kind++) {
            if (quick && kind) continue;
            run_case({8, 2, 256, 384, false, b.first, b.second}, (colibri_expert_kind_t)kind, f8, COLIBRI_DTYPE_BF16,
                     COUNTS, 0, 377, 0, rng, &rows);
        }
}

int main(int argc, char **argv) {
    const bool quick = argc > 1 && !strcmp(argv[1], "--quick");
    if (!colibri_cuda_built() || colibri_cuda_device_count() < 1) {
        printf("SKIP: CUDA backend built %d, devices %d\n", colibri_cuda_built(), colibri_cuda_device_count());
        return 0;
    }
    const uint64_t seed = quick ? 7 : (uint64_t)time(nullptr);
    printf("seed %llu%s\n", (unsigned long long)seed, quick ? " (quick: a subset, for the sanitizers)" : "");
    std::mt19937_64 rng(seed);
    const Shape aligned = {8, 2, 136, 88};  /* 16-byte gemv, every tensor-core tile height, partial tiles */
    const Shape odd = {5, 3, 36, 20};       /* scalar gemv: rows not 16-byte multiples */
    const Shape wide = {64, 6, 64, 32};     /* many experts, fine-grained */
    const Shape many = {100, 8, 200, 32};   /* router GEMM: two expert tiles, the second partial; H % 32 != 0 */
    /* the router gemv split along H (route_gemv_plan, 256-element minimum): 16-byte rows in up to 16
     * splits, the last 160 elements (T <= 128), 4 at T = 513; scalar rows (H % 8 != 0) with 60 experts,
     * the last group of 8 rows half empty, in 4 splits up to T = 64 (the last 236 elements), 2 at 128 */
    const Shape tall = {8, 2, 4000, 16};
    const Shape tall_odd = {60, 4, 1004, 16};
    const colibri_dtype_t dts[3] = {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16};
    const int routings[6][2] = {{GIVEN, 0}, {COLIBRI_ROUTING_SOFTMAX_TOPK, 1}, {COLIBRI_ROUTING_SOFTMAX_TOPK, 0},
                                {COLIBRI_ROUTING_TOPK_SOFTMAX, 0}, {COLIBRI_ROUTING_SIGMOID_BIAS, 1}, {CUSTOM, 0}};
    const std::vector<int> Ts = quick ? std::vector<int>{1, 7, 64, 513} : std::vector<int>{1, 7, 32, 64, 128, 513, 4096};
    for (int r = 0; r < 6; r++)
        for (int kind = 0; kind < 2; kind++)
            for (colibri_dtype_t w : dts)
                for (colibri_dtype_t a : dts)
                    for (int T : Ts) {
                        if (quick && (w != a || r % 2)) continue;
                        run_case(aligned, (colibri_expert_kind_t)kind, w, a, routings[r][0], routings[r][1], T, 0, rng);
                    }
    for (Shape s : {odd, wide, many, tall, tall_odd})
        for (int r = 0; r < 6; r++)
            for (colibri_dtype_t w : dts)
                for (int T : Ts) {
                    if (quick && (T == 1 || T > 64 || r % 2)) continue;
                    run_case(s, COLIBRI_EXPERT_SWIGLU, w, w == COLIBRI_DTYPE_F32 ? COLIBRI_DTYPE_BF16 : w,
                             routings[r][0], routings[r][1], T, 0, rng);
                }
    /* the router GEMM (T >= 128, more than 16 experts) in the quick set too, for the sanitizers */
    if (quick)
        for (int r = 1; r < 3; r++)
            run_case(many, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, r == 1 ? COLIBRI_DTYPE_F32 : COLIBRI_DTYPE_BF16,
                     routings[r][0], routings[r][1], 1024, 0, rng);
    /* the router GEMM over rows long enough that each split's K cycles a ring of stages (H = 2048: 16
     * slices of 32 per split at T = 4096; H = 1032, 32.25 slices: the last split ends inside one), with
     * 64, 60 and (odd) 33 experts; bf16 and f16 tokens; the 2048-element rows of a router that bf16
     * holds exactly */
    const Shape router_long = {64, 6, 2048, 32, true}, router_odd = {60, 4, 1032, 16},
                router_odd_e = {33, 4, 1032, 16};
    for (colibri_dtype_t a : {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F16}) {
        if (quick && a == COLIBRI_DTYPE_F16) continue;
        run_case(router_odd, COLIBRI_EXPERT_SWIGLU, a, a, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 1024, 0, rng);
        if (quick) continue;
        run_case(router_odd, COLIBRI_EXPERT_SWIGLU, a, a, COLIBRI_ROUTING_SIGMOID_BIAS, 1, 4096, 0, rng);
        run_case(router_odd_e, COLIBRI_EXPERT_SWIGLU, a, a, COLIBRI_ROUTING_TOPK_SOFTMAX, 0, 1024, 0, rng);
        run_case(router_long, COLIBRI_EXPERT_SWIGLU, a, a, COLIBRI_ROUTING_SOFTMAX_TOPK, 0, 4096, 0, rng);
    }
    /* 128-row tiles whose K cycles the 4-stage ring of the wgmma kernel (8 and 5 k tiles) and whose N
     * ends inside a block (320 = 2.5 x 128 for the gate/up, 256 + 64 for linear) */
    const Shape deep = {4, 2, 512, 320};
    for (int r = 0; r < 2; r++)
        for (int kind = 0; kind < 2; kind++)
            for (colibri_dtype_t w : {COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16})
                for (int T : {513, 2048}) {
                    if (quick && (r || T > 513)) continue;
                    run_case(deep, (colibri_expert_kind_t)kind, w, w, routings[r][0], routings[r][1], T, 0, rng);
                }
    /* the streaming 128-row tiles (fewer assignments than a tile per expert: 100 each): the wgmma
     * kernel 3 stages ahead with K cycling its ring (up K = 512: 8 k steps of 64; down K = 1088: 17),
     * N ending inside a column block (GLU 1088 = 8.5 x 128), more items than SMs for the up projection
     * (the ring running on across items), experts' second tiles of at most 64 rows */
    const Shape stream = {16, 4, 512, 1088};
    for (int kind = 0; kind < 2; kind++)
        for (colibri_dtype_t w : {COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16}) {
            if (quick && (kind || w == COLIBRI_DTYPE_F16)) continue;
            run_case(stream, (colibri_expert_kind_t)kind, w, w, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 400, 0, rng);
        }
    /* long rows (K >= 4096): the BK=128 tensor-core tiles of 32 rows (T=32) beside those of 16 (T=8),
     * K = 4104 ending inside a k tile of the down projection; at T=4 the few-tokens path's down projection
     * with the combine folded in over rows of more than 8 KB (a warp per row and assignment) */
    const Shape longk = {4, 2, 4096, 4104};
    for (int kind = 0; kind < 2; kind++)
        for (colibri_dtype_t w : {COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16})
            for (int T : {4, 8, 32}) {
                if (quick && (kind || w == COLIBRI_DTYPE_F16 || T == 8)) continue;
                run_case(longk, (colibri_expert_kind_t)kind, w, w, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, T, 0, rng);
            }
    /* chunking: workspace smaller than T */
    run_case(aligned, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, COLIBRI_ROUTING_SOFTMAX_TOPK, 1,
             quick ? 513 : 4096, 200, rng);
    /* the split gemv with f32 activations, and in chunks of 100 and 13 tokens (logits_part sized for the
     * workspace's 100 tokens) */
    run_case(tall, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F32, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 100, 0,
             rng);
    run_case(tall, COLIBRI_EXPERT_SWIGLU, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, COLIBRI_ROUTING_SOFTMAX_TOPK, 1, 513,
             100, rng);
    for (colibri_dtype_t w : dts)
        for (int T : {1, 7, 513}) graph_and_bad_ids(aligned, w, COLIBRI_DTYPE_BF16, T, rng);
    /* many assignments: the multi-block permutation and the split router GEMM, also under the sanitizers */
    graph_and_bad_ids(wide, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F32, quick ? 1024 : 4096, rng);
    graph_and_bad_ids(many, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, quick ? 700 : 3000, rng);
    graph_and_bad_ids(tall, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, 64, rng); /* the split gemv in a graph */
    /* decode of 16-byte rows whose down projection's blocks take 3 output rows each (H = 1000 over 3 x 132
     * blocks on an H200: the last block 1 row), inter rows of 5.5 16-byte steps per lane (F = 1400); at
     * T = 2 with k = 4, 8 assignments whose experts the two tokens share (GIVEN piles half the tokens onto
     * expert 0). */
    const Shape decode = {8, 4, 1000, 1400};
    for (colibri_dtype_t w : {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F16})
        for (int r = 0; r < 2; r++)
            for (int T : {1, 2}) {
                if (quick && (w == COLIBRI_DTYPE_F16 || r)) continue;
                run_case(decode, COLIBRI_EXPERT_SWIGLU, w, w, routings[r][0], routings[r][1], T, 0, rng);
            }
    /* rows per expert chosen around whole 128-row tiles: remainders of 1, 16, 16 past two tiles, 17, 2, 6
     * rows and an expert with none; then around what wgmma_ws_kernel folds into an expert's last whole
     * tiles (up to WS_EXTRA_ROWS = 24 rows each, over at most PERMUTE_FOLD_TILES = 2 of them) and one past:
     * 24, 25, 48 and 49 rows past one tile (25-49: a tile of their own), 24, 33 (17 + 16) and 48 (24 + 24)
     * past two, 40 past three; and 67 past three, 90 and 78 past four, 2 and 1 past one and two (mc_deep,
     * one_deep: folded over 3-4 tiles where PERMUTE_FOLD_TILES is set to 4); 11 past one and three, 13 past
     * one and two, 30 (15 + 15) past two and three, 44 (22 + 22) past two (mc_sized, one_sized: folds that
     * products of 136 or 144 token rows would fit; folds of 152 like the others). On the cluster kernel (at most 2
     * tiles per expert on average) and on the one-block kernel (3 stages of k, the last partial), SWIGLU and
     * linear; the column blocks end inside the last 256 (128 for SWIGLU's up projection). */
    const std::vector<int> mc_counts = {129, 144, 272, 145, 130, 0}, one_counts = {400, 390, 272, 130},
                           edge24 = {152, 153, 280, 256, 0, 79}, edge48 = {176, 177, 304, 289, 0, 2},
                           one48 = {424, 390, 272, 106}, mc_deep = {451, 602, 0, 130, 257, 0},
                           one_deep = {451, 590, 130, 21}, mc_sized = {139, 286, 300, 13, 269, 141},
                           one_sized = {395, 414, 269, 114};
    for (colibri_dtype_t w : {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F16}) {
        if (quick && w == COLIBRI_DTYPE_F16) continue;
        for (colibri_expert_kind_t kind : {COLIBRI_EXPERT_SWIGLU, COLIBRI_EXPERT_LINEAR}) {
            run_case({6, 2, 512, 1088}, kind, w, w, COUNTS, 0, 410, 0, rng, &mc_counts);
            run_case({6, 2, 512, 1088}, kind, w, w, COUNTS, 0, 460, 0, rng, &edge24);
            run_case({6, 2, 512, 1088}, kind, w, w, COUNTS, 0, 474, 0, rng, &edge48);
            run_case({6, 2, 512, 1088}, kind, w, w, COUNTS, 0, 720, 0, rng, &mc_deep);
            run_case({6, 2, 512, 1088}, kind, w, w, COUNTS, 0, 574, 0, rng, &mc_sized);
        }
        run_case({4, 2, 136, 520}, COLIBRI_EXPERT_SWIGLU, w, w, COUNTS, 0, 596, 0, rng, &one_counts);
        run_case({4, 2, 136, 520}, COLIBRI_EXPERT_SWIGLU, w, w, COUNTS, 0, 596, 0, rng, &one48);
        run_case({4, 2, 136, 520}, COLIBRI_EXPERT_SWIGLU, w, w, COUNTS, 0, 596, 0, rng, &one_deep);
        run_case({4, 2, 136, 520}, COLIBRI_EXPERT_SWIGLU, w, w, COUNTS, 0, 596, 0, rng, &one_sized);
    }
    /* back to back: decode (direct mode, the down projection with the combine folded in: T * k <= 8,
     * 16-byte rows), the scalar-x gemv (H = 1004), and T = 7 (tensor-core tiles, the route kernel's
     * permutation) */
    for (colibri_dtype_t w : {COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F16})
        for (int T : {1, 4, 7}) back_to_back(aligned, w, w, T, rng);
    back_to_back(wide, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F32, 1, rng);
    /* 128-row tiles on wgmma_ws_kernel, streaming (many, T=300) and compute-bound (aligned, T=513): its item
     * counters, and any per-token counts, must be back at 0 when the
     * next forward's kernels start */
    back_to_back(many, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, 300, rng);
    back_to_back(aligned, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, 513, rng);
    for (int T : {1, 2}) back_to_back(decode, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, T, rng);
    for (int T : {1, 2}) back_to_back(tall_odd, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_BF16, T, rng);

    feature_cases(quick, rng);
    fp8_cases(quick, rng);
    fp8_tensor_core_cases(quick, rng);

    printf("\nworst normalised error per (weight dtype, act dtype): err (err/limit)\n");
    for (colibri_dtype_t w : {COLIBRI_DTYPE_F32, COLIBRI_DTYPE_F16, COLIBRI_DTYPE_BF16, COLIBRI_DTYPE_F8E4M3})
        for (colibri_dtype_t a : dts)
            if (worst[w][a].ratio > 0)
                printf("  w=%-4s a=%-4s %.3g (%.2f)\n", dtype_name(w), dtype_name(a), worst[w][a].err, worst[w][a].ratio);
    printf("%s: %d checks, %d failed\n", failures ? "FAIL" : "PASS", checks, failures);
    return failures ? 1 : 0;
}
