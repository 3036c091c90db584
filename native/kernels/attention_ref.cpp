// Scalar reference of the decode-attention kernel: the specification of AttentionOps,
// written for clarity, and the portable path of CPUs without AVX-512-BF16. Baseline x86-64.
//
// Operand layouts (attention_api.hpp):
//   query  packed = plain rows q[i * d + c] bf16 (pack_query copies)
//   k, v   k[t * d + c], v[t * d + c] bf16 cache rows
//   state  m[i], l[i], o[i * d + c] fp32
//   scratch scores s[i * kAttentionChunk + t] fp32
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/attention_api.hpp"
#include "kernels/bf16.hpp"

namespace numa_moe::kernels {
namespace {

size_t query_bytes(int64_t g, int64_t d) { return static_cast<size_t>(g * d) * sizeof(bf16); }
size_t scratch_bytes(int64_t g, int64_t) { return static_cast<size_t>(g * kAttentionChunk) * sizeof(float); }

void pack_query(const bf16* q, int64_t g, int64_t d, void* packed) { std::memcpy(packed, q, query_bytes(g, d)); }

void attend(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n, float scale,
            const AttentionState& st, void* scratch) {
    const bf16* q = static_cast<const bf16*>(packed_query);
    float* s = static_cast<float*>(scratch);
    for (int64_t t0 = 0; t0 < n; t0 += kAttentionChunk) {
        const int64_t nc = n - t0 < kAttentionChunk ? n - t0 : kAttentionChunk;
        for (int64_t i = 0; i < g; ++i) {
            float* si = s + i * kAttentionChunk;
            float chunk_max = -std::numeric_limits<float>::infinity();
            for (int64_t t = 0; t < nc; ++t) {
                const bf16* kt = k + (t0 + t) * d;
                float dot = 0.0f;
                for (int64_t c = 0; c < d; ++c) dot += bf16_to_float(q[i * d + c]) * bf16_to_float(kt[c]);
                si[t] = dot * scale;
                chunk_max = std::fmax(chunk_max, si[t]);
            }
            const float m_new = std::fmax(st.m[i], chunk_max);
            const float alpha = std::exp(st.m[i] - m_new);  // 0 for the first run (m = -inf)
            float sum = 0.0f;
            for (int64_t t = 0; t < nc; ++t) {
                si[t] = std::exp(si[t] - m_new);
                sum += si[t];
            }
            st.m[i] = m_new;
            st.l[i] = st.l[i] * alpha + sum;
            float* oi = st.o + i * d;
            for (int64_t c = 0; c < d; ++c) oi[c] *= alpha;
            for (int64_t t = 0; t < nc; ++t) {
                const bf16* vt = v + (t0 + t) * d;
                for (int64_t c = 0; c < d; ++c) oi[c] += si[t] * bf16_to_float(vt[c]);
            }
        }
    }
}

}  // namespace

const AttentionOps& attention_ref_ops() {
    static const AttentionOps ops{Isa::ref, "ref", query_bytes, scratch_bytes, pack_query, attend};
    return ops;
}

}  // namespace numa_moe::kernels
