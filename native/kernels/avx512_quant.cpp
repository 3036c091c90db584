// AVX-512-VNNI kernels of the integer weight formats (docs/quantization.md): int8, int4,
// mxfp4 and iq4nl weights against int8 tokens, vpdpbusd (u8 x s8, four products per 32-bit lane). Compiled
// with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma -mavx512vnni -ffp-contract=off;
// dispatch only hands these tables out when cpuid + XCR0 allow it. One table per format
// and group G (32, 64, 128); G is also the tokens' quantization block. avx512_vbmi_quant.cpp
// compiles this source again with -mavx512vbmi for the codebook formats' (mxfp4, iq4nl)
// tables of CPUs with VBMI (their lookup, biased_low_nibbles).
//
// Operand layouts (kernel_api.hpp):
//   weights  int8 w[r * ld + c]; int4 / mxfp4 / iq4nl (the nibble formats, "int4" below): byte
//            (r * ld + c) / 2, the even column in its low nibble, each code an integer of
//            the format's codebook (nibble_codes.hpp); never repacked. Scales (fp32, fp16,
//            bf16; mxfp4 e8m0) s[r * scales_ld + c / G]
//   tokens   the same int8 values and fp32 scales as ref_quant.cpp (per token and block of
//            G columns), laid out by token count:
//            plain (m < 5)  q[t * k + c] (the nibble formats: each 128-column
//                           block's even columns, then its odd ones; the last block k % 128
//                           columns if short), then scale[t * (k / G) + b]
//            interleaved (5 <= m <= 12; int4 to 16) the m tokens' values of each
//                           weight dword side by side: int8 q[(c / 4) * 4m + 4t + c % 4];
//                           int4 per 8 columns (a packed weight dword) each token's 4
//                           even ones, then its 4 odd ones:
//                           q[(c / 8) * 8m + 8t + 4 (c % 2) + (c % 8) / 2].
//                           Then scale[t * (k / G) + b], then the int32 start
//                           -bias * sum(q) of each token and block, [t * (k / G) + b]
//            lanes (more)   lane group j = tokens 16j .. 16j + 15; for each 4 columns
//                           d = c / 4 a 64-byte vector at (j * k / 4 + d) * 64 whose
//                           lane l holds token 16j + l's 4 values as u8 x + 128; absent
//                           tokens hold 128 (x = 0). Then fp32
//                           scale[(j * (k / G) + b) * 16 + l] (0 for absent tokens).
//                           Values are padded to 64 bytes before the scales.
//            formats with minimums, every layout: then fp32 group sums
//                           X[t * (k / G) + b] (group_minimums.hpp)
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// The result is the reference's bit for bit: per group an exact int32 dot product,
// float(dot) * (s_w * s_x) added in fp32 in increasing column order, starting from 0 per
// segment and added to out at the end (hence -ffp-contract=off: no fused multiply-add may
// change a rounding).
//
// vpdpbusd wants one unsigned operand.
// 1 to 4 tokens (pairs, plain operand): the weights are made unsigned by an offset, one
// xor per weight vector shared by all tokens: int8 u = w + 128 (w ^ 0x80), int4 u = q + 8
// (nibble ^ 8; mxfp4 u = value + 12, iq4nl value + 127, a lookup per nibble vector); dot(u, x) = dot(w, x) + bias * sum(x), and the bias term of each token
// (vpdpbusd with a constant, shared by all rows) is the accumulator's start value,
// negated. Register block: R rows x T tokens = up to 16 (row, token) pairs, one vector
// each; a reduction tree (reduce_pairs) turns the 16 vectors into one vector of group
// totals, lane p = pair p (the nibble formats step 128 columns: at G = 32 four vectors,
// one per group, reduce_quarters; at 64 the two halves of the tree), so the fp32
// scale-and-add runs on 16 pairs at once, except at one token, where a block is 8 rows
// (8 pairs): 16 row streams read from memory more slowly than 8 (docs/kernels.md).
// Each weight vector loaded serves T tokens.
// 5 to 12 tokens, int4 to 16 (row lanes): the same unsigned weights, 16 rows a block,
// each 64 bytes of the 16 rows transposed in registers so that lane r holds row r: every
// weight dword then meets each token's 4 bytes broadcast from memory (the interleaved
// operand; for int8 the same quads as the AMX B operand), and a group's totals come out
// one vector of 16 rows per token, with no reduction tree; the bias term per token and
// group comes with the operand (gather, silu_mul_pack).
// More tokens (lanes): the tokens are the unsigned operand, biased once by gather or
// silu_mul_pack, and each weight dword is broadcast straight from memory into vpdpbusd:
// one instruction per 4 columns x 16 tokens. dot(x + 128, w) = dot(x, w) + 128 sum(w):
// the sums of each row's groups are taken once per row block (amortised over every lane
// group) and subtracted per group. int4 rows are first unpacked to signed bytes in a
// per-thread buffer, also once per row block.
// All three kernels stream a register block's rows side by side, and every weight line
// they load requests (L2) one line of the row block after next, taken in address order,
// row after row (LinePrefetcher): the hardware prefetchers do not ramp up on 8-16 rows of
// a few KB read in step, and one request stream in address order kept the memory busier
// than the same lines requested row by row in step with the loads (docs/kernels.md).
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "common/util.hpp"

#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"
#include "kernels/group_minimums.hpp"
#include "kernels/integer_tables.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/nibble_codes.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// avx512_quant_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx512_emulated;
#else
constexpr Isa kIsa = Isa::avx512;
#endif

constexpr int kPairs = 16;             // lanes of a pair vector
constexpr int64_t kChunkGroups = 16;   // groups whose scale products one tile holds
constexpr int64_t kStepColumns = 64;   // columns of one plain step (a vector of int8 weights)

// From 5 tokens the row lanes beat the pairs (a transpose per 16 x 64 weight bytes,
// amortised over the tokens, against a reduction tree per group and 16 pairs; at 4 tokens
// and G = 32 the row lanes win from L2 but the pairs from memory, docs/kernels.md), and the
// token lanes, whose 16 lanes are partly padding, up to 12 tokens (one pass: 12
// accumulators and 16 weight vectors fill the registers); int4 up to 16 as well, in two
// passes over the same rows, since its token lanes first unpack every row block to bytes.
// docs/kernels.md.
constexpr int64_t kRowLaneMinTokens = 5;
constexpr int kRowLaneMaxPass = 12;  // tokens of one row-lane pass
template <Format F>
constexpr int64_t kLaneMinTokens = F == Format::int8 ? kRowLaneMaxPass + 1 : 17;  // int4: two passes to 16
constexpr int kRowLaneRows = 16;
constexpr int kLaneTokens = 16;
constexpr int kUnpackedRowsSlot = 0, kRowScalesSlot = 1, kRowSumsSlot = 2;  // thread_scratch slots

// ---------------------------------------------------------------------------------------
// Token operand.

template <Format F>
constexpr bool uses_lanes(int64_t m) {
    return m >= kLaneMinTokens<F>;
}
template <Format F>
constexpr bool uses_row_lanes(int64_t m) {
    return m >= kRowLaneMinTokens && m < kLaneMinTokens<F>;
}
inline int64_t lane_groups(int64_t m) { return (m + kLaneTokens - 1) / kLaneTokens; }

template <Format F>
size_t value_bytes(int64_t m, int64_t k) {
    const int64_t n = uses_lanes<F>(m) ? lane_groups(m) * (k / 4) * 64 : m * k;
    return (static_cast<size_t>(n) + 63) / 64 * 64;
}

// Bytes of the values, scales and row-lane starts; formats with minimums then hold their
// group sums.
template <Format F, int64_t G>
size_t sums_offset(int64_t m, int64_t k) {
    const int64_t scales = uses_lanes<F>(m) ? lane_groups(m) * (k / G) * 16 : m * (k / G);
    const int64_t starts = uses_row_lanes<F>(m) ? m * (k / G) : 0;
    return value_bytes<F>(m, k) + static_cast<size_t>(scales) * sizeof(float) + static_cast<size_t>(starts) * sizeof(int32_t);
}

template <Format F, int64_t G>
size_t packed_bytes(int64_t m, int64_t k) {
    const size_t sums = has_minimums(F) ? static_cast<size_t>(m * (k / G)) * sizeof(float) : 0;
    return sums_offset<F, G>(m, k) + sums;
}

template <Format F, int64_t G>
float* group_sums(const void* packed, int64_t m, int64_t k) {
    return reinterpret_cast<float*>(static_cast<uint8_t*>(const_cast<void*>(packed)) + sums_offset<F, G>(m, k));
}

// The few-token kernels of the nibble formats take the even and the odd columns of a
// 128-column block apart (pair_dots_split): their plain token operand holds each block (the
// last one k % 128 columns, if short) as its even-column bytes, then its odd ones.
constexpr int64_t kSplitColumns = 128;
constexpr bool splits_nibbles(Format format) { return format != Format::int8; }

// Where the even columns of token row bytes [c, ...) start in the split operand (the odd
// ones: half_block bytes on), c inside the block that starts at column c / 128 * 128.
struct SplitAt {
    SplitAt(int64_t k, int64_t c) {
        const int64_t block = c / kSplitColumns * kSplitColumns;
        half_block = (k - block < kSplitColumns ? k - block : kSplitColumns) / 2;
        even = block + (c - block) / 2;
    }
    int64_t even, half_block;
};

// The bias that makes the weights the unsigned operand: int8 w + 128, a nibble format's
// value + its codebook's bias.
template <Format F>
constexpr int32_t weight_bias() {
    if constexpr (F == Format::int8)
        return 128;
    else
        return NibbleCodes<F>::kBias;
}
template <Format F>
constexpr char kBias = static_cast<char>(weight_bias<F>());  // int8: 0x80

// Where gather and silu_mul_pack put token t's block b (G values and a scale; row lanes
// also minus the offset's product with them, start[t * (k / G) + b]).
template <Format F, int64_t G>
struct TokenWriter {
    TokenWriter(void* packed, int64_t m_, int64_t k_)
        : values(static_cast<uint8_t*>(packed)),
          scales(reinterpret_cast<float*>(values + value_bytes<F>(m_, k_))),
          starts(uses_row_lanes<F>(m_) ? reinterpret_cast<int32_t*>(scales + m_ * (k_ / G)) : nullptr),
          sums(has_minimums(F) ? group_sums<F, G>(packed, m_, k_) : nullptr),
          m(m_), k(k_), lanes(uses_lanes<F>(m_)), row_lanes(uses_row_lanes<F>(m_)) {}

    void put(int64_t t, int64_t b, const int8_t* q, float scale) const {
        if constexpr (has_minimums(F)) sums[t * (k / G) + b] = token_group_sum<G>(q, scale);
        if (row_lanes) {
            put_interleaved(t, b, q);
            int32_t sum = 0;
            for (int64_t c = 0; c < G; ++c) sum += q[c];
            scales[t * (k / G) + b] = scale;
            starts[t * (k / G) + b] = -weight_bias<F>() * sum;
            return;
        }
        if (!lanes) {
            if constexpr (splits_nibbles(F)) {
                const SplitAt at(k, b * G);
                uint8_t* even = values + t * k + at.even;
                for (int64_t c = 0; c < G; c += 2) {
                    even[c / 2] = static_cast<uint8_t>(q[c]);
                    even[at.half_block + c / 2] = static_cast<uint8_t>(q[c + 1]);
                }
            } else {
                std::memcpy(values + t * k + b * G, q, G);
            }
            scales[t * (k / G) + b] = scale;
            return;
        }
        const int64_t j = t / kLaneTokens, lane = t % kLaneTokens;
        uint8_t* first = values + (j * (k / 4) + b * G / 4) * 64 + lane * 4;
        for (int64_t d = 0; d < G / 4; ++d) {
            uint32_t word;
            std::memcpy(&word, q + 4 * d, 4);
            word ^= 0x80808080u;
            std::memcpy(first + d * 64, &word, 4);
        }
        scales[(j * (k / G) + b) * 16 + lane] = scale;
    }

    // Row lanes: the m tokens' bytes of one weight dword side by side, m * 4 bytes per 4
    // columns (int8) or m * 8 per 8 (int4: each token's 4 even columns, then its 4 odd
    // ones, the low and high nibbles of the dword).
    void put_interleaved(int64_t t, int64_t b, const int8_t* q) const {
        if constexpr (F == Format::int8) {
            for (int64_t d = 0; d < G / 4; ++d) std::memcpy(values + ((b * G / 4 + d) * m + t) * 4, q + 4 * d, 4);
        } else {
            const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            for (int64_t e = 0; e < G / 8; e += 2) {
                const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * e)), order);
                _mm_storel_epi64(reinterpret_cast<__m128i*>(values + ((b * G / 8 + e) * m + t) * 8), v);
                _mm_storel_epi64(reinterpret_cast<__m128i*>(values + ((b * G / 8 + e + 1) * m + t) * 8),
                                 _mm_unpackhi_epi64(v, v));
            }
        }
    }

    // Lanes: the lanes of absent tokens of columns [c_begin, c_end) hold x = 0 with scale
    // 0 (each writer fills its own columns: no shared bytes).
    void fill_padding(int64_t c_begin, int64_t c_end) const {
        if (!lanes) return;
        for (int64_t j = m / kLaneTokens; j < lane_groups(m); ++j) {  // the last group, if short
            const int64_t present = m - j * kLaneTokens;
            const __mmask16 pad = static_cast<__mmask16>(~tail_mask16(present));
            for (int64_t d = c_begin / 4; d < c_end / 4; ++d)
                _mm512_mask_storeu_epi32(values + (j * (k / 4) + d) * 64, pad, _mm512_set1_epi8(static_cast<char>(0x80)));
            for (int64_t b = c_begin / G; b < c_end / G; ++b)
                _mm512_mask_storeu_ps(scales + (j * (k / G) + b) * 16, pad, _mm512_setzero_ps());
        }
    }

    uint8_t* values;
    float* scales;
    int32_t* starts;
    float* sums;  // formats with minimums: X[t * (k / G) + b] (group_minimums.hpp)
    int64_t m, k;
    bool lanes, row_lanes;
};

template <Format F, int64_t G>
void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    const TokenWriter<F, G> out(packed, m, k);
    out.fill_padding(0, k);
    quantize_tokens_avx512<G>(x, ldx, token_index, m, k,
                              [&](int64_t t, int64_t b, const int8_t* q, float scale) { out.put(t, b, q, scale); });
}

template <Format F, int64_t G>
void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    const TokenWriter<F, G> out(packed, m, i_total);
    out.fill_padding(i_begin, i_end);
    quantize_silu_mul_avx512<G>(gate_parts, up_parts, n_parts, ld, i_begin, i_end, m, epilogue,
                                [&](int64_t t, int64_t b, const int8_t* q, float scale) { out.put(t, b, q, scale); });
}

// ---------------------------------------------------------------------------------------
// Weights.

template <Format F>
constexpr int64_t column_bytes(int64_t c) {
    return F == Format::int8 ? c : c / 2;
}

// The codebook formats: the code in each byte's low nibble as the unsigned operand value +
// bias (mxfp4 12, iq4nl 127), a lookup in
// the 16-byte table repeated in every 128-bit lane; the bits above the nibble do not count.
// vpshufb zeroes a byte whose index has bit 7 set, so it needs the nibble masked; vpermb
// (VBMI, the avx512_vbmi_quant.cpp build) indexes by the low six bits, which the repeated
// table makes the nibble's, and needs no mask: one operation a vector where vpshufb takes two.
inline __m512i lookup_low_nibbles(__m512i bytes, const void* table16) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(static_cast<const __m128i*>(table16)));
#ifdef NUMA_MOE_AVX512_VBMI
    return _mm512_permutexvar_epi8(bytes, table);
#else
    return _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, _mm512_set1_epi8(0x0f)));
#endif
}

template <Format F>
inline __m512i biased_low_nibbles(__m512i bytes) {
    return lookup_low_nibbles(bytes, kBiasedCodes<F>.bytes);
}

// 64 columns (or the first 32, upper half zero) of a nibble-format row, column c's code in
// the low nibble of byte c (the bits above it not cleared): widened to 16 bits, byte 0x?HL
// becomes the pair of bytes (L, H) with word | word << 4.
inline __m512i spread_nibbles(const uint8_t* p, bool full) {
    const __m256i raw = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi8(0xffff, p);
    const __m512i wide = _mm512_cvtepu8_epi16(raw);
    return _mm512_or_si512(wide, _mm512_slli_epi16(wide, 4));
}

// 64 columns (or the first 32, upper half zero) of a weight row as unsigned bytes
// u = w + bias in column order.
template <Format F>
inline __m512i load_unsigned(const uint8_t* p, bool full) {
    if constexpr (F == Format::int8) {
        const __m512i w = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xffffffffull, p);
        return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
    } else {
        // Two columns per byte, spread as spread_nibbles does: int4 biases each nibble
        // with an xor first and masks with the spreading (one ternary logic); the codebook
        // formats look the spread codes up.
        if constexpr (F == Format::int4) {
            __m256i raw = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi8(0xffff, p);
            raw = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x88)));
            const __m512i wide = _mm512_cvtepu8_epi16(raw);
            return _mm512_ternarylogic_epi32(wide, _mm512_slli_epi16(wide, 4), _mm512_set1_epi16(0x0f0f), 0xa8);
        } else {
            return biased_low_nibbles<F>(spread_nibbles(p, full));
        }
    }
}

// 64 columns (or the first 32, upper half zero) of a nibble-format row as signed bytes in
// column order: int4 its unsigned bytes less the bias (no wrap: u <= 15), the codebook
// formats their signed values looked up (iq4nl's u - 127 would wrap a byte).
template <Format F>
inline __m512i load_signed(const uint8_t* p, bool full) {
    if constexpr (F == Format::int4)
        return _mm512_sub_epi8(load_unsigned<F>(p, full), _mm512_set1_epi8(kBias<F>));
    else
        return lookup_low_nibbles(spread_nibbles(p, full), NibbleCodes<F>::kValues);
}

// n (<= 16) consecutive scales of one row from group g0, as fp32 (lanes past n: 0). e8m0
// as e8m0_scale: the byte shifted into the exponent field is 2^(e - 127) (0 for e = 0),
// halved exactly, and e = 0 set to 2^-128 on its own.
inline __m512 row_scales(ScaleDtype type, const void* row_scales, int64_t g0, int64_t n) {
    const __mmask16 mask = tail_mask16(n);
    switch (type) {
        case ScaleDtype::e8m0: {
            const uint8_t* p = static_cast<const uint8_t*>(row_scales) + g0;
            alignas(16) uint8_t part[16] = {};
            if (n < 16) std::memcpy(part, p, static_cast<size_t>(n));
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(n < 16 ? part : p));
            const __m512i e = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(bytes));
            const __m512 half = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.5f));
            const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
            return _mm512_maskz_mov_ps(mask, _mm512_mask_blend_ps(zero, half, _mm512_castsi512_ps(_mm512_set1_epi32(0x00200000))));
        }
        case ScaleDtype::fp32: return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row_scales) + g0);
        case ScaleDtype::fp16:
            return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row_scales) + g0));
        default:
            return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row_scales) + g0)), 16));
    }
}

// The R rows of a register block. Rows past `rows` (a short last block) repeat row 0, so
// that the kernel reads only valid memory; their results are dropped.
template <int R>
struct RowBlock {
    const uint8_t* w[R];       // column 0 of each row
    const void* scales[R];     // the row's first scale
    const uint8_t* pf;         // column 0 of the row block after next, for prefetching
    int64_t w_step;            // bytes between rows
    float* out[R];             // out row
    int rows;
};

// Segment row j is weight row seg.row0 + j * stride: its bytes start at row * row_bytes,
// its scales at row * scales_ld * scale_bytes.
struct RowGeometry {
    RowGeometry(Format format, const Weights& w, const Segment& seg)
        : stride(seg.row_stride > 0 ? seg.row_stride : 1),
          row_bytes(format == Format::int8 ? w.ld : w.ld / 2),
          scale_bytes(scale_dtype_bytes(w.scale_dtype)) {}
    int64_t stride, row_bytes, scale_bytes;
};

template <int R>
RowBlock<R> row_block_of(Format format, const Weights& w, const Segment& seg, int64_t j, int64_t j_hi, float* out,
                         int64_t ldo) {
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const RowGeometry g(format, w, seg);
    RowBlock<R> b;
    b.rows = static_cast<int>(j_hi - j < R ? j_hi - j : R);
    b.w_step = g.stride * g.row_bytes;
    b.pf = data + (seg.row0 + (j + 2 * R) * g.stride) * g.row_bytes;
    for (int r = 0; r < R; ++r) {
        const int64_t row = seg.row0 + (j + (r < b.rows ? r : 0)) * g.stride;
        b.w[r] = data + row * g.row_bytes;
        b.scales[r] = static_cast<const uint8_t*>(w.scales) + row * w.scales_ld * g.scale_bytes;
        b.out[r] = out + row * ldo;
    }
    return b;
}

// ---------------------------------------------------------------------------------------
// Few tokens: pairs.

// acc += vpdpbusd(u, s). GCC 12 keeps each accumulator of the intrinsic in two registers
// with a copy either side of every instruction (it does not coalesce the tied operand in
// a loop); the asm operand "+v" makes the accumulator one register.
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
#ifdef NUMA_MOE_EMULATED
    acc = _mm512_dpbusd_epi32(acc, u, s);  // no instruction to write out: SIMDe's vectors
#else
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#endif
}


// tile[i][p] = s_w(row r, group g0 + i) * s_x(token t, group g0 + i), pair p = r * T + t:
// the factor of group i's totals, a vector over the pairs (a transpose of per-row vectors).
template <int R, int T>
void scale_tile(const RowBlock<R>& b, const Weights& w, const float* xs, int64_t x_groups, int64_t g0, int64_t n,
                __m512 tile[kChunkGroups]) {
    // Built in registers and stored once: zeroing the caller's array with a memset (which
    // GCC emits for it) cost a fifth of this function at one token.
    __m512 sx[T], v[kPairs];
    for (int t = 0; t < T; ++t) sx[t] = _mm512_maskz_loadu_ps(tail_mask16(n), xs + t * x_groups + g0);
    for (int r = 0; r < R; ++r) {
        const __m512 sw = row_scales(w.scale_dtype, b.scales[r], g0, n);
        for (int t = 0; t < T; ++t) v[r * T + t] = _mm512_mul_ps(sw, sx[t]);
    }
    for (int p = R * T; p < kPairs; ++p) v[p] = _mm512_setzero_ps();
    transpose16(v);
    for (int i = 0; i < kChunkGroups; ++i) tile[i] = v[i];
}

// The totals of each 128-bit lane of the 16 pair vectors: 128-bit lane l of s2[i] holds
// those of pairs 4i .. 4i + 3 (pairwise unpack-and-add within 128-bit lanes).
inline void reduce_within_lanes(const __m512i v[kPairs], __m512i s2[4]) {
    __m512i s1[8];
    for (int i = 0; i < 8; ++i)
        s1[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        s2[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[2 * i], s1[2 * i + 1]),
                                 _mm512_unpackhi_epi64(s1[2 * i], s1[2 * i + 1]));
}

// v[p] lanes 0-7: partial sums of pair p's first half, lanes 8-15 its second. Returns the
// half totals, lane p = pair p: pairwise unpack-and-add within 128-bit lanes, then across.
inline void reduce_pairs(const __m512i v[kPairs], __m512i* first, __m512i* second) {
    __m512i s2[4];
    reduce_within_lanes(v, s2);
    const __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[0], s2[1], 0x88), _mm512_shuffle_i32x4(s2[0], s2[1], 0xdd));
    const __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[2], s2[3], 0x88), _mm512_shuffle_i32x4(s2[2], s2[3], 0xdd));
    *first = _mm512_shuffle_i32x4(a, c, 0x88);
    *second = _mm512_shuffle_i32x4(a, c, 0xdd);
}

// v[p] lanes 4q .. 4q + 3: partial sums of pair p's quarter q. quarter[q] lane p = pair
// p's total of quarter q: the lane totals, then a 4 x 4 transpose of 128-bit lanes.
inline void reduce_quarters(const __m512i v[kPairs], __m512i quarter[4]) {
    reduce_within_lanes(v, quarter);
    transpose4x128(quarter);
}

// The pair vectors of `steps` 64-column steps (the last one 32 columns when !full) from
// column c: v[p] = sum over the steps of vpdpbusd(u_row, x_token), started from the bias
// correction of the same token columns.
// The pair vectors stay in registers only while every index into v is a constant; GCC 12
// left some of these short loops rolled (here the token loop, whose load is a branch; in
// pair_dots_split the codebook formats' row loop) and kept v in memory, a load and a store
// around each vpdpbusd: hence the unroll pragmas (int8 at groups of 32 and 3-4 tokens 1.6x
// faster, the codebook formats at 2 tokens 1.2x, from L2).
template <Format F, int R, int T, int S>
inline void pair_dots(const RowBlock<R>& b, const int8_t* xq, int64_t k, int64_t c, bool full, __m512i v[kPairs],
                      LinePrefetcher& pf) {
    const __m512i bias = _mm512_set1_epi8(kBias<F>);
    __m512i x[T][S];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
        __m512i correction = _mm512_setzero_si512();
        for (int s = 0; s < S; ++s) {
            const int8_t* p = xq + t * k + c + s * kStepColumns;
            x[t][s] = full || s + 1 < S ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xffffffffull, p);
            correction = _mm512_dpbusd_epi32(correction, bias, x[t][s]);
        }
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), correction);
        for (int r = 0; r < R; ++r) v[r * T + t] = start;
    }
    for (int p = R * T; p < kPairs; ++p) v[p] = _mm512_setzero_si512();
    for (int s = 0; s < S; ++s) {
        const int64_t offset = column_bytes<F>(c + s * kStepColumns);
        const bool whole = full || s + 1 < S;
        for (int r = 0; r < R; ++r) {
            pf.next<F == Format::int8 ? 64 : 32>();
            const __m512i u = load_unsigned<F>(b.w[r] + offset, whole);
            for (int t = 0; t < T; ++t) dpbusd(v[r * T + t], u, x[t][s]);
        }
    }
}

// The nibble formats: columns [c, c + n) of one 128-column block, 64 weight bytes a row
// when whole. The tokens' even and odd columns are apart (splits_nibbles), so the low
// nibbles of the bytes meet the even columns and the high ones the odd: int4 unpacks 128 columns in three operations (one ternary logic
// (w & 0x0f) ^ 8 per nibble, after a shift for the high ones) where column order takes
// five per 64; the codebook formats look each nibble up instead of the xor. Lane 4i .. 4i + 3 of v[p]
// sums columns c + 8i .. c + 8i + 7: a group of 32 is a quarter of the vector, of 64 a half.
// kWhole (n = 128) loads without masks.
template <Format F, int R, int T, bool kWhole>
inline void pair_dots_split(const RowBlock<R>& b, const int8_t* xq, int64_t k, int64_t c, int64_t n, __m512i v[kPairs],
                            LinePrefetcher& pf) {
    const __m512i bias = _mm512_set1_epi8(kBias<F>), low = _mm512_set1_epi8(0x0f);
    constexpr int kAndXor = 0x6a;  // ternarylogic(a, b, c) = (a & b) ^ c
    const __mmask64 mask = kWhole ? ~0ull : (1ull << (n / 2)) - 1;
    const auto load = [mask](const void* p) { return kWhole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(mask, p); };
    const SplitAt at(k, c);
    __m512i even[T], odd[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
        even[t] = load(xq + t * k + at.even);
        odd[t] = load(xq + t * k + at.even + at.half_block);
        __m512i correction = _mm512_setzero_si512();
        dpbusd(correction, bias, even[t]);
        dpbusd(correction, bias, odd[t]);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), correction);
        for (int r = 0; r < R; ++r) v[r * T + t] = start;
    }
    for (int p = R * T; p < kPairs; ++p) v[p] = _mm512_setzero_si512();
    const int64_t offset = c / 2;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
        pf.next();
        const __m512i packed = load(b.w[r] + offset);
        __m512i lo, hi;
        if constexpr (F == Format::int4) {
            lo = _mm512_ternarylogic_epi32(packed, low, bias, kAndXor);
            hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, 4), low, bias, kAndXor);
        } else {
            lo = biased_low_nibbles<F>(packed);
            hi = biased_low_nibbles<F>(_mm512_srli_epi16(packed, 4));
        }
        for (int t = 0; t < T; ++t) {
            dpbusd(v[r * T + t], lo, even[t]);
            dpbusd(v[r * T + t], hi, odd[t]);
        }
    }
}

// The steps of pair_micro for the nibble formats at G = 32 and 64: one 128-column block a
// step (G = 32: four groups, a group per 128-bit lane of the pair vectors; 64: two, a group
// per half), in chunks of 16 groups whose scale products scale_tile builds. Steps and
// chunks are aligned to absolute columns, so that a step never crosses a chunk, and a
// segment that starts or ends off the 128-column grid takes a partial step there. (G = 128
// takes pair_steps, whose steps are whole groups: this loop measured 5-8% slower there at
// 4 tokens.)
template <Format F, int64_t G, int R, int T>
inline void pair_steps_split(const RowBlock<R>& b, const Weights& w, const int8_t* xq, const float* xs, int64_t k,
                             int64_t c0, int64_t c1, LinePrefetcher& pf, __m512& acc, __m512 tile[kChunkGroups]) {
    constexpr int64_t kChunkColumns = kChunkGroups * G;
    static_assert(kChunkColumns % kSplitColumns == 0, "a step never crosses a chunk");
    for (int64_t cc = c0, ce; cc < c1; cc = ce) {
        ce = (cc / kChunkColumns + 1) * kChunkColumns < c1 ? (cc / kChunkColumns + 1) * kChunkColumns : c1;
        scale_tile<R, T>(b, w, xs, k / G, cc / G, (ce - cc) / G, tile);
        for (int64_t c = cc, e; c < ce; c = e) {
            e = (c / kSplitColumns + 1) * kSplitColumns < ce ? (c / kSplitColumns + 1) * kSplitColumns : ce;
            __m512i v[kPairs], totals[4];
            if (e - c == kSplitColumns)
                pair_dots_split<F, R, T, true>(b, xq, k, c, e - c, v, pf);
            else
                pair_dots_split<F, R, T, false>(b, xq, k, c, e - c, v, pf);
            if constexpr (G == 32)
                reduce_quarters(v, totals);
            else
                reduce_pairs(v, &totals[0], &totals[1]);
            const int64_t i = (c - cc) / G;
            for (int q = 0; q < (e - c) / G; ++q)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(totals[q]), tile[i + q]));
        }
    }
}

// The steps of pair_micro in column order from c0: int8 at G = 32 two groups a 64-column
// step (the two halves of the reduction); G >= 64 a group is G / 64 steps, summed in int32
// (the nibble formats at G = 128: one 128-column block, pair_dots_split).
template <Format F, int64_t G, int R, int T>
inline void pair_steps(const RowBlock<R>& b, const Weights& w, const int8_t* xq, const float* xs, int64_t k,
                       int64_t c0, int64_t c1, LinePrefetcher& pf, __m512& acc, __m512 tile[kChunkGroups]) {
    constexpr int kSteps = G >= kStepColumns ? static_cast<int>(G / kStepColumns) : 1;
    for (int64_t cc = c0; cc < c1; cc += kChunkGroups * G) {
        const int64_t ce = cc + kChunkGroups * G < c1 ? cc + kChunkGroups * G : c1;
        scale_tile<R, T>(b, w, xs, k / G, cc / G, (ce - cc) / G, tile);
        for (int64_t c = cc; c < ce; c += kSteps * kStepColumns) {
            const int64_t i = (c - cc) / G;
            __m512i v[kPairs], first, second;
            if constexpr (G == 32) {
                const bool full = ce - c >= kStepColumns;
                pair_dots<F, R, T, 1>(b, xq, k, c, full, v, pf);
                reduce_pairs(v, &first, &second);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(first), tile[i]));
                if (full) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(second), tile[i + 1]));
            } else {
                if constexpr (splits_nibbles(F))
                    pair_dots_split<F, R, T, true>(b, xq, k, c, kSplitColumns, v, pf);
                else
                    pair_dots<F, R, T, kSteps>(b, xq, k, c, true, v, pf);
                reduce_pairs(v, &first, &second);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(first, second)), tile[i]));
            }
        }
    }
}

// out[r][t] += sum over the groups of [c0, c1) of float(dot) * (s_w * s_x), in group
// order, for the R rows of b and T tokens from xq / xs.
template <Format F, int64_t G, int R, int T>
void pair_micro(const RowBlock<R>& b, const Weights& w, const int8_t* xq, const float* xs, int64_t k, int64_t c0,
                int64_t c1) {
    static_assert(R * T <= kPairs, "one vector of pairs");
    __m512 acc = _mm512_setzero_ps();
    __m512 tile[kChunkGroups];
    LinePrefetcher pf(b.pf, column_bytes<F>(c0), column_bytes<F>(c1), b.w_step);
    if constexpr (splits_nibbles(F) && G < 128)
        pair_steps_split<F, G, R, T>(b, w, xq, xs, k, c0, c1, pf, acc, tile);
    else
        pair_steps<F, G, R, T>(b, w, xq, xs, k, c0, c1, pf, acc, tile);
    alignas(64) float sums[kPairs];
    _mm512_store_ps(sums, acc);
    for (int r = 0; r < b.rows; ++r)
        for (int t = 0; t < T; ++t) b.out[r][t] += sums[r * T + t];
}

// Rows per register block for T tokens: all 16 pairs used (15 at T = 3), but 8 rows at
// one token (see the file's opening block).
constexpr int rows_for_tokens(int t) { return t == 1 ? 8 : kPairs / t; }

template <Format F, int64_t G, int T>
void pair_row_block(const Weights& w, const Segment& seg, int64_t j, int64_t j_hi, const int8_t* q, const float* xs,
                    int64_t k, float* out, int64_t ldo) {
    constexpr int R = rows_for_tokens(T);
    const RowBlock<R> b = row_block_of<R>(F, w, seg, j, j_hi, out, ldo);
    pair_micro<F, G, R, T>(b, w, q, xs, k, seg.k0, seg.k1);
}

// ---------------------------------------------------------------------------------------
// Many tokens: lanes.

// The row block's columns [c0, c1) as signed bytes, column c at rows[r] + c - c0: int8
// rows in place, the nibble formats' rows unpacked into this thread's buffer.
template <Format F, int R>
void signed_rows(const RowBlock<R>& b, int64_t c0, int64_t c1, const int8_t* rows[R]) {
    if constexpr (F == Format::int8) {
        for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const int8_t*>(b.w[r]) + c0;
    } else {
        const int64_t n = c1 - c0, padded = (n + 63) / 64 * 64;
        int8_t* buffer = static_cast<int8_t*>(thread_scratch(kUnpackedRowsSlot, R * padded));
        for (int r = 0; r < R; ++r) {
            int8_t* dst = buffer + r * padded;
            for (int64_t c = 0; c < n; c += kStepColumns)
                _mm512_storeu_si512(dst + c, load_signed<F>(b.w[r] + (c0 + c) / 2, n - c >= kStepColumns));
            rows[r] = dst;
        }
    }
}

// The weight side of a lane row block: its rows as signed bytes from column c0, and their
// fp32 scales sw[r * sw_ld + g] of groups g0 + g.
template <int R>
struct LaneRows {
    const int8_t* rows[R];
    const float* sw;        // sw[r * ld + g]: fp32 weight scale of group g0 + g
    const int32_t* bias;    // bias[r * ld + g]: 128 * the sum of the row's weights in it
    int64_t ld;
    int64_t c0, g0, n_groups;
    int column_shift;       // bytes of column c of a weight row: c >> column_shift (int4: 1)
};

// sums[g] = 128 * sum of row[c] over group g's columns (row indexed from the first group,
// n groups): per 16 groups, one vpdpbusd against ones per 64 columns, then the 16 vectors
// reduced at once (reduce_pairs).
template <int64_t G>
void group_bias(const int8_t* row, int64_t n_groups, int32_t* sums) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g0 = 0; g0 < n_groups; g0 += 16) {
        __m512i v[kPairs];
        for (int i = 0; i < kPairs; ++i) {
            v[i] = _mm512_setzero_si512();
            if (g0 + i >= n_groups) continue;
            const int8_t* p = row + (g0 + i) * G;
            if constexpr (G == 32) {
                dpbusd(v[i], ones, _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
            } else {
                for (int64_t c = 0; c < G; c += 64) dpbusd(v[i], ones, _mm512_loadu_si512(p + c));
            }
        }
        __m512i first, second;
        reduce_pairs(v, &first, &second);
        _mm512_storeu_si512(sums + g0, _mm512_slli_epi32(_mm512_add_epi32(first, second), 7));
    }
}

// The int32 sums of one group (G columns from cg) for R rows and NG lane groups: per 4
// columns, NG token vectors and R weight dwords (broadcast from memory) feed R x NG
// independent vpdpbusd. A function of its own so that the sums stay in registers: inside
// the group loop GCC spilled them.
template <int64_t G, int R, int NG>
__attribute__((noinline)) void group_dots(const int8_t* const rows[R], int64_t cg, const uint8_t* xv,
                                          int64_t x_group_bytes, __m512i* dots) {
    __m512i dot[R][NG];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int n = 0; n < NG; ++n) dot[r][n] = _mm512_setzero_si512();
    for (int64_t c = cg; c < cg + G; c += 4, xv += 64) {
        __m512i x[NG];
#pragma GCC unroll 4
        for (int n = 0; n < NG; ++n) x[n] = _mm512_load_si512(xv + n * x_group_bytes);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            int32_t word;
            std::memcpy(&word, rows[r] + c, sizeof(word));
            const __m512i wv = _mm512_set1_epi32(word);
#pragma GCC unroll 4
            for (int n = 0; n < NG; ++n) dpbusd(dot[r][n], x[n], wv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int n = 0; n < NG; ++n) _mm512_store_si512(dots + r * NG + n, dot[r][n]);
}

// out[r][t] += the group-ordered fp32 sum, for R rows and NG lane groups from lane group
// j0: per group the int32 sums (group_dots), less the rows' bias, then scaled.
template <int64_t G, int R, int NG>
void lane_micro(const RowBlock<R>& b, const LaneRows<R>& lr, const uint8_t* values, const float* xs, int64_t m,
                int64_t k, int64_t j0) {
    for (int n = 0; n < NG; ++n)
        for (int r = 0; r < b.rows; ++r) prefetch_out_floats(b.out[r] + (j0 + n) * kLaneTokens, kLaneTokens);
    alignas(64) float acc[R][NG][16] = {};
    alignas(64) __m512i dots[R * NG];
    const int64_t x_group_bytes = (k / 4) * 64;
    const int8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = lr.rows[r] - lr.c0;  // indexed by column
    LinePrefetcher pf(b.pf, lr.c0 >> lr.column_shift, (lr.c0 + lr.n_groups * G) >> lr.column_shift, b.w_step);
    for (int64_t g = 0; g < lr.n_groups; ++g) {
        const int64_t cg = (lr.g0 + g) * G;
        // The first pass over the rows requests the group's share of the row block after
        // next: without that request 16-token calls read the weights slower than the bf16
        // kernel does.
        if (j0 == 0)
            for (int64_t line = 0; line < R * (G >> lr.column_shift); line += 64) pf.next();
        group_dots<G, R, NG>(rows, cg, values + j0 * x_group_bytes + cg * 16, x_group_bytes, dots);
        for (int n = 0; n < NG; ++n) {
            const __m512 sx = _mm512_loadu_ps(xs + ((j0 + n) * (k / G) + lr.g0 + g) * 16);
            for (int r = 0; r < R; ++r) {
                const __m512i dot = dots[r * NG + n];
                const __m512i exact = _mm512_sub_epi32(dot, _mm512_set1_epi32(lr.bias[r * lr.ld + g]));
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(lr.sw[r * lr.ld + g]), sx);
                _mm512_store_ps(acc[r][n], _mm512_add_ps(_mm512_load_ps(acc[r][n]),
                                                         _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale)));
            }
        }
    }
    for (int n = 0; n < NG; ++n) {
        const int64_t t0 = (j0 + n) * kLaneTokens;
        const __mmask16 tmask = tail_mask16(m - t0 < kLaneTokens ? m - t0 : kLaneTokens);
        for (int r = 0; r < b.rows; ++r)
            _mm512_mask_storeu_ps(b.out[r] + t0, tmask,
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(tmask, b.out[r] + t0), _mm512_load_ps(acc[r][n])));
    }
}

// Rows per lane row block: 8 when every lane group fits one register block with 8 rows,
// else 6 with up to 3 lane groups per register block: R x NG sums + NG token vectors + a
// broadcast stay within the 32 registers with room (at 6 x 4 GCC spilled the sums).
constexpr int kLaneMaxGroups = 3;
inline int lane_rows(int64_t m) { return lane_groups(m) <= 2 ? 8 : 6; }

// Every lane group of the tokens against R rows of a segment, NG at a time.
template <Format F, int64_t G, int R>
void lane_row_block(const Weights& w, const Segment& seg, int64_t j, int64_t j_hi, const uint8_t* values,
                    const float* xs, int64_t m, int64_t k, float* out, int64_t ldo) {
    const RowBlock<R> b = row_block_of<R>(F, w, seg, j, j_hi, out, ldo);
    LaneRows<R> lr;
    signed_rows<F, R>(b, seg.k0, seg.k1, lr.rows);
    lr.c0 = seg.k0;
    lr.column_shift = F == Format::int8 ? 0 : 1;
    lr.g0 = seg.k0 / G;
    lr.n_groups = (seg.k1 - seg.k0) / G;
    lr.ld = lr.n_groups + 16;  // 16 spare: whole-vector stores
    float* sw = static_cast<float*>(thread_scratch(kRowScalesSlot, sizeof(float) * R * lr.ld));
    int32_t* bias = static_cast<int32_t*>(thread_scratch(kRowSumsSlot, sizeof(int32_t) * R * lr.ld));
    for (int r = 0; r < R; ++r) {
        for (int64_t g = 0; g < lr.n_groups; g += 16)
            _mm512_storeu_ps(sw + r * lr.ld + g,
                             row_scales(w.scale_dtype, b.scales[r], lr.g0 + g, lr.n_groups - g < 16 ? lr.n_groups - g : 16));
        group_bias<G>(lr.rows[r], lr.n_groups, bias + r * lr.ld);
    }
    lr.sw = sw;
    lr.bias = bias;
    // Register blocks of about equal lane groups (4 = 2 + 2, not 3 + 1).
    const int64_t groups = lane_groups(m), blocks = (groups + kLaneMaxGroups - 1) / kLaneMaxGroups;
    for (int64_t i = 0, j0 = 0; i < blocks; ++i) {
        const int64_t ng = groups / blocks + (i < groups % blocks ? 1 : 0);
        const int64_t first = j0;
        j0 += ng;
        switch (ng) {
            case 1: lane_micro<G, R, 1>(b, lr, values, xs, m, k, first); break;
            case 2: lane_micro<G, R, 2>(b, lr, values, xs, m, k, first); break;
            default:
                if constexpr (R <= 6) lane_micro<G, R, 3>(b, lr, values, xs, m, k, first);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 5 to 12 tokens, int4 to 16: row lanes.

// acc += vpdpbusd(u, the 4 token bytes at x broadcast to every lane), the broadcast taken
// by the instruction's memory operand (no shuffle); "+v" as in dpbusd.
inline void dpbusd_broadcast(__m512i& acc, __m512i u, const int8_t* x) {
#ifdef NUMA_MOE_EMULATED
    int32_t quad;
    std::memcpy(&quad, x, sizeof(quad));
    acc = _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(quad));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
#endif
}

// transpose16 on 32-bit integer lanes: v[j] lane r <- v[r] lane j.
__attribute__((always_inline)) inline void transpose16_epi32(__m512i v[16]) {
    __m512 f[16];
    for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(v[i]);
    transpose16(f);
    for (int i = 0; i < 16; ++i) v[i] = _mm512_castps_si512(f[i]);
}

// A row-lane register block: 16 rows of a segment, row r at w + r * step (rows past
// `rows`, in a segment's last block, are not read: their lanes are zero and dropped).
struct RowLaneBlock {
    const uint8_t* w;
    int64_t step;
    const uint8_t* scales;  // row 0's first scale
    int64_t scales_step;    // bytes between rows' scales
    float* out;             // row 0's out row
    int64_t out_step;       // floats between rows' out rows
    int rows;
};

RowLaneBlock row_lane_block_of(Format format, const Weights& w, const Segment& seg, int64_t j, int64_t j_hi, float* out,
                               int64_t ldo) {
    const RowGeometry g(format, w, seg);
    const int64_t row0 = seg.row0 + j * g.stride;
    RowLaneBlock b;
    b.w = static_cast<const uint8_t*>(w.data) + row0 * g.row_bytes;
    b.step = g.stride * g.row_bytes;
    b.scales = static_cast<const uint8_t*>(w.scales) + row0 * w.scales_ld * g.scale_bytes;
    b.scales_step = g.stride * w.scales_ld * g.scale_bytes;
    b.out = out + row0 * ldo;
    b.out_step = g.stride * ldo;
    b.rows = static_cast<int>(j_hi - j < kRowLaneRows ? j_hi - j : kRowLaneRows);
    return b;
}

// sw[g * 16 + r] = fp32 scale of the block's row r and group g0 + g, g < n: one vector of
// the 16 rows' scales per group (rows' vectors of 16 groups, transposed; absent rows
// repeat row 0).
inline void row_lane_scales(const RowLaneBlock& b, ScaleDtype type, int64_t g0, int64_t n, float* sw) {
    for (int64_t gc = 0; gc < n; gc += 16) {
        const int64_t ng = n - gc < 16 ? n - gc : 16;
        __m512 v[16];
        for (int r = 0; r < kRowLaneRows; ++r)
            v[r] = row_scales(type, b.scales + (r < b.rows ? r : 0) * b.scales_step, g0 + gc, ng);
        transpose16(v);
        for (int64_t i = 0; i < ng; ++i) _mm512_store_ps(sw + (gc + i) * 16, v[i]);
    }
}

// A span: the weight bytes of a row that one call of row_lane_span takes, whole groups
// and at least one 64-byte vector (int8 G = 128: one group of two vectors; int8 G = 32,
// int4 G = 32 / 64: a vector of 2 / 4 / 2 groups).
template <Format F, int64_t G>
struct Span {
    static constexpr int64_t kGroupBytes = column_bytes<F>(G);
    static constexpr int64_t kBytes = kGroupBytes > 64 ? kGroupBytes : 64;
    static constexpr int kGroups = static_cast<int>(kBytes / kGroupBytes);
    static constexpr int kVectors = static_cast<int>(kBytes / 64);
};

// dots[i * T + t] = the exact int32 dot product of row r (lane r) with token t over group
// i of the span at w (row 0's first byte of it), for its first n_groups groups (fewer at a
// segment's end). x: the interleaved tokens from the span's first column; start[t *
// x_groups + i]: minus the offset's product, the accumulators' start.
// Per 64 bytes the 16 rows' vectors are transposed, so that lane r of vector j holds row
// r's dword j, and each meets every token's 4 bytes broadcast from memory: a group's 16
// row totals end in one vector per token, with no reduction. kWhole (16 rows, every group
// of the span) loads without masks. Each row's load requests the prefetcher's next line
// (its state is copied in and out, to stay in registers). A function of its own so that
// the accumulators stay in registers (as group_dots).
template <Format F, int64_t G, int T, int M, bool kWhole>
__attribute__((noinline)) void row_lane_span(const uint8_t* w, int64_t step, int rows, int n_groups, const int8_t* x,
                                             const int32_t* start, int64_t x_groups, __m512i* dots,
                                             LinePrefetcher* prefetcher) {
    using S = Span<F, G>;
    LinePrefetcher pf = *prefetcher;
    const __m512i low = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8(kBias<F>);
    constexpr int kAndXor = 0x6a;  // ternarylogic(a, b, c) = (a & b) ^ c
    const __mmask64 mask = kWhole || n_groups == S::kGroups ? ~0ull : (1ull << (n_groups * S::kGroupBytes)) - 1;
    __m512i acc[T];  // each started at its group's first dword; zeroed for GCC's -Wmaybe-uninitialized
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < S::kVectors; ++h) {
        __m512i u[kRowLaneRows];
        const uint8_t* p = w + 64 * h;
#pragma GCC unroll 16
        for (int r = 0; r < kRowLaneRows; ++r, p += step) {
            pf.next();
            u[r] = kWhole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(r < rows ? mask : 0, p);
            if constexpr (F == Format::int8) u[r] = _mm512_xor_si512(u[r], bias);
        }
        transpose16_epi32(u);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const int64_t at = 64 * h + 4 * j;  // byte in the span
            const int i = static_cast<int>(at / S::kGroupBytes);
            if (!kWhole && i >= n_groups) break;
            if (at % S::kGroupBytes == 0)
#pragma GCC unroll 12
                for (int t = 0; t < T; ++t) acc[t] = _mm512_set1_epi32(start[t * x_groups + i]);
            if constexpr (F == Format::int8) {
#pragma GCC unroll 12
                for (int t = 0; t < T; ++t) dpbusd_broadcast(acc[t], u[j], x + at * M + 4 * t);
            } else {
                __m512i lo, hi;
                if constexpr (F == Format::int4) {
                    lo = _mm512_ternarylogic_epi32(u[j], low, bias, kAndXor);
                    hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(u[j], 4), low, bias, kAndXor);
                } else {
                    lo = biased_low_nibbles<F>(u[j]);
                    hi = biased_low_nibbles<F>(_mm512_srli_epi16(u[j], 4));
                }
#pragma GCC unroll 12
                for (int t = 0; t < T; ++t) {
                    dpbusd_broadcast(acc[t], lo, x + 2 * at * M + 8 * t);
                    dpbusd_broadcast(acc[t], hi, x + 2 * at * M + 8 * t + 4);
                }
            }
            if ((at + 4) % S::kGroupBytes == 0)
#pragma GCC unroll 12
                for (int t = 0; t < T; ++t) _mm512_store_si512(dots + i * T + t, acc[t]);
        }
    }
    *prefetcher = pf;
}

// out[r][t0 + t] += the group-ordered fp32 sum over [c0, c1) for the rows of b and tokens
// t0 .. t0 + T - 1 of the M in the operand: per span the int32 dots (row_lane_span),
// scaled and added for 16 rows at once.
template <Format F, int64_t G, int T, int M>
void row_lane_micro(const RowLaneBlock& b, const float* sw, const int8_t* xv, const float* xs, const int32_t* starts,
                    int64_t k, int64_t c0, int64_t c1, int t0) {
    using S = Span<F, G>;
    const int64_t x_groups = k / G, g_first = c0 / G, g_end = c1 / G;
    xv += (F == Format::int8 ? 4 : 8) * t0;
    xs += t0 * x_groups;
    starts += t0 * x_groups;
    __m512 sum[T];
    for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_ps();
    alignas(64) __m512i dots[S::kGroups * T];
    LinePrefetcher pf(b.w + 2 * kRowLaneRows * b.step, column_bytes<F>(c0), column_bytes<F>(c1), b.step);
    for (int64_t g = g_first; g < g_end; g += S::kGroups) {
        const int n = static_cast<int>(g_end - g < S::kGroups ? g_end - g : S::kGroups);
        const uint8_t* w = b.w + column_bytes<F>(g * G);
        const int8_t* x = xv + g * G * M;
        if (b.rows == kRowLaneRows && n == S::kGroups)
            row_lane_span<F, G, T, M, true>(w, b.step, b.rows, n, x, starts + g, x_groups, dots, &pf);
        else
            row_lane_span<F, G, T, M, false>(w, b.step, b.rows, n, x, starts + g, x_groups, dots, &pf);
        for (int i = 0; i < n; ++i) {
            const __m512 sw_g = _mm512_load_ps(sw + (g + i - g_first) * 16);
            for (int t = 0; t < T; ++t) {
                const __m512 scale = _mm512_mul_ps(sw_g, _mm512_set1_ps(xs[t * x_groups + g + i]));
                sum[t] = _mm512_add_ps(sum[t], _mm512_mul_ps(_mm512_cvtepi32_ps(dots[i * T + t]), scale));
            }
        }
    }
    alignas(64) float sums[T][16];
    for (int t = 0; t < T; ++t) _mm512_store_ps(sums[t], sum[t]);
    for (int r = 0; r < b.rows; ++r)
        for (int t = 0; t < T; ++t) b.out[r * b.out_step + t0 + t] += sums[t][r];
}

template <Format F, int64_t G>
void row_lane_row_block(const Weights& w, const Segment& seg, int64_t j, int64_t j_hi, const int8_t* xv,
                        const float* xs, const int32_t* starts, int64_t m, int64_t k, float* out, int64_t ldo) {
    const RowLaneBlock b = row_lane_block_of(F, w, seg, j, j_hi, out, ldo);
    const int64_t g0 = seg.k0 / G, n_groups = (seg.k1 - seg.k0) / G;
    float* sw = static_cast<float*>(thread_scratch(kRowScalesSlot, sizeof(float) * 16 * (n_groups + 16)));
    row_lane_scales(b, w.scale_dtype, g0, n_groups, sw);
    // Up to kRowLaneMaxPass tokens in one pass; 13-16 (int4) in two of at most 8 over the
    // same rows, from L1 / L2.
    const auto pass = [&](auto tokens, auto stride, int t0) {
        row_lane_micro<F, G, decltype(tokens)::value, decltype(stride)::value>(b, sw, xv, xs, starts, k, seg.k0, seg.k1,
                                                                                t0);
    };
    using std::integral_constant;
    static_assert(kRowLaneMaxPass == 12 && kLaneMinTokens<F> <= 17, "the switches below list every pass");
    if (m > kRowLaneMaxPass) {
        if constexpr (uses_row_lanes<F>(16)) {
            switch (m) {
                case 13:
                    pass(integral_constant<int, 7>{}, integral_constant<int, 13>{}, 0);
                    pass(integral_constant<int, 6>{}, integral_constant<int, 13>{}, 7);
                    break;
                case 14:
                    pass(integral_constant<int, 7>{}, integral_constant<int, 14>{}, 0);
                    pass(integral_constant<int, 7>{}, integral_constant<int, 14>{}, 7);
                    break;
                case 15:
                    pass(integral_constant<int, 8>{}, integral_constant<int, 15>{}, 0);
                    pass(integral_constant<int, 7>{}, integral_constant<int, 15>{}, 8);
                    break;
                default:
                    pass(integral_constant<int, 8>{}, integral_constant<int, 16>{}, 0);
                    pass(integral_constant<int, 8>{}, integral_constant<int, 16>{}, 8);
                    break;
            }
        }
        return;
    }
    switch (m) {
        case 4: pass(integral_constant<int, 4>{}, integral_constant<int, 4>{}, 0); break;
        case 5: pass(integral_constant<int, 5>{}, integral_constant<int, 5>{}, 0); break;
        case 6: pass(integral_constant<int, 6>{}, integral_constant<int, 6>{}, 0); break;
        case 7: pass(integral_constant<int, 7>{}, integral_constant<int, 7>{}, 0); break;
        case 8: pass(integral_constant<int, 8>{}, integral_constant<int, 8>{}, 0); break;
        case 9: pass(integral_constant<int, 9>{}, integral_constant<int, 9>{}, 0); break;
        case 10: pass(integral_constant<int, 10>{}, integral_constant<int, 10>{}, 0); break;
        case 11: pass(integral_constant<int, 11>{}, integral_constant<int, 11>{}, 0); break;
        default: pass(integral_constant<int, 12>{}, integral_constant<int, 12>{}, 0); break;
    }
}

// ---------------------------------------------------------------------------------------
// Segments.

// Blocks of rows of each segment, in row order, each over all the tokens (its weights
// read once): 1-4 tokens the pairs (rows_for_tokens(m) rows), then to 12 the row lanes (16
// rows; int4 to 16), then the lanes (lane_rows(m) rows over every lane group).
template <Format F, int64_t G>
void matmul_segments(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin, int64_t row_end,
                     const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    if (m <= 0) return;
    const uint8_t* values = static_cast<const uint8_t*>(packed);
    const int8_t* q = reinterpret_cast<const int8_t*>(values);
    const float* xs = reinterpret_cast<const float*>(values + value_bytes<F>(m, k));
    const int32_t* starts = reinterpret_cast<const int32_t*>(xs + m * (k / G));  // row lanes
    const int rows = uses_lanes<F>(m)       ? lane_rows(m)
                     : uses_row_lanes<F>(m) ? kRowLaneRows
                                            : rows_for_tokens(static_cast<int>(m));
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += rows) {
            const int64_t j1 = j0 + rows < j_hi ? j0 + rows : j_hi;
            if (uses_lanes<F>(m)) {
                if (rows == 8)
                    lane_row_block<F, G, 8>(w, seg, j0, j1, values, xs, m, k, out, ldo);
                else
                    lane_row_block<F, G, 6>(w, seg, j0, j1, values, xs, m, k, out, ldo);
            } else if (uses_row_lanes<F>(m)) {
                row_lane_row_block<F, G>(w, seg, j0, j1, q, xs, starts, m, k, out, ldo);
            } else {
                switch (m) {
                    case 1: pair_row_block<F, G, 1>(w, seg, j0, j1, q, xs, k, out, ldo); break;
                    case 2: pair_row_block<F, G, 2>(w, seg, j0, j1, q, xs, k, out, ldo); break;
                    case 3: pair_row_block<F, G, 3>(w, seg, j0, j1, q, xs, k, out, ldo); break;
                    default: pair_row_block<F, G, 4>(w, seg, j0, j1, q, xs, k, out, ldo); break;
                }
            }
            if constexpr (has_minimums(F))
                add_block_minimums(w, seg, j0, j1, stride, group_sums<F, G>(packed, m, k), m, k, out, ldo);
        }
    });
}

template <Format F, int64_t G>
const KernelOps& table() {
    static const KernelOps ops{kIsa, isa_name(kIsa), F, G, plain_layout, packed_bytes<F, G>, gather<F, G>,
                               matmul_segments<F, G>, silu_mul_pack<F, G>, combine_down_avx512,
                               store_down_avx512};
    return ops;
}

}  // namespace

#ifdef NUMA_MOE_AVX512_VBMI
// The VBMI build serves the codebook formats alone: their lookup is the only code VBMI
// changes (the other formats' tables would be the same kernels compiled twice).
#ifdef NUMA_MOE_EMULATED
const KernelOps* avx512_vbmi_emulated_integer_ops(Format format, int64_t group) {
#else
const KernelOps* avx512_vbmi_integer_ops(Format format, int64_t group) {
#endif
    if (!is_codebook_format(format)) return nullptr;
    return integer_table(format, group, [](auto f, auto g) -> const KernelOps& {
        return table<decltype(f)::value, decltype(g)::value>();
    });
}
#else
#ifdef NUMA_MOE_EMULATED
const KernelOps* avx512_emulated_integer_ops(Format format, int64_t group) {
#else
const KernelOps* avx512_integer_ops(Format format, int64_t group) {
#endif
    return integer_table(format, group, [](auto f, auto g) -> const KernelOps& {
        return table<decltype(f)::value, decltype(g)::value>();
    });
}
#endif

}  // namespace numa_moe::kernels
