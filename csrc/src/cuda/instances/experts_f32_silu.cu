/* experts_f32_silu.cu — the expert kernels of fp32 weights with ActSilu (the SwiGLU first projection): the
 * gemv only (the tensor cores take 16-bit or fp8 weights); one compilation unit of experts_project.cuh
 * (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<float, float, ActSilu>;
template struct ExpertProjection<float, __half, ActSilu>;
template struct ExpertProjection<float, __nv_bfloat16, ActSilu>;
