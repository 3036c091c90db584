// AMX benchmark loops (loops.hpp). Compiled with -mamx-tile -mamx-bf16 -mamx-int8.
//
// Tiles: C in tmm0..3 (16 rows x 16 fp32), A in tmm4/5 (16 rows x 32 bf16), B in tmm6/7
// (16 pair rows x 16 tokens): four independent accumulators, as the kernel's 2 x 2 block.
#include <cstdint>

#include "bench/loops.hpp"
#include "kernels/amx_tiles.hpp"

namespace numa_moe::bench {

namespace {

// Eight 16 x 64-byte tiles, zeroed.
void configure_square_tiles() {
    kernels::amx_tiles::TileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    TILE_LOADCONFIG(&config);
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    TILE_ZERO(4);
    TILE_ZERO(5);
    TILE_ZERO(6);
    TILE_ZERO(7);
}

}  // namespace

double tdpbf16ps_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    configure_square_tiles();
    for (int64_t i = 0; i < iterations; ++i) {
        TILE_DPBF16PS(0, 4, 6);
        TILE_DPBF16PS(1, 4, 7);
        TILE_DPBF16PS(2, 5, 6);
        TILE_DPBF16PS(3, 5, 7);
    }
    alignas(64) float sink[16 * 16];
    TILE_STORED(0, sink, 64);  // keeps the chain observable
    _tile_release();
    return static_cast<double>(iterations) * 4.0 * 2.0 * 16 * 16 * 32;
}

double tdpbssd_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    configure_square_tiles();
    for (int64_t i = 0; i < iterations; ++i) {
        TILE_DPBSSD(0, 4, 6);
        TILE_DPBSSD(1, 4, 7);
        TILE_DPBSSD(2, 5, 6);
        TILE_DPBSSD(3, 5, 7);
    }
    alignas(64) int32_t sink[16 * 16];
    TILE_STORED(0, sink, 64);
    _tile_release();
    return static_cast<double>(iterations) * 4.0 * 2.0 * 16 * 16 * 64;
}

}  // namespace numa_moe::bench
