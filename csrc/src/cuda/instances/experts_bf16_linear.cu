/* experts_bf16_linear.cu — the expert kernels of bf16 weights with ActLinear (LINEAR layers, every down
 * projection and the folded combine); one compilation unit of experts_project.cuh (experts_instances.cuh
 * says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<__nv_bfloat16, float, ActLinear>;
template struct ExpertProjection<__nv_bfloat16, __half, ActLinear>;
template struct ExpertProjection<__nv_bfloat16, __nv_bfloat16, ActLinear>;
template struct ExpertCombine<__nv_bfloat16, float>;
template struct ExpertCombine<__nv_bfloat16, __half>;
template struct ExpertCombine<__nv_bfloat16, __nv_bfloat16>;
template struct MmaSetup<__nv_bfloat16, ActLinear>;
template struct WgmmaSetup<__nv_bfloat16, ActLinear>;
template struct Mma16Occupancy<ActLinear, MMA_BN>;
template struct Mma16Occupancy<ActLinear, MMA_NARROW_BN>;
