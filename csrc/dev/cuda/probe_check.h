/* probe_check.h — CHECK(call) for the standalone probes beside it (stream_probe.cu, pdl_probe.cu): a
 * failing CUDA runtime call prints where and why, and ends the probe. */
#ifndef COLIBRI_PROBE_CHECK_H
#define COLIBRI_PROBE_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                                                   \
    do {                                                                                                           \
        cudaError_t e_ = (x);                                                                                      \
        if (e_ != cudaSuccess) {                                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                     \
            exit(1);                                                                                               \
        }                                                                                                          \
    } while (0)

#endif /* COLIBRI_PROBE_CHECK_H */
