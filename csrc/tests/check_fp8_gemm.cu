/*
 * check_fp8_gemm.cu — the fp8 tensor-core kernels alone (fp8_quant.cuh, sm90_fp8_experts.cuh) against float64, on
 * tile tables built here: the quantisation per element, the projection against the dequantised
 * activations it was given (indexing, scales, epilogue: bf16 rounding only) and against the unquantised
 * ones (the fp8 activation error), outputs poisoned with NaN first. --bench times the Mixtral- and
 * DeepSeek-V3-shaped projections after a 512 MB read flush (median of 20).
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc/include \
 *        -Icsrc/src -Icsrc/src/cuda csrc/tests/check_fp8_gemm.cu -o check_fp8_gemm && ./check_fp8_gemm [--bench]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "sm90_fp8_experts.cuh"

/* the library's error function, which cuda_backend.cuh's check refers to */
extern "C" colibri_status_t colibri_set_error(colibri_status_t status, const char *, ...) { return status; }

#define CK(call)                                                                                          \
    do {                                                                                                  \
        cudaError_t e_ = (call);                                                                          \
        if (e_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));          \
            exit(2);                                                                                      \
        }                                                                                                 \
    } while (0)

static int failures = 0;

static double e4m3(uint8_t b) {
    const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return s ? -v : v;
}
static double bf16v(__nv_bfloat16 h) {
    uint16_t u;
    memcpy(&u, &h, 2);
    uint32_t f = (uint32_t)u << 16;
    float r;
    memcpy(&r, &f, 4);
    return r;
}

struct Case {
    const char *name;
    bool glu, oai, bias;
    int E, n, k, topk, T;
    int sbn, sbk;
    std::vector<int> counts; /* rows per expert */
};

template <class T> static T *dev(const std::vector<T> &h) {
    T *d = NULL;
    CK(cudaMalloc(&d, h.size() * sizeof(T) + 16));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

/* tiles of at most 128 rows over positions sorted by expert */
static std::vector<ExpertTile> tile_table(const std::vector<int> &counts) {
    std::vector<ExpertTile> t;
    int pos = 0;
    for (int e = 0; e < (int)counts.size(); e++) {
        for (int b = 0; b < counts[e]; b += F8_BM) t.push_back(ExpertTile{e, pos + b, pos + std::min(b + F8_BM, counts[e]), 0});
        pos += counts[e];
    }
    return t;
}

static void run_case(const Case &c, void *encode, int sms, std::mt19937_64 &rng) {
    const int E = c.E, n = c.n, k = c.k, rows_w = c.glu ? 2 * n : n, T = c.T;
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ud(0.5, 2.0);
    /* tokens: a few large ones and a zero row, so scales vary */
    std::vector<__nv_bfloat16> x((size_t)T * k);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < k; i++)
            x[(size_t)t * k + i] = __float2bfloat16((float)(t == 1 ? 0.0 : nd(rng) * (i % 97 == 0 ? 8.0 : 1.0)));
    /* weights: fp8 of normal values, random scales */
    std::vector<uint8_t> w((size_t)E * rows_w * k);
    for (auto &b : w) b = __nv_cvt_float_to_fp8((float)(nd(rng) * 64.0), __NV_SATFINITE, __NV_E4M3);
    const int gr = c.sbn ? (n + c.sbn - 1) / c.sbn : 1, gc = c.sbk ? (k + c.sbk - 1) / c.sbk : 1;
    const size_t grid = (size_t)gr * gc, sstride = (c.glu ? 2 : 1) * grid + 3; /* padding between experts */
    std::vector<float> ws((size_t)E * sstride);
    for (auto &v : ws) v = (float)(ud(rng) / 512.0);
    std::vector<float> bias;
    if (c.bias) {
        bias.resize((size_t)E * 2 * n);
        for (auto &v : bias) v = (float)(0.3 * nd(rng));
    }
    /* positions sorted by expert, each reading a random token's slot */
    int P = 0;
    for (int v : c.counts) P += v;
    std::vector<int32_t> row_map(P);
    for (auto &r : row_map) r = (int32_t)(rng() % T) * c.topk + (int32_t)(rng() % c.topk);
    const std::vector<ExpertTile> tiles = tile_table(c.counts);
    const int32_t ntiles = (int32_t)tiles.size();

    __nv_bfloat16 *d_x = dev(x);
    uint8_t *d_w = dev(w), *d_xq;
    float *d_ws = dev(ws), *d_xs, *d_bias = c.bias ? dev(bias) : NULL;
    int32_t *d_map = dev(row_map), *d_nt = dev(std::vector<int32_t>{ntiles});
    ExpertTile *d_tiles = dev(tiles);
    const int groups = fp8_groups(k);
    CK(cudaMalloc(&d_xq, (size_t)T * k));
    CK(cudaMalloc(&d_xs, (size_t)T * groups * sizeof(float)));
    __nv_bfloat16 *d_out;
    CK(cudaMalloc(&d_out, (size_t)P * n * 2));
    CK(cudaMemset(d_out, 0xff, (size_t)P * n * 2)); /* NaN */
    CK(fp8_quant_launch(d_x, T, k, d_xq, d_xs, sms, 0));

    Fp8ProjArgs a = {};
    a.n = n;
    a.k = k;
    a.x = d_xq;
    a.x_scales = d_xs;
    a.row_map = d_map;
    a.row_div = c.topk;
    a.out = d_out;
    a.tiles = d_tiles;
    a.num_tiles = d_nt;
    a.w_scales = d_ws;
    a.ws_expert_stride = sstride;
    a.w_second_scales = grid;
    a.sbn = c.sbn;
    a.sbk = c.sbk;
    a.s_cols = gc;
    a.per_channel = c.sbn == 1 && c.sbk == 0;
    a.bias = d_bias;
    a.bias_stride = 2 * n;
    a.act_alpha = 1.702f;
    a.act_limit = 7.0f;
    const size_t estride = (size_t)rows_w * k;
    CUtensorMap map;
    if (!fp8_tensor_map(encode, d_w, estride, n, k, c.glu, E, &map)) {
        printf("FAIL %s: tensor map not encoded\n", c.name);
        failures++;
        return;
    }
    cudaError_t err = c.glu ? (c.oai ? wgmma_fp8_launch<ActOai>(map, a, ntiles, sms, 0)
                                     : wgmma_fp8_launch<ActSilu>(map, a, ntiles, sms, 0))
                            : wgmma_fp8_launch<ActLinear>(map, a, ntiles, sms, 0);
    CK(err);
    CK(cudaDeviceSynchronize());

    std::vector<uint8_t> xq((size_t)T * k);
    std::vector<float> xs((size_t)T * groups);
    std::vector<__nv_bfloat16> out((size_t)P * n);
    CK(cudaMemcpy(xq.data(), d_xq, xq.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(xs.data(), d_xs, xs.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));

    /* the quantisation: every element within half an e4m3 step of its value (3 mantissa bits: 1/16
     * relative, and the subnormal step of the group's scale) */
    int qbad = 0;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < k; i++) {
            const double v = bf16v(x[(size_t)t * k + i]), s = xs[(size_t)t * groups + i / FP8_GROUP];
            const double d = e4m3(xq[(size_t)t * k + i]) * s;
            if (!(fabs(d - v) <= fabs(v) / 16.0 + s * ldexp(1.0, -10) + 1e-30)) qbad++;
        }
    /* references: with the dequantised activations the kernel was given, and with the bf16 ones */
    double max_ref = 0.0, err_q = 0.0, err_x = 0.0;
    int nonfinite = 0;
    std::vector<double> accq(rows_w), accx(rows_w), xd(k), xv(k);
    int pos = 0;
    for (int e = 0; e < E; e++)
        for (int r = 0; r < c.counts[e]; r++, pos++) {
            const int tok = row_map[pos] / c.topk;
            for (int i = 0; i < k; i++) {
                xd[i] = e4m3(xq[(size_t)tok * k + i]) * xs[(size_t)tok * groups + i / FP8_GROUP];
                xv[i] = bf16v(x[(size_t)tok * k + i]);
            }
            for (int m = 0; m < rows_w; m++) {
                const uint8_t *wr = w.data() + (size_t)e * estride + (size_t)m * k;
                const int mat = m / n, nn = m % n;
                const float *g = ws.data() + (size_t)e * sstride + (size_t)mat * grid;
                double sq = 0.0, sx = 0.0;
                for (int i = 0; i < k; i++) {
                    const size_t gi = c.sbn == 1 && c.sbk == 0 ? (size_t)nn
                                                                : (size_t)(c.sbn ? nn / c.sbn : 0) * gc + (c.sbk ? i / c.sbk : 0);
                    const double wv = e4m3(wr[i]) * g[gi];
                    sq += wv * xd[i];
                    sx += wv * xv[i];
                }
                accq[m] = sq;
                accx[m] = sx;
            }
            for (int o = 0; o < n; o++) {
                double rq = accq[o], rx = accx[o];
                if (c.glu) {
                    double gq = accq[o], uq = accq[n + o], gx = accx[o], ux = accx[n + o];
                    if (c.bias) {
                        const double bg = bias[(size_t)e * 2 * n + o], bu = bias[(size_t)e * 2 * n + n + o];
                        gq += bg, uq += bu, gx += bg, ux += bu;
                    }
                    auto act = [&](double gg, double uu) {
                        if (!c.oai) return gg / (1.0 + exp(-gg)) * uu;
                        gg = std::min(gg, 7.0);
                        uu = std::max(std::min(uu, 7.0), -7.0);
                        return (uu + 1.0) * gg / (1.0 + exp(-1.702 * gg));
                    };
                    rq = act(gq, uq);
                    rx = act(gx, ux);
                }
                const double got = bf16v(out[(size_t)pos * n + o]);
                if (!std::isfinite(got)) nonfinite++;
                max_ref = std::max(max_ref, fabs(rx));
                err_q = std::max(err_q, fabs(got - rq));
                err_x = std::max(err_x, fabs(got - rx));
            }
        }
    err_q /= max_ref > 0 ? max_ref : 1.0;
    err_x /= max_ref > 0 ? max_ref : 1.0;
    /* bf16 output (2^-9) and tanh.approx in SiLU; fp8 activations: up to 2^-4 per element, which partly
     * average out in the sums (2-5% seen on an H100) */
    const bool ok = qbad == 0 && nonfinite == 0 && err_q < 8e-3 && err_x < 6e-2;
    printf("%s %-34s P=%5d tiles=%3d  quant_bad=%d nonfinite=%d  err(deq x)=%.2e err(x)=%.2e\n", ok ? "PASS" : "FAIL",
           c.name, P, ntiles, qbad, nonfinite, err_q, err_x);
    if (!ok) failures++;
    cudaFree(d_x), cudaFree(d_w), cudaFree(d_xq), cudaFree(d_ws), cudaFree(d_xs), cudaFree(d_bias);
    cudaFree(d_map), cudaFree(d_nt), cudaFree(d_tiles), cudaFree(d_out);
}

/* ---- timing ---- */
__global__ void fill_kernel(uint8_t *p, size_t n, uint32_t seed, uint8_t mask) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = (uint8_t)h & mask; /* mask 0x77: finite e4m3 below 2 in magnitude; 0x7f bits of a bf16: finite */
    }
}
__global__ void flush_kernel(const int4 *p, size_t n, int *sink) {
    int acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc ^= p[i].x;
    if (acc == 0x12345) *sink = acc;
}

struct Timer {
    int4 *flush;
    int *sink;
    size_t flush_n = (512u << 20) / 16;
    Timer() {
        CK(cudaMalloc(&flush, flush_n * 16));
        CK(cudaMemset(flush, 1, flush_n * 16));
        CK(cudaMalloc(&sink, 4));
    }
    /* median of 20 runs of f after a read flush each */
    template <class F> double median_ms(F &&f) {
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        std::vector<double> ms;
        for (int r = 0; r < 23; r++) {
            flush_kernel<<<1024, 256>>>(flush, flush_n, sink);
            CK(cudaEventRecord(a));
            f();
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float t;
            CK(cudaEventElapsedTime(&t, a, b));
            if (r >= 3) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        CK(cudaGetLastError());
        return ms[ms.size() / 2];
    }
};

/* One layer's forward through the fp8 kernels: quantise x, the GLU projection into bf16 inter, quantise it,
 * the down projection into bf16 y; weights random, routing uniform at random (as the benchmark's). */
static void bench_layer(const char *name, int E, int topk, int H, int F, int T, void *encode, int sms, Timer &tm,
                        std::mt19937_64 &rng) {
    const size_t expert = (size_t)3 * H * F;
    uint8_t *d_w;
    CK(cudaMalloc(&d_w, expert * E));
    fill_kernel<<<4096, 256>>>(d_w, expert * E, 7u, 0x77);
    const int gF = (F + 127) / 128, gH = (H + 127) / 128;
    const size_t sgrid = (size_t)gF * gH, sstride = 3 * sgrid;
    std::vector<float> ws((size_t)E * sstride);
    std::uniform_real_distribution<double> ud(0.5, 2.0);
    for (auto &v : ws) v = (float)(ud(rng) / 64.0);
    float *d_ws = dev(ws);
    /* routing: distinct experts per token; positions sorted by expert, stable */
    std::vector<std::vector<int32_t>> by_e(E);
    std::vector<int> perm_e(E);
    for (int t = 0; t < T; t++) {
        for (int e = 0; e < E; e++) perm_e[e] = e;
        for (int j = 0; j < topk; j++) {
            const int s = j + (int)(rng() % (E - j));
            std::swap(perm_e[j], perm_e[s]);
            by_e[perm_e[j]].push_back(t * topk + j);
        }
    }
    std::vector<int32_t> row_map;
    std::vector<int> counts(E);
    for (int e = 0; e < E; e++) {
        counts[e] = (int)by_e[e].size();
        row_map.insert(row_map.end(), by_e[e].begin(), by_e[e].end());
    }
    const std::vector<ExpertTile> tiles = tile_table(counts);
    const int P = T * topk, nt = (int)tiles.size();
    int touched = 0;
    for (int v : counts) touched += v > 0;
    int32_t *d_map = dev(row_map), *d_nt = dev(std::vector<int32_t>{nt});
    ExpertTile *d_tiles = dev(tiles);
    __nv_bfloat16 *d_x, *d_inter, *d_y;
    uint8_t *d_xq, *d_iq;
    float *d_xs, *d_is;
    CK(cudaMalloc(&d_x, (size_t)T * H * 2));
    fill_kernel<<<1024, 256>>>((uint8_t *)d_x, (size_t)T * H * 2, 11u, 0x3f); /* small finite bf16s */
    CK(cudaMalloc(&d_xq, (size_t)T * H));
    CK(cudaMalloc(&d_xs, (size_t)T * gH * 4));
    CK(cudaMalloc(&d_inter, (size_t)P * F * 2));
    CK(cudaMalloc(&d_iq, (size_t)P * F));
    CK(cudaMalloc(&d_is, (size_t)P * gF * 4));
    CK(cudaMalloc(&d_y, (size_t)P * H * 2));
    Fp8ProjArgs up = {}, down = {};
    up.n = F, up.k = H, up.x = d_xq, up.x_scales = d_xs, up.row_map = d_map, up.row_div = topk, up.out = d_inter;
    up.tiles = d_tiles, up.num_tiles = d_nt, up.w_scales = d_ws, up.ws_expert_stride = sstride;
    up.w_second_scales = sgrid, up.sbn = 128, up.sbk = 128, up.s_cols = gH;
    down = up;
    down.n = H, down.k = F, down.x = d_iq, down.x_scales = d_is, down.row_map = NULL, down.row_div = 1, down.out = d_y;
    down.w_scales = d_ws + 2 * sgrid, down.w_second_scales = 0, down.s_cols = gF;
    CUtensorMap mup, mdown;
    if (!fp8_tensor_map(encode, d_w, expert, F, H, true, E, &mup) ||
        !fp8_tensor_map(encode, d_w + (size_t)2 * F * H, expert, H, F, false, E, &mdown)) {
        printf("FAIL %s: tensor map\n", name);
        failures++;
        return;
    }
    auto q1 = [&]() { CK(fp8_quant_launch(d_x, T, H, d_xq, d_xs, sms, 0)); };
    auto g1 = [&]() { CK(wgmma_fp8_launch<ActSilu>(mup, up, nt, sms, 0)); };
    auto q2 = [&]() { CK(fp8_quant_launch(d_inter, P, F, d_iq, d_is, sms, 0)); };
    auto g2 = [&]() { CK(wgmma_fp8_launch<ActLinear>(mdown, down, nt, sms, 0)); };
    const double t_q1 = tm.median_ms(q1), t_g1 = tm.median_ms(g1), t_q2 = tm.median_ms(q2), t_g2 = tm.median_ms(g2);
    const double t_all = tm.median_ms([&]() { q1(), g1(), q2(), g2(); });
    const double flops = 2.0 * P * 3.0 * H * F, bytes = (double)touched * expert;
    printf("%-12s T=%5d  quant %.3f  up %.3f  quant %.3f  down %.3f  all %.3f ms  %.0f TFLOP/s  %.2f TB/s weights"
           "  (up %.0f, down %.0f TFLOP/s)\n",
           name, T, t_q1, t_g1, t_q2, t_g2, t_all, flops / t_all * 1e-9, bytes / t_all * 1e-9,
           2.0 * P * 2.0 * H * F / t_g1 * 1e-9, 2.0 * P * H * F / t_g2 * 1e-9);
    cudaFree(d_w), cudaFree(d_ws), cudaFree(d_map), cudaFree(d_nt), cudaFree(d_tiles), cudaFree(d_x);
    cudaFree(d_xq), cudaFree(d_xs), cudaFree(d_inter), cudaFree(d_iq), cudaFree(d_is), cudaFree(d_y);
    CK(cudaGetLastError());
}

int main(int argc, char **argv) {
    const bool bench = argc > 1 && !strcmp(argv[1], "--bench");
    int sms = 0, major = 0;
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    if (major != 9) { /* the kernels are sm_90a's; the library runs fp8 elsewhere on other paths */
        printf("check_fp8_gemm: skipped, compute capability %d.x has no sm_90a fp8 wgmma\n", major);
        return 0;
    }
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    void *encode = ws_encode_fn();
    if (!encode) {
        printf("FAIL: no tensor-map encoder\n");
        return 1;
    }
    CK(wgmma_fp8_setup_one<ActLinear>());
    CK(wgmma_fp8_setup_one<ActSilu>());
    CK(wgmma_fp8_setup_one<ActOai>());
    std::mt19937_64 rng(20261206);
    const std::vector<Case> cases = {
        {"silu block128 mixed tiles", true, false, false, 4, 384, 512, 2, 300, 128, 128, {0, 1, 130, 300}},
        {"silu block128 n,k partial", true, false, false, 3, 336, 528, 2, 200, 128, 128, {77, 129, 256}},
        {"linear per-channel", false, false, false, 3, 512, 384, 1, 300, 1, 0, {64, 200, 3}},
        {"linear block128 k partial", false, false, false, 2, 400, 272, 8, 40, 128, 128, {129, 300}},
        {"oai bias per-tensor", true, true, true, 3, 256, 256, 4, 64, 0, 0, {40, 0, 190}},
        {"silu bias block256x128", true, false, true, 2, 512, 384, 2, 100, 256, 128, {65, 150}},
        {"silu many experts few rows", true, false, false, 40, 256, 256, 8, 16, 128, 128,
         {1, 2, 3, 0, 5, 1, 1, 0, 2, 7, 1, 1, 3, 1, 0, 2, 9, 1, 1, 4, 1, 1, 2, 3, 1, 0, 1, 1, 2, 1, 3, 1, 1, 1, 2, 1, 1, 6, 1, 1}},
    };
    for (const Case &c : cases) run_case(c, encode, sms, rng);
    if (bench) {
        Timer tm;
        for (int T : {16, 64, 256, 1024, 4096}) bench_layer("Mixtral", 8, 2, 4096, 14336, T, encode, sms, tm, rng);
        for (int T : {16, 64, 256, 1024, 4096}) bench_layer("DeepSeek-V3", 256, 8, 7168, 2048, T, encode, sms, tm, rng);
    }
    printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
