/*
 * dtype.h — the facts of each colibri_dtype_t in one table, read by the front end (colibri.c,
 * common.c), the CPU backend and the CUDA backend (cuda/dtype.cuh adds the C++ types): bytes, name,
 * whether activations may have it, whether it is a scaled fp8 weight dtype (expert_scales), the dtype
 * its experts compute in, and what K must be a multiple of for the 16-byte weight loads and for the
 * tensor-core tiles (0: the dtype has none; the few-token kernels serve it at every T). A new dtype is
 * a row here (and its arithmetic in each backend). Plain C99 that C++ compiles too.
 */
#ifndef COLIBRI_DTYPE_H
#define COLIBRI_DTYPE_H

#include <stddef.h>

#include "colibri.h"

/* X(dtype, name, bytes, activation, scaled, compute, vec_k, mma_k) */
#define COLIBRI_DTYPE_TABLE(X)                                                   \
    X(COLIBRI_DTYPE_F32, "fp32", 4, 1, 0, COLIBRI_DTYPE_F32, 8, 0)              \
    X(COLIBRI_DTYPE_F16, "fp16", 2, 1, 0, COLIBRI_DTYPE_F16, 8, 8)              \
    X(COLIBRI_DTYPE_BF16, "bf16", 2, 1, 0, COLIBRI_DTYPE_BF16, 8, 8)            \
    /* e4m3 values are exact in bf16, and the 16-bit kernels take bf16 */       \
    X(COLIBRI_DTYPE_F8E4M3, "fp8_e4m3", 1, 0, 1, COLIBRI_DTYPE_BF16, 16, 16)

typedef struct {
    const char *name;         /* as colibri.dtypes names it (Python), in messages */
    size_t size;              /* bytes of an element; 0: not a dtype */
    int activation;           /* activations (x, out) may have it; else weights only */
    int scaled;               /* fp8 weights with fp32 block scales (expert_scales) */
    colibri_dtype_t compute;  /* what experts of these weights compute and store in */
    int vec_k;                /* K a multiple of this: the weight rows allow 16-byte loads */
    int mma_k;                /* H and F multiples of this: the tensor-core tiles take it (0: none) */
} colibri_dtype_info_t;

static inline colibri_dtype_info_t colibri_dtype_info(colibri_dtype_t d) {
#define COLIBRI_DTYPE_CASE(dt, nm, sz, act, sc, cmp, vk, mk) \
    case dt: {                                               \
        colibri_dtype_info_t i = {nm, sz, act, sc, cmp, vk, mk}; \
        return i;                                        \
    }
    switch (d) { COLIBRI_DTYPE_TABLE(COLIBRI_DTYPE_CASE) }
#undef COLIBRI_DTYPE_CASE
    {
        colibri_dtype_info_t none = {"unknown", 0, 0, 0, d, 0, 0};
        return none;
    }
}

static inline int colibri_dtype_scaled(colibri_dtype_t d) { return colibri_dtype_info(d).scaled; }

#endif /* COLIBRI_DTYPE_H */
