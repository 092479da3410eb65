/*
 * routing.h — the built-in routing of colibri.h (colibri_routing_t) as small functions that the CPU
 * backend (C99) and the CUDA kernels (host and device) both call, so the two cannot drift apart: the
 * per-expert score p, the selection score s, the selection order, the group limit and the weights.
 * The CUDA warp kernels spread a token's experts over lanes, but every value they form comes from
 * these functions, in the order written here.
 */
#ifndef COLIBRI_ROUTING_H
#define COLIBRI_ROUTING_H

#include <math.h>

#include "colibri.h"

#ifdef __CUDACC__
#define COLIBRI_HD __host__ __device__ __forceinline__
#else
#define COLIBRI_HD static inline
#endif

/* Whether colibri.h defines the routing (config validation). */
COLIBRI_HD int colibri_route_known(colibri_routing_t routing) {
    return routing == COLIBRI_ROUTING_SOFTMAX_TOPK || routing == COLIBRI_ROUTING_TOPK_SOFTMAX ||
           routing == COLIBRI_ROUTING_SIGMOID_BIAS;
}
/* Whether the routing selects with router_bias (required then; ignored by the others) */
COLIBRI_HD int colibri_route_uses_bias(colibri_routing_t routing) { return routing == COLIBRI_ROUTING_SIGMOID_BIAS; }

/* What the parallel code must gather for a routing before the functions below can run; route.cu's warps
 * and moe_cpu.c ask these instead of naming routings. */
/* p needs softmax's max and sum over the token's logits (colibri_route_prob's mx and sum) */
COLIBRI_HD int colibri_route_softmax_all(colibri_routing_t routing) { return routing == COLIBRI_ROUTING_SOFTMAX_TOPK; }
/* the weights start from the first pick's value (colibri_route_unnormed's `first`) */
COLIBRI_HD int colibri_route_softmax_picks(colibri_routing_t routing) { return routing == COLIBRI_ROUTING_TOPK_SOFTMAX; }
/* the weights are divided by a sum over the picks (colibri_route_norm) */
COLIBRI_HD int colibri_route_sums_picks(colibri_routing_t routing, int renormalize) {
    return colibri_route_softmax_picks(routing) || renormalize;
}

/* Softmax's term of one logit, given the max mx of the token's logits: the sum of these is colibri_route_prob's
 * `sum` (summed in the order each backend states). */
COLIBRI_HD float colibri_route_softmax_term(float logit, float mx) { return expf(logit - mx); }

/* p_e from logit l_e; mx and sum are softmax's max and sum of terms over the token (SOFTMAX_TOPK). */
COLIBRI_HD float colibri_route_prob(colibri_routing_t routing, float logit, float mx, float sum) {
    return routing == COLIBRI_ROUTING_SOFTMAX_TOPK   ? colibri_route_softmax_term(logit, mx) / sum
           : routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0f / (1.0f + expf(-logit))
                                                     : logit;
}

/* The score top-k selects on: SIGMOID_BIAS p + bias[e], the others the logit itself (softmax keeps its
 * order, and the logit has no rounding that could tie two experts), so no selection needs softmax's sums.
 * NaN ranks last, like -inf, so that k valid ids always come out. */
COLIBRI_HD float colibri_route_select(colibri_routing_t routing, float logit, const float *bias, int e) {
    const float s = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? colibri_route_prob(routing, logit, 0.0f, 1.0f) + bias[e]
                                                            : logit;
    return s != s ? -INFINITY : s;
}

/* Selection order: the higher score first, ties to the lower id. */
COLIBRI_HD int colibri_route_before(float s, int e, float best_s, int best_e) {
    return s > best_s || (s == best_s && e < best_e);
}

/* A group's score from its selection scores, fed in ascending id to colibri_route_group_add (first and
 * second start at -INFINITY), then colibri_route_group_score: the max, or the sum of the two highest. */
COLIBRI_HD void colibri_route_group_add(float v, float *first, float *second) {
    if (v > *first) *second = *first, *first = v;
    else if (v > *second) *second = v;
}
COLIBRI_HD float colibri_route_group_score(colibri_group_score_t how, float first, float second) {
    const float g = how == COLIBRI_GROUP_SCORE_TOP2_SUM ? first + second : first;
    return g != g ? -INFINITY : g;
}

/* Group limit (n_group > 1): s[0..E) are selection scores; every expert of a group outside the
 * topk_group best groups gets -INFINITY, so a plain top-k then picks among the kept groups only.
 * group[] is scratch of n_group floats. Group order is the selection order (ties to the lower group). */
COLIBRI_HD void colibri_route_limit_groups(float *s, int E, int n_group, int topk_group,
                                           colibri_group_score_t how, float *group) {
    const int size = E / n_group;
    for (int g = 0; g < n_group; g++) {
        float first = -INFINITY, second = -INFINITY;
        for (int i = 0; i < size; i++) colibri_route_group_add(s[g * size + i], &first, &second);
        group[g] = colibri_route_group_score(how, first, second);
    }
    for (int g = 0; g < n_group; g++) {
        int rank = 0; /* groups ranked before g */
        for (int h = 0; h < n_group; h++) rank += colibri_route_before(group[h], h, group[g], g);
        if (rank >= topk_group)
            for (int i = 0; i < size; i++) s[g * size + i] = -INFINITY;
    }
}

/* A pick's weight before the normalisation, from its p (TOPK_SOFTMAX: its logit, and `first` the first
 * pick's, the largest). */
COLIBRI_HD float colibri_route_unnormed(colibri_routing_t routing, float p, float first) {
    return colibri_route_softmax_picks(routing) ? expf(p - first) : p;
}

/* The divisor of the weights from the sum of the unnormed weights of the picks in pick order. A sum of
 * zero only comes from sigmoids that underflowed: renormalising leaves those weights at zero. */
COLIBRI_HD float colibri_route_norm(colibri_routing_t routing, int renormalize, float sum) {
    if (colibri_route_softmax_picks(routing)) return sum;
    return renormalize && sum > 0.0f ? sum : 1.0f;
}

/* A pick's final weight */
COLIBRI_HD float colibri_route_weight(float unnormed, float norm, float scale) { return unnormed / norm * scale; }

/* The weights of the k picks, in place: w[j] holds p of pick j on entry (picks in descending order). */
COLIBRI_HD void colibri_route_weights(colibri_routing_t routing, int renormalize, float scale, float *w, int k) {
    const float first = w[0];
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += w[j] = colibri_route_unnormed(routing, w[j], first);
    const float norm = colibri_route_norm(routing, renormalize, sum);
    for (int j = 0; j < k; j++) w[j] = colibri_route_weight(w[j], norm, scale);
}

#endif /* COLIBRI_ROUTING_H */
