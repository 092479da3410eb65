/* experts_fp8_oai.cu — the expert kernels of fp8 weights with ActOai (the clamped SwiGLU first projection
 * of gpt-oss); one compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<F8E4M3, float, ActOai>;
template struct ExpertProjection<F8E4M3, __half, ActOai>;
template struct ExpertProjection<F8E4M3, __nv_bfloat16, ActOai>;
template struct MmaSetup<F8E4M3, ActOai>;
