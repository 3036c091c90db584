// Scalar reference kernels of the integer weight formats (docs/quantization.md): the
// specification the SIMD and AMX kernels of int8 / int4 are tested against. Baseline
// x86-64 code.
//
// Operand layouts (kernel_api.hpp):
//   weights  int8 w[r * ld + c]; int4 / mxfp4 / iq4nl: byte (r * ld + c) / 2, the even column in
//            its low nibble, each 4-bit code an integer of the format's codebook
//            (nibble_codes.hpp); scales s[r * scales_ld + c / group] (mxfp4: e8m0)
//   tokens   per token t and block b of G columns (G = the weights' group), symmetric
//            int8: q[t * k + c] (m * k bytes, padded to 64), then fp32
//            scale[t * (k / G) + b] with x ~= scale * q; k is a multiple of G; formats with
//            minimums then the group sums X[t * (k / G) + b] (group_minimums.hpp)
//   partials out[r * ldo + t] fp32: per segment, the sum over its groups of int32 dot *
//            (s_w * s_x), in fp32; formats with minimums then the segment's minimum terms
//            (group_minimums.hpp)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/fp16.hpp"
#include "kernels/bf16.hpp"
#include "kernels/group_minimums.hpp"
#include "kernels/integer_tables.hpp"
#include "kernels/kernel_api.hpp"
#include "kernels/nibble_codes.hpp"

namespace numa_moe::kernels {
namespace {

float weight_scale(const Weights& w, int64_t r, int64_t c) {
    const int64_t index = r * w.scales_ld + c / w.group;
    switch (w.scale_dtype) {
        case ScaleDtype::fp32: return static_cast<const float*>(w.scales)[index];
        case ScaleDtype::fp16: return fp16_to_float(static_cast<const uint16_t*>(w.scales)[index]);
        case ScaleDtype::bf16: return bf16_to_float(static_cast<const uint16_t*>(w.scales)[index]);
        case ScaleDtype::e8m0: return e8m0_scale(static_cast<const uint8_t*>(w.scales)[index]);
    }
    return 0.0f;
}

template <Format F>
int32_t weight_value(const Weights& w, int64_t r, int64_t c) {
    if constexpr (F == Format::int8) {
        return static_cast<const int8_t*>(w.data)[r * w.ld + c];
    } else {
        const uint8_t byte = static_cast<const uint8_t*>(w.data)[(r * w.ld + c) / 2];
        return NibbleCodes<F>::kValues[(c % 2 == 0) ? (byte & 0x0f) : (byte >> 4)];
    }
}

size_t value_bytes(int64_t m, int64_t k) { return (static_cast<size_t>(m * k) + 63) / 64 * 64; }

template <Format F, int64_t G>
size_t packed_bytes(int64_t m, int64_t k) {
    const size_t per_block = has_minimums(F) ? 2 : 1;  // the scale, and the group sum
    return value_bytes(m, k) + per_block * static_cast<size_t>(m * (k / G)) * sizeof(float);
}

int8_t* token_values(void* packed) { return static_cast<int8_t*>(packed); }
float* token_scales(const void* packed, int64_t m, int64_t k) {
    return reinterpret_cast<float*>(const_cast<uint8_t*>(static_cast<const uint8_t*>(packed)) + value_bytes(m, k));
}
template <int64_t G>
float* token_group_sums(const void* packed, int64_t m, int64_t k) {
    return token_scales(packed, m, k) + m * (k / G);
}

// One block of G values -> symmetric int8 with scale amax / 127 (0 for a zero block). A
// block holding a NaN or an infinity gets the scale NaN and values 0, so that every product
// with it, and so the token's whole output, is NaN: the max would drop a NaN (and quantize
// the rest to a plausible number), an infinite amax would make every value 0.
template <int64_t G>
void quantize_block(const float* v, int8_t* q, float* scale) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t j = 0; j < G; ++j) {
        finite = finite && std::isfinite(v[j]);
        amax = std::max(amax, std::fabs(v[j]));
    }
    const float s = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    *scale = s;
    for (int64_t j = 0; j < G; ++j)
        q[j] = s > 0.0f ? static_cast<int8_t>(std::clamp(std::nearbyint(v[j] / s), -127.0f, 127.0f)) : 0;
}

// Token t's block b: its values quantized from v (G floats), its scale, and for formats
// with minimums its group sum.
template <Format F, int64_t G>
void put_block(const float* v, int64_t t, int64_t b, int64_t m, int64_t k, void* packed) {
    int8_t* q = token_values(packed) + t * k + b * G;
    float* scale = token_scales(packed, m, k) + t * (k / G) + b;
    quantize_block<G>(v, q, scale);
    if constexpr (has_minimums(F)) token_group_sums<G>(packed, m, k)[t * (k / G) + b] = token_group_sum<G>(q, *scale);
}

template <Format F, int64_t G>
void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    float block[G];
    for (int64_t t = 0; t < m; ++t) {
        const bf16* row = x + token_index[t] * ldx;
        for (int64_t b = 0; b < k / G; ++b) {
            for (int64_t j = 0; j < G; ++j) block[j] = bf16_to_float(row[b * G + j]);
            put_block<F, G>(block, t, b, m, k, packed);
        }
    }
}

template <Format F, int64_t G>
void matmul_segments(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const int8_t* q = static_cast<const int8_t*>(packed);
    const float* x_scales = token_scales(packed, m, k);
    for (int64_t s = 0; s < n_segments; ++s) {
        const Segment& seg = segments[s];
        for (int64_t j = 0; j < seg.nrows; ++j) {
            const int64_t r = seg.row0 + j * seg.row_stride;
            if (r < row_begin || r >= row_end) continue;
            for (int64_t t = 0; t < m; ++t) {
                float sum = 0.0f;
                for (int64_t c0 = seg.k0; c0 < seg.k1; c0 += G) {
                    int32_t dot = 0;
                    for (int64_t c = c0; c < c0 + G; ++c) dot += weight_value<F>(w, r, c) * q[t * k + c];
                    sum += static_cast<float>(dot) * (weight_scale(w, r, c0) * x_scales[t * (k / G) + c0 / G]);
                }
                out[r * ldo + t] += sum;
            }
            if constexpr (has_minimums(F))
                add_block_minimums(w, seg, j, j + 1, seg.row_stride, token_group_sums<G>(packed, m, k), m, k, out, ldo);
        }
    }
}

template <Format F, int64_t G>
void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    float block[G];
    for (int64_t t = 0; t < m; ++t) {
        for (int64_t b0 = i_begin; b0 < i_end; b0 += G) {
            silu_mul_rows(gate_parts, up_parts, n_parts, ld, b0, G, t, epilogue, block);
            put_block<F, G>(block, t, b0 / G, m, i_total, packed);
        }
    }
}

template <Format F, int64_t G>
const KernelOps& table() {
    static const KernelOps ops{Isa::ref,        "ref",          F,
                               G,               plain_layout,   packed_bytes<F, G>,
                               gather<F, G>,    matmul_segments<F, G>, silu_mul_pack<F, G>,
                               ref_ops().combine_down, ref_ops().store_down};
    return ops;
}

}  // namespace

const KernelOps* ref_integer_ops(Format format, int64_t group) {
    return integer_table(format, group, [](auto f, auto g) -> const KernelOps& {
        return table<decltype(f)::value, decltype(g)::value>();
    });
}

}  // namespace numa_moe::kernels
