// float32 weights into the store's int8 / int4 groups by numa_moe.quant.quantize's rule
// (docs/quantization.md): per row and group of G columns the scale is the group's largest
// magnitude over 127 (int4: 7) in fp32, rounded to the scale dtype (to nearest, ties to
// even), 1 where that is 0; each value the nearest integer of w / scale (ties to even),
// clipped to [-127, 127] (int4: [-8, 7]).
//
// Layouts:
//   w       fp32 [rows, cols], rows w_ld floats apart
//   values  int8 [rows, cols]; int4 two a byte [rows, cols / 2], column 2i in byte i's low
//           nibble (two's complement); rows values_ld bytes apart
//   scales  [rows, cols / G] of fp16 / bf16 bits or fp32; rows scales_ld bytes apart
#pragma once

#include <cstdint>

namespace numa_moe::formats {

enum class GroupInts { int8, int4 };
enum class GroupScales { fp16, bf16, fp32 };

// Throws std::invalid_argument naming the row and column of the first NaN or infinite
// weight, or the row and group of a scale beyond its dtype's range (fp16 from 65520, a
// largest magnitude from about 8.3e6 for int8); the outputs are then partly written.
// cols must be a multiple of group.
void quantize_groups(const float* w, int64_t w_ld, int64_t rows, int64_t cols, GroupInts ints, int64_t group,
                     GroupScales scale_type, uint8_t* values, int64_t values_ld, uint8_t* scales,
                     int64_t scales_ld);

int64_t group_scale_bytes(GroupScales type);

}  // namespace numa_moe::formats
