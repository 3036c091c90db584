// AVX-512 helpers shared by the avx512 and amx translation units (both are compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16). Everything here has internal linkage
// (static / anonymous namespace) so that each TU keeps its own copy compiled with its own
// flags: no ODR merge can hand AVX-512 code to a baseline TU.
//
// Layouts handled here:
//   partials  parts[p][r * ld + t] fp32 (weight row r, token t)
//   plain     act[t * i_total + i] bf16 (dot-product kernels' token operand)
//   pairs     act[(i / 2) * 2 * m + 2 * t + i % 2] bf16 (AMX B operand, "VNNI" pairs)
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {
namespace {

inline __mmask16 tail_mask16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

// exp(x) to ~2 ulp over the fp32 range: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial,
// 2^n applied with scalef (which also handles the over/underflow ends).
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.9f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline __m512 silu512(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// In-register 16x16 fp32 transpose: r[i][j] -> r[j][i].
inline void transpose16(__m512 r[16]) {
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

// Sum of parts[p][row * ld + t0 .. t0 + nt) over p, in part order (deterministic).
inline __m512 sum_parts(const float* const* parts, int n_parts, int64_t offset, __mmask16 mask) {
    __m512 sum = _mm512_maskz_loadu_ps(mask, parts[0] + offset);
    for (int p = 1; p < n_parts; ++p) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, parts[p] + offset));
    return sum;
}

inline __m256i to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// silu(g) * u over 16 rows x 16 tokens blocks, written in the plain or the pair layout.
template <bool kPairs>
void silu_mul_pack_avx512(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                          int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, void* packed) {
    bf16* act = static_cast<bf16*>(packed);
    for (int64_t i0 = i_begin; i0 < i_end; i0 += 16) {
        const int64_t ni = i_end - i0 < 16 ? i_end - i0 : 16;
        for (int64_t t0 = 0; t0 < m; t0 += 16) {
            const int64_t nt = m - t0 < 16 ? m - t0 : 16;
            const __mmask16 tmask = tail_mask16(nt);
            __m512 v[16];
            for (int ii = 0; ii < 16; ++ii) {
                if (ii >= ni) {
                    v[ii] = _mm512_setzero_ps();
                    continue;
                }
                const int64_t offset = (i0 + ii) * ld + t0;
                const __m512 g = sum_parts(gate_parts, n_parts, offset, tmask);
                const __m512 u = sum_parts(up_parts, n_parts, offset, tmask);
                v[ii] = _mm512_mul_ps(silu512(g), u);
            }
            if constexpr (kPairs) {
                // Pair row i/2 holds (act[t][i], act[t][i+1]) interleaved over t.
                const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                const __mmask32 store_mask = nt >= 16 ? __mmask32(0xffffffffu) : __mmask32((1u << (2 * nt)) - 1u);
                for (int ii = 0; ii < ni; ii += 2) {
                    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16x16(v[ii])),
                                                            to_bf16x16(v[ii + 1]), 1);
                    const __m512i pairs = _mm512_permutexvar_epi16(interleave, both);
                    _mm512_mask_storeu_epi16(act + ((i0 + ii) / 2) * 2 * m + 2 * t0, store_mask, pairs);
                }
            } else {
                transpose16(v);
                const __mmask16 imask = tail_mask16(ni);
                for (int tt = 0; tt < nt; ++tt)
                    _mm256_mask_storeu_epi16(act + (t0 + tt) * i_total + i0, imask, to_bf16x16(v[tt]));
            }
        }
    }
}

// y[token_index[t]][h] += token_weight[t] * sum_p parts[p][h * ld + t], the transpose done
// in registers 16 x 16 at a time.
inline void combine_down_avx512(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin, int64_t h_end,
                         int64_t m, const int64_t* token_index, const float* token_weight, float* y, int64_t ldy) {
    for (int64_t t0 = 0; t0 < m; t0 += 16) {
        const int64_t nt = m - t0 < 16 ? m - t0 : 16;
        const __mmask16 tmask = tail_mask16(nt);
        const __m512 weight = _mm512_maskz_loadu_ps(tmask, token_weight + t0);
        for (int64_t h0 = h_begin; h0 < h_end; h0 += 16) {
            const int64_t nh = h_end - h0 < 16 ? h_end - h0 : 16;
            __m512 v[16];
            for (int hh = 0; hh < 16; ++hh)
                v[hh] = hh < nh ? _mm512_mul_ps(weight, sum_parts(parts, n_parts, (h0 + hh) * ld + t0, tmask))
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

}  // namespace
}  // namespace numa_moe::kernels
