/*
 * experts_project.cuh — the definitions behind experts_instances.cuh: one projection on the kernel the
 * plan picks (gemv.cuh for few rows, sm80_mma_experts.cuh for 16-128 rows, sm90_wgmma_ws_experts.cuh or
 * sm90_wgmma_experts.cuh for 128 rows on sm_90a), the folded combine, and the kernels' setup. Included by
 * instances/*.cu only: each unit instantiates the kernels of one weight dtype and activation tag.
 */
#ifndef COLIBRI_CUDA_EXPERTS_PROJECT_CUH
#define COLIBRI_CUDA_EXPERTS_PROJECT_CUH

#include "experts_instances.cuh"
#include "experts_plan.cuh"
#include "gemv.cuh"
#include "sm80_mma_experts.cuh"
#include "sm90_wgmma_experts.cuh"
#include "sm90_wgmma_ws_experts.cuh"

template <class TW, class TX, class Act>
cudaError_t ExpertProjection<TW, TX, Act>::run(const colibri_moe_context_t *ctx, int64_t assignments, int32_t tile_m,
                                               size_t first, size_t second, int matrix, int32_t n, int32_t k,
                                               const void *x, const int32_t *row_map, void *out, bool x_aligned,
                                               const int32_t *direct_ids, bool bookkeeping, cudaStream_t stream) {
    constexpr bool f8 = is_fp8<TW>;
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int64_t active = assignments < ctx->cfg.num_experts ? assignments : ctx->cfg.num_experts;
    int64_t slots = assignments / tile_m + active;
    ProjArgs a = {};
    a.w = b->d_weights + first;
    a.w_expert_stride = b->expert_stride;
    a.w_second = second;
    a.n = n;
    a.k = k;
    a.x = x;
    a.row_map = row_map;
    a.row_div = ctx->cfg.top_k;
    a.out = out;
    a.tiles = b->tiles;
    a.num_tiles = b->num_tiles;
    a.sched = b->ws_sched + (row_map ? 0 : 2);
    /* a GLU is a first projection: its gate and up biases (the output biases are combine.cu's) */
    a.bias = Act::glu ? b->expert_bias : NULL;
    a.bias_stride = ctx->bias_numel;
    a.act_alpha = ctx->cfg.activation_alpha;
    a.act_limit = ctx->cfg.activation_limit;
    if (direct_ids) {
        /* positions are assignment indices: x row t = position / k for the first projection, which reads
         * the tokens (row_map given), the position itself for the second, which reads inter */
        a.row_div = row_map ? ctx->cfg.top_k : 1;
        a.tiles = NULL;
        a.num_tiles = NULL;
        a.row_map = NULL;
        a.ids = direct_ids;
        a.num_ids = (int32_t)assignments;
        a.num_experts = ctx->cfg.num_experts;
        a.totals = bookkeeping ? b->totals : NULL;
        a.bad_id = bookkeeping ? b->bad_id : NULL;
        a.early = !bookkeeping;
        slots = active;
    }
    if (tile_m <= GEMV_GROUP) {
        const size_t row_bytes = (size_t)k * sizeof(TW) * (Act::glu ? 2 : 1);
        const int row_blocks = plan_gemv_row_blocks(b, direct_ids != NULL, row_bytes, slots);
        const bool vec = k % colibri_cuda_vec_multiple(ctx->cfg.weight_dtype) == 0 && x_aligned; /* 16-byte loads */
        return gemv_launch<TW, TX, compute_t<TW>, Act>(a, slots, tile_m, vec, row_blocks,
                                                       colibri_cuda_scale_grid(ctx, matrix, k), stream);
    }
    if constexpr (sizeof(TW) == 2 && std::is_same<TW, TX>::value) {
#if COLIBRI_TMA
        /* a GLU: the map takes the up matrix as the gate matrix's next n rows */
        CUtensorMap map;
        if (tile_m == WG_BM && b->tma_encode && (!Act::glu || second == (size_t)n * k * sizeof(TW)) &&
            ws_tensor_map<TW, Act::glu>(b->tma_encode, a, ctx->cfg.num_experts, &map)) {
            const int clusters = plan_ws_clusters(b, &ctx->cfg, assignments);
            const int32_t chain = plan_ws_chain(ctx, direct_ids != NULL, clusters);
            if (chain > 0) {
                a.ready = b->ws_ready;
                a.ready_need = Act::glu ? 0 : chain;
            }
            const bool drain = plan_ws_drain(&ctx->cfg, assignments, k);
            return wgmma_ws_launch<TW, Act>(map, a, slots, b->sm_count, clusters, drain, stream);
        }
        /* the tile table may hold extra rows (colibri_cuda_experts_absorb) that only wgmma_ws_kernel computes */
        if (!direct_ids && colibri_cuda_experts_absorb(ctx, tile_m) > 0) return cudaErrorNotSupported;
#endif
        if (tile_m == WG_BM && b->wgmma)
            return wgmma_launch<TW, Act>(a, slots, b->sm_count, plan_wg_streaming(&ctx->cfg, assignments), stream);
        a.early = !bookkeeping; /* the second projection issues its first weights before its wait */
        bool long_k, narrow;
        plan_mma_variant(b, &ctx->cfg, assignments / ctx->cfg.top_k, tile_m, Act::glu, n, k, &long_k, &narrow);
        return mma_launch<TW, Act>(a, tile_m, slots, b->mma_wide_k, long_k, narrow, stream);
    }
    if constexpr (f8 && std::is_same<TX, __nv_bfloat16>::value) {
        /* fp8 weights the fp8 tensor cores do not take (sm_80, scale blocks they cannot fold in): mma_kernel
         * widens each stage's weights to bf16 times their scales (sm80_mma_experts.cuh) */
        a.early = !bookkeeping;
        bool long_k, narrow;
        plan_mma_variant(b, &ctx->cfg, assignments / ctx->cfg.top_k, tile_m, Act::glu, n, k, &long_k, &narrow);
        return mma_launch<TW, Act>(a, tile_m, slots, b->mma_wide_k, long_k, narrow,
                                   colibri_cuda_scale_grid(ctx, matrix, k), stream);
    }
    return cudaErrorInvalidValue;
}

/* As a ProjArgs like ExpertProjection's; plan_combine_rows sizes its blocks. */
template <class TW, class TA>
cudaError_t ExpertCombine<TW, TA>::run(const colibri_moe_context_t *ctx, int64_t assignments, size_t first,
                                       const int32_t *direct_ids, const float *topk_weights, TA *out,
                                       cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int32_t H = ctx->cfg.hidden_size, F = ctx->cfg.intermediate_size;
    ProjArgs a = {};
    a.w = b->d_weights + first;
    a.w_expert_stride = b->expert_stride;
    a.n = H;
    a.k = F;
    a.x = b->inter;
    a.row_div = 1;
    a.ids = direct_ids;
    a.num_ids = (int32_t)assignments;
    a.num_experts = ctx->cfg.num_experts;
    const int rows = plan_combine_rows(b, (size_t)F * sizeof(TW), H, assignments);
    return gemv_combine_launch<TW, TA>(a, topk_weights, ctx->cfg.top_k, rows, out, colibri_cuda_output_bias(ctx),
                                       ctx->bias_numel, colibri_cuda_scale_grid(ctx, 2, F), stream);
}

template <class TW, class Act> cudaError_t MmaSetup<TW, Act>::run(bool wide_k, bool long_k) {
    return mma_setup_all<TW, Act>(wide_k, long_k);
}

template <class Act, int BN> int Mma16Occupancy<Act, BN>::blocks_per_sm(bool wide_k, bool long_k) {
    return mma16_blocks_per_sm<Act, BN>(wide_k, long_k);
}

template <class TW, class Act> cudaError_t WgmmaSetup<TW, Act>::wgmma() { return wgmma_setup_one<TW, Act>(); }

template <class TW, class Act> cudaError_t WgmmaSetup<TW, Act>::ws(int *clusters) {
#if COLIBRI_TMA
    return wgmma_ws_setup_one<TW, Act>(clusters);
#else
    (void)clusters;
    return cudaErrorNotSupported;
#endif
}

#endif /* COLIBRI_CUDA_EXPERTS_PROJECT_CUH */
