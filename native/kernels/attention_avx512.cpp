// AVX-512-BF16 decode attention. Both products run on vdpbf16ps with position lanes, so
// no horizontal sums: per 64-position chunk the K rows are transposed (as 32-bit bf16
// pairs, 16 x 16 at a time) into pair-major order in L1, and the V rows are interleaved two
// by two (vpermt2w); the queries stay plain rows and are broadcast a pair at a time.
//
// Operand layouts (attention_api.hpp):
//   query   packed = plain rows q[i * d + c] bf16
//   k, v    k[t * d + c], v[t * d + c] bf16 cache rows, read as they are
//   state   m[i], l[i], o[i * d + c] fp32
//   scratch s[i][64] fp32 scores, then p[i][64] bf16 (rounded probabilities), and one
//           L1 area for the chunk's K pairs kt[c / 2][t] (32-bit) or V pairs
//           vp[t / 2][2c + t % 2] (bf16)
// Precision: P is rounded to bf16 for P.V and l sums the rounded values (as on AMX).
#include <immintrin.h>

#include <cstring>

#include "kernels/attention_api.hpp"
#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"

namespace numa_moe::kernels {
namespace {

constexpr int64_t kChunk = kAttentionChunk;
constexpr int64_t kScoresBytes = kMaxQueryBlock * kChunk * 4;
constexpr int64_t kProbsBytes = kMaxQueryBlock * kChunk * 2;

size_t query_bytes(int64_t g, int64_t d) { return static_cast<size_t>(g * d) * sizeof(bf16); }
// scores + probabilities + the pair area (kChunk positions x d bf16)
size_t scratch_bytes(int64_t, int64_t d) { return static_cast<size_t>(kScoresBytes + kProbsBytes + kChunk * d * 2); }

void pack_query(const bf16* q, int64_t g, int64_t d, void* packed) { std::memcpy(packed, q, query_bytes(g, d)); }

inline __m512bh pair_broadcast(const bf16* p) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// kt[p * kChunk + t] = pair p of row t (rows >= nc zero), 32-bit elements.
template <int D>
void transpose_k(const bf16* k, int64_t nc, float* kt) {
    for (int64_t t0 = 0; t0 < kChunk; t0 += 16) {
        if (t0 >= nc) {
            for (int64_t p = 0; p < D / 2; ++p) _mm512_store_ps(kt + p * kChunk + t0, _mm512_setzero_ps());
            continue;
        }
        for (int64_t c = 0; c < D / 32; ++c) {
            __m512 rows[16];
            for (int64_t r = 0; r < 16; ++r)
                rows[r] = t0 + r < nc ? _mm512_castsi512_ps(_mm512_loadu_si512(k + (t0 + r) * D + 32 * c))
                                      : _mm512_setzero_ps();
            transpose16(rows);
            for (int64_t j = 0; j < 16; ++j) _mm512_store_ps(kt + (16 * c + j) * kChunk + t0, rows[j]);
        }
    }
}

// s[i][t] = scale * q_i . k_t for the chunk (all 64 lanes; rows >= nc give 0).
template <int D>
void scores(const bf16* q, int64_t g, const float* kt, float scale, float* s) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < g; ++i) {
        __m512 acc[8];
        for (int a = 0; a < 8; ++a) acc[a] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; p += 2) {
            const __m512bh q0 = pair_broadcast(q + i * D + 2 * p), q1 = pair_broadcast(q + i * D + 2 * p + 2);
            for (int b = 0; b < 4; ++b) {
                acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_load_ps(kt + p * kChunk + 16 * b), q0);
                acc[4 + b] = _mm512_dpbf16_ps(acc[4 + b], (__m512bh)_mm512_load_ps(kt + (p + 1) * kChunk + 16 * b), q1);
            }
        }
        for (int b = 0; b < 4; ++b)
            _mm512_storeu_ps(s + i * kChunk + 16 * b, _mm512_mul_ps(_mm512_add_ps(acc[b], acc[4 + b]), vscale));
    }
}

// The online-softmax step of query i over s[0, nc): probs = bf16(e^(s - m')) (zero beyond
// nc, up to kChunk); m and l updated with the rounded values; returns alpha = e^(m - m').
float softmax_row(const float* s, int64_t nc, float* m, float* l, bf16* probs) {
    __m512 vmax = _mm512_set1_ps(*m);
    for (int64_t t = 0; t < nc; t += 16)
        vmax = _mm512_mask_max_ps(vmax, tail_mask16(nc - t), vmax, _mm512_loadu_ps(s + t));
    const float m_new = _mm512_reduce_max_ps(vmax);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < kChunk; t += 16) {
        const __mmask16 mask = t < nc ? tail_mask16(nc - t) : __mmask16(0);
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm)));
        const __m256i rounded = to_bf16x16(p);
        _mm256_storeu_si256((__m256i*)(probs + t), rounded);
        vsum = _mm512_add_ps(vsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
    const float alpha = *m == -__builtin_inff() ? 0.0f : _mm512_cvtss_f32(exp512(_mm512_set1_ps(*m - m_new)));
    *m = m_new;
    *l = *l * alpha + _mm512_reduce_add_ps(vsum);
    return alpha;
}

// vp[(t / 2) * 2D + 2c + t % 2] = v[t][c] for t < nc rounded up to even (row nc zero).
template <int D>
void pair_v(const bf16* v, int64_t nc, bf16* vp) {
    alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
    for (int64_t t = 0; t < nc; t += 2) {
        bf16* row = vp + (t / 2) * 2 * D;
        for (int64_t c = 0; c < D; c += 32) {
            const __m512i a = _mm512_loadu_si512(v + t * D + c);
            const __m512i b = t + 1 < nc ? _mm512_loadu_si512(v + (t + 1) * D + c) : _mm512_setzero_si512();
            _mm512_store_si512(row + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512(row + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

// o_i = alpha o_i + sum_t p_i[t] v_t over the chunk's pairs of positions.
template <int D>
void accumulate_pv(const bf16* probs, float alpha, const bf16* vp, int64_t nc, float* o) {
    constexpr int kVecs = D / 16;
    __m512 acc[kVecs];
    const __m512 va = _mm512_set1_ps(alpha);
    for (int j = 0; j < kVecs; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), va);
    for (int64_t t = 0; t < nc; t += 2) {
        const __m512bh p = pair_broadcast(probs + t);
        const bf16* row = vp + (t / 2) * 2 * D;
        for (int j = 0; j < kVecs; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_load_si512(row + 32 * j), p);
    }
    for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(o + 16 * j, acc[j]);
}

template <int D>
void attend_d(const bf16* q, int64_t g, const bf16* k, const bf16* v, int64_t n, float scale,
              const AttentionState& st, unsigned char* scratch) {
    float* s = reinterpret_cast<float*>(scratch);
    bf16* probs = reinterpret_cast<bf16*>(scratch + kScoresBytes);
    void* pairs = scratch + kScoresBytes + kProbsBytes;
    float alpha[kMaxQueryBlock];
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
        const int64_t nc = n - t0 < kChunk ? n - t0 : kChunk;
        transpose_k<D>(k + t0 * D, nc, static_cast<float*>(pairs));
        scores<D>(q, g, static_cast<const float*>(pairs), scale, s);
        for (int64_t i = 0; i < g; ++i)
            alpha[i] = softmax_row(s + i * kChunk, nc, st.m + i, st.l + i, probs + i * kChunk);
        pair_v<D>(v + t0 * D, nc, static_cast<bf16*>(pairs));
        for (int64_t i = 0; i < g; ++i)
            accumulate_pv<D>(probs + i * kChunk, alpha[i], static_cast<const bf16*>(pairs), nc, st.o + i * D);
    }
}

void attend(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n, float scale,
            const AttentionState& st, void* scratch) {
    const bf16* q = static_cast<const bf16*>(packed_query);
    auto* work = static_cast<unsigned char*>(scratch);
    switch (d) {
        case 64: attend_d<64>(q, g, k, v, n, scale, st, work); break;
        case 128: attend_d<128>(q, g, k, v, n, scale, st, work); break;
        case 256: attend_d<256>(q, g, k, v, n, scale, st, work); break;
        default: break;  // the driver admits only attention_head_dim_supported sizes
    }
}

}  // namespace

const AttentionOps& attention_avx512_ops() {
    static const AttentionOps ops{Isa::avx512, "avx512", query_bytes, scratch_bytes, pack_query, attend};
    return ops;
}

}  // namespace numa_moe::kernels
