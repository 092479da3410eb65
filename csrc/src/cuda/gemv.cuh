/*
 * gemv.cuh — the memory-bound kernel shared by the router (route.cu) and the few-tokens expert path
 * (experts.cu): out[p, n] = sum_k W[n, k] * x[row(p), k] for a handful of positions p per block.
 *
 * At decode a touched expert sees one to a few tokens, so the cost is streaming its weights once.
 * Each warp owns one output row n (for SWIGLU the gate row and the up row together, so silu(g) * u is
 * formed in the same pass), walks K with 16-byte loads, UNROLL of them in flight per matrix, and dots
 * them against up to 8 token rows read through L1. A block is 8 warps = 8 consecutive rows (blockIdx.y); blockIdx.x
 * picks a tile (expert, positions [begin, end)) from the table permute.cu wrote, or, with no table,
 * a group of 8 consecutive positions (the router, whose "expert" is the single router matrix).
 */
#ifndef COLIBRI_CUDA_GEMV_CUH
#define COLIBRI_CUDA_GEMV_CUH

#include "cuda_backend.cuh"

#define GEMV_WARPS 8
#define GEMV_GROUP 8 /* most positions one block serves: the tile_m of the few-tokens path */

/* One projection over expert rows, for the gemv kernel here and the tensor-core kernel (experts.cu),
 * which takes x and out in the weight dtype; NULL tiles and `positions` serve gemv alone. */
struct ProjArgs {
    const char *w;            /* matrix of expert 0: [N, K] weight dtype, row-major */
    size_t w_expert_stride;   /* bytes from one expert's matrix to the next */
    size_t w_second;          /* GLU: bytes from the gate matrix to the up matrix */
    int32_t n, k;             /* N outputs, K inputs */
    const void *x;            /* rows of K elements */
    const int32_t *row_map;   /* position p reads x row row_map[p] / row_div; NULL: row p */
    int32_t row_div;
    void *out;                /* [positions, N] */
    const ExpertTile *tiles;  /* NULL: blockIdx.x covers positions [8x, 8x + 8) of `positions` */
    const int32_t *num_tiles;
    int32_t positions;
};

/* One pass over this warp's row(s) for NT token rows; `count` (<= NT) of them are real. */
template <class TW, class TX, class TO, int VW, bool GLU, int NT>
__device__ __forceinline__ void gemv_rows(const ProjArgs &a, const TW *w0, const TW *w1, int p0, int count, int n,
                                          int lane) {
    constexpr int UNROLL = VW == 1 ? 1 : 4;
    constexpr int STEP = 32 * VW;
    const TX *xr[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const int p = p0 + (t < count ? t : count - 1);
        const int row = a.row_map ? a.row_map[p] / a.row_div : p;
        xr[t] = reinterpret_cast<const TX *>(a.x) + (size_t)row * a.k;
    }
    float acc0[NT], acc1[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = 0.0f;

    int k = lane * VW;
    for (; k + (UNROLL - 1) * STEP < a.k; k += UNROLL * STEP) {
        Pack<TW, VW> wa[UNROLL], wb[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            wa[u] = load_stream<TW, VW>(w0 + k + u * STEP);
            if (GLU) wb[u] = load_stream<TW, VW>(w1 + k + u * STEP);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float xv[VW];
                load_f32<TX, VW>(xr[t] + k + u * STEP, xv);
#pragma unroll
                for (int i = 0; i < VW; i++) {
                    acc0[t] = fmaf(to_f32(wa[u].v[i]), xv[i], acc0[t]);
                    if (GLU) acc1[t] = fmaf(to_f32(wb[u].v[i]), xv[i], acc1[t]);
                }
            }
        }
    }
    for (; k < a.k; k += STEP) {
        const Pack<TW, VW> wa = load_stream<TW, VW>(w0 + k);
        Pack<TW, VW> wb;
        if (GLU) wb = load_stream<TW, VW>(w1 + k);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float xv[VW];
            load_f32<TX, VW>(xr[t] + k, xv);
#pragma unroll
            for (int i = 0; i < VW; i++) {
                acc0[t] = fmaf(to_f32(wa.v[i]), xv[i], acc0[t]);
                if (GLU) acc1[t] = fmaf(to_f32(wb.v[i]), xv[i], acc1[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            acc0[t] += __shfl_xor_sync(0xffffffffu, acc0[t], off);
            if (GLU) acc1[t] += __shfl_xor_sync(0xffffffffu, acc1[t], off);
        }
    }
    TO *out = reinterpret_cast<TO *>(a.out);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (lane == t && t < count) {
            const float v = GLU ? silu_f32(acc0[t]) * acc1[t] : acc0[t];
            out[(size_t)(p0 + t) * a.n + n] = from_f32<TO>(v);
        }
    }
}

template <class TW, class TX, class TO, int VW, bool GLU>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_kernel(ProjArgs a) {
    pdl_begin();
    int expert = 0, p0, p1;
    if (a.tiles) {
        if ((int)blockIdx.x >= *a.num_tiles) return;
        const ExpertTile tile = a.tiles[blockIdx.x];
        expert = tile.expert;
        p0 = tile.begin;
        p1 = tile.end;
    } else {
        p0 = blockIdx.x * GEMV_GROUP;
        p1 = min(p0 + GEMV_GROUP, a.positions);
    }
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.y * GEMV_WARPS + (threadIdx.x >> 5);
    if (n >= a.n) return;
    const TW *w0 = reinterpret_cast<const TW *>(a.w + (size_t)expert * a.w_expert_stride) + (size_t)n * a.k;
    const TW *w1 = reinterpret_cast<const TW *>(reinterpret_cast<const char *>(w0) + a.w_second);
    for (; p0 < p1; p0 += GEMV_GROUP) {
        const int count = min(p1 - p0, GEMV_GROUP);
        if (count > 4) gemv_rows<TW, TX, TO, VW, GLU, 8>(a, w0, w1, p0, count, n, lane);
        else if (count > 2) gemv_rows<TW, TX, TO, VW, GLU, 4>(a, w0, w1, p0, count, n, lane);
        else if (count == 2) gemv_rows<TW, TX, TO, VW, GLU, 2>(a, w0, w1, p0, count, n, lane);
        else gemv_rows<TW, TX, TO, VW, GLU, 1>(a, w0, w1, p0, count, n, lane);
    }
}

/* Launches gemv_kernel over `slots` values of blockIdx.x (slots that find no tile return at once).
 * vec: K and every row start allow 16-byte loads of the weights (and the matching loads of x);
 * otherwise one element at a time. */
template <class TW, class TX, class TO, bool GLU>
static cudaError_t gemv_launch(const ProjArgs &a, int64_t slots, bool vec, cudaStream_t stream) {
    const dim3 grid((unsigned)slots, (unsigned)((a.n + GEMV_WARPS - 1) / GEMV_WARPS));
    if (vec) return colibri_launch(gemv_kernel<TW, TX, TO, 16 / sizeof(TW), GLU>, grid, GEMV_WARPS * 32, 0, stream, a);
    return colibri_launch(gemv_kernel<TW, TX, TO, 1, GLU>, grid, GEMV_WARPS * 32, 0, stream, a);
}

#endif /* COLIBRI_CUDA_GEMV_CUH */
