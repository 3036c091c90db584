// expert_ffn: gather (calling thread) -> one run on the kernel pool (kernel_pool.hpp):
// phase 0 gate/up matmuls + silu_mul_pack, each thread on its own intermediate rows ->
// barrier -> phase 1 down matmul + store_down, each thread on its own hidden rows.
// Rows are split in multiples of 32 (silu_mul_pack's contract).
// Baseline x86-64 code: it only calls through the KernelOps table.
#include "kernels/expert_ffn.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "kernels/kernel_pool.hpp"

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

// The call's work buffers, kept per calling thread from one call to the next: glibc
// returns blocks of 128 KiB and more to the kernel on free, so fresh buffers cost page
// faults on every call (a qwen3-30b-a3b expert at M = 16 needs five buffers of 24-128 KiB).
// A buffer above kKeptBytes (long prefill) is the call's own and freed after it.
enum Slot { kTokens, kGate, kUp, kAct, kDown, kSlots };
constexpr size_t kKeptBytes = size_t(4) << 20;

class Scratch {
public:
    void* get(Slot slot, size_t bytes, Buffer* call_owned) {
        if (bytes > kKeptBytes) {
            *call_owned = aligned_buffer(bytes);
            return call_owned->get();
        }
        if (bytes > sizes_[slot]) {
            buffers_[slot].reset();
            buffers_[slot] = aligned_buffer(bytes);
            sizes_[slot] = bytes;
        }
        return buffers_[slot].get();
    }

private:
    Buffer buffers_[kSlots];
    size_t sizes_[kSlots] = {};
};

thread_local Scratch t_scratch;

// Thread `index` of n_threads: its share of [0, n) in chunks that are multiples of 32
// (silu_mul_pack's contract); empty for threads past the last chunk.
std::pair<int64_t, int64_t> row_share(int64_t n, int index, int n_threads) {
    const int64_t chunk = std::max<int64_t>(32, (n + n_threads - 1) / n_threads + 31) / 32 * 32;
    const int64_t begin = std::min(n, index * chunk);
    return {begin, std::min(n, begin + chunk)};
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

    Buffer owned[kSlots];  // only buffers above kKeptBytes
    void* x_packed = t_scratch.get(kTokens, ops.packed_bytes(m, hidden), &owned[kTokens]);
    ops.gather(a.x, a.ldx, a.token_index, m, hidden, x_packed);

    float* gate_f = static_cast<float*>(t_scratch.get(kGate, sizeof(float) * inter * m, &owned[kGate]));
    float* up_f = static_cast<float*>(t_scratch.get(kUp, sizeof(float) * inter * m, &owned[kUp]));
    void* act = t_scratch.get(kAct, ops.packed_bytes(m, inter), &owned[kAct]);
    Segment whole_g, whole_u, whole_d;
    int64_t n_g, n_u, n_d;
    const Segment* seg_g = segments_or_whole(a.gate_segments, &whole_g, inter, hidden, &n_g);
    const Segment* seg_u = segments_or_whole(a.up_segments, &whole_u, inter, hidden, &n_u);
    const Segment* seg_d = segments_or_whole(a.down_segments, &whole_d, hidden, inter, &n_d);

    float* down_f = static_cast<float*>(t_scratch.get(kDown, sizeof(float) * hidden * m, &owned[kDown]));

    auto gate_up_rows = [&](int64_t begin, int64_t end) {
        std::memset(gate_f + begin * m, 0, sizeof(float) * (end - begin) * m);
        std::memset(up_f + begin * m, 0, sizeof(float) * (end - begin) * m);
        ops.matmul_segments(a.w_gate, hidden, seg_g, n_g, begin, end, x_packed, m, hidden, gate_f, m);
        ops.matmul_segments(a.w_up, hidden, seg_u, n_u, begin, end, x_packed, m, hidden, up_f, m);
        const float* gate_parts[1] = {gate_f};
        const float* up_parts[1] = {up_f};
        ops.silu_mul_pack(gate_parts, up_parts, 1, m, begin, end, m, inter, act);
    };
    auto down_rows = [&](int64_t begin, int64_t end) {
        std::memset(down_f + begin * m, 0, sizeof(float) * (end - begin) * m);
        ops.matmul_segments(a.w_down, inter, seg_d, n_d, begin, end, act, m, inter, down_f, m);
        const float* parts[1] = {down_f};
        ops.store_down(parts, 1, m, begin, end, m, a.out, hidden, a.out_bf16);
    };
    // Phase 0 writes act (all of it, across threads), phase 1 reads all of it.
    run_phases(threads, 2, [&](int phase, int index, int n_threads) {
        const auto [begin, end] = row_share(phase == 0 ? inter : hidden, index, n_threads);
        if (begin >= end) return;
        if (phase == 0)
            gate_up_rows(begin, end);
        else
            down_rows(begin, end);
    });
}

}  // namespace numa_moe::kernels
