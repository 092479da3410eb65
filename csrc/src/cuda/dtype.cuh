/*
 * dtype.cuh — the CUDA backend's dtypes in one place: the C++ type of each colibri_dtype_t and the
 * dispatch to it, the fp8 weight type, the compute type of each weight type (its facts: ../dtype.h),
 * conversions to and from fp32 and the vector loads the kernels share. A new weight dtype starts here.
 */
#ifndef COLIBRI_CUDA_DTYPE_CUH
#define COLIBRI_CUDA_DTYPE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "colibri.h"
#include "dtype.h"

template <class T> struct DtypeTag { using type = T; };

/* Calls f(DtypeTag<T>{}) with T the C++ type of dtype d. */
template <class F> static inline void colibri_dispatch_dtype(colibri_dtype_t d, F &&f) {
    switch (d) {
    case COLIBRI_DTYPE_F32: f(DtypeTag<float>{}); break;
    case COLIBRI_DTYPE_F16: f(DtypeTag<__half>{}); break;
    case COLIBRI_DTYPE_BF16: f(DtypeTag<__nv_bfloat16>{}); break;
    }
}

/* An fp8 e4m3 weight (OCP e4m3fn: S.1111.111 is NaN), as the packed checkpoint stores it: a type of its
 * own, so that no overload takes it for an integer. Weights only: nothing is ever stored in it. */
struct F8E4M3 {
    __nv_fp8_storage_t bits;
};

/* Calls f(DtypeTag<T>{}) with T the C++ type of weight dtype d: colibri_dispatch_dtype's and F8E4M3. */
template <class F> static inline void colibri_dispatch_weight_dtype(colibri_dtype_t d, F &&f) {
    if (d == COLIBRI_DTYPE_F8E4M3) f(DtypeTag<F8E4M3>{});
    else colibri_dispatch_dtype(d, f);
}

/* The dtype experts of weights TW compute and store in (inter, y, the tensor cores' x): TW itself, bf16
 * for fp8 (e4m3 values are exact in bf16, and the 16-bit kernels take bf16). */
template <class TW> struct ComputeOf { using type = TW; };
template <> struct ComputeOf<F8E4M3> { using type = __nv_bfloat16; };
template <class TW> using compute_t = typename ComputeOf<TW>::type;
static inline colibri_dtype_t colibri_cuda_compute_dtype(const colibri_moe_config_t *c) {
    return colibri_dtype_info(c->weight_dtype).compute;
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
/* Before sm_89 cuda_fp8.h converts e4m3 in general-purpose code that made the fp8 units' sm_80 image 8x
 * longer to compile than sm_90a's. e4m3 is fp16 with 3 fewer exponent bits: the 7 magnitude bits moved
 * under fp16's and scaled by 2^8 give the same value, subnormals included (fp16 keeps subnormals); NaN
 * (S.1111.111, which would land on 480) is set apart. Two codes: the lower byte goes to .x. */
__device__ __forceinline__ __half2 e4m3x2_to_half2(uint32_t v) {
    const uint32_t w = __byte_perm(v, 0u, 0x1404); /* each 16-bit half: its code << 8 */
    uint32_t h = (w & 0x80008000u) | ((w & 0x7F007F00u) >> 1);
    if ((w & 0x00007F00u) == 0x00007F00u) h |= 0x00007E00u;
    if ((w & 0x7F000000u) == 0x7F000000u) h |= 0x7E000000u;
    return __hmul2(*reinterpret_cast<const __half2 *>(&h), __half2(__half(256.0f), __half(256.0f)));
}
__device__ __forceinline__ float to_f32(F8E4M3 v) { return __low2float(e4m3x2_to_half2(v.bits)); }
__device__ __forceinline__ float2 f8x2_to_f32(__nv_fp8x2_storage_t v) { return __half22float2(e4m3x2_to_half2(v)); }
#else
/* e4m3 -> fp16 is exact: one cvt.f16x2.e4m3x2 from sm_89 on (the lower address in .x); NaN stays NaN */
__device__ __forceinline__ float to_f32(F8E4M3 v) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E4M3)));
}
__device__ __forceinline__ float2 f8x2_to_f32(__nv_fp8x2_storage_t v) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3)));
}
#endif

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <class T, int N> struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Pack {
    T v[N];
};

/* N elements from p, which is aligned to min(16, N * sizeof(T)) bytes, widened to fp32. */
template <class T, int N> __device__ __forceinline__ void load_f32(const T *p, float (&out)[N]) {
    const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N> *>(p);
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = to_f32(pk.v[i]);
}

template <class T, int N> __device__ __forceinline__ void store_from_f32(T *p, const float (&in)[N]) {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; i++) pk.v[i] = from_f32<T>(in[i]);
    *reinterpret_cast<Pack<T, N> *>(p) = pk;
}

/* Weights are read once per forward: keep them out of L1 so the activations that are re-read stay. */
template <class T, int N> __device__ __forceinline__ Pack<T, N> load_stream(const T *p) {
    if constexpr (sizeof(Pack<T, N>) == 16) {
        uint4 u;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                     : "l"(p));
        return *reinterpret_cast<Pack<T, N> *>(&u);
    } else {
        return *reinterpret_cast<const Pack<T, N> *>(p);
    }
}

/* N fp8 weights to fp32, in pairs where N is even. */
template <int N> __device__ __forceinline__ void f8_to_f32(const Pack<F8E4M3, N> &p, float (&out)[N]) {
    if constexpr (N % 2 == 0) {
        const __nv_fp8x2_storage_t *q = reinterpret_cast<const __nv_fp8x2_storage_t *>(&p);
#pragma unroll
        for (int i = 0; i < N / 2; i++) {
            const float2 f = f8x2_to_f32(q[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) out[i] = to_f32(p.v[i]);
    }
}

/* Whether weight type TW is fp8 (scaled: the kernels take a ScaleGrid and widen 16 weights a load). */
template <class TW> constexpr bool is_fp8 = std::is_same<TW, F8E4M3>::value;

/* What K must be a multiple of for the 16-byte weight loads of weight dtype d (dtype.h) */
static inline int colibri_cuda_vec_multiple(colibri_dtype_t d) { return colibri_dtype_info(d).vec_k; }

#endif /* COLIBRI_CUDA_DTYPE_CUH */
