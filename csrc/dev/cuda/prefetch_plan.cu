/*
 * prefetch_plan.cu — prints the L2 prefetch plan (experts.cu, colibri_cuda_prefetch_plan) of the bench
 * shapes: what the forward fetches into L2 during the routing (NOTES.md, v11).
 *   make lib && nvcc -O2 -std=c++17 -Icsrc/include -Icsrc/src -Xcompiler -fopenmp -o build/prefetch_plan \
 *        csrc/dev/cuda/prefetch_plan.cu build/libcolibri.a -lgomp && build/prefetch_plan
 *
 * With a GPU, the backend fields the plan reads come from colibri_cuda_experts_setup on device 0; without
 * one, from an H200 (132 SMs, sm_90a image): the 16-row kernels' occupancy worked out from their shared
 * memory and ptxas's registers (nvcc 13), as the query at setup would give it. The budget is the one the
 * library was built with (COLIBRI_PREFETCH_BYTES).
 */
#include <stdio.h>
#include <string.h>

#include "cuda/cuda_backend.cuh"

int main(void) {
    CudaBackend b = {};
    int devices = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
        if (colibri_cuda_experts_setup(&b) != COLIBRI_OK) {
            fprintf(stderr, "prefetch_plan: experts setup failed: %s\n", colibri_last_error());
            return 1;
        }
    } else {
        b.sm_count = 132;
        b.wgmma = b.mma_wide_k = b.mma_long_k = b.l2_prefetch = true;
        /* [GLU][narrow][long K]: the smaller of the blocks that 228 KB of shared memory (1 KB reserved per
         * block) and 64 K registers hold: GLU 16 x 128 BK=64 (3 stages, 102 KB; 86 registers) 2, BK=128
         * (204 KB) 1, narrow BK=64 (4 stages, 72 KB) 3, narrow BK=128 (108 KB) 2; linear 3, 2, 5, 3. */
        const int per_sm[2][2][2] = {{{3, 2}, {5, 3}}, {{2, 1}, {3, 2}}};
        memcpy(b.mma16_blocks_per_sm, per_sm, sizeof per_sm);
    }
    struct Shape {
        const char *name;
        int E, k, H, F;
    } shapes[] = {{"Mixtral-8x7B", 8, 2, 4096, 14336}, {"DeepSeek-V2-Lite", 64, 6, 2048, 1408},
                  {"Qwen1.5-MoE", 60, 4, 2048, 1408}};
    const int64_t tokens[] = {4, 16, 64, 256, 1024};
    printf("%d SMs\n| shape | T | tile_m | experts | rows | bytes of a row | MB |\n|---|---|---|---|---|---|---|\n",
           b.sm_count);
    for (const Shape &s : shapes) {
        colibri_moe_context_t ctx = {};
        ctx.cfg.expert_kind = COLIBRI_EXPERT_SWIGLU;
        ctx.cfg.weight_dtype = COLIBRI_DTYPE_BF16;
        ctx.cfg.num_experts = s.E;
        ctx.cfg.top_k = s.k;
        ctx.cfg.hidden_size = s.H;
        ctx.cfg.intermediate_size = s.F;
        ctx.backend = &b;
        for (int64_t T : tokens) {
            const int32_t tile_m = colibri_cuda_experts_tile_m(&ctx, T, COLIBRI_DTYPE_BF16, NULL);
            const PrefetchPlan p = colibri_cuda_prefetch_plan(&ctx, T, tile_m);
            const double mb = (double)p.experts * p.matrices * p.rows * p.bytes / (1 << 20);
            printf("| %s | %lld | %d | %d | %d | %u | %.1f |\n", s.name, (long long)T, tile_m, p.experts, p.rows,
                   p.bytes, mb);
        }
    }
    return 0;
}
