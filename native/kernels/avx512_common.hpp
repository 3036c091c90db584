// AVX-512 helpers shared by the avx512 and amx translation units (both are compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16). Everything here has internal linkage
// (static / anonymous namespace) so that each TU keeps its own copy compiled with its own
// flags: no ODR merge can hand AVX-512 code to a baseline TU.
//
// Layouts handled here:
//   partials  parts[p][r * ld + t] fp32 (weight row r, token t)
//   plain     act[t * i_total + i] bf16 (dot-product kernels' token operand)
//   pairs     act[(i / 2) * 2 * m + 2 * t + i % 2] bf16 (AMX B operand, "VNNI" pairs)
//   int8      per token and group of G columns: G values in column order and a scale, handed
//             to the integer kernel's own writer
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/exp_poly.hpp"
#include "kernels/kernel_api.hpp"
#include "kernels/line_prefetcher.hpp"

namespace numa_moe::kernels {
namespace {

inline __mmask16 tail_mask16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

// Requests (L2) the lines of out[0, n) (n fp32 in one or two lines) that a register block
// adds into at its end: with many rows or k blocks they have left the caches, and a load
// from DRAM at the end of every block would stall it.
inline void prefetch_out_floats(const float* out, int64_t n) {
    _mm_prefetch(reinterpret_cast<const char*>(out), _MM_HINT_T2);
    _mm_prefetch(reinterpret_cast<const char*>(out + n - 1), _MM_HINT_T2);
}

// exp_poly's wrappers for __m512: 2^n applied with scalef, which also handles the
// over/underflow ends, so the whole fp32 range down to -103.9 is kept (~2 ulp).
struct Exp512Ops {
    static constexpr float kLowest = -103.9f;
    static __m512 set1(float v) { return _mm512_set1_ps(v); }
    static __m512 min(__m512 a, __m512 b) { return _mm512_min_ps(a, b); }
    static __m512 max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
    static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
    static __m512 round(__m512 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
    static __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
    static __m512 scale_pow2(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
};

inline __m512 exp512(__m512 x) { return exp_poly<Exp512Ops>(x); }

// kernel_api.hpp's Activation in vectors, bf16.hpp's activate with exp512: the clamps take
// the limit as the first operand, so that a NaN (returned from the second) passes through.
struct Activation512 {
    explicit Activation512(const Activation& a)
        : alpha(_mm512_set1_ps(a.alpha)), limit(_mm512_set1_ps(a.limit)), negative_limit(_mm512_set1_ps(-a.limit)),
          up_offset(_mm512_set1_ps(a.up_offset)) {}
    __m512 operator()(__m512 g, __m512 u) const {
        g = _mm512_min_ps(limit, g);
        u = _mm512_max_ps(negative_limit, _mm512_min_ps(limit, u));
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(alpha, g)));
        return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), _mm512_add_ps(u, up_offset));
    }
    __m512 alpha, limit, negative_limit, up_offset;
};

// 4 x 4 transpose of 128-bit elements: r[j] <- element j of every r[i].
inline void transpose4x128(__m512i r[4]) {
    const __m512i a = _mm512_shuffle_i64x2(r[0], r[1], 0x44), b = _mm512_shuffle_i64x2(r[0], r[1], 0xee);
    const __m512i c = _mm512_shuffle_i64x2(r[2], r[3], 0x44), d = _mm512_shuffle_i64x2(r[2], r[3], 0xee);
    r[0] = _mm512_shuffle_i64x2(a, c, 0x88);
    r[1] = _mm512_shuffle_i64x2(a, c, 0xdd);
    r[2] = _mm512_shuffle_i64x2(b, d, 0x88);
    r[3] = _mm512_shuffle_i64x2(b, d, 0xdd);
}

// In-register 16x16 fp32 transpose: r[i][j] -> r[j][i]. Always inlined: a call would
// make the caller save every live vector (all zmm registers are caller-saved), and the
// integer row-lane kernel calls it between its accumulators' updates.
__attribute__((always_inline)) inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // r[4i + j], 128-bit lane l, now holds rows 4i..4i+3 of column 4l + j.
    __m512 out[16];
    for (int j = 0; j < 4; ++j) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        const __m512 u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        out[j] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        out[8 + j] = _mm512_shuffle_f32x4(u0, u2, 0xdd);
        out[4 + j] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        out[12 + j] = _mm512_shuffle_f32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = out[i];
}

// packed[(c / 2) * 2 m_pad + 2t + c % 2] = x[token_index[t]][c], the pair layout {2,
// token_multiple} (the padding half of an odd last pair and the padding tokens m <= t <
// m_pad are zero). A pair is 32 bits, so this is a transpose of 32-bit elements:
// [m tokens][k/2 pairs] -> [k/2 pairs][m_pad tokens], 16 x 16 at a time.
inline void gather_pairs_avx512(const uint16_t* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k,
                                int64_t token_multiple, void* packed) {
    const int64_t whole_pairs = k / 2;
    const int64_t m_pad = (m + token_multiple - 1) / token_multiple * token_multiple;
    for (int64_t t0 = 0; t0 < m_pad; t0 += 16) {
        const int64_t nt = m - t0 < 16 ? (m > t0 ? m - t0 : 0) : 16;
        const int64_t nt_pad = m_pad - t0 < 16 ? m_pad - t0 : 16;
        for (int64_t p0 = 0; p0 < whole_pairs; p0 += 16) {
            const int64_t np = whole_pairs - p0 < 16 ? whole_pairs - p0 : 16;
            const __mmask16 pair_mask = tail_mask16(np);
            const __mmask16 token_mask = tail_mask16(nt_pad);
            __m512 v[16];
            for (int tt = 0; tt < 16; ++tt)
                v[tt] = tt < nt ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(pair_mask, x + token_index[t0 + tt] * ldx + 2 * p0))
                                : _mm512_setzero_ps();
            transpose16(v);
            uint16_t* dst = static_cast<uint16_t*>(packed) + p0 * 2 * m_pad + 2 * t0;
            for (int pp = 0; pp < np; ++pp)
                _mm512_mask_storeu_epi32(dst + pp * 2 * m_pad, token_mask, _mm512_castps_si512(v[pp]));
        }
    }
    if (k % 2) {
        uint16_t* last = static_cast<uint16_t*>(packed) + whole_pairs * 2 * m_pad;
        for (int64_t t = 0; t < m_pad; ++t) {
            last[2 * t] = t < m ? x[token_index[t] * ldx + k - 1] : 0;
            last[2 * t + 1] = 0;
        }
    }
}

// Sum of parts[p][row * ld + t0 .. t0 + nt) over p, in part order (deterministic).
inline __m512 sum_parts(const float* const* parts, int n_parts, int64_t offset, __mmask16 mask) {
    __m512 sum = _mm512_maskz_loadu_ps(mask, parts[0] + offset);
    for (int p = 1; p < n_parts; ++p) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, parts[p] + offset));
    return sum;
}

// sum_parts plus bias[row] (none: no addition, so that the sum keeps its bits).
inline __m512 biased_sum(const float* const* parts, int n_parts, int64_t row, int64_t ld, int64_t t0, __mmask16 mask,
                         const float* bias) {
    const __m512 sum = sum_parts(parts, n_parts, row * ld + t0, mask);
    return bias ? _mm512_add_ps(sum, _mm512_set1_ps(bias[row])) : sum;
}

// The activation of row i for tokens t0 .. t0 + 15; lanes off `mask` are 0 (the padding
// tokens of the operand, which the biases would otherwise make non-zero).
inline __m512 activation_rows(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                              int64_t i, int64_t t0, __mmask16 mask, const ExpertEpilogue& e,
                              const Activation512& activate) {
    return _mm512_maskz_mov_ps(mask, activate(biased_sum(gate_parts, n_parts, i, ld, t0, mask, e.gate_bias),
                                              biased_sum(up_parts, n_parts, i, ld, t0, mask, e.up_bias)));
}

inline __m256i to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The activation (with the biases) over 16 rows x 16 tokens blocks, written in the token
// layout `layout` (kernel_api.hpp): plain, pairs (AMX), or the token-lane column blocks;
// padding tokens (m <= t < m_pad) are written as zeros.
inline void silu_mul_pack_avx512(TokenLayout layout, const float* const* gate_parts, const float* const* up_parts,
                                 int n_parts, int64_t ld, int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total,
                                 const ExpertEpilogue& epilogue, void* packed) {
    bf16* act = static_cast<bf16*>(packed);
    const Activation512 activate(epilogue.activation);
    const int64_t m_pad = padded_tokens(layout, m);
    const int64_t block = layout.block_columns;
    for (int64_t i0 = i_begin; i0 < i_end; i0 += 16) {
        const int64_t ni = i_end - i0 < 16 ? i_end - i0 : 16;
        for (int64_t t0 = 0; t0 < m_pad; t0 += 16) {
            const int64_t nt = m - t0 < 16 ? (m > t0 ? m - t0 : 0) : 16;     // real tokens
            const int64_t nt_pad = m_pad - t0 < 16 ? m_pad - t0 : 16;        // ... and padding
            const __mmask16 tmask = tail_mask16(nt);
            __m512 v[16];
            for (int ii = 0; ii < 16; ++ii) {
                if (ii >= ni) {
                    v[ii] = _mm512_setzero_ps();
                    continue;
                }
                v[ii] = activation_rows(gate_parts, up_parts, n_parts, ld, i0 + ii, t0, tmask, epilogue, activate);
            }
            if (block == 2) {
                // Pair row i/2 holds (act[t][i], act[t][i+1]) interleaved over t.
                const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                const __mmask32 store_mask = nt_pad >= 16 ? __mmask32(0xffffffffu) : __mmask32((1u << (2 * nt_pad)) - 1u);
                for (int ii = 0; ii < ni; ii += 2) {
                    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16x16(v[ii])),
                                                            to_bf16x16(v[ii + 1]), 1);
                    const __m512i pairs = _mm512_permutexvar_epi16(interleave, both);
                    _mm512_mask_storeu_epi16(act + ((i0 + ii) / 2) * 2 * m_pad + 2 * t0, store_mask, pairs);
                }
                continue;
            }
            transpose16(v);
            for (int tt = 0; tt < nt_pad; ++tt) {
                const __m256i row = to_bf16x16(v[tt]);  // token t0 + tt, columns i0 .. i0 + 15
                if (block == 0) {
                    _mm256_mask_storeu_epi16(act + (t0 + tt) * i_total + i0, tail_mask16(ni), row);
                    continue;
                }
                // Column blocks of `block` (4, 8 or 16) columns: pieces of one token's row. A
                // piece past i_end only exists at i_total, where it is the zero padding of
                // the last block.
                alignas(32) bf16 values[16];
                _mm256_store_si256(reinterpret_cast<__m256i*>(values), row);
                for (int64_t c = 0; c < ni; c += block)
                    std::memcpy(act + ((i0 + c) / block) * block * m_pad + (t0 + tt) * block, values + c,
                                block * sizeof(bf16));
            }
        }
    }
}

// y[token_index[t]][h] += token_weight[t] * (sum_p parts[p][h * ld + t] + bias[h]), the
// transpose done in registers 16 x 16 at a time.
inline void combine_down_avx512(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin, int64_t h_end,
                                int64_t m, const int64_t* token_index, const float* token_weight, const float* bias,
                                float* y, int64_t ldy) {
    for (int64_t t0 = 0; t0 < m; t0 += 16) {
        const int64_t nt = m - t0 < 16 ? m - t0 : 16;
        const __mmask16 tmask = tail_mask16(nt);
        const __m512 weight = _mm512_maskz_loadu_ps(tmask, token_weight + t0);
        for (int64_t h0 = h_begin; h0 < h_end; h0 += 16) {
            const int64_t nh = h_end - h0 < 16 ? h_end - h0 : 16;
            __m512 v[16];
            for (int hh = 0; hh < 16; ++hh)
                v[hh] = hh < nh ? _mm512_mul_ps(weight, biased_sum(parts, n_parts, h0 + hh, ld, t0, tmask, bias))
                                : _mm512_setzero_ps();
            transpose16(v);
            const __mmask16 hmask = tail_mask16(nh);
            for (int tt = 0; tt < nt; ++tt) {
                float* dst = y + token_index[t0 + tt] * ldy + h0;
                _mm512_mask_storeu_ps(dst, hmask, _mm512_add_ps(_mm512_maskz_loadu_ps(hmask, dst), v[tt]));
            }
        }
    }
}

// out[t][h] = sum_p parts[p][h * ld + t] + bias[h] (bf16 or fp32), transposed 16 x 16 in registers
// like combine_down_avx512 and stored once: no fp32 rows to clear, add into and convert.
// The 16 token rows of a tile share an L1 set when the rows are 4 KB apart (2048 bf16),
// and still this beats clearing, combining into and converting fp32 rows (docs/kernels.md).
// The bf16 rounding is vcvtneps2bf16's (nearest even, as float_to_bf16; it flushes
// denormal inputs, which an FFN output does not reach in practice).
inline void store_down_avx512(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin, int64_t h_end,
                              int64_t m, const float* bias, void* out, int64_t ldo, bool out_bf16) {
    for (int64_t t0 = 0; t0 < m; t0 += 16) {
        const int64_t nt = m - t0 < 16 ? m - t0 : 16;
        const __mmask16 tmask = tail_mask16(nt);
        for (int64_t h0 = h_begin; h0 < h_end; h0 += 16) {
            const int64_t nh = h_end - h0 < 16 ? h_end - h0 : 16;
            __m512 v[16];
            for (int hh = 0; hh < 16; ++hh)
                v[hh] = hh < nh ? biased_sum(parts, n_parts, h0 + hh, ld, t0, tmask, bias) : _mm512_setzero_ps();
            transpose16(v);
            const __mmask16 hmask = tail_mask16(nh);
            for (int tt = 0; tt < nt; ++tt) {
                const int64_t offset = (t0 + tt) * ldo + h0;
                if (out_bf16)
                    _mm256_mask_storeu_epi16(static_cast<bf16*>(out) + offset, hmask, to_bf16x16(v[tt]));
                else
                    _mm512_mask_storeu_ps(static_cast<float*>(out) + offset, hmask, v[tt]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The integer kernels' token rule (docs/quantization.md), shared so that every AVX-512 and
// AMX integer table quantizes the same way; each kernel writes the bytes in its own layout
// through `put(t, b, q, scale)`: token t, group b, G int8 values in column order.

inline __m512 bf16x16_to_ps(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// G values (G / 16 vectors, columns in the lanes) -> symmetric int8 with scale amax / 127,
// as quantize_block of ref_quant.cpp: the same division (not a reciprocal) and rounding
// (nearbyint there, the conversion here: both by the current rounding mode, half-even
// unless a caller changes it), so the same bytes, and the same NaN scale (values 0) for a
// block holding a NaN or an infinity. The magnitudes are compared as integers: with the
// sign cleared, the bit patterns order as the floats do and every infinity or NaN lies
// above the finite ones (0x7f800000 and up), where a float max would drop a NaN lane. So
// the maximum tells finite blocks from the others at the cost of one compare. The rounded
// quotients lie in [-127, 127] but for subnormal scales, which the clamp keeps there.
// Four vectors are narrowed at a time (two packs, one dword permute): half the cost of
// narrowing each alone. One token at a time: G / 16 divisions a group.
template <int64_t G>
inline void quantize_block(const __m512* v, int8_t* q, float* scale) {
    __m512i amax = _mm512_castps_si512(_mm512_abs_ps(v[0]));
    for (int64_t i = 1; i < G / 16; ++i) amax = _mm512_max_epi32(amax, _mm512_castps_si512(_mm512_abs_ps(v[i])));
    const int32_t amax_bits = _mm512_reduce_max_epi32(amax);
    float amax_value;
    std::memcpy(&amax_value, &amax_bits, sizeof(amax_value));
    const float s = amax_bits < 0x7f800000 ? amax_value / 127.0f : std::numeric_limits<float>::quiet_NaN();
    *scale = s;
    if (!(s > 0.0f)) {
        std::memset(q, 0, G);
        return;
    }
    const __m512 sv = _mm512_set1_ps(s);
    auto rounded = [&](int64_t i) {
        return _mm512_cvtps_epi32(_mm512_div_ps(v[i], sv));
    };
    constexpr int64_t n_vectors = G / 16;
    constexpr int64_t n_quads = n_vectors / 4;
    // The packs leave dword 4l + j of the result holding vector j's lanes 4l..4l+3.
    const __m512i vector_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int64_t i = 0; i < 4 * n_quads; i += 4) {
        const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(rounded(i), rounded(i + 1)),
                                                 _mm512_packs_epi32(rounded(i + 2), rounded(i + 3)));
        _mm512_storeu_si512(q + 16 * i,
                            _mm512_max_epi8(_mm512_permutexvar_epi32(vector_order, bytes), _mm512_set1_epi8(-127)));
    }
    // The vectors left over: groups of 32 only. Compiled only there: left in for 64 and 128
    // the dead loop is what GCC's link-time optimizer reports as undefined behaviour.
    if constexpr (n_vectors % 4 != 0) {
        for (int64_t i = 4 * n_quads; i < n_vectors; ++i)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i),
                             _mm512_cvtsepi32_epi8(_mm512_max_epi32(rounded(i), _mm512_set1_epi32(-127))));
    }
}

// The gather: token t is row token_index[t] of x, quantized group by group. Tokens are
// taken in blocks of 16, each group of a block token after token (the order
// quantize_silu_mul_avx512 has too), so that a writer may collect a block's group and
// store it at once.
template <int64_t G, class Put>
void quantize_tokens_avx512(const uint16_t* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k,
                            Put&& put) {
    alignas(64) int8_t q[G];
    for (int64_t t0 = 0; t0 < m; t0 += 16) {
        const int64_t nt = m - t0 < 16 ? m - t0 : 16;
        for (int64_t b = 0; b < k / G; ++b) {
            for (int64_t t = t0; t < t0 + nt; ++t) {
                const uint16_t* group = x + token_index[t] * ldx + b * G;
                __m512 v[G / 16];
                for (int64_t i = 0; i < G / 16; ++i) v[i] = bf16x16_to_ps(group + 16 * i);
                float scale;
                quantize_block<G>(v, q, &scale);
                put(t, b, q, scale);
            }
        }
    }
}

// The gate/up epilogue, the activation (with the biases) quantized per token and group of the intermediate
// columns [i_begin, i_end): the partials are [row][token], the operand [token][column], so
// 16 rows x 16 tokens tiles are transposed in registers, G / 16 per group.
template <int64_t G, class Put>
void quantize_silu_mul_avx512(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                              int64_t i_begin, int64_t i_end, int64_t m, const ExpertEpilogue& epilogue, Put&& put) {
    const Activation512 activate(epilogue.activation);
    alignas(64) int8_t q[G];
    for (int64_t i0 = i_begin; i0 < i_end; i0 += G) {
        for (int64_t t0 = 0; t0 < m; t0 += 16) {
            const int64_t nt = m - t0 < 16 ? m - t0 : 16;
            const __mmask16 tmask = tail_mask16(nt);
            __m512 act[16][G / 16];  // [token][16 columns]
            for (int64_t sub = 0; sub < G / 16; ++sub) {
                __m512 v[16];
                for (int ii = 0; ii < 16; ++ii)
                    v[ii] = activation_rows(gate_parts, up_parts, n_parts, ld, i0 + sub * 16 + ii, t0, tmask, epilogue,
                                            activate);
                transpose16(v);
                for (int tt = 0; tt < 16; ++tt) act[tt][sub] = v[tt];
            }
            for (int64_t tt = 0; tt < nt; ++tt) {
                float scale;
                quantize_block<G>(act[tt], q, &scale);
                put(t0 + tt, i0 / G, q, scale);
            }
        }
    }
}

}  // namespace
}  // namespace numa_moe::kernels
