/* experts_f16_oai.cu — the expert kernels of fp16 weights with ActOai (the clamped SwiGLU first projection
 * of gpt-oss); one compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<__half, float, ActOai>;
template struct ExpertProjection<__half, __half, ActOai>;
template struct ExpertProjection<__half, __nv_bfloat16, ActOai>;
template struct MmaSetup<__half, ActOai>;
template struct WgmmaSetup<__half, ActOai>;
