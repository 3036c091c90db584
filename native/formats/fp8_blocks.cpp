// FP8 block dequantization (fp8_blocks.hpp): each byte decoded by a 256-entry table (every
// e4m3fn value is exact in fp32), times its block's scale; a row at a time.
#include "formats/fp8_blocks.hpp"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/fp16.hpp"

namespace numa_moe::formats {
namespace {

constexpr uint8_t kNanMagnitude = 0x7f;

struct E4m3Table {
    float value[256];
    E4m3Table() {
        for (int byte = 0; byte < 256; ++byte) {
            const int exponent = byte >> 3 & 0x0f, mantissa = byte & 7;
            const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                                  : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
            value[byte] = (byte & kNanMagnitude) == kNanMagnitude ? NAN : byte & 0x80 ? -magnitude : magnitude;
        }
    }
};

const E4m3Table& e4m3() {
    static const E4m3Table table;
    return table;
}

// Row r's products into `row` (cols floats).
void dequantize_row(const uint8_t* w, int64_t r, int64_t cols, const float* scales, int64_t block_rows,
                    int64_t block_cols, float* row) {
    const float* value = e4m3().value;
    const uint8_t* bytes = w + r * cols;
    const float* scale_row = scales + (r / block_rows) * ((cols + block_cols - 1) / block_cols);
    bool nan = false;
    for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
        const int64_t c1 = c0 + block_cols < cols ? c0 + block_cols : cols;
        const float scale = scale_row[b];
        for (int64_t c = c0; c < c1; ++c) {
            nan |= (bytes[c] & kNanMagnitude) == kNanMagnitude;
            row[c] = value[bytes[c]] * scale;
        }
    }
    if (nan)
        for (int64_t c = 0; c < cols; ++c)
            if ((bytes[c] & kNanMagnitude) == kNanMagnitude)
                throw std::invalid_argument("a NaN weight (byte 0x" + std::string(bytes[c] & 0x80 ? "FF" : "7F") +
                                            ") (row " + std::to_string(r) + ", column " + std::to_string(c) + ")");
}

void check_blocks(int64_t block_rows, int64_t block_cols) {
    if (block_rows < 1 || block_cols < 1)
        throw std::invalid_argument("block " + std::to_string(block_rows) + " x " + std::to_string(block_cols) +
                                    ": both sides must be positive");
}

}  // namespace

void dequantize_fp8_blocks(const uint8_t* w, int64_t rows, int64_t cols, const float* scales, int64_t block_rows,
                           int64_t block_cols, float* out, int64_t out_ld) {
    check_blocks(block_rows, block_cols);
    for (int64_t r = 0; r < rows; ++r) dequantize_row(w, r, cols, scales, block_rows, block_cols, out + r * out_ld);
}

void requantize_fp8_blocks(const uint8_t* w, int64_t rows, int64_t cols, const float* scales, int64_t block_rows,
                           int64_t block_cols, const GroupTarget& to) {
    check_blocks(block_rows, block_cols);
    check_group_target(cols, to);
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(w, r, cols, scales, block_rows, block_cols, row.data());
        quantize_group_row(row.data(), r, cols, to);
    }
}

void dequantize_fp8_blocks_bf16(const uint8_t* w, int64_t rows, int64_t cols, const float* scales,
                                int64_t block_rows, int64_t block_cols, uint16_t* out, int64_t out_ld) {
    check_blocks(block_rows, block_cols);
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(w, r, cols, scales, block_rows, block_cols, row.data());
        uint16_t* dst = out + r * out_ld;
        for (int64_t c = 0; c < cols; ++c) dst[c] = float_to_bf16(row[c]);
    }
}

}  // namespace numa_moe::formats
