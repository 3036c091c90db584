// The AMX software model (amx_model.hpp): baseline x86-64 code.
#include "kernels/amx_model.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace numa_moe::amx_model {
namespace {


constexpr int kTiles = 8;
constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

struct TileState {
    bool configured = false;
    uint16_t colsb[kTiles] = {};
    uint8_t rows[kTiles] = {};
    alignas(64) uint8_t data[kTiles][kMaxRows][kMaxColsb] = {};
};

TileState& tile_state() {
    static thread_local TileState state;
    return state;
}

InstructionCounts& counts() {
    static thread_local InstructionCounts c;
    return c;
}

[[noreturn]] void fault(const char* instruction, const std::string& rule) {
    throw std::runtime_error(std::string("AMX model: ") + instruction + " faults (#UD/#GP): " + rule);
}

void check_tile(const char* instruction, int tile) {
    const TileState& s = tile_state();
    if (!s.configured) fault(instruction, "tiles not configured (no LDTILECFG)");
    if (tile < 0 || tile >= kTiles) fault(instruction, "tile register tmm" + std::to_string(tile) + " does not exist");
    if (s.rows[tile] == 0) fault(instruction, "tmm" + std::to_string(tile) + " is not configured (rows = 0)");
}

}  // namespace

InstructionCounts instruction_counts() { return counts(); }
void reset_instruction_counts() { counts() = InstructionCounts{}; }

void _tile_release() { tile_state() = TileState{}; }

void _tile_loadconfig(const void* config) {
    const uint8_t* raw = static_cast<const uint8_t*>(config);
    const uint8_t palette = raw[0];
    if (palette == 0) {  // palette 0 = INIT state, same as TILERELEASE
        _tile_release();
        return;
    }
    if (palette != 1) fault("LDTILECFG", "palette " + std::to_string(palette) + " is not supported (only 1)");
    if (raw[1] != 0) fault("LDTILECFG", "start_row must be 0");
    for (int i = 2; i < 16; ++i)
        if (raw[i] != 0) fault("LDTILECFG", "reserved byte " + std::to_string(i) + " is not zero");
    uint16_t colsb[16];
    std::memcpy(colsb, raw + 16, sizeof(colsb));
    const uint8_t* rows = raw + 48;
    for (int t = 0; t < 16; ++t) {
        const std::string name = "tmm" + std::to_string(t);
        if (t >= kTiles) {
            if (colsb[t] != 0 || rows[t] != 0) fault("LDTILECFG", name + " does not exist in palette 1 (must be 0)");
            continue;
        }
        if (rows[t] > kMaxRows) fault("LDTILECFG", name + " rows " + std::to_string(rows[t]) + " > 16");
        if (colsb[t] > kMaxColsb) fault("LDTILECFG", name + " colsb " + std::to_string(colsb[t]) + " > 64");
        if ((rows[t] == 0) != (colsb[t] == 0)) fault("LDTILECFG", name + " has rows == 0 xor colsb == 0");
    }
    TileState& s = tile_state();
    s = TileState{};
    s.configured = true;
    ++counts().loadconfig;
    for (int t = 0; t < kTiles; ++t) {
        s.rows[t] = rows[t];
        s.colsb[t] = colsb[t];
    }
}

void _tile_loadd(int dst, const void* base, long stride) {
    check_tile("TILELOADD", dst);
    ++counts().loads;
    TileState& s = tile_state();
    const uint8_t* src = static_cast<const uint8_t*>(base);
    std::memset(s.data[dst], 0, sizeof(s.data[dst]));
    for (int r = 0; r < s.rows[dst]; ++r) std::memcpy(s.data[dst][r], src + r * stride, s.colsb[dst]);
}

// TILELOADDT1 differs only in its cache hint.
void _tile_stream_loadd(int dst, const void* base, long stride) {
    _tile_loadd(dst, base, stride);
    ++counts().stream_loads;
}

void _tile_stored(int src, void* base, long stride) {
    check_tile("TILESTORED", src);
    ++counts().stores;
    const TileState& s = tile_state();
    uint8_t* dst = static_cast<uint8_t*>(base);
    for (int r = 0; r < s.rows[src]; ++r) std::memcpy(dst + r * stride, s.data[src][r], s.colsb[src]);
}

void _tile_zero(int dst) {
    check_tile("TILEZERO", dst);
    ++counts().zeros;
    std::memset(tile_state().data[dst], 0, sizeof(tile_state().data[dst]));
}

// Shape rules shared by the dot-product instructions (SDM exception class AMX-E4).
static void check_dot_shapes(const char* instruction, int dst, int a, int b) {
    check_tile(instruction, dst);
    check_tile(instruction, a);
    check_tile(instruction, b);
    if (dst == a || dst == b || a == b) fault(instruction, "source and destination tiles must all differ");
    const TileState& s = tile_state();
    if (s.colsb[dst] % 4 || s.colsb[a] % 4 || s.colsb[b] % 4) fault(instruction, "colsb must be a multiple of 4");
    if (s.rows[dst] != s.rows[a]) fault(instruction, "dst.rows != src1.rows");
    if (s.colsb[a] / 4 != s.rows[b]) fault(instruction, "src1.colsb / 4 != src2.rows");
    if (s.colsb[dst] != s.colsb[b]) fault(instruction, "dst.colsb != src2.colsb");
}

static float daz_bf16(uint16_t value) {
    if ((value & 0x7f80u) == 0) value &= 0x8000u;  // denormal (or zero) input -> signed zero
    const uint32_t bits = static_cast<uint32_t>(value) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

static float ftz(float value) { return std::fpclassify(value) == FP_SUBNORMAL ? std::copysign(0.0f, value) : value; }

void _tile_dpbf16ps(int dst, int a, int b) {
    check_dot_shapes("TDPBF16PS", dst, a, b);
    ++counts().dpbf16ps;
    TileState& s = tile_state();
    const int pairs = s.colsb[a] / 4, columns = s.colsb[dst] / 4;
    for (int m = 0; m < s.rows[dst]; ++m) {
        float temp[2 * kMaxColsb / 4] = {};
        const uint16_t* a_row = reinterpret_cast<const uint16_t*>(s.data[a][m]);
        for (int k = 0; k < pairs; ++k) {
            const uint16_t* b_row = reinterpret_cast<const uint16_t*>(s.data[b][k]);
            for (int n = 0; n < columns; ++n) {
                temp[2 * n] = ftz(std::fma(daz_bf16(a_row[2 * k]), daz_bf16(b_row[2 * n]), temp[2 * n]));
                temp[2 * n + 1] = ftz(std::fma(daz_bf16(a_row[2 * k + 1]), daz_bf16(b_row[2 * n + 1]), temp[2 * n + 1]));
            }
        }
        float* c_row = reinterpret_cast<float*>(s.data[dst][m]);
        for (int n = 0; n < columns; ++n) c_row[n] = ftz(c_row[n] + ftz(temp[2 * n] + temp[2 * n + 1]));
    }
}

void _tile_dpbssd(int dst, int a, int b) {
    check_dot_shapes("TDPBSSD", dst, a, b);
    ++counts().dpbssd;
    TileState& s = tile_state();
    const int quads = s.colsb[a] / 4, columns = s.colsb[dst] / 4;
    for (int m = 0; m < s.rows[dst]; ++m) {
        const int8_t* a_row = reinterpret_cast<const int8_t*>(s.data[a][m]);
        int32_t* c_row = reinterpret_cast<int32_t*>(s.data[dst][m]);
        for (int k = 0; k < quads; ++k) {
            const int8_t* b_row = reinterpret_cast<const int8_t*>(s.data[b][k]);
            for (int n = 0; n < columns; ++n) {
                int32_t dot = 0;
                for (int i = 0; i < 4; ++i) dot += int32_t(a_row[4 * k + i]) * int32_t(b_row[4 * n + i]);
                c_row[n] = static_cast<int32_t>(static_cast<uint32_t>(c_row[n]) + static_cast<uint32_t>(dot));
            }
        }
    }
}


void tile_dot(const void* config, bool int8, void* c, const void* a, const void* b) {
    _tile_loadconfig(config);
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    if (int8)
        _tile_dpbssd(0, 1, 2);
    else
        _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
}

}  // namespace numa_moe::amx_model
