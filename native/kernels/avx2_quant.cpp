// AVX2 kernels of the integer weight formats (docs/quantization.md): int8 and int4 weights
// against int8 tokens, the portable SIMD path for x86-64 CPUs without AVX-512-VNNI.
// Compiled with -mavx2 -mfma -ffp-contract=off; dispatch only hands these tables out when
// cpuid + XCR0 allow AVX2 + FMA. One table per format and group G (32, 64, 128); G is also
// the tokens' quantization block.
//
// Operand layouts (kernel_api.hpp), all those of ref_quant.cpp, whose gather,
// silu_mul_pack and epilogues this table reuses:
//   weights  int8 w[r * ld + c]; int4: byte (r * ld + c) / 2, the even column in its low
//            nibble, 4-bit two's complement; never repacked. Scales (fp32, fp16 or bf16)
//            s[r * scales_ld + c / G]
//   tokens   plain: int8 q[t * k + c] (m * k bytes, padded to 64), then fp32
//            scale[t * (k / G) + b]
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// The result is the reference's bit for bit: per group an exact int32 dot product,
// float(dot) * (s_w * s_x) added in fp32 in increasing group order, starting from 0 per
// segment and added to out at the end (hence -ffp-contract=off: no fused multiply-add may
// change a rounding).
//
// The dot products use vpmaddubsw (u8 x s8, adjacent products summed into saturating
// int16), which is exact here because no pair sum can reach the int16 limit 32767:
//   int8: |w| . sign(x, w), |w| <= 128 (even the -128 the format never writes), |x| <= 127
//         (gather and silu_mul_pack clamp to [-127, 127]): |pair| <= 2 * 128 * 127 = 32512;
//         vpmaddwd with ones then widens each step's pairs to int32.
//   int4: the nibble biased to u = q + 8 in [0, 15]: |pair| <= 2 * 15 * 127 = 3810, and
//         dot(u, x) = dot(q, x) + 8 * sum(x). A group has G / 32 <= 4 steps, so the int16
//         sums of a group's u products stay below 4 * 3810 = 15240: accumulated in int16,
//         widened once per group; 8 * sum(x) of each token and group is taken once per
//         call and subtracted from the group totals.
// Register block: R rows x T tokens = up to 8 (row, token) pairs (T = 1, 2, 3, 4 tokens;
// R = 8, 4, 2, 2 rows), one int32 vector each, so each weight vector loaded serves T tokens.
// Per group the 8 pair vectors reduce (vphaddd tree) to one vector of group totals, lane
// p = pair p, and the fp32 scale-and-add runs on the 8 pairs at once.
#include <immintrin.h>

#include "common/util.hpp"
#include "kernels/integer_tables.hpp"
#include "kernels/isa_tables.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// avx2_quant_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx2_emulated;
#else
constexpr Isa kIsa = Isa::avx2;
#endif

constexpr int kPairs = 8;          // (row, token) pairs of a register block: the lanes of a vector
constexpr int kBlockRows = 8;      // rows collected per block, split into R = kPairs / T per token block
constexpr int64_t kStepColumns = 32;  // columns of one step (a vector of int8 weights)
constexpr int kOffsetsSlot = 0;       // thread_scratch slot of the int4 token offsets

const float* token_scales(const void* packed, int64_t m, int64_t k) {
    return reinterpret_cast<const float*>(static_cast<const uint8_t*>(packed) +
                                          (static_cast<size_t>(m * k) + 63) / 64 * 64);
}

// n (<= 8) consecutive scales of one row from group g0 as fp32, lanes past n zero. fp16
// is converted exactly with integer operations (no F16C in the flags): normal numbers
// rebias the exponent, subnormals are mantissa * 2^-24, infinities and NaNs (which the
// bindings refuse anyway) keep their class, as ref_quant.cpp's fp16_to_float does.
inline __m256 row_scales(ScaleType type, const void* row_scales, int64_t g0, int64_t n) {
    if (type == ScaleType::fp32) {
        const float* p = static_cast<const float*>(row_scales) + g0;
        if (n == 8) return _mm256_loadu_ps(p);
        alignas(32) float part[8] = {};
        for (int64_t i = 0; i < n; ++i) part[i] = p[i];
        return _mm256_load_ps(part);
    }
    const uint16_t* p = static_cast<const uint16_t*>(row_scales) + g0;
    __m128i raw;
    if (n == 8) {
        raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
        alignas(16) uint16_t part[8] = {};
        for (int64_t i = 0; i < n; ++i) part[i] = p[i];
        raw = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
    }
    const __m256i h = _mm256_cvtepu16_epi32(raw);
    if (type == ScaleType::bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
    const __m256i magnitude = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
    const __m256i shifted = _mm256_slli_epi32(magnitude, 13);
    const __m256i normal = _mm256_add_epi32(shifted, _mm256_set1_epi32(112 << 23));
    const __m256i special = _mm256_or_si256(shifted, _mm256_set1_epi32(0x7f800000));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-24f));
    const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), magnitude);
    const __m256i is_special = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7bff));
    __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal), is_subnormal);
    bits = _mm256_blendv_epi8(bits, special, is_special);
    return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

inline void transpose8(__m256 v[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// tile[i] lane p = s_w(row r, group g0 + i) * s_x(token t, group g0 + i), pair p = r * T + t
// (pairs past R * T: 0), for the n <= 8 groups from g0: per row and token a vector over
// the groups, their products, transposed.
template <int R, int T>
inline void scale_tile(const void* const* scales, ScaleType scale_type, const float* x_scales, int64_t x_groups,
                       int64_t g0, int64_t n, __m256 tile[kPairs]) {
    __m256 sx[T];
    for (int t = 0; t < T; ++t) sx[t] = row_scales(ScaleType::fp32, x_scales + t * x_groups, g0, n);
    for (int p = 0; p < kPairs; ++p) tile[p] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
        const __m256 sw = row_scales(scale_type, scales[r], g0, n);
        for (int t = 0; t < T; ++t) tile[r * T + t] = _mm256_mul_ps(sw, sx[t]);
    }
    transpose8(tile);
}

// 32 columns of a weight row from `p` (int4: p points at the byte of the first column):
// int8 the signed bytes; int4 the biased nibbles u = q + 8 as bytes, in column order.
template <Format F>
inline __m256i load_weights(const uint8_t* p) {
    if constexpr (F == Format::int8) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
        // Widened to 16 bits, byte 0xHL (after the xor that biases each nibble) becomes
        // the byte pair (L, H) with (word | word << 4) & 0x0f0f.
        const __m128i raw = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                          _mm_set1_epi8(static_cast<char>(0x88)));
        const __m256i wide = _mm256_cvtepu8_epi16(raw);
        return _mm256_and_si256(_mm256_or_si256(wide, _mm256_slli_epi16(wide, 4)), _mm256_set1_epi16(0x0f0f));
    }
}

template <Format F>
constexpr int64_t column_bytes(int64_t c) {
    return F == Format::int8 ? c : c / 2;
}

// Lane p of the result = the sum of v[p]'s eight lanes.
inline __m256i reduce_pairs(const __m256i v[kPairs]) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    // 128-bit half h of ab: pairs 0-3 summed over their half h; of cd: pairs 4-7.
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// The int32 dot products of one group (G columns from c0) for the R x T pairs, pair
// p = r * T + t in dot[p]'s lanes (pairs past R * T: zero).
template <Format F, int64_t G, int R, int T>
inline void group_dots(const uint8_t* const* w, const int8_t* x, int64_t k, int64_t c0, __m256i dot[kPairs]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int p = 0; p < kPairs; ++p) dot[p] = _mm256_setzero_si256();
    if constexpr (F == Format::int8) {
        for (int64_t c = c0; c < c0 + G; c += kStepColumns) {
            __m256i xv[T];
            for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * k + c));
            for (int r = 0; r < R; ++r) {
                const __m256i wv = load_weights<F>(w[r] + c);
                const __m256i magnitude = _mm256_abs_epi8(wv);
                for (int t = 0; t < T; ++t) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv[t], wv));
                    dot[r * T + t] = _mm256_add_epi32(dot[r * T + t], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
    } else {
        __m256i sums[R * T];
        for (int p = 0; p < R * T; ++p) sums[p] = _mm256_setzero_si256();
        for (int64_t c = c0; c < c0 + G; c += kStepColumns) {
            __m256i xv[T];
            for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * k + c));
            for (int r = 0; r < R; ++r) {
                const __m256i uv = load_weights<F>(w[r] + c / 2);
                for (int t = 0; t < T; ++t)
                    sums[r * T + t] = _mm256_add_epi16(sums[r * T + t], _mm256_maddubs_epi16(uv, xv[t]));
            }
        }
        for (int p = 0; p < R * T; ++p) dot[p] = _mm256_madd_epi16(sums[p], ones);
    }
}

// int4: the weights' bias times each token's group sums, 8 * sum(x[t][group g]), at
// offsets[g * m_pad + t] (m_pad = m rounded up to 4, padding 0): subtracted from the
// biased dots once per group, for all pairs at once.
int64_t offsets_stride(int64_t m) { return (m + 3) / 4 * 4; }

template <int64_t G>
void token_offsets(const int8_t* q, int64_t m, int64_t k, int32_t* offsets) {
    const int64_t m_pad = offsets_stride(m);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < k / G; ++g) {
        for (int64_t t = 0; t < m_pad; ++t) {
            if (t >= m) {
                offsets[g * m_pad + t] = 0;
                continue;
            }
            __m256i pairs = _mm256_setzero_si256();  // at most 4 steps x 2 x 127: int16 holds it
            for (int64_t c = g * G; c < (g + 1) * G; c += kStepColumns)
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(
                                                    ones8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * k + c))));
            const __m256i quads = _mm256_madd_epi16(pairs, ones16);
            const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
            const __m128i two = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
            offsets[g * m_pad + t] = 8 * _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
        }
    }
}

// The offsets of group g for the pairs, lane p = token p % T of the block.
template <int T>
inline __m256i pair_offsets(const int32_t* offsets_t0, int64_t m_pad, int64_t g) {
    const __m256i four = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets_t0 + g * m_pad)));
    return _mm256_permutevar8x32_epi32(four, _mm256_setr_epi32(0 % T, 1 % T, 2 % T, 3 % T, 4 % T, 5 % T, 6 % T, 7 % T));
}

// The token operand of a block of T tokens from t0.
struct TokenBlock {
    const int8_t* x;          // token t0, column 0
    const float* scales;      // token t0's first scale
    const int32_t* offsets;   // int4: offsets + t0 (stride m_pad per group)
    int64_t k;
    int64_t m_pad;
};

// One register block over columns [k0, k1) of a segment: sums[p] = sum over its groups of
// float(dot) * (s_w * s_x), pair p = r * T + t, in increasing group order from 0.
// w[r]: column 0 of row r; scales[r]: its first scale.
template <Format F, int64_t G, int R, int T>
void block_sums(const uint8_t* const* w, const void* const* scales, ScaleType scale_type, const TokenBlock& tokens,
                int64_t k0, int64_t k1, float sums[kPairs]) {
    static_assert(R * T <= kPairs, "a register block holds at most kPairs pairs");
    const int64_t x_groups = tokens.k / G;
    __m256 total = _mm256_setzero_ps();
    for (int64_t g0 = k0 / G; g0 < k1 / G; g0 += kPairs) {
        const int64_t n = k1 / G - g0 < kPairs ? k1 / G - g0 : kPairs;
        __m256 tile[kPairs];
        scale_tile<R, T>(scales, scale_type, tokens.scales, x_groups, g0, n, tile);
        for (int64_t i = 0; i < n; ++i) {
            __m256i dot[kPairs];
            group_dots<F, G, R, T>(w, tokens.x, tokens.k, (g0 + i) * G, dot);
            __m256i totals = reduce_pairs(dot);
            if constexpr (F == Format::int4)
                totals = _mm256_sub_epi32(totals, pair_offsets<T>(tokens.offsets, tokens.m_pad, g0 + i));
            total = _mm256_add_ps(total, _mm256_mul_ps(_mm256_cvtepi32_ps(totals), tile[i]));
        }
    }
    _mm256_storeu_ps(sums, total);
}

// The rows collected for a block (up to kBlockRows of a segment inside [row_begin, row_end)).
struct Rows {
    const uint8_t* w[kBlockRows];
    const void* scales[kBlockRows];
    float* out[kBlockRows];
    int n = 0;
};

// Rows r0 .. r0 + R of the block against tokens t0 .. t0 + T; rows past the block's end
// repeat row r0 (valid memory), their sums dropped.
template <Format F, int64_t G, int R, int T>
void run_block(const Rows& rows, ScaleType scale_type, const TokenBlock& tokens, int64_t k0, int64_t k1,
               int64_t t0) {
    for (int r0 = 0; r0 < rows.n; r0 += R) {
        const uint8_t* w[R];
        const void* scales[R];
        for (int r = 0; r < R; ++r) {
            const int row = r0 + r < rows.n ? r0 + r : r0;
            w[r] = rows.w[row];
            scales[r] = rows.scales[row];
        }
        float sums[kPairs];
        block_sums<F, G, R, T>(w, scales, scale_type, tokens, k0, k1, sums);
        for (int r = 0; r < R && r0 + r < rows.n; ++r)
            for (int t = 0; t < T; ++t) rows.out[r0 + r][t0 + t] += sums[r * T + t];
    }
}

template <Format F, int64_t G>
void matmul_segments(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const int8_t* q = static_cast<const int8_t*>(packed);
    const float* x_scales = token_scales(packed, m, k);
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const int64_t row_bytes = column_bytes<F>(w.ld);
    const int64_t scale_bytes = w.scale_type == ScaleType::fp32 ? 4 : 2;
    const int64_t m_pad = offsets_stride(m);
    int32_t* offsets = nullptr;
    if constexpr (F == Format::int4) {
        offsets = static_cast<int32_t*>(thread_scratch(kOffsetsSlot, static_cast<size_t>(m_pad * (k / G)) * sizeof(int32_t)));
        token_offsets<G>(q, m, k, offsets);
    }
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += kBlockRows) {
            Rows rows;
            for (int64_t j = j0; j < j_hi && rows.n < kBlockRows; ++j) {
                const int64_t r = seg.row0 + j * stride;
                rows.w[rows.n] = data + r * row_bytes;
                rows.scales[rows.n] = static_cast<const uint8_t*>(w.scales) + r * w.scales_ld * scale_bytes;
                rows.out[rows.n] = out + r * ldo;
                ++rows.n;
            }
            for (int64_t t0 = 0; t0 < m;) {
                const int64_t nt = m - t0 < 4 ? m - t0 : 4;
                const TokenBlock tokens{q + t0 * k, x_scales + t0 * (k / G), offsets ? offsets + t0 : nullptr, k, m_pad};
                switch (nt) {
                    case 1: run_block<F, G, 8, 1>(rows, w.scale_type, tokens, seg.k0, seg.k1, t0); break;
                    case 2: run_block<F, G, 4, 2>(rows, w.scale_type, tokens, seg.k0, seg.k1, t0); break;
                    case 3: run_block<F, G, 2, 3>(rows, w.scale_type, tokens, seg.k0, seg.k1, t0); break;
                    default: run_block<F, G, 2, 4>(rows, w.scale_type, tokens, seg.k0, seg.k1, t0); break;
                }
                t0 += nt;
            }
        }
    });
}

template <Format F, int64_t G>
const KernelOps& table() {
    // The token layout is the reference's plain one, and the epilogues touch rows x tokens
    // floats, nothing next to the weights: the reference versions serve.
    static const KernelOps& ref = *ref_integer_ops(F, G);
    static const KernelOps ops{kIsa, isa_name(kIsa), F, G, plain_layout, ref.packed_bytes, ref.gather,
                               matmul_segments<F, G>, ref.silu_mul_pack, ref.combine_down, ref.store_down};
    return ops;
}

}  // namespace

#ifdef NUMA_MOE_EMULATED
const KernelOps* avx2_emulated_integer_ops(Format format, int64_t group) {
#else
const KernelOps* avx2_integer_ops(Format format, int64_t group) {
#endif
    return integer_table(format, group, [](auto f, auto g) -> const KernelOps& {
        return table<decltype(f)::value, decltype(g)::value>();
    });
}

}  // namespace numa_moe::kernels
