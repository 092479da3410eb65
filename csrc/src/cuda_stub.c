/*
 * cuda_stub.c — stands in for the CUDA backend when the library is built without nvcc, so that a
 * CUDA context is refused with a clear message instead of failing to link. It answers supports as the
 * CUDA backend does (the same layers refused the same way), and refuses the rest at init.
 */
#include "cuda/cuda_supports.h"
#include "internal.h"

static colibri_status_t not_built(void) {
    return colibri_set_error(COLIBRI_ERR_UNSUPPORTED,
                             "this libcolibri was built without the CUDA backend (nvcc was not found or CUDA=0); "
                             "rebuild with nvcc on the PATH or use device CPU");
}

static colibri_status_t stub_init(colibri_moe_context_t *ctx, const void *w, const uint64_t *off) {
    (void)ctx; (void)w; (void)off;
    return not_built();
}

static colibri_status_t stub_forward(colibri_moe_context_t *ctx, int64_t n, colibri_dtype_t a, const void *in,
                                     const int32_t *ids, const float *wts, void *out, void *stream) {
    (void)ctx; (void)n; (void)a; (void)in; (void)ids; (void)wts; (void)out; (void)stream;
    return not_built();
}

static colibri_status_t stub_route(colibri_moe_context_t *ctx, int64_t n, colibri_dtype_t a, const void *in,
                                   int32_t *ids, float *wts, void *stream) {
    (void)ctx; (void)n; (void)a; (void)in; (void)ids; (void)wts; (void)stream;
    return not_built();
}

static colibri_status_t stub_expert_counts(colibri_moe_context_t *ctx, uint64_t *counts, int32_t reset) {
    (void)ctx; (void)counts; (void)reset;
    return not_built();
}

static colibri_status_t stub_take_device_error(colibri_moe_context_t *ctx) { (void)ctx; return not_built(); }
static void stub_destroy(colibri_moe_context_t *ctx) { (void)ctx; }
const colibri_backend_t colibri_cuda_backend = {
    "cuda (not built)", 0, colibri_cuda_supports, stub_init, stub_forward, stub_route, stub_expert_counts,
    stub_take_device_error, stub_destroy,
};

int32_t colibri_cuda_built_impl(void) { return 0; }
int32_t colibri_cuda_device_count_impl(void) { return 0; }
