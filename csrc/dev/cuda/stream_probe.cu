/*
 * stream_probe.cu — how fast can the touched experts' weights of a decode forward be read at all?
 * (NOTES.md v20). Not part of the library: a standalone probe, built and run on the GPU machine:
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o stream_probe csrc/dev/cuda/stream_probe.cu
 *   ./stream_probe [reps]
 *
 * For each decode row of bench_gpu.py (the experts it touched there: Mixtral T=1, 4; DeepSeek and Qwen
 * T=1, 4), the touched experts' whole weights (gate, up, down: 3 F H bf16 each, at their place in one
 * allocation of E experts, as the library keeps them) read by one plain streaming kernel (16-byte
 * chunks, grid-stride, 8 loads in flight per thread, 2 blocks of 256 per SM): the least time any
 * forward that reads those bytes once could take, routing aside. Timed by CUDA events around the launch
 * after an L2 flush, median of `reps`, two ways:
 *  - zero: a 512 MB memset, as bench_gpu.py's Timer does; L2 is then full of dirty lines, which the
 *    timed kernel's reads evict, writing them back to HBM beside its own reads;
 *  - read: a kernel that reads 512 MB; L2 is then full of clean lines.
 * Also gemv.cuh's direct-mode walk of the up projection (rows_kernel) against the plain read of the same
 * bytes, and an empty kernel (what the events see around a launch).
 */
#include "probe_check.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

struct Regions {
    const uint4 *base[32];
    long long chunks; /* 16-byte chunks per region */
    int n;
};

template <int U> __global__ void flat_kernel(Regions r, unsigned *sink) {
    const long long total = r.chunks * r.n, stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i0 < total; i0 += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            long long i = i0 + u * stride;
            if (i >= total) i = i0;
            const int reg = (int)(i / r.chunks);
            v[u] = __ldcs(r.base[reg] + (i - reg * r.chunks));
        }
#pragma unroll
        for (int u = 0; u < U; u++) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

/* gemv.cuh's GLU walk at one token: expert blockIdx.x, rows n = 8 (blockIdx.y + i gridDim.y) + warp */
__global__ void rows_kernel(Regions r, int rows, int k, long long second, unsigned *sink) {
    const int lane = threadIdx.x & 31;
    const char *e = reinterpret_cast<const char *>(r.base[blockIdx.x]);
    unsigned acc = 0;
    for (int n = blockIdx.y * 8 + (threadIdx.x >> 5); n < rows; n += gridDim.y * 8) {
        const uint4 *g = reinterpret_cast<const uint4 *>(e + (size_t)n * k * 2);
        const uint4 *u = reinterpret_cast<const uint4 *>(e + second + (size_t)n * k * 2);
        const int steps = k * 2 / 512;
        for (int s0 = 0; s0 < steps; s0 += 4) {
            uint4 a[4], b[4];
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const int c = (s0 + s < steps ? s0 + s : s0) * 32 + lane;
                a[s] = __ldcs(g + c);
                b[s] = __ldcs(u + c);
            }
#pragma unroll
            for (int s = 0; s < 4; s++) acc += (a[s].x ^ b[s].y) + (a[s].z ^ b[s].w);
        }
    }
    if (acc == 0x12345678u) *sink = acc;
}

__global__ void empty_kernel() {}

__global__ void read_flush_kernel(const uint4 *p, long long n, unsigned *sink) {
    unsigned acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = __ldcg(p + i);
        acc += v.x ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

struct Shape {
    const char *name;
    int E, H, F;
    int touched[2]; /* experts bench_gpu.py touched at T = 1 and 4 */
};

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 30;
    const Shape shapes[3] = {{"Mixtral", 8, 4096, 14336, {2, 6}},
                             {"DeepSeek", 64, 2048, 1408, {6, 22}},
                             {"Qwen", 60, 2048, 1408, {4, 14}}};
    size_t wbytes = 0;
    for (const Shape &sh : shapes) wbytes = std::max(wbytes, (size_t)sh.E * 3 * sh.F * sh.H * 2);
    char *w, *flush;
    unsigned *sink;
    const size_t flush_bytes = 512u << 20;
    CHECK(cudaMalloc(&w, wbytes));
    CHECK(cudaMalloc(&flush, flush_bytes));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(w, 1, wbytes));
    CHECK(cudaMemset(flush, 3, flush_bytes));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));

    /* median us of launch() after each flush */
    auto timeit = [&](bool read_flush, auto launch) {
        std::vector<float> ts;
        for (int i = 0; i < reps + 3; i++) {
            if (read_flush) read_flush_kernel<<<sms * 4, 256>>>(reinterpret_cast<const uint4 *>(flush),
                                                               (long long)(flush_bytes / 16), sink);
            else CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
            CHECK(cudaEventRecord(a));
            launch();
            CHECK(cudaEventRecord(b));
            CHECK(cudaEventSynchronize(b));
            CHECK(cudaGetLastError());
            float ms;
            CHECK(cudaEventElapsedTime(&ms, a, b));
            if (i >= 3) ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        return ts[ts.size() / 2] * 1e3;
    };

    printf("%-34s %10s %10s %14s %14s\n", "what", "MB", "zero us", "read us", "TB/s zero/read");
    const double e0 = timeit(false, [&] { empty_kernel<<<1, 32>>>(); });
    const double e1 = timeit(true, [&] { empty_kernel<<<1, 32>>>(); });
    printf("%-34s %10.1f %10.1f %14.1f\n", "empty kernel", 0.0, e0, e1);
    for (const Shape &sh : shapes) {
        const size_t mat = (size_t)sh.F * sh.H * 2, expert = 3 * mat;
        for (int ti = 0; ti < 2; ti++) {
            const int ne = sh.touched[ti];
            /* the touched experts spread over the allocation, as a router's picks are */
            Regions all = {}, up = {};
            all.n = up.n = ne;
            all.chunks = (long long)(expert / 16);
            up.chunks = (long long)(2 * mat / 16);
            for (int i = 0; i < ne; i++) {
                const size_t e = (size_t)((i * 2 + 1) * sh.E / (2 * ne));
                all.base[i] = up.base[i] = reinterpret_cast<const uint4 *>(w + e * expert);
            }
            char name[96];
            const double mb = ne * (double)expert / 1e6;
            const double tz = timeit(false, [&] { flat_kernel<8><<<sms * 2, 256>>>(all, sink); });
            const double tr = timeit(true, [&] { flat_kernel<8><<<sms * 2, 256>>>(all, sink); });
            snprintf(name, sizeof name, "%s T=%d: %d experts, all", sh.name, ti ? 4 : 1, ne);
            printf("%-34s %10.1f %10.1f %14.1f %7.2f/%.2f\n", name, mb, tz, tr, mb / tz, mb / tr);
            if (sh.F == 1408 && ti == 0) {
                const double mu = ne * 2.0 * mat / 1e6;
                const int rb = 3 * sms / ne;
                const double fz = timeit(false, [&] { flat_kernel<8><<<sms * 2, 256>>>(up, sink); });
                const double fr = timeit(true, [&] { flat_kernel<8><<<sms * 2, 256>>>(up, sink); });
                snprintf(name, sizeof name, "%s T=1: up, plain read", sh.name);
                printf("%-34s %10.1f %10.1f %14.1f %7.2f/%.2f\n", name, mu, fz, fr, mu / fz, mu / fr);
                const double rz = timeit(false, [&] { rows_kernel<<<dim3(ne, rb), 256>>>(up, sh.F, sh.H, (long long)mat, sink); });
                const double rr = timeit(true, [&] { rows_kernel<<<dim3(ne, rb), 256>>>(up, sh.F, sh.H, (long long)mat, sink); });
                snprintf(name, sizeof name, "%s T=1: up, gemv walk", sh.name);
                printf("%-34s %10.1f %10.1f %14.1f %7.2f/%.2f\n", name, mu, rz, rr, mu / rz, mu / rr);
            }
        }
    }
    {
        Regions all = {};
        all.n = 1;
        all.base[0] = reinterpret_cast<const uint4 *>(w);
        all.chunks = (long long)(wbytes / 16);
        const double tz = timeit(false, [&] { flat_kernel<8><<<sms * 2, 256>>>(all, sink); });
        const double tr = timeit(true, [&] { flat_kernel<8><<<sms * 2, 256>>>(all, sink); });
        printf("%-34s %10.1f %10.1f %14.1f %7.2f/%.2f\n", "whole allocation", wbytes / 1e6, tz, tr, wbytes / 1e6 / tz,
               wbytes / 1e6 / tr);
    }
    return 0;
}
