// llama.cpp's blocks of weights that load without loss into the store's layouts
// (docs/checkpoints.md, docs/quantization.md), converted in one pass over the file's bytes.
//
// Layouts:
//   raw     rows x (cols / 32) blocks, row after row. Q8_0: fp16 d, 32 int8 q (w = d q).
//           Q4_0 / IQ4_NL: fp16 d, 16 code bytes, byte j holding weight j in its low nibble
//           and weight j + 16 in its high one (Q4_0: q + 8; IQ4_NL: a codebook index).
//           MXFP4: the e8m0 scale byte, then 16 e2m1 code bytes in Q4_0's order.
//           Q5_0: fp16 d, a little-endian uint32 whose bit j is weight j's fifth bit, 16
//           bytes of the low four bits in Q4_0's order (w = d (q - 16)).
//           IQ4_XS, per 256 weights: fp16 d, a uint16 of the 8 sub-blocks' high scale bits
//           (2 each), 4 bytes of their low ones (4 each, sub-block 2i in byte i's low
//           nibble), 8 x 16 IQ4_NL code bytes; sub-block i has the scale d * (ls_i - 32).
//           Q4_1: fp16 d, fp16 m, 16 code bytes in Q4_0's order (w = d q + m).
//           Q4_K, per 256 weights (the K-quant layout below): sub-block j of 32 has the
//           scale d * sc_j and the minimum -(dmin * m_j), both exact in fp32 (11 x 6
//           significant bits); its weight i is nibble j % 2 of code byte 32 (j / 2) + i.
//   values  Q8_0 and Q5_0 int8 [rows, cols]; the others two codes a byte [rows, cols / 2], column 2i
//           in byte i's low nibble (Q4_0 as two's complement int4, Q4_1 / Q4_K unsigned);
//           rows values_ld bytes apart
//   scales  [rows, cols / 32]: fp16 bits (MXFP4: e8m0 bytes; IQ4_XS: fp32 d * (ls - 32),
//           exact: 11 x 6 significant bits); Q4_1 (fp16) and Q4_K (fp32) [rows, 2 cols /
//           32], each row's scales, then its minimums (int4_affine); rows scales_ld bytes
//           apart
#pragma once

#include <cstdint>

#include "formats/group_quant.hpp"

namespace numa_moe::formats {

enum class GgmlBlocks { q8_0, q4_0, iq4_nl, mxfp4, iq4_xs, q5_0, q4_1, q4_k };

// Whether a type's scales come with minimums (Q4_1, Q4_K: the scales tensor is twice as wide).
constexpr bool ggml_has_minimums(GgmlBlocks type) { return type == GgmlBlocks::q4_1 || type == GgmlBlocks::q4_k; }

// Weights of one block (32; IQ4_XS and Q4_K 256), and its bytes.
int64_t ggml_block_weights(GgmlBlocks type);
int64_t ggml_block_bytes(GgmlBlocks type);

// Bytes of one converted scale or minimum (fp16 2, e8m0 1, IQ4_XS's and Q4_K's fp32 4).
int64_t ggml_scale_bytes(GgmlBlocks type);

// raw -> values and scales. A block whose fp16 scale is +-0 holds zeros: Q8_0, Q5_0 and Q4_0,
// whose formats refuse zero scales, store it as zeros under the scale +-1 (the same
// weights); IQ4_NL, IQ4_XS, Q4_1 and Q4_K keep zero scales (a codebook without zero; a
// block of equal weights). Throws std::invalid_argument naming the row and block of the
// first NaN or infinite fp16 scale (Q4_1 / Q4_K: d, m, dmin), e8m0 scale 0xFF (NaN) or
// Q8_0 q = -128 (outside the symmetric int8 the kernels take); the outputs are then partly
// written. cols must be a multiple of the block.
void convert_ggml_blocks(GgmlBlocks type, const uint8_t* raw, int64_t rows, int64_t cols, uint8_t* values,
                         int64_t values_ld, uint8_t* scales, int64_t scales_ld);

// llama.cpp's K-quants: super-blocks of 256 weights under fp16 scales, 6- or 4-bit scales
// (and minima) per sub-block of 16 or 32. They load through float32 (their sub-block
// structure is not one of the store's formats):
//   Q2_K  16 scale bytes (sub-block k of 16: scale low nibble, minimum high), 64 bytes of
//         2-bit q, fp16 d, fp16 dmin: w = (d sc) q - (dmin m)
//   Q3_K  32 bytes of high bits, 64 of 2-bit q, 12 bytes of 6-bit scales, fp16 d:
//         w = (d (sc - 32)) (q - 4 (1 - high bit))
//   Q4_K  fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minima per sub-block of 32, 128
//         bytes of 4-bit q: w = (d sc) q - (dmin m)
//   Q5_K  as Q4_K with 32 bytes of fifth bits before the 4-bit q
//   Q6_K  128 bytes of low 4 bits, 64 of high 2, 16 int8 scales per 16, fp16 d:
//         w = (d sc) (q - 32)
// The bits of each q as gguf-py's dequantize_blocks reads them (docs/checkpoints.md).
enum class GgmlKQuant { q2_k, q3_k, q4_k, q5_k, q6_k };

constexpr int64_t kGgmlSuperBlock = 256;  // weights of a K-quant block
int64_t ggml_k_block_bytes(GgmlKQuant type);

// raw (rows x cols / 256 blocks) -> out float32 [rows, cols], rows out_ld floats apart:
// float32 arithmetic in the gguf package's order (each product and difference rounded),
// so the result equals gguf.quants.dequantize's bit for bit. Throws std::invalid_argument
// naming the row and block of the first NaN or infinite d or dmin (out partly written).
void dequantize_ggml_k_blocks(GgmlKQuant type, const uint8_t* raw, int64_t rows, int64_t cols, float* out,
                              int64_t out_ld);

// One row of that: raw_row its cols / 256 blocks, `row` its index (for errors), out cols
// floats. cols a multiple of 256, unchecked.
void dequantize_ggml_k_row(GgmlKQuant type, const uint8_t* raw_row, int64_t row, int64_t cols, float* out);

// raw dequantized as above and quantized into the target (group_quant.hpp) a row at a time
// through one float32 row: the bytes of dequantize_ggml_k_blocks then quantize_groups,
// without a float32 copy of the matrix (whose page faults cost more than both
// conversions). Throws as either does (outputs partly written).
void requantize_ggml_k_blocks(GgmlKQuant type, const uint8_t* raw, int64_t rows, int64_t cols,
                              const GroupTarget& to);

}  // namespace numa_moe::formats
