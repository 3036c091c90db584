// The minimum terms of the formats with minimums (kernel_api.hpp: int4_affine, w = s q + m
// per row and group), the same code in every ISA's kernels so that the terms are the same
// bits everywhere. For token t with quantized values x_q and scale s_x per group,
//     sum_c w[r][c] x[t][c] = sum_g s_g s_x dot(q, x_q)  +  sum_g m_g X[t][g]
// with X[t][g] = s_x[t][g] * sum_{c in g} x_q[t][c], the token's group sum, taken once when
// its operand is written (token_group_sum). The matmul kernels add the scale terms as for
// every integer format, then add_group_minimums adds, per segment, row and token,
//     out[r * ldo + t] += ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
// where a_j sums m[r][g] * X[t][g] over the segment's groups g0 + j, g0 + j + 8, ... in
// ascending order: eight independent chains of additions, which the compiler keeps in one
// vector, instead of one chain as long as the row's groups.
//
// Operand layouts:
//   minimums  row r's at scales[r * scales_ld + k / G + g] (after its k / G scales), fp32,
//             fp16 or bf16 like the scales
//   sums      X[t * (k / G) + g], fp32, per token t < m and group g < k / G
//   partials  out[r * ldo + t] fp32, accumulated (+=)
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "common/fp16.hpp"
#include "common/isa_namespace.hpp"
#include "common/segment.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {
inline namespace NUMA_MOE_ISA_NS {

// X of one token and group: its G quantized values' exact int32 sum times its scale.
template <int64_t G>
inline float token_group_sum(const int8_t* q, float scale) {
    int32_t sum = 0;
    for (int64_t c = 0; c < G; ++c) sum += q[c];
    return scale * static_cast<float>(sum);
}

// n minimums of row r from group g0, as fp32 (exact for every float scale dtype).
inline void row_minimums(const Weights& w, int64_t groups, int64_t r, int64_t g0, int64_t n, float* out) {
    const int64_t first = r * w.scales_ld + groups + g0;
    switch (w.scale_dtype) {
        case ScaleDtype::fp32: std::copy_n(static_cast<const float*>(w.scales) + first, n, out); return;
        case ScaleDtype::fp16: {
            const uint16_t* bits = static_cast<const uint16_t*>(w.scales) + first;
            int64_t i = 0;
            // vcvtph2ps is exact, as fp16_to_float is: the same floats, 16 or 8 at a time where
            // the translation unit's ISA has it.
#if defined(__AVX512F__)
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i))));
#elif defined(__F16C__)
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
#endif
            for (; i < n; ++i) out[i] = fp16_to_float(bits[i]);
            return;
        }
        case ScaleDtype::bf16:
            for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(static_cast<const uint16_t*>(w.scales)[first + i]);
            return;
        case ScaleDtype::e8m0: std::fill_n(out, n, 0.0f); return;  // no format with minimums takes e8m0
    }
}

// Requests (into all cache levels) the lines of row r's minimums of groups [g0, g1): the
// matmul before this pass read the rows' scales but not their minimums, and a row's
// minimums then arrive one latency at a time.
inline void prefetch_minimums(const Weights& w, int64_t groups, int64_t r, int64_t g0, int64_t g1) {
    const int64_t bytes = scale_dtype_bytes(w.scale_dtype);
    const char* first = static_cast<const char*>(w.scales) + (r * w.scales_ld + groups + g0) * bytes;
    const char* last = first + (g1 - g0) * bytes;
    for (const char* p = first; p < last; p += 64) __builtin_prefetch(p, 0, 3);
    __builtin_prefetch(last - 1, 0, 3);
}

inline void add_group_minimums(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin,
                               int64_t row_end, const float* sums, int64_t m, int64_t k, float* out, int64_t ldo) {
    constexpr int kLanes = 8;
    constexpr int64_t kChunkGroups = 64;  // minimums converted at a time (a multiple of kLanes)
    constexpr int64_t kTokenBlock = 64;   // tokens whose running sums are kept at a time
    constexpr int64_t kAheadRows = 4;     // rows whose minimums are requested ahead
    const int64_t groups = k / w.group;
    alignas(64) float minimums[kChunkGroups];
    alignas(64) float lanes[kTokenBlock][kLanes];
    for (int64_t s = 0; s < n_segments; ++s) {
        const Segment& seg = segments[s];
        const int64_t g0 = seg.k0 / w.group, g1 = seg.k1 / w.group;
        if (g1 <= g0) continue;
        for (int64_t j = 0; j < seg.nrows; ++j) {
            const int64_t r = seg.row0 + j * seg.row_stride;
            if (r < row_begin || r >= row_end) continue;
            for (int64_t a = j == 0 ? 0 : kAheadRows; a <= kAheadRows; ++a) {  // the first row: its first rows too
                const int64_t ahead = r + a * seg.row_stride;
                if (j + a < seg.nrows && ahead < row_end) prefetch_minimums(w, groups, ahead, g0, g1);
            }
            for (int64_t t0 = 0; t0 < m; t0 += kTokenBlock) {
                const int64_t nt = std::min(kTokenBlock, m - t0);
                for (int64_t t = 0; t < nt; ++t) std::fill_n(lanes[t], kLanes, 0.0f);
                for (int64_t c0 = g0; c0 < g1; c0 += kChunkGroups) {
                    const int64_t n = std::min(kChunkGroups, g1 - c0);
                    row_minimums(w, groups, r, c0, n, minimums);
                    for (int64_t t = 0; t < nt; ++t) {
                        const float* x = sums + (t0 + t) * groups + c0;
                        float* a = lanes[t];
                        int64_t i = 0;
                        for (; i + kLanes <= n; i += kLanes)
                            for (int l = 0; l < kLanes; ++l) a[l] += minimums[i + l] * x[i + l];
                        for (int l = 0; i + l < n; ++l) a[l] += minimums[i + l] * x[i + l];
                    }
                }
                for (int64_t t = 0; t < nt; ++t) {
                    const float* a = lanes[t];
                    out[r * ldo + t0 + t] += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
                }
            }
        }
    }
}

}  // namespace NUMA_MOE_ISA_NS
}  // namespace numa_moe::kernels
