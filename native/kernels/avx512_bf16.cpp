// AVX-512-BF16 kernels over row-major weights, for CPUs without AMX (Zen 4, Cooper Lake,
// Ice Lake and later). Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma;
// dispatch only hands this table out when cpuid + XCR0 allow it.
//
// Operand layouts (kernel_api.hpp):
//   weights  w[r * ldw + c] bf16 row-major, never repacked
//   tokens   m <= 2: plain packed[t * k + c] (gather is a row copy)
//            m >= 3: token lanes {2P, T}: column blocks of 2P columns, each holding every
//            token's 2P columns in turn, tokens padded with zeros to a multiple of T = 16 / P
//   partials out[r * ldo + t] fp32, accumulated (+=)
// Above kLaneTokenBlock tokens the token-lane kernels take the token vectors in blocks
// (whole passes over the weights each); the layer's pipeline hands large experts over in
// such blocks already (engine/pipeline.hpp, token_split_block).
//
// Two formulations of out += W x^T, both vdpbf16ps (32 bf16 products into 16 fp32 lanes):
//   dot product (1-2 tokens): a zmm holds 32 columns of one weight row or one token; a block
//     of R = 8 rows x T tokens accumulates along k, one horizontal sum per output at the end.
//   token lanes (3+ tokens): a zmm holds P column pairs of T tokens (T * P = 16); the weight
//     row's matching 2P columns are broadcast to the T token slots, so each instruction does
//     useful work in all 16 lanes however few the tokens, and each weight element loaded
//     serves T tokens (see lane_micro).
// Both stream the weights once, R rows at a time, and prefetch the blocks two on and one
// on into L2 while a block computes (see Block, prefetch_target).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"
#include "kernels/isa_tables.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// avx512_bf16_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx512_emulated;
#else
constexpr Isa kIsa = Isa::avx512;
#endif

// The token-lane kernels replace the dot-product ones from this many tokens on (at 1-2
// tokens a lane vector would be mostly padding: T = 4 at M = 2 wastes half the lanes).
constexpr int64_t kLaneMinTokens = 3;
// Above this many tokens the token-lane kernels cut k into blocks whose token slice
// (m_pad x block, bf16) stays in L2 while the R weight rows of a block pass over the
// token vectors from L1; blocks of at most kKBlockMax columns.
constexpr int64_t kLaneUnblockedTokens = 32;
constexpr int64_t kTokenBlockBytes = 512 * 1024;
constexpr int64_t kKBlockMax = 2048;
// Above this many tokens the token-lane kernels take the tokens in blocks of about this
// many, each a whole pass over the weights: the k block of all m tokens would otherwise
// shrink until each row block's partials are read and written back per few hundred
// columns, from beyond L2 (docs/kernels.md, "Token blocking").
constexpr int64_t kLaneTokenBlock = 256;

// k block length: the whole span up to kLaneUnblockedTokens tokens; otherwise equal blocks
// of at most kKBlockMax columns (multiples of 32), fewer still when the m x k token slice
// would not stay in L2.
int64_t k_block(int64_t span, int64_t m) {
    if (m <= kLaneUnblockedTokens) return span;
    int64_t limit = std::min<int64_t>(kKBlockMax, std::max<int64_t>(256, kTokenBlockBytes / (2 * m)));
    limit = limit / 32 * 32;
    const int64_t blocks = (span + limit - 1) / limit;
    return ((span + blocks - 1) / blocks + 31) / 32 * 32;
}

// The blocks to prefetch while register block j (rows [j, j + rows), columns [kb, ke))
// computes: the one `ahead` blocks on. Every line is prefetched twice, two blocks and one
// block before its use: two blocks so that the request comes a whole block's compute time
// early under memory contention, and again one block on, as if some of the first requests
// were lost (both measured: docs/kernels.md). Past the last rows the first rows
// of the next k block (k_next0 < k_end), at the very end this block again (cache hits).
// Prefetches past the segment's last row are harmless (prefetch never faults).
struct PrefetchTarget {
    int64_t j, k0, k1;
};
PrefetchTarget prefetch_target(int64_t j, int64_t rows, int ahead, int64_t j_lo, int64_t j_hi, int64_t kb, int64_t ke,
                               int64_t kc, int64_t k_end) {
    PrefetchTarget target{j + ahead * rows, kb, ke};
    if (target.j < j_hi) return target;
    if (ke < k_end) return PrefetchTarget{j_lo + (target.j - j_hi), ke, std::min(ke + kc, k_end)};
    return PrefetchTarget{j, kb, ke};
}

// The block after the first of a row range, prefetched up front (prefetch_target covers
// the ones from the third on).
void prefetch_second_block(const bf16* w, int64_t w_step, int64_t rows, int64_t k0, int64_t k1) {
    const char* first = reinterpret_cast<const char*>(w + k0);
    for (int64_t c = 0; c < (k1 - k0) * 2; c += 64)
        for (int64_t r = 0; r < rows; ++r) _mm_prefetch(first + r * w_step * 2 + c, _MM_HINT_T2);
}

// L2 prefetch of later register blocks while this one computes: the hardware prefetcher
// alone stops at every 4 KB page of each of the R row streams and leaves the loads waiting
// on DRAM, serialising memory and compute. Row r's columns [begin, begin + len) are
// prefetched spread evenly over the 64-byte lines of the block (line s: column
// begin + (s * step_fixed >> 16)), so that when a block is passed over several times
// (token vector groups) the memory stream stays busy through all of them. prefetcht2
// (L2), not t0: L1-filling prefetches took the L1 miss buffers the demand loads need and
// were slower than none.
// The rows of a register block lie at a constant stride (segment row stride x ldw), so a
// block is a base pointer and a step: few general registers.
struct Block {
    const bf16* w;          // row 0 of the block, column 0
    int64_t w_step;         // elements between its rows
    const bf16* pf;         // row 0 of the block two on, first column to prefetch
    const bf16* pf_again;   // row 0 of the block one on, the same column
    int64_t pf_step_fixed;  // 16.16 fixed-point prefetch columns per 64-byte line
    float* out;             // out row of block row 0, first token of the block
    int64_t out_step;       // floats between the out rows
};

// ---------------------------------------------------------------------------------------
// Dot-product formulation (1-2 tokens).

constexpr int kDotRows = 8;  // R: 8 x 2 accumulators + 8 weight + 1 token registers

// Four accumulators -> their four horizontal sums in one xmm (lane j = sum of a[j]).
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    // 64-bit unpacks move float pairs; the add must be a float add.
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[r][t] += sum_{c in [k0, k1)} w[r][c] * tok[t][c] for R rows, T tokens.
template <int R, int T>  // T = 1 or 2
void dot_micro(const Block& b, const bf16* tok, int64_t ldt, int64_t k0, int64_t k1) {
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    const int64_t w_step = b.w_step, pf_step = b.pf_step_fixed;
    const bf16* w = b.w + k0;
    const bf16* x = tok + k0;
    const char* pf = reinterpret_cast<const char*>(b.pf);
    const char* pf_again = reinterpret_cast<const char*>(b.pf_again);
    int64_t pf_fixed = 0;
    int64_t steps = (k1 - k0) / 32;
    for (; steps > 0; --steps, w += 32, x += 32) {
        __m512bh wv[R];
        const char* pf_at = pf + (pf_fixed >> 16) * 2;
        const char* again_at = pf_again + (pf_fixed >> 16) * 2;
        pf_fixed += pf_step;
        for (int r = 0; r < R; ++r) {
            _mm_prefetch(pf_at + r * w_step * 2, _MM_HINT_T2);
            _mm_prefetch(again_at + r * w_step * 2, _MM_HINT_T2);
            wv[r] = (__m512bh)_mm512_loadu_si512(w + r * w_step);
        }
        for (int t = 0; t < T; ++t) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * ldt);
            for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
        }
    }
    const int64_t tail = (k1 - k0) % 32;
    if (tail) {  // k tail: masked loads fill the missing bf16 with zeros, exact
        const __mmask32 mask = static_cast<__mmask32>((1ull << tail) - 1ull);
        __m512bh wv[R];
        for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * w_step);
        for (int t = 0; t < T; ++t) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + t * ldt);
            for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
        }
    }
    const __m512 zero = _mm512_setzero_ps();
    const __mmask8 mask = static_cast<__mmask8>((1u << T) - 1u);
    for (int r = 0; r < R; ++r) {
        const __m128 sums = hsum4(acc[r][0], T == 2 ? acc[r][T - 1] : zero, zero, zero);
        float* dst = b.out + r * b.out_step;
        _mm_mask_storeu_ps(dst, mask, _mm_add_ps(_mm_maskz_loadu_ps(mask, dst), sums));
    }
}

using DotMicroFn = void (*)(const Block&, const bf16*, int64_t, int64_t, int64_t);

template <int T>
DotMicroFn dot_micro_for_rows(int64_t rows) {
    switch (rows) {
        case 8: return dot_micro<8, T>;
        case 7: return dot_micro<7, T>;
        case 6: return dot_micro<6, T>;
        case 5: return dot_micro<5, T>;
        case 4: return dot_micro<4, T>;
        case 3: return dot_micro<3, T>;
        case 2: return dot_micro<2, T>;
        default: return dot_micro<1, T>;
    }
}

void dot_matmul_segments(const bf16* w, int64_t ldw, const Segment* segments, int64_t n_segments, int64_t row_begin,
                         int64_t row_end, const bf16* tokens, int64_t m, int64_t k, float* out, int64_t ldo) {
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        const int64_t w_step = stride * ldw;
        const int64_t kb = seg.k0, ke = seg.k1, span = ke - kb;
        // Full blocks of kDotRows rows, then one block of the rows left: a row range that is
        // not a multiple of 8 (a thread's share) then costs one narrower block, not
        // row-at-a-time passes (1 weight load per T vdpbf16ps, ~2.5x the time per row).
        for (int64_t j = j_lo; j < j_hi;) {
            const int64_t rows = std::min<int64_t>(kDotRows, j_hi - j);
            if (j == j_lo && j + rows < j_hi)
                prefetch_second_block(w + (seg.row0 + (j + rows) * stride) * ldw, w_step,
                                      std::min<int64_t>(kDotRows, j_hi - j - rows), kb, ke);
            const PrefetchTarget next = prefetch_target(j, rows, 2, j_lo, j_hi, kb, ke, span, ke);
            const PrefetchTarget near = prefetch_target(j, rows, 1, j_lo, j_hi, kb, ke, span, ke);
            const int64_t steps = std::max<int64_t>(1, span / 32);
            const Block block{w + (seg.row0 + j * stride) * ldw, w_step,
                              w + (seg.row0 + next.j * stride) * ldw + next.k0,
                              w + (seg.row0 + near.j * stride) * ldw + near.k0, ((next.k1 - next.k0) << 16) / steps,
                              out + (seg.row0 + j * stride) * ldo, stride * ldo};
            (m == 1 ? dot_micro_for_rows<1>(rows) : dot_micro_for_rows<2>(rows))(block, tokens, k, kb, ke);
            j += rows;
        }
    });
}

// ---------------------------------------------------------------------------------------
// Token-lane formulation (3+ tokens). One zmm holds T tokens x P column pairs (T * P = 16
// lanes of 32 bits): the token operand is in the layout {2P, T} (kernel_api.hpp), so token
// vector g of column block q is
//     tokens[q * 2P * m_pad + g * 32 ..+ 32] = x[gT + i][2Pq .. 2Pq + 2P) for i < T.
// The weight row's matching 2P columns (4P bytes) are broadcast to all T token slots
// (vpbroadcastd / q, vbroadcasti32x4), so one vdpbf16ps adds P pairs of products for each
// of T tokens; at the end of the k range the P lanes of a token are summed (log2 P shuffle
// steps, once per output). Against the dot-product kernel: every lane is useful at any
// token count, each weight element loaded serves T tokens, and no token chunk re-reads the
// weights; on Zen 4 (weights hot in L2, 1 thread) 0.85-0.88 of the vdpbf16ps peak from 16
// tokens on, against 0.64 for the dot-product kernel.

template <int P>
inline __m512bh broadcast_columns(const bf16* p) {
    if constexpr (P == 1) {
        int32_t v;
        std::memcpy(&v, p, sizeof(v));
        return (__m512bh)_mm512_set1_epi32(v);
    } else if constexpr (P == 2) {
        int64_t v;
        std::memcpy(&v, p, sizeof(v));
        return (__m512bh)_mm512_set1_epi64(v);
    } else {
        static_assert(P == 4, "P is 1, 2 or 4");
        return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
}

// Sums each token's P lanes; lane t (t < 16 / P) of the result is token t's sum.
template <int P>
inline __m512 sum_token_lanes(__m512 acc) {
    if constexpr (P >= 2) acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xb1));  // swap lanes 2i, 2i+1
    if constexpr (P >= 4) acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4e));  // swap lane pairs
    if constexpr (P >= 2) {
        // Lane t * P holds token t's sum: move it to lane t.
        const __m512i first = _mm512_set_epi32(15 * P % 16, 14 * P % 16, 13 * P % 16, 12 * P % 16, 11 * P % 16,
                                                10 * P % 16, 9 * P % 16, 8 * P % 16, 7 * P % 16, 6 * P % 16,
                                                5 * P % 16, 4 * P % 16, 3 * P % 16, 2 * P % 16, P, 0);
        acc = _mm512_permutexvar_ps(first, acc);
    }
    return acc;
}

// The token vectors of a register block: G vectors from the block's first token, over the
// column blocks [q0, q1) (2P columns each) of a k block.
struct LaneTokens {
    const bf16* tokens;    // column block 0, the first token vector
    int64_t block_stride;  // elements between column blocks (2P * m_pad)
    int64_t tokens_left;   // tokens from the first one to m (masks the output)
};

// The R weight rows of a block usually lie a multiple of 4 KB apart (rows of 2048, 4096,
// 14336 columns), so their lines share one L1 set: R <= 8 keeps them within its 8 ways for
// the 16 / P steps each line is used (lane_rows: fewer when the token lines pass too).
template <int P, int R, int G>
void lane_micro(const Block& b, const LaneTokens& x_block, int64_t q0, int64_t q1) {
    constexpr int T = 16 / P;
    constexpr int64_t kBlocksPerLine = 16 / P;  // one 64-byte line of a weight row
    __m512 acc[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) prefetch_out_floats(b.out + r * b.out_step + g * T, T);
    const int64_t w_step = b.w_step;
    const char* pf = reinterpret_cast<const char*>(b.pf);
    const char* pf_again = reinterpret_cast<const char*>(b.pf_again);
    int64_t pf_fixed = 0;
    for (int64_t line = q0; line < q1; line += kBlocksPerLine) {
        // R prefetches of a later block per line of this one (see Block).
        const char* pf_at = pf + (pf_fixed >> 16) * 2;
        const char* again_at = pf_again + (pf_fixed >> 16) * 2;
        pf_fixed += b.pf_step_fixed;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) _mm_prefetch(pf_at + r * w_step * 2, _MM_HINT_T2);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) _mm_prefetch(again_at + r * w_step * 2, _MM_HINT_T2);
        const int64_t line_end = line + kBlocksPerLine < q1 ? line + kBlocksPerLine : q1;
        for (int64_t q = line; q < line_end; ++q) {
            __m512bh x[G];
#pragma GCC unroll 4
            for (int g = 0; g < G; ++g) x[g] = (__m512bh)_mm512_load_si512(x_block.tokens + q * x_block.block_stride + g * 32);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512bh wv = broadcast_columns<P>(b.w + r * w_step + 2 * P * q);
#pragma GCC unroll 4
                for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv, x[g]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
        const int64_t n = x_block.tokens_left - g * T;
        const __mmask16 mask = static_cast<__mmask16>(n >= T ? (1u << T) - 1u : (1u << n) - 1u);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            float* dst = b.out + r * b.out_step + g * T;
            _mm512_mask_storeu_ps(dst, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), sum_token_lanes<P>(acc[r][g])));
        }
    }
}

using LaneMicroFn = void (*)(const Block&, const LaneTokens&, int64_t, int64_t);

// Rows per register block with G token vectors: 8 with one token vector, 6 with two or
// more. 8 rows fill the 8 ways of the L1 set their lines share (above); with G >= 2 each
// step also loads G token lines, and 6 rows leave them room; with G = 1 six accumulators
// would not hide the vdpbf16ps latency (docs/kernels.md has the measurements). R * G
// accumulators + G token vectors + one broadcast weight fit the 32 vector registers up
// to G = 4.
constexpr int lane_rows(int groups) { return groups == 1 ? 8 : 6; }
constexpr int kLaneMaxGroups = 4;

template <int P, int R>
LaneMicroFn lane_micro_for_groups(int64_t groups) {
    if constexpr (R > lane_rows(2)) {
        return groups == 1 ? lane_micro<P, R, 1> : nullptr;
    } else {
        switch (groups) {
            case 1: return lane_micro<P, R, 1>;
            case 2: return lane_micro<P, R, 2>;
            case 3: return lane_micro<P, R, 3>;
            case 4: return lane_micro<P, R, 4>;
            default: return nullptr;
        }
    }
}

// The micro kernel for a block of `rows` rows (a value lane_block_rows returns) and
// `groups` token vectors; R never exceeds lane_rows(groups).
template <int P>
LaneMicroFn lane_micro_for(int64_t rows, int64_t groups) {
    switch (rows) {
        case 8: return lane_micro_for_groups<P, 8>(groups);
        case 6: return lane_micro_for_groups<P, 6>(groups);
        case 4: return lane_micro_for_groups<P, 4>(groups);
        case 2: return lane_micro_for_groups<P, 2>(groups);
        default: return lane_micro_for_groups<P, 1>(groups);
    }
}

// Rows of the next register block: the full lane_rows for the token vectors of a group
// block, then the rows left in decreasing powers of two.
int64_t lane_block_rows(int64_t rows_left, int64_t group_block) {
    const int64_t full = lane_rows(static_cast<int>(group_block));
    if (rows_left >= full) return full;
    if (rows_left >= 4) return 4;
    if (rows_left >= 2) return 2;
    return 1;
}

// Columns of [c0, c1) outside whole 2P-column blocks (segment edges off the block grid):
// added in scalar code, so that no column outside the segment is ever read.
// Tokens [t0, t1); out points at token t0's column.
void lane_edge_columns(const bf16* w, int64_t w_step, int64_t rows, const bf16* tokens, TokenLayout layout,
                       int64_t m, int64_t k, int64_t t0, int64_t t1, int64_t c0, int64_t c1, float* out,
                       int64_t out_step) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = c0; c < c1; ++c) {
            const float wv = bf16_to_float(w[r * w_step + c]);
            for (int64_t t = t0; t < t1; ++t)
                out[r * out_step + t - t0] += wv * bf16_to_float(tokens[packed_index(layout, m, k, t, c)]);
        }
}

template <int P>
void lane_matmul_segments(const bf16* w, int64_t ldw, const Segment* segments, int64_t n_segments, int64_t row_begin,
                          int64_t row_end, const bf16* tokens, int64_t m, int64_t k, float* out, int64_t ldo) {
    constexpr int64_t T = 16 / P, B = 2 * P;
    const TokenLayout layout{B, T};
    const int64_t m_pad = padded_tokens(layout, m);
    const int64_t all_groups = m_pad / T;
    // Token blocks: equal numbers of token vectors, at most about kLaneTokenBlock tokens.
    const int64_t n_token_blocks = (m_pad + kLaneTokenBlock - 1) / kLaneTokenBlock;
    const int64_t block_groups = (all_groups + n_token_blocks - 1) / n_token_blocks;
    for (int64_t tg0 = 0; tg0 < all_groups; tg0 += block_groups) {
        const int64_t groups = std::min(block_groups, all_groups - tg0);
        const int64_t block_m = std::min(m - tg0 * T, groups * T);
        const bf16* block_tokens = tokens + tg0 * 32;
        float* block_out = out + tg0 * T;
        // Passes of about equal numbers of token vectors (5 = 3 + 2, not 4 + 1): a pass with
        // one vector runs at about half the rate of one with three or four (docs/kernels.md).
        const int64_t n_group_blocks = (groups + kLaneMaxGroups - 1) / kLaneMaxGroups;
        const int64_t group_block = (groups + n_group_blocks - 1) / n_group_blocks;  // the largest
        for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo,
                                                                          int64_t j_hi, int64_t stride) {
            const int64_t w_step = stride * ldw, out_step = stride * ldo;
            const int64_t kc = k_block(seg.k1 - seg.k0, block_m);
            for (int64_t kb = seg.k0; kb < seg.k1; kb += kc) {
                const int64_t ke = std::min(kb + kc, seg.k1);
                const int64_t q0 = (kb + B - 1) / B, q1 = ke / B;  // whole column blocks
                for (int64_t j = j_lo; j < j_hi;) {
                    const int64_t rows = lane_block_rows(j_hi - j, group_block);
                    if (j == j_lo && kb == seg.k0 && j + rows < j_hi)
                        prefetch_second_block(w + (seg.row0 + (j + rows) * stride) * ldw, w_step,
                                              std::min(rows, j_hi - j - rows), kb, ke);
                    const PrefetchTarget next = prefetch_target(j, rows, 2, j_lo, j_hi, kb, ke, kc, seg.k1);
                    const PrefetchTarget near = prefetch_target(j, rows, 1, j_lo, j_hi, kb, ke, kc, seg.k1);
                    const bf16* w_block = w + (seg.row0 + j * stride) * ldw;
                    const bf16* w_next = w + (seg.row0 + next.j * stride) * ldw;
                    const bf16* w_near = w + (seg.row0 + near.j * stride) * ldw + near.k0 - next.k0;
                    float* out_block = block_out + (seg.row0 + j * stride) * ldo;
                    const int64_t lines = std::max<int64_t>(1, (q1 - q0) * B / 32);
                    const int64_t pf_len = next.k1 - next.k0;
                    for (int64_t gb = 0; q1 > q0 && gb < n_group_blocks; ++gb) {
                        const int64_t g0 = groups * gb / n_group_blocks;
                        const int64_t ng = groups * (gb + 1) / n_group_blocks - g0;
                        // Group block gb prefetches its share of the next block's columns.
                        const int64_t share_begin = next.k0 + pf_len * gb / n_group_blocks;
                        const int64_t share_len = next.k0 + pf_len * (gb + 1) / n_group_blocks - share_begin;
                        const Block block{w_block, w_step, w_next + share_begin, w_near + share_begin,
                                          (share_len << 16) / lines, out_block + g0 * T, out_step};
                        const LaneTokens x_block{block_tokens + g0 * 32, B * m_pad, block_m - g0 * T};
                        lane_micro_for<P>(rows, ng)(block, x_block, q0, q1);
                    }
                    // Columns outside whole blocks (segment edges off the 2P grid).
                    const int64_t head_end = std::min(ke, q0 * B), tail_begin = std::max(kb, q1 * B);
                    if (kb < head_end)
                        lane_edge_columns(w_block, w_step, rows, tokens, layout, m, k, tg0 * T, tg0 * T + block_m, kb,
                                          head_end, out_block, out_step);
                    if (q1 >= q0 && tail_begin < ke)
                        lane_edge_columns(w_block, w_step, rows, tokens, layout, m, k, tg0 * T, tg0 * T + block_m,
                                          tail_begin, ke, out_block, out_step);
                    j += rows;
                }
            }
        });
    }
}

// 8 x 8 transpose of 64-bit elements: r[j] <- element j of every r[i].
inline void transpose8x64(__m512i r[8]) {
    __m512i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]);      // [i0 j0 | i2 j2 | i4 j4 | i6 j6]
        t[2 * i + 1] = _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]);  // [i1 j1 | i3 j3 | ...]
    }
    for (int h = 0; h < 2; ++h) {  // rows 0-3, rows 4-7
        u[4 * h + 0] = _mm512_shuffle_i64x2(t[4 * h], t[4 * h + 2], 0x88);      // elements 0, 4
        u[4 * h + 1] = _mm512_shuffle_i64x2(t[4 * h], t[4 * h + 2], 0xdd);      // elements 2, 6
        u[4 * h + 2] = _mm512_shuffle_i64x2(t[4 * h + 1], t[4 * h + 3], 0x88);  // elements 1, 5
        u[4 * h + 3] = _mm512_shuffle_i64x2(t[4 * h + 1], t[4 * h + 3], 0xdd);  // elements 3, 7
    }
    r[0] = _mm512_shuffle_i64x2(u[0], u[4], 0x88);
    r[4] = _mm512_shuffle_i64x2(u[0], u[4], 0xdd);
    r[2] = _mm512_shuffle_i64x2(u[1], u[5], 0x88);
    r[6] = _mm512_shuffle_i64x2(u[1], u[5], 0xdd);
    r[1] = _mm512_shuffle_i64x2(u[2], u[6], 0x88);
    r[5] = _mm512_shuffle_i64x2(u[2], u[6], 0xdd);
    r[3] = _mm512_shuffle_i64x2(u[3], u[7], 0x88);
    r[7] = _mm512_shuffle_i64x2(u[3], u[7], 0xdd);
}

// Writes the token-lane layout {2P, T} (P = 2 or 4; tokens padded with zeros to a multiple
// of T): token t's columns [qB, qB + B) are one 4P-byte element, so this is a transpose of
// 8-byte (P = 2) or 16-byte (P = 4) elements, [m tokens][k / B] -> [k / B][m_pad tokens],
// T tokens x T elements (one zmm of each token) at a time. Columns past k are zero.
template <int P>
void lane_gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    static_assert(P == 2 || P == 4, "the 16-token layout is gather_pairs_avx512's");
    constexpr int64_t T = 16 / P, B = 2 * P;
    const int64_t m_pad = (m + T - 1) / T * T;
    const int64_t blocks = (k + B - 1) / B;
    bf16* dst = static_cast<bf16*>(packed);
    for (int64_t t0 = 0; t0 < m_pad; t0 += T) {
        for (int64_t c0 = 0; c0 < k; c0 += 32) {  // 32 columns = T blocks
            const __mmask32 columns = k - c0 >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (k - c0)) - 1u);
            __m512i v[T];
            for (int i = 0; i < T; ++i)
                v[i] = t0 + i < m ? _mm512_maskz_loadu_epi16(columns, x + token_index[t0 + i] * ldx + c0)
                                  : _mm512_setzero_si512();
            if constexpr (P == 2)
                transpose8x64(v);
            else
                transpose4x128(v);
            const int64_t q0 = c0 / B;
            for (int j = 0; j < T && q0 + j < blocks; ++j)
                _mm512_store_si512(dst + (q0 + j) * B * m_pad + t0 * B, v[j]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The KernelOps entries. The token operand's layout is chosen by the token count alone, so
// that gather, silu_mul_pack and matmul_segments, which all see m, agree on it.

bool uses_lanes(int64_t m) { return m >= kLaneMinTokens; }

// Tokens per vector of the token-lane kernels: 4 up to 4 tokens, 8 up to 24 (each 64-bit
// weight broadcast then serves two token vectors, and 24 tokens need no padding), 16 from
// there on, even where 8 would pad fewer tokens: 16 reads faster per useful flop at every
// such count (docs/kernels.md).
int64_t lane_tokens(int64_t m) {
    if (m <= 4) return 4;
    if (m <= 24) return 8;
    return 16;
}

TokenLayout token_layout(int64_t m) {
    if (!uses_lanes(m)) return plain_layout(m);
    const int64_t t = lane_tokens(m);
    return TokenLayout{32 / t, t};
}

size_t packed_bytes(int64_t m, int64_t k) {
    return static_cast<size_t>(packed_elements(token_layout(m), m, k)) * sizeof(bf16);
}

void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    if (!uses_lanes(m)) return ref_ops().gather(x, ldx, token_index, m, k, packed);
    switch (lane_tokens(m)) {
        case 16: return gather_pairs_avx512(x, ldx, token_index, m, k, 16, packed);
        case 8: return lane_gather<2>(x, ldx, token_index, m, k, packed);
        default: return lane_gather<4>(x, ldx, token_index, m, k, packed);
    }
}

void matmul_segments(const Weights& weights, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const bf16* w = static_cast<const bf16*>(weights.data);
    const int64_t ldw = weights.ld;
    if (m <= 0) return;
    const bf16* x = static_cast<const bf16*>(packed);
    if (!uses_lanes(m)) return dot_matmul_segments(w, ldw, segments, n_segments, row_begin, row_end, x, m, k, out, ldo);
    switch (lane_tokens(m)) {
        case 16: return lane_matmul_segments<1>(w, ldw, segments, n_segments, row_begin, row_end, x, m, k, out, ldo);
        case 8: return lane_matmul_segments<2>(w, ldw, segments, n_segments, row_begin, row_end, x, m, k, out, ldo);
        default: return lane_matmul_segments<4>(w, ldw, segments, n_segments, row_begin, row_end, x, m, k, out, ldo);
    }
}

void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    silu_mul_pack_avx512(token_layout(m), gate_parts, up_parts, n_parts, ld, i_begin, i_end, m, i_total, epilogue,
                         packed);
}

}  // namespace

#ifdef NUMA_MOE_EMULATED
const KernelOps& avx512_emulated_ops() {
#else
const KernelOps& avx512_ops() {
#endif
    static const KernelOps ops{kIsa,   isa_name(kIsa),  Format::bf16, 0, token_layout,    packed_bytes, gather, matmul_segments,
                               silu_mul_pack, combine_down_avx512, store_down_avx512};
    return ops;
}

}  // namespace numa_moe::kernels
