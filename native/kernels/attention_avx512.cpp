// AVX-512-BF16 decode attention: q.k with vdpbf16ps over bf16 pairs of the plain cache
// rows, softmax in fp32 (exp512), P.V with fp32 FMAs (P stays fp32).
//
// Operand layouts (attention_api.hpp):
//   query  packed = plain rows q[i * d + c] bf16
//   k, v   k[t * d + c], v[t * d + c] bf16 cache rows, read as they are
//   state  m[i], l[i], o[i * d + c] fp32
//   scratch scores s[i * kAttentionChunk + t] fp32
#include <immintrin.h>

#include <cstring>

#include "kernels/attention_api.hpp"
#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"

namespace numa_moe::kernels {
namespace {

size_t query_bytes(int64_t g, int64_t d) { return static_cast<size_t>(g * d) * sizeof(bf16); }
size_t scratch_bytes(int64_t g, int64_t) { return static_cast<size_t>(g * kAttentionChunk) * sizeof(float); }

void pack_query(const bf16* q, int64_t g, int64_t d, void* packed) { std::memcpy(packed, q, query_bytes(g, d)); }

inline __m512 bf16x16_to_ps(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// s[i][t] = scale * q_i . k_t for t < nc.
template <int D>
void scores(const bf16* q, int64_t g, const bf16* k, int64_t nc, float scale, float* s) {
    constexpr int kVecs = D / 32;
    for (int64_t t = 0; t < nc; ++t) {
        __m512bh kt[kVecs];
        for (int j = 0; j < kVecs; ++j) kt[j] = (__m512bh)_mm512_loadu_si512(k + t * D + 32 * j);
        for (int64_t i = 0; i < g; ++i) {
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < kVecs; ++j)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i * D + 32 * j), kt[j]);
            s[i * kAttentionChunk + t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

// The online-softmax step of query i over s[0, nc): s becomes p = e^(s - m'); returns alpha.
float softmax_row(float* s, int64_t nc, float* m, float* l) {
    __m512 vmax = _mm512_set1_ps(*m);
    for (int64_t t = 0; t < nc; t += 16)
        vmax = _mm512_mask_max_ps(vmax, tail_mask16(nc - t), vmax, _mm512_loadu_ps(s + t));
    const float m_new = _mm512_reduce_max_ps(vmax);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nc; t += 16) {
        const __mmask16 mask = tail_mask16(nc - t);
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vm)));
        _mm512_storeu_ps(s + t, p);
        vsum = _mm512_add_ps(vsum, p);
    }
    const float alpha = *m == -__builtin_inff() ? 0.0f : _mm512_cvtss_f32(exp512(_mm512_set1_ps(*m - m_new)));
    *m = m_new;
    *l = *l * alpha + _mm512_reduce_add_ps(vsum);
    return alpha;
}

// o_i = alpha o_i + sum_t p[t] v_t.
template <int D>
void accumulate_pv(const float* p, int64_t nc, float alpha, const bf16* v, float* o) {
    constexpr int kVecs = D / 16;
    __m512 acc[kVecs];
    const __m512 va = _mm512_set1_ps(alpha);
    for (int j = 0; j < kVecs; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), va);
    for (int64_t t = 0; t < nc; ++t) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int j = 0; j < kVecs; ++j) acc[j] = _mm512_fmadd_ps(pt, bf16x16_to_ps(v + t * D + 16 * j), acc[j]);
    }
    for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(o + 16 * j, acc[j]);
}

template <int D>
void attend_d(const bf16* q, int64_t g, const bf16* k, const bf16* v, int64_t n, float scale,
              const AttentionState& st, float* s) {
    for (int64_t t0 = 0; t0 < n; t0 += kAttentionChunk) {
        const int64_t nc = n - t0 < kAttentionChunk ? n - t0 : kAttentionChunk;
        scores<D>(q, g, k + t0 * D, nc, scale, s);
        for (int64_t i = 0; i < g; ++i) {
            float* si = s + i * kAttentionChunk;
            const float alpha = softmax_row(si, nc, st.m + i, st.l + i);
            accumulate_pv<D>(si, nc, alpha, v + t0 * D, st.o + i * D);
        }
    }
}

void attend(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n, float scale,
            const AttentionState& st, void* scratch) {
    const bf16* q = static_cast<const bf16*>(packed_query);
    float* s = static_cast<float*>(scratch);
    switch (d) {
        case 64: attend_d<64>(q, g, k, v, n, scale, st, s); break;
        case 128: attend_d<128>(q, g, k, v, n, scale, st, s); break;
        case 256: attend_d<256>(q, g, k, v, n, scale, st, s); break;
        default: break;  // the driver admits only attention_head_dim_supported sizes
    }
}

}  // namespace

const AttentionOps& attention_avx512_ops() {
    static const AttentionOps ops{Isa::avx512, "avx512", query_bytes, scratch_bytes, pack_query, attend};
    return ops;
}

}  // namespace numa_moe::kernels
