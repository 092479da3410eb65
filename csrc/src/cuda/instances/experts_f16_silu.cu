/* experts_f16_silu.cu — the expert kernels of fp16 weights with ActSilu (the SwiGLU first projection); one
 * compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<__half, float, ActSilu>;
template struct ExpertProjection<__half, __half, ActSilu>;
template struct ExpertProjection<__half, __nv_bfloat16, ActSilu>;
template struct MmaSetup<__half, ActSilu>;
template struct WgmmaSetup<__half, ActSilu>;
