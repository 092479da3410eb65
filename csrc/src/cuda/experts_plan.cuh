/*
 * experts_plan.cuh — what experts_plan.cu decides for experts.cu's launchers: which variant of a kernel
 * a projection runs and how its grid is sized. Host only; what context.cu asks of the plan is
 * declared in cuda_backend.cuh.
 */
#ifndef COLIBRI_CUDA_EXPERTS_PLAN_CUH
#define COLIBRI_CUDA_EXPERTS_PLAN_CUH

#include "cuda_backend.cuh"

/* Whether the 128-row tiles of a projection of `assignments` stream their weights from HBM. */
bool plan_wg_streaming(const colibri_moe_config_t *c, int64_t assignments);
/* The mma_kernel variant of a projection of n outputs and k-element rows over tile_m-row tiles: the
 * BK=128 kernel (long_k, see mma_bk) and, for 16-row tiles, the narrow one. */
void plan_mma_variant(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, int32_t tile_m, bool glu,
                      int32_t n, int32_t k, bool *long_k, bool *narrow);
/* Clusters of two the cluster kernel runs for a projection of 128-row tiles (0: the one-block kernel). */
int plan_ws_clusters(const CudaBackend *b, const colibri_moe_config_t *c, int64_t assignments);
/* Whether a projection of 128-row tiles and k-element rows runs wgmma_ws_kernel's DRAIN variant. */
bool plan_ws_drain(const colibri_moe_config_t *c, int64_t assignments, int32_t k);
/* > 0: the two projections chain per tile, the second waiting for this many column blocks of the
 * first in each tile; 0: the grid dependency. */
int32_t plan_ws_chain(const colibri_moe_context_t *ctx, bool direct, int clusters);
/* The gemv's blocks along the rows for rows of row_bytes (both matrices), slots blocks along x:
 * > 0 where direct mode's warps loop over rows, else 0 (a block per 8 rows). */
int plan_gemv_row_blocks(const CudaBackend *b, bool direct, size_t row_bytes, int64_t slots);
/* Output rows per block of gemv_combine_kernel over n outputs of rows of row_bytes. */
int plan_combine_rows(const CudaBackend *b, size_t row_bytes, int32_t n, int64_t assignments);

#endif /* COLIBRI_CUDA_EXPERTS_PLAN_CUH */
