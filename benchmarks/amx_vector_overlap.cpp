// Whether tdpbssd and vector work run side by side: one thread, no memory traffic. Per
// iteration: T = four tdpbssd into four C tiles (the AMX-INT8 kernels' 2 x 2 block, operands already in tiles, B tiles of N tokens), and/or
// V = V vectors of the integer kernels' fp32 epilogue (convert an int32 dot, multiply by
// a scale product, add to an accumulator: a load and four floating-point operations,
// sixteen accumulators). Prints ns per iteration for T alone, V alone and both; were
// the two overlapped, both would take the longer of the two. Not part of the library.
//
//   g++ -O2 -std=c++17 -ffp-contract=off -mamx-tile -mamx-int8 -mavx512f -Inative
//       benchmarks/amx_vector_overlap.cpp native/common/cpu_features.cpp -o /tmp/amx_vector
//   /tmp/amx_vector [ITERATIONS]   (default 2000000; rounds of N = 1, 8, 16 tokens and V = 16, 32, 64)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/cpu_features.hpp"
#include "kernels/amx_tiles.hpp"

namespace {

using numa_moe::kernels::amx_tiles::TileConfig;

alignas(64) int8_t operand[4][16 * 64];

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void configure(int tokens) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16;
    for (int t = 0; t < 4; ++t) cfg.colsb[t] = static_cast<uint16_t>(4 * tokens);  // C
    cfg.colsb[4] = cfg.colsb[5] = 64;                                               // A
    cfg.colsb[6] = cfg.colsb[7] = static_cast<uint16_t>(4 * tokens);                // B
    TILE_LOADCONFIG(&cfg);
    TILE_LOADD(kA0, operand[0], 64);
    TILE_LOADD(kA1, operand[1], 64);
    TILE_LOADD(kB0, operand[2], 64);
    TILE_LOADD(kB1, operand[3], 64);
    TILE_ZERO(kC00);
    TILE_ZERO(kC01);
    TILE_ZERO(kC10);
    TILE_ZERO(kC11);
}

alignas(64) int32_t stored_dots[16][16];  // a stored C tile, as the epilogue reads it

// ns per iteration of four tdpbssd (if `tiles`) and kVectors epilogue vectors, each
// independent of the others as in the kernels: a load of 16 stored dots, convert, the
// scale product, multiply, add into one of 16 accumulators held in registers.
template <int kVectors>
double run(long iterations, bool tiles) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    __m512 sw = _mm512_set1_ps(0.75f), sx = _mm512_set1_ps(0.5f);
    const double t0 = now();
    for (long n = 0; n < iterations; ++n) {
        if (tiles) {
            TILE_DPBSSD(kC00, kA0, kB0);
            TILE_DPBSSD(kC01, kA0, kB1);
            TILE_DPBSSD(kC10, kA1, kB0);
            TILE_DPBSSD(kC11, kA1, kB1);
        }
#pragma GCC unroll 64
        for (int v = 0; v < kVectors; ++v) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(stored_dots[v % 16]));
            acc[v % 16] = _mm512_add_ps(acc[v % 16], _mm512_mul_ps(dot, _mm512_mul_ps(sw, sx)));
            if (v % 16 == 15) __asm__ volatile("" : "+v"(sw), "+v"(sx));  // a new scale product a row
        }
        __asm__ volatile("" ::"r"(stored_dots) : "memory");  // the dots are stored again each time
    }
    const double ns = (now() - t0) * 1e9 / static_cast<double>(iterations);
    float keep = 0.0f;
    for (int i = 0; i < 16; ++i) keep += _mm512_reduce_add_ps(acc[i]);
    if (keep == 1.0f) std::puts("");  // the accumulators are live
    return ns;
}

template <int kVectors>
void report(long iterations, int tokens) {
    double t = 1e30, v = 1e30, both = 1e30;
    for (int round = 0; round < 3; ++round) {  // best of three: the least disturbed
        t = std::min(t, run<0>(iterations, true));
        v = std::min(v, run<kVectors>(iterations, false));
        both = std::min(both, run<kVectors>(iterations, true));
    }
    std::printf("%6d %7d %10.2f %10.2f %10.2f %12.2f\n", tokens, kVectors, t, v, both, t + v - both);
}

}  // namespace

int main(int argc, char** argv) {
    const long iterations = argc > 1 ? std::atol(argv[1]) : 2000000;
    if (iterations <= 0) {
        std::fprintf(stderr, "usage: %s [ITERATIONS > 0]\n", argv[0]);
        return 2;
    }
    std::string why;
    if (!numa_moe::request_amx_permission(&why)) {
        std::fprintf(stderr, "no AMX: %s\n", why.c_str());
        return 1;
    }
    for (int i = 0; i < 4 * 16 * 64; ++i) operand[i / 1024][i % 1024] = static_cast<int8_t>(i * 7);
    for (int i = 0; i < 256; ++i) stored_dots[i / 16][i % 16] = i - 128;
    std::printf("%6s %7s %10s %10s %10s %12s\n", "tokens", "vectors", "tiles ns", "vector ns", "both ns",
                "hidden (ns)");
    for (int tokens : {1, 8, 16}) {
        configure(tokens);
        report<16>(iterations, tokens);
        report<32>(iterations, tokens);
        report<64>(iterations, tokens);
    }
    _tile_release();
    return 0;
}
