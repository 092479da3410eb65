/*
 * experts.cu — the expert FFNs over tokens grouped by expert (permute.cu's tile table): setup of the
 * expert kernels, the dispatch of each projection to its weight dtype and activation tag, and the L2
 * prefetch beside the router. The projections and their kernels are instantiated in instances/*.cu
 * (experts_instances.cuh); experts_plan.cu picks the kernel. Outputs: inter [T*k, F] and y [T*k, O] in
 * the compute dtype (the weight dtype; bf16 for fp8 weights), rows in sorted order (direct mode:
 * assignment order). See docs/cuda-design.md.
 */
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "experts_instances.cuh"
#include "experts_plan.cuh"
#include "gemv.cuh"
#include "sm80_mma_experts.cuh"
#include "sm90_wgmma_ws_experts.cuh"

#if COLIBRI_TMA
/* Whether environment variable `name` is set to something other than "" or "0" (the switches below). */
static bool env_on(const char *name) {
    const char *v = getenv(name);
    return v && v[0] && strcmp(v, "0") != 0;
}
#endif

/* Writes 1 where the sm_90a image (and so wgmma_kernel's body) is the one this device runs. */
__global__ void wgmma_probe_kernel(int *flag) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *flag = 1;
#else
    *flag = 0;
#endif
}

static bool wgmma_available(int device) {
    int major = 0, optin = 0, flag = 0, *d_flag = NULL;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major != 9 ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        optin < WG_SMEM_BYTES || cudaMalloc(&d_flag, sizeof(int)) != cudaSuccess)
        return false;
    wgmma_probe_kernel<<<1, 1>>>(d_flag);
    (void)cudaGetLastError(); /* a probe that could not launch leaves flag unread: no wgmma */
    const bool ok = cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && flag == 1;
    cudaFree(d_flag);
    return ok;
}

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
        if (kernel_setup == cudaSuccess) kernel_setup = MmaSetup<__nv_bfloat16, Act>::run(w, l);
        if (kernel_setup == cudaSuccess) kernel_setup = MmaSetup<__half, Act>::run(w, l);
        if (kernel_setup == cudaSuccess) kernel_setup = MmaSetup<F8E4M3, Act>::run(w, l);
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
            if (kernel_setup == cudaSuccess) kernel_setup = WgmmaSetup<__nv_bfloat16, Act>::wgmma();
            if (kernel_setup == cudaSuccess) kernel_setup = WgmmaSetup<__half, Act>::wgmma();
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
            if (ws_ok) ws_ok = WgmmaSetup<__nv_bfloat16, Act>::ws(&clusters) == cudaSuccess;
            if (ws_ok) ws_ok = WgmmaSetup<__half, Act>::ws(&clusters) == cudaSuccess;
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
            b->mma16_blocks_per_sm[Act::glu][0][lk] = Mma16Occupancy<Act, MMA_BN>::blocks_per_sm(w, lk && l);
            b->mma16_blocks_per_sm[Act::glu][1][lk] = Mma16Occupancy<Act, MMA_NARROW_BN>::blocks_per_sm(w, lk && l);
        }
    });
    return COLIBRI_OK;
}

#if COLIBRI_TMA
/* Whether the tensor maps of every projection wgmma_ws_kernel would run encode (ExpertProjection's arguments) */
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
 * encoder, and this context's tensor maps encoding (checked once here, so that ExpertProjection never meets a
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
                err = ExpertProjection<TW, TX, Act>::run(ctx, assignments, tile_m, 0, Act::glu ? mat : 0, 0, F, H,
                                                         input, b->perm, swiglu ? b->inter : b->y, in_aligned,
                                                         direct_ids, true, stream);
            });
        });
        if (err == cudaSuccess && fold) {
            colibri_dispatch_dtype(out_dtype, [&](auto ta) {
                using TA = typename decltype(ta)::type;
                err = ExpertCombine<TW, TA>::run(ctx, assignments, 2 * mat, direct_ids, topk_weights, (TA *)output,
                                                 stream);
            });
        } else if (err == cudaSuccess && swiglu) {
            err = ExpertProjection<TW, compute_t<TW>, ActLinear>::run(ctx, assignments, tile_m, 2 * mat, 0, 2, H, F,
                                                                      b->inter, NULL, b->y, true, direct_ids, false,
                                                                      stream);
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
