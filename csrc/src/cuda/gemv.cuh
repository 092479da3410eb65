/*
 * gemv.cuh — the memory-bound kernel shared by the router (route.cu) and the few-tokens expert path
 * (experts.cu): out[p, n] = sum_k W[n, k] * x[row(p), k] for a handful of positions p per block.
 * Each warp owns one output row (a GLU activation: the gate and up rows, so act(g, u) forms in the same
 * pass) and streams it with 16-byte loads against up to MAXNT token rows. blockIdx.x picks the positions: in
 * direct mode the block finds its expert among the ids itself (no permute; positions t*k+j), else a
 * tile of permute.cu's table, else (the router) 8 consecutive positions; the router's launch may split
 * K over blockIdx.z (gemv_split_kernel). fp8 weights (gemv_f8_kernel, gemv_combine_f8_kernel): 16 per
 * 16-byte load, widened in registers, each lane's 16-weight dot times its scale (ScaleGrid).
 * docs/cuda-design.md ("Decode: the gemv") says why.
 */
#ifndef COLIBRI_CUDA_GEMV_CUH
#define COLIBRI_CUDA_GEMV_CUH

#include <type_traits>

#include "activation.cuh"

#define GEMV_WARPS 8
#define GEMV_GROUP 8         /* most positions one pass serves: the largest tile_m of the few-tokens path */
#define GEMV_DIRECT_MAX 256  /* direct mode: at most this many assignments (one per thread of a block) */
#define GEMV_DIRECT_MAX_E 4096 /* and this many experts (a flag per expert in shared memory) */

/* One projection over expert rows, for the gemv kernel here and the tensor-core kernels (sm80_mma_experts.cuh,
 * sm90_*.cuh), which take x and out in the weight dtype; NULL tiles and `positions` serve gemv alone. */
struct ProjArgs {
    const char *w;            /* matrix of expert 0: [N, K] weight dtype, row-major */
    size_t w_expert_stride;   /* bytes from one expert's matrix to the next */
    size_t w_second;          /* Act::glu: bytes from the gate matrix to the up matrix */
    int32_t n, k;             /* N outputs, K inputs */
    const void *x;            /* rows of K elements */
    const int32_t *row_map;   /* position p reads x row row_map[p] / row_div; NULL: row p / row_div */
    int32_t row_div;
    void *out;                /* [positions, N] */
    const ExpertTile *tiles;  /* NULL: blockIdx.x covers positions [8x, 8x + 8) of `positions` */
    const int32_t *num_tiles;
    int32_t positions;
    /* direct mode (gemv only): ids [num_ids] of num_experts experts; positions are assignment indices */
    const int32_t *ids;
    int32_t num_ids, num_experts;
    unsigned long long *totals; /* first projection of direct mode: per-expert counters, else NULL */
    int32_t *bad_id;            /* likewise: set when an id is out of range */
    int32_t early;              /* second projection (direct mode, tensor cores): weights loaded before the wait */
    unsigned *sched;            /* wgmma_ws_kernel: its two counters (items asked for, blocks done), 0 between launches */
    /* wgmma_ws_kernel chained (sm90_wgmma_ws_experts.cuh, ws_chain_wait): per tile, the first projection's items stored; the first
     * projection adds to it (ready_need 0), the second waits for ready_need in it before it reads a tile */
    unsigned *ready;
    int32_t ready_need;
    /* a GLU's gate and up biases (colibri_glu_bias), [experts, bias_stride] fp32, or NULL; ActOai's slope and clamp */
    const float *bias;
    int32_t bias_stride;
    float act_alpha, act_limit;
};

/* Direct mode: finds the blockIdx.x-th distinct valid expert of ids[0, n) in ascending id order, and
 * writes to s_pos the assignment indices that chose it, ascending. Returns how many (0: no such
 * expert; the same in every thread). Every thread of the block calls it; n <= blockDim.x. */
__device__ __forceinline__ int gemv_direct_setup(const ProjArgs &a, int &expert, int *s_pos) {
    extern __shared__ int s_flag[]; /* [num_experts] */
    __shared__ int s_warp[32];
    __shared__ int s_expert;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int n = a.num_ids, E = a.num_experts;
    for (int e = tid; e < E; e += blockDim.x) s_flag[e] = 0;
    int my = -1;
    if (tid < n) {
        const int e = __ldcg(a.ids + tid); /* from L2: an early second projection reads it before its wait */
        if ((unsigned)e < (unsigned)E) my = e;
        else if (a.bad_id && blockIdx.x == 0 && blockIdx.y == 0) *a.bad_id = 1;
    }
    __syncthreads();
    if (my >= 0) s_flag[my] = 1;
    __syncthreads();
    /* each thread counts the present experts of a contiguous run; the scan ranks them */
    const int per = (E + (int)blockDim.x - 1) / (int)blockDim.x;
    const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
    int c = 0;
    for (int e = e0; e < e1; e++) c += s_flag[e];
    int total;
    const int before = colibri_block_exclusive_scan(c, s_warp, &total);
    const int r = blockIdx.x;
    if (r >= total) return 0;
    if (r >= before && r < before + c) {
        int left = r - before;
        for (int e = e0; e < e1; e++)
            if (s_flag[e] && left-- == 0) {
                s_expert = e;
                break;
            }
    }
    __syncthreads();
    expert = s_expert;
    const bool mine = my == expert;
    const unsigned m = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) s_warp[warp] = __popc(m);
    __syncthreads();
    int base = 0, count = 0;
    for (int w = 0; w < nwarps; w++) {
        const int cw = s_warp[w];
        base += w < warp ? cw : 0;
        count += cw;
    }
    if (mine) s_pos[base + __popc(m & ((1u << lane) - 1u))] = tid;
    if (a.totals && blockIdx.y == 0 && tid == 0) a.totals[expert] += (unsigned long long)count;
    __syncthreads();
    return count;
}

/* gemv_direct_setup for at most 32 ids, by each warp alone: no block barrier. The warp's positions go to
 * its own 32 ints of s_pos (s_pos_w); the expert and the count are those the block version finds. At
 * decode the block version's barriers and scan stood between the dependency wait and the first weight
 * load of every block (docs/performance.md). */
__device__ __forceinline__ int gemv_direct_setup_warp(const ProjArgs &a, int &expert, int *s_pos_w) {
    const int lane = threadIdx.x & 31, n = a.num_ids;
    int id = -1;
    if (lane < n) {
        const int e = __ldcg(a.ids + lane); /* from L2: an early second projection reads it before its wait */
        if ((unsigned)e < (unsigned)a.num_experts) id = e;
        else if (a.bad_id && blockIdx.x == 0 && blockIdx.y == 0) *a.bad_id = 1;
    }
    /* a valid id's first lane stands for its expert; its rank among those, ascending id, picks the block */
    const unsigned same = __match_any_sync(0xffffffffu, id);
    const bool first = id >= 0 && (same & ((1u << lane) - 1u)) == 0;
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    int rank = 0;
    for (unsigned f = firsts; f; f &= f - 1) rank += __shfl_sync(0xffffffffu, id, __ffs(f) - 1) < id;
    const unsigned hit = __ballot_sync(0xffffffffu, first && rank == (int)blockIdx.x);
    if (!hit) return 0;
    expert = __shfl_sync(0xffffffffu, id, __ffs(hit) - 1);
    const unsigned m = __ballot_sync(0xffffffffu, id == expert);
    if (id == expert) s_pos_w[__popc(m & ((1u << lane) - 1u))] = lane;
    __syncwarp();
    if (a.totals && blockIdx.y == 0 && threadIdx.x == 0) a.totals[expert] += (unsigned long long)__popc(m);
    return __popc(m);
}

/* The scales gemv_chunk applies to a warp's rows: none (NoScales: 16- and 32-bit weights, the kernels'
 * code as it was without fp8), or fp8's (RowScales): the gate (or only) row's s0 and the up row's s1 of
 * a ScaleGrid, indexed by k >> k_shift. Rows are never split along K for fp8 (the router is fp32), so
 * k counts from the row's start. */
struct NoScales {};
struct RowScales {
    const float *s0, *s1;
    int k_shift;
};
__device__ __forceinline__ NoScales gemv_row_scales(const NoScales &, int, int) { return {}; }
__device__ __forceinline__ RowScales gemv_row_scales(const ScaleGrid &g, int expert, int n) {
    return RowScales{g.row(expert, 0, n), g.row(expert, 1, n), g.k_shift};
}

/* Position p of this block: its output row and its x row. */
__device__ __forceinline__ void gemv_position(const ProjArgs &a, const int *s_pos, int p, int &out_row, int &x_row) {
    if (s_pos) {
        out_row = s_pos[p];
        x_row = out_row / a.row_div;
    } else {
        out_row = p;
        x_row = a.row_map ? a.row_map[p] / a.row_div : p;
    }
}

/* One chunk of UNROLL steps of K (a step: 16 bytes per lane and matrix) for NT token rows: every weight
 * load of the chunk issued before the first use. PARTIAL: the chunk may run past kl (the row length,
 * a.k, or a split's K range), and the steps past it are skipped. fp8 (RS = RowScales): a lane's VW
 * weights of a step share one scale (scale_block_k a multiple of 16), which multiplies their fp32 dot
 * with x: the dequantised weights' dot up to fp32 rounding. */
template <class TW, class TX, int VW, class Act, int NT, int UNROLL, bool PARTIAL, class RS>
__device__ __forceinline__ void gemv_chunk(const TW *w0, const TW *w1, const TX *const (&xr)[NT], int k0, int kl,
                                           float (&acc0)[NT], float (&acc1)[NT], bool &must_wait, const RS &rs) {
    constexpr int STEP = 32 * VW;
    constexpr bool F8 = std::is_same<RS, RowScales>::value;
    Pack<TW, VW> wa[UNROLL], wb[UNROLL];
    float sa[F8 ? UNROLL : 1], sb[F8 ? UNROLL : 1];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        /* past K: the chunk's first step again (a hit), keeping the loads unconditional */
        const int k = PARTIAL && k0 + u * STEP >= kl ? k0 : k0 + u * STEP;
        wa[u] = load_stream<TW, VW>(w0 + k);
        if (Act::glu) wb[u] = load_stream<TW, VW>(w1 + k);
        if constexpr (F8) { /* the scales are never written by a kernel: loaded before the wait too */
            sa[u] = __ldg(rs.s0 + (k >> rs.k_shift));
            if (Act::glu) sb[u] = __ldg(rs.s1 + (k >> rs.k_shift));
        }
    }
    if (must_wait) { /* the weights are on their way; x is the previous kernel's output */
        pdl_wait();
        must_wait = false;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        if (PARTIAL && k0 + u * STEP >= kl) break;
        if constexpr (F8) {
            float fa[VW], fb[VW];
            f8_to_f32<VW>(wa[u], fa);
            if (Act::glu) f8_to_f32<VW>(wb[u], fb);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float xv[VW], da = 0.0f, db = 0.0f;
                load_f32<TX, VW>(xr[t] + k0 + u * STEP, xv);
#pragma unroll
                for (int i = 0; i < VW; i++) {
                    da = fmaf(fa[i], xv[i], da);
                    if (Act::glu) db = fmaf(fb[i], xv[i], db);
                }
                acc0[t] = fmaf(sa[u], da, acc0[t]);
                if (Act::glu) acc1[t] = fmaf(sb[u], db, acc1[t]);
            }
        } else {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float xv[VW];
                load_f32<TX, VW>(xr[t] + k0 + u * STEP, xv);
#pragma unroll
                for (int i = 0; i < VW; i++) {
                    acc0[t] = fmaf(to_f32(wa[u].v[i]), xv[i], acc0[t]);
                    if (Act::glu) acc1[t] = fmaf(to_f32(wb[u].v[i]), xv[i], acc1[t]);
                }
            }
        }
    }
}

/* This warp's row w0 (and w1) dotted with NT token rows xr over elements [0, kl) of each (the pointers
 * already at the range's start), summed over the warp: every lane gets the NT sums. */
template <class TW, class TX, int VW, class Act, int NT, int UNROLL, class RS>
__device__ __forceinline__ void gemv_dot(const TW *w0, const TW *w1, const TX *const (&xr)[NT], int lane, int kl,
                                         float (&acc0)[NT], float (&acc1)[NT], bool &must_wait, const RS &rs) {
    constexpr int STEP = 32 * VW;
#pragma unroll
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = 0.0f;

    /* K in chunks of UNROLL steps, the last one partial: a short row (the down projection of a
     * fine-grained expert, K = 1408: 5.5 steps) is then all in flight at once rather than a step at a
     * time. Each lane still sums its elements in ascending k: the result does not depend on UNROLL. */
    int k0 = lane * VW;
    for (; k0 + (UNROLL - 1) * STEP < kl; k0 += UNROLL * STEP)
        gemv_chunk<TW, TX, VW, Act, NT, UNROLL, false>(w0, w1, xr, k0, kl, acc0, acc1, must_wait, rs);
    constexpr int TAIL = NT == 1 ? UNROLL : (UNROLL + 1) / 2; /* wider passes: no spills (ptxas -v) */
    for (; k0 < kl; k0 += TAIL * STEP)
        gemv_chunk<TW, TX, VW, Act, NT, TAIL, true>(w0, w1, xr, k0, kl, acc0, acc1, must_wait, rs);
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            acc0[t] += __shfl_xor_sync(0xffffffffu, acc0[t], off);
            if (Act::glu) acc1[t] += __shfl_xor_sync(0xffffffffu, acc1[t], off);
        }
    }
}

/* One pass over this warp's row(s) for NT token rows; `count` (<= NT) of them are real. The K range
 * [kb, kb + kl) of rows a.k long (the whole row but in a split router launch), the sums to out. */
template <class TW, class TX, class TO, int VW, class Act, int NT, int UNROLL, class RS>
__device__ __forceinline__ void gemv_rows(const ProjArgs &a, const TW *w0, const TW *w1, const int *s_pos, int p0,
                                          int count, int n, int lane, int kb, int kl, void *out_v, bool &must_wait,
                                          int expert, const RS &rs) {
    const TX *xr[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        int out_row, x_row;
        gemv_position(a, s_pos, p0 + (t < count ? t : count - 1), out_row, x_row);
        xr[t] = reinterpret_cast<const TX *>(a.x) + (size_t)x_row * a.k + kb;
    }
    float acc0[NT], acc1[NT];
    gemv_dot<TW, TX, VW, Act, NT, UNROLL>(w0 + kb, w1 + kb, xr, lane, kl, acc0, acc1, must_wait, rs);
    TO *out = reinterpret_cast<TO *>(out_v);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (lane == t && t < count) {
            int out_row, x_row;
            gemv_position(a, s_pos, p0 + t, out_row, x_row);
            float g = acc0[t], u = acc1[t];
            if constexpr (Act::glu) colibri_glu_bias(a, expert, n, g, u);
            out[(size_t)out_row * a.n + n] = from_f32<TO>(Act::apply(g, u, a));
        }
    }
}

/* Blocks per SM the register budget must allow: 4 (64 registers) for the decode kernels, 3 or 2 for the
 * wider ones. */
template <int MAXNT> constexpr int gemv_min_blocks() { return MAXNT <= 2 ? 3 : 2; }

/* fp8: a step's 16 weights widen to 16 fp32 per matrix, which the 16-bit kernels' budget spills past one
 * token row (ptxas -v); 2 blocks of 8 warps still keep 16 KB of weights in flight per SM and matrix. */
template <int MAXNT> constexpr int gemv_f8_min_blocks() { return MAXNT == 1 ? 3 : MAXNT <= 4 ? 2 : 1; }

/* 16-byte loads in flight per lane and matrix: 8 for the narrow single-matrix kernels (the down
 * projection at decode), else 4 (registers: see the file header) */
template <int VW, class Act, int MAXNT> constexpr int gemv_unroll() {
    return VW == 1 ? 1 : (Act::glu || MAXNT > 2) ? 4 : 8;
}

/* One pass over `count` (<= MAXNT) token rows from position q, with the narrowest gemv_rows that
 * holds them. */
template <class TW, class TX, class TO, int VW, class Act, int MAXNT, int U, class RS>
__device__ __forceinline__ void gemv_pass(const ProjArgs &a, const TW *w0, const TW *w1, const int *s_pos, int q,
                                          int count, int n, int lane, int kb, int kl, void *out, bool &must_wait,
                                          int expert, const RS &rs) {
    if constexpr (MAXNT >= 8)
        if (count > 4) {
            gemv_rows<TW, TX, TO, VW, Act, 8, U>(a, w0, w1, s_pos, q, count, n, lane, kb, kl, out, must_wait, expert,
                                                 rs);
            return;
        }
    if constexpr (MAXNT >= 4)
        if (count > 2) {
            gemv_rows<TW, TX, TO, VW, Act, 4, U>(a, w0, w1, s_pos, q, count, n, lane, kb, kl, out, must_wait, expert,
                                                 rs);
            return;
        }
    if constexpr (MAXNT >= 2)
        if (count == 2) {
            gemv_rows<TW, TX, TO, VW, Act, 2, U>(a, w0, w1, s_pos, q, count, n, lane, kb, kl, out, must_wait, expert,
                                                 rs);
            return;
        }
    gemv_rows<TW, TX, TO, VW, Act, 1, U>(a, w0, w1, s_pos, q, count, n, lane, kb, kl, out, must_wait, expert, rs);
}

/* gemv_kernel's body; G: NoScales, or fp8's ScaleGrid. */
template <class TW, class TX, class TO, int VW, class Act, int MAXNT, class G>
__device__ __forceinline__ void gemv_run(const ProjArgs &a, const G &g) {
    __shared__ int s_pos_buf[GEMV_DIRECT_MAX];
    bool must_wait = a.ids && a.early;
    if (must_wait) pdl_trigger();                  /* wait later, after the first weight loads */
    else if (a.ids) { pdl_wait(); pdl_trigger(); } /* the next kernel may read the ids early */
    else pdl_begin();
    int expert = 0, p0, p1;
    const int *s_pos = nullptr;
    if (a.ids && a.num_ids <= 32) {
        /* each warp its own 32 positions (GEMV_DIRECT_MAX = 8 warps x 32) */
        int *mine = s_pos_buf + (threadIdx.x >> 5) * 32;
        p1 = gemv_direct_setup_warp(a, expert, mine);
        if (p1 == 0) return;
        p0 = 0;
        s_pos = mine;
    } else if (a.ids) {
        p1 = gemv_direct_setup(a, expert, s_pos_buf);
        if (p1 == 0) return;
        p0 = 0;
        s_pos = s_pos_buf;
    } else if (a.tiles) {
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
    constexpr int U = gemv_unroll<VW, Act, MAXNT>();
    /* warp w of the block takes rows n = 8 (blockIdx.y + i gridDim.y) + w: one row unless the launch
     * gave fewer blocks than groups of 8 rows (gemv_launch's row_blocks) */
    for (int n = blockIdx.y * GEMV_WARPS + (threadIdx.x >> 5); n < a.n; n += gridDim.y * GEMV_WARPS) {
        const TW *w0 = reinterpret_cast<const TW *>(a.w + (size_t)expert * a.w_expert_stride) + (size_t)n * a.k;
        const TW *w1 = reinterpret_cast<const TW *>(reinterpret_cast<const char *>(w0) + a.w_second);
        const auto rs = gemv_row_scales(g, expert, n);
        for (int q = p0; q < p1; q += MAXNT)
            gemv_pass<TW, TX, TO, VW, Act, MAXNT, U>(a, w0, w1, s_pos, q, min(p1 - q, MAXNT), n, lane, 0, a.k, a.out,
                                                    must_wait, expert, rs);
    }
}

template <class TW, class TX, class TO, int VW, class Act, int MAXNT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, gemv_min_blocks<MAXNT>()) gemv_kernel(ProjArgs a) {
    gemv_run<TW, TX, TO, VW, Act, MAXNT>(a, NoScales{});
}

/* fp8 weights: the scales a parameter of their own (ScaleGrid). */
template <class TX, class TO, int VW, class Act, int MAXNT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, gemv_f8_min_blocks<MAXNT>()) gemv_f8_kernel(ProjArgs a, ScaleGrid g) {
    gemv_run<F8E4M3, TX, TO, VW, Act, MAXNT>(a, g);
}

/* Direct mode's last projection with the weighted top-k sum folded in (GEMV_COMBINE_MAX assignments at
 * most, one matrix): out[t, n] = sum_j wts[t k + j] * y(t k + j, n), j in order, where y is the
 * projection of assignment t k + j rounded to the weight dtype, exactly as gemv_kernel writes it and
 * combine.cu sums it (fp8: rounded to bf16, y's dtype): the output is the same bits as the two kernels give, without y's round trip
 * through memory and the combine kernel's launch after the last weight arrives. Block b takes output
 * rows [b rows, (b + 1) rows); its warps share the rows x assignments pairs (r, i), q = r A + i, q =
 * warp, warp + 8, ..., so a warp's pairs are mostly one expert's rows; the sums meet in shared memory.
 * Like the early second projection of gemv_kernel it lets the next kernel launch at once, reads the
 * ids from L2 and issues its first row's weights before it waits for inter. */
#define GEMV_COMBINE_MAX 8   /* assignments: the few-tokens path where tensor cores could run */
#define GEMV_COMBINE_ROWS 64 /* most output rows per block (shared memory) */

template <class TW, class TA, int VW, class G>
__device__ __forceinline__ void gemv_combine_run(const ProjArgs &a, const float *wts, int top_k, int rows, TA *out,
                                                 const float *bias, int bias_stride, const G &g) {
    using TC = compute_t<TW>; /* x (inter) and y's dtype */
    __shared__ int s_e[GEMV_COMBINE_MAX];
    __shared__ float s_y[GEMV_COMBINE_ROWS][GEMV_COMBINE_MAX];
    pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, A = a.num_ids;
    if (tid < A) {
        const int e = __ldcg(a.ids + tid);
        s_e[tid] = (unsigned)e < (unsigned)a.num_experts ? e : -1;
    }
    __syncthreads();
    const int n0 = blockIdx.x * rows, nr = min(rows, a.n - n0);
    constexpr int U = gemv_unroll<VW, ActLinear, 1>();
    bool must_wait = true;
    for (int q = warp; q < nr * A; q += GEMV_WARPS) {
        const int r = q / A, i = q - r * A, e = s_e[i];
        if (e < 0) continue;
        const TW *w = reinterpret_cast<const TW *>(a.w + (size_t)e * a.w_expert_stride) + (size_t)(n0 + r) * a.k;
        const TC *const xr[1] = {reinterpret_cast<const TC *>(a.x) + (size_t)i * a.k};
        float acc0[1], acc1[1];
        gemv_dot<TW, TC, VW, ActLinear, 1, U>(w, w, xr, lane, a.k, acc0, acc1, must_wait,
                                              gemv_row_scales(g, e, n0 + r));
        if (lane == 0) s_y[r][i] = to_f32(from_f32<TC>(acc0[0]));
    }
    if (must_wait) pdl_wait(); /* the weights below: the routing's, visible after the wait */
    __syncthreads();
    for (int q = tid; q < (A / top_k) * nr; q += blockDim.x) {
        const int t = q / nr, r = q - t * nr;
        float acc = 0.0f;
        for (int j = 0; j < top_k; j++) {
            const int i = t * top_k + j;
            if (s_e[i] < 0) continue;
            float y = s_y[r][i];
            /* the expert's output bias, after the rounding to the weight dtype (as combine.cu adds it) */
            if (bias) y += __ldg(bias + (size_t)s_e[i] * bias_stride + n0 + r);
            acc = fmaf(wts[i], y, acc);
        }
        out[(size_t)t * a.n + n0 + r] = from_f32<TA>(acc);
    }
}

template <class TW, class TA, int VW>
__global__ void __launch_bounds__(GEMV_WARPS * 32, gemv_min_blocks<1>())
    gemv_combine_kernel(ProjArgs a, const float *wts, int top_k, int rows, TA *out, const float *bias,
                        int bias_stride) {
    gemv_combine_run<TW, TA, VW>(a, wts, top_k, rows, out, bias, bias_stride, NoScales{});
}

/* fp8 weights (inter and y in bf16): the scales a parameter of their own (ScaleGrid of the down matrix). */
template <class TA, int VW>
__global__ void __launch_bounds__(GEMV_WARPS * 32, gemv_min_blocks<1>())
    gemv_combine_f8_kernel(ProjArgs a, const float *wts, int top_k, int rows, TA *out, const float *bias,
                           int bias_stride, ScaleGrid g) {
    gemv_combine_run<F8E4M3, TA, VW>(a, wts, top_k, rows, out, bias, bias_stride, g);
}

/* Launches gemv_combine_kernel (a.ids, a.num_ids <= GEMV_COMBINE_MAX, 16-byte rows: the caller checks)
 * with `rows` (<= GEMV_COMBINE_ROWS) output rows per block; g: the down matrix's scales (fp8 only). */
template <class TW, class TA>
static cudaError_t gemv_combine_launch(const ProjArgs &a, const float *wts, int top_k, int rows, TA *out,
                                       const float *bias, int bias_stride, const ScaleGrid &g, cudaStream_t stream) {
    const dim3 grid((unsigned)((a.n + rows - 1) / rows));
    if constexpr (is_fp8<TW>)
        return colibri_launch(gemv_combine_f8_kernel<TA, 16>, grid, GEMV_WARPS * 32, 0, stream, a, wts, top_k, rows,
                              out, bias, bias_stride, g);
    else
        return colibri_launch(gemv_combine_kernel<TW, TA, 16 / sizeof(TW)>, grid, GEMV_WARPS * 32, 0, stream, a, wts,
                              top_k, rows, out, bias, bias_stride);
}

/* The router's launch split along K (gemv_launch_groups with splits > 1): gemv_kernel's group mode
 * (no ids, no tiles, GEMV_GROUP positions per blockIdx.x, one matrix), block z summing only the K range
 * [z kchunk, min((z + 1) kchunk, K)) into out (z = 0) or part + (z - 1) positions n. kchunk is a
 * multiple of the step (32 VW), so every range starts 16-byte aligned and each lane still sums its
 * elements in ascending k. A kernel of its own, with the split in its own parameters: a field more in
 * ProjArgs changes the code ptxas emits for every expert kernel (gemv, mma, wgmma), even unused. */
template <class TW, class TX, class TO, int VW>
__global__ void __launch_bounds__(GEMV_WARPS * 32, gemv_min_blocks<GEMV_GROUP>())
    gemv_split_kernel(ProjArgs a, int kchunk, TO *part) {
    pdl_begin();
    const int p0 = blockIdx.x * GEMV_GROUP, count = min(GEMV_GROUP, a.positions - p0);
    const int lane = threadIdx.x & 31, kb = (int)blockIdx.z * kchunk, kl = min(kchunk, a.k - kb);
    TO *out = blockIdx.z == 0 ? reinterpret_cast<TO *>(a.out)
                              : part + (size_t)(blockIdx.z - 1) * (size_t)a.positions * (size_t)a.n;
    constexpr int U = gemv_unroll<VW, ActLinear, GEMV_GROUP>();
    bool must_wait = false;
    for (int n = blockIdx.y * GEMV_WARPS + (threadIdx.x >> 5); n < a.n; n += gridDim.y * GEMV_WARPS) {
        const TW *w = reinterpret_cast<const TW *>(a.w) + (size_t)n * a.k;
        gemv_pass<TW, TX, TO, VW, ActLinear, GEMV_GROUP, U>(a, w, w, nullptr, p0, count, n, lane, kb, kl, out,
                                                            must_wait, 0, NoScales{});
    }
}

/* gemv_kernel of MAXNT token rows, or for fp8 weights gemv_f8_kernel with the scales g. */
template <class TW, class TX, class TO, int VW, class Act, int MAXNT>
static cudaError_t gemv_launch_one(const ProjArgs &a, dim3 grid, size_t smem, const ScaleGrid &g,
                                   cudaStream_t stream) {
    if constexpr (is_fp8<TW>)
        return colibri_launch(gemv_f8_kernel<TX, TO, VW, Act, MAXNT>, grid, GEMV_WARPS * 32, smem, stream, a, g);
    else
        return colibri_launch(gemv_kernel<TW, TX, TO, VW, Act, MAXNT>, grid, GEMV_WARPS * 32, smem, stream, a);
}

template <class TW, class TX, class TO, int VW, class Act>
static cudaError_t gemv_launch_vw(const ProjArgs &a, dim3 grid, int tile, size_t smem, const ScaleGrid &g,
                                  cudaStream_t stream) {
    switch (tile) {
    case 1: return gemv_launch_one<TW, TX, TO, VW, Act, 1>(a, grid, smem, g, stream);
    case 2: return gemv_launch_one<TW, TX, TO, VW, Act, 2>(a, grid, smem, g, stream);
    case 4: return gemv_launch_one<TW, TX, TO, VW, Act, 4>(a, grid, smem, g, stream);
    default: return gemv_launch_one<TW, TX, TO, VW, Act, 8>(a, grid, smem, g, stream);
    }
}

/* Launches gemv_kernel over `slots` values of blockIdx.x (slots that find no tile or expert return at
 * once). tile: 1, 2, 4 or 8, the most token rows per pass (and the tile_m permute.cu used, if any).
 * vec: K and every row start allow 16-byte loads of the weights (and the matching loads of x);
 * otherwise one element at a time (always the 8-row kernel: those shapes are small). row_blocks > 0:
 * at most that many blocks along the rows, each warp then looping over rows (0: a block per 8 rows).
 * g: fp8 weights' scales (scale_block_k a multiple of 16 where vec), else unused. */
template <class TW, class TX, class TO, class Act>
static cudaError_t gemv_launch(const ProjArgs &a, int64_t slots, int tile, bool vec, int row_blocks,
                               const ScaleGrid &g, cudaStream_t stream) {
    const int groups = (a.n + GEMV_WARPS - 1) / GEMV_WARPS;
    const dim3 grid((unsigned)slots, (unsigned)(row_blocks > 0 && row_blocks < groups ? row_blocks : groups));
    const size_t smem = a.ids ? (size_t)a.num_experts * sizeof(int) : 0;
    if (vec) return gemv_launch_vw<TW, TX, TO, 16 / sizeof(TW), Act>(a, grid, tile, smem, g, stream);
    return gemv_launch_one<TW, TX, TO, 1, Act, GEMV_GROUP>(a, grid, smem, g, stream);
}

/* The router's launch: no tiles, groups of GEMV_GROUP positions. splits > 1: that many blocks along K
 * (gemv_split_kernel), kchunk elements each (a multiple of the step: 32 x 16 / sizeof(TW) elements
 * with vec, else 32; every split non-empty), split 0 writing a.out, split s > 0 part + (s - 1)
 * positions n. splits == 1: the unsplit kernel, as before. */
template <class TW, class TX, class TO>
static cudaError_t gemv_launch_groups(const ProjArgs &a, int64_t slots, bool vec, int splits, int kchunk, TO *part,
                                      cudaStream_t stream) {
    const dim3 grid((unsigned)slots, (unsigned)((a.n + GEMV_WARPS - 1) / GEMV_WARPS), (unsigned)splits);
    if (splits > 1) {
        if (vec)
            return colibri_launch(gemv_split_kernel<TW, TX, TO, 16 / sizeof(TW)>, grid, GEMV_WARPS * 32, 0, stream, a,
                                  kchunk, part);
        return colibri_launch(gemv_split_kernel<TW, TX, TO, 1>, grid, GEMV_WARPS * 32, 0, stream, a, kchunk, part);
    }
    if (vec)
        return colibri_launch(gemv_kernel<TW, TX, TO, 16 / sizeof(TW), ActLinear, GEMV_GROUP>, grid, GEMV_WARPS * 32, 0,
                              stream, a);
    return colibri_launch(gemv_kernel<TW, TX, TO, 1, ActLinear, GEMV_GROUP>, grid, GEMV_WARPS * 32, 0, stream, a);
}

#endif /* COLIBRI_CUDA_GEMV_CUH */
