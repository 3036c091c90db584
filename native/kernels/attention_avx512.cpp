// AVX-512-BF16 decode attention. Both products run on vdpbf16ps (each fp32 lane adds the
// dot product of one bf16 pair of either operand), with the cache rows read straight from
// memory: nothing of K or V is transposed or copied to L1 (but a run's last block of fewer
// than 16 K rows, which is padded so that no row past the run is read).
//
//   q.k  The block of g queries is padded to G = 1, 2, 4, 8 or 16 and a vector holds G
//        queries x R = 16 / G consecutive pairs of the head. Each K row supplies its R
//        pairs broadcast to the G query slots (vpbroadcastq for G = 8), so one query
//        vector serves 16 positions (16 accumulators). A tree of two-source permutes then
//        sums the R lanes of each query and packs R positions per vector: S^T[t][i].
//   softmax  On S^T vectors (lanes are queries, so the max and the sum over positions are
//        vertical operations, and one cross-lane reduction per chunk); P is rounded to
//        bf16 and permuted to pairs of positions per query, the broadcast operand of P.V.
//   P.V  Lanes are 16 columns: two V rows are interleaved in registers (vpermt2w) into
//        position pairs, and one interleaved vector feeds a block of up to 8 queries.
//   Prefetch: a 4 KB page holds 16 cache rows of D = 128, too few for the hardware
//   prefetcher to run ahead by itself; each phase (scores, P.V) prefetches the rows of
//   the next phase into L1 and those of the phase after into L2 (struct Prefetch).
//
// Operand layouts (attention_api.hpp):
//   query   packed A[s][j] (s < d / 2R, j < 16) = the bf16 pair (q[i][2p], q[i][2p + 1])
//           with i = j / R, p = s R + j % R (zero for the padding queries i >= g)
//   k, v    k[t * d + c], v[t * d + c] bf16 cache rows, read as they are
//   state   m[i], l[i], o[i * d + c] fp32
//   scratch S^T st[t * G + i] fp32 (64 positions), P pairs pt[(t / 2) * 2G + 2i + t % 2]
//           bf16, and a zero-padded copy of a last block of fewer than 16 K rows
// Precision: P is rounded to bf16 for P.V and l sums the rounded values (as on AMX).
#include <immintrin.h>

#include <cstring>

#include "kernels/attention_api.hpp"
#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"

namespace numa_moe::kernels {
namespace {

#ifdef NUMA_MOE_EMULATED
// attention_avx512_emulated.cpp: this source over SIMDe's intrinsics, a test build (docs/kernels.md).
constexpr Isa kIsa = Isa::avx512_emulated;
#else
constexpr Isa kIsa = Isa::avx512;
#endif

constexpr int64_t kChunk = kAttentionChunk;
constexpr int64_t kScoresBytes = kMaxQueryBlock * kChunk * 4;
constexpr int64_t kProbsBytes = kMaxQueryBlock * kChunk * 2;
// Queries per P.V block: 8 x 2 accumulators, and an interleaved V vector used 8 times.
constexpr int64_t kPvQueries = 8;

int64_t padded_group(int64_t g) { return g <= 1 ? 1 : g <= 2 ? 2 : g <= 4 ? 4 : g <= 8 ? 8 : 16; }

size_t query_bytes(int64_t g, int64_t d) { return static_cast<size_t>(padded_group(g) * d) * sizeof(bf16); }
// S^T + P + the K tail block
size_t scratch_bytes(int64_t, int64_t d) { return static_cast<size_t>(kScoresBytes + kProbsBytes + 16 * d * 2); }

// Lane j = i R + r of vector s is pair s R + r of query i: R consecutive pairs of a row.
template <int R>
void pack_pairs(const bf16* q, int64_t g, int64_t d, bf16* dst) {
    for (int64_t s = 0; s < d / (2 * R); ++s)
        for (int64_t i = 0; i < 16 / R; ++i) {
            bf16* lanes = dst + (s * 16 + i * R) * 2;
            if (i < g) std::memcpy(lanes, q + i * d + 2 * R * s, 4 * R);
            else std::memset(lanes, 0, 4 * R);
        }
}

void pack_query(const bf16* q, int64_t g, int64_t d, void* packed) {
    bf16* dst = static_cast<bf16*>(packed);
    switch (padded_group(g)) {
        case 1: pack_pairs<16>(q, g, d, dst); break;
        case 2: pack_pairs<8>(q, g, d, dst); break;
        case 4: pack_pairs<4>(q, g, d, dst); break;
        case 8: pack_pairs<2>(q, g, d, dst); break;
        default: pack_pairs<1>(q, g, d, dst); break;
    }
}

// Cache rows to prefetch while a phase runs (rows at `near` are read by the next phase,
// those at `far` by the one after): near ones into L1, non-temporal (every line of K and V
// is used in one chunk only), far ones into L2. Prefetching only one phase ahead left the
// loads waiting, and into L1 two phases ahead measured slower still (the lines then
// compete for L1 with the chunk in use).
struct Prefetch {
    const bf16* near = nullptr;
    int64_t near_lines = 0;  // 64-byte lines from `near` on
    const bf16* far = nullptr;
    int64_t far_lines = 0;
};

// Line `line` after pf.near and after pf.far, where it exists. Always inlined: as a call,
// gcc finds it free of side effects and drops it.
__attribute__((always_inline)) inline void prefetch_line(Prefetch pf, int64_t line) {
    if (line < pf.near_lines) _mm_prefetch(reinterpret_cast<const char*>(pf.near + 32 * line), _MM_HINT_NTA);
    if (line < pf.far_lines) _mm_prefetch(reinterpret_cast<const char*>(pf.far + 32 * line), _MM_HINT_T2);
}

// The `rows` rows of D at `near` and at `far` (null: none).
template <int D>
inline Prefetch prefetch_rows(const bf16* near, int64_t near_rows, const bf16* far, int64_t far_rows) {
    return Prefetch{near, near ? near_rows * (D / 32) : 0, far, far ? far_rows * (D / 32) : 0};
}

inline __m512bh pair_broadcast(const bf16* p) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// R consecutive pairs of a row, repeated over the 16 / R query slots.
template <int R>
inline __m512bh row_pairs(const bf16* p) {
    if constexpr (R == 1) {
        return pair_broadcast(p);
    } else if constexpr (R == 2) {
        long long bits;
        std::memcpy(&bits, p, 8);
        return (__m512bh)_mm512_set1_epi64(bits);
    } else if constexpr (R == 4) {
        return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else if constexpr (R == 8) {
        return (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
        return (__m512bh)_mm512_loadu_si512(p);
    }
}

inline __m512i lane_index(int add, int mod_mask) {
    return _mm512_and_si512(_mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(add)),
                            _mm512_set1_epi32(mod_mask));
}

// The lines of pf from row r on.
template <int D>
inline Prefetch rows_from(Prefetch pf, int64_t r) {
    constexpr int64_t kRowLines = D / 32;
    Prefetch out;
    if (pf.near_lines > r * kRowLines) out = Prefetch{pf.near + r * D, pf.near_lines - r * kRowLines, nullptr, 0};
    if (pf.far_lines > r * kRowLines) {
        out.far = pf.far + r * D;
        out.far_lines = pf.far_lines - r * kRowLines;
    }
    return out;
}

// st[t * G + i] = scale * q_i . k_t for 16 rows of stride D; up to 16 rows of `pf` are
// prefetched along the way.
template <int D, int G>
void score_rows(const bf16* qp, const bf16* k, __m512 vscale, float* st, Prefetch pf) {
    constexpr int R = 16 / G, kSteps = D / (2 * R);
    constexpr int kLines = 16 * D / 32;
    constexpr int kLinesPerStep = (kLines + kSteps - 1) / kSteps;
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int s = 0; s < kSteps; ++s) {
        for (int e = 0; e < kLinesPerStep; ++e)
            if (s * kLinesPerStep + e < kLines) prefetch_line(pf, s * kLinesPerStep + e);
        const __m512bh a = (__m512bh)_mm512_load_si512(qp + s * 32);
        const bf16* kp = k + s * 2 * R;
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], a, row_pairs<R>(kp + t * D));
    }
    // Each level sums adjacent lanes (the two halves of a query's pairs) of two vectors
    // and packs both into one: 16 vectors of one position -> G vectors of R positions.
    const __m512i even = _mm512_add_epi32(lane_index(0, 15), lane_index(0, 15));
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int n = 16; n > G; n /= 2)
        for (int w = 0; w < n / 2; ++w)
            acc[w] = _mm512_add_ps(_mm512_permutex2var_ps(acc[2 * w], even, acc[2 * w + 1]),
                                   _mm512_permutex2var_ps(acc[2 * w], odd, acc[2 * w + 1]));
    for (int w = 0; w < G; ++w) _mm512_store_ps(st + 16 * w, _mm512_mul_ps(acc[w], vscale));
}

// S^T of the nc <= 64 rows at k, prefetching the rows of `pf` (up to a chunk).
template <int D, int G>
void scores(const bf16* qp, const bf16* k, int64_t nc, Prefetch pf, float scale, float* st, bf16* k_tail) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < nc; t0 += 16) {
        const bf16* rows = k + t0 * D;
        if (nc - t0 < 16) {
            // a run's last rows: never read past them
            std::memcpy(k_tail, rows, static_cast<size_t>((nc - t0) * D * 2));
            std::memset(k_tail + (nc - t0) * D, 0, static_cast<size_t>((16 - (nc - t0)) * D * 2));
            rows = k_tail;
        }
        score_rows<D, G>(qp, rows, vscale, st + t0 * G, rows_from<D>(pf, t0));
    }
}

// x reduced (op) over the R lanes of each query; every lane gets its query's result.
template <int G, class Op>
inline __m512 across_positions(__m512 x, Op op) {
    for (int shift = G; shift < 16; shift *= 2) x = op(x, _mm512_permutexvar_ps(lane_index(shift, 15), x));
    return x;
}

// bf16(e^(s - m)) of two S^T vectors (zero where not valid), in the P pair layout.
inline __m512i round_pairs(const float* st, __mmask16 valid0, __mmask16 valid1, __m512 m, __m512i pairs) {
    const __m512 p0 = _mm512_maskz_mov_ps(valid0, exp512(_mm512_sub_ps(_mm512_load_ps(st), m)));
    const __m512 p1 = _mm512_maskz_mov_ps(valid1, exp512(_mm512_sub_ps(_mm512_load_ps(st + 16), m)));
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
}

// The online-softmax step of every query over st[t][i], t < nc: pt = bf16(e^(s - m'))
// (zero beyond nc, up to kChunk) in pairs of positions; m and l updated with the rounded
// values; alpha[i] = e^(m - m').
template <int G>
void softmax(const float* st, int64_t g, int64_t nc, float* m, float* l, bf16* pt, float* alpha) {
    constexpr int R = 16 / G, kVecs = static_cast<int>(kChunk) * G / 16;
    // pt position of element e of two S^T vectors (2R positions x G queries, bf16)
    alignas(64) static const uint16_t kPairs[32] = {
#define NUMA_MOE_PAIR(e) static_cast<uint16_t>((((e) / (2 * G)) * 2 + (e) % 2) * G + ((e) % (2 * G)) / 2)
        NUMA_MOE_PAIR(0),  NUMA_MOE_PAIR(1),  NUMA_MOE_PAIR(2),  NUMA_MOE_PAIR(3),  NUMA_MOE_PAIR(4),
        NUMA_MOE_PAIR(5),  NUMA_MOE_PAIR(6),  NUMA_MOE_PAIR(7),  NUMA_MOE_PAIR(8),  NUMA_MOE_PAIR(9),
        NUMA_MOE_PAIR(10), NUMA_MOE_PAIR(11), NUMA_MOE_PAIR(12), NUMA_MOE_PAIR(13), NUMA_MOE_PAIR(14),
        NUMA_MOE_PAIR(15), NUMA_MOE_PAIR(16), NUMA_MOE_PAIR(17), NUMA_MOE_PAIR(18), NUMA_MOE_PAIR(19),
        NUMA_MOE_PAIR(20), NUMA_MOE_PAIR(21), NUMA_MOE_PAIR(22), NUMA_MOE_PAIR(23), NUMA_MOE_PAIR(24),
        NUMA_MOE_PAIR(25), NUMA_MOE_PAIR(26), NUMA_MOE_PAIR(27), NUMA_MOE_PAIR(28), NUMA_MOE_PAIR(29),
        NUMA_MOE_PAIR(30), NUMA_MOE_PAIR(31)};
#undef NUMA_MOE_PAIR
    const __m512i query_of_lane = lane_index(0, G - 1);
    const __mmask16 real = tail_mask16(g);
    const __m512 m_old = _mm512_permutexvar_ps(query_of_lane, _mm512_maskz_loadu_ps(real, m));
    const __m512 l_old = _mm512_permutexvar_ps(query_of_lane, _mm512_maskz_loadu_ps(real, l));
    __mmask16 valid[kVecs];
    for (int w = 0; w < kVecs; ++w) {
        const int64_t left = nc - static_cast<int64_t>(w) * R;  // positions of vector w that are real
        valid[w] = left >= R ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : tail_mask16(left * G);
    }
    // Partial maxima and sums in named variables (an array indexed in the loop stays in
    // memory): one chain of dependent operations per vector would be latency-bound.
    __m512 mx0 = m_old, mx1 = m_old, mx2 = m_old, mx3 = m_old;
    for (int w = 0; w < kVecs; w += 4) {
        mx0 = _mm512_mask_max_ps(mx0, valid[w], mx0, _mm512_load_ps(st + 16 * w));
        mx1 = _mm512_mask_max_ps(mx1, valid[w + 1], mx1, _mm512_load_ps(st + 16 * w + 16));
        mx2 = _mm512_mask_max_ps(mx2, valid[w + 2], mx2, _mm512_load_ps(st + 16 * w + 32));
        mx3 = _mm512_mask_max_ps(mx3, valid[w + 3], mx3, _mm512_load_ps(st + 16 * w + 48));
    }
    const __m512 m_new = across_positions<G>(_mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3)),
                                             [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
    const __m512i pairs = _mm512_load_si512(kPairs);
    // The rounded values are summed by vdpbf16ps against ones: each 32-bit lane of the pair
    // layout is one query's two positions, as in P.V (which treats them alike).
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int w = 0; w < kVecs; w += 4) {
        const __m512i pair0 = round_pairs(st + 16 * w, valid[w], valid[w + 1], m_new, pairs);
        const __m512i pair1 = round_pairs(st + 16 * w + 32, valid[w + 2], valid[w + 3], m_new, pairs);
        _mm512_store_si512(pt + 16 * w, pair0);
        _mm512_store_si512(pt + 16 * w + 32, pair1);
        sum0 = _mm512_dpbf16_ps(sum0, (__m512bh)pair0, ones);
        sum1 = _mm512_dpbf16_ps(sum1, (__m512bh)pair1, ones);
    }
    const __m512 sum = across_positions<G>(_mm512_add_ps(sum0, sum1),
                                           [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
    const __mmask16 seen = _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ);
    const __m512 a = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(m_old, m_new)));
    _mm512_mask_storeu_ps(m, real, m_new);
    _mm512_mask_storeu_ps(l, real, _mm512_fmadd_ps(l_old, a, sum));
    _mm512_storeu_ps(alpha, a);
}

// Rows a and b of 32 columns as position pairs: columns 0-15 and 16-31.
inline void interleave(__m512i a, __m512i b, __m512bh* lo, __m512bh* hi) {
    alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    *lo = (__m512bh)_mm512_permutex2var_epi16(a, _mm512_load_si512(kLo), b);
    *hi = (__m512bh)_mm512_permutex2var_epi16(a, _mm512_load_si512(kHi), b);
}

// acc[i][j] += p_i[t, t+1] . v[t, t+1][c0 + 16j] for one pair of rows (b = zero past the run).
template <int G, int QB, int CV>
inline void pv_step(__m512 (&acc)[QB][CV], const bf16* pt_pair, const bf16* row_a, const bf16* row_b) {
    __m512bh vv[CV];
    for (int j = 0; j < CV; j += 2) {
        const __m512i a = _mm512_loadu_si512(row_a + 16 * j);
        const __m512i b = row_b ? _mm512_loadu_si512(row_b + 16 * j) : _mm512_setzero_si512();
        interleave(a, b, &vv[j], &vv[j + 1]);
    }
    for (int i = 0; i < QB; ++i) {
        const __m512bh p = pair_broadcast(pt_pair + 2 * i);
        for (int j = 0; j < CV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], vv[j], p);
    }
}

// o_i[c0, c0 + 16 CV) = alpha_i o_i + sum_t p_i[t] v_t[...] for QB queries and every CV
// columns group; with few accumulators the pairs alternate over S sets, so that enough
// dependency chains keep vdpbf16ps busy. The rows of `pf` are prefetched along the way.
template <int D, int G, int QB, int CV, int S>
void pv_block(const bf16* pt, const float* alpha, const bf16* v, int64_t nc, float* o, const Prefetch* pf) {
    const int64_t full = nc / 2;
    for (int64_t c0 = 0; c0 < D; c0 += 16 * CV) {
        __m512 acc[S][QB][CV];
        for (int i = 0; i < QB; ++i) {
            const __m512 va = _mm512_set1_ps(alpha[i]);
            for (int j = 0; j < CV; ++j) {
                acc[0][i][j] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c0 + 16 * j), va);
                for (int h = 1; h < S; ++h) acc[h][i][j] = _mm512_setzero_ps();
            }
        }
        int64_t tp = 0;
        for (; tp + S <= full; tp += S)
            for (int h = 0; h < S; ++h) {
                const int64_t t = 2 * (tp + h);
                if (pf) {
                    // the lines of rows t and t + 1 that this column group reads
                    for (int line = 0; line < CV / 2; ++line) {
                        prefetch_line(*pf, t * (D / 32) + c0 / 32 + line);
                        prefetch_line(*pf, (t + 1) * (D / 32) + c0 / 32 + line);
                    }
                }
                pv_step<G, QB, CV>(acc[h], pt + (tp + h) * 2 * G, v + t * D + c0, v + (t + 1) * D + c0);
            }
        for (; tp < full; ++tp) pv_step<G, QB, CV>(acc[0], pt + tp * 2 * G, v + 2 * tp * D + c0, v + (2 * tp + 1) * D + c0);
        if (nc % 2) pv_step<G, QB, CV>(acc[0], pt + full * 2 * G, v + 2 * full * D + c0, nullptr);
        for (int i = 0; i < QB; ++i)
            for (int j = 0; j < CV; ++j) {
                __m512 sum = acc[0][i][j];
                for (int h = 1; h < S; ++h) sum = _mm512_add_ps(sum, acc[h][i][j]);
                _mm512_storeu_ps(o + i * D + c0 + 16 * j, sum);
            }
    }
}

template <int D, int G>
void accumulate_pv(const bf16* pt, const float* alpha, int64_t g, const bf16* v, int64_t nc, float* o,
                   const Prefetch& prefetch) {
    for (int64_t i = 0; i < g; i += kPvQueries) {
        const bf16* p = pt + 2 * i;
        const Prefetch* pf = i == 0 ? &prefetch : nullptr;  // one prefetch per line
        float* oi = o + i * D;
        switch (g - i < kPvQueries ? g - i : kPvQueries) {
            case 1: pv_block<D, G, 1, 4, 4>(p, alpha + i, v, nc, oi, pf); break;
            case 2: pv_block<D, G, 2, 4, 2>(p, alpha + i, v, nc, oi, pf); break;
            case 3: pv_block<D, G, 3, 4, 1>(p, alpha + i, v, nc, oi, pf); break;
            case 4: pv_block<D, G, 4, 4, 1>(p, alpha + i, v, nc, oi, pf); break;
            case 5: pv_block<D, G, 5, 2, 1>(p, alpha + i, v, nc, oi, pf); break;
            case 6: pv_block<D, G, 6, 2, 1>(p, alpha + i, v, nc, oi, pf); break;
            case 7: pv_block<D, G, 7, 2, 1>(p, alpha + i, v, nc, oi, pf); break;
            default: pv_block<D, G, 8, 2, 1>(p, alpha + i, v, nc, oi, pf); break;
        }
    }
}

template <int D, int G>
void attend_dg(const bf16* qp, int64_t g, const bf16* k, const bf16* v, int64_t n, float scale,
               const AttentionState& st, unsigned char* scratch) {
    float* s = reinterpret_cast<float*>(scratch);
    bf16* pt = reinterpret_cast<bf16*>(scratch + kScoresBytes);
    bf16* k_tail = reinterpret_cast<bf16*>(scratch + kScoresBytes + kProbsBytes);
    alignas(64) float alpha[16];
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
        const int64_t nc = n - t0 < kChunk ? n - t0 : kChunk;
        // Rows of the next chunk (none past the run).
        const int64_t ahead = n - t0 - kChunk < 0 ? 0 : n - t0 - kChunk < kChunk ? n - t0 - kChunk : kChunk;
        const bf16* k_next = ahead > 0 ? k + (t0 + kChunk) * D : nullptr;
        const bf16* v_next = ahead > 0 ? v + (t0 + kChunk) * D : nullptr;
        // Scoring reads K(c) and prefetches V(c) near and K(c + 1) far; P.V reads V(c) and
        // prefetches K(c + 1) near and V(c + 1) far.
        scores<D, G>(qp, k + t0 * D, nc, prefetch_rows<D>(v + t0 * D, nc, k_next, ahead), scale, s, k_tail);
        softmax<G>(s, g, nc, st.m, st.l, pt, alpha);
        accumulate_pv<D, G>(pt, alpha, g, v + t0 * D, nc, st.o, prefetch_rows<D>(k_next, ahead, v_next, ahead));
    }
}

template <int D>
void attend_d(const bf16* qp, int64_t g, const bf16* k, const bf16* v, int64_t n, float scale,
              const AttentionState& st, unsigned char* scratch) {
    switch (padded_group(g)) {
        case 1: attend_dg<D, 1>(qp, g, k, v, n, scale, st, scratch); break;
        case 2: attend_dg<D, 2>(qp, g, k, v, n, scale, st, scratch); break;
        case 4: attend_dg<D, 4>(qp, g, k, v, n, scale, st, scratch); break;
        case 8: attend_dg<D, 8>(qp, g, k, v, n, scale, st, scratch); break;
        default: attend_dg<D, 16>(qp, g, k, v, n, scale, st, scratch); break;
    }
}

void attend(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n, float scale,
            const AttentionState& st, void* scratch) {
    const bf16* q = static_cast<const bf16*>(packed_query);
    auto* work = static_cast<unsigned char*>(scratch);
    with_head_dim(d, [&](auto dim) { attend_d<decltype(dim)::value>(q, g, k, v, n, scale, st, work); });
}

}  // namespace

#ifdef NUMA_MOE_EMULATED
const AttentionOps& attention_avx512_emulated_ops() {
#else
const AttentionOps& attention_avx512_ops() {
#endif
    static const AttentionOps ops{kIsa, isa_name(kIsa), query_bytes, scratch_bytes, pack_query, attend};
    return ops;
}

}  // namespace numa_moe::kernels
