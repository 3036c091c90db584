// AMX-INT8 kernels of the integer weight formats (docs/quantization.md, docs/kernels.md):
// int8, int4, mxfp4 and iq4nl weights against int8 tokens, tdpbssd (s8 x s8 into int32). This one
// source is compiled twice, as amx_bf16.cpp is:
//   - for real (-mamx-tile -mamx-int8 + AVX-512 flags): Isa::amx, handed out only when
//     cpuid has AMX-INT8 and Linux granted the tile state (request_amx_permission);
//   - with -DNUMA_MOE_AMX_MODEL against amx_model.hpp: Isa::amx_model, the same kernel
//     logic over emulated tiles, run by the tests on CPUs without AMX.
// Both with -ffp-contract=off: the fp32 epilogue must round as ref_quant.cpp does.
//
// Operand layouts (tdpbssd C[m][n] += sum_k A[m][k] * B[k/4][4n + k%4], all int8 / int32),
// K = 64 columns per tdpbssd, or 32 for groups of 32 (the tile rule below):
//   A  weights  int8 w[r * ld + c] row-major, straight from the checkpoint: a tile is 16 rows
//               of one segment (r = row0 + j * row_stride) x K columns, loaded at stride
//               row_stride * ld bytes (tileloadt1 when m <= 32).
//               int4, mxfp4 and iq4nl, the nibble formats (byte (r * ld + c) / 2, even column in
//               the low nibble, each code an integer of the format's codebook,
//               nibble_codes.hpp: sign-extended, or looked up), are unpacked to
//               int8 in registers into a staging buffer the A tile is loaded from (stride
//               64 bytes), in the int4 order. Groups of 128: a row's 64 bytes of the
//               group at once, the low nibbles (the group's even columns) as one K-step
//               and the high ones (its odd columns) as the next, each nibble q as the
//               byte 16q (a mask, and a shift for the low ones), so C holds 16 x the dot
//               and the epilogue shifts it back (exact). Groups of 64 and 32: K columns
//               of a row at a time, sign-extended, each K-column chunk as its even
//               columns, then its odd ones (no byte crosses a vector lane)
//   B  tokens   the quad layout TokenLayout {4, 1}: q[(c / 4) * 4m + 4t + c % 4] int8 (m * k
//               bytes, padded to 64), then fp32 scale[b * m + t] per group b of G columns
//               (group-major, so that one vector holds 16 tokens' scales); for int4 weights
//               c counts columns in the int4 order (groups of 128: each group's even
//               columns, then its odd ones; else per K-column chunk). The values and scales are
//               quantize_block's (avx512_common.hpp), i.e. ref_quant.cpp's token rule, in
//               another order; formats with minimums then fp32 group sums
//               X[t * (k / G) + b] (group_minimums.hpp). A tile is K / 4 quad rows x min(tokens, 16) tokens, stride
//               4m bytes
//   C  int32 dots of one group (G / K tdpbssd), stored to a scratch tile; the fp32 sums
//               live in accumulators and are added to out[r * ldo + t] once per segment
// Tile rule: K = 64 (A colsb 64: a whole line of each row; B rows 16) when the group is 64
// columns or more, K = 32 (A colsb 32, B rows 8) for groups of 32 (Q8_0 and Q4_0 imports),
// whose products must be scaled on their own; a group's G / K products accumulate in the C
// tiles. Rows and tokens in blocks of 32 as 2 x 2 C tiles (tmm0..3), A in tmm4/5, B in
// tmm6/7; smaller tiles for fewer rows or tokens (16-row blocks for unprefetched rows at
// <= 16 tokens). Per group: tilezero, the products (each tile loaded just before its
// first one), tilestored into one of two buffers, then, after the next group's tile work
// is issued, the epilogue
//     acc[r][t] += float(dot) * (s_w[r][group] * s_x[t][group])
// over the stored tile read flat (16 (row, token) pairs a vector, whatever the token count,
// with the two scale vectors spread by permutes): the reference's fp32 terms in its block
// order, hence its result bit for bit. int8 at groups of 32 from 32 tokens instead: blocks
// of 16 rows x 16-token C tiles whose sums stay in registers across groups
// (run_pass_resident), the same terms in the same order.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/cpu_features.hpp"
#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"
#include "kernels/group_minimums.hpp"
#include "kernels/integer_tables.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/nibble_codes.hpp"

#include "kernels/amx_tiles.hpp"
#ifdef NUMA_MOE_AMX_MODEL
#define AMX_NAMESPACE amx_quant_model_build
#else
#define AMX_NAMESPACE amx_quant_real_build
#endif

namespace numa_moe::kernels {
namespace AMX_NAMESPACE {
namespace {

constexpr int kChunkGroups = 16;  // groups per transposed scale table
// run_pass_resident: the groups a token tile runs through between turns, and the token
// tiles of 16 that share one pass over a block's weights.
constexpr int64_t kResidentGroups = 8;
constexpr int kPassTiles = 8;

// Streamed weights are requested one row block (32 rows) ahead of the block being read,
// when their rows are at most 4 KiB: for such rows one block ahead reads faster from
// memory than a fixed distance in bytes, for both int8 and int4. For longer rows every
// whole-block distance reads slower than none (docs/kernels.md), and such rows are read
// 16 at a time instead.
constexpr int64_t kPrefetchAheadRows = 32;
constexpr int64_t kPrefetchMaxRowBytes = 4096;

// Columns per tdpbssd for groups of G columns: a whole 64-byte line of each weight row
// unless a group is narrower.
template <int64_t G>
constexpr int64_t columns_per_product() {
    return G < 64 ? G : 64;
}

using amx_tiles::TileConfig;

struct TileShape {
    int rows[2];    // weight rows in A0 / A1 (rows[1] may be 0)
    int tokens[2];  // tokens in B0 / B1 (tokens[1] may be 0)
    int columns;    // K of one tdpbssd: A bytes per row, 4 x B rows
    bool operator==(const TileShape& o) const {
        return rows[0] == o.rows[0] && rows[1] == o.rows[1] && tokens[0] == o.tokens[0] &&
               tokens[1] == o.tokens[1] && columns == o.columns;
    }
};

void configure(const TileShape& shape) {
    const TileConfig cfg = amx_tiles::block_config(shape.rows, shape.tokens, shape.columns, shape.columns / 4);
    TILE_LOADCONFIG(&cfg);
}

// ---------------------------------------------------------------------------------------
// Token operand: the quad layout.

TokenLayout quads_layout(int64_t) { return TokenLayout{4, 1}; }

size_t values_bytes(int64_t m, int64_t k) { return (static_cast<size_t>(m * k) + 63) / 64 * 64; }

template <Format F, int64_t G>
size_t packed_bytes(int64_t m, int64_t k) {
    const size_t per_block = has_minimums(F) ? 2 : 1;  // the scale, and the group sum
    return values_bytes(m, k) + per_block * static_cast<size_t>(m * (k / G)) * sizeof(float);
}

float* token_scales(const void* packed, int64_t m, int64_t k) {
    return reinterpret_cast<float*>(const_cast<uint8_t*>(static_cast<const uint8_t*>(packed)) + values_bytes(m, k));
}

template <int64_t G>
float* token_group_sums(const void* packed, int64_t m, int64_t k) {
    return token_scales(packed, m, k) + m * (k / G);
}

// Groups of 128 columns split into their even and odd columns (the low and high nibbles
// of a row's 64 bytes of the group), each one K-step of 64 columns; narrower groups are
// unpacked K columns at a time.
template <int64_t G>
constexpr bool unpacks_whole_groups() {
    return G == 128;
}

// A token's quantized group in the order of the int4 A rows: groups of 128 as their even
// columns, then their odd ones (unpack_group_int4); else each K-column chunk so
// (unpack_nibbles). Bytes are sorted within 16-byte lanes, then the lanes' 8-byte halves
// (a 64-column chunk: its 32 even columns, then its 32 odd ones), then, for a group of
// 128, the two chunks' even halves and odd halves paired.
template <int64_t G>
inline void int4_column_order(const int8_t* q, int8_t* out) {
    constexpr int64_t K = columns_per_product<G>();
    if constexpr (K == 64) {
        const __m512i in_lane = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m512i halves = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
        __m512i chunks[G / 64];
        for (int64_t c = 0; c < G; c += 64)
            chunks[c / 64] = _mm512_permutexvar_epi64(halves, _mm512_shuffle_epi8(_mm512_loadu_si512(q + c), in_lane));
        if constexpr (unpacks_whole_groups<G>()) {
            _mm512_storeu_si512(out, _mm512_shuffle_i64x2(chunks[0], chunks[1], 0x44));
            _mm512_storeu_si512(out + 64, _mm512_shuffle_i64x2(chunks[0], chunks[1], 0xee));
        } else {
            for (int64_t c = 0; c < G; c += 64) _mm512_storeu_si512(out + c, chunks[c / 64]);
        }
    } else {
        const __m256i in_lane = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), in_lane);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(v, 0xd8));
    }
}

// The quantized tokens into the quad layout: dword d of token t's group b goes to quad row
// b * G / 4 + d, byte 4t. The producers (quantize_tokens_avx512, quantize_silu_mul_avx512)
// hand over a block of up to 16 tokens one group at a time, token after token; the block's
// group is collected and written as 16 x 16 dword transposes, one 64-byte store per quad
// row and block, where storing each token's dwords alone would write 4 bytes to each of
// G / 4 lines.
template <Format F, int64_t G>
class QuadWriter {
    // Below this many tokens each token's dwords are stored alone: the lines they touch are
    // few, and a transpose would cost more than the stores it saves.
    static constexpr int64_t kTransposeFromTokens = 4;

public:
    QuadWriter(void* packed, int64_t m, int64_t k)
        : values_(static_cast<int8_t*>(packed)),
          scales_(token_scales(packed, m, k)),
          sums_(has_minimums(F) ? token_group_sums<G>(packed, m, k) : nullptr),
          m_(m),
          k_(k) {}

    void operator()(int64_t t, int64_t b, const int8_t* q, float scale) {
        scales_[b * m_ + t] = scale;
        if constexpr (has_minimums(F)) sums_[t * (k_ / G) + b] = token_group_sum<G>(q, scale);
        const int64_t t0 = t / 16 * 16, nt = m_ - t0 < 16 ? m_ - t0 : 16;
        const bool transposed = m_ >= kTransposeFromTokens;
        // The group in the kernel's column order: collected for the block, or (int4) reordered
        // into a slot of its own; int8 stored alone is written from q as it is.
        const int8_t* row = q;
        if (is_nibble_format(F) || transposed) {
            int8_t* slot = transposed ? block_[t - t0] : block_[0];
            if constexpr (is_nibble_format(F))
                int4_column_order<G>(q, slot);
            else
                std::memcpy(slot, q, G);
            row = slot;
        }
        if (transposed) {
            if (t - t0 == nt - 1) store_block(t0, nt, b);
        } else if (m_ == 1) {
            std::memcpy(values_ + b * G, row, G);
        } else {
            int8_t* dst = values_ + b * G * m_ + 4 * t;
            for (int64_t d = 0; d < G / 4; ++d) std::memcpy(dst + d * 4 * m_, row + 4 * d, 4);
        }
    }

private:
    void store_block(int64_t t0, int64_t nt, int64_t b) {
        const __mmask16 tokens = tail_mask16(static_cast<int>(nt));
        constexpr int64_t kChunk = G < 64 ? G : 64;  // columns a transpose covers
        for (int64_t c = 0; c < G; c += kChunk) {
            __m512 rows[16];
            for (int i = 0; i < 16; ++i) {
                const void* src = block_[i] + c;
                if (i >= nt)
                    rows[i] = _mm512_setzero_ps();
                else if (kChunk == 64)
                    rows[i] = _mm512_load_ps(static_cast<const float*>(src));
                else
                    rows[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(0x00ff, src));
            }
            transpose16(rows);  // rows[d]: dword d of the 16 tokens
            int8_t* dst = values_ + (b * G + c) * m_ + 4 * t0;
            for (int64_t d = 0; d < kChunk / 4; ++d)
                _mm512_mask_storeu_epi32(dst + 4 * d * m_, tokens, _mm512_castps_si512(rows[d]));
        }
    }

    int8_t* values_;
    float* scales_;
    float* sums_;  // formats with minimums: X[t * (k / G) + b] (group_minimums.hpp)
    int64_t m_, k_;
    alignas(64) int8_t block_[16][G];
};

template <Format F, int64_t G>
void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    QuadWriter<F, G> put(packed, m, k);
    quantize_tokens_avx512<G>(x, ldx, token_index, m, k, put);
}

template <Format F, int64_t G>
void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    QuadWriter<F, G> put(packed, m, i_total);
    quantize_silu_mul_avx512<G>(gate_parts, up_parts, n_parts, ld, i_begin, i_end, m, epilogue, put);
}

// ---------------------------------------------------------------------------------------
// Weights.

template <Format F>
constexpr int64_t column_bytes(int64_t c) {
    return F == Format::int8 ? c : c / 2;
}

// The flat epilogue's lane maps: a C tile of `rows` x n tokens stored at stride 4n bytes
// is rows * n int32 in a row; lane l of vector v is pair e = 16v + l, row e / n, token
// e % n (pairs past rows * n are computed and never written).
struct FlatIndex {
    int32_t row[17][16][16];
    int32_t token[17][16][16];
    constexpr FlatIndex() : row(), token() {
        for (int n = 1; n <= 16; ++n)
            for (int v = 0; v < 16; ++v)
                for (int l = 0; l < 16; ++l) {
                    row[n][v][l] = (16 * v + l) / n % 16;
                    token[n][v][l] = (16 * v + l) % n;
                }
    }
};
alignas(64) constexpr FlatIndex kFlatIndex{};

inline __m512 load_scales16(ScaleDtype type, const void* p, __mmask16 mask) {
    switch (type) {
        case ScaleDtype::fp32: return _mm512_maskz_loadu_ps(mask, p);
        case ScaleDtype::fp16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
        case ScaleDtype::bf16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
        case ScaleDtype::e8m0: {
            // e8m0_scale: the byte in the exponent field is 2^(e - 127) (0 for e = 0), halved
            // exactly, and e = 0 set to 2^-128 on its own.
            alignas(16) uint8_t part[16] = {};
            for (int i = 0; i < 16 && mask >> i & 1; ++i) part[i] = static_cast<const uint8_t*>(p)[i];
            const __m128i bytes = mask == 0xffff ? _mm_loadu_si128(static_cast<const __m128i*>(p))
                                                 : _mm_load_si128(reinterpret_cast<const __m128i*>(part));
            const __m512i e = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(bytes));
            const __m512 half = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.5f));
            const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
            return _mm512_maskz_mov_ps(mask, _mm512_mask_blend_ps(zero, half, _mm512_castsi512_ps(_mm512_set1_epi32(0x00200000))));
        }
    }
    return _mm512_setzero_ps();
}

// table[g][i] = fp32 scale of row i (rows apart by row_step bytes of scales) and group
// g0 + g, for i < rows (0 beyond) and g < n_groups: a transpose, so that one load gives the
// 16 rows' scales of a group.
void row_scale_table(ScaleDtype type, const uint8_t* first_row, int64_t row_step, int rows, int64_t g0, int n_groups,
                     float table[kChunkGroups][16]) {
    const int64_t elem = scale_dtype_bytes(type);
    const __mmask16 mask = tail_mask16(n_groups);
    __m512 v[16];
    for (int i = 0; i < 16; ++i)
        v[i] = i < rows ? load_scales16(type, first_row + i * row_step + g0 * elem, mask) : _mm512_setzero_ps();
    transpose16(v);
    for (int g = 0; g < kChunkGroups; ++g) _mm512_store_ps(table[g], v[g]);
}

// K (64 or 32) columns of a nibble-format row as int8 in the kernel's nibble order: the
// low nibbles of the K / 2 bytes (the even columns), then the high nibbles (the odd
// columns). The bytes are broadcast to both halves of a vector and the upper half shifted
// by 4, so no byte moves across lanes; then int4's (n & 15 ^ 8) - 8 sign-extends each
// nibble n, and the codebook formats look (n & 15) up.
template <Format F, int64_t K>
inline void unpack_nibbles(const uint8_t* src, int8_t* dst) {
    constexpr long long kHighHalf = 0x0004000400040004;  // 16-bit shift counts of 4
    const __m128i codebook = _mm_load_si128(reinterpret_cast<const __m128i*>(NibbleCodes<F>::kValues));
    if constexpr (K == 64) {
        const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        const __m512i shifted = _mm512_srlv_epi16(raw, _mm512_set_epi64(kHighHalf, kHighHalf, kHighHalf, kHighHalf, 0, 0, 0, 0));
        if constexpr (F == Format::int4) {
            const __m512i biased = _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi8(0x0f), _mm512_set1_epi8(8), 0x6a);
            _mm512_store_si512(dst, _mm512_sub_epi8(biased, _mm512_set1_epi8(8)));
        } else {
            const __m512i codes = _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
            _mm512_store_si512(dst, _mm512_shuffle_epi8(_mm512_broadcast_i32x4(codebook), codes));
        }
    } else {
        const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
        const __m256i shifted = _mm256_srlv_epi16(raw, _mm256_set_epi64x(kHighHalf, kHighHalf, 0, 0));
        if constexpr (F == Format::int4) {
            const __m256i biased = _mm256_ternarylogic_epi32(shifted, _mm256_set1_epi8(0x0f), _mm256_set1_epi8(8), 0x6a);
            _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_sub_epi8(biased, _mm256_set1_epi8(8)));
        } else {
            const __m256i codes = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
            _mm256_store_si256(reinterpret_cast<__m256i*>(dst),
                               _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(codebook), codes));
        }
    }
}

// A row's 64 bytes of a group of 128 columns as two K-steps of int8, each nibble q as 16q:
// the low nibbles (the even columns) shifted up and masked, the high ones (the odd
// columns) masked in place. C then holds 16 x the dot (at most 16 x 128 x 8 x 127 in
// magnitude), which the epilogue shifts back exactly.
inline void unpack_group_int4(const uint8_t* src, int8_t* even, int8_t* odd) {
    const __m512i packed = _mm512_loadu_si512(src);
    const __m512i high_nibbles = _mm512_set1_epi8(static_cast<char>(0xf0));
    _mm512_store_si512(even, _mm512_and_si512(_mm512_slli_epi16(packed, 4), high_nibbles));
    _mm512_store_si512(odd, _mm512_and_si512(packed, high_nibbles));
}

// log2 of the factor the A rows carry (unpack_group_int4), which the epilogue divides
// out of the dots.
template <Format F, int64_t G>
constexpr int dot_shift() {
    return F == Format::int4 && unpacks_whole_groups<G>() ? 4 : 0;
}

// Where one block of up to 32 rows x 32 tokens of a segment reads and writes.
struct Block {
    const uint8_t* w;           // weight row r, column 0
    int64_t w_step_bytes;       // between the block's rows
    const uint8_t* scales;      // scale row of r
    int64_t scales_step_bytes;  // between scale rows
    float* out;                 // out row r, token t0
    int64_t out_step_floats;    // between out rows
    int64_t t0;                 // first token
    TileShape shape;
};

// A thread's working memory for one matmul_segments call (28 KiB).
struct Scratch {
    alignas(64) float acc[4][256];        // fp32 sums per C tile, pairs in the flat order
    alignas(64) int32_t dots[2][4][256];  // the C tiles of a group, flat; alternate groups
    alignas(64) int8_t stage[2][32][64];  // int4 rows unpacked to int8: a group's two K-steps
    alignas(64) float sw_table[2][kChunkGroups][16];  // weight scales, [group][row] per A tile
    alignas(64) float pass_sums[kPassTiles][256];  // run_pass_resident: each token tile's sums between turns
};

// 16 dots of a stored C tile as floats, divided by 2^kShift (dot_shift: exact, the dots
// being multiples of it).
template <int kShift>
inline __m512 dots_as_floats(const int32_t* dots) {
    const __m512i d = _mm512_load_si512(dots);
    return _mm512_cvtepi32_ps(kShift ? _mm512_srai_epi32(d, kShift) : d);
}

// The epilogue of one group: acc[tile] += float(dots[tile] >> kShift) * (s_w * s_x) over
// each C tile read flat (16 (row, token) pairs a vector), sw_table[a][g] the A tile's row
// scales and xs the tokens' scales of the group from the block's first token.
template <int kShift>
inline void scale_and_add(const TileShape& shape, const float (&sw_table)[2][kChunkGroups][16], int64_t g,
                          const float* xs, const int32_t (&dots)[4][256], float (&acc)[4][256]) {
    for (int a = 0; a < 2; ++a) {
        if (!shape.rows[a]) continue;
        const float* sw_rows = sw_table[a][g];
        const __m512 sw = _mm512_load_ps(sw_rows);
        for (int tb = 0; tb < 2; ++tb) {
            const int n = shape.tokens[tb];
            if (!n) continue;
            const __m512 sx = _mm512_maskz_loadu_ps(tail_mask16(n), xs + 16 * tb);
            const int tile = 2 * a + tb, vectors = (shape.rows[a] * n + 15) / 16;
            if (n == 16) {  // vector v is row v: its weight scale broadcast, no permutes
                for (int v = 0; v < vectors; ++v) {
                    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sw_rows[v]), sx);
                    const __m512 dot = dots_as_floats<kShift>(dots[tile] + 16 * v);
                    _mm512_store_ps(acc[tile] + 16 * v,
                                    _mm512_add_ps(_mm512_load_ps(acc[tile] + 16 * v), _mm512_mul_ps(dot, scale)));
                }
                continue;
            }
            // When n divides 16 every vector holds the same tokens in the same lanes.
            const __m512 sx_lanes = _mm512_permutexvar_ps(_mm512_load_si512(kFlatIndex.token[n][0]), sx);
            const bool same_tokens = 16 % n == 0;
            for (int v = 0; v < vectors; ++v) {
                const __m512i ri = _mm512_load_si512(kFlatIndex.row[n][v]);
                const __m512 sx_v =
                    same_tokens ? sx_lanes : _mm512_permutexvar_ps(_mm512_load_si512(kFlatIndex.token[n][v]), sx);
                const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(ri, sw), sx_v);
                const __m512 dot = dots_as_floats<kShift>(dots[tile] + 16 * v);
                _mm512_store_ps(acc[tile] + 16 * v,
                                _mm512_add_ps(_mm512_load_ps(acc[tile] + 16 * v), _mm512_mul_ps(dot, scale)));
            }
        }
    }
}

// out[i * out_step + t] += sums[i * n + t] for a C tile of rows x n < 16 tokens. The sums
// were just stored as whole vectors of flat pairs, and a row of fewer than 16 lies inside
// or across two of them: a load of the row itself (masked, or straddling two stores) waits
// for those stores to reach the cache (a quarter of a 768-column matrix's time at 8
// tokens), while a load of a whole stored vector is forwarded from it. So each row is
// taken out of the (one or two) whole vectors it lies in with a two-source permute.
// Out of line, so that the kernel's loops keep their code.
__attribute__((noinline)) void add_sums(const float* sums, int rows, int n, float* out, int64_t out_step) {
    if (n == 8) {  // each row half of a stored vector: a load inside one store is forwarded too
        for (int i = 0; i < rows; ++i) {
            float* o = out + i * out_step;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_load_ps(sums + 8 * i)));
        }
        return;
    }
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < rows; ++i) {
        const int first = i * n / 16, offset = i * n % 16;
        const __m512 low = _mm512_load_ps(sums + 16 * first);
        // The second vector only where the row reaches into it (the buffer may end here).
        const __m512 high = offset + n > 16 ? _mm512_load_ps(sums + 16 * (first + 1)) : low;
        const __m512 row = _mm512_permutex2var_ps(low, _mm512_add_epi32(lanes, _mm512_set1_epi32(offset)), high);
        // The out row in pieces of 8, 4, 2 and 1 floats, each an exact-size unmasked access:
        // masked ones wait behind the masked stores to the neighbouring rows.
        float* o = out + i * out_step;
        int c = 0;
        if (n & 8) {
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm512_castps512_ps256(row)));
            c = 8;
        }
        const auto piece = [&](int at) {
            return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(at)), row));
        };
        if (n & 4) {
            _mm_storeu_ps(o + c, _mm_add_ps(_mm_loadu_ps(o + c), piece(c)));
            c += 4;
        }
        if (n & 2) {
            const __m128 sum = _mm_add_ps(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + c))), piece(c));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(o + c), _mm_castps_si128(sum));
            c += 2;
        }
        if (n & 1) _mm_store_ss(o + c, _mm_add_ss(_mm_load_ss(o + c), piece(c)));
    }
}

// The segment columns [k0, k1) (whole groups) of one block: per group, G / K tile
// products accumulated in C, then the fp32 epilogue; out += the sums at the end.
// With `prefetch` (streamed weights, matmul_segments' rule), each weight line read requests
// one line of the rows kPrefetchAheadRows ahead.
template <Format F, int64_t G>
void run_block(const Block& blk, const Weights& w, int64_t k0, int64_t k1, const int8_t* q, const float* xs, int64_t m,
               bool stream_weights, LinePrefetcher* prefetch, Scratch& scratch) {
    constexpr int64_t K = columns_per_product<G>();
    const int block_rows = blk.shape.rows[0] + blk.shape.rows[1];
    const TileShape& shape = blk.shape;
    float (&acc)[4][256] = scratch.acc;
    int8_t (&stage)[2][32][64] = scratch.stage;
    float (&sw_table)[2][kChunkGroups][16] = scratch.sw_table;
    for (int a = 0; a < 2; ++a)
        for (int tb = 0; tb < 2; ++tb)
            std::memset(acc[2 * a + tb], 0, sizeof(float) * shape.rows[a] * shape.tokens[tb]);
    const int64_t g_first = k0 / G, g_end = k1 / G;
    // A group's epilogue runs after the next group's tile work is issued, so that the vector
    // work overlaps the tile unit's (the stored C tiles alternate between two buffers).
    // (The last group of a chunk of kChunkGroups waits for none: the next table replaces its.)
    int64_t pending = -1;
    auto finish_pending = [&](int64_t g0) {
        if (pending < 0) return;
        scale_and_add<dot_shift<F, G>()>(shape, sw_table, pending - g0, xs + pending * m + blk.t0,
                                         scratch.dots[pending & 1], acc);
        pending = -1;
    };
    for (int64_t g0 = g_first; g0 < g_end; g0 += kChunkGroups) {
        const int n_groups = static_cast<int>(g_end - g0 < kChunkGroups ? g_end - g0 : kChunkGroups);
        for (int a = 0; a < 2; ++a)
            if (shape.rows[a])
                row_scale_table(w.scale_dtype, blk.scales + 16 * a * blk.scales_step_bytes, blk.scales_step_bytes,
                                shape.rows[a], g0, n_groups, sw_table[a]);
        for (int64_t g = g0; g < g0 + n_groups; ++g) {
            TILE_ZERO(kC00);
            if (shape.tokens[1]) TILE_ZERO(kC01);
            if (shape.rows[1]) TILE_ZERO(kC10);
            if (shape.rows[1] && shape.tokens[1]) TILE_ZERO(kC11);
            for (int64_t c = g * G; c < (g + 1) * G; c += K) {
                const int step = static_cast<int>((c - g * G) / K);  // the int4 rows' stage
                if constexpr (F == Format::int4 && unpacks_whole_groups<G>()) {
                    if (step == 0)
                        for (int a = 0; a < 2; ++a)
                            for (int i = 0; i < shape.rows[a]; ++i)
                                unpack_group_int4(blk.w + (16 * a + i) * blk.w_step_bytes + column_bytes<F>(c),
                                                  stage[0][16 * a + i], stage[1][16 * a + i]);
                } else if constexpr (is_nibble_format(F)) {
                    for (int a = 0; a < 2; ++a)
                        for (int i = 0; i < shape.rows[a]; ++i)
                            unpack_nibbles<F, K>(blk.w + (16 * a + i) * blk.w_step_bytes + column_bytes<F>(c),
                                           stage[0][16 * a + i]);
                }
                // Each load as late as the products allow: tiles are not renamed, so a load
                // waits for the last product that reads the tile's previous contents.
                const int8_t* bq = q + c * m + 4 * blk.t0;
                const uint8_t* a_rows = F == Format::int8 ? blk.w + c
                                                          : reinterpret_cast<const uint8_t*>(
                                                                stage[unpacks_whole_groups<G>() ? step : 0][0]);
                const int64_t a_stride = F == Format::int8 ? blk.w_step_bytes : 64;
                const bool stream_a = F == Format::int8 && stream_weights;
                if (stream_a)
                    TILE_STREAM_LOADD(kA0, a_rows, a_stride);
                else
                    TILE_LOADD(kA0, a_rows, a_stride);
                TILE_LOADD(kB0, bq, 4 * m);
                TILE_DPBSSD(kC00, kA0, kB0);
                if (shape.tokens[1]) {
                    TILE_LOADD(kB1, bq + 64, 4 * m);
                    TILE_DPBSSD(kC01, kA0, kB1);
                }
                if (shape.rows[1]) {
                    if (stream_a)
                        TILE_STREAM_LOADD(kA1, a_rows + 16 * a_stride, a_stride);
                    else
                        TILE_LOADD(kA1, a_rows + 16 * a_stride, a_stride);
                    TILE_DPBSSD(kC10, kA1, kB0);
                    if (shape.tokens[1]) TILE_DPBSSD(kC11, kA1, kB1);
                }
                // One request a line: the step reads column_bytes(K) of each row.
                if (prefetch)
                    for (int64_t i = 0; i < block_rows * column_bytes<F>(K) / 64; ++i) prefetch->next<64>();
            }
            int32_t (&dots)[4][256] = scratch.dots[g & 1];
            TILE_STORED(kC00, dots[0], 4 * shape.tokens[0]);
            if (shape.tokens[1]) TILE_STORED(kC01, dots[1], 4 * shape.tokens[1]);
            if (shape.rows[1]) {
                TILE_STORED(kC10, dots[2], 4 * shape.tokens[0]);
                if (shape.tokens[1]) TILE_STORED(kC11, dots[3], 4 * shape.tokens[1]);
            }
            finish_pending(g0);
            pending = g;
        }
        finish_pending(g0);
    }
    for (int a = 0; a < 2; ++a)
        for (int tb = 0; tb < 2; ++tb) {
            const int n = shape.tokens[tb];
            if (!n) continue;
            if (n < 16) {
                add_sums(acc[2 * a + tb], shape.rows[a], n, blk.out + 16 * a * blk.out_step_floats + 16 * tb,
                         blk.out_step_floats);
                continue;
            }
            for (int i = 0; i < shape.rows[a]; ++i) {
                float* o = blk.out + (16 * a + i) * blk.out_step_floats + 16 * tb;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_load_ps(acc[2 * a + tb] + 16 * i)));
            }
        }
}

// int8 at groups of 32 (GGUF Q8_0 imports) from kResidentMinTokens tokens: a tdpbssd
// covers one group, so every 32 columns' dots leave the tile unit to be scaled, and with
// run_block's 2 x 2 C tiles the epilogue kept the fp32 sums in memory (a load and a store
// per 16 pairs and group). Here a C tile is 16 rows x 16 tokens (fewer at the edges) whose
// sums stay in registers (16 vectors: the tile's pairs, flat) while it runs through
// kResidentGroups groups; the pass's token tiles take turns over those groups (their A
// rows and B columns then come from L1), each saving its sums once per turn. Consecutive
// groups alternate between two sets of tiles (A0 B0 C00, A1 B1 C11), and a group's dots are
// scaled kResidentDepth groups after its store is issued: tiles are not renamed, and the
// vector loads wait for the tile store. The nibble formats gained nothing from it
// (docs/kernels.md), their rows' unpacking being the larger part of their work.
constexpr int64_t kResidentMinTokens = 32;
constexpr int kResidentDepth = 2;  // groups between a tile store and its epilogue

template <Format F, int64_t G>
constexpr bool has_resident_pass() {
    return F == Format::int8 && G == 32;
}

// acc += the scaled dots of one group of a rows x n C tile, read flat (16 pairs a vector).
__attribute__((always_inline)) inline void scale_and_add_resident(int rows, int n, const float* sw_rows,
                                                                   const float* xs, const int32_t* dots,
                                                                   __m512 (&acc)[16]) {
    const __m512 sx = _mm512_maskz_loadu_ps(tail_mask16(n), xs);
    if (n == 16) {  // vector v is row v: its weight scale broadcast, no permutes
#pragma GCC unroll 16
        for (int v = 0; v < 16; ++v) {
            if (v >= rows) break;
            const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sw_rows[v]), sx);
            acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(dots_as_floats<0>(dots + 16 * v), scale));
        }
        return;
    }
    const __m512 sw = _mm512_load_ps(sw_rows);
    const int vectors = (rows * n + 15) / 16;
#pragma GCC unroll 16
    for (int v = 0; v < 16; ++v) {
        if (v >= vectors) break;
        const __m512 sx_v = _mm512_permutexvar_ps(_mm512_load_si512(kFlatIndex.token[n][v]), sx);
        const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_load_si512(kFlatIndex.row[n][v]), sw), sx_v);
        acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(dots_as_floats<0>(dots + 16 * v), scale));
    }
}

// Groups [h0, h0 + n_groups) of one token tile (B columns from bq, token scales from xs):
// per group a product and its store, and the epilogue kResidentDepth groups later.
// sw_table[g - sw_g0] holds group g's row scales.
__attribute__((always_inline)) inline void resident_groups(const Block& blk, int64_t h0, int n_groups, const int8_t* bq,
                                                           const float* xs, int64_t m, const float (*sw_table)[16],
                                                           int64_t sw_g0, Scratch& scratch, __m512 (&acc)[16]) {
    constexpr int64_t G = 32;
    const int rows = blk.shape.rows[0], n = blk.shape.tokens[0];
    const auto dots_of = [&](int64_t g) { return scratch.dots[0][g & 3]; };  // kResidentDepth + 1 <= 4 buffers
    const auto epilogue = [&](int64_t g) {
        scale_and_add_resident(rows, n, sw_table[g - sw_g0], xs + g * m, dots_of(g), acc);
    };
    for (int i = 0; i < n_groups; ++i) {
        const int64_t g = h0 + i;
        const uint8_t* a = blk.w + g * G;
        const int8_t* b = bq + g * G * m;
        int32_t* dots = dots_of(g);
// Tile registers are literal digits in the instructions' text: one expansion per set.
#define NUMA_MOE_GROUP_PRODUCT(kA, kB, kC)     \
    TILE_ZERO(kC);                             \
    TILE_LOADD(kA, a, blk.w_step_bytes);       \
    TILE_LOADD(kB, b, 4 * m);                  \
    TILE_DPBSSD(kC, kA, kB);                   \
    TILE_STORED(kC, dots, 4 * n)
        if (g & 1) {
            NUMA_MOE_GROUP_PRODUCT(kA1, kB1, kC11);
        } else {
            NUMA_MOE_GROUP_PRODUCT(kA0, kB0, kC00);
        }
#undef NUMA_MOE_GROUP_PRODUCT
        if (i >= kResidentDepth) epilogue(g - kResidentDepth);
    }
    for (int i = n_groups > kResidentDepth ? n_groups - kResidentDepth : 0; i < n_groups; ++i) epilogue(h0 + i);
}

// One pass of int8 at groups of 32: a block of rows (<= 16) x `tiles` token tiles of n
// tokens each (<= kPassTiles; n = 16 but in a pass of one tile), over the segment columns
// [k0, k1); out += the sums at the end.
void run_pass_resident(const Block& blk, int tiles, const Weights& w, int64_t k0, int64_t k1, const int8_t* q,
                       const float* xs, int64_t m, Scratch& scratch) {
    constexpr int64_t G = 32;
    const int rows = blk.shape.rows[0], n = blk.shape.tokens[0];
    float (&sw_table)[kChunkGroups][16] = scratch.sw_table[0];
    float (&sums)[kPassTiles][256] = scratch.pass_sums;
    __m512 acc[16];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int tile = 0; tile < tiles; ++tile) std::memset(sums[tile], 0, sizeof(sums[tile]));
    const int64_t g_first = k0 / G, g_end = k1 / G;
    for (int64_t g0 = g_first; g0 < g_end; g0 += kChunkGroups) {
        const int n_table = static_cast<int>(g_end - g0 < kChunkGroups ? g_end - g0 : kChunkGroups);
        row_scale_table(w.scale_dtype, blk.scales, blk.scales_step_bytes, rows, g0, n_table, sw_table);
        for (int64_t h0 = g0; h0 < g0 + n_table; h0 += kResidentGroups) {
            const int n_groups = static_cast<int>(std::min<int64_t>(g0 + n_table - h0, kResidentGroups));
            for (int tile = 0; tile < tiles; ++tile) {
                // A pass of one tile keeps its sums in registers throughout.
                if (tiles > 1)
                    for (int v = 0; v < 16; ++v) acc[v] = _mm512_load_ps(sums[tile] + 16 * v);
                resident_groups(blk, h0, n_groups, q + 4 * (blk.t0 + 16 * tile), xs + blk.t0 + 16 * tile, m,
                                sw_table, g0, scratch, acc);
                if (tiles > 1)
                    for (int v = 0; v < 16; ++v) _mm512_store_ps(sums[tile] + 16 * v, acc[v]);
            }
        }
    }
    if (tiles == 1)
        for (int v = 0; v < 16; ++v) _mm512_store_ps(sums[0] + 16 * v, acc[v]);
    for (int tile = 0; tile < tiles; ++tile) {
        float* out = blk.out + 16 * tile;
        if (n < 16) {
            add_sums(sums[tile], rows, n, out, blk.out_step_floats);
            continue;
        }
        for (int i = 0; i < rows; ++i) {
            float* o = out + i * blk.out_step_floats;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_load_ps(sums[tile] + 16 * i)));
        }
    }
}

// Each segment in row blocks of 32 (16 for unprefetched rows at <= 16 tokens) and, within
// one, token blocks of 32 (a block's weights are read once per token block: from memory
// once when m <= 32, hence tileloadt1 then). int8 at groups of 32 from kResidentMinTokens:
// row blocks of 16, each in passes over up to kPassTiles whole token tiles of 16, then one
// pass for the last m % 16 tokens (run_pass_resident).
template <Format F, int64_t G>
void matmul_segments(const Weights& w, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t k, float* out, int64_t ldo) {
    if (m <= 0) return;
    const bool resident = has_resident_pass<F, G>() && m >= kResidentMinTokens;
    const int8_t* q = static_cast<const int8_t*>(packed);
    const float* xs = token_scales(packed, m, k);
    const bool stream_weights = m <= 32 && !resident;
    const int64_t row_bytes = column_bytes<F>(w.ld);
    const int64_t scale_row_bytes = w.scales_ld * scale_dtype_bytes(w.scale_dtype);
    TileShape current{{-1, -1}, {-1, -1}, -1};  // tile state of other code on this thread is not trusted
    Scratch scratch;
    // Lanes past a tile's rows x tokens pairs are computed and dropped; zeroed once so that
    // they start from defined values.
    std::memset(scratch.dots, 0, sizeof(scratch.dots));
    std::memset(scratch.acc, 0, sizeof(scratch.acc));
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        if (seg.k1 <= seg.k0) return;  // an empty column range (valid) reads nothing
        const bool prefetch = stream_weights && column_bytes<F>(seg.k1 - seg.k0) <= kPrefetchMaxRowBytes;
        // Rows the software does not request are left to the hardware prefetchers, which
        // follow 16 rows read side by side better than 32 (at up to 16 tokens one A tile
        // per block costs no more tile loads per weight byte).
        const int64_t block_rows = resident || (!prefetch && m <= 16) ? 16 : 32;
        for (int64_t j = j_lo; j < j_hi; j += block_rows) {
            const int rows = static_cast<int>(j_hi - j < block_rows ? j_hi - j : block_rows);
            const int64_t r = seg.row0 + j * stride;
            // Rows past the thread's range are another thread's or no one's: not requested.
            const bool request_ahead = prefetch && j + kPrefetchAheadRows < j_hi;
            LinePrefetcher ahead(static_cast<const uint8_t*>(w.data) + (r + kPrefetchAheadRows * stride) * row_bytes,
                                 column_bytes<F>(seg.k0), column_bytes<F>(seg.k1), stride * row_bytes);
            const auto block_at = [&](int64_t t0, TileShape shape) {
                Block blk{static_cast<const uint8_t*>(w.data) + r * row_bytes,
                          stride * row_bytes,
                          static_cast<const uint8_t*>(w.scales) + r * scale_row_bytes,
                          stride * scale_row_bytes,
                          out + r * ldo + t0,
                          stride * ldo,
                          t0,
                          shape};
                if (!(shape == current)) {
                    configure(shape);
                    current = shape;
                }
                return blk;
            };
            LinePrefetcher* requests = request_ahead ? &ahead : nullptr;
            if (resident) {
                for (int64_t t0 = 0; t0 < m;) {
                    const int64_t whole = std::min<int64_t>((m - t0) / 16, kPassTiles);
                    const int n = whole ? 16 : static_cast<int>(m - t0);
                    // Both tile sets of run_pass_resident: A0 B0 C00 and A1 B1 C11.
                    const Block blk = block_at(t0, TileShape{{rows, rows}, {n, n}, static_cast<int>(G)});
                    run_pass_resident(blk, whole ? static_cast<int>(whole) : 1, w, seg.k0, seg.k1, q, xs, m, scratch);
                    t0 += whole ? 16 * whole : n;
                }
            } else {
                for (int64_t t0 = 0; t0 < m; t0 += 32) {
                    const int nt = static_cast<int>(m - t0 < 32 ? m - t0 : 32);
                    const Block blk = block_at(t0, TileShape{{rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 0},
                                                             {nt < 16 ? nt : 16, nt > 16 ? nt - 16 : 0},
                                                             static_cast<int>(columns_per_product<G>())});
                    run_block<F, G>(blk, w, seg.k0, seg.k1, q, xs, m, stream_weights, requests, scratch);
                }
            }
            if constexpr (has_minimums(F))
                add_block_minimums(w, seg, j, j + rows, stride, token_group_sums<G>(packed, m, k), m, k, out, ldo);
        }
    });
}

}  // namespace
}  // namespace AMX_NAMESPACE

namespace AMX_NAMESPACE {
namespace {

template <Format F, int64_t G>
const KernelOps& table() {
#ifdef NUMA_MOE_AMX_MODEL
    constexpr Isa isa = Isa::amx_model;
    constexpr const char* name = "amx_model";
#else
    constexpr Isa isa = Isa::amx;
    constexpr const char* name = "amx";
#endif
    static const KernelOps ops{isa, name, F, G, quads_layout, packed_bytes<F, G>, gather<F, G>, matmul_segments<F, G>,
                               silu_mul_pack<F, G>, combine_down_avx512, store_down_avx512};
    return ops;
}

const KernelOps* integer_ops(Format format, int64_t group) {
    return integer_table(format, group, [](auto f, auto g) -> const KernelOps& {
        return table<decltype(f)::value, decltype(g)::value>();
    });
}

}  // namespace
}  // namespace AMX_NAMESPACE

#ifdef NUMA_MOE_AMX_MODEL
const KernelOps* amx_model_integer_ops(Format format, int64_t group) { return AMX_NAMESPACE::integer_ops(format, group); }
#else
const KernelOps* amx_integer_ops(Format format, int64_t group) { return AMX_NAMESPACE::integer_ops(format, group); }
#endif

}  // namespace numa_moe::kernels
