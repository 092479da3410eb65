/*
 * permute.cu — groups the T*k (token, slot) assignments by expert on the device, stably: within an
 * expert, assignments keep their order t*k+j, so every run produces the same layout.
 * Up to PERMUTE_MULTI_MIN assignments one block (up to PERMUTE_WARP_MAX, one warp) does it all
 * (permute.cuh): histogram, scan into offsets and the tile table, stable scatter. Beyond, two launches
 * over chunks: permute_count_kernel (per-chunk histograms; the last block scans) and
 * permute_scatter_kernel (block b starts expert e at offsets[e] plus chunks 0..b-1's counts). Ids out
 * of range get no position (inv = -1) and raise bad_id. Also the shared expert's slots (shared_slots_kernel)
 * and convert_kernel, which casts activations to the weight dtype for the tensor-core path.
 * docs/cuda-design.md ("Permutation") says more.
 */
#include "permute.cuh"

/* Below this, one block permutes faster than the two multi-block launches (docs/performance.md). */
#define PERMUTE_MULTI_MIN 4096

/* The expert projection may launch once the tile table is written rather than at the start, which ends
 * it sooner (docs/performance.md); it still waits for this kernel's end before it reads anything. */
__global__ void permute_kernel(const int32_t *ids, int n, int E, int tile_m, PermuteArgs o) {
    pdl_wait();
    extern __shared__ int smem[];
    if (permute_by_warp(n, E, o)) {
        if (threadIdx.x < 32) permute_warp(ids, n, E, tile_m, o, smem, true);
        return;
    }
    permute_block(ids, n, E, tile_m, o, smem, true);
}

/* Multi-block pass 1: chunk histograms; the last block writes offsets and tiles (file header).
 * Shared memory: permute_count_smem_bytes. */
__global__ void permute_count_kernel(const int32_t *ids, int n, int E, int tile_m, PermuteArgs o, int32_t *hist,
                                     int32_t *counts, unsigned *done) {
    pdl_begin();
    extern __shared__ int smem[];
    /* [E], [32], [(E + 1) / 2]; count then holds the forward's totals */
    int *count = smem, *warp_sums = smem + E, *pair_ends = warp_sums + 32;
    __shared__ bool s_last;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    const int c0 = blockIdx.x * blockDim.x * PERMUTE_MULTI_ROUNDS;
    int e[PERMUTE_MULTI_ROUNDS];
#pragma unroll
    for (int r = 0; r < PERMUTE_MULTI_ROUNDS; r++) { /* all loads in flight before the first atomic */
        const int i = c0 + r * blockDim.x + threadIdx.x;
        e[r] = i < n ? ids[i] : 0;
    }
    bool bad = false;
#pragma unroll
    for (int r = 0; r < PERMUTE_MULTI_ROUNDS; r++) {
        if (c0 + r * (int)blockDim.x + (int)threadIdx.x >= n) continue;
        if ((unsigned)e[r] < (unsigned)E) atomicAdd(&count[e[r]], 1);
        else bad = true;
    }
    if (bad) *o.bad_id = 1;
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        const int c = count[x];
        hist[(size_t)blockIdx.x * E + x] = c;
        if (c) atomicAdd(&counts[x], c);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        count[x] = __ldcg(counts + x);
        counts[x] = 0; /* for the next launch */
    }
    if (threadIdx.x == 0) *done = 0;
    __syncthreads();
    permute_scan(count, E, tile_m, o, NULL, warp_sums, pair_ends);
}

/* Multi-block pass 2: block b's stable scatter of its chunk. Shared memory: permute_multi_smem_bytes. */
__global__ void permute_scatter_kernel(const int32_t *ids, int n, int E, PermuteArgs o, const int32_t *hist) {
    pdl_begin();
    extern __shared__ int smem[];
    const int nwarps = blockDim.x >> 5, b = blockIdx.x;
    int *cursor = smem;                      /* [E] */
    int *warp_base = cursor + E;                               /* [nwarps, permute_stride(E)] */
    int *chunk_ids = warp_base + nwarps * permute_stride(E);   /* [blockDim.x * ROUNDS] */
    /* counts of chunks 0..b-1 per expert: `parts` threads per expert, each summing every parts-th chunk
     * (integers: the split does not change the sum); the partial sums go where warp_base and chunk_ids
     * will be, which hold at least max(E, blockDim.x) ints */
    int *partial = warp_base;
    const int parts = E < (int)blockDim.x ? (int)blockDim.x / E : 1;
    for (int x = threadIdx.x; x < parts * E; x += blockDim.x) {
        const int e = x % E, p = x / E;
        int s = 0;
#pragma unroll 4
        for (int c = p; c < b; c += parts) s += __ldcg(hist + (size_t)c * E + e);
        partial[x] = s;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int s = __ldcg(o.offsets + e);
        for (int p = 0; p < parts; p++) s += partial[p * E + e];
        cursor[e] = s;
    }
    __syncthreads();
    permute_scatter<PERMUTE_MULTI_ROUNDS>(ids, b * (int)blockDim.x * PERMUTE_MULTI_ROUNDS, n, E, o, cursor, warp_base,
                                          chunk_ids);
}

size_t colibri_cuda_permute_chunks(int64_t assignments, int32_t num_experts) {
    return (size_t)permute_multi_blocks(assignments, num_experts);
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
    const size_t multi = permute_multi_smem_bytes(num_experts);
    if (multi > (size_t)optin)
        return colibri_set_error(COLIBRI_ERR_UNSUPPORTED, "%d experts need %zu bytes of shared memory to permute; "
                                 "the device allows %d", num_experts, multi, optin);
    COLIBRI_CUDA_CHECK(cudaFuncSetAttribute(permute_scatter_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)multi));
    /* the count kernel's fewer ints fit wherever the scatter's do */
    COLIBRI_CUDA_CHECK(cudaFuncSetAttribute(permute_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)permute_count_smem_bytes(num_experts)));
    return COLIBRI_OK;
}

colibri_status_t colibri_cuda_launch_permute(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             const int32_t *topk_ids, int32_t tile_m, bool pairs, int absorb,
                                             cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int n = (int)(num_tokens * ctx->cfg.top_k), E = ctx->cfg.num_experts;
    PermuteArgs o = permute_args(b);
    o.pairs = pairs;
    o.absorb = absorb; /* permute_warp's few assignments have no expert past a whole tile: nothing to take */
    if (permute_by_warp(n, E, o)) {
        COLIBRI_CUDA_CHECK(colibri_launch(permute_kernel, dim3(1), dim3(32), sizeof(int) * 2 * (size_t)E, stream,
                                          topk_ids, n, E, tile_m, o));
        return COLIBRI_OK;
    }
    if (n < PERMUTE_MULTI_MIN) {
        COLIBRI_CUDA_CHECK(colibri_launch(permute_kernel, dim3(1), dim3(b->permute_threads), b->permute_smem, stream,
                                          topk_ids, n, E, tile_m, o));
        return COLIBRI_OK;
    }
    const int threads = permute_multi_threads(E), blocks = permute_multi_blocks(n, E);
    COLIBRI_CUDA_CHECK(colibri_launch(permute_count_kernel, dim3((unsigned)blocks), dim3((unsigned)threads),
                                      permute_count_smem_bytes(E), stream, topk_ids, n, E, tile_m,
                                      o, b->permute_hist, b->permute_counts, b->permute_done));
    COLIBRI_CUDA_CHECK(colibri_launch(permute_scatter_kernel, dim3((unsigned)blocks), dim3((unsigned)threads),
                                      permute_multi_smem_bytes(E), stream, topk_ids, n, E, o,
                                      (const int32_t *)b->permute_hist));
    return COLIBRI_OK;
}

/* One block per token (colibri_cuda_launch_slots): the routed slots copied, then the shared slots, weighted
 * by the shared gate where there is one: sigmoid of its fp32 dot with x, the 256 threads strided over H (VEC: 4
 * elements a load), summed by shuffles and then over the warps in order (the same bits every run). A warp per
 * token read H = 2048 in 64 rounds of loads, each waiting on HBM after the bench's flush. */
template <class TX, bool VEC>
__global__ void __launch_bounds__(256) shared_slots_kernel(const int32_t *ids, const float *wts, const TX *x,
                                                           const float *gate, int E, int k, int m, int H,
                                                           int32_t *sids, float *swts, int32_t *bad_id) {
    pdl_begin();
    __shared__ float s_part[8];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, kk = k + m;
    for (int j = tid; j < k; j += 256) {
        const int e = ids[(size_t)t * k + j];
        const bool ok = (unsigned)e < (unsigned)E;
        if (!ok) *bad_id = 1;
        sids[(size_t)t * kk + j] = ok ? e : -1;
        swts[(size_t)t * kk + j] = wts[(size_t)t * k + j];
    }
    float g = 1.0f;
    if (gate) {
        const TX *xt = x + (size_t)t * H;
        float d = 0.0f;
        if (VEC) {
#pragma unroll 4
            for (int h = tid * 4; h < H; h += 256 * 4) {
                const float4 gv = __ldg(reinterpret_cast<const float4 *>(gate + h));
                float xv[4];
                load_f32<TX, 4>(xt + h, xv);
                d = fmaf(gv.x, xv[0], d);
                d = fmaf(gv.y, xv[1], d);
                d = fmaf(gv.z, xv[2], d);
                d = fmaf(gv.w, xv[3], d);
            }
        } else {
#pragma unroll 4
            for (int h = tid; h < H; h += 256) d = fmaf(__ldg(gate + h), to_f32(xt[h]), d);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        if (lane == 0) s_part[warp] = d;
        __syncthreads();
        d = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) d += s_part[w];
        g = 1.0f / (1.0f + expf(-d));
    }
    for (int j = tid; j < m; j += 256) {
        sids[(size_t)t * kk + k + j] = E + j;
        swts[(size_t)t * kk + k + j] = g;
    }
}

colibri_status_t colibri_cuda_launch_slots(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                           colibri_dtype_t act_dtype, const void *input, const int32_t *topk_ids,
                                           const float *topk_weights, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const dim3 grid((unsigned)num_tokens);
    const bool vec = c->hidden_size % 4 == 0 && colibri_aligned16(input) && colibri_aligned16(b->shared_gate);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_dtype(act_dtype, [&](auto tx) {
        using TX = typename decltype(tx)::type;
        auto kernel = vec ? shared_slots_kernel<TX, true> : shared_slots_kernel<TX, false>;
        err = colibri_launch(kernel, grid, dim3(256), 0, stream, topk_ids, topk_weights, (const TX *)input,
                             (const float *)b->shared_gate, c->num_experts, c->top_k, ctx->shared_experts,
                             c->hidden_size, b->slot_ids, b->slot_wts, b->bad_id);
    });
    COLIBRI_CUDA_CHECK(err);
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
