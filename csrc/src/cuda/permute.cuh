/*
 * permute.cuh — the body of the permutation (permute.cu's header says what it computes), shared by the
 * permute kernel and, for a few tokens, the route kernel's last block (route.cu), which then saves a launch.
 */
#ifndef COLIBRI_CUDA_PERMUTE_CUH
#define COLIBRI_CUDA_PERMUTE_CUH

#include "cuda_backend.cuh"

/* Where the permutation goes (CudaBackend's buffers). */
struct PermuteArgs {
    int32_t *offsets, *perm, *inv;
    ExpertTile *tiles;
    int32_t *num_tiles;
    unsigned long long *totals;
    int32_t *bad_id;
};

#define PERMUTE_ROUNDS 8 /* rounds of 32 assignments each warp ranks per chunk */

/* The whole permutation, by every thread of one block; smem holds permute_smem_bytes(blockDim.x, E). */
__device__ __forceinline__ void permute_block(const int32_t *ids, int n, int E, int tile_m, const PermuteArgs &o,
                                              int *smem) {
    int32_t *offsets = o.offsets, *perm = o.perm, *inv = o.inv, *num_tiles = o.num_tiles, *bad_id = o.bad_id;
    ExpertTile *tiles = o.tiles;
    unsigned long long *totals = o.totals;
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
    int pos = colibri_block_exclusive_scan(my_count, warp_sums, &total_count);
    int tile = colibri_block_exclusive_scan(my_tiles, warp_sums, &total_tiles);
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

static inline size_t permute_smem_bytes(int threads, int E) {
    return sizeof(int) * ((size_t)2 * E + (size_t)(threads / 32) * E + (size_t)threads * PERMUTE_ROUNDS + 32);
}

static inline PermuteArgs permute_args(const CudaBackend *b) {
    PermuteArgs o;
    o.offsets = b->offsets;
    o.perm = b->perm;
    o.inv = b->inv;
    o.tiles = b->tiles;
    o.num_tiles = b->num_tiles;
    o.totals = b->totals;
    o.bad_id = b->bad_id;
    return o;
}

#endif /* COLIBRI_CUDA_PERMUTE_CUH */
