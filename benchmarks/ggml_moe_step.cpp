// One MoE layer step on llama.cpp's ggml CPU backend, built the way llama.cpp's
// build_moe_ffn (src/llama-graph.cpp) builds it: experts stacked [E, I, H] (ggml ne
// order H, I, E) in BF16 / Q8_0 / Q4_0 / MXFP4, ggml_mul_mat_id for gate and up with the routing
// ids, ggml_swiglu_split, ggml_mul_mat_id for down, ggml_mul by the routing weights and
// the sum of the top-k views. Built by tools/build-ggml.sh, driven by
// benchmarks/bench_ggml.py.
//
//   ggml_moe_step --experts E --top-k K --hidden H --inter I --tokens M --type bf16|q8_0|q4_0|mxfp4
//                 --threads T [--repeats R] [--no-repack] [--weights FILE --input FILE --check]
//
// Weights are random (filled once) unless --weights names a float32 file of gate [E,I,H],
// up [E,I,H], down [E,H,I]; the input is random unless --input names a float32 [M,H].
// Then stdin holds one routing per line: M*K expert ids, then M*K weights. For each, the
// graph is computed R times and one JSON line {"ms": [...]} is printed (with --check also
// "out": the output [M,H]). The weight buffer is mmap'ed with MADV_NOHUGEPAGE: 4 KB
// pages, as the numa-moe side uses by default.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

namespace {

struct Args {
    int64_t experts = 0, top_k = 0, hidden = 0, inter = 0, tokens = 0;
    int threads = 1, repeats = 1;
    std::string type, weights, input;
    bool check = false, no_repack = false;
};

int64_t positive(const char *name, const char *value) {
    char *end = nullptr;
    long long v = std::strtoll(value, &end, 10);
    if (*end != '\0' || v <= 0) throw std::runtime_error(std::string(name) + " must be a positive integer");
    return v;
}

Args parse(int argc, char **argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        std::string k = argv[i];
        if (k == "--check") { a.check = true; continue; }
        if (k == "--no-repack") { a.no_repack = true; continue; }
        if (i + 1 >= argc) throw std::runtime_error(k + " needs a value");
        const char *v = argv[++i];
        if (k == "--experts") a.experts = positive("--experts", v);
        else if (k == "--top-k") a.top_k = positive("--top-k", v);
        else if (k == "--hidden") a.hidden = positive("--hidden", v);
        else if (k == "--inter") a.inter = positive("--inter", v);
        else if (k == "--tokens") a.tokens = positive("--tokens", v);
        else if (k == "--threads") a.threads = static_cast<int>(positive("--threads", v));
        else if (k == "--repeats") a.repeats = static_cast<int>(positive("--repeats", v));
        else if (k == "--type") a.type = v;
        else if (k == "--weights") a.weights = v;
        else if (k == "--input") a.input = v;
        else throw std::runtime_error("unknown option " + k);
    }
    if (!a.experts || !a.top_k || !a.hidden || !a.inter || !a.tokens)
        throw std::runtime_error("--experts, --top-k, --hidden, --inter and --tokens are required");
    if (a.top_k > a.experts) throw std::runtime_error("--top-k exceeds --experts");
    return a;
}

ggml_type parse_type(const std::string &t) {
    if (t == "bf16") return GGML_TYPE_BF16;
    if (t == "q8_0") return GGML_TYPE_Q8_0;
    if (t == "q4_0") return GGML_TYPE_Q4_0;
    if (t == "mxfp4") return GGML_TYPE_MXFP4;
    throw std::runtime_error("--type must be bf16, q8_0, q4_0 or mxfp4, not '" + t + "'");
}

std::vector<float> read_floats(const std::string &path, size_t n) {
    std::vector<float> v(n);
    FILE *f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot open " + path);
    size_t got = std::fread(v.data(), sizeof(float), n, f);
    std::fclose(f);
    if (got != n) throw std::runtime_error(path + " holds fewer than the expected float32 values");
    return v;
}

// Converts rows of float32 to the tensor's type (ggml_quantize_chunk quantizes Q8_0/Q4_0/MXFP4,
// converts BF16) into dst, the tensor's bytes in ggml's plain layout.
void store_rows(const ggml_tensor *t, char *dst, int64_t row0, const float *src, int64_t nrows) {
    const int64_t k = t->ne[0];
    ggml_quantize_chunk(t->type, src, dst + row0 * ggml_row_size(t->type, k), 0, nrows, k, nullptr);
}

// Random weights: a block of rows quantized once and tiled over the tensor (the content
// does not matter for speed; only for --check do the values come from a file).
void fill_random(const ggml_tensor *t, char *base, std::mt19937 &gen, float scale) {
    const int64_t k = t->ne[0], rows = ggml_nrows(t);
    const int64_t block_rows = std::min<int64_t>(rows, std::max<int64_t>(1, (1 << 20) / k));
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> block(block_rows * k);
    for (auto &x : block) x = normal(gen);
    store_rows(t, base, 0, block.data(), block_rows);
    for (int64_t r = block_rows; r < rows; r += block_rows) {
        const int64_t n = std::min(block_rows, rows - r);
        std::memcpy(base + r * ggml_row_size(t->type, k), base, n * ggml_row_size(t->type, k));
    }
}

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int run(const Args &a) {
    const ggml_type type = parse_type(a.type);
    const int64_t E = a.experts, K = a.top_k, H = a.hidden, I = a.inter, M = a.tokens;
    if (H % ggml_blck_size(type) || I % ggml_blck_size(type))
        throw std::runtime_error("--hidden and --inter must be multiples of the type's block size");
    // ggml's info lines (one per repacked tensor) would interleave with the driver's table.
    ggml_log_set([](ggml_log_level level, const char *text, void *) {
        if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
    }, nullptr);
    ggml_cpu_init();

    // Q4_0 and MXFP4 go into the CPU backend's repack buffer where ggml has a repacked
    // layout for this CPU (8x8 with AVX2), as llama.cpp loads them by default; the other
    // types have none on x86 and stay in plain memory. Weights live in their own context.
    ggml_backend_buffer_type_t repack = nullptr;
    if ((type == GGML_TYPE_Q4_0 || type == GGML_TYPE_MXFP4) && !a.no_repack) {
        ggml_backend_reg_t reg = ggml_backend_cpu_reg();
        auto get_extra = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
            ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
        if (get_extra && ggml_cpu_has_avx2() && I % 8 == 0 && H % 8 == 0)
            for (ggml_backend_buffer_type_t *b = get_extra(ggml_backend_reg_dev_get(reg, 0)); b && *b; ++b)
                if (std::string(ggml_backend_buft_name(*b)) == "CPU_REPACK") repack = *b;
    }
    const size_t weight_bytes = E * (2 * ggml_row_size(type, H) * I + ggml_row_size(type, I) * H);
    const size_t wsize = weight_bytes + 3 * ggml_tensor_overhead() + 3 * 64 + 4096;
    void *wbuf = nullptr;
    if (!repack) {
        wbuf = mmap(nullptr, wsize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (wbuf == MAP_FAILED) throw std::runtime_error("cannot map " + std::to_string(wsize) + " bytes of weights");
        madvise(wbuf, wsize, MADV_NOHUGEPAGE);
    }
    ggml_init_params wp = {repack ? 8 * ggml_tensor_overhead() : wsize, wbuf, repack != nullptr};
    ggml_context *wctx = ggml_init(wp);
    ggml_tensor *gate = ggml_new_tensor_3d(wctx, type, H, I, E);
    ggml_tensor *up = ggml_new_tensor_3d(wctx, type, H, I, E);
    ggml_tensor *down = ggml_new_tensor_3d(wctx, type, I, H, E);
    ggml_backend_buffer_t repack_buf = nullptr;
    if (repack) {
        repack_buf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, repack);
        if (!repack_buf) throw std::runtime_error("cannot allocate the repacked weights");
        // 4 KB pages before the first touch, as for the plain buffer.
        auto *base = static_cast<char *>(ggml_backend_buffer_get_base(repack_buf));
        auto *page = reinterpret_cast<char *>(reinterpret_cast<uintptr_t>(base) & ~uintptr_t(4095));
        madvise(page, ggml_backend_buffer_get_size(repack_buf) + (base - page), MADV_NOHUGEPAGE);
    }
    // The plain bytes of each tensor: in place, or staged and handed to the repack buffer
    // (whose set_tensor takes a whole tensor and rearranges it).
    std::vector<char> staging;  // released after the fill, below
    auto plain = [&](ggml_tensor *t) {
        if (!repack) return static_cast<char *>(t->data);
        staging.assign(ggml_nbytes(t), 0);
        return staging.data();
    };
    auto commit = [&](ggml_tensor *t) {
        if (repack) ggml_backend_tensor_set(t, staging.data(), 0, ggml_nbytes(t));
    };

    // Activations, routing and the graph in a second context.
    // Input, routing, gate/up/act [I, K, M], down and weighted [H, K, M], K - 1 sums [H, M],
    // with room for alignment.
    const size_t asize = (2 * K + 64) * ggml_tensor_overhead() + ggml_graph_overhead() +
                         sizeof(float) * (M * H * (3 * K + 4) + M * K * (3 * I + 2)) + (1 << 20);
    ggml_init_params ap = {asize, nullptr, false};
    ggml_context *ctx = ggml_init(ap);
    ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, H, M);
    ggml_tensor *ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, K, M);
    ggml_tensor *rw = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, K, M);

    std::mt19937 gen(1234);
    if (a.weights.empty()) {
        fill_random(gate, plain(gate), gen, 1.0f / std::sqrt(static_cast<float>(H)));
        commit(gate);
        fill_random(up, plain(up), gen, 1.0f / std::sqrt(static_cast<float>(H)));
        commit(up);
        fill_random(down, plain(down), gen, 1.0f / std::sqrt(static_cast<float>(I)));
        commit(down);
    } else {
        std::vector<float> w = read_floats(a.weights, static_cast<size_t>(E * 3 * I * H));
        store_rows(gate, plain(gate), 0, w.data(), E * I);
        commit(gate);
        store_rows(up, plain(up), 0, w.data() + E * I * H, E * I);
        commit(up);
        store_rows(down, plain(down), 0, w.data() + 2 * E * I * H, E * H);
        commit(down);
    }
    std::vector<char>().swap(staging);
    if (a.input.empty()) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (int64_t i = 0; i < M * H; ++i) static_cast<float *>(x->data)[i] = normal(gen);
    } else {
        std::vector<float> v = read_floats(a.input, static_cast<size_t>(M * H));
        std::memcpy(x->data, v.data(), v.size() * sizeof(float));
    }

    // build_moe_ffn's graph (no gate bias, SwiGLU, weights applied after down).
    ggml_tensor *cur = ggml_reshape_3d(ctx, x, H, 1, M);
    ggml_tensor *g = ggml_mul_mat_id(ctx, gate, cur, ids);   // [I, K, M]
    ggml_tensor *u = ggml_mul_mat_id(ctx, up, cur, ids);     // [I, K, M]
    ggml_tensor *act = ggml_swiglu_split(ctx, g, u);
    ggml_tensor *experts = ggml_mul_mat_id(ctx, down, act, ids);  // [H, K, M]
    experts = ggml_mul(ctx, experts, rw);
    ggml_tensor *out = ggml_view_2d(ctx, experts, H, M, experts->nb[2], 0);
    for (int64_t k = 1; k < K; ++k)
        out = ggml_add(ctx, out, ggml_view_2d(ctx, experts, H, M, experts->nb[2], k * experts->nb[1]));
    if (K == 1) out = ggml_cont(ctx, out);
    ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    ggml_threadpool_params tpp = ggml_threadpool_params_default(a.threads);
    ggml_threadpool *pool = ggml_threadpool_new(&tpp);
    ggml_cplan plan = ggml_graph_plan(gf, a.threads, pool);
    std::vector<uint8_t> work(plan.work_size + 64);
    plan.work_data = work.data();

    std::cout << "{\"ready\": true, \"weight_bytes\": " << weight_bytes << ", \"repacked\": "
              << (repack ? "true" : "false") << "}" << std::endl;
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        std::istringstream in(line);
        auto *id = static_cast<int32_t *>(ids->data);
        auto *wt = static_cast<float *>(rw->data);
        for (int64_t i = 0; i < M * K; ++i) {
            long long e;
            if (!(in >> e) || e < 0 || e >= E) throw std::runtime_error("bad routing line: expert ids out of range or missing");
            id[i] = static_cast<int32_t>(e);
        }
        for (int64_t i = 0; i < M * K; ++i)
            if (!(in >> wt[i])) throw std::runtime_error("bad routing line: missing weights");
        std::ostringstream o;
        o << "{\"ms\": [";
        for (int r = 0; r < a.repeats; ++r) {
            const double t0 = now_ms();
            if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) throw std::runtime_error("ggml_graph_compute failed");
            o << (r ? ", " : "") << now_ms() - t0;
        }
        o << "]";
        if (a.check) {
            o.precision(9);
            o << ", \"out\": [";
            for (int64_t m = 0; m < M; ++m)
                for (int64_t h = 0; h < H; ++h)
                    o << (m || h ? ", " : "")
                      << *reinterpret_cast<const float *>(static_cast<const char *>(out->data) + m * out->nb[1] + h * out->nb[0]);
            o << "]";
        }
        o << "}";
        std::cout << o.str() << std::endl;
    }
    ggml_threadpool_free(pool);
    ggml_free(ctx);
    ggml_free(wctx);
    if (repack_buf) ggml_backend_buffer_free(repack_buf);
    if (wbuf) munmap(wbuf, wsize);
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception &e) {
        std::cerr << "ggml_moe_step: " << e.what() << std::endl;
        return 2;
    }
}
