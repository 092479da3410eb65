/* experts_f32_linear.cu — the expert kernels of fp32 weights with ActLinear (LINEAR layers, every down
 * projection and the folded combine): the gemv only (the tensor cores take 16-bit or fp8 weights); one
 * compilation unit of experts_project.cuh (experts_instances.cuh says why). */
#include "../experts_project.cuh"

template struct ExpertProjection<float, float, ActLinear>;
template struct ExpertProjection<float, __half, ActLinear>;
template struct ExpertProjection<float, __nv_bfloat16, ActLinear>;
template struct ExpertCombine<float, float>;
template struct ExpertCombine<float, __half>;
template struct ExpertCombine<float, __nv_bfloat16>;
