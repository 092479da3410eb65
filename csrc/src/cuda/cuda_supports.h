/*
 * cuda_supports.h — the CUDA backend's answer to colibri_backend_t.supports: the layers its kernels do
 * not compute yet, refused rather than computed otherwise. Plain C, so that cuda_stub.c (a build
 * without nvcc) refuses the same layers with the same message.
 */
#ifndef COLIBRI_CUDA_SUPPORTS_H
#define COLIBRI_CUDA_SUPPORTS_H

#include "dtype.h"
#include "internal.h"

static inline colibri_status_t colibri_cuda_supports(const colibri_moe_config_t *c, const colibri_moe_weights_t *w) {
    const char *missing = NULL;
    (void)w;
    /* the warp top-k ranks the groups with one lane each */
    if (c->n_group > 32) missing = "group-limited routing with more than 32 groups";
    /* the fp8 kernels give 16 consecutive weights of a row one scale, found by a shift */
    else if (colibri_dtype_scaled(c->weight_dtype) && c->scale_block_k != 0 &&
             (c->scale_block_k < 16 || (c->scale_block_k & (c->scale_block_k - 1)) != 0))
        missing = "fp8 weights with a scale_block_k other than 0 or a power of two from 16 on";
    /* the shared slices take SiLU while the routed experts take the OAI tag: one tag per launch */
    else if (c->shared_intermediate_size > 0 && c->activation != COLIBRI_ACTIVATION_SILU)
        missing = "a shared expert beside the SWIGLU_OAI activation";
    if (!missing) return COLIBRI_OK;
    return colibri_set_error(COLIBRI_ERR_UNSUPPORTED, "the CUDA backend does not compute %s yet; "
                             "use the CPU backend for this layer", missing);
}

#endif /* COLIBRI_CUDA_SUPPORTS_H */
