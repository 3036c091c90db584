// fp16 and bf16 bits <-> fp32 (rounding to nearest even, NaN kept quiet), scalar and exact,
// in code any ISA compiles (no F16C): the kernels, the reference and the checkpoint
// conversions share them. Each ISA translation unit gets its own copies
// (isa_namespace.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/isa_namespace.hpp"

namespace numa_moe {
inline namespace NUMA_MOE_ISA_NS {

inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
        const float value = static_cast<float>(mantissa) * 0x1p-24f;
        std::memcpy(&bits, &value, sizeof(bits));
    } else if (exponent == 31) {
        bits = mantissa ? 0x7fc00000u : 0x7f800000u;  // NaN (quiet), infinity
    } else {
        bits = (exponent + 112) << 23 | mantissa << 13;  // rebias 15 -> 127
    }
    bits |= sign;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

// The nearest fp16, ties to even (as numpy's astype(float16)): beyond 65504 (from 65520,
// the midpoint to 2^16) infinity, below 2^-14 a subnormal multiple of 2^-24.
inline uint16_t float_to_fp16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: infinity
    uint32_t kept, dropped, shift;
    if (magnitude >= 0x38800000u) {  // a normal fp16: rebias the exponent, drop 13 bits
        kept = (magnitude >> 13) - (112u << 10);
        shift = 13;
        dropped = magnitude & 0x1fffu;
    } else {  // a subnormal fp16 (or zero): the float's significand in units of 2^-24
        const uint32_t exponent = magnitude >> 23;
        shift = 126 - exponent;  // >= 14
        if (exponent == 0 || shift > 24) return sign;  // below 2^-25: rounds to zero
        const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
        kept = significand >> shift;
        dropped = significand & ((1u << shift) - 1);
    }
    const uint32_t half = 1u << (shift - 1);
    if (dropped > half || (dropped == half && (kept & 1u))) ++kept;  // a carry moves to the next binade
    return static_cast<uint16_t>(sign | kept);
}

inline float bf16_to_float(uint16_t value) {
    const uint32_t bits = static_cast<uint32_t>(value) << 16;
    float result;
    std::memcpy(&result, &bits, sizeof(result));
    return result;
}

// Branch-free, so that loops over it (floats_to_bf16) vectorise in baseline code.
inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace NUMA_MOE_ISA_NS
}  // namespace numa_moe
