// IEEE fp16 bits to fp32, exactly, in baseline x86-64 code (no F16C): the scalar reference
// kernels and the checkpoint conversions share it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace numa_moe {

inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    float value;
    if (exponent == 0) {
        value = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
    } else if (exponent == 31) {
        value = mantissa ? std::nanf("") : INFINITY;
    } else {
        value = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
    }
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    bits |= sign;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

}  // namespace numa_moe
