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

// Where converted rows go: values and scales as above, in groups of `group` columns.
struct GroupTarget {
    GroupInts ints;
    int64_t group;
    GroupScales scale_type;
    uint8_t* values;
    int64_t values_ld;
    uint8_t* scales;
    int64_t scales_ld;
};

// Throws std::invalid_argument unless cols is a positive multiple of the target's group
// and the group a positive multiple of 16.
void check_group_target(int64_t cols, const GroupTarget& to);

// Row `row` of the target from x (cols floats); `row` also names it in errors. Throws
// std::invalid_argument naming the row and column of the first NaN or infinite weight, or
// the row and group of a scale beyond its dtype's range (fp16 from 65520, a largest
// magnitude from about 8.3e6 for int8); the row is then partly written. The caller has
// checked the target (check_group_target).
void quantize_group_row(const float* x, int64_t row, int64_t cols, const GroupTarget& to);

// Every row of w (rows floats w_ld apart) into the target, as quantize_group_row.
void quantize_groups(const float* w, int64_t w_ld, int64_t rows, int64_t cols, const GroupTarget& to);

int64_t group_scale_bytes(GroupScales type);

}  // namespace numa_moe::formats
