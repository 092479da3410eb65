/*
 * experts_instances.cuh — the seam between experts.cu (setup, and which projection runs) and the
 * expert kernels: one projection on the kernel that fits it, the folded combine, and the kernels'
 * setup, as class templates whose members experts_project.cuh defines and instances/*.cu instantiate,
 * one unit per weight dtype and activation tag, so that make -j compiles the kernels side by side.
 * experts.cu sees these declarations only, so it instantiates no kernel.
 */
#ifndef COLIBRI_CUDA_EXPERTS_INSTANCES_CUH
#define COLIBRI_CUDA_EXPERTS_INSTANCES_CUH

#include "activation.cuh"

/* One projection over the tile table (or, direct_ids given, over the distinct experts of those ids):
 * x rows -> out [positions, n] (compute dtype), weights at byte offset `first` (and `first + second` for
 * the up matrix of a GLU) inside each expert, `matrix` their index in an expert (colibri_scale_grid_offset:
 * fp8 weights' scales). `bookkeeping`: this projection keeps the direct mode's counters. Weights TW, x
 * TX, first-projection tag Act (ActLinear: a LINEAR layer's projection, and every down projection). */
template <class TW, class TX, class Act> struct ExpertProjection {
    static cudaError_t run(const colibri_moe_context_t *ctx, int64_t assignments, int32_t tile_m, size_t first,
                           size_t second, int matrix, int32_t n, int32_t k, const void *x, const int32_t *row_map,
                           void *out, bool x_aligned, const int32_t *direct_ids, bool bookkeeping,
                           cudaStream_t stream);
};

/* Direct mode's down projection with the combine folded in (gemv_combine_kernel), outputs TA. */
template <class TW, class TA> struct ExpertCombine {
    static cudaError_t run(const colibri_moe_context_t *ctx, int64_t assignments, size_t first,
                           const int32_t *direct_ids, const float *topk_weights, TA *out, cudaStream_t stream);
};

/* Setup of mma_kernel of weights TW (16-bit, or fp8) and tag Act: its shared memory. */
template <class TW, class Act> struct MmaSetup {
    static cudaError_t run(bool wide_k, bool long_k);
};

/* Blocks of the 16-row mma_kernel of tag Act and BN columns one SM holds (the plan's wave estimate). */
template <class Act, int BN> struct Mma16Occupancy {
    static int blocks_per_sm(bool wide_k, bool long_k);
};

/* Setup of the Hopper kernels of 16-bit weights TW and tag Act: wgmma_kernel, and wgmma_ws_kernel
 * (with tensor maps; *clusters: how many clusters of the MC kernel fit at once). */
template <class TW, class Act> struct WgmmaSetup {
    static cudaError_t wgmma();
    static cudaError_t ws(int *clusters);
};

#endif /* COLIBRI_CUDA_EXPERTS_INSTANCES_CUH */
