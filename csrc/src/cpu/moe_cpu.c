/*
 * moe_cpu.c — the CPU backend, in plain C99 + OpenMP, and the readable specification of the math every
 * backend computes (the CUDA files follow the same steps): 1. dtype helpers (all arithmetic fp32),
 * 2. the projection, 3. routing, 4. grouping by expert (a counting sort), 5. the expert FFN (each
 * touched expert once over all its tokens), 6. combine (output[t] = sum_j w[t, j] * y[t, j], slot order).
 * The expert weights are borrowed in place (often a memory-mapped checkpoint), never copied; everything
 * a forward needs is allocated at init for cfg.workspace_tokens tokens. Every output element is computed
 * by one task in a fixed order of operations, so results are bitwise identical run to run, for any
 * thread count and any chunking.
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "internal.h"
#include "routing.h"

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#else
#define ALWAYS_INLINE inline
#define NOINLINE
#endif

#ifdef __AVX512BF16__
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

enum {
    ROW_PAD = 32,       /* activation rows are padded with zeros to 32 elements: aligned, whole vectors */
    TILE_TOKENS = 4,    /* register tile: TILE_TOKENS x TILE_ROWS accumulators, see dot_tile */
    TILE_ROWS = 4,
    ROW_BLOCK = 16,     /* weight rows per task (a multiple of TILE_ROWS) */
    K_CHUNK = 1024,     /* weight columns converted to fp32 at once (ROW_BLOCK x K_CHUNK floats) */
    LANES = 16,         /* token-lane kernel (section 2b): tokens per vector, */
    PHASES = 16,        /* the phases of dot_tile_bf16's order it reproduces, */
    TILE_ACC = 16,      /* at most this many accumulator vectors per tile, */
    TOKEN_LANES_MIN = 32, /* and an expert needs at least this many tokens to use it (below, with the
                             weights streaming from memory, dot_tile_bf16 was as fast or faster) */
    DEFAULT_WORKSPACE_TOKENS = 256
};

typedef struct {
    int32_t expert;
    int32_t row0;
} task_t;

/* Expert e of E' = E + m (m: the shared expert's slices, internal.h) and slot j of k' = k + m per token:
 * the forward runs over all E' experts and k' slots; routing and the counts see the routed ones. */
typedef struct {
    const void **base;         /* [E'] expert e's buffer: the borrowed packed weights, or the shared copy */
    uint64_t *offsets;         /* [E'] element offset of each expert in its buffer */
    uint64_t *counts;          /* [E'] (token, expert) assignments over all forwards */
    int32_t experts, slots;    /* E' and k' */
    int nthreads;
    int64_t hp, fp;            /* H and F rounded up to ROW_PAD: row strides of x32/x16 and hidden */
    int bf16_dot;              /* this forward multiplies bf16 x bf16 (see the top of the file) */

    /* workspace, for W = workspace_tokens tokens and P = W * k pairs */
    float *x32;                /* [W, hp] input in fp32, zero padding */
    uint16_t *x16;             /* [W, hp] input in bf16 (bf16 weights only), zero padding */
    const void **token_rows;   /* [W] x32 + t * hp */
    float *logits;             /* [W, E] router logits */
    int32_t *ids;              /* [P] routing computed here, [W, k] */
    float *weights_tk;         /* [P] */
    int32_t *slot_ids;         /* [P] with a shared expert: the routed ids and the shared slices, [W, k'] */
    float *slot_w;             /* [P] their weights */
    int32_t *expert_start;     /* [E + 1] first sorted position of each expert */
    int32_t *cursor;           /* [E] counting-sort scratch */
    int32_t *pair_of;          /* [P] sorted position -> pair index t * k + j */
    const void **x_rows;       /* [P] sorted position -> its token's input row (x32 or x16) */
    const void **h_rows;       /* [P] sorted position -> its hidden row (hidden or hidden16) */
    int32_t *lane_tokens;      /* [E] how many of expert e's tokens (its first) run in token lanes (section
                                  2b); the others run dot_tile_bf16 on their rows */
    int32_t *lane_vec;         /* [E] the first packed vector of those tokens */
    uint32_t *x_packed;        /* [V, hp / 2 * LANES] expert inputs packed for token lanes (bf16 pairs) */
    uint32_t *h_packed;        /* [V, fp / 2 * LANES] SWIGLU hidden packed the same way */
    float *hidden;             /* [P, fp] silu(gate x) * up x (SWIGLU), zero padding */
    uint16_t *hidden16;        /* [P, fp] the same in bf16 (SWIGLU with bf16 weights only) */
    float *y;                  /* [P, out_features] expert output of each pair, in pair order */
    task_t *tasks;             /* [E * ceil(max(F, H) / ROW_BLOCK)] */
    float *wbuf;               /* [nthreads, ROW_BLOCK * K_CHUNK] converted weight chunk; in a token-lane
                                  projection the phase sums of a tile (PHASES * TILE_ACC vectors) */
    float *tile;               /* [nthreads, P * 2 * ROW_BLOCK] task outputs before the epilogue */
    float *route_scratch;      /* [nthreads, E + k + n_group] */
} cpu_state_t;

/* ---------------------------------------------------------------------------------------------------
 * 1. dtype helpers
 * ------------------------------------------------------------------------------------------------- */

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* bf16 is the top half of an fp32. */
static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* keep NaN a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                                /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mantissa << 13)); /* inf, NaN */
    if (exponent != 0) return bits_to_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    /* zero or subnormal: mantissa * 2^-24 is exact in fp32 */
    return bits_to_f32(sign | f32_to_bits((float)mantissa * 0x1p-24f));
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t u = f32_to_bits(f), a = u & 0x7fffffffu;
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (a > 0x7f800000u) return sign | 0x7e00u;      /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;     /* rounds past 65504: inf */
    if (a >= 0x38800000u) {                           /* normal fp16: rebias the exponent, round to even */
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
        return (uint16_t)(sign | (r >> 13));
    }
    /* subnormal fp16: the value in units of 2^-24, rounded to nearest even (1024 becomes the smallest normal) */
    return (uint16_t)(sign | (uint16_t)nearbyintf(bits_to_f32(a) * 0x1p24f));
}

/* fp8 e4m3 ("e4m3fn": bias 7, no inf; S.1111.111 is NaN) to fp32, exactly. */
static inline float f8e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return bits_to_f32(sign | 0x7fc00000u);
    if (e == 0) return bits_to_f32(sign | f32_to_bits((float)m * 0x1p-9f)); /* subnormal: m 2^-9 */
    return bits_to_f32(sign | (e + 120) << 23 | m << 20);
}

/* dst[i] = src[offset + i] as fp32 for i < n. */
static void load_f32(float *dst, const void *src, colibri_dtype_t dtype, uint64_t offset, int64_t n) {
    int64_t i = 0;
    switch (dtype) {
    case COLIBRI_DTYPE_F32:
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
        return;
    case COLIBRI_DTYPE_BF16: {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
        return;
    }
    case COLIBRI_DTYPE_F16: {
        const uint16_t *s = (const uint16_t *)src + offset;
#ifdef __F16C__
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = f16_to_f32(s[i]);
        return;
    }
    case COLIBRI_DTYPE_F8E4M3: {
        const uint8_t *s = (const uint8_t *)src + offset;
        for (; i < n; i++) dst[i] = f8e4m3_to_f32(s[i]);
        return;
    }
    }
}

/* dst[offset + i] = src[i] rounded to dtype (nearest even) for i < n. */
static void store_f32(void *dst, colibri_dtype_t dtype, uint64_t offset, const float *src, int64_t n) {
    int64_t i = 0;
    switch (dtype) {
    case COLIBRI_DTYPE_F32:
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
        return;
    case COLIBRI_DTYPE_BF16: {
        uint16_t *d = (uint16_t *)dst + offset;
        for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
        return;
    }
    case COLIBRI_DTYPE_F16: {
        uint16_t *d = (uint16_t *)dst + offset;
#ifdef __F16C__
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) d[i] = f32_to_f16(src[i]);
        return;
    }
    case COLIBRI_DTYPE_F8E4M3: return; /* fp8 is a weight dtype only: nothing is stored in it */
    }
}

/* ---------------------------------------------------------------------------------------------------
 * 2. projection: the one matmul kernel, out[c, r] = dot(W[r, :], x[c, :]) with W in its stored dtype
 *
 * bf16 x bf16: where the CPU has AVX512-BF16 dot products (vdpbf16ps) and both the weights and the
 * activations are bf16, the projections multiply bf16 pairs straight from the weights, accumulating in
 * fp32, and the SwiGLU intermediate silu(gate x) * up x is kept in bf16, the activation dtype (as
 * PyTorch does in bf16). That halves the arithmetic and skips the weight conversion. Every other case
 * converts weights to fp32 and keeps the intermediate in fp32. The bf16 x bf16 projection has two
 * kernels: dot_tile_bf16 (a few tokens: decode, where streaming the weights is all that matters) and,
 * for an expert with at least TOKEN_LANES_MIN tokens, the token-lane kernel of section 2b (prefill,
 * where the arithmetic is); they give bitwise the same results.
 * ------------------------------------------------------------------------------------------------- */

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A register tile: dot products of nt tokens (1..4) with 4 converted weight rows over len elements.
 * `omp simd reduction` lets the compiler split each sum into vector lanes without -ffast-math; the
 * lanes and their final combination are fixed at compile time and len is a multiple of ROW_PAD, so
 * every tile shape adds in the same order. fmaf makes the FMA explicit (ISO C does not contract
 * a * b + c). nt is a constant at every call site, so the unused accumulators vanish. Stores nr_store
 * rows of the tile into out, adding to what is there when accumulate. */
static ALWAYS_INLINE void dot_tile(const int nt, const void *const *x, int64_t x_off, const float *w, int64_t len,
                                   float *out, int64_t ld, int nr_store, int accumulate) {
    const float *w0 = w, *w1 = w + K_CHUNK, *w2 = w + 2 * K_CHUNK, *w3 = w + 3 * K_CHUNK;
    const float *x0 = (const float *)x[0] + x_off, *x1 = (const float *)x[nt > 1] + x_off,
                *x2 = (const float *)x[nt > 2 ? 2 : 0] + x_off, *x3 = (const float *)x[nt > 3 ? 3 : 0] + x_off;
    float a00 = 0, a01 = 0, a02 = 0, a03 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0;
    float a20 = 0, a21 = 0, a22 = 0, a23 = 0, a30 = 0, a31 = 0, a32 = 0, a33 = 0;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)
    for (int64_t i = 0; i < len; i++) {
        a00 = fmaf(x0[i], w0[i], a00), a01 = fmaf(x0[i], w1[i], a01), a02 = fmaf(x0[i], w2[i], a02), a03 = fmaf(x0[i], w3[i], a03);
        if (nt > 1)
            a10 = fmaf(x1[i], w0[i], a10), a11 = fmaf(x1[i], w1[i], a11), a12 = fmaf(x1[i], w2[i], a12), a13 = fmaf(x1[i], w3[i], a13);
        if (nt > 2)
            a20 = fmaf(x2[i], w0[i], a20), a21 = fmaf(x2[i], w1[i], a21), a22 = fmaf(x2[i], w2[i], a22), a23 = fmaf(x2[i], w3[i], a23);
        if (nt > 3)
            a30 = fmaf(x3[i], w0[i], a30), a31 = fmaf(x3[i], w1[i], a31), a32 = fmaf(x3[i], w2[i], a32), a33 = fmaf(x3[i], w3[i], a33);
    }
    const float sums[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
    for (int c = 0; c < nt; c++)
        for (int r = 0; r < nr_store; r++) out[c * ld + r] = accumulate ? out[c * ld + r] + sums[c][r] : sums[c][r];
}

/* fp8 weights: the scale grid of the matrix a projection reads (colibri.h) and the matrix row of its
 * first weight row; grid NULL for the other dtypes. */
typedef struct {
    const float *grid;
    int32_t bn, bk, cols; /* the config's blocks (0: whole dimension) and the grid's columns */
    int64_t row0;
} wscale_t;

/* The fp32 projection: each K_CHUNK-wide slice of the rows is converted to fp32 once into wbuf (fp8:
 * times its scale, so the product is the dequantised weight rounded once to fp32) and reused by every
 * token. */
static void project_f32(const void *w, colibri_dtype_t wdtype, uint64_t w_offset, int64_t in, int nrows,
                        const void *const *x, int64_t n, float *out, int64_t ld, float *wbuf, const wscale_t *sc) {
    for (int64_t i0 = 0; i0 < in; i0 += K_CHUNK) {
        const int64_t len = min64(K_CHUNK, in - i0), padded = round_up(len, ROW_PAD);
        for (int r = 0; r < nrows; r++) {
            float *dst = wbuf + (int64_t)r * K_CHUNK;
            load_f32(dst, w, wdtype, w_offset + (uint64_t)r * (uint64_t)in + (uint64_t)i0, len);
            if (sc && sc->grid) {
                const float *srow = sc->grid + (sc->bn > 0 ? (sc->row0 + r) / sc->bn : 0) * sc->cols;
                if (sc->bk > 0)
                    for (int64_t i = 0; i < len; i++) dst[i] *= srow[(i0 + i) / sc->bk];
                else
                    for (int64_t i = 0; i < len; i++) dst[i] *= srow[0];
            }
            for (int64_t i = len; i < padded; i++) dst[i] = 0.0f; /* x is zero there too; keeps NaN weights out */
        }
        const int accumulate = i0 > 0;
        for (int r0 = 0; r0 < nrows; r0 += TILE_ROWS) { /* 4 rows stay in L1 while the tokens stream by */
            const int nr = nrows - r0 < TILE_ROWS ? nrows - r0 : TILE_ROWS;
            const float *wr = wbuf + (int64_t)r0 * K_CHUNK;
            for (int64_t c0 = 0; c0 < n; c0 += TILE_TOKENS) {
                const int nt = (int)min64(TILE_TOKENS, n - c0);
                float *o = out + c0 * ld + r0;
                switch (nt) {
                case 4: dot_tile(4, x + c0, i0, wr, padded, o, ld, nr, accumulate); break;
                case 3: dot_tile(3, x + c0, i0, wr, padded, o, ld, nr, accumulate); break;
                case 2: dot_tile(2, x + c0, i0, wr, padded, o, ld, nr, accumulate); break;
                default: dot_tile(1, x + c0, i0, wr, padded, o, ld, nr, accumulate); break;
                }
            }
        }
    }
}

#if HAVE_BF16_DOT
/* The sums of the 16 lanes of each of a, b, c, d, reduced together: pairs of lanes within each 128-bit
 * block, then the four blocks (a third of the work of four separate reductions). */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* The bf16 register tile: nt tokens (1..4) x up to 4 weight rows read straight from the packed bf16
 * weights (row stride `in`). vdpbf16ps multiplies 16 pairs of bf16 and adds both products to 16 fp32
 * lanes. The tail of a row is loaded under a mask (never reading past the row: the next row or the end
 * of a memory-mapped file is there); x rows are zero-padded to ROW_PAD. */
static ALWAYS_INLINE void dot_tile_bf16(const int nt, const void *const *x, const uint16_t *w, int64_t in, int nr,
                                        float *out, int64_t ld, int prefetch) {
    /* missing rows repeat row 0 and are not stored; missing tokens repeat token 0 and are not computed */
    const uint16_t *w0 = w, *w1 = w + (nr > 1 ? in : 0), *w2 = w + (nr > 2 ? 2 * in : 0), *w3 = w + (nr > 3 ? 3 * in : 0);
    const uint16_t *x0 = (const uint16_t *)x[0], *x1 = (const uint16_t *)x[nt > 1],
                   *x2 = (const uint16_t *)x[nt > 2 ? 2 : 0], *x3 = (const uint16_t *)x[nt > 3 ? 3 : 0];
    /* named accumulators, not an array: the compiler keeps all 16 in registers */
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t i = 0; i < in; i += 32) {
        const __mmask32 m = in - i >= 32 ? 0xffffffffu : (1u << (in - i)) - 1u;
        if (prefetch) { /* into L2 only: into L1 too was slower at decode (docs/performance.md) */
            _mm_prefetch((const char *)(w0 + 4 * in + i), _MM_HINT_T1);
            _mm_prefetch((const char *)(w1 + 4 * in + i), _MM_HINT_T1);
            _mm_prefetch((const char *)(w2 + 4 * in + i), _MM_HINT_T1);
            _mm_prefetch((const char *)(w3 + 4 * in + i), _MM_HINT_T1);
        }
        const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + i), v1 = (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + i),
                       v2 = (__m512bh)_mm512_maskz_loadu_epi16(m, w2 + i), v3 = (__m512bh)_mm512_maskz_loadu_epi16(m, w3 + i);
        __m512bh xv = (__m512bh)_mm512_load_si512((const void *)(x0 + i));
        a00 = _mm512_dpbf16_ps(a00, xv, v0), a01 = _mm512_dpbf16_ps(a01, xv, v1);
        a02 = _mm512_dpbf16_ps(a02, xv, v2), a03 = _mm512_dpbf16_ps(a03, xv, v3);
        if (nt > 1) {
            xv = (__m512bh)_mm512_load_si512((const void *)(x1 + i));
            a10 = _mm512_dpbf16_ps(a10, xv, v0), a11 = _mm512_dpbf16_ps(a11, xv, v1);
            a12 = _mm512_dpbf16_ps(a12, xv, v2), a13 = _mm512_dpbf16_ps(a13, xv, v3);
        }
        if (nt > 2) {
            xv = (__m512bh)_mm512_load_si512((const void *)(x2 + i));
            a20 = _mm512_dpbf16_ps(a20, xv, v0), a21 = _mm512_dpbf16_ps(a21, xv, v1);
            a22 = _mm512_dpbf16_ps(a22, xv, v2), a23 = _mm512_dpbf16_ps(a23, xv, v3);
        }
        if (nt > 3) {
            xv = (__m512bh)_mm512_load_si512((const void *)(x3 + i));
            a30 = _mm512_dpbf16_ps(a30, xv, v0), a31 = _mm512_dpbf16_ps(a31, xv, v1);
            a32 = _mm512_dpbf16_ps(a32, xv, v2), a33 = _mm512_dpbf16_ps(a33, xv, v3);
        }
    }
    float sums[4][4];
    _mm_storeu_ps(sums[0], sum4(a00, a01, a02, a03));
    if (nt > 1) _mm_storeu_ps(sums[1], sum4(a10, a11, a12, a13));
    if (nt > 2) _mm_storeu_ps(sums[2], sum4(a20, a21, a22, a23));
    if (nt > 3) _mm_storeu_ps(sums[3], sum4(a30, a31, a32, a33));
    for (int c = 0; c < nt; c++)
        for (int r = 0; r < nr; r++) out[c * ld + r] = sums[c][r];
}

/* The bf16 x bf16 projection: weight rows are read where they are, 4 at a time, and stay in L1 while
 * every tile of tokens streams by. */
static void project_bf16(const uint16_t *w, int64_t in, int nrows, const void *const *x, int64_t n, float *out,
                         int64_t ld) {
    for (int r0 = 0; r0 < nrows; r0 += TILE_ROWS) {
        const int nr = nrows - r0 < TILE_ROWS ? nrows - r0 : TILE_ROWS;
        const uint16_t *wr = w + (int64_t)r0 * in;
        for (int64_t c0 = 0; c0 < n; c0 += TILE_TOKENS) {
            const int nt = (int)min64(TILE_TOKENS, n - c0), pf = c0 == 0 && r0 + TILE_ROWS < nrows;
            float *o = out + c0 * ld + r0;
            switch (nt) {
            case 4: dot_tile_bf16(4, x + c0, wr, in, nr, o, ld, pf); break;
            case 3: dot_tile_bf16(3, x + c0, wr, in, nr, o, ld, pf); break;
            case 2: dot_tile_bf16(2, x + c0, wr, in, nr, o, ld, pf); break;
            default: dot_tile_bf16(1, x + c0, wr, in, nr, o, ld, pf); break;
            }
        }
    }
}
#endif

/* out[c * ld + r] = sum_i W[r, i] * x[c][i] for r < nrows <= ROW_BLOCK and c < n, where row r of W starts
 * at element w_offset + r * in of the packed weights (stored dtype) and the x rows are zero-padded to a
 * multiple of ROW_PAD: bf16 rows when x_bf16 (then W is bf16 too), fp32 rows otherwise. */
static void project(const void *w, colibri_dtype_t wdtype, uint64_t w_offset, int64_t in, int nrows,
                    const void *const *x, int x_bf16, int64_t n, float *out, int64_t ld, float *wbuf,
                    const wscale_t *sc) {
#if HAVE_BF16_DOT
    if (x_bf16) {
        project_bf16((const uint16_t *)w + w_offset, in, nrows, x, n, out, ld);
        return;
    }
#endif
    (void)x_bf16;
    project_f32(w, wdtype, w_offset, in, nrows, x, n, out, ld, wbuf, sc);
}

/* ---- 2b. the bf16 x bf16 projection for many tokens: tokens in the vector lanes ----------------
 *
 * dot_tile_bf16 puts 16 pairs of one row in the lanes of a vector and must add the lanes together
 * at the end of every (token, row) tile; with many tokens per expert those horizontal sums and its
 * load-to-multiply ratio hold it well below the CPU's peak. Here the lanes are 16 TOKENS instead:
 * the activations of an expert's tokens are repacked (they are small; the weights stay borrowed in
 * place), each weight pair is broadcast to all lanes, and a tile of NR rows x NV vectors of tokens
 * needs no horizontal sum at all.
 *
 * The result must be bitwise what dot_tile_bf16 gives, or an output would depend on how many other
 * tokens its expert got in the same call (the kernel is chosen per expert by that count). So this
 * kernel follows dot_tile_bf16's order of operations exactly: lane j of dot_tile_bf16 accumulates
 * the pairs j, j + 16, j + 32, ... of the row in turn ("phase" j), and sum4 adds the 16 phases as
 * ((s0 + s2) + (s1 + s3)) with s_b = (l[4b] + l[4b + 2]) + (l[4b + 1] + l[4b + 3]). The packed
 * activations therefore hold each phase's pairs one after another (phase-major), the tile runs
 * phase by phase into a small buffer, and the same tree adds the 16 phases. Pairs past the end of
 * a row are skipped: in dot_tile_bf16 they multiply zeros and leave the sums as they are.
 *
 * Packed layout of K columns (K padded to Kp = round_up(K, ROW_PAD), M = Kp / 32 pairs per phase):
 * one "vector" per 16 tokens, Kp / 2 slots of 16 lanes of uint32 (a bf16 pair of one token);
 * pair p of token lane c sits in slot (p % 16) * M + p / 16, lane c. */
static inline int64_t packed_slot(int64_t pair, int64_t M) { return pair % PHASES * M + pair / PHASES; }

#if HAVE_BF16_DOT
/* acc[r * NV + v] += pair r (a bf16 pair of weight row r, in every lane) . vector v of activations */
static ALWAYS_INLINE void token_lane_step(const int NR, const int NV, __m512 *acc, const uint32_t *x, int64_t vec_stride,
                                          const uint32_t *pair) {
    __m512bh xv[4];
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        xv[v] = (__m512bh)_mm512_load_si512((const void *)(x + v * vec_stride));
        /* load each vector once: without this GCC reloads it for every row (it would rather
         * repeat a load than hold a register) and the loads become the bottleneck */
        __asm__("" : "+v"(xv[v]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) {
        const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)pair[r]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) acc[r * NV + v] = _mm512_dpbf16_ps(acc[r * NV + v], xv[v], wv);
    }
}

/* One tile: NR rows (nr of them real, the rest repeat row 0 and are not stored) x NV vectors of
 * tokens (nt real tokens from the first), all of each row's `in` columns. out[c * ld + r] as in
 * project; phase is a [PHASES][NR * NV] scratch of vectors. */
static ALWAYS_INLINE void token_lane_tile(const int NR, const int NV, const uint32_t *x, int64_t vec_stride,
                                          const uint16_t *w, int64_t in, int nr, int64_t nt, float *out,
                                          int64_t ld, __m512 *phase) {
    const int64_t M = round_up(in, ROW_PAD) / 32;
    const uint16_t *row[TILE_ACC];
    for (int r = 0; r < NR; r++) row[r] = w + (r < nr ? r : 0) * in;
    for (int j = 0; j < PHASES; j++) {
        /* pairs j + 16 m with both columns inside the row: m < full; a last half pair when in is odd */
        const int64_t full = in - 2 * j >= 2 ? (in - 2 * j - 2) / 32 + 1 : 0;
        const int half = full < M && 32 * full + 2 * j == in - 1;
        const uint32_t *xj = x + j * M * LANES;
        __m512 acc[TILE_ACC];
#pragma GCC unroll 16
        for (int a = 0; a < NR * NV; a++) acc[a] = _mm512_setzero_ps();
        int64_t m = 0;
        for (; m < full; m++) {
            /* the weights stream from memory: fetch the next NR rows at an even pace over the 16 phases */
            _mm_prefetch((const char *)(w + NR * in + (j * M + m) * NR / PHASES * 32), _MM_HINT_T0);
            const int64_t col = 2 * (j + PHASES * m);
            uint32_t pair[TILE_ACC];
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) memcpy(&pair[r], row[r] + col, sizeof pair[r]);
            token_lane_step(NR, NV, acc, xj + m * LANES, vec_stride, pair);
        }
        if (half) { /* the last column alone: never read past the row */
            uint32_t pair[TILE_ACC];
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) pair[r] = row[r][in - 1];
            token_lane_step(NR, NV, acc, xj + m * LANES, vec_stride, pair);
        }
#pragma GCC unroll 16
        for (int a = 0; a < NR * NV; a++) phase[j * NR * NV + a] = acc[a];
    }
    for (int a = 0; a < NR * NV; a++) {
        const __m512 *p = phase + a;
        const int64_t s = NR * NV;
        __m512 blk[4];
        for (int b = 0; b < 4; b++)
            blk[b] = _mm512_add_ps(_mm512_add_ps(p[(4 * b) * s], p[(4 * b + 2) * s]),
                                   _mm512_add_ps(p[(4 * b + 1) * s], p[(4 * b + 3) * s]));
        float sum[LANES];
        _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_add_ps(blk[0], blk[2]), _mm512_add_ps(blk[1], blk[3])));
        const int r = a / NV, v = a % NV;
        if (r >= nr) continue;
        for (int64_t c = 0; c < LANES && v * LANES + c < nt; c++) out[(v * LANES + c) * ld + r] = sum[c];
    }
}

/* Each tile shape in a function of its own: inlined into one loop nest, the three shapes leave the
 * register allocator too few registers and it reloads the activation vectors for every row. */
#define TOKEN_LANE_TILE(NR, NV)                                                                                  \
    static NOINLINE void token_lane_tile_##NR##x##NV(const uint32_t *x, int64_t vec_stride, const uint16_t *w,    \
                                                    int64_t in, int nr, int64_t nt, float *out, int64_t ld,    \
                                                    __m512 *phase) {                                           \
        token_lane_tile(NR, NV, x, vec_stride, w, in, nr, nt, out, ld, phase);                                 \
    }
TOKEN_LANE_TILE(4, 4)
TOKEN_LANE_TILE(4, 3)
TOKEN_LANE_TILE(8, 2)
/* every tile has 2 to 4 vectors (see project_token_lanes) */
typedef char token_lanes_need_two_vectors[TOKEN_LANES_MIN >= 2 * LANES ? 1 : -1];

/* The bf16 x bf16 projection of n tokens packed as above (x: their first vector) by nrows <= ROW_BLOCK
 * weight rows read in place (row stride in): out[c * ld + r] as in project. */
static void project_token_lanes(const uint16_t *w, int64_t in, int nrows, const uint32_t *x, int64_t n,
                                float *out, int64_t ld, __m512 *phase) {
    const int64_t vec_stride = round_up(in, ROW_PAD) / 2 * LANES, nvec = (n + LANES - 1) / LANES;
    /* as few tiles of at most 4 vectors as possible, of even sizes (5 vectors: 3 + 2, not 4 + 1); with
     * at least 2 vectors in all (TOKEN_LANES_MIN), every tile has 2 to 4 */
    const int64_t ntiles = (nvec + 3) / 4;
    for (int64_t tile = 0, v0 = 0; tile < ntiles; tile++) {
        const int nv = (int)((nvec - v0) / (ntiles - tile) + ((nvec - v0) % (ntiles - tile) != 0));
        const int tile_rows = nv == 2 ? 8 : 4; /* 12 to 16 accumulators */
        const uint32_t *xv = x + v0 * vec_stride;
        float *o = out + v0 * LANES * ld;
        const int64_t nt = n - v0 * LANES;
        for (int r0 = 0; r0 < nrows; r0 += tile_rows) {
            const int nr = nrows - r0 < tile_rows ? nrows - r0 : tile_rows;
            const uint16_t *wr = w + (int64_t)r0 * in;
            switch (nv) {
            case 4: token_lane_tile_4x4(xv, vec_stride, wr, in, nr, nt, o + r0, ld, phase); break;
            case 3: token_lane_tile_4x3(xv, vec_stride, wr, in, nr, nt, o + r0, ld, phase); break;
            default: token_lane_tile_8x2(xv, vec_stride, wr, in, nr, nt, o + r0, ld, phase); break;
            }
        }
        v0 += nv;
    }
}
#endif

/* ---------------------------------------------------------------------------------------------------
 * 3. routing
 * ------------------------------------------------------------------------------------------------- */

/* x32 = the input in fp32 (the router needs it), and for a bf16 x bf16 forward x16 = its bf16 rows. */
static void convert_input(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t T, colibri_dtype_t act_dtype,
                          const void *input) {
    const int64_t H = ctx->cfg.hidden_size;
#pragma omp parallel for num_threads(s->nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        load_f32(s->x32 + t * s->hp, input, act_dtype, (uint64_t)(t * H), H);
        if (s->bf16_dot) memcpy(s->x16 + t * s->hp, (const uint16_t *)input + t * H, (size_t)H * sizeof(uint16_t));
    }
}

/* logits[t, e] = router_weight[e, :] . x32[t, :] in fp32. */
static void router_logits(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t T) {
    const int32_t E = ctx->cfg.num_experts;
    const int64_t token_blocks = (T + TILE_TOKENS - 1) / TILE_TOKENS, row_blocks = (E + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for num_threads(s->nthreads) schedule(static)
    for (int64_t b = 0; b < token_blocks * row_blocks; b++) {
        const int64_t t0 = b / row_blocks * TILE_TOKENS, e0 = b % row_blocks * ROW_BLOCK;
        project(ctx->router_weight, COLIBRI_DTYPE_F32, (uint64_t)(e0 * ctx->cfg.hidden_size), ctx->cfg.hidden_size,
                (int)min64(ROW_BLOCK, E - e0), (const void *const *)s->token_rows + t0, 0, min64(TILE_TOKENS, T - t0),
                s->logits + t0 * E + e0, E, s->wbuf + (int64_t)omp_get_thread_num() * ROW_BLOCK * K_CHUNK, NULL);
    }
    if (ctx->router_logit_bias)
        for (int64_t t = 0; t < T; t++)
            for (int32_t e = 0; e < E; e++) s->logits[t * E + e] += ctx->router_logit_bias[e];
}

/* ids[0..k) = the k largest scores, in descending order, ties to the lower expert id (NaN counts as -inf
 * so that k valid ids always come out). Insertion into the sorted prefix: k is small. */
static void top_k(const float *score, int32_t E, int32_t k, int32_t *ids, float *chosen) {
    int32_t n = 0;
    for (int32_t e = 0; e < E; e++) {
        const float v = isnan(score[e]) ? -INFINITY : score[e];
        if (n == k && !(v > chosen[k - 1])) continue;
        int32_t p = n < k ? n++ : k - 1;
        for (; p > 0 && v > chosen[p - 1]; p--) {
            chosen[p] = chosen[p - 1];
            ids[p] = ids[p - 1];
        }
        chosen[p] = v;
        ids[p] = e;
    }
}

/* The built-in routing of one token (colibri.h, routing.h); scratch holds E + k + n_group floats. */
static void route_token(const colibri_moe_config_t *cfg, const float *router_bias, const float *logits,
                        float *scratch, int32_t *ids, float *weights) {
    const int32_t E = cfg->num_experts, k = cfg->top_k;
    float *select = scratch, *chosen = scratch + E, *group = scratch + E + k;
    float mx = -INFINITY, sum = 0.0f;
    if (colibri_route_softmax_all(cfg->routing)) {
        for (int32_t e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int32_t e = 0; e < E; e++) sum += colibri_route_softmax_term(logits[e], mx);
    }
    for (int32_t e = 0; e < E; e++) select[e] = colibri_route_select(cfg->routing, logits[e], router_bias, e);
    if (cfg->n_group > 1) colibri_route_limit_groups(select, E, cfg->n_group, cfg->topk_group, cfg->group_score, group);
    top_k(select, E, k, ids, chosen);
    for (int32_t j = 0; j < k; j++) weights[j] = colibri_route_prob(cfg->routing, logits[ids[j]], mx, sum);
    colibri_route_weights(cfg->routing, cfg->renormalize, cfg->routed_scaling_factor, weights, k);
}

/* Routing of T tokens into ids/weights ([T, k]): the caller's routing_fn, or the built-in routing from
 * the router logits. Expects x32 to hold the input. */
static colibri_status_t compute_routing(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t T,
                                        colibri_dtype_t act_dtype, const void *input, int32_t *ids, float *weights) {
    const colibri_moe_config_t *cfg = &ctx->cfg;
    if (ctx->router_weight) router_logits(ctx, s, T);
    if (cfg->routing_fn) {
        colibri_status_t st = cfg->routing_fn(cfg->routing_user_data, T, cfg->num_experts, cfg->top_k, act_dtype,
                                              input, ctx->router_weight ? s->logits : NULL, ids, weights, NULL);
        if (st != COLIBRI_OK)
            return colibri_set_error(COLIBRI_ERR_ROUTING, "routing_fn failed with status %d (%s)", (int)st,
                                     colibri_status_string(st));
        if (colibri_check_routing(ctx, T, ids, weights, "routing_fn") != COLIBRI_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", colibri_last_error());
            return colibri_set_error(COLIBRI_ERR_ROUTING, "%s", why);
        }
        return COLIBRI_OK;
    }
    const int32_t E = cfg->num_experts, k = cfg->top_k;
#pragma omp parallel for num_threads(s->nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        route_token(cfg, ctx->router_bias, s->logits + t * E,
                    s->route_scratch + (int64_t)omp_get_thread_num() * (E + k + cfg->n_group),
                    ids + t * k, weights + t * k);
    return COLIBRI_OK;
}

/* ---------------------------------------------------------------------------------------------------
 * 4. grouping: a stable counting sort of the T * k (token, slot) pairs by expert
 * ------------------------------------------------------------------------------------------------- */

/* How many of an expert's n tokens the token-lane kernel takes: none below TOKEN_LANES_MIN, else whole
 * vectors of LANES tokens, and a last partial vector only when it is at least half full; the few
 * tokens left over run dot_tile_bf16, which wastes no lanes on them. A function of n alone, and both
 * kernels give the same bits, so no token's output depends on the other tokens of the call. */
static int32_t token_lane_count(int32_t n) {
    if (n < TOKEN_LANES_MIN) return 0;
    return n % LANES >= LANES / 2 ? n : n - n % LANES;
}

static void group_by_expert(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t T, const int32_t *ids) {
    (void)ctx;
    const int32_t E = s->experts, k = s->slots;
    const int64_t P = T * k;
    memset(s->cursor, 0, (size_t)E * sizeof *s->cursor);
    for (int64_t p = 0; p < P; p++) s->cursor[ids[p]]++;
    s->expert_start[0] = 0;
    for (int32_t e = 0; e < E; e++) {
        s->expert_start[e + 1] = s->expert_start[e] + s->cursor[e];
        s->counts[e] += (uint64_t)s->cursor[e];
        s->cursor[e] = s->expert_start[e];
    }
    for (int64_t p = 0; p < P; p++) {
        const int32_t pos = s->cursor[ids[p]]++;
        s->pair_of[pos] = (int32_t)p;
        s->x_rows[pos] = s->bf16_dot ? (const void *)(s->x16 + p / k * s->hp) : s->token_rows[p / k];
        if (s->hidden) s->h_rows[pos] = s->bf16_dot ? (const void *)(s->hidden16 + pos * s->fp) : s->hidden + pos * s->fp;
    }
    int32_t vectors = 0;
    for (int32_t e = 0; e < E; e++) {
        s->lane_tokens[e] = s->bf16_dot ? token_lane_count(s->expert_start[e + 1] - s->expert_start[e]) : 0;
        s->lane_vec[e] = vectors;
        vectors += (s->lane_tokens[e] + LANES - 1) / LANES;
    }
}

/* The inputs of every token-lane expert, packed (section 2b) from their bf16 rows: the rows' zero
 * padding fills the padded pairs, and lanes past the expert's last token are zero. */
static void pack_token_lanes(cpu_state_t *s) {
    const int64_t pairs = s->hp / 2, M = s->hp / 32;
#pragma omp parallel for num_threads(s->nthreads) schedule(dynamic, 1)
    for (int32_t e = 0; e < s->experts; e++) {
        const int32_t start = s->expert_start[e], n = s->lane_tokens[e];
        if (n == 0) continue; /* x_packed may not exist at all (no bf16 dot products) */
        uint32_t *dst = s->x_packed + (int64_t)s->lane_vec[e] * pairs * LANES;
        for (int32_t v = 0; v * LANES < n; v++, dst += pairs * LANES)
            for (int64_t slot = 0; slot < pairs; slot++) {
                const int64_t pair = slot % M * PHASES + slot / M; /* the inverse of packed_slot */
                for (int32_t c = 0; c < LANES; c++) {
                    const int32_t t = v * LANES + c;
                    uint32_t value = 0;
                    if (t < n) memcpy(&value, (const uint16_t *)s->x_rows[start + t] + 2 * pair, sizeof value);
                    dst[slot * LANES + c] = value;
                }
            }
    }
}

/* Expert e's projection by nrows weight rows from w_offset (row stride in) into out[c * ld + r]: the
 * token-lane kernel when the expert's inputs are packed (packed: vector 0 of that buffer), else project
 * on its rows. fp8 weights: the rows are row0.. of the expert's matrix `matrix` (colibri_scale_grid_offset). */
static void project_expert(const colibri_moe_context_t *ctx, cpu_state_t *s, int32_t e, uint64_t w_offset, int64_t in,
                           int nrows, const void *const *rows, const uint32_t *packed, float *out, int64_t ld,
                           float *scratch, int matrix, int64_t row0) {
    const int32_t start = s->expert_start[e], n = s->expert_start[e + 1] - start, lanes = s->lane_tokens[e];
#if HAVE_BF16_DOT
    if (lanes > 0) {
        const uint32_t *x = packed + (int64_t)s->lane_vec[e] * (round_up(in, ROW_PAD) / 2 * LANES);
        project_token_lanes((const uint16_t *)s->base[e] + w_offset, in, nrows, x, lanes, out, ld, (__m512 *)scratch);
    }
#else
    (void)packed;
#endif
    wscale_t sc = {NULL, 0, 0, 0, row0};
    if (ctx->expert_scales) {
        const colibri_moe_config_t *c = &ctx->cfg;
        sc.grid = ctx->expert_scales + (uint64_t)e * ctx->scales_numel + colibri_scale_grid_offset(c, matrix);
        sc.bn = c->scale_block_n;
        sc.bk = c->scale_block_k;
        sc.cols = colibri_scale_blocks((int32_t)in, sc.bk);
    }
    if (n > lanes)
        project(s->base[e], ctx->cfg.weight_dtype, w_offset, in, nrows, rows + start + lanes, s->bf16_dot, n - lanes,
                out + lanes * ld, ld, scratch, &sc);
}

/* One task per (touched expert, block of ROW_BLOCK of its `rows` output rows); returns how many. */
static int64_t make_tasks(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t rows) {
    (void)ctx;
    int64_t n = 0;
    for (int32_t e = 0; e < s->experts; e++) {
        if (s->expert_start[e + 1] == s->expert_start[e]) continue;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) s->tasks[n++] = (task_t){e, (int32_t)r0};
    }
    return n;
}

/* ---------------------------------------------------------------------------------------------------
 * 5. expert FFN
 *
 * Parallelism: the expert FFN is cut into tasks (expert, block of ROW_BLOCK weight rows) that each run
 * over all of the expert's tokens. At T = 1 that splits every touched expert's rows across the threads,
 * so each weight byte is streamed once (decode is memory-bound); at large T each block of weight rows is
 * converted to fp32 once and reused from cache by every token of the expert.
 * ------------------------------------------------------------------------------------------------- */

/* e^x in fp32 from plain arithmetic, so that the SiLU loop below vectorises (a call to libm's expf
 * cannot, and cost about a tenth of a large forward). x = k ln2 + r with k = round(x / ln2) and
 * |r| <= ln2 / 2 (ln2 in two parts, so r is exact to a few ulp); e^r by its Taylor series to r^7,
 * whose remainder is below 2^-27 there; 2^k applied in two halves so that subnormal results come out
 * right and large ones overflow to inf. Within 2 ulp of e^x; inf, -inf and NaN give inf, 0 and NaN. */
static inline float exp_f32(float x) {
    float xc = x > -104.0f ? x : -104.0f;                         /* e^x is 0 below (NaN goes here too), */
    xc = xc < 89.0f ? xc : 89.0f;                                 /* and inf above */
    const float round = 12582912.0f;                              /* 1.5 * 2^23: adding it rounds to an integer */
    const float k = (xc * 1.44269504f + round) - round;
    float r = fmaf(k, -0.693145751953125f, xc);                   /* ln2's high part is exact in 16 bits */
    r = fmaf(k, -1.428606765330187e-06f, r);
    float p = 1.0f / 5040;
    p = fmaf(p, r, 1.0f / 720), p = fmaf(p, r, 1.0f / 120), p = fmaf(p, r, 1.0f / 24);
    p = fmaf(p, r, 1.0f / 6), p = fmaf(p, r, 0.5f), p = fmaf(p, r, 1.0f), p = fmaf(p, r, 1.0f);
    const int32_t k1 = (int32_t)k / 2, k2 = (int32_t)k - k1;      /* each in [-75, 64]: 2^k1, 2^k2 are normal */
    union { uint32_t u; float f; } s1 = {(uint32_t)(k1 + 127) << 23}, s2 = {(uint32_t)(k2 + 127) << 23}; /* memcpy would not vectorise */
    const float e = p * s1.f * s2.f;
    return x != x ? x : e;
}

/* g[i] = act(g[i], u[i]) for i < n (colibri_activation_t): silu(g) * u = g / (1 + e^-g) * u, or gpt-oss's
 * clamped form. The clamps are comparisons so that NaN stays NaN, as torch.clamp keeps it. */
static void activate(float *g, const float *u, int64_t n, colibri_activation_t act, float alpha, float limit) {
    if (act == COLIBRI_ACTIVATION_SILU) {
        for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float gc = g[i] > limit ? limit : g[i], uc = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
        g[i] = (uc + 1.0f) * (gc / (1.0f + exp_f32(-alpha * gc)));
    }
}

/* SWIGLU, first half: hidden[pos, :] = silu(gate x) * up x for every sorted pair position (hidden16 in
 * bf16 for a bf16 x bf16 forward). */
static void swiglu_gate_up(const colibri_moe_context_t *ctx, cpu_state_t *s) {
    const int64_t H = ctx->cfg.hidden_size, F = ctx->cfg.intermediate_size, P = (int64_t)ctx->cfg.workspace_tokens * s->slots;
    const int64_t ntasks = make_tasks(ctx, s, F), ld = 2 * ROW_BLOCK;
#pragma omp parallel for num_threads(s->nthreads) schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; i++) {
        const int tid = omp_get_thread_num();
        const int32_t e = s->tasks[i].expert, start = s->expert_start[e], n = s->expert_start[e + 1] - start;
        const int64_t row0 = s->tasks[i].row0;
        const int nrows = (int)min64(ROW_BLOCK, F - row0);
        const uint64_t gate = s->offsets[e] + (uint64_t)(row0 * H), up = gate + (uint64_t)(F * H);
        float *tile = s->tile + tid * P * ld, *wbuf = s->wbuf + (int64_t)tid * ROW_BLOCK * K_CHUNK;
        project_expert(ctx, s, e, gate, H, nrows, s->x_rows, s->x_packed, tile, ld, wbuf, 0, row0);
        project_expert(ctx, s, e, up, H, nrows, s->x_rows, s->x_packed, tile + ROW_BLOCK, ld, wbuf, 1, row0);
        int64_t packed_at[ROW_BLOCK]; /* where hidden column row0 + r of lane 0 goes in a packed vector (2b) */
        for (int r = 0; r < nrows; r++) packed_at[r] = packed_slot((row0 + r) / 2, s->fp / 32) * LANES * 2 + (row0 + r) % 2;
        if (ctx->expert_bias) { /* gate and up biases, before the activation */
            const float *b = ctx->expert_bias + (int64_t)e * ctx->bias_numel + row0;
            for (int32_t c = 0; c < n; c++)
                for (int r = 0; r < nrows; r++) tile[c * ld + r] += b[r], tile[c * ld + ROW_BLOCK + r] += b[F + r];
        }
        /* the shared expert's slices always take SiLU (colibri.h) */
        const colibri_activation_t act = e < ctx->cfg.num_experts ? ctx->cfg.activation : COLIBRI_ACTIVATION_SILU;
        /* all tokens first, then the stores: the tokens' activations are independent and overlap */
        for (int32_t c = 0; c < n; c++)
            activate(tile + c * ld, tile + c * ld + ROW_BLOCK, nrows, act, ctx->cfg.activation_alpha,
                     ctx->cfg.activation_limit);
        for (int32_t c = 0; c < n; c++) {
            const float *g = tile + c * ld;
            const int64_t pos = start + c;
            if (c < s->lane_tokens[e]) { /* bf16 into the packed hidden of the token-lane down projection */
                uint16_t *h = (uint16_t *)(s->h_packed + (s->lane_vec[e] + c / LANES) * (s->fp / 2 * LANES)) + c % LANES * 2;
                uint16_t g16[ROW_BLOCK];
                for (int r = 0; r < nrows; r++) g16[r] = f32_to_bf16(g[r]);
                for (int r = 0; r < nrows; r++) h[packed_at[r]] = g16[r];
            } else if (s->bf16_dot) {
                store_f32(s->hidden16, COLIBRI_DTYPE_BF16, (uint64_t)(pos * s->fp + row0), g, nrows);
            } else {
                memcpy(s->hidden + pos * s->fp + row0, g, (size_t)nrows * sizeof(float));
            }
        }
    }
}

/* y[pair, :] = W x for every pair, with W the out_features x in matrix that starts `skip` elements into
 * each expert (SWIGLU: down over the hidden rows; LINEAR: w over the input rows). */
static void project_to_y(const colibri_moe_context_t *ctx, cpu_state_t *s, uint64_t skip, int64_t in,
                         const void *const *rows, const uint32_t *packed) {
    const int64_t out = ctx->out_features, P = (int64_t)ctx->cfg.workspace_tokens * s->slots;
    const int64_t ntasks = make_tasks(ctx, s, out);
    /* the output bias: SWIGLU's down bias follows the gate and up biases */
    const int64_t bias_at = ctx->cfg.expert_kind == COLIBRI_EXPERT_SWIGLU ? 2 * (int64_t)ctx->cfg.intermediate_size : 0;
#pragma omp parallel for num_threads(s->nthreads) schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; i++) {
        const int tid = omp_get_thread_num();
        const int32_t e = s->tasks[i].expert, start = s->expert_start[e], n = s->expert_start[e + 1] - start;
        const int64_t row0 = s->tasks[i].row0;
        const int nrows = (int)min64(ROW_BLOCK, out - row0);
        float *tile = s->tile + tid * P * 2 * ROW_BLOCK, *wbuf = s->wbuf + (int64_t)tid * ROW_BLOCK * K_CHUNK;
        project_expert(ctx, s, e, s->offsets[e] + skip + (uint64_t)(row0 * in), in, nrows, rows, packed, tile, ROW_BLOCK,
                       wbuf, skip ? 2 : 0, row0);
        if (ctx->expert_bias) {
            const float *b = ctx->expert_bias + (int64_t)e * ctx->bias_numel + bias_at + row0;
            for (int32_t c = 0; c < n; c++)
                for (int r = 0; r < nrows; r++) tile[c * ROW_BLOCK + r] += b[r];
        }
        for (int32_t c = 0; c < n; c++)
            memcpy(s->y + s->pair_of[start + c] * out + row0, tile + c * ROW_BLOCK, (size_t)nrows * sizeof(float));
    }
}

static void expert_ffn(const colibri_moe_context_t *ctx, cpu_state_t *s) {
    const int64_t H = ctx->cfg.hidden_size, F = ctx->cfg.intermediate_size;
    pack_token_lanes(s);
    if (ctx->cfg.expert_kind == COLIBRI_EXPERT_SWIGLU) {
        swiglu_gate_up(ctx, s);
        project_to_y(ctx, s, (uint64_t)(2 * F * H), F, (const void *const *)s->h_rows, s->h_packed);
    } else {
        project_to_y(ctx, s, 0, H, (const void *const *)s->x_rows, s->x_packed);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * 6. combine
 * ------------------------------------------------------------------------------------------------- */

/* output[t] = sum_j weights[t, j] * y[t, j], summed in slot order into y[t, 0]. */
static void combine(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t T, const float *weights,
                    colibri_dtype_t act_dtype, void *output) {
    const int64_t out = ctx->out_features, k = s->slots;
#pragma omp parallel for num_threads(s->nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *acc = s->y + t * k * out;
        const float w0 = weights[t * k];
        for (int64_t o = 0; o < out; o++) acc[o] *= w0;
        for (int64_t j = 1; j < k; j++) {
            const float wj = weights[t * k + j], *yj = acc + j * out;
            for (int64_t o = 0; o < out; o++) acc[o] = fmaf(wj, yj[o], acc[o]);
        }
        store_f32(output, act_dtype, (uint64_t)(t * out), acc, out);
    }
}

/* slot_ids / slot_w [T, k'] = each token's k routed ids and weights, then the shared expert's slices
 * E .. E + m - 1 with weight 1 or sigmoid(shared_gate . x) (x32 holds the input). */
static void add_shared_slots(const colibri_moe_context_t *ctx, cpu_state_t *s, int64_t T, const int32_t *ids,
                             const float *weights) {
    const int32_t E = ctx->cfg.num_experts, k = ctx->cfg.top_k, kk = s->slots;
    const int64_t H = ctx->cfg.hidden_size;
#pragma omp parallel for num_threads(s->nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float g = 1.0f;
        if (ctx->shared_gate) {
            const float *x = s->x32 + t * s->hp;
            float dot = 0.0f;
            for (int64_t h = 0; h < H; h++) dot = fmaf(ctx->shared_gate[h], x[h], dot);
            g = 1.0f / (1.0f + expf(-dot));
        }
        for (int32_t j = 0; j < k; j++) s->slot_ids[t * kk + j] = ids[t * k + j], s->slot_w[t * kk + j] = weights[t * k + j];
        for (int32_t j = k; j < kk; j++) s->slot_ids[t * kk + j] = E + (j - k), s->slot_w[t * kk + j] = g;
    }
}

/* ---------------------------------------------------------------------------------------------------
 * backend entry points
 * ------------------------------------------------------------------------------------------------- */

static colibri_status_t cpu_forward(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                    const void *input, const int32_t *topk_ids, const float *topk_weights,
                                    void *output, void *stream) {
    (void)stream;
    cpu_state_t *s = (cpu_state_t *)ctx->backend;
    s->bf16_dot = HAVE_BF16_DOT && ctx->cfg.weight_dtype == COLIBRI_DTYPE_BF16 && act_dtype == COLIBRI_DTYPE_BF16;
    convert_input(ctx, s, num_tokens, act_dtype, input);
    if (!topk_ids) {
        colibri_status_t st = compute_routing(ctx, s, num_tokens, act_dtype, input, s->ids, s->weights_tk);
        if (st != COLIBRI_OK) return st;
        topk_ids = s->ids;
        topk_weights = s->weights_tk;
    }
    if (ctx->shared_experts) {
        add_shared_slots(ctx, s, num_tokens, topk_ids, topk_weights);
        topk_ids = s->slot_ids;
        topk_weights = s->slot_w;
    }
    group_by_expert(ctx, s, num_tokens, topk_ids);
    expert_ffn(ctx, s);
    combine(ctx, s, num_tokens, topk_weights, act_dtype, output);
    return COLIBRI_OK;
}

static colibri_status_t cpu_route(colibri_moe_context_t *ctx, int64_t num_tokens, colibri_dtype_t act_dtype,
                                  const void *input, int32_t *topk_ids, float *topk_weights, void *stream) {
    (void)stream;
    cpu_state_t *s = (cpu_state_t *)ctx->backend;
    s->bf16_dot = 0;
    convert_input(ctx, s, num_tokens, act_dtype, input);
    return compute_routing(ctx, s, num_tokens, act_dtype, input, topk_ids, topk_weights);
}

static colibri_status_t cpu_expert_counts(colibri_moe_context_t *ctx, uint64_t *counts, int32_t reset) {
    cpu_state_t *s = (cpu_state_t *)ctx->backend;
    memcpy(counts, s->counts, (size_t)ctx->cfg.num_experts * sizeof *counts);
    if (reset) memset(s->counts, 0, (size_t)ctx->cfg.num_experts * sizeof *s->counts);
    return COLIBRI_OK;
}

/* The CPU reports ids out of range from forward itself: nothing is deferred. */
static colibri_status_t cpu_take_device_error(colibri_moe_context_t *ctx) {
    (void)ctx;
    return COLIBRI_OK;
}

static void cpu_destroy(colibri_moe_context_t *ctx) {
    cpu_state_t *s = (cpu_state_t *)ctx->backend;
    if (!s) return;
    free(s->base);
    free(s->offsets);
    free(s->counts);
    free(s->x32);
    free(s->x16);
    free(s->token_rows);
    free(s->logits);
    free(s->ids);
    free(s->weights_tk);
    free(s->slot_ids);
    free(s->slot_w);
    free(s->expert_start);
    free(s->cursor);
    free(s->pair_of);
    free(s->x_rows);
    free(s->h_rows);
    free(s->lane_tokens);
    free(s->lane_vec);
    free(s->x_packed);
    free(s->h_packed);
    free(s->hidden);
    free(s->hidden16);
    free(s->y);
    free(s->tasks);
    free(s->wbuf);
    free(s->tile);
    free(s->route_scratch);
    free(s);
    ctx->backend = NULL;
}

/* a * b zeroed elements of `size` bytes, 64-byte aligned (fp32 rows then start on a vector boundary);
 * NULL, with *failed set, on overflow or when out of memory. Zeroed so that row padding reads as 0. */
static void *alloc_zeroed(int64_t a, int64_t b, size_t size, int *failed) {
    if (*failed) return NULL;
    void *p = NULL;
    const size_t n = a > 0 && b > 0 ? (size_t)a * (size_t)b : 1;
    if (a >= 0 && b >= 0 && (b == 0 || (uint64_t)a <= (uint64_t)SIZE_MAX / size / (uint64_t)b) &&
        posix_memalign(&p, 64, n * size) == 0)
        memset(p, 0, n * size);
    else
        p = NULL, *failed = 1;
    return p;
}

static colibri_status_t cpu_init(colibri_moe_context_t *ctx, const void *expert_weights,
                                 const uint64_t *expert_offsets) {
    colibri_moe_config_t *cfg = &ctx->cfg;
    cpu_state_t *s = (cpu_state_t *)calloc(1, sizeof *s);
    if (!s) return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY, "cannot allocate the CPU backend state");
    ctx->backend = s;
    if (cfg->workspace_tokens == 0) cfg->workspace_tokens = DEFAULT_WORKSPACE_TOKENS;
    s->nthreads = cfg->num_threads > 0 ? cfg->num_threads : omp_get_max_threads();
    s->hp = round_up(cfg->hidden_size, ROW_PAD);
    s->fp = round_up(cfg->intermediate_size, ROW_PAD);

    s->experts = colibri_all_experts(ctx);
    s->slots = cfg->top_k + ctx->shared_experts;
    const int64_t E = s->experts, k = s->slots, W = cfg->workspace_tokens, P = W * k;
    const int64_t H = cfg->hidden_size, F = cfg->intermediate_size, max_rows = H > F ? H : F;
    const int swiglu = cfg->expert_kind == COLIBRI_EXPERT_SWIGLU;
    const int bf16_dot_possible = HAVE_BF16_DOT && cfg->weight_dtype == COLIBRI_DTYPE_BF16;
    int failed = 0;
    s->base = alloc_zeroed(E, 1, sizeof *s->base, &failed);
    s->offsets = alloc_zeroed(E, 1, sizeof *s->offsets, &failed);
    s->counts = alloc_zeroed(E, 1, sizeof *s->counts, &failed);
    s->x32 = alloc_zeroed(W, s->hp, sizeof(float), &failed);
    s->x16 = bf16_dot_possible ? alloc_zeroed(W, s->hp, sizeof(uint16_t), &failed) : NULL;
    s->token_rows = alloc_zeroed(W, 1, sizeof *s->token_rows, &failed);
    s->logits = alloc_zeroed(W, E, sizeof(float), &failed);
    s->ids = alloc_zeroed(P, 1, sizeof *s->ids, &failed);
    s->weights_tk = alloc_zeroed(P, 1, sizeof(float), &failed);
    s->slot_ids = ctx->shared_experts ? alloc_zeroed(P, 1, sizeof *s->slot_ids, &failed) : NULL;
    s->slot_w = ctx->shared_experts ? alloc_zeroed(P, 1, sizeof(float), &failed) : NULL;
    s->expert_start = alloc_zeroed(E + 1, 1, sizeof *s->expert_start, &failed);
    s->cursor = alloc_zeroed(E, 1, sizeof *s->cursor, &failed);
    s->pair_of = alloc_zeroed(P, 1, sizeof *s->pair_of, &failed);
    s->x_rows = alloc_zeroed(P, 1, sizeof *s->x_rows, &failed);
    s->h_rows = alloc_zeroed(P, 1, sizeof *s->h_rows, &failed);
    /* token-lane vectors: one per LANES tokens of each expert with at least TOKEN_LANES_MIN tokens */
    const int64_t lane_vectors = bf16_dot_possible ? P / LANES + (E < P / TOKEN_LANES_MIN ? E : P / TOKEN_LANES_MIN) : 0;
    s->lane_tokens = alloc_zeroed(E, 1, sizeof *s->lane_tokens, &failed);
    s->lane_vec = alloc_zeroed(E, 1, sizeof *s->lane_vec, &failed);
    s->x_packed = lane_vectors ? alloc_zeroed(lane_vectors, s->hp / 2 * LANES, sizeof(uint32_t), &failed) : NULL;
    s->h_packed = lane_vectors && swiglu ? alloc_zeroed(lane_vectors, s->fp / 2 * LANES, sizeof(uint32_t), &failed) : NULL;
    s->hidden = swiglu ? alloc_zeroed(P, s->fp, sizeof(float), &failed) : NULL;
    s->hidden16 = swiglu && bf16_dot_possible ? alloc_zeroed(P, s->fp, sizeof(uint16_t), &failed) : NULL;
    s->y = alloc_zeroed(P, ctx->out_features, sizeof(float), &failed);
    s->tasks = alloc_zeroed(E, (max_rows + ROW_BLOCK - 1) / ROW_BLOCK, sizeof *s->tasks, &failed);
    s->wbuf = alloc_zeroed(s->nthreads, ROW_BLOCK * K_CHUNK, sizeof(float), &failed);
    s->tile = alloc_zeroed((int64_t)s->nthreads * P, 2 * ROW_BLOCK, sizeof(float), &failed);
    s->route_scratch = alloc_zeroed(s->nthreads, cfg->num_experts + cfg->top_k + cfg->n_group, sizeof(float), &failed);
    if (failed || P > INT32_MAX) {
        cpu_destroy(ctx);
        return colibri_set_error(COLIBRI_ERR_OUT_OF_MEMORY,
                                 "cannot allocate the CPU workspace for %lld tokens (H=%lld, F=%lld, k=%lld); "
                                 "lower config.workspace_tokens",
                                 (long long)W, (long long)H, (long long)F, (long long)k);
    }
    for (int32_t e = 0; e < E; e++) {
        const int routed = e < cfg->num_experts;
        s->base[e] = routed ? expert_weights : ctx->shared_packed;
        s->offsets[e] = routed ? expert_offsets[e] : (uint64_t)(e - cfg->num_experts) * ctx->expert_numel;
    }
    for (int64_t t = 0; t < W; t++) s->token_rows[t] = s->x32 + t * s->hp;
    return COLIBRI_OK;
}

/* The CPU backend computes every layer the front end accepts. */
static colibri_status_t cpu_supports(const colibri_moe_config_t *config, const colibri_moe_weights_t *weights) {
    (void)config; (void)weights;
    return COLIBRI_OK;
}

const colibri_backend_t colibri_cpu_backend = {
    "cpu", 1, cpu_supports, cpu_init, cpu_forward, cpu_route, cpu_expert_counts, cpu_take_device_error, cpu_destroy,
};
