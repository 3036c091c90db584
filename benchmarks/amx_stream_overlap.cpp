// How the AMX-INT8 weight stream overlaps other work: one thread walks an int8 matrix as
// the AMX kernel does (32-row blocks, per 64-column step two A tiles straight from the
// rows, tileloaddt1, one B tile, two tdpbssd into C tiles of one token), with W rounds of
// eight independent vpmulld chains per step standing in for the kernel's vector work,
// optionally requesting (prefetcht2) each line of the next block. Prints ns per step and
// GB/s for W = 0, 2, 4, 8, 12, 16, 24. Not part of the library.
//
//   g++ -O2 -std=c++17 -mamx-tile -mamx-int8 -mavx512f -Inative benchmarks/amx_stream_overlap.cpp
//       native/common/cpu_features.cpp -o /tmp/amx_stream
//   /tmp/amx_stream ROWS K REPEATS PREFETCH(0|1)
//   in L2:        /tmp/amx_stream 256 2048 200 0
//   from memory:  taskset -c 0 /tmp/amx_stream 600000 2048 2 1 & taskset -c 1 /tmp/amx_stream 600000 2048 2 1
//   (1.2 GB a copy: above the 480 MiB L3 the development VM reports)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cpu_features.hpp"
#include "kernels/amx_tiles.hpp"

namespace {

using numa_moe::kernels::amx_tiles::TileConfig;

alignas(64) int8_t tokens[64 * 1024];
alignas(64) int32_t sums[16 * 16];
__m512i sink;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

__attribute__((noinline)) long walk(const int8_t* w, long rows, long k, int work, bool prefetch) {
    long steps = 0;
    __m512i a[8];
    for (auto& v : a) v = _mm512_set1_epi32(1);
    const __m512i three = _mm512_set1_epi32(3);
    for (long r = 0; r + 32 <= rows; r += 32) {
        const int8_t* block = w + r * k;
        for (long c = 0; c < k; c += 64, ++steps) {
            TILE_STREAM_LOADD(4, block + c, k);
            TILE_LOADD(6, tokens + c, 4);
            _tile_dpbssd(0, 4, 6);
            TILE_STREAM_LOADD(5, block + 16 * k + c, k);
            _tile_dpbssd(2, 5, 6);
            if (prefetch && r + 64 <= rows)
                for (int i = 0; i < 32; ++i) _mm_prefetch(reinterpret_cast<const char*>(block + (32 + i) * k + c), _MM_HINT_T2);
            for (int i = 0; i < work; ++i) {
                for (auto& v : a) v = _mm512_mullo_epi32(v, three);
                __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), "+v"(a[6]),
                                 "+v"(a[7]));
            }
        }
    }
    for (auto& v : a) sink = _mm512_add_epi32(sink, v);
    _tile_stored(0, sums, 4);
    return steps;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: %s ROWS K REPEATS PREFETCH(0|1)\n", argv[0]);
        return 2;
    }
    const long rows = std::atol(argv[1]), k = std::atol(argv[2]);
    const int repeats = std::atoi(argv[3]);
    const bool prefetch = std::atoi(argv[4]) != 0;
    if (rows < 32 || k < 64 || k % 64 != 0 || k > 16384 || repeats < 1) {
        std::fprintf(stderr, "ROWS >= 32, K a multiple of 64 up to 16384, REPEATS >= 1\n");
        return 2;
    }
    std::string why;
    if (!numa_moe::request_amx_permission(&why)) {
        std::fprintf(stderr, "no AMX: %s\n", why.c_str());
        return 1;
    }
    std::vector<int8_t> storage(static_cast<size_t>(rows) * k + 64);
    int8_t* w = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    for (long i = 0; i < rows * k; ++i) w[i] = static_cast<int8_t>(i * 7);
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t : {0, 2}) cfg.rows[t] = 16, cfg.colsb[t] = 4;  // C: 16 rows x 1 token
    for (int t : {4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // A: 16 rows x 64 columns
    cfg.rows[6] = 16, cfg.colsb[6] = 4;                        // B: 64 columns x 1 token
    TILE_LOADCONFIG(&cfg);
    _tile_zero(0);
    _tile_zero(2);
    for (int work : {0, 2, 4, 8, 12, 16, 24}) {
        double best = 1e30;
        long steps = 0;
        for (int i = 0; i < repeats; ++i) {
            const double start = now();
            steps = walk(w, rows, k, work, prefetch);
            best = std::min(best, now() - start);
        }
        std::printf("work %2d: %6.1f ns a step, %6.1f GB/s\n", work, best / steps * 1e9, rows / 32 * 32 * k / best / 1e9);
    }
    _tile_release();
    return 0;
}
