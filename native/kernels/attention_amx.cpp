// AMX-BF16 decode attention. The g query heads that share a KV head form the small
// operand that takes the layout transform (pairs, once per block), while the K cache rows
// are AMX A tiles exactly as they lie in memory, as the expert weights are. This source is
// compiled twice, like amx_bf16.cpp: for real (-mamx-tile -mamx-bf16, Isa::amx) and with
// -DNUMA_MOE_AMX_MODEL against amx_model.hpp (Isa::amx_model, run by the tests on CPUs
// without AMX).
//
// Operand layouts (tdpbf16ps C[m][n] += sum_k A[m][k] * B[k/2][2n + k%2]):
//   query   packed pairs q[(c / 2) * 2g + 2i + c % 2] (pack_query): the B operand of S^T
//   S^T     C [16 positions][g] = A (16 K rows x 32 columns, stride 2d bytes, straight
//           from the cache) x B (16 query pairs x g); 4 C tiles cover a 64-position chunk;
//           a last block of fewer than 16 rows is copied into a zero-padded tile first
//   softmax fp32 over S^T rows (lanes = queries), p rounded to bf16 and transposed to
//           P [g][64 positions] (the A operand of P.V, stride 128 bytes)
//   P.V     C [g][16 columns] x 4 (64 columns of o per pass, loaded from and stored back to
//           the state, stride 4d bytes) += A (P, g x 32 positions) x B (V pairs: 32 cache
//           rows interleaved two by two into 16 x 64-byte rows, packed in L1 per step)
//   state   m[i], l[i], o[i * d + c] fp32
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/attention_api.hpp"
#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"

#include "kernels/amx_tiles.hpp"
#ifdef NUMA_MOE_AMX_MODEL
#define ATTN_AMX_NAMESPACE attention_amx_model_build
#else
#define ATTN_AMX_NAMESPACE attention_amx_real_build
#endif

namespace numa_moe::kernels {
namespace ATTN_AMX_NAMESPACE {
namespace {

using amx_tiles::TileConfig;

// Scratch layout (bytes): S^T [64][16] fp32, the K tail tile [16][d] bf16, P [16][64] bf16,
// V pairs [4][16][32] bf16.
constexpr int64_t kScoresBytes = kAttentionChunk * 16 * 4;
constexpr int64_t kProbsBytes = 16 * kAttentionChunk * 2;
constexpr int64_t kVPairsBytes = 4 * 16 * 64;

size_t query_bytes(int64_t g, int64_t d) { return static_cast<size_t>(g * d) * sizeof(bf16); }
size_t scratch_bytes(int64_t, int64_t d) { return static_cast<size_t>(kScoresBytes + 16 * d * 2 + kProbsBytes + kVPairsBytes); }

void pack_query(const bf16* q, int64_t g, int64_t d, void* packed) {
    bf16* dst = static_cast<bf16*>(packed);
    for (int64_t i = 0; i < g; ++i)
        for (int64_t c = 0; c < d; ++c) dst[(c / 2) * 2 * g + 2 * i + c % 2] = q[i * d + c];
}

void configure(int rows_c, int colsb_c, int rows_a, int rows_b, int colsb_b, bool two_a) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 4; ++t) {
        cfg.rows[t] = static_cast<uint8_t>(rows_c);
        cfg.colsb[t] = static_cast<uint16_t>(colsb_c);
    }
    for (int t = 4; t < (two_a ? 6 : 5); ++t) {
        cfg.rows[t] = static_cast<uint8_t>(rows_a);
        cfg.colsb[t] = 64;
    }
    for (int t = two_a ? 6 : 5; t < 8; ++t) {
        cfg.rows[t] = static_cast<uint8_t>(rows_b);
        cfg.colsb[t] = static_cast<uint16_t>(colsb_b);
    }
    TILE_LOADCONFIG(&cfg);
}

// S^T[t][i] (unscaled) for the nc <= 64 positions of a chunk.
void scores(const bf16* qp, int64_t g, int64_t d, const bf16* k, int64_t nc, bf16* k_tail, float* st) {
    const int64_t full = nc / 16, blocks = (nc + 15) / 16;
    if (blocks > full) {  // a last block of fewer than 16 rows: zero-padded copy
        std::memset(k_tail, 0, static_cast<size_t>(16 * d * 2));
        std::memcpy(k_tail, k + full * 16 * d, static_cast<size_t>((nc - full * 16) * d * 2));
    }
    const long k_stride = static_cast<long>(2 * d), q_stride = static_cast<long>(4 * g);
    // C tile, K block: literal tile numbers (the real intrinsics paste them into assembly).
    auto block = [&](int64_t b) { return b < full ? k + b * 16 * d : k_tail; };
    configure(16, static_cast<int>(4 * g), 16, 16, static_cast<int>(4 * g), true);
    TILE_ZERO(0);
    if (blocks > 1) TILE_ZERO(1);
    if (blocks > 2) TILE_ZERO(2);
    if (blocks > 3) TILE_ZERO(3);
    for (int64_t j = 0; j < d / 32; ++j) {
        TILE_LOADD(6, qp + j * 32 * g, q_stride);
        TILE_LOADD(4, block(0) + 32 * j, k_stride);
        TILE_DPBF16PS(0, 4, 6);
        if (blocks > 1) {
            TILE_LOADD(5, block(1) + 32 * j, k_stride);
            TILE_DPBF16PS(1, 5, 6);
        }
        if (blocks > 2) {
            TILE_LOADD(4, block(2) + 32 * j, k_stride);
            TILE_DPBF16PS(2, 4, 6);
        }
        if (blocks > 3) {
            TILE_LOADD(5, block(3) + 32 * j, k_stride);
            TILE_DPBF16PS(3, 5, 6);
        }
    }
    TILE_STORED(0, st, 64);
    if (blocks > 1) TILE_STORED(1, st + 16 * 16, 64);
    if (blocks > 2) TILE_STORED(2, st + 32 * 16, 64);
    if (blocks > 3) TILE_STORED(3, st + 48 * 16, 64);
}

// Softmax step over S^T rows t < nc (lanes i < g): P [16][64] bf16 (zero beyond nc), the
// state's m and l updated, alpha[i] returned for the rescale of o.
void softmax(const float* st, int64_t nc, int64_t g, float scale, const AttentionState& state, bf16* probs,
             float* alpha) {
    const __mmask16 lanes = tail_mask16(g);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 m_old = _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), lanes, state.m);
    __m512 m_new = m_old;
    for (int64_t t = 0; t < nc; ++t) m_new = _mm512_max_ps(m_new, _mm512_mul_ps(_mm512_loadu_ps(st + 16 * t), vscale));
    m_new = _mm512_maskz_mov_ps(lanes, m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < kAttentionChunk / 16; ++b) {
        __m512 rows[16];
        for (int64_t r = 0; r < 16; ++r) {
            const int64_t t = 16 * b + r;
            if (t >= nc) {
                rows[r] = _mm512_setzero_ps();
                continue;
            }
            const __m512 p = exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(st + 16 * t), vscale), m_new));
            // the value P.V will use: bf16, and l sums the same values
            const __m512 p_rounded = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p)), 16));
            rows[r] = _mm512_maskz_mov_ps(lanes, p_rounded);
            sum = _mm512_add_ps(sum, rows[r]);
        }
        transpose16(rows);  // rows[i] = p of query i over the block's 16 positions
        for (int64_t i = 0; i < 16; ++i)
            _mm256_storeu_si256((__m256i*)(probs + i * kAttentionChunk + 16 * b), to_bf16x16(rows[i]));
    }
    // alpha = e^(m - m'); 0 where m was -inf (no position seen yet: o and l are 0 anyway)
    const __mmask16 seen = _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ);
    const __m512 va = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(m_old, m_new)));
    const __m512 l_old = _mm512_maskz_loadu_ps(lanes, state.l);
    _mm512_mask_storeu_ps(state.l, lanes, _mm512_fmadd_ps(l_old, va, sum));
    _mm512_mask_storeu_ps(state.m, lanes, m_new);
    _mm512_storeu_ps(alpha, va);
}

// V pairs of 32 positions from `first` (rows >= n zero) and 64 columns from c0: block b
// (16 columns) at vp + b * 512, row j = positions 2j, 2j + 1 interleaved column by column.
void pack_v_pairs(const bf16* v, int64_t d, int64_t first, int64_t n, int64_t c0, bf16* vp) {
    alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
    for (int64_t j = 0; j < 16; ++j) {
        const int64_t ta = first + 2 * j, tb = ta + 1;
        for (int64_t h = 0; h < 2; ++h) {
            const __m512i a = ta < n ? _mm512_loadu_si512(v + ta * d + c0 + 32 * h) : _mm512_setzero_si512();
            const __m512i b = tb < n ? _mm512_loadu_si512(v + tb * d + c0 + 32 * h) : _mm512_setzero_si512();
            _mm512_store_si512(vp + (2 * h) * 512 + j * 32, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512(vp + (2 * h + 1) * 512 + j * 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

// o = alpha o + P V over the chunk's nc positions.
void accumulate_pv(const bf16* probs, int64_t g, int64_t d, const bf16* v, int64_t nc, const float* alpha, float* o,
                   bf16* vp) {
    for (int64_t i = 0; i < g; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(o + i * d + c, _mm512_mul_ps(_mm512_loadu_ps(o + i * d + c), a));
    }
    const long o_stride = static_cast<long>(4 * d);
    configure(static_cast<int>(g), 64, static_cast<int>(g), 16, 64, false);
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        float* oc = o + c0;
        TILE_LOADD(0, oc, o_stride);
        TILE_LOADD(1, oc + 16, o_stride);
        TILE_LOADD(2, oc + 32, o_stride);
        TILE_LOADD(3, oc + 48, o_stride);
        for (int64_t s = 0; s * 32 < nc; ++s) {
            pack_v_pairs(v, d, 32 * s, nc, c0, vp);
            TILE_LOADD(4, probs + 32 * s, 2 * kAttentionChunk);
            TILE_LOADD(5, vp, 64);
            TILE_DPBF16PS(0, 4, 5);
            TILE_LOADD(6, vp + 512, 64);
            TILE_DPBF16PS(1, 4, 6);
            TILE_LOADD(7, vp + 1024, 64);
            TILE_DPBF16PS(2, 4, 7);
            TILE_LOADD(5, vp + 1536, 64);
            TILE_DPBF16PS(3, 4, 5);
        }
        TILE_STORED(0, oc, o_stride);
        TILE_STORED(1, oc + 16, o_stride);
        TILE_STORED(2, oc + 32, o_stride);
        TILE_STORED(3, oc + 48, o_stride);
    }
}

void attend(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n, float scale,
            const AttentionState& state, void* scratch) {
    auto* bytes = static_cast<unsigned char*>(scratch);
    float* st = reinterpret_cast<float*>(bytes);
    bf16* k_tail = reinterpret_cast<bf16*>(bytes + kScoresBytes);
    bf16* probs = reinterpret_cast<bf16*>(bytes + kScoresBytes + 16 * d * 2);
    bf16* vp = reinterpret_cast<bf16*>(bytes + kScoresBytes + 16 * d * 2 + kProbsBytes);
    alignas(64) float alpha[16];
    const bf16* qp = static_cast<const bf16*>(packed_query);
    for (int64_t t0 = 0; t0 < n; t0 += kAttentionChunk) {
        const int64_t nc = n - t0 < kAttentionChunk ? n - t0 : kAttentionChunk;
        scores(qp, g, d, k + t0 * d, nc, k_tail, st);
        softmax(st, nc, g, scale, state, probs, alpha);
        accumulate_pv(probs, g, d, v + t0 * d, nc, alpha, state.o, vp);
    }
}

}  // namespace
}  // namespace ATTN_AMX_NAMESPACE

#ifdef NUMA_MOE_AMX_MODEL
const AttentionOps& attention_amx_model_ops() {
    static const AttentionOps ops{Isa::amx_model, "amx_model", ATTN_AMX_NAMESPACE::query_bytes,
                                  ATTN_AMX_NAMESPACE::scratch_bytes, ATTN_AMX_NAMESPACE::pack_query,
                                  ATTN_AMX_NAMESPACE::attend};
    return ops;
}
#else
const AttentionOps& attention_amx_ops() {
    static const AttentionOps ops{Isa::amx, "amx", ATTN_AMX_NAMESPACE::query_bytes, ATTN_AMX_NAMESPACE::scratch_bytes,
                                  ATTN_AMX_NAMESPACE::pack_query, ATTN_AMX_NAMESPACE::attend};
    return ops;
}
#endif

}  // namespace numa_moe::kernels
