// One thread, one decode-attention kernel, back to back: the kernel's own rate without the
// driver, thread wake-ups or cache eviction. Not part of the library: it includes a kernel
// translation unit whole.
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma -I. -Inative
//       -DKERNEL='"native/kernels/attention_avx512.cpp"' benchmarks/attention_kernel_loop.cpp
//       native/kernels/names.cpp -o /tmp/attn_loop   (one command line; or the CMake target
//       attention_kernel_loop, -DNUMA_MOE_BENCHMARKS=ON)
//   /tmp/attn_loop GROUP POSITIONS     (D = 128; e.g. 8 1024: 512 KB of K and V, in L2;
//                                       8 262144: 128 MB, from memory)
//
// K and V are [POSITIONS, 128] bf16, random; the kernel folds them in calls of 2048
// positions (the driver's longest run) into one state. Prints the median and best ns per
// position over the repetitions, and for POSITIONS > 100000 the rate of a plain
// one-thread streaming read of the same bytes.
#include KERNEL

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace numa_moe;
using namespace numa_moe::kernels;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

bf16* random_bf16(int64_t n, std::mt19937& gen) {
    std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
    bf16* p = static_cast<bf16*>(std::aligned_alloc(64, static_cast<size_t>(n) * 2));
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(dist(gen));
    return p;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s GROUP POSITIONS\n", argv[0]);
        return 2;
    }
    const int64_t d = 128, g = std::atoll(argv[1]), n = std::atoll(argv[2]);
    if (g < 1 || g > kMaxQueryBlock || n < 1) {
        std::fprintf(stderr, "GROUP in 1..%ld, POSITIONS >= 1\n", static_cast<long>(kMaxQueryBlock));
        return 2;
    }
    const AttentionOps& ops = attention_avx512_ops();
    std::mt19937 gen(1);
    const bf16* k = random_bf16(n * d, gen);
    const bf16* v = random_bf16(n * d, gen);
    const bf16* q = random_bf16(g * d, gen);
    void* packed = std::aligned_alloc(64, 1 << 16);
    void* scratch = std::aligned_alloc(64, (ops.scratch_bytes(kMaxQueryBlock, d) + 63) / 64 * 64);
    ops.pack_query(q, g, d, packed);
    std::vector<float> state(static_cast<size_t>(g * (d + 2)));
    const int repeats = n > 100000 ? 7 : 2001;
    std::vector<double> seconds;
    for (int rep = 0; rep < repeats; ++rep) {
        std::fill(state.begin(), state.begin() + g, -__builtin_inff());
        std::fill(state.begin() + g, state.end(), 0.0f);
        const AttentionState st{state.data(), state.data() + g, state.data() + 2 * g};
        const double start = now();
        for (int64_t t0 = 0; t0 < n; t0 += 2048)
            ops.attend(packed, g, d, k + t0 * d, v + t0 * d, std::min<int64_t>(2048, n - t0), 0.088f, st, scratch);
        seconds.push_back(now() - start);
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    std::printf("g=%ld positions=%ld: %.2f ns/position (best %.2f), %.1f GB/s of K and V\n", static_cast<long>(g),
                static_cast<long>(n), median / n * 1e9, seconds[0] / n * 1e9, n * d * 4 / median / 1e9);
    if (n > 100000) {
        std::vector<double> reads;
        for (int rep = 0; rep < 7; ++rep) {
            const double start = now();
            __m512i acc = _mm512_setzero_si512();
            for (const bf16* buf : {k, v})
                for (int64_t i = 0; i < n * d; i += 32) acc = _mm512_xor_si512(acc, _mm512_load_si512(buf + i));
            reads.push_back(now() - start);
            volatile int sink = _mm512_reduce_add_epi32(acc);
            (void)sink;
        }
        std::sort(reads.begin(), reads.end());
        std::printf("streaming read of the same bytes, one thread: %.2f ns/position, %.1f GB/s\n", reads[3] / n * 1e9,
                    n * d * 4 / reads[3] / 1e9);
    }
    return 0;
}
