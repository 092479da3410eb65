/*
 * experts_plan.cu — the expert path's decisions, host only: the path and tile height of a forward
 * (colibri_cuda_experts_tile_m), direct mode, the cluster kernel's pairs and folded rows, which
 * variant of a kernel a projection runs and how its grid is sized (experts_plan.cuh, for experts.cu's
 * launchers), and the L2 prefetch plan. Reads the backend's fields; queries and launches nothing.
 */
#include <math.h>

#include "activation.cuh"
#include "experts_plan.cuh"
#include "sm80_mma_experts.cuh"
#include "sm90_wgmma.cuh"

/* Whether a 16-row projection of n outputs runs the narrow kernel: when its grid over the experts
 * likely touched (top-k of num_tokens tokens spread evenly over E) ends in a clearly fuller last wave
 * than the BN = 128 grid does. Small batches leave most of a wave idle with BN = 128 (Qwen T=4: 0.6 of
 * one wave) or a ragged last one (Mixtral T=16: 3.4 waves). */
static double mma16_touched(const colibri_moe_config_t *c, int64_t num_tokens) {
    const double E = c->num_experts;
    return E * (1.0 - pow(1.0 - (double)c->top_k / E, (double)num_tokens));
}

/* Waves of the 16-row grid of n outputs (BN = 128 or narrow; long_k: the BK=128 kernel) on this device. */
static double mma16_waves(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, bool glu, int32_t n,
                          bool narrow, bool long_k) {
    const int bn = narrow ? MMA_NARROW_BN : MMA_BN, per_sm = b->mma16_blocks_per_sm[glu][narrow][long_k];
    if (per_sm <= 0) return 0.0;
    return mma16_touched(c, num_tokens) * ((n + bn - 1) / bn) / ((double)b->sm_count * per_sm);
}

static bool mma_narrow(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, bool glu, int32_t n,
                       bool long_k) {
    double fill[2];
    for (int narrow = 0; narrow < 2; narrow++) {
        const double waves = mma16_waves(b, c, num_tokens, glu, n, narrow, long_k);
        if (waves <= 0.0) return false;
        fill[narrow] = waves / ceil(waves);
    }
    return fill[1] > fill[0] + 0.05;
}

/* Whether a 16-row projection of short rows (K < MMA_LONG_K) takes BK=128: only where its BN = 128 grid
 * is at least MMA16_LONG_MIN_WAVES waves of that kernel, whose blocks per SM are fewer. */
#define MMA16_LONG_MIN_WAVES 2.0
static bool mma16_long(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, bool glu, int32_t n) {
    return mma16_waves(b, c, num_tokens, glu, n, false, true) >= MMA16_LONG_MIN_WAVES;
}

/* Where the tensor cores could run, the few-tokens path serves at most this many assignments: so few
 * touched experts leave a tensor-core grid's SMs idle, while the gemv spreads an expert over N/8 blocks.
 * With GEMV_MANY_EXPERTS or more (the shared slots counted), twice as many: nearly every assignment is an
 * expert of its own there, which a 16-row tile reads for one row after a permutation; the gemv took
 * 13 us off Qwen3-Next's 87 us decode step (512 experts, 10 + 1 slots; docs/performance.md). */
#define GEMV_MAX_ASSIGNMENTS 8
#define GEMV_MANY_EXPERTS 256
static int64_t gemv_max_assignments(int64_t experts) {
    return experts >= GEMV_MANY_EXPERTS ? 2 * GEMV_MAX_ASSIGNMENTS : GEMV_MAX_ASSIGNMENTS;
}

/* Direct mode with rows of at most this many bytes per warp (fine-grained experts) launches about
 * GEMV_LOOP_BLOCKS_PER_SM blocks per SM whose warps loop over rows: a block's setup (its expert found
 * in the ids) and its wait for a slot are then paid once per slot, not once per 8 rows. */
#define GEMV_SHORT_ROW_BYTES 8192
#define GEMV_LOOP_BLOCKS_PER_SM 3

int plan_gemv_row_blocks(const CudaBackend *b, bool direct, size_t row_bytes, int64_t slots) {
    if (!direct || row_bytes > GEMV_SHORT_ROW_BYTES) return 0;
    return (int)(((int64_t)GEMV_LOOP_BLOCKS_PER_SM * b->sm_count + slots - 1) / slots);
}

/* gemv_combine_kernel's rows per block: about GEMV_LOOP_BLOCKS_PER_SM blocks per SM where the rows are
 * short (the rows x assignments pairs spread over them), else one pair per warp (long rows: Mixtral's
 * 28 KB). */
int plan_combine_rows(const CudaBackend *b, size_t row_bytes, int32_t n, int64_t assignments) {
    int64_t rows;
    if (row_bytes <= GEMV_SHORT_ROW_BYTES) {
        const int64_t blocks = (int64_t)GEMV_LOOP_BLOCKS_PER_SM * b->sm_count;
        rows = (n + blocks - 1) / blocks;
    } else {
        rows = (GEMV_WARPS + assignments - 1) / assignments;
    }
    return (int)(rows < 1 ? 1 : rows > GEMV_COMBINE_ROWS ? GEMV_COMBINE_ROWS : rows);
}

#define WS_SMALL_TILE_MIN_EXPERTS 32

/* 1..GEMV_GROUP: the few-tokens path (gemv.cuh) with that many token rows per pass: the smallest of 2,
 * 4, 8 at or above 1.5x the mean assignments per expert (1 where the experts outnumber the assignments
 * 4 to 1). 16..128: the tensor-core tile height, ~1.5x the mean so that most experts fit in one tile
 * and their weights are read once; 32 rather than 64 where 1.3x the mean fits, as the 64-row GLU tile
 * keeps BK=32. docs/cuda-design.md has the table, docs/performance.md the figures. */
int32_t colibri_cuda_experts_tile_m(const colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                    const void *input) {
    const colibri_moe_config_t *c = &ctx->cfg;
    /* fp8 weights: the fp8 tensor cores where they take the layer (sm90_fp8_experts.cuh); else mma_kernel's
     * tiles where the weight dtype has them (fp8 widened to bf16) and rows are multiples of its mma_k, with x
     * in the compute dtype 16-byte aligned; else the gemv */
    const colibri_dtype_info_t w = colibri_dtype_info(c->weight_dtype);
    const bool f8 = c->weight_dtype == COLIBRI_DTYPE_F8E4M3, f8_tc = f8 && colibri_cuda_fp8_tensor_cores(ctx);
    const bool tensor_cores = f8_tc || (w.mma_k > 0 && c->hidden_size % w.mma_k == 0 && c->intermediate_size % w.mma_k == 0 &&
                                        (act_dtype != w.compute || colibri_aligned16(input)));
    const int64_t assignments = num_tokens * c->top_k, E = c->num_experts;
    if (!tensor_cores || assignments <= gemv_max_assignments(E)) {
        if (4 * assignments <= E) return 1;
        const int64_t want3 = assignments * 3; /* 2 * (1.5 * mean) * E */
        return want3 <= 4 * E ? 2 : want3 <= 8 * E ? 4 : GEMV_GROUP;
    }
    /* wgmma_fp8_kernel's tiles are 128 rows: with fewer rows per expert it streams the weights, at the copy
     * rate from 16 tokens on (Mixtral, DeepSeek-V3 shapes; docs/performance.md) */
    if (f8_tc) return WG_BM;
    const int64_t want = (assignments * 3 / 2 + E - 1) / E;
    int32_t tile = want <= 16 ? 16 : want <= 32 ? 32 : want <= 64 ? 64 : 128;
    if (want > 32 && want <= 64 && assignments * 13 / 10 <= 32 * E) tile = 32;
    /* With many experts, tiles of 32 or 64 rows go to the 128-row warp-specialised kernel instead: its
     * producer streams a partial tile's weights well and its items hand out by a counter. */
    if (tile >= 32 && tile < WG_BM && E >= WS_SMALL_TILE_MIN_EXPERTS && ((const CudaBackend *)ctx->backend)->tma_encode &&
        !f8)
        tile = WG_BM;
    return tile;
}

/* Few enough assignments that the few-tokens path finds each block's expert itself (no permute). */
bool colibri_cuda_experts_direct(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
    return tile_m <= GEMV_GROUP && num_tokens * ctx->cfg.top_k <= GEMV_DIRECT_MAX &&
           ctx->cfg.num_experts <= GEMV_DIRECT_MAX_E;
}

/* Whether the 128-row tiles of a projection of `assignments` stream their weights from HBM: the experts
 * have fewer assignments than a tile on average (wgmma_launch's `streaming`, and the prefetch plan). */
bool plan_wg_streaming(const colibri_moe_config_t *c, int64_t assignments) {
    return assignments < (int64_t)WG_BM * c->num_experts;
}

/* Whether the 128-row tiles of a projection of `assignments` run on the cluster kernel (sm90_wgmma_ws_experts.cuh's
 * MC): where they are compute-bound and the experts have at most WS_MC_MAX_TILES tiles each; with more,
 * the one-block kernel's tiles share the weight blocks in L2 anyway and the pairs' coupling costs more. */
#define WS_MC_MAX_TILES 2
/* Where every item's k loop is long (H and F both at least WS_MC_LONG_K), the limit counts tiles with
 * their folded rows, 128 + b->ws_fold each. */
#define WS_MC_LONG_K 4096
/* The streaming projections of at most this many k elements run wgmma_ws_kernel's DRAIN variant (4
 * stages in flight): it pays for short k loops only. */
#define WS_DRAIN_MAX_K 2048

static bool ws_multicast(const colibri_moe_config_t *c, const CudaBackend *b, int64_t assignments) {
    const bool long_k = c->hidden_size >= WS_MC_LONG_K && c->intermediate_size >= WS_MC_LONG_K;
    const int64_t rows = WG_BM + (long_k ? b->ws_fold : 0);
    return !plan_wg_streaming(c, assignments) && assignments <= (int64_t)WS_MC_MAX_TILES * rows * c->num_experts;
}

int plan_ws_clusters(const CudaBackend *b, const colibri_moe_config_t *c, int64_t assignments) {
    return ws_multicast(c, b, assignments) ? b->ws_clusters : 0;
}

bool plan_ws_drain(const colibri_moe_config_t *c, int64_t assignments, int32_t k) {
    return plan_wg_streaming(c, assignments) && k <= WS_DRAIN_MAX_K;
}

/* A SWIGLU forward's two projections chained per tile (sm90_wgmma_ws_experts.cuh, ws_chain_wait), where both run on
 * wgmma_ws_kernel (ws_fold: their maps encoded at init) and either the first projection's column blocks
 * are one group of WG_GROUP_N (F <= 2048: its items complete the tiles in order) or the cluster kernel
 * runs; on Mixtral's L2-bound one-block kernel the chain lost (docs/performance.md). */
int32_t plan_ws_chain(const colibri_moe_context_t *ctx, bool direct, int clusters) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const int32_t up_blocks = (ctx->cfg.intermediate_size + WG_BN / 2 - 1) / (WG_BN / 2);
    if (!direct && b->ws_fold > 0 && ctx->cfg.expert_kind == COLIBRI_EXPERT_SWIGLU &&
        (up_blocks <= WG_GROUP_N || clusters > 0))
        return up_blocks;
    return 0;
}

bool colibri_cuda_experts_pairs(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
#if COLIBRI_TMA
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    return tile_m == WG_BM && b->ws_clusters > 0 && ws_multicast(&ctx->cfg, b, num_tokens * ctx->cfg.top_k);
#else
    (void)ctx, (void)num_tokens, (void)tile_m;
    return false;
#endif
}

/* Rows an expert's last whole tile may absorb (sm90_wgmma_ws_experts.cuh's folded tiles), so that a few rows do not
 * cost a tile that re-reads the expert's weights. */
int colibri_cuda_experts_absorb(const colibri_moe_context_t *ctx, int32_t tile_m) {
    return tile_m == WG_BM ? ((const CudaBackend *)ctx->backend)->ws_fold : 0;
}

/* The mma_kernel variant of a projection of n outputs and k-element rows over tile_m-row tiles: the
 * BK=128 kernel (long_k, see mma_bk) and, for 16-row tiles, the narrow one. */
void plan_mma_variant(const CudaBackend *b, const colibri_moe_config_t *c, int64_t num_tokens, int32_t tile_m, bool glu,
                      int32_t n, int32_t k, bool *long_k, bool *narrow) {
    *long_k = b->mma_long_k && (k >= MMA_LONG_K || (tile_m == 16 && mma16_long(b, c, num_tokens, glu, n)));
    *narrow = tile_m == 16 && mma_narrow(b, c, num_tokens, glu, n, *long_k);
}

/* L2 prefetch of the up projection's first wave during the routing, while HBM idles: about this many
 * bytes of the weight rows the first wave starts on, guessing every expert is touched (L2: 50 MB on an
 * H100/H200). docs/cuda-design.md ("The L2 prefetch"). */
#define COLIBRI_PREFETCH_BYTES (24u << 20)
/* Shared memory of an H100/H200 SM, for the blocks of the 32- and 64-row kernels one SM holds (the
 * 16-row ones have their occupancy measured at setup): the plan runs only on compute capability 9.x,
 * and there the registers of the kernels it meets allow as many blocks (ptxas of nvcc 13: 104-168 for
 * one or two blocks of 256 threads). */
#define PREFETCH_SM_SMEM (228 * 1024)

/* The first projection's grid as its first wave sees it: `blocks` blocks run at once, each reading `cols`
 * rows of each matrix from k = 0 on in steps of `step` bytes; the blocks go through `group` column
 * blocks of a tile before the next tile (mma_kernel: 1, its grid's x is the tile; wgmma_kernel: its
 * items' WG_GROUP_N), the tiles in expert order. blocks 0: no prefetch. */
struct PrefetchWave {
    int blocks, cols, group, step;
};

/* The mma_kernel of BM-row tiles and BN columns that mma_launch_bn picks for (wide_k, long_k). */
template <int BM, class Act, int BN> static PrefetchWave mma_wave(const CudaBackend *b, bool long_k) {
    constexpr int LBK = mma_bk<BM, Act, BN, true>(), WBK = mma_bk<BM, Act, BN>();
    const int bk = mma_pick_bk<BM, Act, BN>(b->mma_wide_k, long_k);
    const size_t smem = bk == LBK   ? mma_smem_bytes<BM, Act, LBK, BN>()
                        : bk == WBK ? mma_smem_bytes<BM, Act, WBK, BN>()
                                    : mma_smem_bytes<BM, Act, 32, BN>();
    /* 1 KB of an SM's shared memory is reserved per block */
    const int by_smem = (int)(PREFETCH_SM_SMEM / (smem + 1024)), by_threads = 2048 / (2 * BN);
    const int per_sm = BM == 16 ? b->mma16_blocks_per_sm[Act::glu][BN != MMA_BN][long_k]
                                : by_smem < by_threads ? by_smem : by_threads;
    return PrefetchWave{b->sm_count * per_sm, BN, 1, bk * 2};
}

template <class Act> static PrefetchWave mma_wave_of(const CudaBackend *b, int32_t tile_m, bool long_k, bool narrow) {
    switch (tile_m) {
    case 16: return narrow ? mma_wave<16, Act, MMA_NARROW_BN>(b, long_k) : mma_wave<16, Act, MMA_BN>(b, long_k);
    case 32: return mma_wave<32, Act, MMA_BN>(b, long_k);
    default: return mma_wave<64, Act, MMA_BN>(b, long_k);
    }
}

/* The first projection's wave where it is a tensor-core GEMM (16-bit weights, more than gemv_max_assignments
 * assignments) that streams its weights: tiles of up to 64 rows, or wgmma's tiles of 128 where the
 * experts have fewer assignments than a tile on average (wgmma_launch's `streaming`; mma_kernel's
 * 128-row tiles, which a cc 9.x device runs only without the sm_90a image, were not measured). The
 * compute-bound tiles re-read their weights from L2 and need it for themselves; the gemv's few experts
 * leave no wave to speak of. */
static PrefetchWave prefetch_wave(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
    const CudaBackend *b = (const CudaBackend *)ctx->backend;
    const colibri_moe_config_t *c = &ctx->cfg;
    const bool glu = colibri_act_glu(c);
    const int64_t assignments = num_tokens * c->top_k;
    if (!b->l2_prefetch || tile_m <= GEMV_GROUP || colibri_dtype_size(c->weight_dtype) != 2) return PrefetchWave{};
    if (tile_m > 64) {
        if (!b->wgmma || !plan_wg_streaming(c, assignments)) return PrefetchWave{};
        return PrefetchWave{b->sm_count, glu ? WG_BN / 2 : WG_BN, WG_GROUP_N, WG_BK * 2};
    }
    bool long_k, narrow;
    plan_mma_variant(b, c, num_tokens, tile_m, glu, c->intermediate_size, c->hidden_size, &long_k, &narrow);
    PrefetchWave w;
    colibri_dispatch_act(c, [&](auto act) { w = mma_wave_of<decltype(act)>(b, tile_m, long_k, narrow); });
    return w;
}

/* Tiles come about one per touched expert (tile_m is ~1.5x the mean assignments per expert), more where
 * experts overflow theirs. The first wave covers `group`-wide column blocks of the first tiles, or, when
 * it reaches past the last tile, blocks / tiles column blocks of every tile (on average: wgmma's last
 * group is partial): rows [0, rows) of the experts of its tiles.
 * Then whole k steps of those rows up to the budget, or, where one k step of them is more, one k step of
 * fewer rows (the first column blocks, dispatched first). */
PrefetchPlan colibri_cuda_prefetch_plan(const colibri_moe_context_t *ctx, int64_t num_tokens, int32_t tile_m) {
    PrefetchPlan p = {};
    const PrefetchWave w = prefetch_wave(ctx, num_tokens, tile_m);
    if (w.blocks <= 0) return p;
    const colibri_moe_config_t *c = &ctx->cfg;
    const double E = c->num_experts, n = c->intermediate_size;
    const double tiles = fmax(mma16_touched(c, num_tokens), (double)(num_tokens * c->top_k) / tile_m);
    const double width = fmin(w.group, ceil(n / w.cols));
    double wave_tiles = ceil(w.blocks / width), col_blocks = width;
    if (wave_tiles > tiles) {
        wave_tiles = tiles;
        col_blocks = ceil(w.blocks / tiles);
    }
    p.experts = (int32_t)fmin(E, ceil(wave_tiles * E / tiles - 1e-9));
    p.matrices = colibri_act_glu(c) ? 2 : 1;
    p.rows = (int32_t)fmin(n, col_blocks * w.cols);
    const size_t budget = COLIBRI_PREFETCH_BYTES, sets = (size_t)p.experts * p.matrices;
    const size_t row_bytes = (size_t)c->hidden_size * 2;
    size_t bytes = budget / (sets * p.rows) / w.step * w.step;
    if (bytes == 0) {
        bytes = w.step;
        p.rows = (int32_t)(budget / (sets * bytes));
    }
    p.bytes = (uint32_t)(bytes < row_bytes ? bytes : row_bytes);
    if (p.rows == 0) p = PrefetchPlan{};
    return p;
}
