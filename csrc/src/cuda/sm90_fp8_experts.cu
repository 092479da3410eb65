/*
 * sm90_fp8_experts.cu — the fp8 expert pass on Hopper tensor cores, for tiles of 128 rows (experts_plan.cu
 * chooses it): the tokens quantised to fp8 per 128 columns (fp8_quant.cuh), the first projection by
 * wgmma_fp8_kernel into bf16 inter (SWIGLU) or y (LINEAR), then for SWIGLU inter quantised and the down
 * projection into bf16 y, which combine.cu sums as for bf16 weights. docs/cuda-design.md ("fp8 weights").
 */
#include "sm90_fp8_experts.cuh"

cudaError_t colibri_cuda_fp8_setup(void) {
#if COLIBRI_TMA
    cudaError_t e = cudaSuccess;
    colibri_for_each_act([&](auto act) {
        if (e == cudaSuccess) e = wgmma_fp8_setup_one<decltype(act)>();
    });
    return e;
#else
    return cudaErrorNotSupported;
#endif
}

bool colibri_cuda_fp8_tensor_cores(const colibri_moe_context_t *ctx) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    return b->fp8_tc && c->weight_dtype == COLIBRI_DTYPE_F8E4M3 && c->hidden_size % 16 == 0 &&
           c->intermediate_size % 16 == 0 && fp8_scales_fit(c->scale_block_n, c->scale_block_k);
}

#if COLIBRI_TMA
/* The arguments of one projection: matrix `matrix` of each expert (colibri_scale_grid_offset), n x k. */
static Fp8ProjArgs fp8_args(const colibri_moe_context_t *ctx, int matrix, int32_t n, int32_t k) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    Fp8ProjArgs a = {};
    a.n = n;
    a.k = k;
    a.tiles = b->tiles;
    a.num_tiles = b->num_tiles;
    a.w_scales = b->expert_scales + colibri_scale_grid_offset(c, matrix);
    a.ws_expert_stride = ctx->scales_numel;
    a.w_second_scales = colibri_scale_grid_offset(c, 1);
    a.sbn = c->scale_block_n;
    a.sbk = c->scale_block_k;
    a.s_cols = colibri_scale_blocks(k, c->scale_block_k);
    a.per_channel = c->scale_block_n == 1 && c->scale_block_k == 0;
    a.act_alpha = c->activation_alpha;
    a.act_limit = c->activation_limit;
    return a;
}
#endif

colibri_status_t colibri_cuda_launch_fp8_experts(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                                 colibri_dtype_t act_dtype, const void *input, cudaStream_t stream) {
#if COLIBRI_TMA
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const int64_t positions = num_tokens * c->top_k, E = c->num_experts;
    const int32_t H = c->hidden_size, F = c->intermediate_size;
    const bool swiglu = c->expert_kind == COLIBRI_EXPERT_SWIGLU, glu = colibri_act_glu(c);
    /* the most tiles the table can hold, as project()'s slots */
    const int64_t slots = positions / WG_BM + (positions < E ? positions : E);
    cudaError_t err = cudaErrorInvalidValue;
    colibri_dispatch_dtype(act_dtype, [&](auto tx) {
        using TX = typename decltype(tx)::type;
        err = fp8_quant_launch((const TX *)input, num_tokens, H, b->xq, b->xq_scales, b->sm_count, stream);
    });
    COLIBRI_CUDA_CHECK(err);

    Fp8ProjArgs a = fp8_args(ctx, 0, F, H);
    a.x = b->xq;
    a.x_scales = b->xq_scales;
    a.row_map = b->perm;
    a.row_div = c->top_k;
    a.out = (__nv_bfloat16 *)(swiglu ? b->inter : b->y);
    a.bias = glu ? b->expert_bias : NULL;
    a.bias_stride = ctx->bias_numel;
    CUtensorMap map;
    if (!fp8_tensor_map(b->tma_encode, (const uint8_t *)b->d_weights, b->expert_stride, F, H, glu, (int)E, &map))
        return colibri_set_error(COLIBRI_ERR_CUDA, "the driver did not encode the fp8 weights' tensor map");
    colibri_dispatch_act(c, [&](auto act) {
        err = wgmma_fp8_launch<decltype(act)>(map, a, slots, b->sm_count, stream);
    });
    COLIBRI_CUDA_CHECK(err);
    if (!swiglu) return COLIBRI_OK;

    COLIBRI_CUDA_CHECK(fp8_quant_launch((const __nv_bfloat16 *)b->inter, positions, F, b->inter_q, b->inter_q_scales,
                                        b->sm_count, stream));
    a = fp8_args(ctx, 2, H, F);
    a.x = b->inter_q;
    a.x_scales = b->inter_q_scales;
    a.row_div = 1;
    a.out = (__nv_bfloat16 *)b->y;
    if (!fp8_tensor_map(b->tma_encode, (const uint8_t *)b->d_weights + 2 * (size_t)F * H, b->expert_stride, H, F, false,
                        (int)E, &map))
        return colibri_set_error(COLIBRI_ERR_CUDA, "the driver did not encode the fp8 weights' tensor map");
    COLIBRI_CUDA_CHECK(wgmma_fp8_launch<ActLinear>(map, a, slots, b->sm_count, stream));
    return COLIBRI_OK;
#else
    (void)ctx, (void)num_tokens, (void)act_dtype, (void)input, (void)stream;
    return colibri_set_error(COLIBRI_ERR_UNSUPPORTED, "fp8 tensor cores need a CUDA 12 build");
#endif
}
