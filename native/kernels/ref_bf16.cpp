// Scalar reference kernels: the specification of every KernelOps entry, written for
// clarity, not speed. Baseline x86-64 code; runs anywhere.
//
// Operand layouts (see kernel_api.hpp):
//   weights  w[r * ldw + k] bf16 row-major
//   tokens   plain row-major: packed[t * k + c] bf16
//   partials out[r * ldo + t] fp32

#include <cmath>
#include <cstring>

#include "kernels/bf16.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {
namespace {

size_t packed_bytes(int64_t m, int64_t k) { return static_cast<size_t>(m * k) * sizeof(bf16); }

void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    bf16* dst = static_cast<bf16*>(packed);
    for (int64_t t = 0; t < m; ++t) std::memcpy(dst + t * k, x + token_index[t] * ldx, k * sizeof(bf16));
}

void matmul_segments(const Weights& weights, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const bf16* w = static_cast<const bf16*>(weights.data);
    const int64_t ldw = weights.ld;
    const bf16* tokens = static_cast<const bf16*>(packed);
    for (int64_t s = 0; s < n_segments; ++s) {
        const Segment& seg = segments[s];
        for (int64_t j = 0; j < seg.nrows; ++j) {
            const int64_t r = seg.row0 + j * seg.row_stride;
            if (r < row_begin || r >= row_end) continue;
            const bf16* row = w + r * ldw;
            for (int64_t t = 0; t < m; ++t) {
                const bf16* token = tokens + t * k;
                float sum = 0.0f;
                for (int64_t c = seg.k0; c < seg.k1; ++c) sum += bf16_to_float(row[c]) * bf16_to_float(token[c]);
                out[r * ldo + t] += sum;
            }
        }
    }
}

void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    bf16* act = static_cast<bf16*>(packed);
    for (int64_t i = i_begin; i < i_end; ++i)
        for (int64_t t = 0; t < m; ++t)
            act[t * i_total + i] = float_to_bf16(activation_at(gate_parts, up_parts, n_parts, ld, i, t, epilogue));
}

// sum_p parts[p][h * ld + t] in part order, then the bias.
float down_sum(const float* const* parts, int n_parts, int64_t ld, int64_t h, int64_t t, const float* bias) {
    float sum = 0.0f;
    for (int p = 0; p < n_parts; ++p) sum += parts[p][h * ld + t];
    return bias ? sum + bias[h] : sum;
}

void combine_down(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin, int64_t h_end,
                  int64_t m, const int64_t* token_index, const float* token_weight, const float* bias, float* y,
                  int64_t ldy) {
    for (int64_t t = 0; t < m; ++t) {
        float* y_row = y + token_index[t] * ldy;
        for (int64_t h = h_begin; h < h_end; ++h) y_row[h] += token_weight[t] * down_sum(parts, n_parts, ld, h, t, bias);
    }
}

void store_down(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin, int64_t h_end, int64_t m,
                const float* bias, void* out, int64_t ldo, bool out_bf16) {
    for (int64_t t = 0; t < m; ++t) {
        for (int64_t h = h_begin; h < h_end; ++h) {
            const float sum = down_sum(parts, n_parts, ld, h, t, bias);
            if (out_bf16)
                static_cast<bf16*>(out)[t * ldo + h] = float_to_bf16(sum);
            else
                static_cast<float*>(out)[t * ldo + h] = sum;
        }
    }
}

}  // namespace

const KernelOps& ref_ops() {
    static const KernelOps ops{Isa::ref,      "ref",        Format::bf16, 0, plain_layout, packed_bytes, gather, matmul_segments,
                               silu_mul_pack, combine_down, store_down};
    return ops;
}

}  // namespace numa_moe::kernels
