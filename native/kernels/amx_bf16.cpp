// AMX-BF16 kernels with row-major weights. This one source is compiled twice:
//   - for real (-mamx-tile -mamx-bf16 + AVX-512 flags): Isa::amx, handed out only when
//     cpuid has AMX and Linux granted the tile state (request_amx_permission);
//   - with -DNUMA_MOE_AMX_MODEL against amx_model.hpp: Isa::amx_model, the same kernel
//     logic over emulated tiles, run by the tests on CPUs with AVX-512 but no AMX.
//
// Operand layouts (tdpbf16ps C[m][n] += sum_k A[m][k] * B[k/2][2n + k%2]):
//   A  weights  w[r * ldw + c] row-major, straight from the checkpoint: a tile is 16 rows of
//               one segment (r = row0 + j * row_stride) x 32 bf16, loaded with tileloadd at
//               stride row_stride * ldw * 2 bytes (tileloadt1 when m <= 32: streamed once)
//   B  tokens   pair-interleaved packed[(c / 2) * 2m + 2t + c % 2] (gather and silu_mul_pack
//               write it), a tile is 16 pair rows x min(tokens, 16) tokens, stride 4m bytes
//   C  partials out[r * ldo + t] fp32, loaded from and stored back to `out` (so += is
//               exact), stride row_stride * ldo * 4 bytes
// Tile rule: k_r = 32 bf16 per step; rows and tokens in blocks of 32 as 2 x 2 C tiles
// (tmm0..3), A in tmm4/5, B in tmm6/7; a block with fewer than 16 rows or tokens gets
// a smaller tile configuration, so AMX runs down to a single token. k tails of fewer than
// 32 columns run as a second pass with a narrower A / shorter B configuration; a column
// left over from an odd k0 or k1 (a pair split by a segment edge) is added in scalar code.
#include <cstdint>
#include <cstring>

#include "common/cpu_features.hpp"
#include "kernels/avx512_common.hpp"
#include "kernels/bf16.hpp"
#include "kernels/isa_tables.hpp"

#include "kernels/amx_tiles.hpp"
#ifdef NUMA_MOE_AMX_MODEL
#define AMX_NAMESPACE amx_model_build
#else
#define AMX_NAMESPACE amx_real_build
#endif

namespace numa_moe::kernels {
namespace AMX_NAMESPACE {
namespace {

using amx_tiles::TileConfig;

struct BlockShape {
    int rows0, rows1;  // weight rows in A0 / A1 (rows1 may be 0)
    int n0, n1;        // tokens in B0 / B1 (n1 may be 0)
    int pairs;         // bf16 pairs per k step (16 = k_r 32, fewer for the k tail)
    bool operator==(const BlockShape& o) const {
        return rows0 == o.rows0 && rows1 == o.rows1 && n0 == o.n0 && n1 == o.n1 && pairs == o.pairs;
    }
};

void configure(const BlockShape& shape) {
    const int rows[2] = {shape.rows0, shape.rows1}, tokens[2] = {shape.n0, shape.n1};
    const TileConfig cfg = amx_tiles::block_config(rows, tokens, 4 * shape.pairs, shape.pairs);
    TILE_LOADCONFIG(&cfg);
}

size_t packed_bytes(int64_t m, int64_t k) { return static_cast<size_t>(packed_elements(pairs_layout(m), m, k)) * sizeof(bf16); }

// The pair layout {2, 1} (kernel_api.hpp): a transpose of 32-bit pairs.
void gather(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k, void* packed) {
    gather_pairs_avx512(x, ldx, token_index, m, k, 1, packed);
}

// out[r][t] += w[r][c] * tokens[t][c] for one column c (a pair split by a segment edge).
void add_single_column(const bf16* w, int64_t ldw, const Segment& seg, int64_t j_lo, int64_t j_hi, const bf16* tokens,
                       int64_t m, int64_t c, float* out, int64_t ldo) {
    const bf16* column = tokens + (c / 2) * 2 * m + (c % 2);
    for (int64_t j = j_lo; j < j_hi; ++j) {
        const int64_t r = seg.row0 + j * (seg.row_stride > 0 ? seg.row_stride : 1);
        const float wv = bf16_to_float(w[r * ldw + c]);
        for (int64_t t = 0; t < m; ++t) out[r * ldo + t] += wv * bf16_to_float(column[2 * t]);
    }
}

// One block of up to 32 rows x 32 tokens over the pair range [p0, p1) in steps of
// shape.pairs: C loaded from out, accumulated, stored back.
void run_block(const BlockShape& shape, const bf16* w_block, int64_t w_stride_bytes, int64_t w_tile1_offset,
               const bf16* b_block, int64_t b_stride_bytes, int64_t p0, int64_t p1, int64_t m, float* c_block,
               int64_t c_stride_bytes, int64_t c_tile1_offset, bool stream_weights) {
    const bool two_rows = shape.rows1 > 0, two_tokens = shape.n1 > 0;
    TILE_LOADD(kC00, c_block, c_stride_bytes);
    if (two_tokens) TILE_LOADD(kC01, c_block + 16, c_stride_bytes);
    if (two_rows) TILE_LOADD(kC10, c_block + c_tile1_offset, c_stride_bytes);
    if (two_rows && two_tokens) TILE_LOADD(kC11, c_block + c_tile1_offset + 16, c_stride_bytes);
    for (int64_t p = p0; p < p1; p += shape.pairs) {
        const bf16* a = w_block + 2 * p;
        const bf16* b = b_block + p * 2 * m;
        if (stream_weights) {
            TILE_STREAM_LOADD(kA0, a, w_stride_bytes);
            if (two_rows) TILE_STREAM_LOADD(kA1, a + w_tile1_offset, w_stride_bytes);
        } else {
            TILE_LOADD(kA0, a, w_stride_bytes);
            if (two_rows) TILE_LOADD(kA1, a + w_tile1_offset, w_stride_bytes);
        }
        TILE_LOADD(kB0, b, b_stride_bytes);
        TILE_DPBF16PS(kC00, kA0, kB0);
        if (two_rows) TILE_DPBF16PS(kC10, kA1, kB0);
        if (two_tokens) {
            TILE_LOADD(kB1, b + 32, b_stride_bytes);
            TILE_DPBF16PS(kC01, kA0, kB1);
            if (two_rows) TILE_DPBF16PS(kC11, kA1, kB1);
        }
    }
    TILE_STORED(kC00, c_block, c_stride_bytes);
    if (two_tokens) TILE_STORED(kC01, c_block + 16, c_stride_bytes);
    if (two_rows) TILE_STORED(kC10, c_block + c_tile1_offset, c_stride_bytes);
    if (two_rows && two_tokens) TILE_STORED(kC11, c_block + c_tile1_offset + 16, c_stride_bytes);
}

void matmul_segments(const Weights& weights, const Segment* segments, int64_t n_segments, int64_t row_begin,
                     int64_t row_end, const void* packed, int64_t m, int64_t /*k*/, float* out, int64_t ldo) {
    const bf16* w = static_cast<const bf16*>(weights.data);
    const int64_t ldw = weights.ld;
    const bf16* tokens = static_cast<const bf16*>(packed);
    if (m <= 0) return;
    const bool stream_weights = m <= 32;  // each weight byte is used by one token block only
    BlockShape current{-1, -1, -1, -1, -1};  // tile state of other code on this thread is not trusted
    for_each_segment_rows(segments, n_segments, row_begin, row_end, [&](const Segment& seg, int64_t j_lo, int64_t j_hi,
                                                                      int64_t stride) {
        int64_t c0 = seg.k0, c1 = seg.k1;
        if (c0 % 2) add_single_column(w, ldw, seg, j_lo, j_hi, tokens, m, c0++, out, ldo);
        if (c1 > c0 && c1 % 2) add_single_column(w, ldw, seg, j_lo, j_hi, tokens, m, --c1, out, ldo);
        if (c1 <= c0) return;
        const int64_t p0 = c0 / 2, p1 = c1 / 2;
        const int64_t p_main_end = p0 + (p1 - p0) / 16 * 16;
        const int64_t w_stride_bytes = stride * ldw * 2, c_stride_bytes = stride * ldo * 4;
        for (int64_t j = j_lo; j < j_hi; j += 32) {
            const int64_t rows = j_hi - j < 32 ? j_hi - j : 32;
            const int64_t r = seg.row0 + j * stride;
            const bf16* w_block = w + r * ldw;
            for (int64_t t0 = 0; t0 < m; t0 += 32) {
                const int64_t nt = m - t0 < 32 ? m - t0 : 32;
                BlockShape shape{static_cast<int>(rows < 16 ? rows : 16), static_cast<int>(rows > 16 ? rows - 16 : 0),
                                 static_cast<int>(nt < 16 ? nt : 16), static_cast<int>(nt > 16 ? nt - 16 : 0), 16};
                float* c_block = out + r * ldo + t0;
                const bf16* b_block = tokens + 2 * t0;
                for (int pass = 0; pass < 2; ++pass) {
                    const int64_t pa = pass == 0 ? p0 : p_main_end, pb = pass == 0 ? p_main_end : p1;
                    if (pb <= pa) continue;
                    shape.pairs = static_cast<int>(pass == 0 ? 16 : pb - pa);
                    if (!(shape == current)) {
                        configure(shape);
                        current = shape;
                    }
                    run_block(shape, w_block, w_stride_bytes, 16 * stride * ldw, b_block, 4 * m, pa, pb, m, c_block,
                              c_stride_bytes, 16 * stride * ldo, stream_weights);
                }
            }
        }
    });
}

void silu_mul_pack(const float* const* gate_parts, const float* const* up_parts, int n_parts, int64_t ld,
                   int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total, const ExpertEpilogue& epilogue,
                   void* packed) {
    silu_mul_pack_avx512(pairs_layout(m), gate_parts, up_parts, n_parts, ld, i_begin, i_end, m, i_total, epilogue,
                         packed);
}

}  // namespace
}  // namespace AMX_NAMESPACE

#ifdef NUMA_MOE_AMX_MODEL
const KernelOps& amx_model_ops() {
    static const KernelOps ops{Isa::amx_model,          "amx_model", Format::bf16, 0, pairs_layout, AMX_NAMESPACE::packed_bytes,
                               AMX_NAMESPACE::gather,   AMX_NAMESPACE::matmul_segments, AMX_NAMESPACE::silu_mul_pack,
                               combine_down_avx512,     store_down_avx512};
    return ops;
}
#else
const KernelOps& amx_ops() {
    static const KernelOps ops{Isa::amx,                "amx", Format::bf16, 0, pairs_layout, AMX_NAMESPACE::packed_bytes,
                               AMX_NAMESPACE::gather,   AMX_NAMESPACE::matmul_segments, AMX_NAMESPACE::silu_mul_pack,
                               combine_down_avx512,     store_down_avx512};
    return ops;
}
#endif

}  // namespace numa_moe::kernels
