/*
 * cuda_backend.cuh — what the CUDA backend's files share: the backend state hung off the context,
 * the CUDA error check, launch helpers, and the launchers each op family exports to the orchestration
 * in context.cu (dtypes: dtype.cuh). Private to csrc/src/cuda/.
 * One forward chunk, on the caller's stream: route.cu (logits, top-k) -> permute.cu (grouping by
 * expert, the tile table; skipped at decode) -> experts.cu (up and down projections) -> combine.cu
 * (the weighted top-k sum). docs/cuda-design.md ("One forward") has the shapes.
 */
#ifndef COLIBRI_CUDA_BACKEND_CUH
#define COLIBRI_CUDA_BACKEND_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.cuh"
#include "internal.h"

#define COLIBRI_CUDA_CHECK(call)                                                                        \
    do {                                                                                               \
        cudaError_t colibri_err_ = (call);                                                             \
        if (colibri_err_ != cudaSuccess)                                                               \
            return colibri_set_error(COLIBRI_ERR_CUDA, "%s failed: %s (%s:%d)", #call,                   \
                                     cudaGetErrorString(colibri_err_), __FILE__, __LINE__);            \
    } while (0)

/* A tile of sorted positions [begin, end) that all belong to one expert. */
struct ExpertTile {
    int32_t expert, begin, end, pad;
};
static_assert(sizeof(ExpertTile) == 16, "a tile is one 16-byte load");

/* A tile of the table, read from L2 in one 16-byte load: for a kernel that reads the table before its
 * dependency wait, which must not meet lines an earlier kernel left in this SM's L1. */
__device__ __forceinline__ ExpertTile colibri_tile_ldcg(const ExpertTile *t) {
    const int4 v = __ldcg(reinterpret_cast<const int4 *>(t));
    return ExpertTile{v.x, v.y, v.z, v.w};
}

struct CudaBackend {
    int device;
    size_t expert_stride;       /* bytes between experts in d_weights (a multiple of 256) */
    char *d_weights;            /* [E, expert_stride] bytes: gate [F,H], up [F,H], down [H,F] (or w [F,H]) */
    char *d_workspace;          /* one allocation; the pointers below point into it */
    float *router;              /* [E, H] fp32, or NULL */
    float *router_bias;         /* [E] fp32, or NULL */
    float *router_logit_bias;   /* [E] fp32 added to the logits, or NULL */
    float *expert_bias;         /* [E + m, bias_numel] fp32 (ctx->expert_bias), or NULL */
    float *expert_scales;       /* fp8 weights: [E + m, ctx->scales_numel] fp32 scale grids (ctx->expert_scales; a
                                 * projection's view: colibri_cuda_scale_grid), else NULL */
    __nv_bfloat16 *router_split; /* [3, E, H] the router as hi + mid + lo bf16 parts (route.cu), or NULL; carved
                                  * wherever the router GEMM may run (6 bytes per router weight) */
    int router_parts;           /* 1 where every mid and lo is 0 (a bf16 router upcast), else 3 */
    float *logits;              /* [Tw, E] fp32 */
    float *logits_part;         /* [splits - 1, T, E] split-K partial logits of the router GEMM (route.cu) */
    int32_t *ids;               /* [Tw, k] routing computed here */
    float *wts;                 /* [Tw, k] */
    int32_t *offsets;           /* [E + 1] */
    int32_t *perm;              /* [Tw * k] sorted position -> assignment index */
    int32_t *inv;               /* [Tw * k] assignment index -> sorted position, -1 if its id was invalid */
    ExpertTile *tiles;          /* [Tw * k + E] */
    int32_t *num_tiles;         /* [1] */
    unsigned long long *totals; /* [E] assignments per expert since init / reset */
    int32_t *bad_id;            /* [1] set when an id out of range was met */
    unsigned *ws_sched;         /* [4] wgmma_ws_kernel's item counters: 0-1 the first projection's, 2-3 the second's */
    unsigned *ws_ready;         /* [Tw * k + E] per tile: first-projection items stored (sm90_wgmma_ws_experts.cuh, ws_chain_wait) */
    unsigned *route_done;       /* [1] blocks of the small-T route kernel done; 0 between launches (route.cu) */
    int32_t *permute_hist;      /* [chunks, E] per-chunk expert counts of the multi-block permutation */
    int32_t *permute_counts;    /* [E] its per-expert totals; 0 between launches (permute.cu) */
    unsigned *permute_done;     /* [1] its count blocks done; 0 between launches */
    /* Experts compute in the "compute dtype" (colibri_cuda_compute_dtype): the weight dtype, bf16 for fp8
     * weights. Tensor cores take 16-bit operands of one type. */
    void *xc;                   /* [Tw, H] input converted to the compute dtype (tensor-core path) */
    void *inter;                /* [Tw * k, F] compute dtype (SWIGLU only) */
    void *y;                    /* [Tw * k, O] compute dtype: each assignment's expert output */
    uint8_t *xq;                /* fp8 weights: [Tw, H] the tokens in fp8 for the tensor cores (sm90_fp8_experts.cu) */
    float *xq_scales;           /* [Tw, ceil(H / 128)] their scales */
    uint8_t *inter_q;           /* [Tw * k, F] inter in fp8 (SWIGLU) */
    float *inter_q_scales;      /* [Tw * k, ceil(F / 128)] its scales */
    int permute_threads;        /* block size of the permute kernel (bounded by E, see permute.cu) */
    bool mma_wide_k;            /* the device fits the BK=64 tensor-core kernels (see sm80_mma_experts.cuh) */
    bool mma_long_k;            /* and the BK=128 ones of long rows (one block per SM) */
    bool wgmma;                 /* the sm_90a image runs here: 128-row tiles use sm90_wgmma_experts.cuh */
    int ws_clusters;            /* > 0: tiles an expert shares run on the MC wgmma_ws_kernel, this many clusters at once */
    void *tma_encode;           /* with wgmma: cuTensorMapEncodeTiled; non-NULL: 128-row tiles run wgmma_ws_kernel */
    int ws_fold;                /* rows past 128 an expert's last tile may take (colibri_cuda_experts_absorb) */
    bool fp8_tc;                /* with tma_encode: fp8 weights' 128-row tiles run wgmma_fp8_kernel */
    int sm_count;               /* multiprocessors: the persistent wgmma grid, wave estimates */
    int mma16_blocks_per_sm[2][2][2]; /* [GLU][narrow][long K]: occupancy of the 16-row tensor-core kernels */
    bool l2_prefetch;           /* compute capability 9.x: the first wave's weights are prefetched during routing */
    size_t permute_smem;
    int32_t *slot_ids;          /* [Tw, k + m] with a shared expert (colibri_cuda_launch_slots), else NULL */
    float *slot_wts;            /* [Tw, k + m] */
    float *shared_gate;         /* [H] fp32, or NULL */
};

/* fp8 weights: the activations the fp8 tensor cores read are quantised per row in groups of FP8_GROUP
 * columns, one fp32 scale each (fp8_quant.cuh); the workspace holds fp8_groups(k) scales per row. */
#define FP8_GROUP 128   /* one k step of the fp8 tiles */
__host__ __device__ inline int fp8_groups(int k) { return (k + FP8_GROUP - 1) / FP8_GROUP; }

/* fp8 weights: the scale grids one projection reads, in the form every fp8 kernel takes (a kernel
 * parameter of its own: a field more in ProjArgs changes every 16-bit kernel's code, see gemv.cuh).
 * Weight (n, k) of expert e's matrix scales by grid[(n / bn) * cols + (k >> k_shift)], grid = s +
 * e * expert_stride (+ second for a GLU's up matrix). bn 0: one row of the grid (per tensor or per
 * k block); k_shift = log2(scale_block_k), or 31 where the block is the whole row (then k >> 31 = 0).
 * colibri.h has the layout (per matrix [ceil(N / bn), ceil(K / bk)] row-major, gate, up, down). */
struct ScaleGrid {
    const float *s;         /* grid of the projection's (first) matrix of expert 0 */
    int64_t expert_stride;  /* floats from one expert's grids to the next (ctx->scales_numel) */
    int32_t second;         /* a GLU: floats from the gate grid to the up grid */
    int32_t bn, cols, k_shift;
    /* Row n's scales of expert e's first matrix (m = 0) or up matrix (m = 1). */
    __device__ __forceinline__ const float *row(int e, int m, int n) const {
        return s + e * expert_stride + m * second + (bn > 0 ? n / bn : 0) * cols;
    }
};

/* The grid of matrix `matrix` (0 gate or w, 1 up, 2 down: colibri_scale_grid_offset) with K columns for
 * a projection of ctx's (view's) experts; second: the up grid after the gate grid. Zeros where the
 * weights are not fp8. The CUDA backend takes scale_block_k 0 or a power of two from 16 on (cuda_supports.h
 * refuses the others), so that 16 consecutive weights share a scale. */
static inline ScaleGrid colibri_cuda_scale_grid(const colibri_moe_context_t *ctx, int matrix, int32_t K) {
    const float *s = ((const struct CudaBackend *)ctx->backend)->expert_scales;
    ScaleGrid g = {};
    if (!s) return g;
    const colibri_moe_config_t *c = &ctx->cfg;
    const int32_t bk = c->scale_block_k;
    g.s = s + colibri_scale_grid_offset(c, matrix);
    g.expert_stride = (int64_t)ctx->scales_numel;
    g.second = (int32_t)colibri_scale_grid_offset(c, 1);
    g.bn = c->scale_block_n;
    g.cols = colibri_scale_blocks(K, bk);
    g.k_shift = bk > 0 ? 0 : 31;
    while (bk > 0 && (1 << g.k_shift) < bk) g.k_shift++;
    return g;
}

__device__ __forceinline__ float silu_f32(float g) { return g / (1.0f + expf(-g)); }

static inline bool colibri_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Programmatic dependent launch (sm_90): every kernel of a forward lets the next one launch as soon as
 * all its blocks have started (a few later: the permute kernel once its tile table is written, some expert
 * projections past their own wait), and waits for the previous one to finish (with its writes visible)
 * before touching anything. The next kernel's launch and block scheduling then overlap this one's
 * tail instead of following it; at decode, where each kernel runs a few microseconds, that is most
 * of the gap between them. Elsewhere both are no-ops and the launch attribute is ignored. */
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Exclusive prefix sum over the block of one value per thread; *total gets the sum. Every thread of the
 * block must call it; warp_sums holds 32 ints of shared memory, free again when it returns. */
__device__ __forceinline__ int colibri_block_exclusive_scan(int v, int *warp_sums, int *total) {
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

/* The two halves of pdl_begin, for kernels that order them otherwise (gemv.cuh's direct mode). */
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Every kernel launch of the backend: on the caller's stream with programmatic dependent launch allowed
 * (pdl_begin), and with `cluster` > 1 in clusters of that many blocks along x (the grid a multiple). */
template <class... Params, class... Args>
static cudaError_t colibri_launch_clusters(void (*kernel)(Params...), unsigned cluster, dim3 grid, dim3 block,
                                           size_t smem, cudaStream_t stream, Args... args) {
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = cluster;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = cluster > 1 ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, kernel, ((Params)args)...);
}

template <class... Params, class... Args>
static cudaError_t colibri_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  Args... args) {
    return colibri_launch_clusters(kernel, 1, grid, block, smem, stream, args...);
}

/* The layer as the expert pass sees it (internal.h): the shared expert's m slices are experts E.. and
 * every token's slots k.. . Everything after the routing (permute, experts, combine) takes this view;
 * the routing and the counts reported keep the context's own E and k. */
static inline colibri_moe_context_t colibri_cuda_expert_view(const colibri_moe_context_t *ctx) {
    colibri_moe_context_t v = *ctx;
    v.cfg.num_experts += ctx->shared_experts;
    v.cfg.top_k += ctx->shared_experts;
    return v;
}

/* route.cu */
/* permute_tile_m > 0: the forward's tile height; the route kernel may then also run the permutation
 * (few tokens, built-in routing) and says so in *permuted. 0 (and permuted NULL): routing only. */
colibri_status_t colibri_cuda_launch_route(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                           colibri_dtype_t act_dtype, const void *input, int32_t *topk_ids,
                                           float *topk_weights, int32_t permute_tile_m, bool *permuted,
                                           cudaStream_t stream);
/* Elements of router_split a workspace of `tokens` tokens carves (0: the tensor-core router GEMM never
 * runs), and its setup at init (after the router's copy). */
size_t colibri_cuda_route_split_elems(const colibri_moe_context_t *ctx, size_t tokens);
colibri_status_t colibri_cuda_route_setup(const colibri_moe_context_t *ctx, CudaBackend *b);
/* Floats of logits_part that forwards of up to `tokens` tokens need (sm_count: the device's). */
size_t colibri_cuda_route_part_floats(const colibri_moe_context_t *ctx, int sm_count, int64_t tokens);
/* permute.cu */
/* Chunks (rows of permute_hist) the multi-block permutation of `assignments` uses at most. */
size_t colibri_cuda_permute_chunks(int64_t assignments, int32_t num_experts);
colibri_status_t colibri_cuda_permute_setup(CudaBackend *b, int32_t num_experts);
/* pairs: the tile table in the order of the cluster kernel's pairs (colibri_cuda_experts_pairs); absorb:
 * the rows an expert's last tile may take past tile_m (colibri_cuda_experts_absorb) */
colibri_status_t colibri_cuda_launch_permute(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             const int32_t *topk_ids, int32_t tile_m, bool pairs, int absorb,
                                             cudaStream_t stream);
/* slot_ids / slot_wts [T, k + m]: each token's k routed slots (ids outside [0, E) become -1 and raise
 * bad_id, as E.. are the shared slices' own), then the shared slices with weight 1 or the shared gate. */
colibri_status_t colibri_cuda_launch_slots(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                           colibri_dtype_t act_dtype, const void *input, const int32_t *topk_ids,
                                           const float *topk_weights, cudaStream_t stream);
colibri_status_t colibri_cuda_launch_convert(const void *src, colibri_dtype_t src_dtype, void *dst,
                                             colibri_dtype_t dst_dtype, int64_t n, cudaStream_t stream);
/* experts.cu and experts_plan.cu */
colibri_status_t colibri_cuda_experts_setup(CudaBackend *b);
int32_t colibri_cuda_experts_tile_m(const colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                    const void *input);
bool colibri_cuda_experts_direct(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m);
/* Whether the projections of tile_m-row tiles may run on the cluster kernel, whose pairs of tiles want
 * the tile table in pair order (permute_scan). */
bool colibri_cuda_experts_pairs(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m);
/* How many rows past tile_m an expert's last tile may take (0: none), where every projection of tile_m-row
 * tiles runs wgmma_ws_kernel, which multiplies them (its extra rows). */
int colibri_cuda_experts_absorb(const colibri_moe_context_t *ctx, int32_t tile_m);
/* At init, after colibri_cuda_experts_setup and the weights' upload: b->ws_fold, for ..._absorb. */
void colibri_cuda_experts_fold_setup(const colibri_moe_context_t *ctx, CudaBackend *b);
/* direct_ids: the forward's topk ids when colibri_cuda_experts_direct (no permute ran), else NULL.
 * *combined: the last projection also summed the top-k into output (direct mode, few assignments), so
 * no combine is to follow; else it wrote y. */
colibri_status_t colibri_cuda_launch_experts(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             colibri_dtype_t act_dtype, const void *input, int32_t tile_m,
                                             const int32_t *direct_ids, const float *topk_weights, void *output,
                                             bool *combined, cudaStream_t stream);
/* Rows [0, rows) of matrices [0, matrices) of the first projection of experts [0, experts), bytes [0, bytes)
 * of each row: what the up projection's first wave of blocks reads first if every expert is touched. */
struct PrefetchPlan {
    int32_t experts, matrices, rows;
    uint32_t bytes;
};
/* Empty (experts 0) off compute capability 9.x and where the projection is not a memory-bound
 * tensor-core GEMM. Host only: reads the backend's fields, queries nothing. */
PrefetchPlan colibri_cuda_prefetch_plan(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m);
/* Enqueues that plan's L2 prefetch; OK doing nothing where it is empty. */
colibri_status_t colibri_cuda_launch_prefetch(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m,
                                              cudaStream_t stream);
/* sm90_fp8_experts.cu */
/* Sets up wgmma_fp8_kernel (at init, where wgmma_ws_kernel runs): its shared memory. */
cudaError_t colibri_cuda_fp8_setup(void);
/* Whether ctx's fp8 weights may run on the tensor cores: b->fp8_tc, rows of multiples of 16 and scale
 * blocks the kernel folds in (sm90_fp8_experts.cuh, fp8_scales_fit). */
bool colibri_cuda_fp8_tensor_cores(const colibri_moe_context_t *ctx);
/* The expert pass of fp8 weights over 128-row tiles (after the permutation): y [T*k, O] in bf16. */
colibri_status_t colibri_cuda_launch_fp8_experts(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                                 colibri_dtype_t act_dtype, const void *input, cudaStream_t stream);
/* combine.cu */
/* direct_ids: as for launch_experts (y rows are then assignment indices); topk_ids: the forward's ids */
colibri_status_t colibri_cuda_launch_combine(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             colibri_dtype_t act_dtype, const int32_t *topk_ids,
                                             const float *topk_weights, const int32_t *direct_ids, void *output,
                                             cudaStream_t stream);

/* The expert biases added to each expert's output (SWIGLU: the down biases, 2F into a row; LINEAR: the
 * whole row), rows of ctx->bias_numel on the device, or NULL without expert biases. */
static inline const float *colibri_cuda_output_bias(const colibri_moe_context_t *ctx) {
    const float *b = ((const CudaBackend *)ctx->backend)->expert_bias;
    if (!b) return NULL;
    return ctx->cfg.expert_kind == COLIBRI_EXPERT_SWIGLU ? b + 2 * (size_t)ctx->cfg.intermediate_size : b;
}

#endif /* COLIBRI_CUDA_BACKEND_CUH */
