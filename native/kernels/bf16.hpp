// bf16 <-> fp32 conversions (round to nearest even, NaN kept quiet) and the activation,
// shared by every kernel translation unit. Header-only, baseline x86-64.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace numa_moe::kernels {

inline float bf16_to_float(uint16_t value) {
    const uint32_t bits = static_cast<uint32_t>(value) << 16;
    float result;
    std::memcpy(&result, &bits, sizeof(result));
    return result;
}

inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace numa_moe::kernels
