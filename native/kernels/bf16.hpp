// bf16 rows <-> fp32 (the scalar conversions: common/fp16.hpp) and the activation, shared
// by every kernel translation unit; each ISA gets its own copies (isa_namespace.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/fp16.hpp"
#include "common/isa_namespace.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {
inline namespace NUMA_MOE_ISA_NS {

inline void floats_to_bf16(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// The activation of kernel_api.hpp's Activation on one gate / up pair (biases added). The
// clamps are written so that a NaN passes through them.
inline float activate(float g, float u, const Activation& a) {
    g = g > a.limit ? a.limit : g;
    u = u > a.limit ? a.limit : u < -a.limit ? -a.limit : u;
    return g / (1.0f + std::exp(-(a.alpha * g))) * (u + a.up_offset);
}

// The activation the scalar epilogues compute for row i and token t: the node parts summed
// in order 0..n_parts-1, the biases, then activate.
inline float activation_at(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                           int64_t i, int64_t t, const ExpertEpilogue& e) {
    float g = 0.0f, u = 0.0f;
    for (int p = 0; p < n_parts; ++p) {
        g += gate_parts[p][i * ld + t];
        u += up_parts[p][i * ld + t];
    }
    if (e.gate_bias) g += e.gate_bias[i];
    if (e.up_bias) u += e.up_bias[i];
    return activate(g, u, e.activation);
}

// The activation silu_mul_pack quantizes, for rows [i0, i0 + n) of token t. One
// expression for every integer table that does not vectorise it (ref, avx2), so that they
// quantize the same values bit for bit.
inline void silu_mul_rows(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                          int64_t i0, int64_t n, int64_t t, const ExpertEpilogue& e, float* out) {
    for (int64_t j = 0; j < n; ++j) out[j] = activation_at(gate_parts, up_parts, n_parts, ld, i0 + j, t, e);
}

}  // namespace NUMA_MOE_ISA_NS
}  // namespace numa_moe::kernels
