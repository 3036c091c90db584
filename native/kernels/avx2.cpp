// AVX2/FMA kernels: the portable SIMD path for x86-64 CPUs without AVX-512-BF16
// (and the numa-vm guests). Compiled with -mavx2 -mfma only.
//
// Operand layouts (same as ref.cpp and avx512_bf16.cpp):
//   weights  w[r * ldw + c] bf16 row-major
//   tokens   plain row-major packed[t * k + c] bf16
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// bf16 -> fp32 is a 16-bit left shift (zero-extend to 32 bits, shift); 8 columns per step,
// a block of 2 rows x 4 tokens of ymm accumulators, FMA, horizontal sums at the end.
#include <immintrin.h>


#include "kernels/bf16.hpp"
#include "kernels/isa_tables.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// avx2_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx2_emulated;
#else
constexpr Isa kIsa = Isa::avx2;
#endif


inline __m256 load8_bf16(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

template <int R, int T>
void micro(const bf16* const* w_rows, const bf16* tok, int64_t ldt, int64_t k0, int64_t k1, float* const* out_rows) {
    __m256 acc[R][T];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
    int64_t c = k0;
    for (; c + 8 <= k1; c += 8) {
        __m256 w[R];
        for (int r = 0; r < R; ++r) w[r] = load8_bf16(w_rows[r] + c);
        for (int t = 0; t < T; ++t) {
            const __m256 x = load8_bf16(tok + t * ldt + c);
            for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
            float sum = hsum8(acc[r][t]);
            for (int64_t cc = c; cc < k1; ++cc) sum += bf16_to_float(w_rows[r][cc]) * bf16_to_float(tok[t * ldt + cc]);
            out_rows[r][t] += sum;
        }
    }
}

using MicroFn = void (*)(const bf16* const*, const bf16*, int64_t, int64_t, int64_t, float* const*);

template <int R>
MicroFn micro_for_tokens(int64_t t) {
    switch (t) {
        case 1: return micro<R, 1>;
        case 2: return micro<R, 2>;
        case 3: return micro<R, 3>;
        default: return micro<R, 4>;
    }
}

void matmul_segments(const Weights& weights, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const bf16* w = static_cast<const bf16*>(weights.data);
    const int64_t ldw = weights.ld;
    const bf16* tokens = static_cast<const bf16*>(packed);
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += 2) {  // 2 rows at a time
            const bf16* w_rows[2];
            float* out_base[2];
            int rows = 0;
            for (int64_t j = j0; j < j_hi && rows < 2; ++j) {
                const int64_t r = seg.row0 + j * stride;
                w_rows[rows] = w + r * ldw;
                out_base[rows] = out + r * ldo;
                ++rows;
            }
            for (int64_t t0 = 0; t0 < m; t0 += 4) {
                const int64_t nt = m - t0 < 4 ? m - t0 : 4;
                float* out_rows[2] = {out_base[0] + t0, rows > 1 ? out_base[1] + t0 : nullptr};
                const MicroFn fn = rows == 2 ? micro_for_tokens<2>(nt) : micro_for_tokens<1>(nt);
                fn(w_rows, tokens + t0 * k, k, seg.k0, seg.k1, out_rows);
            }
        }
    });
}

}  // namespace

#ifdef NUMA_MOE_EMULATED
const KernelOps& avx2_emulated_ops() {
#else
const KernelOps& avx2_ops() {
#endif
    // The token layout is the plain one of the reference (its gather is a row copy), and
    // the epilogues touch rows x tokens floats, nothing next to the weights: the
    // reference versions serve.
    static const KernelOps ops{kIsa, isa_name(kIsa), Format::bf16, 0, plain_layout, ref_ops().packed_bytes, ref_ops().gather, matmul_segments,
                               ref_ops().silu_mul_pack, ref_ops().combine_down, ref_ops().store_down};
    return ops;
}

}  // namespace numa_moe::kernels
