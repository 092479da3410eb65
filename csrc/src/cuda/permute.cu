/*
 * permute.cu — groups the T*k (token, slot) assignments by expert on the device, deterministically:
 * within an expert, assignments keep their order t*k+j, so every run produces the same layout.
 *
 * One block does it all (T*k is at most workspace_tokens * k, and one block avoids a grid-wide sync
 * that a graph could not express cheaply): a histogram with shared-memory integer atomics (the
 * counts do not depend on the order), a scan into expert offsets and a tile table, then a stable
 * scatter in which each warp ranks its 32 assignments with __match_any_sync and takes its base from a
 * per-warp, per-expert count. Ids out of range get no position (inv = -1) and raise bad_id.
 * Also: convert, which casts activations to the weight dtype for the tensor-core path.
 */
#include "permute.cuh"

__global__ void permute_kernel(const int32_t *ids, int n, int E, int tile_m, PermuteArgs o) {
    pdl_begin();
    extern __shared__ int smem[];
    permute_block(ids, n, E, tile_m, o, smem);
}

colibri_status_t colibri_cuda_permute_setup(CudaBackend *b, int32_t num_experts) {
    /* the per-warp counts take warps * E ints: fewer warps for many experts keep them in shared memory */
    int warps = 4096 / num_experts;
    warps = warps < 1 ? 1 : warps > 32 ? 32 : warps;
    b->permute_threads = warps * 32;
    b->permute_smem = permute_smem_bytes(b->permute_threads, num_experts);
    int optin = 0;
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, b->device));
    if (b->permute_smem > (size_t)optin)
        return colibri_set_error(COLIBRI_ERR_UNSUPPORTED, "%d experts need %zu bytes of shared memory to permute; "
                                 "the device allows %d", num_experts, b->permute_smem, optin);
    COLIBRI_CUDA_CHECK(cudaFuncSetAttribute(permute_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)b->permute_smem));
    return COLIBRI_OK;
}

colibri_status_t colibri_cuda_launch_permute(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             const int32_t *topk_ids, int32_t tile_m, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int n = (int)(num_tokens * ctx->cfg.top_k);
    COLIBRI_CUDA_CHECK(colibri_launch(permute_kernel, dim3(1), dim3(b->permute_threads), b->permute_smem, stream,
                                      topk_ids, n, ctx->cfg.num_experts, tile_m, permute_args(b)));
    return COLIBRI_OK;
}

template <class TS, class TD> __global__ void convert_kernel(const TS *src, TD *dst, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = from_f32<TD>(to_f32(src[i]));
}

colibri_status_t colibri_cuda_launch_convert(const void *src, colibri_dtype_t src_dtype, void *dst,
                                             colibri_dtype_t dst_dtype, int64_t n, cudaStream_t stream) {
    const unsigned blocks = (unsigned)(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_dtype(src_dtype, [&](auto ts) {
        colibri_dispatch_dtype(dst_dtype, [&](auto td) {
            using TS = typename decltype(ts)::type;
            using TD = typename decltype(td)::type;
            err = colibri_launch(convert_kernel<TS, TD>, dim3(blocks), dim3(256), 0, stream, (const TS *)src, (TD *)dst, n);
        });
    });
    COLIBRI_CUDA_CHECK(err);
    return COLIBRI_OK;
}
