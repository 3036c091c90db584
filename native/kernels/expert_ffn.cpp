// expert_ffn: gather -> gate/up matmuls + silu_mul_pack (per thread on its own rows, no
// barrier between them) -> join -> down matmul + combine_down (per thread on its own
// hidden rows). Rows are split in multiples of 32 (silu_mul_pack's contract).
// Baseline x86-64 code: it only calls through the KernelOps table.
#include "kernels/expert_ffn.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>

#include "kernels/bf16.hpp"

namespace numa_moe::kernels {
namespace {

struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<void, FreeDeleter>;

Buffer aligned_buffer(size_t bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) throw std::bad_alloc();
    return Buffer(p);
}

// Calls body(begin, end) on `threads` threads over [0, n) in chunks that are multiples of 32.
void parallel_rows(int threads, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    const int64_t chunk = std::max<int64_t>(32, (n + threads - 1) / threads + 31) / 32 * 32;
    const int64_t pieces = (n + chunk - 1) / chunk;
    if (pieces <= 1) {
        body(0, n);
        return;
    }
    std::exception_ptr error;
    std::mutex error_mutex;
    std::vector<std::thread> pool;
    auto run = [&](int64_t begin, int64_t end) {
        try {
            body(begin, end);
        } catch (...) {
            std::lock_guard<std::mutex> lock(error_mutex);
            if (!error) error = std::current_exception();
        }
    };
    for (int64_t p = 1; p < pieces; ++p) pool.emplace_back(run, p * chunk, std::min(n, (p + 1) * chunk));
    run(0, std::min(n, chunk));
    for (auto& thread : pool) thread.join();
    if (error) std::rethrow_exception(error);
}

const Segment* segments_or_whole(const std::vector<Segment>& given, Segment* whole, int64_t rows, int64_t cols,
                                 int64_t* count) {
    if (!given.empty()) {
        *count = static_cast<int64_t>(given.size());
        return given.data();
    }
    *whole = Segment{0, 1, rows, 0, cols};
    *count = 1;
    return whole;
}

}  // namespace

void expert_ffn(const KernelOps& ops, const ExpertFfnArgs& a) {
    const int64_t m = a.m, hidden = a.hidden, inter = a.intermediate;
    const int threads = std::max(1, a.threads);
    if (m == 0) return;

    Buffer x_packed = aligned_buffer(ops.packed_bytes(m, hidden));
    ops.gather(a.x, a.ldx, a.token_index, m, hidden, x_packed.get());

    Buffer gate = aligned_buffer(sizeof(float) * inter * m);
    Buffer up = aligned_buffer(sizeof(float) * inter * m);
    Buffer act = aligned_buffer(ops.packed_bytes(m, inter));
    float* gate_f = static_cast<float*>(gate.get());
    float* up_f = static_cast<float*>(up.get());
    Segment whole_g, whole_u, whole_d;
    int64_t n_g, n_u, n_d;
    const Segment* seg_g = segments_or_whole(a.gate_segments, &whole_g, inter, hidden, &n_g);
    const Segment* seg_u = segments_or_whole(a.up_segments, &whole_u, inter, hidden, &n_u);
    const Segment* seg_d = segments_or_whole(a.down_segments, &whole_d, hidden, inter, &n_d);

    parallel_rows(threads, inter, [&](int64_t begin, int64_t end) {
        std::memset(gate_f + begin * m, 0, sizeof(float) * (end - begin) * m);
        std::memset(up_f + begin * m, 0, sizeof(float) * (end - begin) * m);
        ops.matmul_segments(a.w_gate, hidden, seg_g, n_g, begin, end, x_packed.get(), m, hidden, gate_f, m);
        ops.matmul_segments(a.w_up, hidden, seg_u, n_u, begin, end, x_packed.get(), m, hidden, up_f, m);
        const float* gate_parts[1] = {gate_f};
        const float* up_parts[1] = {up_f};
        ops.silu_mul_pack(gate_parts, up_parts, 1, m, begin, end, m, inter, act.get());
    });

    Buffer down = aligned_buffer(sizeof(float) * hidden * m);
    float* down_f = static_cast<float*>(down.get());
    Buffer y_scratch;
    float* y = static_cast<float*>(a.out);
    if (a.out_bf16) {
        y_scratch = aligned_buffer(sizeof(float) * m * hidden);
        y = static_cast<float*>(y_scratch.get());
    }
    std::vector<int64_t> identity(m);
    std::vector<float> ones(m, 1.0f);
    for (int64_t t = 0; t < m; ++t) identity[t] = t;

    parallel_rows(threads, hidden, [&](int64_t begin, int64_t end) {
        std::memset(down_f + begin * m, 0, sizeof(float) * (end - begin) * m);
        ops.matmul_segments(a.w_down, inter, seg_d, n_d, begin, end, act.get(), m, inter, down_f, m);
        for (int64_t t = 0; t < m; ++t) std::memset(y + t * hidden + begin, 0, sizeof(float) * (end - begin));
        const float* parts[1] = {down_f};
        ops.combine_down(parts, 1, m, begin, end, m, identity.data(), ones.data(), y, hidden);
        if (a.out_bf16) {
            bf16* out = static_cast<bf16*>(a.out);
            for (int64_t t = 0; t < m; ++t)
                for (int64_t h = begin; h < end; ++h) out[t * hidden + h] = float_to_bf16(y[t * hidden + h]);
        }
    });
}

}  // namespace numa_moe::kernels
