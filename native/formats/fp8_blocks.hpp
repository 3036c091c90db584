// FP8 e4m3fn weights under fp32 block scales (DeepSeek-V3 / Kimi-K2 safetensors:
// `weight_scale_inv`), dequantized as torch's w.to(float32) * scale does.
//
// Layouts:
//   w       e4m3fn bytes [rows, cols] (sign, 4 exponent bits of bias 7, 3 mantissa bits;
//           0x7F / 0xFF NaN, no infinity), row-major
//   scales  fp32 [ceil(rows / block_rows), ceil(cols / block_cols)], row-major
//   out     fp32, or bf16 bits rounded to nearest even, [rows, cols]; rows out_ld elements
//           apart
#pragma once

#include <cstdint>

#include "formats/group_quant.hpp"

namespace numa_moe::formats {

// out[r][c] = e4m3(w[r][c]) * scales[r / block_rows][c / block_cols], one fp32 product.
// Throws std::invalid_argument naming the row and column of the first NaN byte (out
// then partly written).
void dequantize_fp8_blocks(const uint8_t* w, int64_t rows, int64_t cols, const float* scales, int64_t block_rows,
                           int64_t block_cols, float* out, int64_t out_ld);

// The same products rounded to bf16 (as .to(torch.bfloat16)).
void dequantize_fp8_blocks_bf16(const uint8_t* w, int64_t rows, int64_t cols, const float* scales,
                                int64_t block_rows, int64_t block_cols, uint16_t* out, int64_t out_ld);

// The same products quantized into the target (group_quant.hpp) a row at a time through
// one float32 row: the bytes of dequantize_fp8_blocks then quantize_groups, without a
// float32 copy of the matrix. Throws as either does (outputs partly written).
void requantize_fp8_blocks(const uint8_t* w, int64_t rows, int64_t cols, const float* scales, int64_t block_rows,
                           int64_t block_cols, const GroupTarget& to);

}  // namespace numa_moe::formats
