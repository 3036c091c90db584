// The AMX tile operations of the AMX sources, each compiled twice: for real (-mamx-tile with
// -mamx-bf16 / -mamx-int8) and with -DNUMA_MOE_AMX_MODEL against the software model
// (amx_model.hpp), so that the kernels' logic runs and is tested on CPUs without AMX.
// Include it before the kernel's namespace.
#pragma once

#include <cstdint>
#include <cstring>

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

// GCC 12's intrinsics under-declare what three tile instructions read: _tile_loadconfig's
// asm names 8 of LDTILECFG's 64 bytes, and _tile_loadd / _tile_stream_loadd name no memory
// at all. Dead-store elimination then drops the stores of rows and colsb (LDTILECFG loads
// an empty palette and the next tile instruction raises #UD, SIGILL), and may drop or sink
// stores into a buffer that only tile loads read (the int4 kernels' staging rows). These
// say what the instructions read: the whole configuration, and any memory for the strided
// loads (their footprint has no fixed shape to name).
namespace numa_moe::kernels::amx_tiles {
inline void load_tile_config(const TileConfig* cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(*cfg)); }
}  // namespace numa_moe::kernels::amx_tiles

// `t` is expanded by the outer macro before it is pasted into the instruction text.
#define NUMA_MOE_TILE_LOAD_ASM(insn, t, base, stride)                                    \
    __asm__ volatile("{" insn "\t(%0,%1,1), %%tmm" #t "|" insn "\t%%tmm" #t ", [%0+%1*1]}" \
                     ::"r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride))  \
                     : "memory")
#define TILE_LOADCONFIG(cfg) ::numa_moe::kernels::amx_tiles::load_tile_config(cfg)
#define TILE_LOADD(t, base, stride) NUMA_MOE_TILE_LOAD_ASM("tileloadd", t, base, stride)
#define TILE_STREAM_LOADD(t, base, stride) NUMA_MOE_TILE_LOAD_ASM("tileloaddt1", t, base, stride)
#define TILE_STORED(t, base, stride) _tile_stored(t, base, stride)  // declares a memory clobber
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#endif

// The expert matmuls' tiles: a 2 x 2 block of C (tmm0..3), A in tmm4/5, B in tmm6/7.
// Register numbers are macros because the tile instructions are asm text ("%%tmm" #n) and
// so need literal digits.
#define kC00 0
#define kC01 1
#define kC10 2
#define kC11 3
#define kA0 4
#define kA1 5
#define kB0 6
#define kB1 7

namespace numa_moe::kernels::amx_tiles {
namespace {

// The configuration of that block: C tiles rows[i] x tokens[j] 32-bit values, A tiles
// rows[i] x a_bytes, B tiles b_rows x tokens[j] 32-bit lanes; a tile without rows or
// columns stays unconfigured (zero).
inline TileConfig block_config(const int rows[2], const int tokens[2], int a_bytes, int b_rows) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    auto set = [&](int tile, int tile_rows, int colsb) {
        if (tile_rows == 0 || colsb == 0) return;
        cfg.rows[tile] = static_cast<uint8_t>(tile_rows);
        cfg.colsb[tile] = static_cast<uint16_t>(colsb);
    };
    set(kC00, rows[0], 4 * tokens[0]);
    set(kC01, rows[0], 4 * tokens[1]);
    set(kC10, rows[1], 4 * tokens[0]);
    set(kC11, rows[1], 4 * tokens[1]);
    set(kA0, rows[0], a_bytes);
    set(kA1, rows[1], a_bytes);
    set(kB0, b_rows, 4 * tokens[0]);
    set(kB1, b_rows, 4 * tokens[1]);
    return cfg;
}

}  // namespace
}  // namespace numa_moe::kernels::amx_tiles
