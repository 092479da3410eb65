/*
 * common.c — what the front end and every backend share: status strings, the per-thread error
 * message, dtype sizes, the host-side checks of given routing and of weights' finiteness. Depends on
 * nothing else here.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "dtype.h"
#include "internal.h"

#if defined(__GNUC__) || defined(__clang__)
#define COLIBRI_THREAD_LOCAL __thread
#else
#define COLIBRI_THREAD_LOCAL _Thread_local
#endif

static COLIBRI_THREAD_LOCAL char last_error[512];

colibri_status_t colibri_set_error(colibri_status_t status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *colibri_last_error(void) { return last_error; }

const char *colibri_version(void) { return COLIBRI_VERSION_STRING; }

const char *colibri_status_string(colibri_status_t status) {
    switch (status) {
    case COLIBRI_OK: return "ok";
    case COLIBRI_ERR_INVALID_ARGUMENT: return "invalid argument";
    case COLIBRI_ERR_OUT_OF_MEMORY: return "out of memory";
    case COLIBRI_ERR_UNSUPPORTED: return "unsupported";
    case COLIBRI_ERR_CUDA: return "CUDA error";
    case COLIBRI_ERR_ROUTING: return "routing error";
    case COLIBRI_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

size_t colibri_dtype_size(colibri_dtype_t dtype) { return colibri_dtype_info(dtype).size; }

uint64_t colibri_expert_numel(colibri_expert_kind_t kind, int32_t hidden_size, int32_t intermediate_size) {
    if (hidden_size < 1 || intermediate_size < 1) return 0;
    uint64_t hf = (uint64_t)hidden_size * (uint64_t)intermediate_size;
    switch (kind) {
    case COLIBRI_EXPERT_SWIGLU: return 3 * hf;
    case COLIBRI_EXPERT_LINEAR: return hf;
    }
    return 0;
}

uint64_t colibri_scales_numel(colibri_expert_kind_t kind, int32_t hidden_size, int32_t intermediate_size,
                              int32_t scale_block_n, int32_t scale_block_k) {
    if (hidden_size < 1 || intermediate_size < 1 || scale_block_n < 0 || scale_block_k < 0) return 0;
    const int32_t H = hidden_size, F = intermediate_size, bn = scale_block_n, bk = scale_block_k;
    const uint64_t first = (uint64_t)colibri_scale_blocks(F, bn) * (uint64_t)colibri_scale_blocks(H, bk);
    switch (kind) {
    case COLIBRI_EXPERT_SWIGLU:
        return 2 * first + (uint64_t)colibri_scale_blocks(H, bn) * (uint64_t)colibri_scale_blocks(F, bk);
    case COLIBRI_EXPERT_LINEAR: return first;
    }
    return 0;
}

colibri_status_t colibri_check_routing(const colibri_moe_context_t *ctx, int64_t num_tokens, const int32_t *topk_ids,
                                       const float *topk_weights, const char *who) {
    const int64_t n = num_tokens * ctx->cfg.top_k;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = topk_ids[i];
        if (id < 0 || id >= ctx->cfg.num_experts)
            return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT,
                                     "%s topk_ids[%lld, %lld] = %d is out of range [0, %d)", who,
                                     (long long)(i / ctx->cfg.top_k), (long long)(i % ctx->cfg.top_k), id,
                                     ctx->cfg.num_experts);
        if (!isfinite(topk_weights[i]))
            return colibri_set_error(COLIBRI_ERR_INVALID_ARGUMENT, "%s topk_weights[%lld, %lld] is not finite (%g)",
                                     who, (long long)(i / ctx->cfg.top_k), (long long)(i % ctx->cfg.top_k),
                                     (double)topk_weights[i]);
    }
    return COLIBRI_OK;
}

/* Non-finite iff the magnitude bits reach the all-ones exponent: a max over masked words, which the
 * compiler vectorises; blocks of a fixed size keep the inner loop free of a remainder. */
#define NONFINITE_BLOCK 65536

#define DEFINE_BLOCK_BAD(name, type, mask, limit)                                   \
    static int name(const type *p, uint64_t n) {                                   \
        type m = 0;                                                                \
        if (n == NONFINITE_BLOCK) {                                                \
            for (uint64_t i = 0; i < NONFINITE_BLOCK; i++) {                       \
                const type v = (type)(p[i] & (mask));                              \
                m = v > m ? v : m;                                                 \
            }                                                                      \
        } else {                                                                   \
            for (uint64_t i = 0; i < n; i++) {                                     \
                const type v = (type)(p[i] & (mask));                              \
                m = v > m ? v : m;                                                 \
            }                                                                      \
        }                                                                          \
        return m >= (limit);                                                       \
    }
DEFINE_BLOCK_BAD(block_bad_f32, uint32_t, 0x7fffffffu, 0x7f800000u)
DEFINE_BLOCK_BAD(block_bad_f16, uint16_t, 0x7fff, 0x7c00)
DEFINE_BLOCK_BAD(block_bad_bf16, uint16_t, 0x7fff, 0x7f80)
DEFINE_BLOCK_BAD(block_bad_f8e4m3, uint8_t, 0x7f, 0x7f)

static int block_bad(colibri_dtype_t dtype, const char *p, uint64_t n) {
    switch (dtype) {
    case COLIBRI_DTYPE_F32: return block_bad_f32((const uint32_t *)(const void *)p, n);
    case COLIBRI_DTYPE_F16: return block_bad_f16((const uint16_t *)(const void *)p, n);
    case COLIBRI_DTYPE_BF16: return block_bad_bf16((const uint16_t *)(const void *)p, n);
    case COLIBRI_DTYPE_F8E4M3: return block_bad_f8e4m3((const uint8_t *)p, n);
    }
    return 0;
}

uint64_t colibri_first_nonfinite(colibri_dtype_t dtype, const void *weights, uint64_t n) {
    const size_t size = colibri_dtype_size(dtype);
    if (!weights || size == 0 || n == 0) return n;
    const char *base = (const char *)weights;
    const int64_t blocks = (int64_t)((n + NONFINITE_BLOCK - 1) / NONFINITE_BLOCK);
    int64_t first = blocks;
    /* the whole pass in parallel (all finite is the case to make fast), then the first bad block alone */
#pragma omp parallel for schedule(static) reduction(min : first) if (blocks > 8)
    for (int64_t b = 0; b < blocks; b++) {
        const uint64_t at = (uint64_t)b * NONFINITE_BLOCK, len = n - at < NONFINITE_BLOCK ? n - at : NONFINITE_BLOCK;
        /* unaligned buffers (a caller's, or a file's) are read a word at a time through a copy */
        if (((uintptr_t)(base + at * size) % size) == 0) {
            if (block_bad(dtype, base + at * size, len) && b < first) first = b;
        } else {
            for (uint64_t i = 0; i < len; i++) {
                uint32_t word = 0;
                memcpy(&word, base + (at + i) * size, size);
                if (block_bad(dtype, (const char *)&word, 1) && b < first) { first = b; break; }
            }
        }
    }
    if (first == blocks) return n;
    const uint64_t at = (uint64_t)first * NONFINITE_BLOCK;
    for (uint64_t i = at; i < n; i++) {
        uint32_t word = 0;
        memcpy(&word, base + i * size, size);
        if (block_bad(dtype, (const char *)&word, 1)) return i;
    }
    return n; /* not reached: the block held one */
}
