/*
 * experts.cu — the expert FFNs over tokens grouped by expert (permute.cu's tile table): setup of the
 * expert kernels, the launchers (project, project_combine) and the L2 prefetch beside the router.
 * The kernels: gemv.cuh (few tokens), sm80_mma_experts.cuh (16-64 rows), sm90_wgmma_experts.cuh and
 * sm90_wgmma_ws_experts.cuh (128 rows on sm_90a); experts_plan.cu picks among them. Outputs: inter
 * [T*k, F] and y [T*k, O] in the compute dtype (the weight dtype; bf16 for fp8 weights), rows in sorted
 * order (direct mode: assignment order). See docs/cuda-design.md.
 */
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "activation.cuh"
#include "experts_plan.cuh"
#include "gemv.cuh"
#include "sm80_mma_experts.cuh"
#include "sm90_wgmma_experts.cuh"
#include "sm90_wgmma_ws_experts.cuh"

#if COLIBRI_TMA
/* Whether environment variable `name` is set to something other than "" or "0" (the switches below). */
static bool env_on(const char *name) {
    const char *v = getenv(name);
    return v && v[0] && strcmp(v, "0") != 0;
}
#endif

/* The BK=64 kernels take up to 3 * 288 rows * 128 bytes of shared memory per block: more than devices
 * with about 100 KB per block (sm_86, sm_89) allow; those keep BK=32 everywhere. */
colibri_status_t colibri_cuda_experts_setup(CudaBackend *b) {
    int optin = 0;
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, b->device));
    b->mma_wide_k = (size_t)optin >= MMA_SMEM_TWO_PER_SM;
    b->mma_long_k = (size_t)optin >= MMA_SMEM_ONE_PER_SM;
    const bool w = b->mma_wide_k, l = b->mma_long_k;
    cudaError_t kernel_setup = cudaSuccess;
    colibri_for_each_act([&](auto act) {
        using Act = decltype(act);
        if (kernel_setup == cudaSuccess) kernel_setup = mma_setup_all<__nv_bfloat16, Act>(w, l);
        if (kernel_setup == cudaSuccess) kernel_setup = mma_setup_all<__half, Act>(w, l);
        if (kernel_setup == cudaSuccess) kernel_setup = mma_setup_all<F8E4M3, Act>(w, l);
    });
    COLIBRI_CUDA_CHECK(kernel_setup);
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&b->sm_count, cudaDevAttrMultiProcessorCount, b->device));
    b->wgmma = wgmma_available(b->device);
    int major = 0;
    COLIBRI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, b->device));
    b->l2_prefetch = major == 9; /* the plan assumes a Hopper L2 and SM (see COLIBRI_PREFETCH_BYTES) */
    if (b->wgmma) {
        colibri_for_each_act([&](auto act) {
            using Act = decltype(act);
            if (kernel_setup == cudaSuccess) kernel_setup = wgmma_setup_one<__nv_bfloat16, Act>();
            if (kernel_setup == cudaSuccess) kernel_setup = wgmma_setup_one<__half, Act>();
        });
        COLIBRI_CUDA_CHECK(kernel_setup);
#if COLIBRI_TMA
        /* the warp-specialised kernel where the driver encodes tensor maps, else wgmma_kernel (also with
         * COLIBRI_CUDA_NO_WS=1: how the harness checks wgmma_kernel on an H100/H200) */
        b->tma_encode = env_on("COLIBRI_CUDA_NO_WS") ? NULL : ws_encode_fn();
        int clusters = -1;
        bool ws_ok = b->tma_encode != NULL;
        colibri_for_each_act([&](auto act) {
            using Act = decltype(act);
            if (ws_ok) ws_ok = wgmma_ws_setup_one<__nv_bfloat16, Act>(&clusters) == cudaSuccess;
            if (ws_ok) ws_ok = wgmma_ws_setup_one<__half, Act>(&clusters) == cudaSuccess;
        });
        if (b->tma_encode && !ws_ok) {
            (void)cudaGetLastError();
            b->tma_encode = NULL;
        }
        /* COLIBRI_CUDA_NO_MC=1: the tiles an expert shares stay on the one-block kernel (harness, timing) */
        b->ws_clusters = b->tma_encode && !env_on("COLIBRI_CUDA_NO_MC") && clusters > 0 ? clusters : 0;
        /* fp8 weights' tiles on the fp8 tensor cores where the weights' tensor maps encode */
        b->fp8_tc = b->tma_encode && colibri_cuda_fp8_setup() == cudaSuccess;
        if (b->tma_encode && !b->fp8_tc) (void)cudaGetLastError();
#endif
    }
    colibri_for_each_act([&](auto act) {
        using Act = decltype(act);
        const bool oai = std::is_same<Act, ActOai>::value; /* the plan reads one GLU entry: ActSilu's */
        for (int lk = 0; lk < 2 && !oai; lk++) {
            b->mma16_blocks_per_sm[Act::glu][0][lk] = mma16_blocks_per_sm<Act, MMA_BN>(w, lk && l);
            b->mma16_blocks_per_sm[Act::glu][1][lk] = mma16_blocks_per_sm<Act, MMA_NARROW_BN>(w, lk && l);
        }
    });
    return COLIBRI_OK;
}

#if COLIBRI_TMA
/* Whether the tensor maps of every projection wgmma_ws_kernel would run encode (project()'s arguments) */
template <class TW> static bool ws_maps_encode(const colibri_moe_context_t *ctx, const CudaBackend *b) {
    const colibri_moe_config_t *c = &ctx->cfg;
    const int32_t H = c->hidden_size, F = c->intermediate_size;
    const size_t mat = (size_t)F * H * sizeof(TW);
    CUtensorMap map;
    ProjArgs a = {};
    a.w = b->d_weights;
    a.w_expert_stride = b->expert_stride;
    a.n = F;
    a.k = H;
    if (!colibri_act_glu(c)) return ws_tensor_map<TW, false>(b->tma_encode, a, c->num_experts, &map);
    a.w_second = mat;
    if (!ws_tensor_map<TW, true>(b->tma_encode, a, c->num_experts, &map)) return false;
    a.w = b->d_weights + 2 * mat;
    a.w_second = 0;
    a.n = H;
    a.k = F;
    return ws_tensor_map<TW, false>(b->tma_encode, a, c->num_experts, &map);
}
#endif

/* An expert's last rows fold into its last whole tile (permute_scan's absorb) only where every projection of
 * 128-row tiles will run wgmma_ws_kernel, the one kernel that multiplies them: 16-bit weights, the map
 * encoder, and this context's tensor maps encoding (checked once here, so that project() never meets a
 * folded table it cannot run; it refuses one rather than drop rows). */
void colibri_cuda_experts_fold_setup(const colibri_moe_context_t *ctx, CudaBackend *b) {
    b->ws_fold = 0;
#if COLIBRI_TMA
    const colibri_moe_config_t *c = &ctx->cfg;
    if (!b->tma_encode || c->hidden_size % 8 || c->intermediate_size % 8) return;
    bool ok = false;
    if (c->weight_dtype == COLIBRI_DTYPE_BF16) ok = ws_maps_encode<__nv_bfloat16>(ctx, b);
    else if (c->weight_dtype == COLIBRI_DTYPE_F16) ok = ws_maps_encode<__half>(ctx, b);
    b->ws_fold = ok ? WS_EXTRA_ROWS : 0;
#else
    (void)ctx;
#endif
}

/* One projection over the tile table (or, direct_ids given, over the distinct experts of those ids):
 * x rows -> out [positions, n] (compute dtype), weights at byte offset `first` (and `first + second` for
 * the up matrix of a GLU) inside each expert, `matrix` their index in an expert (colibri_scale_grid_offset:
 * fp8 weights' scales). `bookkeeping`: this projection keeps the direct mode's counters. */
template <class TW, class TX, class Act>
static cudaError_t project(const colibri_moe_context_t *ctx, int64_t assignments, int32_t tile_m, size_t first,
                           size_t second, int matrix, int32_t n, int32_t k, const void *x, const int32_t *row_map,
                           void *out, bool x_aligned, const int32_t *direct_ids, bool bookkeeping,
                           cudaStream_t stream) {
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
        /* 16-byte loads: 16 fp8 weights, else 8 elements or more */
        const bool vec = k % (f8 ? 16 : 8) == 0 && x_aligned;
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

/* Direct mode's down projection with the combine folded in (gemv_combine_kernel), as a ProjArgs like
 * project()'s; plan_combine_rows sizes its blocks. */
template <class TW, class TA>
static cudaError_t project_combine(const colibri_moe_context_t *ctx, int64_t assignments, size_t first,
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

colibri_status_t colibri_cuda_launch_experts(const colibri_moe_context_t *ctx, int64_t num_tokens,
                                             colibri_dtype_t act_dtype, const void *input, int32_t tile_m,
                                             const int32_t *direct_ids, const float *topk_weights, void *output,
                                             bool *combined, cudaStream_t stream) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const int64_t assignments = num_tokens * c->top_k;
    const int32_t H = c->hidden_size, F = c->intermediate_size;
    const size_t wsize = colibri_dtype_size(c->weight_dtype), mat = (size_t)F * H * wsize;
    const bool swiglu = c->expert_kind == COLIBRI_EXPERT_SWIGLU;
    const colibri_dtype_t out_dtype = act_dtype, compute = colibri_cuda_compute_dtype(c);
    /* the down projection of direct mode sums the top-k itself where its rows allow 16-byte loads */
    const bool fold = swiglu && direct_ids && assignments <= GEMV_COMBINE_MAX &&
                      F % colibri_cuda_vec_multiple(c->weight_dtype) == 0;
    *combined = false;
    /* fp8 weights' tiles (experts_plan.cu chose them): the fp8 tensor cores, which quantise x themselves */
    if (tile_m > GEMV_GROUP && c->weight_dtype == COLIBRI_DTYPE_F8E4M3 && colibri_cuda_fp8_tensor_cores(ctx))
        return colibri_cuda_launch_fp8_experts(ctx, num_tokens, act_dtype, input, stream);
    /* the tensor-core path reads x in the compute dtype */
    if (tile_m > GEMV_GROUP && act_dtype != compute) {
        colibri_status_t st = colibri_cuda_launch_convert(input, act_dtype, b->xc, compute, num_tokens * H, stream);
        if (st != COLIBRI_OK) return st;
        input = b->xc;
        act_dtype = compute;
    }
    const bool in_aligned = colibri_aligned16(input);
    cudaError_t err = cudaSuccess;
    colibri_dispatch_weight_dtype(c->weight_dtype, [&](auto tw) {
        using TW = typename decltype(tw)::type;
        colibri_dispatch_dtype(act_dtype, [&](auto tx) {
            using TX = typename decltype(tx)::type;
            colibri_dispatch_act(c, [&](auto act) {
                using Act = decltype(act);
                err = project<TW, TX, Act>(ctx, assignments, tile_m, 0, Act::glu ? mat : 0, 0, F, H, input, b->perm,
                                           swiglu ? b->inter : b->y, in_aligned, direct_ids, true, stream);
            });
        });
        if (err == cudaSuccess && fold) {
            colibri_dispatch_dtype(out_dtype, [&](auto ta) {
                using TA = typename decltype(ta)::type;
                err = project_combine<TW, TA>(ctx, assignments, 2 * mat, direct_ids, topk_weights, (TA *)output,
                                              stream);
            });
        } else if (err == cudaSuccess && swiglu) {
            err = project<TW, compute_t<TW>, ActLinear>(ctx, assignments, tile_m, 2 * mat, 0, 2, H, F, b->inter, NULL,
                                                        b->y, true, direct_ids, false, stream);
        }
    });
    COLIBRI_CUDA_CHECK(err);
    *combined = fold;
    return COLIBRI_OK;
}

#define PREFETCH_THREADS 256

/* Bytes [0, bytes) (a multiple of 16) of rows [0, rows) of matrices [0, nmat) of experts [0, ...) into L2,
 * a row per thread and step: count = experts * nmat * rows. It reads only the weights, which no kernel
 * writes, so it lets its dependents launch at once and waits for the kernel before it only at its end:
 * the kernel after it, which waits for it, then still waits for that one. */
__global__ void __launch_bounds__(PREFETCH_THREADS) weights_prefetch_kernel(const char *w, size_t expert_stride,
                                                                            size_t second, int nmat, int rows,
                                                                            size_t row_bytes, uint32_t bytes,
                                                                            int count) {
    pdl_trigger();
    for (int i = blockIdx.x * PREFETCH_THREADS + threadIdx.x; i < count; i += gridDim.x * PREFETCH_THREADS) {
        const int set = i / rows;
        const char *row = w + (size_t)(set / nmat) * expert_stride + (size_t)(set % nmat) * second +
                          (size_t)(i - set * rows) * row_bytes;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDACC_VER_MAJOR__ >= 12
        /* the bulk-copy engine fetches the whole run: one instruction per row */
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(bytes) : "memory");
#else
        for (uint32_t off = 0; off < bytes; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
#endif
    }
    pdl_wait();
}

colibri_status_t colibri_cuda_launch_prefetch(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m,
                                              cudaStream_t stream) {
    const PrefetchPlan p = colibri_cuda_prefetch_plan(ctx, num_tokens, tile_m);
    if (p.experts == 0) return COLIBRI_OK;
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    /* the plan's budget (COLIBRI_PREFETCH_BYTES) bounds count: at most that / 64 rows */
    const int count = p.experts * p.matrices * p.rows;
    int blocks = (count + PREFETCH_THREADS - 1) / PREFETCH_THREADS;
    blocks = blocks < 2 * b->sm_count ? blocks : 2 * b->sm_count;
    const size_t row_bytes = (size_t)c->hidden_size * 2, mat = (size_t)c->intermediate_size * row_bytes;
    COLIBRI_CUDA_CHECK(colibri_launch(weights_prefetch_kernel, dim3((unsigned)blocks), dim3(PREFETCH_THREADS), 0,
                                      stream, (const char *)b->d_weights, b->expert_stride, mat, p.matrices, p.rows,
                                      row_bytes, p.bytes, count));
    return COLIBRI_OK;
}
