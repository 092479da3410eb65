/* experts_fp8_linear.cu — the expert kernels of fp8 weights with ActLinear (LINEAR layers, every down
 * projection and the folded combine); one compilation unit of experts_project.cuh (experts_instances.cuh
 * says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<F8E4M3, float, ActLinear>;
template struct ExpertProjection<F8E4M3, __half, ActLinear>;
template struct ExpertProjection<F8E4M3, __nv_bfloat16, ActLinear>;
template struct ExpertCombine<F8E4M3, float>;
template struct ExpertCombine<F8E4M3, __half>;
template struct ExpertCombine<F8E4M3, __nv_bfloat16>;
template struct MmaSetup<F8E4M3, ActLinear>;
