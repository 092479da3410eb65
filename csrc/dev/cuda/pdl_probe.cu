/*
 * pdl_probe.cu — how long after a kernel's last block exits does a programmatic dependent's
 * griddepcontrol.wait return, against a flag the primary's last block sets with release semantics?
 * (NOTES.md v20). Not part of the library; built and run on the GPU machine:
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o pdl_probe csrc/dev/cuda/pdl_probe.cu
 *   ./pdl_probe [reps]
 *
 * A: `blocks_a` blocks that trigger their dependents at once, spin about `work_ns`, count themselves
 *    done; the last one sets a flag (st.release.gpu) and every block stamps its exit (%globaltimer).
 * B: launched with programmatic stream serialization; every block's thread 0 spins on the flag
 *    (ld.acquire.gpu), stamps that, then griddepcontrol.wait and stamps that; then it counts itself done
 *    on a second counter and exits.
 * C: likewise after B, spinning on B's done counter reaching B's grid size.
 * Per replay: flag seen - flag set and wait return - last exit (A -> B), and the same for B -> C; medians
 * over `reps` replays of a captured graph (the host zeroes the counters and stamps before each), ns.
 */
#include "probe_check.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

struct Sync {
    unsigned count_a, flag_a, count_b;
    unsigned long long flag_set, last_exit_a, last_exit_b;       /* max over blocks */
    unsigned long long seen_b, wait_b, seen_c, wait_c;           /* min over blocks */
};

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(unsigned *p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void spin_ns(unsigned ns) {
    const unsigned long long t0 = now();
    while (now() - t0 < ns) {
    }
}

__global__ void kernel_a(Sync *s, unsigned work_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    spin_ns(work_ns);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned done = atomicAdd(&s->count_a, 1u);
        if (done == gridDim.x - 1) {
            __threadfence();
            atomicMax(&s->flag_set, now());
            st_release(&s->flag_a, 1u);
        }
        atomicMax(&s->last_exit_a, now());
    }
}

__global__ void kernel_b(Sync *s, unsigned work_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
        while (ld_acquire(&s->flag_a) == 0) {
        }
        atomicMin(&s->seen_b, now());
        asm volatile("griddepcontrol.wait;" ::: "memory");
        atomicMin(&s->wait_b, now());
    }
    __syncthreads();
    spin_ns(work_ns);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&s->count_b, 1u);
        atomicMax(&s->last_exit_b, now());
    }
}

__global__ void kernel_c(Sync *s, unsigned blocks_b) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
        while (ld_acquire(&s->count_b) < blocks_b) {
        }
        atomicMin(&s->seen_c, now());
        asm volatile("griddepcontrol.wait;" ::: "memory");
        atomicMin(&s->wait_c, now());
    }
}

template <class K, class... Args> static void launch_pdl(K kernel, int blocks, cudaStream_t st, Args... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 50;
    Sync *s;
    CHECK(cudaMalloc(&s, sizeof(Sync)));
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    printf("%8s %8s %8s | %14s %14s | %14s %14s  (ns, medians of %d)\n", "blocksA", "blocksB", "work", "A->B flag",
           "A->B wait", "B->C count", "B->C wait", reps);
    for (int blocks_a : {16, 132}) {
        for (int blocks_b : {132, 396}) {
            for (unsigned work : {2000u, 10000u}) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                launch_pdl(kernel_a, blocks_a, st, s, work);
                launch_pdl(kernel_b, blocks_b, st, s, work);
                launch_pdl(kernel_c, 132, st, s, (unsigned)blocks_b);
                CHECK(cudaStreamEndCapture(st, &g));
                CHECK(cudaGraphInstantiate(&ge, g, 0));
                std::vector<long long> fa, wa, fb, wb;
                for (int r = 0; r < reps + 3; r++) {
                    Sync h = {};
                    h.seen_b = h.wait_b = h.seen_c = h.wait_c = ~0ull;
                    CHECK(cudaMemcpyAsync(s, &h, sizeof h, cudaMemcpyHostToDevice, st));
                    CHECK(cudaGraphLaunch(ge, st));
                    CHECK(cudaMemcpyAsync(&h, s, sizeof h, cudaMemcpyDeviceToHost, st));
                    CHECK(cudaStreamSynchronize(st));
                    if (r < 3) continue;
                    fa.push_back((long long)(h.seen_b - h.flag_set));
                    wa.push_back((long long)(h.wait_b - h.last_exit_a));
                    fb.push_back((long long)(h.seen_c - h.last_exit_b));
                    wb.push_back((long long)(h.wait_c - h.last_exit_b));
                }
                auto med = [](std::vector<long long> v) {
                    std::sort(v.begin(), v.end());
                    return v[v.size() / 2];
                };
                printf("%8d %8d %8u | %14lld %14lld | %14lld %14lld\n", blocks_a, blocks_b, work, med(fa), med(wa),
                       med(fb), med(wb));
                CHECK(cudaGraphExecDestroy(ge));
                CHECK(cudaGraphDestroy(g));
            }
        }
    }
    return 0;
}
