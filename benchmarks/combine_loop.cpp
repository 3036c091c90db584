// One thread, the down projection's combine (combine_down_avx512: a [rows, m] fp32 partial
// transposed 16 x 16 in registers and added into the rows of y), back to back, with y's rows
// H floats apart and with the step arena's spread stride (spread_row_bytes in
// common/util.hpp): with H a multiple of 1024 the 16 rows a transpose writes share one L1
// set (docs/kernels.md, "Combining the down projection"). Not part of the library.
//
//   g++ -O3 -DNDEBUG -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma
//       -Inative benchmarks/combine_loop.cpp -o /tmp/combine_loop
//   /tmp/combine_loop [H [M [ROWS [CALLS]]]]   (default 2048 128 1024 2000: a thread's half
//       of qwen3-30b-a3b's hidden size, 128 tokens)
//
// Prints the best and the median time of a call for each stride, alternated three times.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/util.hpp"
#include "kernels/avx512_common.hpp"

using namespace numa_moe;

int main(int argc, char** argv) {
    const int64_t hidden = argc > 1 ? std::atoll(argv[1]) : 2048;
    const int64_t m = argc > 2 ? std::atoll(argv[2]) : 128;
    const int64_t rows = argc > 3 ? std::atoll(argv[3]) : 1024;
    const int calls = argc > 4 ? std::atoi(argv[4]) : 2000;
    if (hidden <= 0 || m <= 0 || rows <= 0 || rows > hidden || calls <= 0) {
        std::fprintf(stderr, "usage: %s [H [M [ROWS <= H [CALLS]]]]\n", argv[0]);
        return 2;
    }
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> partial(static_cast<size_t>(rows * m)), weight(static_cast<size_t>(m));
    for (float& v : partial) v = dist(gen);
    for (float& v : weight) v = dist(gen);
    std::vector<int64_t> token_index(static_cast<size_t>(m));
    for (int64_t t = 0; t < m; ++t) token_index[static_cast<size_t>(t)] = t;
    const float* parts[1] = {partial.data()};
    const int64_t spread = static_cast<int64_t>(spread_row_bytes(sizeof(float) * hidden) / sizeof(float));
    for (int round = 0; round < 3; ++round)
        for (const int64_t ldy : {hidden, spread}) {
            std::vector<float> y(static_cast<size_t>(m * ldy), 0.0f);
            std::vector<double> us;
            for (int c = 0; c < calls; ++c) {
                const auto t0 = std::chrono::steady_clock::now();
                kernels::combine_down_avx512(parts, 1, m, 0, rows, m, token_index.data(), weight.data(), nullptr, y.data(),
                                             ldy);
                us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
            }
            std::sort(us.begin(), us.end());
            std::printf("H=%ld m=%ld rows=%ld y stride %ld floats: combine best %.1f us median %.1f us",
                        static_cast<long>(hidden), static_cast<long>(m), static_cast<long>(rows),
                        static_cast<long>(ldy), us.front(), us[us.size() / 2]);
            us.clear();
            for (int c = 0; c < calls; ++c) {
                const auto t0 = std::chrono::steady_clock::now();
                kernels::store_down_avx512(parts, 1, m, 0, rows, m, nullptr, y.data(), ldy, false);
                us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
            }
            std::sort(us.begin(), us.end());
            std::printf("; store best %.1f us median %.1f us\n", us.front(), us[us.size() / 2]);
        }
    return 0;
}
