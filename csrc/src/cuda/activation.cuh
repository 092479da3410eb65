/*
 * activation.cuh — what an expert does between its projections, as a tag type the expert kernels take
 * (gemv.cuh, sm80_mma_experts.cuh, sm90_*.cuh): `glu` says whether the first projection multiplies a gate
 * and an up matrix; apply(gate, up, args) forms the output from their sums. colibri_dispatch_act is
 * the one place that maps a layer's config to its tag.
 */
#ifndef COLIBRI_CUDA_ACTIVATION_CUH
#define COLIBRI_CUDA_ACTIVATION_CUH

#include "cuda_backend.cuh"

/* silu(g) = h + h tanh(h), h = g / 2: one MUFU op where expf and a division take two, for the wgmma
 * epilogue, which those units bound while the tensor cores idle (docs/performance.md). */
__device__ __forceinline__ float silu_fast_f32(float g) {
    const float h = 0.5f * g;
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(h));
    return fmaf(h, t, h);
}

/* A tag gives apply (accurate) and apply_fast (what the wgmma epilogue uses), both taking the kernel's
 * ProjArgs, where a tag with runtime parameters (a clamp, a slope) finds them. A new tag needs a case
 * in colibri_dispatch_act and a line in colibri_for_each_act. */

/* One matrix, whose sum is the output: LINEAR experts, and every down projection. */
struct ActLinear {
    static constexpr bool glu = false;
    template <class Args> static __device__ __forceinline__ float apply(float gate, float, const Args &) {
        return gate;
    }
    template <class Args> static __device__ __forceinline__ float apply_fast(float gate, float, const Args &) {
        return gate;
    }
};

/* silu(gate) * up: SWIGLU experts. */
struct ActSilu {
    static constexpr bool glu = true;
    template <class Args> static __device__ __forceinline__ float apply(float gate, float up, const Args &) {
        return silu_f32(gate) * up;
    }
    template <class Args> static __device__ __forceinline__ float apply_fast(float gate, float up, const Args &) {
        return silu_fast_f32(gate) * up;
    }
};

/* gpt-oss's clamped SwiGLU (colibri.h, SWIGLU_OAI), alpha and limit from the args: the clamps are
 * comparisons, so that NaN stays NaN (fminf would turn it into the limit). */
struct ActOai {
    static constexpr bool glu = true;
    template <class Args> static __device__ __forceinline__ void clamp(float &g, float &u, const Args &a) {
        const float l = a.act_limit;
        g = g > l ? l : g;
        u = u > l ? l : u < -l ? -l : u;
    }
    template <class Args> static __device__ __forceinline__ float apply(float gate, float up, const Args &a) {
        clamp(gate, up, a);
        return (up + 1.0f) * (gate / (1.0f + expf(-a.act_alpha * gate)));
    }
    template <class Args> static __device__ __forceinline__ float apply_fast(float gate, float up, const Args &a) {
        clamp(gate, up, a);
        /* g sigmoid(alpha g) = h + h tanh(alpha h), h = g / 2, as silu_fast_f32 */
        const float h = 0.5f * gate;
        float t;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(a.act_alpha * h));
        return (up + 1.0f) * fmaf(h, t, h);
    }
};

/* The first projection's gate and up biases of output column col of `expert` (a.bias: rows of
 * a.bias_stride floats, the up biases a.n on), added before the activation; nothing without them. */
template <class Args>
__device__ __forceinline__ void colibri_glu_bias(const Args &a, int expert, int col, float &gate, float &up) {
    if (a.bias && col < a.n) { /* columns past n (a partial block) are never stored */
        const float *b = a.bias + (size_t)expert * a.bias_stride + col;
        gate += __ldg(b);
        up += __ldg(b + a.n);
    }
}

/* Calls f(Act{}) with the tag of the first projection of c's experts. */
template <class F> static inline void colibri_dispatch_act(const colibri_moe_config_t *c, F &&f) {
    switch (c->expert_kind) {
    case COLIBRI_EXPERT_SWIGLU:
        if (c->activation == COLIBRI_ACTIVATION_SWIGLU_OAI) f(ActOai{});
        else f(ActSilu{});
        break;
    case COLIBRI_EXPERT_LINEAR: f(ActLinear{}); break;
    }
}

/* Whether c's first projection has a gate and an up matrix. */
static inline bool colibri_act_glu(const colibri_moe_config_t *c) {
    bool glu = false;
    colibri_dispatch_act(c, [&](auto act) { glu = decltype(act)::glu; });
    return glu;
}

/* Calls f(Act{}) for every tag, so that setup prepares each one's kernels. */
template <class F> static inline void colibri_for_each_act(F &&f) {
    f(ActLinear{});
    f(ActSilu{});
    f(ActOai{});
}

#endif /* COLIBRI_CUDA_ACTIVATION_CUH */
