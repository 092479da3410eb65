/* experts_bf16_oai.cu — the expert kernels of bf16 weights with ActOai (the clamped SwiGLU first projection
 * of gpt-oss); one compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<__nv_bfloat16, float, ActOai>;
template struct ExpertProjection<__nv_bfloat16, __half, ActOai>;
template struct ExpertProjection<__nv_bfloat16, __nv_bfloat16, ActOai>;
template struct MmaSetup<__nv_bfloat16, ActOai>;
template struct WgmmaSetup<__nv_bfloat16, ActOai>;
template struct Mma16Occupancy<ActOai, MMA_BN>;
template struct Mma16Occupancy<ActOai, MMA_NARROW_BN>;
