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

/* p_e from logit l_e; mx and sum are softmax's max and sum of exp(l - mx) over the token (SOFTMAX_TOPK). */
COLIBRI_HD float colibri_route_prob(colibri_routing_t routing, float logit, float mx, float sum) {
    return routing == COLIBRI_ROUTING_SOFTMAX_TOPK   ? expf(logit - mx) / sum
           : routing == COLIBRI_ROUTING_SIGMOID_BIAS ? 1.0f / (1.0f + expf(-logit))
                                                     : logit;
}

/* The score top-k selects on: SIGMOID_BIAS p + bias[e], the others the logit itself (softmax keeps its
 * order, and the logit has no rounding that could tie two experts). NaN ranks last, like -inf, so that
 * k valid ids always come out. */
COLIBRI_HD float colibri_route_select(colibri_routing_t routing, float logit, float p, const float *bias, int e) {
    const float s = routing == COLIBRI_ROUTING_SIGMOID_BIAS ? p + bias[e] : logit;
    return s != s ? -INFINITY : s;
}

/* Selection order: the higher score first, ties to the lower id. */
COLIBRI_HD int colibri_route_before(float s, int e, float best_s, int best_e) {
    return s > best_s || (s == best_s && e < best_e);
}

/* Group limit (n_group > 1): s[0..E) are selection scores; every expert of a group outside the
 * topk_group best groups gets -INFINITY, so a plain top-k then picks among the kept groups only.
 * group[] is scratch of n_group floats. Group order is the selection order (ties to the lower group). */
COLIBRI_HD void colibri_route_limit_groups(float *s, int E, int n_group, int topk_group,
                                           colibri_group_score_t how, float *group) {
    const int size = E / n_group;
    for (int g = 0; g < n_group; g++) {
        float first = -INFINITY, second = -INFINITY;
        for (int i = 0; i < size; i++) {
            const float v = s[g * size + i];
            if (v > first) second = first, first = v;
            else if (v > second) second = v;
        }
        group[g] = how == COLIBRI_GROUP_SCORE_TOP2_SUM ? first + second : first;
        if (group[g] != group[g]) group[g] = -INFINITY;
    }
    for (int g = 0; g < n_group; g++) {
        int rank = 0; /* groups ranked before g */
        for (int h = 0; h < n_group; h++) rank += colibri_route_before(group[h], h, group[g], g);
        if (rank >= topk_group)
            for (int i = 0; i < size; i++) s[g * size + i] = -INFINITY;
    }
}

/* The weights of the k picks, in place: w[j] holds p of pick j (TOPK_SOFTMAX: its logit, picks in
 * descending order so w[0] is the largest). */
COLIBRI_HD void colibri_route_weights(colibri_routing_t routing, int renormalize, float scale, float *w, int k) {
    float norm = 1.0f;
    if (routing == COLIBRI_ROUTING_TOPK_SOFTMAX) {
        const float m = w[0];
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += w[j] = expf(w[j] - m);
        norm = sum;
    } else if (renormalize) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += w[j];
        /* a sum of zero only comes from sigmoids that underflowed; leave those weights at zero */
        if (sum > 0.0f) norm = sum;
    }
    for (int j = 0; j < k; j++) w[j] = w[j] / norm * scale;
}

#endif /* COLIBRI_ROUTING_H */
