/* experts_f32_oai.cu — the expert kernels of fp32 weights with ActOai (the clamped SwiGLU first projection
 * of gpt-oss): the gemv only (the tensor cores take 16-bit or fp8 weights); one compilation unit of
 * experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<float, float, ActOai>;
template struct ExpertProjection<float, __half, ActOai>;
template struct ExpertProjection<float, __nv_bfloat16, ActOai>;
