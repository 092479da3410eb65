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
#include "cuda_backend.cuh"

#define PERMUTE_ROUNDS 8 /* rounds of 32 assignments each warp ranks per chunk */

/* Exclusive prefix sum over the block of one value per thread; *total gets the sum. */
__device__ int block_exclusive_scan(int v, int *warp_sums, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, s, off);
            if (lane >= off) s += o;
        }
        if (lane < nwarps) warp_sums[lane] = s;
    }
    __syncthreads();
    const int excl = (warp ? warp_sums[warp - 1] : 0) + incl - v;
    *total = warp_sums[nwarps - 1];
    __syncthreads();
    return excl;
}

__global__ void permute_kernel(const int32_t *ids, int n, int E, int tile_m, int32_t *offsets, int32_t *perm,
                               int32_t *inv, ExpertTile *tiles, int32_t *num_tiles, unsigned long long *totals,
                               int32_t *bad_id) {
    pdl_begin();
    extern __shared__ int smem[];
    const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunk = blockDim.x * PERMUTE_ROUNDS;
    int *count = smem;                  /* [E] */
    int *cursor = count + E;            /* [E] next free position of each expert */
    int *warp_base = cursor + E;        /* [nwarps, E] */
    int *chunk_ids = warp_base + nwarps * E; /* [chunk] */
    int *warp_sums = chunk_ids + chunk; /* [32] */

    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    bool bad = false;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int e = ids[i];
        if ((unsigned)e < (unsigned)E) atomicAdd(&count[e], 1);
        else bad = true;
    }
    if (bad) *bad_id = 1;
    __syncthreads();

    /* each thread scans a contiguous run of experts */
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int e0 = min((int)threadIdx.x * per, E), e1 = min(e0 + per, E);
    int my_count = 0, my_tiles = 0;
    for (int e = e0; e < e1; e++) {
        my_count += count[e];
        my_tiles += (count[e] + tile_m - 1) / tile_m;
    }
    int total_count, total_tiles;
    int pos = block_exclusive_scan(my_count, warp_sums, &total_count);
    int tile = block_exclusive_scan(my_tiles, warp_sums, &total_tiles);
    for (int e = e0; e < e1; e++) {
        const int c = count[e];
        offsets[e] = pos;
        cursor[e] = pos;
        totals[e] += (unsigned long long)c;
        for (int b = 0; b < c; b += tile_m) tiles[tile++] = ExpertTile{e, pos + b, pos + min(b + tile_m, c), 0};
        pos += c;
    }
    if (threadIdx.x == 0) {
        offsets[E] = total_count;
        *num_tiles = total_tiles;
    }

    for (int c0 = 0; c0 < n; c0 += chunk) {
        for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
            const int e = c0 + i < n ? ids[c0 + i] : -1;
            chunk_ids[i] = (unsigned)e < (unsigned)E ? e : -1;
        }
        for (int i = threadIdx.x; i < nwarps * E; i += blockDim.x) warp_base[i] = 0;
        __syncthreads();
        /* warp w owns chunk_ids[w * 32 * ROUNDS, (w + 1) * 32 * ROUNDS) */
        const int *mine = chunk_ids + warp * 32 * PERMUTE_ROUNDS;
        int *base = warp_base + warp * E;
        for (int r = 0; r < PERMUTE_ROUNDS; r++) {
            const int e = mine[r * 32 + lane];
            const unsigned same = __match_any_sync(0xffffffffu, e);
            if (e >= 0 && lane == __ffs(same) - 1) base[e] += __popc(same);
            __syncwarp();
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int run = cursor[e];
            for (int w = 0; w < nwarps; w++) {
                const int c = warp_base[w * E + e];
                warp_base[w * E + e] = run;
                run += c;
            }
            cursor[e] = run;
        }
        __syncthreads();
        for (int r = 0; r < PERMUTE_ROUNDS; r++) {
            const int local = warp * 32 * PERMUTE_ROUNDS + r * 32 + lane, i = c0 + local;
            const int e = chunk_ids[local];
            const unsigned same = __match_any_sync(0xffffffffu, e);
            if (e >= 0) {
                const int p = base[e] + __popc(same & ((1u << lane) - 1u));
                perm[p] = i;
                inv[i] = p;
            } else if (i < n) {
                inv[i] = -1;
            }
            __syncwarp();
            if (e >= 0 && lane == __ffs(same) - 1) base[e] += __popc(same);
            __syncwarp();
        }
        __syncthreads();
    }
}

static size_t permute_smem_bytes(int threads, int E) {
    return sizeof(int) * ((size_t)2 * E + (size_t)(threads / 32) * E + (size_t)threads * PERMUTE_ROUNDS + 32);
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
                                      topk_ids, n, ctx->cfg.num_experts, tile_m, b->offsets, b->perm, b->inv,
                                      b->tiles, b->num_tiles, b->totals, b->bad_id));
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
