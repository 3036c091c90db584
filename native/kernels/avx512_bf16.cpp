// AVX-512-BF16 kernels: the dot-product formulation over row-major weights (Zen 4,
// Cooper Lake and later without AMX). Compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512bf16 -mfma; dispatch only hands this table out when cpuid + XCR0 allow it.
//
// Operand layouts:
//   weights  w[r * ldw + c] bf16 row-major, never repacked
//   tokens   plain row-major packed[t * k + c] bf16 (gather is a row copy)
//   partials out[r * ldo + t] fp32, accumulated (+=)
//
// matmul: a block of R weight rows x T tokens of zmm accumulators; each step loads 32 bf16
// of every row and of every token and issues R*T vdpbf16ps (pairs of bf16 products into
// 16 fp32 lanes); one horizontal sum per output at the end of the k range (four outputs
// per tree, see hsum4). R*T <= 24 keeps accumulators + operands in the 32 zmm registers.
// For many tokens the k range is cut into blocks whose token slice stays in L2 while the
// R weight rows of a block stay in L1 across the token chunks. The weights of the block
// two on are prefetched into L2 while a block computes (see Block, matmul_segments).
#include <immintrin.h>

#include <algorithm>

#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"
#include "kernels/isa_tables.hpp"

namespace numa_moe::kernels {
namespace {

// Register blocks: T tokens (<= 4) x R rows, R = 8 for T <= 2, 6 for T = 3, 4 (R*T <= 24
// accumulators + R weight registers + one token register <= 32 zmm). Many rows per block
// matter for few tokens: each k step then issues R independent weight loads.
constexpr int64_t kTokenChunk = 4;
// With more than four token chunks the k range is cut into blocks so that the R weight rows
// of a block (R x kKBlockMax x 2 bytes <= 32 KB) stay close (L1/L2) while the token
// chunks pass over them, and the token slice (m x k block) stays in L2. Every block costs
// one more horizontal-sum epilogue per output, so blocks stay long: measured on Zen 4
// (1 thread, weights hot in L2), 2048 beat 1024 by ~10% at M = 16..128.
constexpr int64_t kKBlockMax = 2048;
// Up to four token chunks the k range is not blocked: a block's rows are reused by at most
// three more chunks, from L2, and the extra horizontal sums of k blocks cost more than
// that. Measured (2 threads, cold weights, qwen3-235b 4096 x 1536): M = 16 at 0.74 of the
// vdpbf16ps peak with 2048-column blocks, 0.82 unblocked; M = 12 0.67 -> 0.80; M = 32
// was no better unblocked.
constexpr int64_t kUnblockedTokens = 4 * kTokenChunk;
constexpr int64_t kTokenBlockBytes = 512 * 1024;
constexpr int64_t kTokenPrefetchElements = 128;


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

// L2 prefetch of the next register block while this one computes: the hardware
// prefetcher alone stops at every 4 KB page of each of the R row streams and leaves the
// loads waiting on DRAM, serialising memory and compute. Row r's columns
// [begin, begin + len) are prefetched spread evenly over the k steps of one micro call
// (step s: column begin + (s * step_fixed >> 16)), so that when a block is passed over
// several times (token chunks) the memory stream stays busy through all of them rather
// than only the first. prefetcht2 (L2), not t0: L1-filling prefetches took the L1 miss
// buffers the demand loads need and were slower than none.
// The rows of a register block lie at a constant stride (segment row stride x ldw), so a
// block is a base pointer and a step: few general registers (with R separate row
// pointers gcc spilled them inside the k loop).
struct Block {
    const bf16* w;          // row 0 of the block, column 0
    int64_t w_step;         // elements between its rows
    const bf16* pf;         // row 0 of the next block, first column to prefetch
    int64_t pf_step_fixed;  // 16.16 fixed-point prefetch columns per k step
    float* out;             // out row of block row 0, first token of the chunk
    int64_t out_step;       // floats between the out rows
};

// out[r][t] += sum_{c in [k0, k1)} w[r][c] * tok[t][c] for R rows, T tokens.
// kTokenPrefetch: with many token chunks the token rows come from L2, a 32- or 64-line
// piece per row per call, too short for the hardware prefetcher to get ahead; prefetching
// them 256 bytes ahead into L1 gained ~6% at M = 128 with cold weights (1 thread), lost
// ~2% at M = 16 and ~3% at M = 8, so it is used from 5 chunks (M > 16) on.
template <int R, int T, bool kTokenPrefetch>
void micro(const Block& b, const bf16* tok, int64_t ldt, int64_t k0, int64_t k1) {
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    const int64_t w_step = b.w_step, pf_step = b.pf_step_fixed;
    const bf16* w = b.w + k0;
    const bf16* x = tok + k0;
    const char* pf = reinterpret_cast<const char*>(b.pf);
    int64_t pf_fixed = 0;
    int64_t steps = (k1 - k0) / 32;
    for (; steps > 0; --steps, w += 32, x += 32) {
        __m512bh wv[R];
        const char* pf_at = pf + (pf_fixed >> 16) * 2;
        pf_fixed += pf_step;
        for (int r = 0; r < R; ++r) {
            _mm_prefetch(pf_at + r * w_step * 2, _MM_HINT_T2);
            wv[r] = (__m512bh)_mm512_loadu_si512(w + r * w_step);
        }
        for (int t = 0; t < T; ++t) {
            if constexpr (kTokenPrefetch)
                _mm_prefetch(reinterpret_cast<const char*>(x + t * ldt + kTokenPrefetchElements), _MM_HINT_T0);
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
    for (int r = 0; r < R; ++r) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            const __m128 sums = hsum4(acc[r][t0], t0 + 1 < T ? acc[r][t0 + 1] : zero,
                                      t0 + 2 < T ? acc[r][t0 + 2] : zero, t0 + 3 < T ? acc[r][t0 + 3] : zero);
            const int n = T - t0 < 4 ? T - t0 : 4;
            const __mmask8 mask = static_cast<__mmask8>((1u << n) - 1u);
            float* dst = b.out + r * b.out_step + t0;
            _mm_mask_storeu_ps(dst, mask, _mm_add_ps(_mm_maskz_loadu_ps(mask, dst), sums));
        }
    }
}

using MicroFn = void (*)(const Block&, const bf16*, int64_t, int64_t, int64_t);

template <int R, bool P>
MicroFn micro_for_tokens(int64_t t) {
    switch (t) {
        case 1: return micro<R, 1, P>;
        case 2: return micro<R, 2, P>;
        case 3: return micro<R, 3, P>;
        default: return micro<R, 4, P>;
    }
}

// Rows per register block for a token chunk of t <= 4 tokens.
int64_t rows_per_block(int64_t t) { return t <= 2 ? 8 : 6; }

template <bool P>
MicroFn micro_for_rows(int64_t rows, int64_t tokens) {
    switch (rows) {
        case 8: return micro_for_tokens<8, P>(tokens);
        case 7: return micro_for_tokens<7, P>(tokens);
        case 6: return micro_for_tokens<6, P>(tokens);
        case 5: return micro_for_tokens<5, P>(tokens);
        case 4: return micro_for_tokens<4, P>(tokens);
        case 3: return micro_for_tokens<3, P>(tokens);
        case 2: return micro_for_tokens<2, P>(tokens);
        default: return micro_for_tokens<1, P>(tokens);
    }
}

MicroFn micro_for(int64_t rows, int64_t tokens, bool token_prefetch) {
    return token_prefetch ? micro_for_rows<true>(rows, tokens) : micro_for_rows<false>(rows, tokens);
}

// k block length: the whole span for up to kUnblockedTokens tokens; otherwise equal blocks of at most
// kKBlockMax columns (multiples of 32), fewer still when the m x k token slice would
// not stay in L2.
int64_t k_block(int64_t span, int64_t m) {
    if (m <= kUnblockedTokens) return span;
    int64_t limit = std::min<int64_t>(kKBlockMax, std::max<int64_t>(256, kTokenBlockBytes / (2 * m)));
    limit = limit / 32 * 32;
    const int64_t blocks = (span + limit - 1) / limit;
    return ((span + blocks - 1) / blocks + 31) / 32 * 32;
}

// j range of segment rows r = row0 + j * stride inside [row_begin, row_end).
void segment_row_range(const Segment& seg, int64_t row_begin, int64_t row_end, int64_t* j_lo, int64_t* j_hi) {
    if (seg.nrows <= 0 || row_end <= row_begin) {
        *j_lo = *j_hi = 0;
        return;
    }
    const int64_t stride = seg.row_stride > 0 ? seg.row_stride : 1;
    int64_t lo = 0, hi = seg.nrows;
    if (seg.row0 < row_begin) lo = (row_begin - seg.row0 + stride - 1) / stride;
    if (seg.row0 + (hi - 1) * stride >= row_end) hi = row_end <= seg.row0 ? 0 : (row_end - seg.row0 + stride - 1) / stride;
    *j_lo = lo;
    *j_hi = hi > lo ? hi : lo;
}

void matmul_segments(const bf16* w, int64_t ldw, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    const bf16* tokens = static_cast<const bf16*>(packed);
    if (m <= 0) return;
    const int64_t chunk = m <= kTokenChunk ? m : kTokenChunk;
    const int64_t n_chunks = (m + chunk - 1) / chunk;
    const int64_t block_rows = rows_per_block(chunk);
    for (int64_t s = 0; s < n_segments; ++s) {
        const Segment& seg = segments[s];
        int64_t j_lo, j_hi;
        segment_row_range(seg, row_begin, row_end, &j_lo, &j_hi);
        if (j_lo >= j_hi || seg.k1 <= seg.k0) continue;
        const int64_t stride = seg.row_stride > 0 ? seg.row_stride : 1;
        const int64_t kc = k_block(seg.k1 - seg.k0, m);
        const int64_t w_step = stride * ldw;
        // Full blocks of block_rows rows, then one block of the rows left: a row range
        // that is not a multiple of block_rows (a thread's share, a pool work chunk)
        // then costs one narrower block, not row-at-a-time passes (1 weight load per T
        // vdpbf16ps, ~2.5x the time per row).
        const auto rows_at = [&](int64_t j) { return j_hi - j >= block_rows ? block_rows : j_hi - j; };
        for (int64_t kb = seg.k0; kb < seg.k1; kb += kc) {
            const int64_t ke = kb + kc < seg.k1 ? kb + kc : seg.k1;
            for (int64_t j = j_lo; j < j_hi;) {
                const int64_t rows = rows_at(j);
                // The block to prefetch while this one computes: without k blocking the
                // one two blocks on (the second is fetched up front at the range start),
                // so that a line's prefetch is issued a whole block's compute time
                // before its use, not a quarter (M = 16) of it at the start of the next
                // block; with k blocking the following rows or the first rows of the next
                // k block. Near the end, the next block, then this block again (cache
                // hits). Prefetches past the segment's last row are harmless (prefetch
                // never faults).
                if (j == j_lo && kc == seg.k1 - seg.k0 && j + rows < j_hi) {
                    const int64_t rows2 = rows_at(j + rows);
                    const char* b2 = reinterpret_cast<const char*>(w + (seg.row0 + (j + rows) * stride) * ldw + kb);
                    for (int64_t c = 0; c < (ke - kb) * 2; c += 64)
                        for (int64_t r = 0; r < rows2; ++r) _mm_prefetch(b2 + r * w_step * 2 + c, _MM_HINT_T2);
                }
                const int64_t ahead = kc == seg.k1 - seg.k0 && j + 2 * rows < j_hi ? 2 : 1;
                int64_t next_j = j + ahead * rows, next_k0 = kb, next_k1 = ke;
                if (next_j >= j_hi) {
                    next_j = j_lo;
                    next_k0 = ke;
                    next_k1 = ke + kc < seg.k1 ? ke + kc : seg.k1;
                    if (next_k0 >= seg.k1) next_j = j, next_k0 = kb, next_k1 = ke;
                }
                const bf16* w_block = w + (seg.row0 + j * stride) * ldw;
                const bf16* w_next = w + (seg.row0 + next_j * stride) * ldw;
                float* out_block = out + (seg.row0 + j * stride) * ldo;
                const int64_t steps = std::max<int64_t>(1, (ke - kb) / 32);
                const int64_t next_len = next_k1 - next_k0;
                for (int64_t c = 0; c < n_chunks; ++c) {
                    const int64_t t0 = c * chunk;
                    const int64_t nt = m - t0 < chunk ? m - t0 : chunk;
                    // Chunk c prefetches its share of the next block's columns.
                    const int64_t pf_begin = next_k0 + next_len * c / n_chunks;
                    const int64_t pf_len = next_k0 + next_len * (c + 1) / n_chunks - pf_begin;
                    const Block block{w_block, w_step, w_next + pf_begin, (pf_len << 16) / steps, out_block + t0,
                                      stride * ldo};
                    micro_for(rows, nt, n_chunks > 4)(block, tokens + t0 * k, k, kb, ke);
                }
                j += rows;
            }
        }
    }
}

void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, void* packed) {
    silu_mul_pack_avx512<false>(gate_parts, up_parts, n_parts, ld, i_begin, i_end, m, i_total, packed);
}

}  // namespace

const KernelOps& avx512_ops() {
    // Plain token layout: the reference's row-copy gather serves.
    static const KernelOps ops{Isa::avx512,          "avx512",        ref_ops().packed_bytes, ref_ops().gather,
                               matmul_segments,      silu_mul_pack,   combine_down_avx512};
    return ops;
}

uint64_t stream_read_avx512(const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= bytes; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    const __m512i all = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    // Fold the lanes as unsigned: _mm512_reduce_add_epi64 adds as signed long long, and
    // an overflow of this checksum would be undefined behaviour.
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, all);
    uint64_t sum = 0;
    for (uint64_t lane : lanes) sum += lane;
    for (; i < bytes; ++i) sum += static_cast<unsigned char>(p[i]);
    return sum;
}

double dpbf16ps_peak_loop(int64_t iterations) {
    // Written in assembly: with intrinsics gcc kept the 24 accumulators in memory.
    // 24 independent chains hide the instruction latency; operands are zeros.
    if (iterations <= 0) return 0.0;
    int64_t n = iterations;
#define NUMA_MOE_DP(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
    __asm__ volatile(
        "vpxord %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpxord %%zmm31, %%zmm31, %%zmm31\n\t"
        "1:\n\t" NUMA_MOE_DP(0) NUMA_MOE_DP(1) NUMA_MOE_DP(2) NUMA_MOE_DP(3) NUMA_MOE_DP(4) NUMA_MOE_DP(5)
        NUMA_MOE_DP(6) NUMA_MOE_DP(7) NUMA_MOE_DP(8) NUMA_MOE_DP(9) NUMA_MOE_DP(10) NUMA_MOE_DP(11) NUMA_MOE_DP(12)
        NUMA_MOE_DP(13) NUMA_MOE_DP(14) NUMA_MOE_DP(15) NUMA_MOE_DP(16) NUMA_MOE_DP(17) NUMA_MOE_DP(18)
        NUMA_MOE_DP(19) NUMA_MOE_DP(20) NUMA_MOE_DP(21) NUMA_MOE_DP(22) NUMA_MOE_DP(23)
        "dec %0\n\t"
        "jnz 1b\n\t"
        : "+r"(n)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
          "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm30",
          "xmm31", "cc");
#undef NUMA_MOE_DP
    return static_cast<double>(iterations) * 24.0 * 64.0;
}

}  // namespace numa_moe::kernels
