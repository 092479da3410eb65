/*
 * route.cu — built-in routing on the GPU: router logits [T, E] = x @ router^T in fp32, then one warp
 * per token turns a row of logits into top-k ids and weights (colibri.h, colibri_routing_t).
 * Up to 8 tokens (decode): one kernel, a block per router row whose 256 threads split H so the whole
 * row is in flight at once, and the last block to finish (a counter in the workspace) picks the top-k
 * of every token and, inside a forward, groups the assignments by expert (permute.cuh) too. More tokens: the memory-bound gemv of gemv.cuh (the router is small and re-read from
 * L2 for each group of 8 tokens), then the top-k kernel.
 * A custom routing_fn is called here too, on the caller's stream, with device pointers.
 */
#include <math.h>

#include "gemv.cuh"
#include "permute.cuh"

/* Selection order: higher score first, ties to the lower id. NaN scores rank last, like -inf. */
__device__ __forceinline__ bool ranks_before(float s, int e, float best_s, int best_e) {
    return s > best_s || (s == best_s && e < best_e);
}

__device__ __forceinline__ float selection_score(colibri_routing_t routing, float logit, const float *bias, int e) {
    float s = logit;
    if (routing == COLIBRI_ROUTING_SIGMOID_BIAS) s = 1.0f / (1.0f + expf(-logit)) + bias[e];
    return isnan(s) ? -INFINITY : s;
}

struct TopkArgs {
    const float *bias;
    int E, k;
    colibri_routing_t routing;
    int renormalize;
    float scale;
    int32_t *ids; /* [T, k]; NULL: logits only (a routing_fn follows) */
    float *wts;
};

/* Logits of one token each lane keeps in registers (e = lane + 32 i): with E <= 256 the picks below
 * read the row from L2 once instead of once per pick; larger E reads the rest each time. */
#define TOPK_REG 8

/* Calls f(logit, e) for this lane's experts e = lane, lane + 32, ... < E, in ascending e. */
template <class F> __device__ __forceinline__ void for_lane_logits(const float (&v)[TOPK_REG], const float *l, int E,
                                                                   int lane, F &&f) {
#pragma unroll
    for (int i = 0; i < TOPK_REG; i++)
        if (lane + 32 * i < E) f(v[i], lane + 32 * i);
    for (int e = lane + 32 * TOPK_REG; e < E; e += 32) f(__ldcg(l + e), e);
}

/* One warp, one token: pick k times the best score ranked after the previous pick (no set of chosen
 * ids to keep, and any E and k work), the pick's logit carried along. Lane 0 then forms the weights
 * from the chosen logits. The logits are read from L2 (__ldcg): another block of the same launch may
 * have written them. */
__device__ __forceinline__ void topk_token(const float *l, const TopkArgs &p, int t, int lane) {
    const int E = p.E, k = p.k;
    const colibri_routing_t routing = p.routing;
    float v[TOPK_REG];
#pragma unroll
    for (int i = 0; i < TOPK_REG; i++) v[i] = lane + 32 * i < E ? __ldcg(l + lane + 32 * i) : 0.0f;
    float mx = -INFINITY;
    for_lane_logits(v, l, E, lane, [&](float x, int) { mx = fmaxf(mx, x); });
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.0f;
    if (routing == COLIBRI_ROUTING_SOFTMAX_TOPK) {
        for_lane_logits(v, l, E, lane, [&](float x, int) { sum += expf(x - mx); });
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }

    int32_t *ids_t = p.ids + (size_t)t * k;
    float *w_t = p.wts + (size_t)t * k;
    float prev_s = INFINITY;
    int prev_e = -1;
    for (int j = 0; j < k; j++) {
        float best_s = -INFINITY, best_l = 0.0f;
        int best_e = 0x7fffffff;
        for_lane_logits(v, l, E, lane, [&](float x, int e) {
            const float s = selection_score(routing, x, p.bias, e);
            const bool after_prev = s < prev_s || (s == prev_s && e > prev_e);
            if (after_prev && ranks_before(s, e, best_s, best_e)) { best_s = s; best_e = e; best_l = x; }
        });
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float os = __shfl_xor_sync(0xffffffffu, best_s, off);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
            const float ol = __shfl_xor_sync(0xffffffffu, best_l, off);
            if (ranks_before(os, oe, best_s, best_e)) { best_s = os; best_e = oe; best_l = ol; }
        }
        prev_s = best_s;
        prev_e = best_e;
        if (lane == 0) {
            const float lg = best_l;
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
    } else if (p.renormalize) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w_t[j];
        norm = s;
    }
    for (int j = 0; j < k; j++) w_t[j] = w_t[j] / norm * p.scale;
}

/* One warp per token. */
__global__ void __launch_bounds__(256) topk_kernel(const float *logits, int T, TopkArgs p) {
    pdl_begin();
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    topk_token(logits + (size_t)t * p.E, p, t, lane);
}

/* Logits of T <= GEMV_GROUP tokens, block e = router row e, the 256 threads splitting H (VEC: 4
 * consecutive elements per thread and step, all steps of a thread in flight together). Fixed reduction
 * order: the same bits every run. Then, if p.ids, the last block to finish picks every token's top-k
 * (warp t takes token t), resets the counter for the next launch and, if tile_m > 0, runs the permutation
 * (dynamic shared memory: permute_smem_bytes(256, E)). */
template <class TX, bool VEC>
__global__ void __launch_bounds__(256) route_small_kernel(const float *router, const TX *x, int T, int H,
                                                          float *logits, TopkArgs p, unsigned *done, int tile_m,
                                                          PermuteArgs po) {
    pdl_begin();
    __shared__ float s_part[8][GEMV_GROUP];
    __shared__ bool s_last;
    const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *w = router + (size_t)e * H;
    float acc[GEMV_GROUP];
#pragma unroll
    for (int t = 0; t < GEMV_GROUP; t++) acc[t] = 0.0f;
    if (VEC) {
#pragma unroll 4
        for (int k = tid * 4; k < H; k += 256 * 4) {
            const float4 wv = __ldg(reinterpret_cast<const float4 *>(w + k));
#pragma unroll
            for (int t = 0; t < GEMV_GROUP; t++) {
                if (t < T) {
                    float xv[4];
                    load_f32<TX, 4>(x + (size_t)t * H + k, xv);
                    acc[t] = fmaf(wv.x, xv[0], acc[t]);
                    acc[t] = fmaf(wv.y, xv[1], acc[t]);
                    acc[t] = fmaf(wv.z, xv[2], acc[t]);
                    acc[t] = fmaf(wv.w, xv[3], acc[t]);
                }
            }
        }
    } else {
        for (int k = tid; k < H; k += 256) {
            const float wv = __ldg(w + k);
#pragma unroll
            for (int t = 0; t < GEMV_GROUP; t++)
                if (t < T) acc[t] = fmaf(wv, to_f32(x[(size_t)t * H + k]), acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_GROUP; t++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
        if (lane == 0) s_part[warp][t] = acc[t];
    }
    __syncthreads();
    if (tid < T) {
        float s = 0.0f;
#pragma unroll
        for (int wi = 0; wi < 8; wi++) s += s_part[wi][tid];
        logits[(size_t)tid * p.E + e] = s;
    }
    if (!p.ids) return;
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (warp < T) topk_token(logits + (size_t)warp * p.E, p, warp, lane);
    if (tid == 0) *done = 0;
    if (tile_m <= 0) return;
    extern __shared__ int permute_smem[];
    __syncthreads(); /* the ids the warps above wrote, visible to the whole block */
    permute_block(p.ids, T * p.k, p.E, tile_m, po, permute_smem);
}

static TopkArgs topk_args(const colibri_moe_config_t *c, const float *bias, int32_t *ids, float *wts) {
    TopkArgs p;
    p.bias = bias;
    p.E = c->num_experts;
    p.k = c->top_k;
    p.routing = c->routing;
    p.renormalize = c->renormalize;
    p.scale = c->routed_scaling_factor;
    p.ids = ids;
    p.wts = wts;
    return p;
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
        err = gemv_launch_groups<float, typename decltype(tx)::type, float>(a, (T + GEMV_GROUP - 1) / GEMV_GROUP,
                                                                           vec, stream);
    });
    return err;
}

/* T <= GEMV_GROUP: logits, (ids non-NULL) top-k and (tile_m > 0) the permutation in one launch. */
static cudaError_t launch_route_small(const colibri_moe_context_t *ctx, int64_t T, colibri_dtype_t act_dtype,
                                      const void *input, int32_t *ids, float *wts, int tile_m, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const TopkArgs p = topk_args(c, b->router_bias, ids, wts);
    const PermuteArgs po = permute_args(b);
    const size_t smem = tile_m > 0 ? permute_smem_bytes(256, c->num_experts) : 0;
    const bool vec = c->hidden_size % 4 == 0 && colibri_aligned16(input);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_dtype(act_dtype, [&](auto tx) {
        using TX = typename decltype(tx)::type;
        if (vec)
            err = colibri_launch(route_small_kernel<TX, true>, dim3((unsigned)c->num_experts), dim3(256), smem,
                                 stream, (const float *)b->router, (const TX *)input, (int)T, (int)c->hidden_size,
                                 b->logits, p, b->route_done, tile_m, po);
        else
            err = colibri_launch(route_small_kernel<TX, false>, dim3((unsigned)c->num_experts), dim3(256), smem,
                                 stream, (const float *)b->router, (const TX *)input, (int)T, (int)c->hidden_size,
                                 b->logits, p, b->route_done, tile_m, po);
    });
    return err;
}

colibri_status_t colibri_cuda_launch_route(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                           colibri_dtype_t act_dtype, const void *input, int32_t *topk_ids,
                                           float *topk_weights, int32_t permute_tile_m, bool *permuted,
                                           cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const bool small = b->router && num_tokens <= GEMV_GROUP;
    /* the permutation rides along where its shared memory fits the default 48 KB */
    const bool fuse = small && !c->routing_fn && permute_tile_m > 0 &&
                      permute_smem_bytes(256, c->num_experts) <= 48 * 1024;
    if (permuted) *permuted = fuse;
    if (small) {
        COLIBRI_CUDA_CHECK(launch_route_small(ctx, num_tokens, act_dtype, input, c->routing_fn ? NULL : topk_ids,
                                              topk_weights, fuse ? permute_tile_m : 0, stream));
    } else if (b->router) {
        COLIBRI_CUDA_CHECK(launch_logits(ctx, num_tokens, act_dtype, input, stream));
    }
    if (c->routing_fn) {
        colibri_status_t st = c->routing_fn(c->routing_user_data, num_tokens, c->num_experts, c->top_k, act_dtype,
                                            input, b->router ? b->logits : NULL, topk_ids, topk_weights, stream);
        if (st != COLIBRI_OK)
            return colibri_set_error(COLIBRI_ERR_ROUTING, "the routing_fn returned status %d (%s)", (int)st,
                                     colibri_status_string(st));
        return COLIBRI_OK;
    }
    if (small) return COLIBRI_OK;
    const TopkArgs p = topk_args(c, b->router_bias, topk_ids, topk_weights);
    COLIBRI_CUDA_CHECK(colibri_launch(topk_kernel, dim3((unsigned)((num_tokens + 7) / 8)), dim3(256), 0, stream,
                                      (const float *)b->logits, (int)num_tokens, p));
    return COLIBRI_OK;
}
