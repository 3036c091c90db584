// AVX2 kernels of the integer weight formats (docs/quantization.md): int8, int4, mxfp4 and
// iq4nl weights against int8 tokens, the portable SIMD path for x86-64 CPUs without AVX-512-VNNI.
// Compiled with -mavx2 -mfma -mf16c -ffp-contract=off; dispatch only hands these tables out
// when cpuid + XCR0 allow AVX2 + FMA + F16C. One table per format and group G (32, 64, 128); G is also
// the tokens' quantization block.
//
// Operand layouts (kernel_api.hpp):
//   weights  int8 w[r * ld + c]; int4 / mxfp4 / iq4nl (the nibble formats): byte (r * ld + c) / 2,
//            the even column in its low nibble, each code an integer of the format's
//            codebook (nibble_codes.hpp); never repacked. Scales (fp32, fp16, bf16; mxfp4
//            e8m0) s[r * scales_ld + c / G]
//   tokens   the int8 values and fp32 scales of ref_quant.cpp's token rule (per token and
//            block of G columns), quantized once by gather / silu_mul_pack:
//            values  int8: q[t * k + c]; nibble formats: the same bytes, but each 64 columns (a
//                    32-byte run of packed weights) as its 32 even columns, then its 32
//                    odd ones: q[t * k + (c & ~63) + 32 (c % 2) + (c % 64) / 2] (a k
//                    that is an odd multiple of 32 ends on 32 columns: 16 even, 16 odd)
//                    (m * k bytes, padded to 64)
//            scales  fp32 scale[t * (k / G) + b]
//            nibble formats (and int8 with AVX-VNNI; not iq4nl without it) then int32
//                    offset[b * m4 + t] = bias * sum of token t's values in block b (m4 =
//                    m rounded up to 4, padding 0): the bias correction below
//            formats with minimums then fp32 group sums X[t * (k / G) + b]
//                    (group_minimums.hpp)
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// The result is the reference's bit for bit: per group an exact int32 dot product,
// float(dot) * (s_w * s_x) added in fp32 in increasing group order, starting from 0 per
// segment and added to out at the end (hence -ffp-contract=off: no fused multiply-add may
// change a rounding). The token rule itself is the reference's too: division by the
// scale and vcvtps2dq round exactly as its x / s and nearbyint.
//
// The dot products use vpmaddubsw (u8 x s8, adjacent products summed into saturating
// int16), which is exact here because no pair sum can reach the int16 limit 32767:
//   int8: |w| . sign(x, w), |w| <= 128 (even the -128 the format never writes), |x| <= 127
//         (the token rule clamps to [-127, 127]): |pair| <= 2 * 128 * 127 = 32512;
//         vpmaddwd with ones then widens each step's pairs to int32.
//   int4: the nibble biased to u = q + 8 in [0, 15]: |pair| <= 2 * 15 * 127 = 3810, and
//         dot(u, x) = dot(q, x) + 8 * sum(x). A group has G / 32 <= 4 steps, so the int16
//         sums of a group's u products stay below 4 * 3810 = 15240: accumulated in int16,
//         widened once per group; the token's offset is subtracted from the group totals.
//         A step unpacks 64 columns (32 bytes of a row) in four operations: bias (xor
//         0x88), mask the low nibbles (the even columns), shift and mask the high ones
//         (the odd columns), the order of the token values.
//   mxfp4: the same steps, each masked code looked up (vpshufb) as u = value + 12 in
//         [0, 24]: |pair| <= 2 * 24 * 127 = 6096, and its only group size, 32, is half a
//         step (two pairs a lane, below 12192). At group 32 the two 128-bit
//         halves of a step's sums are its two groups. At a 32-column edge (a segment or
//         k that is not on the 64-column grid) a half step unpacks 32 columns in three:
//         16 bytes broadcast to both halves, the upper half shifted right by 4, masked and
//         biased, against the 16 even and 16 odd token values loaded side by side.
//   iq4nl: its codebook's biased values reach 127 + 113 = 240, so that one pair could reach
//         2 * 240 * 127 > 32767; its codes are looked up as their signed values (<= 127 in
//         magnitude) instead and take int8's sign trick, each step's pairs widened to
//         int32 at once: no bias and no offsets.
// AVX-VNNI (vpdpbusd in its VEX form: Intel Alder Lake and later, AMD Zen 5) takes the
// place of vpmaddubsw in a second build of this source (avx2_vnni_quant.cpp, kVnni), which
// the avx2 tables use where the CPU has it: four u8 x s8 products straight into each int32
// lane, so no int16 stage and no sign trick; int8 weights are biased to w + 128 like int4's
// q + 8, and each token's 128 * sum(x) per group comes with the operand as int4's offsets do.
// Register block: R rows x T tokens = up to 8 (row, token) pairs (T = 1, 2, 3, 4 tokens;
// R = 8, 4, 2, 2 rows; without AVX-VNNI int4, mxfp4 and int4-affine at group 32 take 3
// tokens as 2 + 1, token_block_size), one vector each, so each weight vector loaded
// serves T tokens. Per group the 8 pair vectors reduce (vphaddd tree; those int16 sums in
// 4-token blocks take its first level in int16, reduce_halves_int16) to one vector of
// group totals, lane p = pair p, and the fp32 scale-and-add runs on the 8 pairs at once.
// Rows are read 8 at a time (a row block), which the hardware prefetchers follow badly:
// while the first token block reads a row block, each 64 bytes of a row read request one
// line of the row block after next, in address order (LinePrefetcher).
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/util.hpp"
#include "kernels/bf16.hpp"
#include "kernels/group_minimums.hpp"
#include "kernels/integer_tables.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/line_prefetcher.hpp"
#include "kernels/nibble_codes.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// avx2_quant_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx2_emulated;
#else
constexpr Isa kIsa = Isa::avx2;
#endif

constexpr int kPairs = 8;             // (row, token) pairs of a register block: the lanes of a vector
constexpr int kBlockRows = 8;         // rows per row block, split into R = kPairs / T per token block
constexpr int64_t kStepColumns = 32;  // columns of one step (a vector of int8 weights or tokens)

#ifdef NUMA_MOE_AVX_VNNI
// avx2_vnni_quant.cpp: this source with AVX-VNNI's vpdpbusd (u8 x s8, four products into
// each int32 lane, no int16 stage) in place of vpmaddubsw; the weights are made unsigned
// by their bias (int8 w + 128, int4 q + 8) and each token's bias term per group comes
// with the operand.
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// iq4nl without AVX-VNNI: its codes as signed values with the sign trick (the header).
template <Format F>
constexpr bool kSignedCodes = F == Format::iq4nl && !kVnni;

// The nibble formats whose pair sums take an int16 stage, widened per group (vpmaddubsw
// without AVX-VNNI, biased codes); the others sum in int32 from the start.
template <Format F>
constexpr bool kInt16Sums = is_nibble_format(F) && !kVnni && !kSignedCodes<F>;

// The tokens' bias terms: where the weights are biased, the other nibble formats always,
// int8 and iq4nl with AVX-VNNI.
template <Format F>
constexpr bool kHasOffsets = kVnni || (is_nibble_format(F) && !kSignedCodes<F>);
template <Format F>
constexpr int32_t weight_bias() {
    if constexpr (F == Format::int8)
        return 128;
    else
        return NibbleCodes<F>::kBias;
}
constexpr int kTokenBlock = 4;        // tokens per register block at most

// ---------------------------------------------------------------------------------------
// Token operand.

int64_t offsets_stride(int64_t m) { return (m + kTokenBlock - 1) / kTokenBlock * kTokenBlock; }

size_t value_bytes(int64_t m, int64_t k) { return (static_cast<size_t>(m * k) + 63) / 64 * 64; }

template <Format F, int64_t G>
size_t packed_bytes(int64_t m, int64_t k) {
    const size_t scales = static_cast<size_t>(m * (k / G)) * sizeof(float);
    const size_t offsets = kHasOffsets<F> ? static_cast<size_t>(offsets_stride(m) * (k / G)) * sizeof(int32_t) : 0;
    const size_t sums = has_minimums(F) ? static_cast<size_t>(m * (k / G)) * sizeof(float) : 0;
    return value_bytes(m, k) + scales + offsets + sums;
}

// Nibble-format token values: where the 16 even and the 16 odd columns of the 32 from column c
// (a multiple of 32) lie in a token's k bytes. Each 64 columns hold their 32 even columns,
// then their 32 odd ones (a k that is an odd multiple of 32 ends on 32 columns: 16 even,
// then 16 odd), the order in which a 32-byte run of packed weights unpacks.
struct NibbleColumns {
    int64_t even, odd;
};
inline NibbleColumns nibble_columns(int64_t c, int64_t k) {
    const int64_t block = c & ~int64_t{63};
    const int64_t width = k - block < 64 ? k - block : 64;
    return NibbleColumns{block + (c - block) / 2, block + width / 2 + (c - block) / 2};
}

template <Format F, int64_t G>
struct TokenOperand {
    TokenOperand(const void* packed, int64_t m_, int64_t k_)
        : values(static_cast<int8_t*>(const_cast<void*>(packed))),
          scales(reinterpret_cast<float*>(values + value_bytes(m_, k_))),
          offsets(kHasOffsets<F> ? reinterpret_cast<int32_t*>(scales + m_ * (k_ / G)) : nullptr),
          sums(!has_minimums(F) ? nullptr
               : kHasOffsets<F>     ? reinterpret_cast<float*>(offsets + offsets_stride(m_) * (k_ / G))
                                    : scales + m_ * (k_ / G)),
          m(m_), k(k_) {}

    // Token t's block b: G values in column order and their scale.
    void put(int64_t t, int64_t b, const int8_t* q, float scale) const {
        scales[t * (k / G) + b] = scale;
        if constexpr (has_minimums(F)) sums[t * (k / G) + b] = token_group_sum<G>(q, scale);
        if constexpr (F == Format::int8) {
            std::memcpy(values + t * k + b * G, q, G);
        } else {
            // Per 128-bit half (16 columns): its 8 even columns, then its 8 odd ones; the
            // 64-bit permute then puts the 16 even columns of the 32 first.
            const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                   0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            for (int64_t c = 0; c < G; c += kStepColumns) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c));
                const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, order), 0xd8);
                const NibbleColumns at = nibble_columns(b * G + c, k);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(values + t * k + at.even), _mm256_castsi256_si128(split));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(values + t * k + at.odd), _mm256_extracti128_si256(split, 1));
            }
        }
        if constexpr (kHasOffsets<F>) {
            const __m256i ones8 = _mm256_set1_epi8(1);
            __m256i pairs = _mm256_setzero_si256();  // at most G / 32 * 2 * 127 per int16: exact
            for (int64_t c = 0; c < G; c += kStepColumns)
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(ones8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c))));
            const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
            const __m128i two = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
            offsets[b * offsets_stride(m) + t] =
                weight_bias<F>() * _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
        }
    }

    // The offsets of the padding tokens of blocks [b_begin, b_end), 0 (each writer fills
    // its own blocks: no shared bytes).
    void zero_padding(int64_t b_begin, int64_t b_end) const {
        if constexpr (kHasOffsets<F>)
            for (int64_t b = b_begin; b < b_end; ++b)
                for (int64_t t = m; t < offsets_stride(m); ++t) offsets[b * offsets_stride(m) + t] = 0;
    }

    int8_t* values;
    float* scales;
    int32_t* offsets;
    float* sums;  // formats with minimums: X[t * (k / G) + b] (group_minimums.hpp)
    int64_t m, k;
};

// The token rule on G values in 8-float vectors: scale amax / 127 (the reference's fp32
// division), values round(v / scale) clamped to [-127, 127]; a zero block gets scale 0 and
// values 0, a block holding a NaN or an infinity scale NaN and values 0 (ref_quant.cpp).
template <int64_t G>
void quantize_block(const __m256* v, int8_t* q, float* scale) {
    const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 infinity = _mm256_set1_ps(INFINITY);
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t i = 0; i < G / 8; ++i) {
        const __m256 magnitude = _mm256_and_ps(v[i], magnitude_mask);
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(magnitude, infinity, _CMP_LT_OQ));
        amax = _mm256_max_ps(amax, magnitude);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const bool all_finite = _mm256_movemask_ps(finite) == 0xff;
    const float s = all_finite ? _mm_cvtss_f32(m4) / 127.0f : std::numeric_limits<float>::quiet_NaN();
    *scale = s;
    if (!(s > 0.0f)) {
        std::memset(q, 0, G);
        return;
    }
    const __m256 sv = _mm256_set1_ps(s);
    // packs of four vectors leave dword 2j + h holding vector j's lanes 4h..4h+3
    const __m256i vector_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < G / 8; i += 4) {
        __m256i r[4];
        for (int j = 0; j < 4; ++j) r[j] = _mm256_cvtps_epi32(_mm256_div_ps(v[i + j], sv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i),
                            _mm256_max_epi8(_mm256_permutevar8x32_epi32(bytes, vector_order), _mm256_set1_epi8(-127)));
    }
}

template <Format F, int64_t G>
void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    const TokenOperand<F, G> out(packed, m, k);
    out.zero_padding(0, k / G);
    __m256 v[G / 8];
    alignas(32) int8_t q[G];
    for (int64_t t = 0; t < m; ++t) {
        const bf16* row = x + token_index[t] * ldx;
        for (int64_t b = 0; b < k / G; ++b) {
            for (int64_t i = 0; i < G / 8; ++i) {
                const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * G + 8 * i));
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
            float scale;
            quantize_block<G>(v, q, &scale);
            out.put(t, b, q, scale);
        }
    }
}

// The activation is ref_quant.cpp's (silu_mul_rows), so that the values quantized are the
// reference's bit for bit.
template <Format F, int64_t G>
void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    const TokenOperand<F, G> out(packed, m, i_total);
    out.zero_padding(i_begin / G, i_end / G);
    alignas(32) float block[G];
    __m256 v[G / 8];
    alignas(32) int8_t q[G];
    for (int64_t t = 0; t < m; ++t) {
        for (int64_t b0 = i_begin; b0 < i_end; b0 += G) {
            silu_mul_rows(gate_parts, up_parts, n_parts, ld, b0, G, t, epilogue, block);
            for (int64_t i = 0; i < G / 8; ++i) v[i] = _mm256_load_ps(block + 8 * i);
            float scale;
            quantize_block<G>(v, q, &scale);
            out.put(t, b0 / G, q, scale);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Weights.

// n (<= 8) consecutive scales of one row from group g0 as fp32, lanes past n zero (fp16
// widened by vcvtph2ps, exact like ref_quant.cpp's fp16_to_float; bf16 by a shift; e8m0
// as e8m0_scale: the byte shifted into the exponent field is 2^(e - 127) (0 for e = 0),
// halved exactly, and e = 0 set to 2^-128 on its own).
inline __m256 row_scales(ScaleDtype type, const void* row_scales, int64_t g0, int64_t n) {
    if (type == ScaleDtype::e8m0) {
        const uint8_t* p = static_cast<const uint8_t*>(row_scales) + g0;
        alignas(8) uint8_t part[8] = {};
        if (n < 8) std::memcpy(part, p, static_cast<size_t>(n));
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(n < 8 ? part : p)));
        const __m256 half = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), _mm256_set1_ps(0.5f));
        const __m256i smallest = _mm256_set1_epi32(0x00200000);  // 2^-128
        const __m256 scales = _mm256_blendv_ps(half, _mm256_castsi256_ps(smallest),
                                               _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_and_ps(scales, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane)));
    }
    if (type == ScaleDtype::fp32) {
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
    if (type == ScaleDtype::bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    return _mm256_cvtph_ps(raw);
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
inline void scale_tile(const void* const* scales, ScaleDtype scale_dtype, const float* x_scales, int64_t x_groups,
                       int64_t g0, int64_t n, __m256 tile[kPairs]) {
    __m256 sx[T];
    for (int t = 0; t < T; ++t) sx[t] = row_scales(ScaleDtype::fp32, x_scales + t * x_groups, g0, n);
    for (int p = 0; p < kPairs; ++p) tile[p] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
        const __m256 sw = row_scales(scale_dtype, scales[r], g0, n);
        for (int t = 0; t < T; ++t) tile[r * T + t] = _mm256_mul_ps(sw, sx[t]);
    }
    transpose8(tile);
}

template <Format F>
constexpr int64_t column_bytes(int64_t c) {
    return F == Format::int8 ? c : c / 2;
}

// acc + the sums of each lane's four u8 x s8 products (AVX-VNNI builds only).
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#ifdef NUMA_MOE_AVX_VNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    (void)u, (void)s;
    return acc;
#endif
}

// Nibble codes, one per byte (0-15), as the weight operand: the unsigned u = value +
// weight_bias<F>() (int4 flips the sign bit of the 4-bit two's complement, the codebook
// formats look it up), or with kSignedCodes the signed value, looked up.
template <Format F>
inline __m256i weight_codes(__m256i codes) {
    if constexpr (F == Format::int4) {
        return _mm256_xor_si256(codes, _mm256_set1_epi8(8));
    } else {
        const void* bytes = kSignedCodes<F> ? static_cast<const void*>(NibbleCodes<F>::kValues) : kBiasedCodes<F>.bytes;
        const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(static_cast<const __m128i*>(bytes)));
        return _mm256_shuffle_epi8(table, codes);
    }
}

// The int32 sums of each lane's four products of signed weights w (|w| = magnitude) and
// tokens x, by the sign trick: vpmaddubsw(|w|, sign(x, w)), whose pairs stay below
// 2 * 128 * 127, widened at once.
inline __m256i signed_dots(__m256i magnitude, __m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

// 32 columns of a weight row from `p` (the byte of the first column), as vpmaddubsw's
// unsigned operand's source: int8 the signed bytes; a nibble format its weight_codes,
// the 16 even columns in the low half and the 16 odd ones in the high half (the nibble
// kernel's half step, at a 32-column edge).
template <Format F>
inline __m256i load_weights(const uint8_t* p) {
    if constexpr (F == Format::int8) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
        const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return weight_codes<F>(_mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)),
                                                _mm256_set1_epi8(0x0f)));
    }
}

// A nibble format, 64 columns of a row from `p` (32 bytes): the weight_codes of the even
// columns (the low nibbles) and of the odd ones (the high nibbles), in the token values'
// order. int4 in four operations (bias both nibbles with one xor, mask, shift, mask),
// the codebook formats in five (mask, shift, mask, and a lookup each).
template <Format F>
inline void load_nibbles64(const uint8_t* p, __m256i* even, __m256i* odd) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i low = _mm256_set1_epi8(0x0f);
    if constexpr (F == Format::int4) {
        const __m256i biased = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x88)));
        *even = _mm256_and_si256(biased, low);
        *odd = _mm256_and_si256(_mm256_srli_epi16(biased, 4), low);
    } else {
        *even = weight_codes<F>(_mm256_and_si256(raw, low));
        *odd = weight_codes<F>(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
    }
}

// The sums of each pair vector's 128-bit halves: first lane p = the sum of v[p]'s lanes
// 0-3, second lane p = of its lanes 4-7.
inline void reduce_halves(const __m256i v[kPairs], __m256i* first, __m256i* second) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    // 128-bit half h of ab: pairs 0-3 summed over their half h; of cd: pairs 4-7.
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    *first = _mm256_permute2x128_si256(ab, cd, 0x20);
    *second = _mm256_permute2x128_si256(ab, cd, 0x31);
}

// reduce_halves of the int16 pair sums of a full step (kInt16Sums formats) widened, with
// the tree's first level in int16: vphaddw adds two lanes of one pair vector, at most
// 2 x 12192 < 32767 (mxfp4's largest codes: 12192 = 2 x 2 x 24 x 127), so that 4
// widenings and 2 vphaddd do what 8 widenings and 6 vphaddd do on the widened sums.
// Blocks of 4 tokens only: from memory it made 1 and 2 tokens slower (docs/kernels.md).
inline void reduce_halves_int16(const __m256i s[kPairs], __m256i* first, __m256i* second) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_madd_epi16(_mm256_hadd_epi16(s[0], s[1]), ones);
    const __m256i b = _mm256_madd_epi16(_mm256_hadd_epi16(s[2], s[3]), ones);
    const __m256i c = _mm256_madd_epi16(_mm256_hadd_epi16(s[4], s[5]), ones);
    const __m256i d = _mm256_madd_epi16(_mm256_hadd_epi16(s[6], s[7]), ones);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    *first = _mm256_permute2x128_si256(ab, cd, 0x20);
    *second = _mm256_permute2x128_si256(ab, cd, 0x31);
}

// Lane p of the result = the sum of v[p]'s eight lanes.
inline __m256i reduce_pairs(const __m256i v[kPairs]) {
    __m256i first, second;
    reduce_halves(v, &first, &second);
    return _mm256_add_epi32(first, second);
}

// The rows of a register block and the prefetch of a later row block's lines; pf is null
// where the row block's lines were already requested (token blocks after the first).
template <int R>
struct RowBlock {
    const uint8_t* w[R];      // column 0 of each row
    const void* scales[R];    // each row's first scale
    LinePrefetcher* pf;
};

// The token operand of a block of T tokens from t0.
struct TokenBlock {
    const int8_t* x;          // token t0, column 0
    const float* scales;      // token t0's first scale
    const int32_t* offsets;   // nibble formats: offsets + t0 (stride m4 per group)
    int64_t k;
    int64_t m4;
};

// int8: the int32 dot products of one group (G columns from c0) for the R x T pairs,
// pair p = r * T + t in dot[p]'s lanes (pairs past R * T: zero). AVX-VNNI: the dots of
// the biased weights w + 128, the bias term left to the offsets.
template <int64_t G, int R, int T>
inline void int8_group_dots(const RowBlock<R>& b, const TokenBlock& tokens, int64_t c0, __m256i dot[kPairs]) {
    for (int p = 0; p < kPairs; ++p) dot[p] = _mm256_setzero_si256();
    for (int64_t c = c0; c < c0 + G; c += kStepColumns) {
        __m256i xv[T];
        for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tokens.x + t * tokens.k + c));
        for (int r = 0; r < R; ++r) {
            if (b.pf && (c & 63) == 0) b.pf->next();
            const __m256i wv = load_weights<Format::int8>(b.w[r] + c);
            if constexpr (kVnni) {
                const __m256i biased = _mm256_xor_si256(wv, _mm256_set1_epi8(static_cast<char>(0x80)));
                for (int t = 0; t < T; ++t) dot[r * T + t] = dpbusd(dot[r * T + t], biased, xv[t]);
            } else {
                const __m256i magnitude = _mm256_abs_epi8(wv);
                for (int t = 0; t < T; ++t)
                    dot[r * T + t] = _mm256_add_epi32(dot[r * T + t], signed_dots(magnitude, wv, xv[t]));
            }
        }
    }
}

// Nibble formats: adds to the int16 sums of the R x T pairs (int32 with AVX-VNNI or
// kSignedCodes) the 64 columns from c (a multiple of 64, a whole 64-column block of the
// token values): the 128-bit half h of a sum holds columns c + 32h .. c + 32h + 31.
template <Format F, int R, int T>
inline void nibble_full_step(const RowBlock<R>& b, const TokenBlock& tokens, int64_t c, __m256i sums[kPairs]) {
    __m256i x_even[T], x_odd[T];
    for (int t = 0; t < T; ++t) {
        const int8_t* x = tokens.x + t * tokens.k + c;
        x_even[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        x_odd[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
    }
    for (int r = 0; r < R; ++r) {
        if (b.pf && (c & 127) == 0) b.pf->next();
        __m256i u_even, u_odd;
        load_nibbles64<F>(b.w[r] + c / 2, &u_even, &u_odd);
        const __m256i magnitude_even = _mm256_abs_epi8(u_even), magnitude_odd = _mm256_abs_epi8(u_odd);
        for (int t = 0; t < T; ++t) {
            if constexpr (kVnni)
                sums[r * T + t] = dpbusd(dpbusd(sums[r * T + t], u_even, x_even[t]), u_odd, x_odd[t]);
            else if constexpr (kSignedCodes<F>)
                sums[r * T + t] = _mm256_add_epi32(sums[r * T + t],
                                                   _mm256_add_epi32(signed_dots(magnitude_even, u_even, x_even[t]),
                                                                    signed_dots(magnitude_odd, u_odd, x_odd[t])));
            else
                sums[r * T + t] = _mm256_add_epi16(sums[r * T + t], _mm256_add_epi16(_mm256_maddubs_epi16(u_even, x_even[t]),
                                                                                     _mm256_maddubs_epi16(u_odd, x_odd[t])));
        }
    }
}

// Nibble formats: the sums (as nibble_full_step's) of the 32 columns from c (a multiple of
// 32 at a 64-column edge of the segment or of k), the even ones in the low half, the odd
// ones in the high half.
template <Format F, int R, int T>
inline void nibble_half_step(const RowBlock<R>& b, const TokenBlock& tokens, int64_t c, __m256i sums[kPairs]) {
    const NibbleColumns at = nibble_columns(c, tokens.k);
    __m256i xv[T];
    for (int t = 0; t < T; ++t) {
        const int8_t* x = tokens.x + t * tokens.k;
        xv[t] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + at.even))),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + at.odd)), 1);
    }
    for (int r = 0; r < R; ++r) {
        if (b.pf && (c & 127) == 0) b.pf->next();
        const __m256i uv = load_weights<F>(b.w[r] + c / 2), magnitude = _mm256_abs_epi8(uv);
        for (int t = 0; t < T; ++t) {
            if constexpr (kVnni)
                sums[r * T + t] = dpbusd(sums[r * T + t], uv, xv[t]);
            else if constexpr (kSignedCodes<F>)
                sums[r * T + t] = _mm256_add_epi32(sums[r * T + t], signed_dots(magnitude, uv, xv[t]));
            else
                sums[r * T + t] = _mm256_add_epi16(sums[r * T + t], _mm256_maddubs_epi16(uv, xv[t]));
        }
    }
}

// The int32 widening of int16 pair sums (pairs past R * T: zero); AVX-VNNI's and
// kSignedCodes' sums are int32 already.
template <Format F, int R, int T>
inline void widen_pairs(const __m256i sums[kPairs], __m256i dot[kPairs]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int p = 0; p < kPairs; ++p)
        dot[p] = p >= R * T ? _mm256_setzero_si256() : kInt16Sums<F> ? _mm256_madd_epi16(sums[p], ones) : sums[p];
}

// The offsets of group g for the pairs, lane p = token p % T of the block.
template <int T>
inline __m256i pair_offsets(const int32_t* offsets_t0, int64_t m4, int64_t g) {
    const __m256i four = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets_t0 + g * m4)));
    return _mm256_permutevar8x32_epi32(four, _mm256_setr_epi32(0 % T, 1 % T, 2 % T, 3 % T, 4 % T, 5 % T, 6 % T, 7 % T));
}

// total + float(group totals) * the group's scale products (the totals less the tokens'
// bias offsets first, where the weights were biased).
template <Format F, int T>
inline __m256 add_group(__m256 total, __m256i totals, const TokenBlock& tokens, int64_t g, __m256 tile) {
    if constexpr (kHasOffsets<F>) totals = _mm256_sub_epi32(totals, pair_offsets<T>(tokens.offsets, tokens.m4, g));
    return _mm256_add_ps(total, _mm256_mul_ps(_mm256_cvtepi32_ps(totals), tile));
}

// One register block over columns [k0, k1) of a segment: sums[p] = sum over its groups of
// float(dot) * (s_w * s_x), pair p = r * T + t, in increasing group order from 0.
template <Format F, int64_t G, int R, int T>
void block_sums(const RowBlock<R>& b, ScaleDtype scale_dtype, const TokenBlock& tokens, int64_t k0, int64_t k1,
                float sums[kPairs]) {
    static_assert(R * T <= kPairs, "a register block holds at most kPairs pairs");
    const int64_t x_groups = tokens.k / G;
    __m256 total = _mm256_setzero_ps();
    for (int64_t g0 = k0 / G; g0 < k1 / G; g0 += kPairs) {
        const int64_t n = k1 / G - g0 < kPairs ? k1 / G - g0 : kPairs;
        __m256 tile[kPairs];
        scale_tile<R, T>(b.scales, scale_dtype, tokens.scales, x_groups, g0, n, tile);
        for (int64_t i = 0; i < n;) {
            const int64_t c = (g0 + i) * G;
            __m256i dot[kPairs];
            if constexpr (F == Format::int8) {
                int8_group_dots<G, R, T>(b, tokens, c, dot);
            } else {
                __m256i nibble_sums[kPairs];
                for (int p = 0; p < kPairs; ++p) nibble_sums[p] = _mm256_setzero_si256();
                if constexpr (G == 32) {
                    // A whole 64-column block holds two groups, one per half of the sums.
                    if (c % 64 == 0 && i + 1 < n && c + 64 <= tokens.k) {
                        nibble_full_step<F, R, T>(b, tokens, c, nibble_sums);
                        __m256i first, second;
                        if constexpr (kInt16Sums<F> && T == kTokenBlock) {
                            reduce_halves_int16(nibble_sums, &first, &second);
                        } else {
                            widen_pairs<F, R, T>(nibble_sums, dot);
                            reduce_halves(dot, &first, &second);
                        }
                        total = add_group<F, T>(total, first, tokens, g0 + i, tile[i]);
                        total = add_group<F, T>(total, second, tokens, g0 + i + 1, tile[i + 1]);
                        i += 2;
                        continue;
                    }
                    nibble_half_step<F, R, T>(b, tokens, c, nibble_sums);
                } else {
                    for (int64_t s = 0; s < G; s += 64) nibble_full_step<F, R, T>(b, tokens, c + s, nibble_sums);
                }
                widen_pairs<F, R, T>(nibble_sums, dot);
            }
            total = add_group<F, T>(total, reduce_pairs(dot), tokens, g0 + i, tile[i]);
            ++i;
        }
    }
    _mm256_storeu_ps(sums, total);
}

// The rows of a row block (up to kBlockRows of a segment inside [row_begin, row_end)).
struct Rows {
    const uint8_t* w[kBlockRows];
    const void* scales[kBlockRows];
    float* out[kBlockRows];
    int n = 0;
};

// Rows r0 .. r0 + R of the row block against tokens t0 .. t0 + T; rows past the block's
// end repeat row r0 (valid memory), their sums dropped.
template <Format F, int64_t G, int R, int T>
void run_block(const Rows& rows, ScaleDtype scale_dtype, const TokenBlock& tokens, int64_t k0, int64_t k1, int64_t t0,
               LinePrefetcher* pf) {
    for (int r0 = 0; r0 < rows.n; r0 += R) {
        RowBlock<R> b;
        for (int r = 0; r < R; ++r) {
            const int row = r0 + r < rows.n ? r0 + r : r0;
            b.w[r] = rows.w[row];
            b.scales[r] = rows.scales[row];
        }
        b.pf = pf;
        float sums[kPairs];
        block_sums<F, G, R, T>(b, scale_dtype, tokens, k0, k1, sums);
        for (int r = 0; r < R && r0 + r < rows.n; ++r)
            for (int t = 0; t < T; ++t) rows.out[r0 + r][t0 + t] += sums[r * T + t];
    }
}

// The tokens of the next register block, of `remaining`: up to kTokenBlock, except that
// the formats with int16 sums at group 32 take 3 as 2 + 1. Their full step ends two
// groups, so each step pays two epilogues (widening, reduction tree, scale-and-add) for
// every register block, and the epilogue costs more than loading and unpacking the rows
// again: as 2 rows x 3 tokens a block leaves 2 of its 8 pair lanes empty and a row block
// needs 4 blocks, as 4 x 2 and 8 x 1 every lane is full and it needs 3 (docs/kernels.md:
// 1.1-1.5x faster at three tokens; int8, iq4nl's int32 sums and groups of 64 and 128 gain
// nothing or lose).
template <Format F, int64_t G>
constexpr int64_t token_block_size(int64_t remaining) {
    if (kInt16Sums<F> && G == 32 && remaining == 3) return 2;
    return remaining < kTokenBlock ? remaining : kTokenBlock;
}

template <Format F, int64_t G>
void matmul_segments(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const TokenOperand<F, G> operand(packed, m, k);
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const int64_t row_bytes = column_bytes<F>(w.ld);
    const int64_t scale_bytes = scale_dtype_bytes(w.scale_dtype);
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += kBlockRows) {
            const int64_t j1 = j0 + kBlockRows < j_hi ? j0 + kBlockRows : j_hi;
            Rows rows;
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t r = seg.row0 + j * stride;
                rows.w[rows.n] = data + r * row_bytes;
                rows.scales[rows.n] = static_cast<const uint8_t*>(w.scales) + r * w.scales_ld * scale_bytes;
                rows.out[rows.n] = out + r * ldo;
                ++rows.n;
            }
            LinePrefetcher pf(rows.w[0] + 2 * kBlockRows * stride * row_bytes, column_bytes<F>(seg.k0),
                              column_bytes<F>(seg.k1), stride * row_bytes);
            for (int64_t t0 = 0; t0 < m;) {
                const int64_t nt = token_block_size<F, G>(m - t0);
                const TokenBlock tokens{operand.values + t0 * k, operand.scales + t0 * (k / G),
                                        operand.offsets ? operand.offsets + t0 : nullptr, k, offsets_stride(m)};
                LinePrefetcher* first = t0 == 0 ? &pf : nullptr;
                switch (nt) {
                    case 1: run_block<F, G, 8, 1>(rows, w.scale_dtype, tokens, seg.k0, seg.k1, t0, first); break;
                    case 2: run_block<F, G, 4, 2>(rows, w.scale_dtype, tokens, seg.k0, seg.k1, t0, first); break;
                    case 3: run_block<F, G, 2, 3>(rows, w.scale_dtype, tokens, seg.k0, seg.k1, t0, first); break;
                    default: run_block<F, G, 2, 4>(rows, w.scale_dtype, tokens, seg.k0, seg.k1, t0, first); break;
                }
                t0 += nt;
            }
            if constexpr (has_minimums(F)) add_block_minimums(w, seg, j0, j1, stride, operand.sums, m, k, out, ldo);
        }
    });
}

template <Format F, int64_t G>
const KernelOps& table() {
    // The epilogues of the down projection touch rows x tokens floats, nothing next to the
    // weights: the reference's serve.
    static const KernelOps& ref = *ref_integer_ops(F, G);
    static const KernelOps ops{kIsa,           isa_name(kIsa),        F,
                               G,              plain_layout,          packed_bytes<F, G>,
                               gather<F, G>,   matmul_segments<F, G>, silu_mul_pack<F, G>,
                               ref.combine_down, ref.store_down};
    return ops;
}

}  // namespace

#if defined(NUMA_MOE_EMULATED) && defined(NUMA_MOE_AVX_VNNI)
const KernelOps* avx2_vnni_emulated_integer_ops(Format format, int64_t group) {
#elif defined(NUMA_MOE_EMULATED)
const KernelOps* avx2_emulated_integer_ops(Format format, int64_t group) {
#elif defined(NUMA_MOE_AVX_VNNI)
const KernelOps* avx2_vnni_integer_ops(Format format, int64_t group) {
#else
const KernelOps* avx2_integer_ops(Format format, int64_t group) {
#endif
    return integer_table(format, group, [](auto f, auto g) -> const KernelOps& {
        return table<decltype(f)::value, decltype(g)::value>();
    });
}

}  // namespace numa_moe::kernels
