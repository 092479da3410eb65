/*
 * check_fp8_decode.cu — every e4m3 code, and every pair of codes, widened by dtype.cuh's to_f32 and
 * f8x2_to_f32 against the exact value computed here (NaN stays NaN). Before sm_89 those are dtype.cuh's own
 * bit moves, from sm_89 on the hardware cvt: test-cuda runs this as built for the library's images and
 * again from compute_80 PTX alone, which a newer GPU compiles for itself, so one GPU checks both.
 */
#include <math.h>
#include <stdio.h>

#include "dtype.cuh"

static double e4m3(unsigned b) {
    const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return s ? -v : v;
}

/* out[2 w], out[2 w + 1]: the two codes of 16-bit word w by f8x2_to_f32; one[c]: code c by to_f32 */
__global__ void decode(float *out, float *one) {
    const unsigned w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= 65536u) return;
    const float2 f = f8x2_to_f32((__nv_fp8x2_storage_t)w);
    out[2 * w] = f.x;
    out[2 * w + 1] = f.y;
    if (w < 256u) {
        F8E4M3 q;
        q.bits = (__nv_fp8_storage_t)w;
        one[w] = to_f32(q);
    }
}

static bool same(double want, float got) { return isnan(want) ? isnan(got) : (double)got == want; }

int main(void) {
    float *d_out, *d_one;
    static float out[2 * 65536], one[256];
    if (cudaMalloc(&d_out, sizeof out) != cudaSuccess || cudaMalloc(&d_one, sizeof one) != cudaSuccess) {
        fprintf(stderr, "check_fp8_decode: no GPU memory\n");
        return 2;
    }
    decode<<<256, 256>>>(d_out, d_one);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) e = cudaMemcpy(one, d_one, sizeof one, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        fprintf(stderr, "check_fp8_decode: %s\n", cudaGetErrorString(e));
        return 2;
    }
    int failures = 0;
    for (unsigned w = 0; w < 65536u; w++)
        for (int i = 0; i < 2; i++) {
            const double want = e4m3((w >> (8 * i)) & 255u);
            if (!same(want, out[2 * w + i]) && failures++ < 10)
                printf("FAIL f8x2_to_f32(0x%04x).%c = %.9g, expected %.9g\n", w, i ? 'y' : 'x', out[2 * w + i], want);
        }
    for (unsigned c = 0; c < 256u; c++)
        if (!same(e4m3(c), one[c]) && failures++ < 10)
            printf("FAIL to_f32(0x%02x) = %.9g, expected %.9g\n", c, one[c], e4m3(c));
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("check_fp8_decode (sm_%d%d device): 131328 conversions, %d failed\n", p.major, p.minor, failures);
    return failures ? 1 : 0;
}
