/* experts_fp8_silu.cu — the expert kernels of fp8 weights with ActSilu (the SwiGLU first projection); one
 * compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<F8E4M3, float, ActSilu>;
template struct ExpertProjection<F8E4M3, __half, ActSilu>;
template struct ExpertProjection<F8E4M3, __nv_bfloat16, ActSilu>;
template struct MmaSetup<F8E4M3, ActSilu>;
