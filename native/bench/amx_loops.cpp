// AMX benchmark loops (loops.hpp). Compiled with -mamx-tile -mamx-bf16 -mamx-int8.
//
// Tiles: C in tmm0..3 (16 rows x 16 fp32), A in tmm4/5 (16 rows x 32 bf16), B in tmm6/7
// (16 pair rows x 16 tokens): four independent accumulators, as the kernel's 2 x 2 block.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "bench/loops.hpp"

namespace numa_moe::bench {

namespace {

// Eight 16 x 64-byte tiles, zeroed.
void configure_square_tiles() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
        const uint16_t colsb = 64;
        std::memcpy(config + 16 + 2 * t, &colsb, sizeof(colsb));
        config[48 + t] = 16;
    }
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
}

}  // namespace

double tdpbf16ps_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    configure_square_tiles();
    for (int64_t i = 0; i < iterations; ++i) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    alignas(64) float sink[16 * 16];
    _tile_stored(0, sink, 64);  // keeps the chain observable
    _tile_release();
    return static_cast<double>(iterations) * 4.0 * 2.0 * 16 * 16 * 32;
}

double tdpbssd_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    configure_square_tiles();
    for (int64_t i = 0; i < iterations; ++i) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    alignas(64) int32_t sink[16 * 16];
    _tile_stored(0, sink, 64);
    _tile_release();
    return static_cast<double>(iterations) * 4.0 * 2.0 * 16 * 16 * 64;
}

}  // namespace numa_moe::bench
