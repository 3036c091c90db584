// AVX2 + FMA decode attention: the portable fast path for CPUs without AVX-512-BF16. All
// in fp32 (no bf16 products exist below AVX-512-BF16): per 64-position chunk the K rows,
// then the V rows, are widened to fp32 in L1 once and shared by the query heads of the
// block; the scores of 8 positions are summed out of 8 accumulators by one hadd tree.
//
// Operand layouts (attention_api.hpp):
//   query   packed = fp32 rows q[i * d + c] (pack_query widens them)
//   k, v    k[t * d + c], v[t * d + c] bf16 cache rows, read as they are
//   state   m[i], l[i], o[i * d + c] fp32
//   scratch s[i][64] fp32 scores / probabilities, then rows[t][c] fp32 (K, then V, of the chunk)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/attention_api.hpp"
#include "kernels/bf16.hpp"
#include "kernels/exp_poly.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// attention_avx2_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx2_emulated;
#else
constexpr Isa kIsa = Isa::avx2;
#endif

constexpr int64_t kChunk = kAttentionChunk;
constexpr int64_t kScoresBytes = kMaxQueryBlock * kChunk * 4;

size_t query_bytes(int64_t g, int64_t d) { return static_cast<size_t>(g * d) * sizeof(float); }
size_t scratch_bytes(int64_t, int64_t d) { return static_cast<size_t>(kScoresBytes + kChunk * d * 4); }

void pack_query(const bf16* q, int64_t g, int64_t d, void* packed) {
    float* dst = static_cast<float*>(packed);
    for (int64_t i = 0; i < g * d; ++i) dst[i] = bf16_to_float(q[i]);
}

inline __m256 widen8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// exp_poly's wrappers for __m256: AVX2 has no scalef, so 2^n is built in the exponent
// field, which holds normal numbers only: x below -87 gives e^-87, about 1e-38 (callers
// mask what must be 0).
struct Exp256Ops {
    static constexpr float kLowest = -87.0f;
    static __m256 set1(float v) { return _mm256_set1_ps(v); }
    static __m256 min(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
    static __m256 max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
    static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
    static __m256 round(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
    static __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
    static __m256 scale_pow2(__m256 p, __m256 n) {
        const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
    }
};

inline __m256 exp256(__m256 x) { return exp_poly<Exp256Ops>(x); }

inline __m256 lanes_below(int64_t n) {  // all-ones in lanes < n
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// rows[t][c] = x[t][c] widened, t < nc.
template <int D>
void widen_rows(const bf16* x, int64_t nc, float* rows) {
    for (int64_t t = 0; t < nc; ++t)
        for (int c = 0; c < D; c += 8) _mm256_store_ps(rows + t * D + c, widen8(x + t * D + c));
}

// s[i][t] = scale * q_i . k_t for t < nc, 8 positions at a time (the sums of 8
// accumulators by one hadd tree).
template <int D>
void scores(const float* q, int64_t g, const float* k, int64_t nc, float scale, float* s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < g; ++i) {
        const float* qi = q + i * D;
        for (int64_t t0 = 0; t0 < nc; t0 += 8) {
            __m256 acc[8];
            for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
            const int64_t rows = nc - t0 < 8 ? nc - t0 : 8;
            for (int c = 0; c < D; c += 8) {
                const __m256 qc = _mm256_loadu_ps(qi + c);
                for (int r = 0; r < 8; ++r)
                    if (r < rows) acc[r] = _mm256_fmadd_ps(qc, _mm256_load_ps(k + (t0 + r) * D + c), acc[r]);
            }
            const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
            const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
            const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
            // lanes: [0-3 of positions 0..3 | 4..7] low halves then high halves
            const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
            const __m256 hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
            _mm256_storeu_ps(s + i * kChunk + t0, _mm256_mul_ps(_mm256_add_ps(lo, hi), vscale));
        }
    }
}

// The online-softmax step of query i over s[0, nc): s becomes p = e^(s - m') (0 beyond nc
// up to a multiple of 8); returns alpha = e^(m - m').
float softmax_row(float* s, int64_t nc, float* m, float* l) {
    __m256 vmax = _mm256_set1_ps(*m);
    for (int64_t t = 0; t < nc; t += 8)
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, _mm256_loadu_ps(s + t), lanes_below(nc - t)));
    const float m_new = hmax8(vmax);
    const __m256 vm = _mm256_set1_ps(m_new);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < nc; t += 8) {
        const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm)), lanes_below(nc - t));
        _mm256_storeu_ps(s + t, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    const float alpha = *m == -INFINITY ? 0.0f : std::exp(*m - m_new);
    *m = m_new;
    *l = *l * alpha + hsum8(vsum);
    return alpha;
}

// o = alpha o + sum_t p[t] v_t, 64 columns at a time (8 accumulators).
template <int D>
void accumulate_pv(const float* p, int64_t nc, float alpha, const float* v, float* o) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (int c0 = 0; c0 < D; c0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(_mm256_loadu_ps(o + c0 + 8 * j), va);
        for (int64_t t = 0; t < nc; ++t) {
            const __m256 pt = _mm256_broadcast_ss(p + t);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pt, _mm256_load_ps(v + t * D + c0 + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + c0 + 8 * j, acc[j]);
    }
}

template <int D>
void attend_d(const float* q, int64_t g, const bf16* k, const bf16* v, int64_t n, float scale,
              const AttentionState& st, unsigned char* scratch) {
    float* s = reinterpret_cast<float*>(scratch);
    float* rows = reinterpret_cast<float*>(scratch + kScoresBytes);
    float alpha[kMaxQueryBlock];
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
        const int64_t nc = n - t0 < kChunk ? n - t0 : kChunk;
        widen_rows<D>(k + t0 * D, nc, rows);
        scores<D>(q, g, rows, nc, scale, s);
        for (int64_t i = 0; i < g; ++i) alpha[i] = softmax_row(s + i * kChunk, nc, st.m + i, st.l + i);
        widen_rows<D>(v + t0 * D, nc, rows);
        for (int64_t i = 0; i < g; ++i) accumulate_pv<D>(s + i * kChunk, nc, alpha[i], rows, st.o + i * D);
    }
}

void attend(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n, float scale,
            const AttentionState& st, void* scratch) {
    const float* q = static_cast<const float*>(packed_query);
    auto* work = static_cast<unsigned char*>(scratch);
    with_head_dim(d, [&](auto dim) { attend_d<decltype(dim)::value>(q, g, k, v, n, scale, st, work); });
}

}  // namespace

#ifdef NUMA_MOE_EMULATED
const AttentionOps& attention_avx2_emulated_ops() {
#else
const AttentionOps& attention_avx2_ops() {
#endif
    static const AttentionOps ops{kIsa, isa_name(kIsa), query_bytes, scratch_bytes, pack_query, attend};
    return ops;
}

}  // namespace numa_moe::kernels
