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
    unsigned *ready; /* per tile: zeroed with the tile table, for wgmma_ws_kernel's chained projections */
    int pairs;  /* the tile table in MC pair order (permute_scan) */
    int absorb; /* > 0: an expert's rows past its whole tiles ride on its last ones, up to this many each */
};

/* With `absorb`, the r rows an expert has past q >= 1 whole tiles go with its last m = ceil(r / absorb)
 * whole tiles (wgmma_ws_kernel's folded tiles, up to `absorb` more rows each) instead of a tile of their
 * own, where m is at most PERMUTE_FOLD_TILES and q: a folded item costs 1.2 plain ones, so more folds
 * lose (docs/performance.md). Returns m (0: no fold). */
#define PERMUTE_FOLD_TILES 2
__device__ __forceinline__ int permute_folds(int c, int tile_m, int absorb) {
    const int q = c / tile_m, r = c % tile_m;
    if (q == 0 || r == 0 || absorb <= 0) return 0;
    const int m = (r + absorb - 1) / absorb;
    return m <= min(q, PERMUTE_FOLD_TILES) ? m : 0;
}

/* Tiles of an expert's c rows: ceil(c / tile_m), less the tile of its last rows where they fold */
__device__ __forceinline__ int permute_tiles(int c, int tile_m, int absorb) {
    return c / tile_m + (c % tile_m != 0 && permute_folds(c, tile_m, absorb) == 0);
}

#define PERMUTE_ROUNDS 8 /* rounds of 32 assignments each warp ranks per chunk (one-block permutation) */

/* Expert offsets, the tile table and the per-expert totals from count[E] (shared memory), by every thread
 * of one block; cursor[e] (if not NULL) gets offsets[e]. warp_sums: 32 ints of shared memory. The table
 * is in expert order, or with o.pairs in the cluster kernel's pair order: of the experts with an odd
 * number of tiles, taken two by two (a, b), b's partial tile moves to just after a's, so that every pair
 * but those of partial tiles is one expert's; an odd one out's partial tile goes to the end. The order
 * changes no output. pair_ends: (E + 1) / 2 ints of shared memory, only with o.pairs. */
__device__ __forceinline__ void permute_scan(const int *count, int E, int tile_m, const PermuteArgs &o, int *cursor,
                                             int *warp_sums, int *pair_ends) {
    /* each thread scans a contiguous run of experts */
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int e0 = min((int)threadIdx.x * per, E), e1 = min(e0 + per, E);
    int my_count = 0, my_tiles = 0, my_odd = 0;
    for (int e = e0; e < e1; e++) {
        const int t = permute_tiles(count[e], tile_m, o.absorb);
        my_count += count[e];
        my_tiles += t;
        my_odd += t & 1;
    }
    int total_count, total_tiles, odd_total = 0;
    int pos = colibri_block_exclusive_scan(my_count, warp_sums, &total_count);
    int tile = colibri_block_exclusive_scan(my_tiles, warp_sums, &total_tiles);
    /* pair order (a block-uniform branch: the scan synchronises): how many experts of odd tile counts come
     * before this thread's, and where each first of a pair ends, for the second */
    int odd_rank = 0;
    if (o.pairs) {
        odd_rank = colibri_block_exclusive_scan(my_odd, warp_sums, &odd_total);
        for (int e = e0, t0 = tile, j = odd_rank; e < e1; e++) {
            const int t = permute_tiles(count[e], tile_m, o.absorb);
            if ((t & 1) && !(j & 1) && j + 1 < odd_total) pair_ends[j >> 1] = t0 + t;
            j += t & 1;
            t0 += t;
        }
        __syncthreads();
    }
    for (int e = e0; e < e1; e++) {
        const int c = count[e], t = permute_tiles(c, tile_m, o.absorb), m = permute_folds(c, tile_m, o.absorb);
        o.offsets[e] = pos;
        if (cursor) cursor[e] = pos;
        /* a reduction, not a load and a store: the thread does not wait for the count's line (cold in L2
         * after other work) before going on */
        if (c) atomicAdd(&o.totals[e], (unsigned long long)c);
        /* table index of this expert's tile i < t - 1: first + i; of its last tile: last */
        int first = tile, last = tile + t - 1;
        if (o.pairs) {
            const bool after_odd_one = (odd_total & 1) && odd_rank == odd_total - (t & 1);
            if (!(t & 1)) {
                first += after_odd_one ? -1 : odd_rank & 1; /* past the odd one out; inside a pair */
                last = first + t - 1;
            } else if (odd_rank & 1) {
                first++; /* the second of a pair: its partial tile after the first's */
                last = pair_ends[odd_rank >> 1];
            } else if (after_odd_one) {
                last = total_tiles - 1; /* the odd one out */
            }
            odd_rank += t & 1;
        }
        for (int i = 0; i < t; i++) {
            /* rows [b, end) of the expert's: whole tiles, the last one partial, or the last m folded ones
             * sharing the r rows past the whole tiles (r / m each, one more for the first r % m) */
            int b = i * tile_m, end = i == t - 1 ? c : b + tile_m;
            if (i >= t - m) {
                const int j = i - (t - m), r = c % tile_m, each = r / m, more = r % m;
                b += j * each + min(j, more);
                end = b + tile_m + each + (j < more);
            }
            const int at = i == t - 1 ? last : first + i;
            o.tiles[at] = ExpertTile{e, pos + b, pos + end, 0};
            o.ready[at] = 0;
        }
        tile += t;
        pos += c;
    }
    if (threadIdx.x == 0) {
        o.offsets[E] = total_count;
        *o.num_tiles = total_tiles;
    }
    if (o.pairs) __syncthreads(); /* pair_ends read: the caller may reuse its memory */
}

/* One round of a warp's stable scatter: lane l's assignment i of expert e (-1: none, or a bad id) goes to
 * its expert's next free position base[e] after those of the lower lanes of the same expert; base[e]
 * (shared memory) then advances past the round's. */
__device__ __forceinline__ void permute_place(int e, int i, int n, int *base, const PermuteArgs &o, int lane) {
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0) {
        const int p = base[e] + __popc(same & ((1u << lane) - 1u));
        o.perm[p] = i;
        o.inv[i] = p;
    } else if (i < n) {
        o.inv[i] = -1;
    }
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) base[e] += __popc(same);
    __syncwarp();
}

/* The row stride of the per-warp, per-expert counts ([nwarps, stride] ints): odd, so that the lanes of a warp
 * reading one expert's counts of every warp (permute_scatter's scan) hit 32 different banks; with a stride of
 * E = 64 they all hit one. */
__host__ __device__ inline int permute_stride(int E) { return E | 1; }

/* Stable scatter of the assignments [c0, c0 + blockDim.x * rounds) that are below n, by every thread of
 * one block: each warp ranks its 32 * rounds assignments with __match_any_sync and takes its base from a
 * per-warp, per-expert count, so within an expert positions follow t*k+j. cursor[e] (shared memory) is
 * expert e's next free position and advances. warp_base: [nwarps, permute_stride(E)] ints, chunk_ids:
 * [blockDim.x * ROUNDS];
 * rounds <= ROUNDS (the positions do not depend on it: the order within an expert is the assignments').
 * loaded: chunk_ids already holds the chunk's ids (-1 for a bad id or past n). */
template <int ROUNDS>
__device__ __forceinline__ void permute_scatter(const int32_t *ids, int c0, int n, int E, const PermuteArgs &o,
                                                int *cursor, int *warp_base, int *chunk_ids, int rounds = ROUNDS,
                                                bool loaded = false) {
    const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, S = permute_stride(E);
    const int chunk = blockDim.x * rounds;
    if (!loaded)
        for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
            const int e = c0 + i < n ? ids[c0 + i] : -1;
            chunk_ids[i] = (unsigned)e < (unsigned)E ? e : -1;
        }
    for (int i = threadIdx.x; i < nwarps * S; i += blockDim.x) warp_base[i] = 0;
    __syncthreads();
    /* warp w owns chunk_ids[w * 32 * rounds, (w + 1) * 32 * rounds) */
    const int *mine = chunk_ids + warp * 32 * rounds;
    int *base = warp_base + warp * S;
    for (int r = 0; r < rounds; r++) {
        const int e = mine[r * 32 + lane];
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(same) - 1) base[e] += __popc(same);
        __syncwarp();
    }
    __syncthreads();
    /* each expert's warp counts into warp bases from cursor[e] on: a warp's shuffle scan over the (at most
     * 32) warps per expert, experts spread over the warps */
    for (int e = warp; e < E; e += nwarps) {
        const int c = lane < nwarps ? warp_base[lane * S + e] : 0;
        int incl = c;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += v;
        }
        const int run = cursor[e];
        if (lane < nwarps) warp_base[lane * S + e] = run + incl - c;
        __syncwarp(); /* every lane has read cursor[e] */
        if (lane == 31) cursor[e] = run + incl;
    }
    __syncthreads();
    for (int r = 0; r < rounds; r++) {
        const int local = warp * 32 * rounds + r * 32 + lane;
        permute_place(chunk_ids[local], c0 + local, n, base, o, lane);
    }
    __syncthreads();
}

/* The whole permutation, by every thread of one block; smem holds permute_smem_bytes(blockDim.x, E). Where
 * the assignments fit one chunk, every warp ranks ceil(n / threads) rounds of them (not PERMUTE_ROUNDS, which
 * left most warps idle and the rest ranking 8 rounds in turn: n = 1536 on 32 warps is 2 rounds each on 24
 * warps, against 8 on 6), and the ids are read once, into chunk_ids, by the histogram.
 * `trigger` (permute_kernel): the kernel's dependents may launch once the tile table is written. */
__device__ __forceinline__ void permute_block(const int32_t *ids, int n, int E, int tile_m, const PermuteArgs &o,
                                              int *smem, bool trigger = false) {
    const int nwarps = blockDim.x >> 5;
    const int fits = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    const bool one = fits <= PERMUTE_ROUNDS;
    const int rounds = one ? max(fits, 1) : PERMUTE_ROUNDS, chunk = blockDim.x * rounds;
    int *count = smem;                                   /* [E] */
    int *cursor = count + E;                             /* [E] next free position of each expert */
    int *warp_base = cursor + E;                         /* [nwarps, permute_stride(E)] */
    int *chunk_ids = warp_base + nwarps * permute_stride(E); /* [blockDim.x * PERMUTE_ROUNDS] */
    int *warp_sums = chunk_ids + blockDim.x * PERMUTE_ROUNDS; /* [32] */

    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    bool bad = false;
    /* one chunk: the ids go to chunk_ids as they are counted (-1 past n), for the scatter */
    for (int i = threadIdx.x; i < (one ? chunk : n); i += blockDim.x) {
        const int e = i < n ? ids[i] : -1;
        const bool ok = (unsigned)e < (unsigned)E;
        if (one) chunk_ids[i] = ok ? e : -1;
        if (ok) atomicAdd(&count[e], 1);
        else bad |= i < n;
    }
    if (bad) *o.bad_id = 1;
    __syncthreads();
    permute_scan(count, E, tile_m, o, cursor, warp_sums, warp_base); /* warp_base: free until the scatter */
    if (trigger) pdl_trigger();
    for (int c0 = 0; c0 < n; c0 += chunk)
        permute_scatter<PERMUTE_ROUNDS>(ids, c0, n, E, o, cursor, warp_base, chunk_ids, rounds, one);
}

/* At most this many assignments (T <= 8 in the route kernel's last block; the permute kernel's small
 * batches) one warp permutes alone (permute_warp). */
#define PERMUTE_WARP_MAX 128

/* The whole permutation of n <= PERMUTE_WARP_MAX assignments by one warp: permute_block's steps with warp
 * synchronisation instead of block barriers, and the ids read once (lane l keeps assignments l, l + 32,
 * ... in registers). The same offsets, positions and tile table (in expert order). smem: 2 E ints.
 * `trigger` as permute_block's. */
__device__ __forceinline__ void permute_warp(const int32_t *ids, int n, int E, int tile_m, const PermuteArgs &o,
                                             int *smem, bool trigger = false) {
    constexpr int R = PERMUTE_WARP_MAX / 32;
    const int lane = threadIdx.x & 31;
    int *count = smem, *cursor = smem + E; /* [E], [E] */
    for (int e = lane; e < E; e += 32) count[e] = 0;
    __syncwarp();
    int key[R]; /* the expert of assignment r * 32 + lane, -1 for none or a bad id */
    bool bad = false;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = r * 32 + lane;
        const int e = i < n ? ids[i] : -1;
        key[r] = (unsigned)e < (unsigned)E ? e : -1;
        bad |= i < n && key[r] < 0;
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        if (key[r] >= 0) atomicAdd(&count[key[r]], 1);
    if (__any_sync(0xffffffffu, bad) && lane == 0) *o.bad_id = 1;
    __syncwarp();
    /* lane l scans a contiguous run of experts: offsets, tiles, totals */
    const int per = (E + 31) >> 5, e0 = min(lane * per, E), e1 = min(e0 + per, E);
    int my_count = 0, my_tiles = 0;
    for (int e = e0; e < e1; e++) {
        my_count += count[e];
        my_tiles += (count[e] + tile_m - 1) / tile_m;
    }
    int pos = my_count, tile = my_tiles;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int p = __shfl_up_sync(0xffffffffu, pos, off), t = __shfl_up_sync(0xffffffffu, tile, off);
        if (lane >= off) {
            pos += p;
            tile += t;
        }
    }
    if (lane == 31) {
        o.offsets[E] = pos;
        *o.num_tiles = tile;
    }
    pos -= my_count;
    tile -= my_tiles;
    for (int e = e0; e < e1; e++) {
        const int c = count[e];
        o.offsets[e] = pos;
        cursor[e] = pos;
        for (int b = 0; b < c; b += tile_m) {
            o.ready[tile] = 0;
            o.tiles[tile++] = ExpertTile{e, pos + b, pos + min(b + tile_m, c), 0};
        }
        pos += c;
    }
    if (trigger) pdl_trigger();
    __syncwarp();
    /* stable scatter: within an expert, assignments in their order */
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r * 32 >= n) break;
        permute_place(key[r], r * 32 + lane, n, cursor, o, lane);
    }
    /* the per-expert totals last: their loads are then off the way of the stores above */
    for (int e = e0; e < e1; e++)
        if (count[e]) o.totals[e] += (unsigned long long)count[e];
}

/* Whether permute_warp takes n assignments of E experts: not in the cluster kernel's pair order, which only
 * permute_scan lays out (it runs from 128 x E assignments on: with a single expert that few), and where its
 * 2 E ints fit the default 48 KB of shared memory. */
__host__ __device__ inline bool permute_by_warp(int n, int E, const PermuteArgs &o) {
    return n <= PERMUTE_WARP_MAX && !o.pairs && 2 * E * (int)sizeof(int) <= 48 * 1024;
}

static inline size_t permute_smem_bytes(int threads, int E) {
    return sizeof(int) * ((size_t)2 * E + (size_t)(threads / 32) * permute_stride(E) + (size_t)threads * PERMUTE_ROUNDS +
                          32);
}

#define PERMUTE_MULTI_ROUNDS 4 /* multi-block permutation (permute.cu): rounds of 32 per warp, one chunk a block */

/* Block size of the multi-block permutation: at most 8 warps, fewer for many experts (warps * E ints). */
static inline int permute_multi_threads(int E) {
    const int warps = 4096 / E;
    return 32 * (warps < 1 ? 1 : warps > 8 ? 8 : warps);
}
static inline int permute_multi_blocks(int64_t n, int E) {
    const int64_t chunk = (int64_t)permute_multi_threads(E) * PERMUTE_MULTI_ROUNDS;
    return (int)((n + chunk - 1) / chunk);
}
static inline size_t permute_count_smem_bytes(int E) { return sizeof(int) * ((size_t)E + 32 + (E + 1) / 2); }
static inline size_t permute_multi_smem_bytes(int E) {
    const int threads = permute_multi_threads(E);
    return sizeof(int) * ((size_t)E + (size_t)(threads / 32) * permute_stride(E) + (size_t)threads * PERMUTE_MULTI_ROUNDS);
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
    o.ready = b->ws_ready;
    o.pairs = 0;
    o.absorb = 0;
    return o;
}

#endif /* COLIBRI_CUDA_PERMUTE_CUH */
