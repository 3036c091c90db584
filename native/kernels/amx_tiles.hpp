// The AMX tile operations of the AMX kernel sources, each compiled twice: for real
// (-mamx-tile with -mamx-bf16 / -mamx-int8: the intrinsics) and with -DNUMA_MOE_AMX_MODEL
// against the software model (amx_model.hpp), so that the kernels' logic runs and is
// tested on CPUs without AMX. Include it before the kernel's namespace.
#pragma once

#include <cstdint>

#ifdef NUMA_MOE_AMX_MODEL
#include "kernels/amx_model.hpp"
#define TILE_LOADCONFIG(cfg) ::numa_moe::amx_model::_tile_loadconfig(cfg)
#define TILE_LOADD(t, base, stride) ::numa_moe::amx_model::_tile_loadd(t, base, stride)
#define TILE_STREAM_LOADD(t, base, stride) ::numa_moe::amx_model::_tile_stream_loadd(t, base, stride)
#define TILE_STORED(t, base, stride) ::numa_moe::amx_model::_tile_stored(t, base, stride)
#define TILE_ZERO(t) ::numa_moe::amx_model::_tile_zero(t)
#define TILE_DPBF16PS(c, a, b) ::numa_moe::amx_model::_tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) ::numa_moe::amx_model::_tile_dpbssd(c, a, b)
#else
#include <immintrin.h>
#define TILE_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_LOADD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STREAM_LOADD(t, base, stride) _tile_stream_loadd(t, base, stride)
#define TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#endif

// The expert matmuls' tiles: a 2 x 2 block of C (tmm0..3), A in tmm4/5, B in tmm6/7.
// Register numbers are macros because gcc's intrinsics paste them into the assembly text
// ("%%tmm" #n) and so need literal digits.
#define kC00 0
#define kC01 1
#define kC10 2
#define kC11 3
#define kA0 4
#define kA1 5
#define kB0 6
#define kB1 7

namespace numa_moe::kernels::amx_tiles {

// The 64-byte operand of LDTILECFG (palette 1): rows and bytes per row of tmm0..7.
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

}  // namespace numa_moe::kernels::amx_tiles
