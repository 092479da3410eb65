/* experts_bf16_silu.cu — the expert kernels of bf16 weights with ActSilu (the SwiGLU first projection); one
 * compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<__nv_bfloat16, float, ActSilu>;
template struct ExpertProjection<__nv_bfloat16, __half, ActSilu>;
template struct ExpertProjection<__nv_bfloat16, __nv_bfloat16, ActSilu>;
template struct MmaSetup<__nv_bfloat16, ActSilu>;
template struct WgmmaSetup<__nv_bfloat16, ActSilu>;
template struct Mma16Occupancy<ActSilu, MMA_BN>;
template struct Mma16Occupancy<ActSilu, MMA_NARROW_BN>;
