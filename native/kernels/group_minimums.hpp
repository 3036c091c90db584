// The minimum terms of the formats with minimums (kernel_api.hpp: int4_affine, w = s q + m
// per row and group), the same code in every ISA's kernels so that the terms are the same
// bits everywhere. For token t with quantized values x_q and scale s_x per group,
//     sum_c w[r][c] x[t][c] = sum_g s_g s_x dot(q, x_q)  +  sum_g m_g X[t][g]
// with X[t][g] = s_x[t][g] * sum_{c in g} x_q[t][c], the token's group sum, taken once when
// its operand is written (token_group_sum). Each ISA's matmul adds a row block's scale terms
// of one segment as for every integer format, then add_block_minimums adds, per row of the
// block and token,
//     out[r * ldo + t] += ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
// where a_j sums m[r][g] * X[t][g] over the segment's groups g0 + j, g0 + j + 8, ... in
// ascending order: eight independent chains of additions, one vector (MinimumLanes),
// instead of one chain as long as the row's groups. So out sees, per row and segment, the
// scale terms and then the minimum terms, in every ISA. Per row block, because a row's
// minimums follow the scales the block has just read in the same scale row: a pass over
// all rows after the matmul would fetch them from memory a second time.
//
// Operand layouts:
//   minimums  row r's at scales[r * scales_ld + k / G + g] (after its k / G scales), fp32,
//             fp16 or bf16 like the scales
//   sums      X[t * (k / G) + g], fp32, per token t < m and group g < k / G
//   partials  out[r * ldo + t] fp32, accumulated (+=)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

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

// Eight fp32 lanes: GCC's vector extension, one register on AVX2 / AVX-512, two on the
// baseline, the same bits either way (elementwise mul and add, never fused: every
// translation unit that includes this compiles with -ffp-contract=off or without FMA).
typedef float MinimumLanes __attribute__((vector_size(32)));

// The minimum terms of the segment's rows j0 .. j1 - 1 (row r = seg.row0 + j * stride) over
// its groups, for tokens [0, m): called by every ISA right after the block's scale terms.
// Four rows at a time, so that four chains of additions interleave (one row's eight lanes
// are one chain of vector additions: its latency, not the loads, bounded a row alone).
inline void add_block_minimums(const Weights& w, const Segment& seg, int64_t j0, int64_t j1, int64_t stride,
                               const float* sums, int64_t m, int64_t k, float* out, int64_t ldo) {
    constexpr int kLanes = 8, kRows = 4;
    // Minimums converted at a time (a multiple of kLanes): a row of k = 8192 at groups of 32
    // in one chunk, converted once for all tokens.
    constexpr int64_t kChunkGroups = 256;
    const int64_t groups = k / w.group, g0 = seg.k0 / w.group, g1 = seg.k1 / w.group;
    if (g1 <= g0 || m <= 0) return;
    alignas(64) float minimums[kRows][kChunkGroups];
    for (int64_t ja = j0; ja < j1; ja += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, j1 - ja));
        for (int i = rows; i < kRows; ++i) std::fill_n(minimums[i], kChunkGroups, 0.0f);  // a short last set
        for (int64_t t = 0; t < m; ++t) {
            const float* x_row = sums + t * groups;
            MinimumLanes a[kRows] = {};
            for (int64_t c0 = g0; c0 < g1; c0 += kChunkGroups) {
                const int64_t n = std::min(kChunkGroups, g1 - c0);
                if (t == 0 || g1 - g0 > kChunkGroups)
                    for (int i = 0; i < rows; ++i)
                        row_minimums(w, groups, seg.row0 + (ja + i) * stride, c0, n, minimums[i]);
                const float* x = x_row + c0;
                int64_t s = 0;
                for (; s + kLanes <= n; s += kLanes) {
                    MinimumLanes xv, mv;
                    std::memcpy(&xv, x + s, sizeof(xv));
                    for (int i = 0; i < kRows; ++i) {
                        std::memcpy(&mv, minimums[i] + s, sizeof(mv));
                        a[i] += mv * xv;
                    }
                }
                for (int i = 0; i < kRows; ++i)
                    for (int l = 0; s + l < n; ++l) a[i][l] += minimums[i][s + l] * x[s + l];
            }
            for (int i = 0; i < rows; ++i) {
                const MinimumLanes& v = a[i];
                out[(seg.row0 + (ja + i) * stride) * ldo + t] +=
                    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            }
        }
    }
}

}  // namespace NUMA_MOE_ISA_NS
}  // namespace numa_moe::kernels
