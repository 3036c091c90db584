// AVX2/FMA kernels: the portable SIMD path for x86-64 CPUs without AVX-512-BF16
// (and the numa-vm guests). Compiled with -mavx2 -mfma only.
//
// Operand layouts (same as ref_bf16.cpp and avx512_bf16.cpp):
//   weights  w[r * ldw + c] bf16 row-major
//   tokens   plain row-major packed[t * k + c] bf16
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// Decode (m < kGemmMinTokens): dot products. bf16 -> fp32 in-lane, 16 columns per step
// split into even and odd columns (a 16-bit left shift of each dword for the even ones, a
// mask for the odd ones) for weights and tokens alike; R rows x T tokens of ymm FMA
// accumulators (8 x 1, 4 x 2, 2 x 3, 2 x 4), horizontal sums at the end. Rows are read 8
// at a time, and while the first token block reads a row block each 64 bytes of a row
// request one line of the row block after next, in address order (LinePrefetcher): 8 rows
// read side by side are a pattern the hardware prefetchers follow badly.
//
// Prefill (m >= kGemmMinTokens): a register-blocked GEMM in which every weight is
// converted once per call and every product is one FMA. Per call the tokens become fp32
// (x32[t * k + c], per-thread scratch); per block of 16 rows of a segment the weights
// become fp32 columns of 16 rows (wt[c * 16 + r], transposed 8 x 8 at a time); then per 6
// tokens, 2 x 6 ymm accumulators take per column two weight vectors and six broadcast
// token values: 12 FMAs against 8 loads, no horizontal sums. The 16 x 6 sums are added
// to out at the end of the segment's columns.
#include <immintrin.h>

#include "common/util.hpp"
#include "kernels/bf16.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/line_prefetcher.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// avx2_bf16_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx2_emulated;
#else
constexpr Isa kIsa = Isa::avx2;
#endif


// 16 columns of bf16 from p as fp32: the even columns (low halves, shifted up) and the
// odd ones (high halves, masked). Two in-lane operations per 16 columns, where widening
// in column order takes a lane-crossing one per 8; weights and tokens split alike, so the
// products still pair column with column.
inline void load16_bf16(const bf16* p, __m256* even, __m256* odd) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

constexpr int kBlockRows = 8;  // rows per row block
constexpr int kTokenBlock = 4;  // tokens per register block at most

// Rows per register block for T tokens: R x T accumulators and the operands of a step in
// 16 ymm registers.
constexpr int rows_for_tokens(int t) { return t == 1 ? 8 : t == 2 ? 4 : 2; }

// out_rows[r][t] += w_rows[r][k0, k1) . tok[t][k0, k1) for R rows and T tokens. pf (null
// when the lines were requested already) takes one line of a later row block per 64 bytes
// of a row read.
template <int R, int T>
void micro(const bf16* const* w_rows, const bf16* tok, int64_t ldt, int64_t k0, int64_t k1, float* const* out_rows,
           LinePrefetcher* pf) {
    // The operands held across a step: the rows' vectors (then each token's in turn) where
    // they fit in 16 registers beside the accumulators, else the tokens' (then each row's).
    constexpr bool kRowsFirst = 2 * R + R * T + 2 <= 16;
    __m256 acc[R][T];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
    int64_t c = k0;
    for (; c + 16 <= k1; c += 16) {
        if constexpr (kRowsFirst) {
            __m256 w_even[R], w_odd[R];
            for (int r = 0; r < R; ++r) {
                if (pf && ((c - k0) & 31) == 0) pf->next();
                load16_bf16(w_rows[r] + c, &w_even[r], &w_odd[r]);
            }
            for (int t = 0; t < T; ++t) {
                __m256 x_even, x_odd;
                load16_bf16(tok + t * ldt + c, &x_even, &x_odd);
                for (int r = 0; r < R; ++r) {
                    acc[r][t] = _mm256_fmadd_ps(w_even[r], x_even, acc[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(w_odd[r], x_odd, acc[r][t]);
                }
            }
        } else {
            __m256 x_even[T], x_odd[T];
            for (int t = 0; t < T; ++t) load16_bf16(tok + t * ldt + c, &x_even[t], &x_odd[t]);
            for (int r = 0; r < R; ++r) {
                if (pf && ((c - k0) & 31) == 0) pf->next();
                __m256 w_even, w_odd;
                load16_bf16(w_rows[r] + c, &w_even, &w_odd);
                for (int t = 0; t < T; ++t) {
                    acc[r][t] = _mm256_fmadd_ps(w_even, x_even[t], acc[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(w_odd, x_odd[t], acc[r][t]);
                }
            }
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

// The rows of a row block against tokens t0 .. t0 + T, R rows at a time; rows past the
// block's end repeat its first row (valid memory), their sums written to a scratch row.
template <int T>
void run_block(const bf16* const* w_rows, float* const* out_rows, int n_rows, const bf16* tok, int64_t ldt,
               int64_t k0, int64_t k1, int64_t t0, LinePrefetcher* pf) {
    constexpr int R = rows_for_tokens(T);
    float discard[kTokenBlock];
    for (int r0 = 0; r0 < n_rows; r0 += R) {
        const bf16* w[R];
        float* out[R];
        for (int r = 0; r < R; ++r) {
            w[r] = r0 + r < n_rows ? w_rows[r0 + r] : w_rows[r0];
            out[r] = r0 + r < n_rows ? out_rows[r0 + r] + t0 : discard;
        }
        micro<R, T>(w, tok, ldt, k0, k1, out, pf);
    }
}

// ---------------------------------------------------------------------------------------
// Prefill GEMM.

constexpr int64_t kGemmMinTokens = 16;
constexpr int kGemmRows = 16;    // rows of a weight tile: two ymm of fp32
constexpr int kGemmTokens = 6;   // tokens of a register block: 2 x 6 accumulators
constexpr int kTokensSlot = 0, kWeightTileSlot = 1;  // thread_scratch slots

// 8 x 8 fp32 transpose in registers: v[i] lane j <-> v[j] lane i.
inline void transpose8_ps(__m256 v[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    __m256 u[8];
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

inline __m256 load8_bf16(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// wt[(c - k0) * 16 + r] = w_rows[r][c] as fp32 for c in [k0, k1); rows past n_rows are 0.
void weight_tile(const bf16* const* w_rows, int n_rows, int64_t k0, int64_t k1, float* wt) {
    int64_t c = k0;
    for (; c + 8 <= k1; c += 8) {
        for (int half = 0; half < 2; ++half) {
            __m256 v[8];
            for (int i = 0; i < 8; ++i) {
                const int r = 8 * half + i;
                v[i] = r < n_rows ? load8_bf16(w_rows[r] + c) : _mm256_setzero_ps();
            }
            transpose8_ps(v);
            for (int j = 0; j < 8; ++j) _mm256_store_ps(wt + (c - k0 + j) * kGemmRows + 8 * half, v[j]);
        }
    }
    for (; c < k1; ++c)
        for (int r = 0; r < kGemmRows; ++r)
            wt[(c - k0) * kGemmRows + r] = r < n_rows ? bf16_to_float(w_rows[r][c]) : 0.0f;
}

// out_rows[r][t0 + t] += sum over the tile's n_cols columns of wt[c][r] * x[t][c], for
// the tile's rows and T tokens (x: token t0's fp32 row, from the tile's first column).
template <int T>
void gemm_micro(const float* wt, int64_t n_cols, const float* x, int64_t ldx, float* const* out_rows, int n_rows,
                int64_t t0) {
    __m256 acc[2][T];
    for (int t = 0; t < T; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n_cols; ++c) {
        const __m256 w0 = _mm256_load_ps(wt + c * kGemmRows), w1 = _mm256_load_ps(wt + c * kGemmRows + 8);
        for (int t = 0; t < T; ++t) {
            const __m256 xb = _mm256_broadcast_ss(x + t * ldx + c);
            acc[0][t] = _mm256_fmadd_ps(w0, xb, acc[0][t]);
            acc[1][t] = _mm256_fmadd_ps(w1, xb, acc[1][t]);
        }
    }
    alignas(32) float sums[T][kGemmRows];
    for (int t = 0; t < T; ++t) {
        _mm256_store_ps(sums[t], acc[0][t]);
        _mm256_store_ps(sums[t] + 8, acc[1][t]);
    }
    for (int r = 0; r < n_rows; ++r)
        for (int t = 0; t < T; ++t) out_rows[r][t0 + t] += sums[t][r];
}

void gemm_row_block(const bf16* const* w_rows, float* const* out_rows, int n_rows, const float* x32, int64_t m,
                    int64_t k, int64_t k0, int64_t k1) {
    float* wt = static_cast<float*>(thread_scratch(kWeightTileSlot, static_cast<size_t>(k1 - k0) * kGemmRows * 4));
    weight_tile(w_rows, n_rows, k0, k1, wt);
    for (int64_t t0 = 0; t0 < m; t0 += kGemmTokens) {
        const float* x = x32 + t0 * k + k0;
        switch (m - t0 < kGemmTokens ? m - t0 : kGemmTokens) {
            case 1: gemm_micro<1>(wt, k1 - k0, x, k, out_rows, n_rows, t0); break;
            case 2: gemm_micro<2>(wt, k1 - k0, x, k, out_rows, n_rows, t0); break;
            case 3: gemm_micro<3>(wt, k1 - k0, x, k, out_rows, n_rows, t0); break;
            case 4: gemm_micro<4>(wt, k1 - k0, x, k, out_rows, n_rows, t0); break;
            case 5: gemm_micro<5>(wt, k1 - k0, x, k, out_rows, n_rows, t0); break;
            default: gemm_micro<6>(wt, k1 - k0, x, k, out_rows, n_rows, t0); break;
        }
    }
}

void gemm_segments(const Weights& weights, const Segment* segments, int64_t n_segments, int64_t row_begin,
                   int64_t row_end, const bf16* tokens, int64_t m, int64_t k, float* out, int64_t ldo) {
    float* x32 = static_cast<float*>(thread_scratch(kTokensSlot, static_cast<size_t>(m * k) * 4));
    int64_t i = 0;
    for (; i + 8 <= m * k; i += 8) _mm256_storeu_ps(x32 + i, load8_bf16(tokens + i));
    for (; i < m * k; ++i) x32[i] = bf16_to_float(tokens[i]);
    const bf16* w = static_cast<const bf16*>(weights.data);
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += kGemmRows) {
            const bf16* w_rows[kGemmRows];
            float* out_rows[kGemmRows];
            int n_rows = 0;
            for (int64_t j = j0; j < j_hi && n_rows < kGemmRows; ++j, ++n_rows) {
                const int64_t r = seg.row0 + j * stride;
                w_rows[n_rows] = w + r * weights.ld;
                out_rows[n_rows] = out + r * ldo;
            }
            gemm_row_block(w_rows, out_rows, n_rows, x32, m, k, seg.k0, seg.k1);
        }
    });
}

// ---------------------------------------------------------------------------------------

void matmul_segments(const Weights& weights, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const bf16* w = static_cast<const bf16*>(weights.data);
    const int64_t ldw = weights.ld;
    const bf16* tokens = static_cast<const bf16*>(packed);
    if (m >= kGemmMinTokens) {
        gemm_segments(weights, segments, n_segments, row_begin, row_end, tokens, m, k, out, ldo);
        return;
    }
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += kBlockRows) {
            const bf16* w_rows[kBlockRows];
            float* out_rows[kBlockRows];
            int n_rows = 0;
            for (int64_t j = j0; j < j_hi && n_rows < kBlockRows; ++j) {
                const int64_t r = seg.row0 + j * stride;
                w_rows[n_rows] = w + r * ldw;
                out_rows[n_rows] = out + r * ldo;
                ++n_rows;
            }
            const int64_t row_step = stride * ldw * static_cast<int64_t>(sizeof(bf16));
            LinePrefetcher pf(reinterpret_cast<const uint8_t*>(w_rows[0]) + 2 * kBlockRows * row_step,
                              seg.k0 * static_cast<int64_t>(sizeof(bf16)), seg.k1 * static_cast<int64_t>(sizeof(bf16)),
                              row_step);
            for (int64_t t0 = 0; t0 < m; t0 += kTokenBlock) {
                const int64_t nt = m - t0 < kTokenBlock ? m - t0 : kTokenBlock;
                LinePrefetcher* first = t0 == 0 ? &pf : nullptr;
                const bf16* tok = tokens + t0 * k;
                switch (nt) {
                    case 1: run_block<1>(w_rows, out_rows, n_rows, tok, k, seg.k0, seg.k1, t0, first); break;
                    case 2: run_block<2>(w_rows, out_rows, n_rows, tok, k, seg.k0, seg.k1, t0, first); break;
                    case 3: run_block<3>(w_rows, out_rows, n_rows, tok, k, seg.k0, seg.k1, t0, first); break;
                    default: run_block<4>(w_rows, out_rows, n_rows, tok, k, seg.k0, seg.k1, t0, first); break;
                }
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
