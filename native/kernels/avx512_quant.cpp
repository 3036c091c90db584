// AVX-512-VNNI kernels of the integer weight formats (docs/quantization.md): int8 and int4
// weights against int8 tokens, vpdpbusd (u8 x s8, four products per 32-bit lane). Compiled
// with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma -mavx512vnni -ffp-contract=off;
// dispatch only hands these tables out when cpuid + XCR0 allow it.
//
// Operand layouts (kernel_api.hpp), exactly ref_quant.cpp's, so that every ISA's token
// operand holds the same bytes:
//   weights  int8 w[r * ld + c]; int4: byte (r * ld + c) / 2, the even column in its low
//            nibble, 4-bit two's complement; never repacked. Scales (fp32, fp16 or bf16)
//            s[r * scales_ld + c / group]
//   tokens   plain: q[t * k + c] int8 (m * k bytes, padded to 64), then fp32
//            scale[t * (k / 32) + b], symmetric per token and 32-column block
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// The result is the reference's bit for bit: per 32-column block an exact int32 dot
// product, float(dot) * (s_w * s_x) added in fp32 in increasing column order, starting
// from 0 per segment and added to out at the end (hence -ffp-contract=off: no fused
// multiply-add may change a rounding).
//
// vpdpbusd wants one unsigned operand. The weights are made unsigned by an offset, which
// is exact for every value and costs one xor per weight vector (shared by all tokens):
// int8 u = w + 128 (w ^ 0x80), int4 u = q + 8 (nibble ^ 8); then dot(u, x) = dot(w, x) +
// bias * sum(x), and the bias term of each token (one vpdpbusd with a constant, shared by
// all rows) is the accumulator's start value, negated.
//
// Few tokens (< 8). Register block: R rows x T tokens = up to 16 (row, token) pairs. A 64-column step gives
// one vector per pair, lanes 0-7 the partial sums of the first 32-column block, 8-15 the
// second; a reduction tree (reduce_pairs) turns the 16 vectors into one vector of block
// totals per block, lane p = pair p, so the fp32 scale-and-add runs on 16 pairs at once
// and in block order. The weights are streamed once, R rows at a time; each weight vector
// loaded serves T tokens; each step prefetches (L2) the same columns of the row block after
// next. Unlike avx512_bf16.cpp no second prefetch of the block one on: with 16 row
// streams it made the qwen3 expert ~15% slower (hot and cold, 2048 x 768, M = 1).
//
// Many tokens (>= 8): token lanes, 16 tokens a vector (lane_micro), so that the 8
// vpdpbusd of a row's block leave exact block totals in the lanes with no reduction.
#include <immintrin.h>

#include <cstring>

#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"
#include "kernels/isa_tables.hpp"

namespace numa_moe::kernels {
namespace {

constexpr int64_t kBlock = kActivationBlock;
constexpr int kPairs = 16;          // lanes of a pair vector
constexpr int64_t kChunkBlocks = 16;  // blocks whose scale products one tile holds

// ---------------------------------------------------------------------------------------
// Token operand: ref_quant.cpp's layout and rule.

size_t packed_bytes(int64_t m, int64_t k) {
    const size_t values = (static_cast<size_t>(m * k) + 63) / 64 * 64;
    return values + static_cast<size_t>(m * (k / kBlock)) * sizeof(float);
}

const float* token_scales(const void* packed, int64_t m, int64_t k) {
    return reinterpret_cast<const float*>(static_cast<const uint8_t*>(packed) +
                                          (static_cast<size_t>(m * k) + 63) / 64 * 64);
}

// 32 values -> symmetric int8 with scale amax / 127, as quantize_block of ref_quant.cpp:
// the same division (not a reciprocal) and round-half-even, so the same bytes.
inline void quantize_block(__m512 lo, __m512 hi, int8_t* q, float* scale) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.0f;
    *scale = s;
    if (!(s > 0.0f)) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
        return;
    }
    const __m512 sv = _mm512_set1_ps(s), limit = _mm512_set1_ps(127.0f), low = _mm512_set1_ps(-127.0f);
    const auto to_int8 = [&](__m512 v) {
        v = _mm512_roundscale_ps(_mm512_div_ps(v, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, limit), low)));
    };
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), to_int8(lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), to_int8(hi));
}

inline __m512 bf16x16_to_ps(const bf16* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    int8_t* q = static_cast<int8_t*>(packed);
    float* scales = const_cast<float*>(token_scales(packed, m, k));
    for (int64_t t = 0; t < m; ++t) {
        const bf16* row = x + token_index[t] * ldx;
        for (int64_t b = 0; b < k / kBlock; ++b)
            quantize_block(bf16x16_to_ps(row + b * kBlock), bf16x16_to_ps(row + b * kBlock + 16), q + t * k + b * kBlock,
                           scales + t * (k / kBlock) + b);
    }
}

// The gate/up epilogue: the partials are [row][token], the operand [token][column], so
// 16 rows x 16 tokens tiles are transposed in registers, two per 32-column block.
void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, void* packed) {
    int8_t* q = static_cast<int8_t*>(packed);
    float* scales = const_cast<float*>(token_scales(packed, m, i_total));
    for (int64_t i0 = i_begin; i0 < i_end; i0 += kBlock) {
        for (int64_t t0 = 0; t0 < m; t0 += 16) {
            const int64_t nt = m - t0 < 16 ? m - t0 : 16;
            const __mmask16 tmask = tail_mask16(nt);
            __m512 lo[16], hi[16];
            for (int ii = 0; ii < 16; ++ii) {
                const int64_t off_lo = (i0 + ii) * ld + t0, off_hi = (i0 + 16 + ii) * ld + t0;
                lo[ii] = _mm512_mul_ps(silu512(sum_parts(gate_parts, n_parts, off_lo, tmask)),
                                       sum_parts(up_parts, n_parts, off_lo, tmask));
                hi[ii] = _mm512_mul_ps(silu512(sum_parts(gate_parts, n_parts, off_hi, tmask)),
                                       sum_parts(up_parts, n_parts, off_hi, tmask));
            }
            transpose16(lo);
            transpose16(hi);
            for (int64_t tt = 0; tt < nt; ++tt)
                quantize_block(lo[tt], hi[tt], q + (t0 + tt) * i_total + i0,
                               scales + (t0 + tt) * (i_total / kBlock) + i0 / kBlock);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Weights.

template <Format F>
constexpr int64_t column_bytes(int64_t c) {
    return F == Format::int8 ? c : c / 2;
}

// 64 columns (or the first 32, upper half zero) of a weight row as unsigned bytes
// u = w + bias in column order.
template <Format F>
inline __m512i load_unsigned(const uint8_t* p, bool full) {
    if constexpr (F == Format::int8) {
        const __m512i w = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xffffffffull, p);
        return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
    } else {
        // Two columns per byte: widened to 16 bits, byte 0x?HL becomes the pair of bytes
        // (L, H) with (word | word << 4) & 0x0f0f, after the xor that biases each nibble.
        __m256i raw = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi8(0xffff, p);
        raw = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x88)));
        const __m512i wide = _mm512_cvtepu8_epi16(raw);
        return _mm512_ternarylogic_epi32(wide, _mm512_slli_epi16(wide, 4), _mm512_set1_epi16(0x0f0f), 0xa8);
    }
}

template <Format F>
constexpr char kBias = F == Format::int8 ? static_cast<char>(0x80) : 8;

// Scales of one row for a chunk: n groups from group g0, spread to the chunk's blocks by
// group_index (lane i: the group of block b0 + i, relative to g0).
inline __m512 row_scales(ScaleType type, const void* row_scales, int64_t g0, __mmask16 groups, __m512i group_index) {
    __m512 v;
    switch (type) {
        case ScaleType::fp32: v = _mm512_maskz_loadu_ps(groups, static_cast<const float*>(row_scales) + g0); break;
        case ScaleType::fp16:
            v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(groups, static_cast<const uint16_t*>(row_scales) + g0));
            break;
        default:
            v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(groups, static_cast<const uint16_t*>(row_scales) + g0)), 16));
    }
    return _mm512_permutexvar_ps(group_index, v);
}

// Lane i: (b0 + i) / per_group - b0 / per_group, lanes past nb repeating the last block.
// Exact in fp32 (block numbers are far below 2^24), and no integer division per lane,
// which cost more than the whole chunk's arithmetic when done per row block.
inline __m512i group_index(int64_t b0, int64_t nb, int64_t per_group) {
    const __m512 lane = _mm512_cvtepi32_ps(_mm512_min_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(static_cast<int>(nb - 1))));
    const __m512 group = _mm512_roundscale_ps(
        _mm512_div_ps(_mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(b0))), _mm512_set1_ps(static_cast<float>(per_group))),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_sub_epi32(_mm512_cvtps_epi32(group), _mm512_set1_epi32(static_cast<int>(b0 / per_group)));
}

// The R rows of a register block. Rows past `rows` (a short last block) repeat row 0, so
// that the kernel reads only valid memory; their results are dropped.
template <int R>
struct RowBlock {
    const uint8_t* w[R];       // column 0 of each row
    const void* scales[R];     // the row's first scale
    const uint8_t* pf;         // column 0 of the row block after next, for prefetching
    int64_t w_step;            // bytes between rows
    float* out[R];             // out row, first token of the token block
    int rows;
};

// tile[i][p] = s_w(row r, block b0 + i) * s_x(token t, block b0 + i), pair p = r * T + t:
// the factor of block i's totals, a vector over the pairs (a transpose of per-row vectors).
template <int R, int T>
void scale_tile(const RowBlock<R>& b, const Weights& w, const float* xs, int64_t x_blocks, int64_t b0, int64_t nb,
                __m512 tile[kChunkBlocks]) {
    const int64_t per_group = w.group / kBlock;
    const int64_t g0 = b0 / per_group;
    const __mmask16 groups = tail_mask16((b0 + nb - 1) / per_group - g0 + 1);
    const __m512i index = group_index(b0, nb, per_group);
    const __mmask16 mask = tail_mask16(nb);
    __m512 sx[T];
    for (int t = 0; t < T; ++t) sx[t] = _mm512_maskz_loadu_ps(mask, xs + t * x_blocks + b0);
    for (int p = 0; p < kPairs; ++p) tile[p] = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        const __m512 sw = row_scales(w.scale_type, b.scales[r], g0, groups, index);
        for (int t = 0; t < T; ++t) tile[r * T + t] = _mm512_mul_ps(sw, sx[t]);
    }
    transpose16(tile);
}

// v[p] lanes 0-7: partial sums of pair p's first block, lanes 8-15 its second. Returns the
// block totals, lane p = pair p: pairwise unpack-and-add within 128-bit lanes, then across.
inline void reduce_pairs(const __m512i v[kPairs], __m512i* first, __m512i* second) {
    __m512i s1[8], s2[4];
    for (int i = 0; i < 8; ++i)
        s1[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // 128-bit lane l of s2[i]: lane group l summed, pairs 4i .. 4i + 3
        s2[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[2 * i], s1[2 * i + 1]),
                                 _mm512_unpackhi_epi64(s1[2 * i], s1[2 * i + 1]));
    const __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[0], s2[1], 0x88), _mm512_shuffle_i32x4(s2[0], s2[1], 0xdd));
    const __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[2], s2[3], 0x88), _mm512_shuffle_i32x4(s2[2], s2[3], 0xdd));
    *first = _mm512_shuffle_i32x4(a, c, 0x88);
    *second = _mm512_shuffle_i32x4(a, c, 0xdd);
}

// One 64-column step (32 when !full) at column c: the per-pair partial sums of its blocks.
template <Format F, int R, int T>
inline void step_dots(const RowBlock<R>& b, const int8_t* xq, int64_t k, int64_t c, bool full, __m512i v[kPairs]) {
    const __m512i bias = _mm512_set1_epi8(kBias<F>);
    __m512i x[T], start[T];
    for (int t = 0; t < T; ++t) {
        x[t] = full ? _mm512_loadu_si512(xq + t * k + c) : _mm512_maskz_loadu_epi8(0xffffffffull, xq + t * k + c);
        start[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, x[t]));
    }
    for (int p = R * T; p < kPairs; ++p) v[p] = _mm512_setzero_si512();
    const int64_t offset = column_bytes<F>(c);
    for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(b.pf + r * b.w_step + offset), _MM_HINT_T2);
        const __m512i u = load_unsigned<F>(b.w[r] + offset, full);
        for (int t = 0; t < T; ++t) v[r * T + t] = _mm512_dpbusd_epi32(start[t], u, x[t]);
    }
}

// out[r][t] += sum over the blocks of [c0, c1) of float(dot) * (s_w * s_x), in block order,
// for the R rows of b and T tokens from xq / xs.
template <Format F, int R, int T>
void micro(const RowBlock<R>& b, const Weights& w, const int8_t* xq, const float* xs, int64_t k, int64_t c0, int64_t c1) {
    static_assert(R * T <= kPairs, "one vector of pairs");
    __m512 acc = _mm512_setzero_ps();
    __m512 tile[kChunkBlocks];
    for (int64_t cc = c0; cc < c1; cc += kChunkBlocks * kBlock) {
        const int64_t ce = cc + kChunkBlocks * kBlock < c1 ? cc + kChunkBlocks * kBlock : c1;
        scale_tile<R, T>(b, w, xs, k / kBlock, cc / kBlock, (ce - cc) / kBlock, tile);
        for (int64_t c = cc; c < ce; c += 2 * kBlock) {
            const bool full = ce - c >= 2 * kBlock;
            __m512i v[kPairs], first, second;
            step_dots<F, R, T>(b, xq, k, c, full, v);
            reduce_pairs(v, &first, &second);
            const int64_t i = (c - cc) / kBlock;
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(first), tile[i]));
            if (full) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(second), tile[i + 1]));
        }
    }
    alignas(64) float sums[kPairs];
    _mm512_store_ps(sums, acc);
    for (int r = 0; r < b.rows; ++r)
        for (int t = 0; t < T; ++t) b.out[r][t] += sums[r * T + t];
}

// ---------------------------------------------------------------------------------------
// Token lanes (many tokens): lane t of a vector is token t0 + t, 16 tokens a vector, so a
// block's 8 vpdpbusd per row (a weight dword broadcast against the tokens' dwords) leave
// exact block totals in the lanes: no reduction tree, which costs more shuffles than the
// products are worth once a weight row serves 16 tokens. The tokens of a block are
// transposed in registers once per row block (amortised over its R rows).

// From 8 tokens (hot 256 x 2048 int8, 1 thread: 7 tokens in token blocks take as long
// as 8 in lanes, and a lane pass costs about the same up to 16 tokens).
constexpr int64_t kLaneMinTokens = 8;
constexpr int kLaneRows = 16;

// The 32 columns at c of tokens [0, nt) (row-major, k apart) as 8 vectors, vector j lane
// t = token t's columns c + 4j .. c + 4j + 3; absent tokens are zero.
inline void transpose_tokens(const int8_t* xq, int64_t k, int nt, int64_t c, __m512i x[8]) {
    __m512 v[16];
    for (int t = 0; t < 16; ++t)
        v[t] = t < nt ? _mm512_castsi512_ps(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * k + c))))
                      : _mm512_setzero_ps();
    transpose16(v);  // outputs 8-15 (input lanes 8-15, zero) are not used
    for (int j = 0; j < 8; ++j) x[j] = _mm512_castps_si512(v[j]);
}

// 32 columns of an int4 weight row as unsigned biased bytes (as load_unsigned). Broadcasts
// are permutes from this register: a store and 8 dword loads of it stalled on the store
// forwarding (~15% at 16 tokens); int8 broadcasts straight from the weights instead.
inline __m256i unsigned_block(const uint8_t* p) {
    const __m128i raw = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(static_cast<char>(0x88)));
    const __m256i wide = _mm256_cvtepu8_epi16(raw);
    return _mm256_ternarylogic_epi32(wide, _mm256_slli_epi16(wide, 4), _mm256_set1_epi16(0x0f0f), 0xa8);
}

// out[r][t] += the block-ordered fp32 sum, for the R rows of b and nt <= 16 tokens.
template <Format F, int R>
void lane_micro(const RowBlock<R>& b, const Weights& w, const int8_t* xq, const float* xs, int64_t k, int nt, int64_t c0,
                int64_t c1) {
    const int64_t x_blocks = k / kBlock, per_group = w.group / kBlock;
    const __mmask16 tmask = tail_mask16(nt);
    const __m512i x_index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(x_blocks)));
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    alignas(64) float sw[R][kChunkBlocks];
    for (int64_t cc = c0; cc < c1; cc += kChunkBlocks * kBlock) {
        const int64_t b0 = cc / kBlock, nb = ((c1 - cc < kChunkBlocks * kBlock ? c1 - cc : kChunkBlocks * kBlock)) / kBlock;
        const int64_t g0 = b0 / per_group;
        const __mmask16 groups = tail_mask16((b0 + nb - 1) / per_group - g0 + 1);
        const __m512i index = group_index(b0, nb, per_group);
        for (int r = 0; r < R; ++r) _mm512_store_ps(sw[r], row_scales(w.scale_type, b.scales[r], g0, groups, index));
        for (int64_t i = 0; i < nb; ++i) {
            const int64_t c = cc + i * kBlock, offset = column_bytes<F>(c);
            __m512i x[8];
            transpose_tokens(xq, k, nt, c, x);
            __m512i start = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j) start = _mm512_dpbusd_epi32(start, _mm512_set1_epi8(kBias<F>), x[j]);
            start = _mm512_sub_epi32(_mm512_setzero_si512(), start);
            const __m512 sx = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), tmask, x_index, xs + b0 + i, 4);
            for (int r = 0; r < R; ++r) {
                _mm_prefetch(reinterpret_cast<const char*>(b.pf + r * b.w_step + offset), _MM_HINT_T2);
                __m512i dot = start;
                if constexpr (F == Format::int8) {  // a dword broadcast from memory, then biased
                    for (int j = 0; j < 8; ++j) {
                        int32_t word;
                        std::memcpy(&word, b.w[r] + offset + 4 * j, sizeof(word));
                        const __m512i u = _mm512_xor_si512(_mm512_set1_epi32(word), _mm512_set1_epi8(static_cast<char>(0x80)));
                        dot = _mm512_dpbusd_epi32(dot, u, x[j]);
                    }
                } else {  // unpacked in a register, each dword broadcast by a permute
                    const __m512i u = _mm512_castsi256_si512(unsigned_block(b.w[r] + offset));
                    for (int j = 0; j < 8; ++j)
                        dot = _mm512_dpbusd_epi32(dot, _mm512_permutexvar_epi32(_mm512_set1_epi32(j), u), x[j]);
                }
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sw[r][i]), sx);
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale));
            }
        }
    }
    for (int r = 0; r < b.rows; ++r)
        _mm512_mask_storeu_ps(b.out[r], tmask, _mm512_add_ps(_mm512_maskz_loadu_ps(tmask, b.out[r]), acc[r]));
}

// ---------------------------------------------------------------------------------------
// Row blocks and segments.

// Rows per register block for T tokens: all 16 pairs used (15 at T = 3).
constexpr int rows_for_tokens(int t) { return kPairs / t; }

// Rows j .. of a segment (at most R, fewer at j_hi) against tokens t0 .. (T, or up to 16
// in lanes when T == 0).
template <Format F, int T>
void row_block(const Weights& w, const Segment& seg, int64_t j, int64_t j_hi, int64_t stride, const int8_t* q,
               const float* xs, int64_t t0, int64_t nt, int64_t k, float* out, int64_t ldo) {
    constexpr int R = T == 0 ? kLaneRows : rows_for_tokens(T);
    const uint8_t* data = static_cast<const uint8_t*>(w.data);
    const int64_t row_bytes = column_bytes<F>(w.ld), scale_bytes = w.scale_type == ScaleType::fp32 ? 4 : 2;
    RowBlock<R> b;
    b.rows = static_cast<int>(j_hi - j < R ? j_hi - j : R);
    b.w_step = stride * row_bytes;
    b.pf = data + (seg.row0 + (j + 2 * R) * stride) * row_bytes;
    for (int r = 0; r < R; ++r) {
        const int64_t row = seg.row0 + (j + (r < b.rows ? r : 0)) * stride;
        b.w[r] = data + row * row_bytes;
        b.scales[r] = static_cast<const uint8_t*>(w.scales) + row * w.scales_ld * scale_bytes;
        b.out[r] = out + row * ldo + t0;
    }
    if constexpr (T == 0)
        lane_micro<F, R>(b, w, q + t0 * k, xs + t0 * (k / kBlock), k, static_cast<int>(nt), seg.k0, seg.k1);
    else
        micro<F, R, T>(b, w, q + t0 * k, xs + t0 * (k / kBlock), k, seg.k0, seg.k1);
}

// j range of segment rows r = row0 + j * stride inside [row_begin, row_end).
void segment_row_range(const Segment& seg, int64_t row_begin, int64_t row_end, int64_t* j_lo, int64_t* j_hi) {
    *j_lo = *j_hi = 0;
    if (seg.nrows <= 0 || row_end <= row_begin) return;
    const int64_t stride = seg.row_stride > 0 ? seg.row_stride : 1;
    int64_t lo = 0, hi = seg.nrows;
    if (seg.row0 < row_begin) lo = (row_begin - seg.row0 + stride - 1) / stride;
    if (seg.row0 + (hi - 1) * stride >= row_end) hi = row_end <= seg.row0 ? 0 : (row_end - seg.row0 + stride - 1) / stride;
    *j_lo = lo;
    *j_hi = hi > lo ? hi : lo;
}

// Few tokens: token blocks of 4 (4 rows x 4 tokens), the last one 1-3 tokens with more
// rows; many: groups of 16 token lanes. Each row block passes over all token blocks before
// the next rows, so its weights stay in cache.
template <Format F>
void matmul_segments(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin, int64_t row_end,
                     const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    if (m <= 0) return;
    const int8_t* q = static_cast<const int8_t*>(packed);
    const float* xs = token_scales(packed, m, k);
    const bool lanes = m >= kLaneMinTokens;
    const int64_t tail = m % 4, full_blocks = m / 4;
    // The row block follows the last token block's width: the widest (most rows) first.
    const int rows = lanes ? kLaneRows : tail ? rows_for_tokens(static_cast<int>(tail)) : rows_for_tokens(4);
    for (int64_t s = 0; s < n_segments; ++s) {
        const Segment& seg = segments[s];
        int64_t j_lo, j_hi;
        segment_row_range(seg, row_begin, row_end, &j_lo, &j_hi);
        if (j_lo >= j_hi || seg.k1 <= seg.k0) continue;
        const int64_t stride = seg.row_stride > 0 ? seg.row_stride : 1;
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += rows) {
            const int64_t j1 = j0 + rows < j_hi ? j0 + rows : j_hi;
            if (lanes) {
                for (int64_t t0 = 0; t0 < m; t0 += 16)
                    row_block<F, 0>(w, seg, j0, j1, stride, q, xs, t0, m - t0 < 16 ? m - t0 : 16, k, out, ldo);
                continue;
            }
            for (int64_t j = j0; j < j1; j += 4)
                for (int64_t tb = 0; tb < full_blocks; ++tb)
                    row_block<F, 4>(w, seg, j, j1, stride, q, xs, tb * 4, 4, k, out, ldo);
            switch (tail) {
                case 1: row_block<F, 1>(w, seg, j0, j1, stride, q, xs, m - 1, 1, k, out, ldo); break;
                case 2: row_block<F, 2>(w, seg, j0, j1, stride, q, xs, m - 2, 2, k, out, ldo); break;
                case 3: row_block<F, 3>(w, seg, j0, j1, stride, q, xs, m - 3, 3, k, out, ldo); break;
                default: break;
            }
        }
    }
}

}  // namespace

const KernelOps& avx512_int8_ops() {
    static const KernelOps ops{Isa::avx512, "avx512", Format::int8, plain_layout, packed_bytes, gather,
                               matmul_segments<Format::int8>, silu_mul_pack, combine_down_avx512, store_down_avx512};
    return ops;
}

const KernelOps& avx512_int4_ops() {
    static const KernelOps ops{Isa::avx512, "avx512", Format::int4, plain_layout, packed_bytes, gather,
                               matmul_segments<Format::int4>, silu_mul_pack, combine_down_avx512, store_down_avx512};
    return ops;
}

}  // namespace numa_moe::kernels
