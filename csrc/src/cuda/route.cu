/*
 * route.cu — built-in routing on the GPU: router logits [T, E] = x @ router^T in fp32, then one warp
 * per token turns a row of logits into top-k ids and weights (colibri.h, colibri_routing_t), every value
 * formed by routing.h, the math the CPU backend uses too; this file keeps only the parallel structure.
 * Up to 8 tokens: route_small_kernel, whose last block also picks the top-k and, inside a forward,
 * permutes (permute.cuh). From ROUTE_GEMM_MIN_T tokens and ROUTE_GEMM_MIN_E experts: a tiled GEMM
 * (route_mma_kernel, route_gemm_kernel); else the gemv of gemv.cuh; either then topk_kernel. Every path
 * sums in a fixed order, so the ids are the same bits on every run. A custom routing_fn is called here
 * too, on the caller's stream. docs/cuda-design.md ("Routing") has the paths and why.
 */
#include <limits.h>
#include <math.h>

#include "gemv.cuh"
#include "sm80_mma.cuh"
#include "permute.cuh"
#include "routing.h"

struct TopkArgs {
    const float *bias;
    const float *logit_bias; /* [E] added to the router's logits (before any use of them), or NULL */
    int E, k;
    colibri_routing_t routing;
    int renormalize;
    float scale;
    int32_t *ids; /* [T, k]; NULL: logits only (a routing_fn follows) */
    float *wts;
    int n_group, topk_group; /* group limit where n_group > 1 (at most 32 groups: topk_kept_groups) */
    colibri_group_score_t group_score;
};

/* The group limit of routing.h (colibri_route_limit_groups) for one token, by its warp: lane g < n_group
 * scores group g from its selection scores in ascending id (the same comparisons in the same order), then
 * ranks it against the others through shuffles. Bit g of the result: group g is kept. Logits from L2, as
 * the callers read them. */
__device__ __forceinline__ unsigned topk_kept_groups(const float *l, const TopkArgs &p, int lane) {
    const int size = p.E / p.n_group;
    float gs = -INFINITY;
    if (lane < p.n_group) {
        float first = -INFINITY, second = -INFINITY;
        for (int i = 0; i < size; i++) {
            const int e = lane * size + i;
            colibri_route_group_add(colibri_route_select(p.routing, __ldcg(l + e), p.bias, e), &first, &second);
        }
        gs = colibri_route_group_score(p.group_score, first, second);
    }
    int rank = 0; /* groups ranked before this lane's */
    for (int h = 0; h < p.n_group; h++) rank += colibri_route_before(__shfl_sync(0xffffffffu, gs, h), h, gs, lane);
    return __ballot_sync(0xffffffffu, lane < p.n_group && rank < p.topk_group);
}

/* Whether expert e may be selected under the kept groups (always without a group limit). */
__device__ __forceinline__ bool topk_allowed(const TopkArgs &p, unsigned kept, int e) {
    return p.n_group <= 1 || ((kept >> (e / (p.E / p.n_group))) & 1u);
}

/* Logits of one token each lane keeps in registers (e = lane + 32 i): the picks below read the row from L2
 * once instead of once per pick up to 32 * REG experts, the rest each time. REG 16 (E > 256) holds
 * Qwen3-Next's 512. */
#define TOPK_REG 8
#define TOPK_REG_WIDE 16

/* Calls f(logit, e) for this lane's experts e = lane, lane + 32, ... < E, in ascending e. */
template <int REG, class F>
__device__ __forceinline__ void for_lane_logits(const float (&v)[REG], const float *l, int E, int lane, F &&f) {
#pragma unroll
    for (int i = 0; i < REG; i++)
        if (lane + 32 * i < E) f(v[i], lane + 32 * i);
    for (int e = lane + 32 * REG; e < E; e += 32) f(__ldcg(l + e), e);
}

/* A selection score as an unsigned key in the same order (scores are never NaN: colibri_route_select made
 * those -inf; -0 keyed as +0, which compares equal to it); 0 is below every score's key. */
__device__ __forceinline__ unsigned topk_key(float s) {
    const unsigned u = __float_as_uint(s == 0.0f ? 0.0f : s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* One warp, one token, E > TOPK_RANK_MAX_E: k rounds, each taking the largest of the lanes' best keys
 * with one redux.sync and the lowest id holding it with another (ids are unique, so the order is the
 * strict one of colibri_route_before), the pick's logit carried along; then only the winning lane looks
 * for its next best. Register-held experts drop to key 0 once picked; those past 32 REG are read from L2
 * each time and count only where ranked after the last pick. Lane 0 forms the weights from the chosen
 * logits. An earlier form tested every expert against the last pick in every round: Qwen3-Next's decode
 * routing (512 experts, top-10) took 41 us on an H100, now 29 (docs/performance.md). The logits are read
 * from L2 (__ldcg): another block of the same launch may have written them. */
template <bool LIMITED, int REG>
__device__ __forceinline__ void topk_token_picks(const float *l, const TopkArgs &p, int t, int lane) {
    const int E = p.E, k = p.k;
    const colibri_routing_t routing = p.routing;
    float v[REG];
#pragma unroll
    for (int i = 0; i < REG; i++) v[i] = lane + 32 * i < E ? __ldcg(l + lane + 32 * i) : 0.0f;
    float mx = -INFINITY;
    for_lane_logits(v, l, E, lane, [&](float x, int) { mx = fmaxf(mx, x); });
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.0f;
    if (colibri_route_softmax_all(routing)) {
        for_lane_logits(v, l, E, lane, [&](float x, int) { sum += colibri_route_softmax_term(x, mx); });
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }

    /* LIMITED (a group limit) is a variant of its own: the test per expert slowed layers without a group
     * limit (docs/performance.md, "Measurements behind the code") */
    const unsigned kept = LIMITED ? topk_kept_groups(l, p, lane) : ~0u;
    const int gsize = LIMITED ? E / p.n_group : 1;
    auto key_of = [&](float x, int e) {
        return topk_key(!LIMITED || ((kept >> (e / gsize)) & 1u) ? colibri_route_select(routing, x, p.bias, e)
                                                                  : -INFINITY);
    };
    unsigned q[REG];
#pragma unroll
    for (int i = 0; i < REG; i++) q[i] = lane + 32 * i < E ? key_of(v[i], lane + 32 * i) : 0u;
    unsigned prev_q = 0xffffffffu, bq; /* above every key: nothing picked yet */
    int prev_e = -1, be;
    float bx;
    auto lane_best = [&]() { /* ascending id, a strictly larger key replacing: ties keep the lower id */
        bq = 0u;
        be = INT_MAX;
        bx = 0.0f;
#pragma unroll
        for (int i = 0; i < REG; i++)
            if (q[i] > bq) { bq = q[i]; be = lane + 32 * i; bx = v[i]; }
        for (int e = lane + 32 * REG; e < E; e += 32) {
            const float x = __ldcg(l + e);
            const unsigned qe = key_of(x, e);
            if ((qe < prev_q || (qe == prev_q && e > prev_e)) && qe > bq) { bq = qe; be = e; bx = x; }
        }
    };
    lane_best();
    int32_t *ids_t = p.ids + (size_t)t * k;
    float *w_t = p.wts + (size_t)t * k;
    for (int j = 0; j < k; j++) {
        const unsigned m = __reduce_max_sync(0xffffffffu, bq);
        const int w = __reduce_min_sync(0xffffffffu, bq == m ? be : INT_MAX);
        const float x = __shfl_sync(0xffffffffu, bx, w & 31);
        if (lane == 0) {
            ids_t[j] = w;
            w_t[j] = colibri_route_prob(routing, x, mx, sum);
        }
        prev_q = m;
        prev_e = w;
        if (lane == (w & 31)) {
#pragma unroll
            for (int i = 0; i < REG; i++)
                if (lane + 32 * i == w) q[i] = 0u;
            lane_best();
        }
    }
    if (lane == 0) colibri_route_weights(routing, p.renormalize, p.scale, w_t, k);
}

/* The warp top-k below serves E <= 64: a lane holds experts lane and lane + 32. */
#define TOPK_RANK_MAX_E 64

/* One warp, one token, E <= TOPK_RANK_MAX_E: k rounds, each taking the warp's largest key with one
 * redux.sync and the lowest id holding it with a ballot (ids lane < lane + 32, so the first half is
 * asked first); the winner's key drops to 0. r0 / r1: the pick index of the lane's two experts, E if
 * not picked. The same ids in the same order as topk_token_picks (ranks_before's order), and the
 * weights formed by the same operations in the same order: the same bits. These rounds are a few warp
 * operations each, where ranking every expert against all E in 32 shuffle rounds sat on the forward's
 * critical path (docs/performance.md). */
__device__ __forceinline__ void topk_token_rank(const float *l, const TopkArgs &p, int t, int lane) {
    const int E = p.E, k = p.k;
    const colibri_routing_t routing = p.routing;
    const bool h0 = lane < E, h1 = lane + 32 < E;
    const float x0 = h0 ? __ldcg(l + lane) : 0.0f, x1 = h1 ? __ldcg(l + lane + 32) : 0.0f;
    unsigned q0 = h0 ? topk_key(colibri_route_select(routing, x0, p.bias, lane)) : 0u;
    unsigned q1 = h1 ? topk_key(colibri_route_select(routing, x1, p.bias, lane + 32)) : 0u;
    if (p.n_group > 1) { /* experts of the groups dropped score -inf, as in routing.h */
        const unsigned kept = topk_kept_groups(l, p, lane);
        if (h0 && !topk_allowed(p, kept, lane)) q0 = topk_key(-INFINITY);
        if (h1 && !topk_allowed(p, kept, lane + 32)) q1 = topk_key(-INFINITY);
    }
    float mx = -INFINITY;
    if (h0) mx = fmaxf(mx, x0);
    if (h1) mx = fmaxf(mx, x1);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.0f;
    if (colibri_route_softmax_all(routing)) {
        if (h0) sum += colibri_route_softmax_term(x0, mx);
        if (h1) sum += colibri_route_softmax_term(x1, mx);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    int r0 = E, r1 = E;
#pragma unroll 1
    for (int j = 0; j < k; j++) {
        const unsigned m = __reduce_max_sync(0xffffffffu, q0 > q1 ? q0 : q1);
        const unsigned b0 = __ballot_sync(0xffffffffu, q0 == m);
        if (b0) { /* warp-uniform */
            if (lane == __ffs(b0) - 1) { r0 = j; q0 = 0u; }
        } else {
            const unsigned b1 = __ballot_sync(0xffffffffu, q1 == m);
            if (lane == __ffs(b1) - 1) { r1 = j; q1 = 0u; }
        }
    }
    float w0 = colibri_route_prob(routing, x0, mx, sum), w1 = colibri_route_prob(routing, x1, mx, sum);
    /* pick j's value, from whichever lane holds rank j */
    auto pick = [&](int j, float v0, float v1) {
        const unsigned m = __ballot_sync(0xffffffffu, r0 == j || r1 == j);
        return __shfl_sync(0xffffffffu, r0 == j ? v0 : v1, __ffs(m) - 1);
    };
    /* colibri_route_weights, each lane for its two experts: the warp gathers the first pick and the sum
     * over the picks (in pick order) only where the routing needs them */
    const float first = colibri_route_softmax_picks(routing) ? pick(0, w0, w1) : 0.0f;
    w0 = colibri_route_unnormed(routing, w0, first);
    w1 = colibri_route_unnormed(routing, w1, first);
    float sum_picks = 0.0f;
    if (colibri_route_sums_picks(routing, p.renormalize))
        for (int j = 0; j < k; j++) sum_picks += pick(j, w0, w1);
    const float norm = colibri_route_norm(routing, p.renormalize, sum_picks);
    int32_t *ids_t = p.ids + (size_t)t * k;
    float *w_t = p.wts + (size_t)t * k;
    if (r0 < k) {
        ids_t[r0] = lane;
        w_t[r0] = colibri_route_weight(w0, norm, p.scale);
    }
    if (r1 < k) {
        ids_t[r1] = lane + 32;
        w_t[r1] = colibri_route_weight(w1, norm, p.scale);
    }
}

/* One warp, one token: ids and weights of its top-k (topk_token_rank where E allows, else the picks).
 * Not inlined: it was faster at decode so (docs/performance.md), and the route kernels' register
 * allocation changes with it; its time there is mostly the fetch of instructions that run once. */
static __device__ __noinline__ void topk_token(const float *l, const TopkArgs &p, int t, int lane) {
    if (p.E <= TOPK_RANK_MAX_E) topk_token_rank(l, p, t, lane);
    else if (p.n_group > 1) topk_token_picks<true, TOPK_REG>(l, p, t, lane);
    else if (p.E <= 32 * TOPK_REG) topk_token_picks<false, TOPK_REG>(l, p, t, lane);
    else topk_token_picks<false, TOPK_REG_WIDE>(l, p, t, lane);
}

/* Most splits along H of either router path (the GEMM's and the gemv's). */
#define ROUTE_GEMM_MAX_SPLITS 16

/* One warp per token. After a split router GEMM or gemv (splits > 1) the warp first adds the partial
 * logits of splits 1.. (part: [splits - 1, T, E]) to split 0's in split order, then the logit bias if
 * any, and writes the sums back as the logits; with p.ids NULL (a routing_fn follows) that is all it does. The partials of a logit
 * are all loaded before the first add (a fixed-size array, the loads past `splits` predicated off):
 * a loop of `splits` trips would wait for each L2 load in turn. The adds keep the order s = 1, 2, ... */
__global__ void __launch_bounds__(256) topk_kernel(float *logits, const float *part, int splits, int T, TopkArgs p) {
    pdl_begin();
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    float *l = logits + (size_t)t * p.E;
    if (splits > 1 || p.logit_bias) {
        /* two logits' partials in flight at once: a trip at a time waited on L2 16 times at E = 512 */
#pragma unroll 2
        for (int e = lane; e < p.E; e += 32) {
            float pv[ROUTE_GEMM_MAX_SPLITS - 1];
#pragma unroll
            for (int s = 1; s < ROUTE_GEMM_MAX_SPLITS; s++)
                pv[s - 1] = s < splits ? __ldcg(part + ((size_t)(s - 1) * T + t) * p.E + e) : 0.0f;
            float v = l[e];
#pragma unroll
            for (int s = 1; s < ROUTE_GEMM_MAX_SPLITS; s++)
                if (s < splits) v += pv[s - 1];
            if (p.logit_bias) v += p.logit_bias[e];
            l[e] = v;
        }
        __syncwarp(); /* lane 0 reads the chosen logits that other lanes wrote */
    }
    if (p.ids) topk_token(l, p, t, lane);
}

/* Router logits for many tokens: a BT tokens x BE experts tile of logits per block over the K range of
 * split blockIdx.z (kchunk elements of H), x and router rows staged through shared memory as fp32 in
 * ROUTE_BK-wide slices (double buffered; the next slice's global loads are in flight during this one's
 * products). 256 threads, each TM tokens x 4 experts, strided by the thread grid so that a warp's
 * float4 reads of the expert rows hit distinct banks and those of the token rows are broadcasts.
 * Every output is one fp32 FMA chain along its K range (fixed order: bitwise repeatable). Split 0
 * writes the logits, split s > 0 part[s - 1]. Rows are read 4 elements at a time: H % 4 == 0 and x
 * 16-byte aligned. It runs at about a third of the FMA rate; 8 x 8 outputs per thread, which halve the
 * shared-memory reads per FMA, were no faster (docs/performance.md). */
#define ROUTE_BK 32
#define ROUTE_LD (ROUTE_BK + 4) /* row stride of a shared slice: consecutive rows 4 banks apart */
#define ROUTE_GEMM_THREADS 256

template <class TX, int BT, int BE, int TM>
__global__ void __launch_bounds__(ROUTE_GEMM_THREADS, 2)
    route_gemm_kernel(const float *router, const TX *x, int T, int E, int H, int kchunk, float *logits, float *part) {
    constexpr int TN = 4, TXT = BE / TN, TYT = ROUTE_GEMM_THREADS / TXT, V = ROUTE_BK / 4;
    static_assert(TYT * TM == BT, "the thread grid covers the tile");
    constexpr int NA = BT * V / ROUTE_GEMM_THREADS, NB = (BE * V + ROUTE_GEMM_THREADS - 1) / ROUTE_GEMM_THREADS;
    __shared__ __align__(16) float sa[2][BT][ROUTE_LD];
    __shared__ __align__(16) float sb[2][BE][ROUTE_LD];
    pdl_begin();
    const int tid = threadIdx.x, tx = tid % TXT, ty = tid / TXT;
    const int t0 = blockIdx.x * BT, e0 = blockIdx.y * BE;
    const int kbeg = blockIdx.z * kchunk, kend = min(H, kbeg + kchunk);
    const int nk = (kend - kbeg + ROUTE_BK - 1) / ROUTE_BK;

    Pack<TX, 4> ra[NA];
    float4 rb[NB];
    auto load = [&](int k0) { /* out of range: zeros, which leave the FMA chains unchanged */
#pragma unroll
        for (int m = 0; m < NA; m++) {
            const int v = tid + m * ROUTE_GEMM_THREADS, t = t0 + v / V, k = k0 + (v % V) * 4;
            if (t < T && k < kend) {
                ra[m] = *reinterpret_cast<const Pack<TX, 4> *>(x + (size_t)t * H + k);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) ra[m].v[i] = from_f32<TX>(0.0f);
            }
        }
#pragma unroll
        for (int m = 0; m < NB; m++) {
            const int v = tid + m * ROUTE_GEMM_THREADS, e = e0 + v / V, k = k0 + (v % V) * 4;
            rb[m] = v < BE * V && e < E && k < kend ? __ldg(reinterpret_cast<const float4 *>(router + (size_t)e * H + k))
                                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int m = 0; m < NA; m++) {
            const int v = tid + m * ROUTE_GEMM_THREADS;
            *reinterpret_cast<float4 *>(&sa[buf][v / V][(v % V) * 4]) =
                make_float4(to_f32(ra[m].v[0]), to_f32(ra[m].v[1]), to_f32(ra[m].v[2]), to_f32(ra[m].v[3]));
        }
#pragma unroll
        for (int m = 0; m < NB; m++) {
            const int v = tid + m * ROUTE_GEMM_THREADS;
            if (v < BE * V) *reinterpret_cast<float4 *>(&sb[buf][v / V][(v % V) * 4]) = rb[m];
        }
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
    load(kbeg);
    store(0);
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < nk) load(kbeg + (kt + 1) * ROUTE_BK);
#pragma unroll
        for (int kk = 0; kk < ROUTE_BK; kk += 4) {
            float4 a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; i++) a[i] = *reinterpret_cast<const float4 *>(&sa[buf][ty + TYT * i][kk]);
#pragma unroll
            for (int j = 0; j < TN; j++) b[j] = *reinterpret_cast<const float4 *>(&sb[buf][tx + TXT * j][kk]);
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++) {
                    acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
                    acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
                    acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
                    acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
                }
        }
        /* the other buffer was last read in the previous slice, before the barrier that ended it */
        if (kt + 1 < nk) store(buf ^ 1);
        __syncthreads();
    }
    float *out = blockIdx.z == 0 ? logits : part + (size_t)(blockIdx.z - 1) * T * E;
#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int t = t0 + ty + TYT * i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int e = e0 + tx + TXT * j;
            if (e < E) out[(size_t)t * E + e] = acc[i][j];
        }
    }
}

/* Where the router GEMM takes over from the gemv: from 128 tokens and more than 16 experts (the
 * measurements behind both are in docs/performance.md). */
#define ROUTE_GEMM_MIN_T 128
#define ROUTE_GEMM_MIN_E 17
#define ROUTE_GEMM_BLOCKS_PER_SM 2 /* blocks per SM the split aims at (the kernel's launch bound) */

/* Split of a K of `units` units of `unit` elements over a grid of `tiles` blocks (either router path):
 * as many ranges as bring the grid to about `blocks` blocks, at most ROUTE_GEMM_MAX_SPLITS, each at
 * least `min_units` units (one split if K is shorter), every one non-empty. */
static void route_split_k(int64_t tiles, int64_t blocks, int units, int unit, int min_units, int *splits,
                          int *kchunk) {
    int64_t s = blocks / tiles;
    s = s < 1 ? 1 : s > ROUTE_GEMM_MAX_SPLITS ? ROUTE_GEMM_MAX_SPLITS : s;
    s = s > units / min_units ? units / min_units : s;
    s = s < 1 ? 1 : s;
    const int per = (units + (int)s - 1) / (int)s; /* units per split */
    *kchunk = per * unit;
    *splits = (units + per - 1) / per;
}

/* Split of the router GEMM for T tokens: as many splits of H as fill about one wave of
 * ROUTE_GEMM_BLOCKS_PER_SM blocks per SM, each at least one slice. */
struct RouteGemmPlan {
    int bt, be, splits, kchunk;
};
static RouteGemmPlan route_gemm_plan(int sm_count, int64_t T, int E, int H) {
    RouteGemmPlan g;
    g.be = 64;
    g.bt = 64;
    const int64_t tiles = ((T + g.bt - 1) / g.bt) * ((E + g.be - 1) / g.be);
    route_split_k(tiles, (int64_t)sm_count * ROUTE_GEMM_BLOCKS_PER_SM, (H + ROUTE_BK - 1) / ROUTE_BK, ROUTE_BK, 1,
                  &g.splits, &g.kchunk);
    return g;
}

/* Split of the router gemv (launch_logits) for T tokens. The gemv runs a block per GEMV_GROUP tokens and
 * GEMV_WARPS experts, T/8 x E/8 blocks, which below about a thousand tokens leave most of the SMs idle
 * while each warp walks its whole row, one chunk of loads in flight after another (docs/performance.md
 * has the profile). So H is
 * split into as many ranges as bring the grid to about ROUTE_GEMV_BLOCKS_PER_SM blocks per SM (the
 * gemv's launch bound, and all that its 125 to 128 registers leave resident: more blocks would queue
 * as a second wave as long as the first), at most ROUTE_GEMM_MAX_SPLITS, each range whole warp steps
 * (a step: the 32 lanes' 16-byte loads of the fp32 router, 128 elements, or 32 in the scalar kernel)
 * and at least ROUTE_GEMV_MIN_K elements. That minimum: 256 elements are two 16-byte steps, one chunk
 * of the 8-token pass with all its loads in flight at once; shorter ranges would not shorten any
 * warp's chain of loads, only add blocks and partial logits (written, then re-read by the top-k
 * kernel) for the same work. Where the grid already holds two blocks per SM (Mixtral at T = 4096: 512
 * blocks), splits = 1 and the unsplit kernel runs as before. */
#define ROUTE_GEMV_BLOCKS_PER_SM 2
#define ROUTE_GEMV_MIN_K 256
struct RouteGemvPlan {
    int splits, kchunk;
};
static RouteGemvPlan route_gemv_plan(int sm_count, int64_t T, int E, int H, bool vec) {
    const int step = 32 * (vec ? 4 : 1);
    const int64_t tiles = ((T + GEMV_GROUP - 1) / GEMV_GROUP) * ((E + GEMV_WARPS - 1) / GEMV_WARPS);
    RouteGemvPlan g;
    route_split_k(tiles, (int64_t)sm_count * ROUTE_GEMV_BLOCKS_PER_SM, (H + step - 1) / step, step,
                  ROUTE_GEMV_MIN_K / step, &g.splits, &g.kchunk);
    return g;
}

/* The most partial logits any one launch of up to `tokens` tokens writes: a forward runs chunks of 1 to
 * workspace_tokens tokens, and which path runs depends on T, E and (the input's alignment) on the call,
 * so every plan counts. Both plans split less as T grows, and within one count of token tiles the need
 * grows with T: evaluated at each tile count's last T. */
size_t colibri_cuda_route_part_floats(const colibri_moe_context_t *ctx, int sm_count, int64_t tokens) {
    const int E = ctx->cfg.num_experts, H = ctx->cfg.hidden_size;
    size_t most = 0;
    for (int64_t T = GEMV_GROUP; T < tokens + GEMV_GROUP; T += GEMV_GROUP) {
        const int64_t t = T < tokens ? T : tokens;
        int splits = 1;
        for (int vec = 0; vec < 2; vec++) {
            const int s = route_gemv_plan(sm_count, t, E, H, vec).splits;
            splits = s > splits ? s : splits;
        }
        if (splits == 1) break; /* nor at any larger T */
        const size_t need = (size_t)(splits - 1) * (size_t)t * E;
        most = need > most ? need : most;
    }
    if (E < ROUTE_GEMM_MIN_E) return most;
    const int bt = route_gemm_plan(sm_count, 1, E, H).bt;
    for (int64_t T = bt; T < tokens + bt; T += bt) { /* the plan changes with the number of token tiles */
        const int64_t t = T < tokens ? T : tokens;
        const size_t need = (size_t)(route_gemm_plan(sm_count, t, E, H).splits - 1) * (size_t)t * E;
        most = need > most ? need : most;
    }
    return most;
}

/* Router logits on tensor cores, for bf16 tokens (the same BT x BE tiles, plan and splits as
 * route_gemm_kernel, which it replaces there). The fp32 router r is kept at init also as three bf16
 * parts, r = hi + mid + lo (route_split_kernel: each part the rounding of what the ones before it
 * left; exact for every finite normal weight of bf16's range), and every logit is x.hi + (x.mid + x.lo),
 * each product of bf16 by bf16 exact in fp32, accumulated by mma.sync m16n8k16 in fp32 in two sets (hi,
 * and the small parts), added at the end: three products per MAC at the tensor rate instead of one fp32
 * FMA. A router that is bf16 upcast (mid and lo all 0, found at init) takes one part: PARTS = 1. The
 * tensor cores' fp32 sums round otherwise than an FMA chain does, so a near tie may pick another id than
 * route_gemm_kernel would; like it, bitwise repeatable (fixed order everywhere). The SIMT kernel runs at a
 * third of the FMA rate. 128 threads: 2 x 2 warps of
 * 32 tokens x 32 experts, x and the router parts staged by cp.async in RMMA_STAGES stages of RMMA_BK
 * elements, swizzled as mma_kernel's (the same fragments). */
#define RMMA_BK 32
#define RMMA_STAGES 4
#define RMMA_THREADS 128
#define RMMA_A_BYTES (64 * RMMA_BK * 2)
#define RMMA_B_BYTES (64 * RMMA_BK * 2)
static_assert(ROUTE_BK % 8 == 0, "every split's K range starts and ends on a 16-byte chunk of bf16");
template <int PARTS> constexpr uint32_t rmma_stage_bytes() { return RMMA_A_BYTES + PARTS * RMMA_B_BYTES; }
template <int PARTS> constexpr size_t rmma_smem_bytes() { return RMMA_STAGES * rmma_stage_bytes<PARTS>(); }

template <int PARTS>
__global__ void __launch_bounds__(RMMA_THREADS, ROUTE_GEMM_BLOCKS_PER_SM)
    route_mma_kernel(const __nv_bfloat16 *split, const __nv_bfloat16 *x, int T, int E, int H, int kchunk,
                     float *logits, float *part) {
    constexpr int BT = 64, BE = 64, BK = RMMA_BK, CPR = BK / 8; /* 16-byte chunks per row */
    constexpr int PER_T = BT * CPR / RMMA_THREADS;               /* chunks per thread, of x and of each part */
    constexpr int WTM = 32, WTN = 32, MI = WTM / 16, NI = WTN / 8;
    static_assert(BT == BE && PER_T * RMMA_THREADS == BT * CPR, "x and router tiles of the same rows");
    pdl_begin();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
    const int t0 = blockIdx.x * BT, e0 = blockIdx.y * BE;
    const int kbeg = blockIdx.z * kchunk, kend = min(H, kbeg + kchunk);
    const int ktiles = (kend - kbeg + BK - 1) / BK;
    extern __shared__ __align__(128) char smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);

    /* thread tid copies chunk idx % CPR of rows idx / CPR, idx = tid + i RMMA_THREADS, of x and of the
     * three parts; rows past T or E read 0 */
    const __nv_bfloat16 *a_src[PER_T], *b_src[PER_T];
    bool a_ok[PER_T], b_ok[PER_T];
#pragma unroll
    for (int i = 0; i < PER_T; i++) {
        const int idx = tid + i * RMMA_THREADS, r = idx / CPR, c = idx % CPR;
        a_ok[i] = t0 + r < T;
        b_ok[i] = e0 + r < E;
        a_src[i] = x + (size_t)(a_ok[i] ? t0 + r : 0) * H + c * 8;
        b_src[i] = split + (size_t)(b_ok[i] ? e0 + r : 0) * H + c * 8;
    }
    const size_t part_stride = (size_t)E * H;
    auto load = [&](int kt) {
        const uint32_t st = sbase + (uint32_t)(kt % RMMA_STAGES) * rmma_stage_bytes<PARTS>();
        const int k0 = kbeg + kt * BK;
#pragma unroll
        for (int i = 0; i < PER_T; i++) {
            const int idx = tid + i * RMMA_THREADS, r = idx / CPR, c = idx % CPR;
            const bool k_ok = k0 + c * 8 < kend; /* kend is a multiple of 8: a chunk is all in or all out */
            const bool ao = a_ok[i] && k_ok, bo = b_ok[i] && k_ok;
            cp_async16(st + swz<BK>(r, c), ao ? (const void *)(a_src[i] + k0) : (const void *)x, ao);
#pragma unroll
            for (int m = 0; m < PARTS; m++)
                cp_async16(st + RMMA_A_BYTES + m * RMMA_B_BYTES + swz<BK>(r, c),
                           bo ? (const void *)(b_src[i] + m * part_stride + k0) : (const void *)split, bo);
        }
    };

    constexpr int SETS = PARTS > 1 ? 2 : 1;
    float acc[SETS][MI][NI][4]; /* [0]: x.hi, [1]: x.mid + x.lo */
#pragma unroll
    for (int s = 0; s < SETS; s++)
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NI; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[s][i][j][q] = 0.0f;
#pragma unroll
    for (int s = 0; s < RMMA_STAGES - 1; s++) {
        if (s < ktiles) load(s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<RMMA_STAGES - 2>();
        __syncthreads(); /* stage kt landed for all; the slot refilled below was last read before this */
        if (kt + RMMA_STAGES - 1 < ktiles) load(kt + RMMA_STAGES - 1);
        cp_async_commit();
        const uint32_t st = sbase + (uint32_t)(kt % RMMA_STAGES) * rmma_stage_bytes<PARTS>();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            uint32_t af[MI][4];
            mma_a_frags<BK>(st, wm * WTM, ks, af);
            /* the hi part into the first set of sums, mid and lo into the second (see the header above) */
#pragma unroll
            for (int m = 0; m < PARTS; m++)
                mma_b_step<__nv_bfloat16, BK>(st + RMMA_A_BYTES + m * RMMA_B_BYTES, wn * WTN, ks, af, acc[m > 0]);
        }
    }
    cp_async_wait<0>();
    /* accumulator layout of m16n8: rows lane / 4 (+8), columns 2 (lane % 4) (+1) */
    float *out = blockIdx.z == 0 ? logits : part + (size_t)(blockIdx.z - 1) * T * E;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int t = t0 + wm * WTM + i * 16 + (lane >> 2) + h * 8;
                const int e = e0 + wn * WTN + j * 8 + (lane & 3) * 2;
                if (t >= T) continue;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    float v = acc[0][i][j][2 * h + q];
                    if constexpr (SETS > 1) v += acc[SETS - 1][i][j][2 * h + q];
                    if (e + q < E) out[(size_t)t * E + e + q] = v;
                }
            }
}

/* hi, mid and lo ([3, n]) of n fp32 router weights: each part the bf16 rounding of what the parts before
 * it left (the differences are exact in fp32). A weight that is not finite or beyond bf16's range keeps
 * only hi (infinite or NaN), mid = lo = 0. *small is set where any mid or lo is not 0. */
__global__ void route_split_kernel(const float *r, size_t n, __nv_bfloat16 *out, int *small) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float v = r[i];
        const __nv_bfloat16 hi = __float2bfloat16(v);
        float rest = v - __bfloat162float(hi);
        if (!isfinite(rest)) rest = 0.0f;
        const __nv_bfloat16 mid = __float2bfloat16(rest);
        const __nv_bfloat16 lo = __float2bfloat16(rest - __bfloat162float(mid));
        out[i] = hi;
        out[n + i] = mid;
        out[2 * n + i] = lo;
        if (__bfloat162float(mid) != 0.0f || __bfloat162float(lo) != 0.0f) *small = 1;
    }
}

size_t colibri_cuda_route_split_elems(const colibri_moe_context_t *ctx, size_t tokens) {
    const colibri_moe_config_t *c = &ctx->cfg;
    if (!ctx->router_weight || tokens < ROUTE_GEMM_MIN_T || c->num_experts < ROUTE_GEMM_MIN_E || c->hidden_size % 8)
        return 0;
    return 3 * (size_t)c->num_experts * (size_t)c->hidden_size;
}

colibri_status_t colibri_cuda_route_setup(const colibri_moe_context_t *ctx, CudaBackend *b) {
    if (!b->router_split) return COLIBRI_OK;
    const size_t n = (size_t)ctx->cfg.num_experts * (size_t)ctx->cfg.hidden_size;
    int *d_small = NULL, small = 0;
    COLIBRI_CUDA_CHECK(cudaMalloc(&d_small, sizeof(int)));
    cudaError_t e = cudaMemset(d_small, 0, sizeof(int));
    if (e == cudaSuccess) {
        const size_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
        route_split_kernel<<<(unsigned)blocks, 256>>>(b->router, n, b->router_split, d_small);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpy(&small, d_small, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d_small);
    COLIBRI_CUDA_CHECK(e);
    b->router_parts = small ? 3 : 1;
    COLIBRI_CUDA_CHECK(
        cudaFuncSetAttribute(route_mma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, rmma_smem_bytes<1>()));
    COLIBRI_CUDA_CHECK(
        cudaFuncSetAttribute(route_mma_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, rmma_smem_bytes<3>()));
    return COLIBRI_OK;
}

static bool route_gemm_fits(const colibri_moe_context_t *ctx, int64_t T, const void *input) {
    return T >= ROUTE_GEMM_MIN_T && ctx->cfg.num_experts >= ROUTE_GEMM_MIN_E && ctx->cfg.hidden_size % 4 == 0 &&
           colibri_aligned16(input);
}

/* Returns the number of splits (the partial logits the top-k kernel must add), or 0 on a launch error. */
static int launch_route_gemm(const colibri_moe_context_t *ctx, int64_t T, colibri_dtype_t act_dtype,
                             const void *input, cudaStream_t stream, cudaError_t *err) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int E = ctx->cfg.num_experts, H = ctx->cfg.hidden_size;
    const RouteGemmPlan g = route_gemm_plan(b->sm_count, T, E, H);
    const dim3 grid((unsigned)((T + g.bt - 1) / g.bt), (unsigned)((E + g.be - 1) / g.be), (unsigned)g.splits);
    if (act_dtype == COLIBRI_DTYPE_BF16 && b->router_split && H % 8 == 0 && g.bt == 64 && g.be == 64) {
        const __nv_bfloat16 *split = b->router_split, *x = (const __nv_bfloat16 *)input;
        *err = b->router_parts == 1
                   ? colibri_launch(route_mma_kernel<1>, grid, dim3(RMMA_THREADS), rmma_smem_bytes<1>(), stream, split,
                                    x, (int)T, E, H, g.kchunk, b->logits, b->logits_part)
                   : colibri_launch(route_mma_kernel<3>, grid, dim3(RMMA_THREADS), rmma_smem_bytes<3>(), stream, split,
                                    x, (int)T, E, H, g.kchunk, b->logits, b->logits_part);
        return g.splits;
    }
    colibri_dispatch_dtype(act_dtype, [&](auto tx) {
        using TX = typename decltype(tx)::type;
        *err = colibri_launch(route_gemm_kernel<TX, 64, 64, 4>, grid, dim3(ROUTE_GEMM_THREADS), 0, stream,
                              (const float *)b->router, (const TX *)input, (int)T, E, H, g.kchunk, b->logits,
                              b->logits_part);
    });
    return g.splits;
}

/* Logits of T <= GEMV_GROUP tokens, block e = router row e, the 256 threads splitting H (VEC: 4
 * consecutive elements per thread and step, all steps of a thread in flight together). Fixed reduction
 * order: the same bits every run. Then, if p.ids, the last block to finish picks every token's top-k
 * (warp t takes token t), resets the counter for the next launch and, if tile_m > 0, runs the permutation
 * (by warp 0 up to PERMUTE_WARP_MAX assignments, else by the block; dynamic shared memory: route_small_smem). */
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
        if (p.logit_bias) s += p.logit_bias[e];
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
    if (permute_by_warp(T * p.k, p.E, po)) {
        if (warp == 0) permute_warp(p.ids, T * p.k, p.E, tile_m, po, permute_smem);
    } else {
        permute_block(p.ids, T * p.k, p.E, tile_m, po, permute_smem);
    }
}

static TopkArgs topk_args(const colibri_moe_context_t *ctx, int32_t *ids, float *wts) {
    const colibri_moe_config_t *c = &ctx->cfg;
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    TopkArgs p;
    p.bias = b->router_bias;
    p.logit_bias = b->router_logit_bias;
    p.E = c->num_experts;
    p.k = c->top_k;
    p.routing = c->routing;
    p.renormalize = c->renormalize;
    p.scale = c->routed_scaling_factor;
    p.ids = ids;
    p.wts = wts;
    p.n_group = c->n_group;
    p.topk_group = c->topk_group;
    p.group_score = c->group_score;
    return p;
}

/* The gemv's logits of T tokens, split along H by route_gemv_plan: split 0 into the logits, split s > 0
 * into logits_part[s - 1]. Returns the number of splits (what the top-k kernel must add), or 0 on a
 * launch error (in *err). */
static int launch_logits(const colibri_moe_context_t *ctx, int64_t T, colibri_dtype_t act_dtype, const void *input,
                         cudaStream_t stream, cudaError_t *err) {
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
    const RouteGemvPlan g = route_gemv_plan(b->sm_count, T, a.n, a.k, vec);
    colibri_dispatch_dtype(act_dtype, [&](auto tx) {
        *err = gemv_launch_groups<float, typename decltype(tx)::type, float>(
            a, (T + GEMV_GROUP - 1) / GEMV_GROUP, vec, g.splits, g.kchunk, b->logits_part, stream);
    });
    return *err == cudaSuccess ? g.splits : 0;
}

/* The dynamic shared memory of route_small_kernel's permutation of T tokens' assignments. */
static size_t route_small_smem(int64_t T, const colibri_moe_config_t *c, const PermuteArgs &po) {
    return permute_by_warp((int)(T * c->top_k), c->num_experts, po) ? sizeof(int) * 2 * (size_t)c->num_experts
                                                                     : permute_smem_bytes(256, c->num_experts);
}

/* T <= GEMV_GROUP: logits, (ids non-NULL) top-k and (tile_m > 0) the permutation in one launch. */
static cudaError_t launch_route_small(const colibri_moe_context_t *ctx, int64_t T, colibri_dtype_t act_dtype,
                                      const void *input, int32_t *ids, float *wts, int tile_m, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const TopkArgs p = topk_args(ctx, ids, wts);
    const PermuteArgs po = permute_args(b);
    const size_t smem = tile_m > 0 ? route_small_smem(T, c, po) : 0;
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
    const bool gemm = b->router && !small && route_gemm_fits(ctx, num_tokens, input);
    int splits = 1;
    /* the permutation rides along where its shared memory fits the default 48 KB */
    const bool fuse = small && !c->routing_fn && permute_tile_m > 0 &&
                      route_small_smem(num_tokens, c, permute_args(b)) <= 48 * 1024;
    if (permuted) *permuted = fuse;
    if (small) {
        COLIBRI_CUDA_CHECK(launch_route_small(ctx, num_tokens, act_dtype, input, c->routing_fn ? NULL : topk_ids,
                                              topk_weights, fuse ? permute_tile_m : 0, stream));
    } else if (gemm) {
        cudaError_t err = cudaSuccess;
        splits = launch_route_gemm(ctx, num_tokens, act_dtype, input, stream, &err);
        COLIBRI_CUDA_CHECK(err);
    } else if (b->router) {
        cudaError_t err = cudaSuccess;
        splits = launch_logits(ctx, num_tokens, act_dtype, input, stream, &err);
        COLIBRI_CUDA_CHECK(err);
    }
    /* The forward's L2 prefetch of the first expert weights runs beside the router's
     * first kernel, which lets its dependents launch as it starts. */
    if (b->router && permute_tile_m > 0) {
        colibri_status_t st = colibri_cuda_launch_prefetch(ctx, num_tokens, permute_tile_m, stream);
        if (st != COLIBRI_OK) return st;
    }
    const unsigned topk_blocks = (unsigned)((num_tokens + 7) / 8);
    if (c->routing_fn) {
        if (!small && (splits > 1 || b->router_logit_bias)) /* the routing_fn gets whole logits, biased */
            COLIBRI_CUDA_CHECK(colibri_launch(topk_kernel, dim3(topk_blocks), dim3(256), 0, stream, b->logits,
                                              (const float *)b->logits_part, splits, (int)num_tokens,
                                              topk_args(ctx, NULL, NULL)));
        colibri_status_t st = c->routing_fn(c->routing_user_data, num_tokens, c->num_experts, c->top_k, act_dtype,
                                            input, b->router ? b->logits : NULL, topk_ids, topk_weights, stream);
        if (st != COLIBRI_OK)
            return colibri_set_error(COLIBRI_ERR_ROUTING, "the routing_fn returned status %d (%s)", (int)st,
                                     colibri_status_string(st));
        return COLIBRI_OK;
    }
    if (small) return COLIBRI_OK;
    const TopkArgs p = topk_args(ctx, topk_ids, topk_weights);
    COLIBRI_CUDA_CHECK(colibri_launch(topk_kernel, dim3(topk_blocks), dim3(256), 0, stream, b->logits,
                                      (const float *)b->logits_part, splits, (int)num_tokens, p));
    return COLIBRI_OK;
}
