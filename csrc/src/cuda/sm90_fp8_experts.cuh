/*
 * sm90_fp8_experts.cuh — wgmma_fp8_kernel, the fp8 e4m3 expert projection on Hopper tensor cores (sm_90a,
 * CUDA 12 tensor maps): 128-row tiles of permute.cu's table, activations quantised per row and 128
 * columns (fp8_quant.cuh), weights with fp32 block, channel or tensor scales (colibri.h). Its tensor map
 * and launch too. The design follows wgmma_ws_kernel (docs/cuda-design.md): a producer warpgroup fills the
 * ring of sm90_tma_ring.cuh (weights by TMA, token rows gathered by cp.async), two consumer warpgroups
 * multiply and store.
 */
#ifndef COLIBRI_CUDA_SM90_FP8_EXPERTS_CUH
#define COLIBRI_CUDA_SM90_FP8_EXPERTS_CUH

#include "fp8_quant.cuh"
#include "sm90_wgmma_ws_experts.cuh"

/* A stage is one 128-column scale group of k: 128 token rows and 128 weight rows of 128 bytes, the rows of
 * the 128-byte swizzle as the bf16 kernels lay them out (a k step of 32 fp8 is 32 bytes of a row, as 16
 * bf16 are). 128 weight rows, not the bf16 kernels' 256: each consumer thread holds the k step's partial
 * sums and the promoted totals (64 + 64 registers), since the activation scale changes every 128 columns. */
#define F8_BM 128
#define F8_BN 128
#define F8_BK 128
#define F8_STAGES 6
#define F8_A_BYTES (F8_BM * F8_BK)
#define F8_B_BYTES (F8_BN * F8_BK)
#define F8_STAGE_BYTES (F8_A_BYTES + F8_B_BYTES)
#define F8_THREADS (WG_THREADS + 128)
/* + 1024: the alignment to the swizzle's period; then the ring's mbarriers, 16 bytes a slot */
#define F8_SMEM_BYTES (F8_STAGES * F8_STAGE_BYTES + 1024 + F8_STAGES * 16)
static_assert(F8_SMEM_BYTES <= 232448, "wgmma_fp8_kernel's shared memory is over the H100/H200 opt-in limit");
static_assert(F8_BK == FP8_GROUP, "a stage is one activation scale group");

/* One fp8 projection over the tile table: out[p, n] (bf16) = act of sum_k wq[n, k] x[row(p), k] with the
 * scales applied. Field names as ProjArgs's where activation.cuh reads them (bias, n, act_*). */
struct Fp8ProjArgs {
    int32_t n, k;
    const uint8_t *x;         /* [rows, k] fp8 */
    const float *x_scales;    /* [rows, fp8_groups(k)] */
    const int32_t *row_map;   /* position p reads x row row_map[p] / row_div; NULL: row p */
    int32_t row_div;
    __nv_bfloat16 *out;       /* [positions, n] */
    const ExpertTile *tiles;
    const int32_t *num_tiles;
    /* the weight scales of expert 0's matrix (a GLU: its gate matrix; the up grid w_second_scales on), a
     * grid of blocks of sbn rows x sbk columns (0: the whole dimension), s_cols columns; experts
     * ws_expert_stride floats apart. per_channel: one scale per output row (sbn 1, sbk 0), applied at the
     * end; else the item's rows lie in one block row (sbn 0 or a multiple of F8_BN) and k steps in one
     * block column (sbk 0 or a multiple of F8_BK), so one scale per k step is folded into the promotion. */
    const float *w_scales;
    size_t ws_expert_stride, w_second_scales;
    int32_t sbn, sbk, s_cols, per_channel;
    const float *bias; /* a GLU's gate and up biases (colibri_glu_bias), or NULL */
    int32_t bias_stride;
    float act_alpha, act_limit;
};

/* Whether the fp8 tensor-core kernel takes a layer's weight scales (Fp8ProjArgs's per_channel rule). */
static inline bool fp8_scales_fit(int32_t bn, int32_t bk) {
    if (bn == 1 && bk == 0) return true;
    return (bn == 0 || bn % F8_BN == 0) && (bk == 0 || bk % F8_BK == 0);
}

#if COLIBRI_TMA
#define F8_D_REGS                                                                         \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "             \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "    \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "    \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define F8_D_OPERANDS(d)                                                                                     \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),            \
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),            \
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),            \
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),            \
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),            \
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),            \
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* d = A B^T (accumulate: d +=) for a 64 x 32 A and a 128 x 32 B of fp8, both K-major in shared memory */
__device__ __forceinline__ void f8_mma(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " F8_D_REGS ", %64, %65, p, 1, 1;\n}"
                 : F8_D_OPERANDS(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}
#endif

__device__ __forceinline__ uint32_t f8_full_bar(uint32_t sbase, int slot) {
    return sbase + F8_STAGES * F8_STAGE_BYTES + 16 * slot;
}
__device__ __forceinline__ uint32_t f8_empty_bar(uint32_t sbase, int slot) { return f8_full_bar(sbase, slot) + 8; }

/* Persistent: block b computes items b, b + gridDim.x, ... in wg_item's order (tile, column block); an item
 * is a tile's 128 rows x 128 weight rows: a GLU's 64 gate rows and the 64 up rows of the same output
 * columns, else 128 output columns. Threads 256-383 load: per stage the weight rows by two TMA boxes of
 * 64 rows and the token rows by cp.async through row_map, both completing on the slot's "full" mbarrier.
 * Warpgroup w < 2 multiplies rows 64w.. of the tile: per stage four m64n128k32 products into `part`, then
 * acc += part * x scale of the row * weight scale of the k step (the promotion), after releasing the
 * slot. Output columns past n are computed from whatever the map's next rows hold and never stored. */
template <class Act>
__global__ void __launch_bounds__(F8_THREADS, 1) wgmma_fp8_kernel(const __grid_constant__ CUtensorMap wmap,
                                                                 Fp8ProjArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = Act::glu ? F8_BN / 2 : F8_BN; /* output columns per item */
    constexpr int P_THREADS = F8_THREADS - WG_THREADS;
    constexpr int A_PER_T = F8_BM * 8 / P_THREADS, ROW_STEP = P_THREADS / 8;
    pdl_begin();
    const int tiles = *a.num_tiles, nblocks = (a.n + COLS - 1) / COLS, items = tiles * nblocks;
    const int ktiles = (a.k + F8_BK - 1) / F8_BK;
    const int tid = threadIdx.x;

    extern __shared__ char smem[];
    const uint32_t sbase = ((uint32_t)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    if (tid == WG_THREADS) {
        ring_init(f8_full_bar(sbase, 0), 16, F8_STAGES, P_THREADS + 1, WG_THREADS / 32);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (tid >= WG_THREADS) {
        /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WS_PRODUCER_REGS));
        const int p = tid - WG_THREADS, c = p & 7, r0 = p >> 3;
        /* thread p copies 16-byte chunk c of rows r0 + i ROW_STEP: one swizzled offset for all */
        const uint32_t my_off = swz<64>(r0, c);
        const uint64_t map = reinterpret_cast<uint64_t>(&wmap);
        if (p == 0) asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
        RingPos<F8_STAGES> ring = {0, 1u};
        for (int it = blockIdx.x; it < items; it += gridDim.x) {
            int ti, nb;
            wg_item(it, tiles, nblocks, ti, nb);
            const ExpertTile tile = a.tiles[ti];
            int row[A_PER_T]; /* x row of each of this thread's tile rows; -1 past the tile's end */
            ring_token_rows<A_PER_T, ROW_STEP>(row, tile.begin + r0, tile.end, a.row_map, a.row_div);
            /* the map's rows of the two boxes: a GLU's gate rows and the up rows of the same columns, else
             * the item's 128 rows */
            const int row0 = nb * COLS, row1 = Act::glu ? a.n + nb * COLS : nb * COLS + F8_BN / 2;
            for (int kt = 0; kt < ktiles; kt++) {
                ring_acquire(f8_empty_bar(sbase, ring.slot), ring.parity);
                const uint32_t st = sbase + (uint32_t)ring.slot * F8_STAGE_BYTES, full = f8_full_bar(sbase, ring.slot);
                const int k0 = kt * F8_BK;
                if (p == 0) {
                    ring_expect(full, (uint32_t)F8_B_BYTES);
                    ws_tma_rows(st + F8_A_BYTES, map, k0, row0, tile.expert, full);
                    ws_tma_rows(st + F8_A_BYTES + F8_B_BYTES / 2, map, k0, row1, tile.expert, full);
                }
                ring_gather<A_PER_T, ROW_STEP>(st + my_off, row, a.x, a.k, k0 + c * 16, k0 + c * 16 < a.k,
                                               (const void *)a.x);
                ring_commit(full);
                ring.next();
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }

    /* ---- consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WS_CONSUMER_REGS));
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, groups = fp8_groups(a.k);
    float acc[64], part[64];
    RingPos<F8_STAGES> cons = {0, 0u};
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        int ti, nb;
        wg_item(it, tiles, nblocks, ti, nb);
        const ExpertTile tile = a.tiles[ti];
        /* this thread's two rows of the tile (accumulators 4j, 4j + 1 and 4j + 2, 4j + 3) and their x rows */
        const int p0 = tile.begin + 64 * wg + 16 * warp + (lane >> 2), p1 = p0 + 8;
        const int x0 = p0 < tile.end ? (a.row_map ? a.row_map[p0] / a.row_div : p0) : -1;
        const int x1 = p1 < tile.end ? (a.row_map ? a.row_map[p1] / a.row_div : p1) : -1;
        const float *xs0 = a.x_scales + (size_t)(x0 < 0 ? 0 : x0) * groups;
        const float *xs1 = a.x_scales + (size_t)(x1 < 0 ? 0 : x1) * groups;
        /* the weight scales' row of blocks holding the item's rows (per_channel: the output columns' own) */
        const float *wsc = a.w_scales + (size_t)tile.expert * a.ws_expert_stride;
        const float *wrow = wsc + (a.per_channel || a.sbn == 0 ? 0 : (size_t)(nb * COLS / a.sbn) * a.s_cols);
#pragma unroll
        for (int i = 0; i < 64; i++) acc[i] = 0.0f;
        /* MMA false: this warpgroup's 64 rows are all past the tile's end; it keeps the ring in step only */
        auto k_loop = [&](auto mma_tag) {
            constexpr bool MMA = decltype(mma_tag)::value;
            for (int kt = 0; kt < ktiles; kt++) {
                float s0 = 0.0f, s1 = 0.0f, wg_s = 1.0f, wu_s = 1.0f;
                if constexpr (MMA) {
                    /* the scales, loaded before the wait for the stage */
                    s0 = x0 >= 0 ? __ldg(xs0 + kt) : 0.0f;
                    s1 = x1 >= 0 ? __ldg(xs1 + kt) : 0.0f;
                    if (!a.per_channel) {
                        const int kb = a.sbk > 0 ? kt * F8_BK / a.sbk : 0;
                        wg_s = __ldg(wrow + kb);
                        wu_s = Act::glu ? __ldg(wrow + a.w_second_scales + kb) : wg_s;
                    }
                }
                ws_wait(f8_full_bar(sbase, cons.slot), cons.parity);
                if constexpr (MMA) {
                    /* A was written through the generic proxy (cp.async); wgmma reads through the async proxy */
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    const uint32_t st = sbase + (uint32_t)cons.slot * F8_STAGE_BYTES;
                    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                    for (int ks = 0; ks < F8_BK / 32; ks++)
                        f8_mma(part, wg_desc(st + wg * (F8_A_BYTES / 2) + ks * 32), wg_desc(st + F8_A_BYTES + ks * 32),
                               ks);
                    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                }
                /* this warp is done with the slot */
                __syncwarp();
                if (lane == 0) ring_release(f8_empty_bar(sbase, cons.slot));
                if constexpr (MMA) {
                    const float g0 = s0 * wg_s, g1 = s1 * wg_s, u0 = s0 * wu_s, u1 = s1 * wu_s;
#pragma unroll
                    for (int j = 0; j < 16; j++) {
                        const bool up = Act::glu && j >= 8; /* a GLU's columns 64.. are the up rows */
                        const float f0 = up ? u0 : g0, f1 = up ? u1 : g1;
                        acc[4 * j] = fmaf(part[4 * j], f0, acc[4 * j]);
                        acc[4 * j + 1] = fmaf(part[4 * j + 1], f0, acc[4 * j + 1]);
                        acc[4 * j + 2] = fmaf(part[4 * j + 2], f1, acc[4 * j + 2]);
                        acc[4 * j + 3] = fmaf(part[4 * j + 3], f1, acc[4 * j + 3]);
                    }
                }
                cons.next();
            }
        };
        if (tile.end - tile.begin > 64 * wg) k_loop(std::true_type{});
        else {
            k_loop(std::false_type{});
            continue;
        }

        /* Epilogue: accumulator 4j + 2h + e is row p_h, item column 8j + 2t + e (t = lane % 4) */
        const int t = lane & 3;
#pragma unroll
        for (int j = 0; j < COLS / 8; j++) {
            const int col = nb * COLS + 8 * j + 2 * t;
            if (col >= a.n) continue;
            float cs[2] = {1.0f, 1.0f}, cu[2] = {1.0f, 1.0f};
            if (a.per_channel) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    cs[e] = __ldg(wsc + col + e);
                    if (Act::glu) cu[e] = __ldg(wsc + a.w_second_scales + col + e);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int pos = h ? p1 : p0;
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float g = acc[4 * j + 2 * h + e] * cs[e];
                    if constexpr (Act::glu) {
                        float u = acc[4 * (j + 8) + 2 * h + e] * cu[e];
                        colibri_glu_bias(a, tile.expert, col + e, g, u);
                        g = Act::apply_fast(g, u, a);
                    }
                    v[e] = g;
                }
                if (pos < tile.end)
                    *reinterpret_cast<uint32_t *>(a.out + (size_t)pos * a.n + col) = pack2<__nv_bfloat16>(v[0], v[1]);
            }
        }
    }
#endif
}

/* The 3-d tensor map (k, row, expert) of a projection's fp8 weights, boxes of 128 k x 64 rows, 128-byte
 * swizzled; rows and k past the matrix read 0. A GLU's map has 2n rows (up after gate: w_second = n k). */
static bool fp8_tensor_map(void *encode, const uint8_t *w, size_t expert_stride, int32_t n, int32_t k, bool glu,
                           int experts, CUtensorMap *map) {
    const cuuint64_t dims[3] = {(cuuint64_t)k, (cuuint64_t)(glu ? 2 * n : n), (cuuint64_t)experts};
    const cuuint64_t strides[2] = {(cuuint64_t)k, (cuuint64_t)expert_stride};
    const cuuint32_t box[3] = {F8_BK, F8_BN / 2, 1}, unit[3] = {1, 1, 1};
    return ((WsEncodeFn)encode)(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)w, dims, strides, box, unit,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <class Act> static cudaError_t wgmma_fp8_setup_one() {
    return cudaFuncSetAttribute(wgmma_fp8_kernel<Act>, cudaFuncAttributeMaxDynamicSharedMemorySize, F8_SMEM_BYTES);
}

/* One block per SM, at most one per item the tile table can hold (slots: its most tiles). */
template <class Act>
static cudaError_t wgmma_fp8_launch(const CUtensorMap &map, const Fp8ProjArgs &a, int64_t slots, int sms,
                                    cudaStream_t stream) {
    constexpr int COLS = Act::glu ? F8_BN / 2 : F8_BN;
    const int64_t most = slots * ((a.n + COLS - 1) / COLS);
    return colibri_launch(wgmma_fp8_kernel<Act>, dim3((unsigned)(most < sms ? most : sms)), dim3(F8_THREADS),
                          F8_SMEM_BYTES, stream, map, a);
}
#endif /* COLIBRI_TMA */

#endif /* COLIBRI_CUDA_SM90_FP8_EXPERTS_CUH */
