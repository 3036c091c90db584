// The nibble formats' codebooks (docs/quantization.md): the integer each 4-bit code of a
// weight stands for, and the e8m0 scale decoding that goes with mxfp4's.
//
//   int4   two's complement: codes 0-7 are 0..7, codes 8-15 are -8..-1
//   mxfp4  twice the OCP e2m1 value: {0, 1, 2, 3, 4, 6, 8, 12} and their negatives (codes
//          8-15), so that every code is an integer and a group's dot product stays exact
//          in int32; its e8m0 scales decode to half their OCP value, 2^(e - 128), so that
//          scale * code is the OCP element 2^(e - 127) * e2m1 exactly.
//   iq4nl  llama.cpp's IQ4_NL codebook (ggml's kvalues_iq4nl), non-uniform int8 values
//          in [-127, 113]; the scales are the format's float scales as they are.
//   int4_affine  unsigned: code q is q in [0, 15] (its group's minimum adds the rest, w =
//          s * q + m; group_minimums.hpp). Already unsigned: bias 0.
//
// The SIMD kernels feed the codes to u8 x s8 instructions (vpmaddubsw, vpdpbusd) as the
// unsigned operand code_value + kBias, and take the bias back with each token's
// bias * sum(x) per group; AMX's s8 x s8 takes the signed values. iq4nl's biased values
// reach 240, too large for vpmaddubsw's int16 pair sums: AVX2 without VNNI takes its
// signed values with the int8 weights' sign trick instead (avx2_quant.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/isa_namespace.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {
// In each ISA's own namespace: the tables are inline variables, which would otherwise be
// weak symbols shared by the ISA objects (isa_namespace.hpp).
inline namespace NUMA_MOE_ISA_NS {

template <Format F>
struct NibbleCodes;

template <>
struct NibbleCodes<Format::int4> {
    alignas(16) static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
    static constexpr int8_t kBias = 8;
};

template <>
struct NibbleCodes<Format::mxfp4> {
    alignas(16) static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    static constexpr int8_t kBias = 12;
};

template <>
struct NibbleCodes<Format::iq4nl> {
    alignas(16) static constexpr int8_t kValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                       1,    13,   25,  38,  53,  69,  89,  113};
    static constexpr int8_t kBias = 127;
};

template <>
struct NibbleCodes<Format::int4_affine> {
    alignas(16) static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static constexpr int8_t kBias = 0;
};

// The codes' unsigned operand value + kBias, as a 16-byte lookup table (vpshufb).
template <Format F>
struct BiasedCodes {
    alignas(16) uint8_t bytes[16];
    constexpr BiasedCodes() : bytes() {
        for (int i = 0; i < 16; ++i) bytes[i] = static_cast<uint8_t>(NibbleCodes<F>::kValues[i] + NibbleCodes<F>::kBias);
    }
};
template <Format F>
constexpr BiasedCodes<F> kBiasedCodes{};

// The fp32 value of an e8m0 scale byte of mxfp4 weights: 2^(e - 128) (exact: at least
// 2^-128, a subnormal). 0xFF (NaN in the OCP spec) never reaches a kernel: the bindings
// refuse it.
inline float e8m0_scale(uint8_t e) { return std::ldexp(1.0f, static_cast<int>(e) - 128); }

}  // namespace NUMA_MOE_ISA_NS
}  // namespace numa_moe::kernels
