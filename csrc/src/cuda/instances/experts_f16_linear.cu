/* experts_f16_linear.cu — the expert kernels of fp16 weights with ActLinear (LINEAR layers, every down
 * projection and the folded combine); one compilation unit of experts_project.cuh (experts_instances.cuh
 * says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<__half, float, ActLinear>;
template struct ExpertProjection<__half, __half, ActLinear>;
template struct ExpertProjection<__half, __nv_bfloat16, ActLinear>;
template struct ExpertCombine<__half, float>;
template struct ExpertCombine<__half, __half>;
template struct ExpertCombine<__half, __nv_bfloat16>;
template struct MmaSetup<__half, ActLinear>;
template struct WgmmaSetup<__half, ActLinear>;
