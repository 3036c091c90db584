// Group quantization of float32 rows (group_quant.hpp): one pass per group, its largest
// magnitude, then its values, 4 at a time in SSE2 (baseline x86-64); one matrix a thread.
#include "formats/group_quant.hpp"

#include <emmintrin.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/fp16.hpp"

namespace numa_moe::formats {
namespace {

[[noreturn]] void refuse(const std::string& what, int64_t row, const char* unit, int64_t index) {
    throw std::invalid_argument(what + " (row " + std::to_string(row) + ", " + unit + " " + std::to_string(index) + ")");
}

// The group's scale as stored (its bits at out) and as the fp32 the values divide by.
float store_scale(float amax, float q_max, GroupScales type, uint8_t* out, int64_t row, int64_t group) {
    const float wanted = amax / q_max;
    float stored = wanted;
    uint16_t bits = 0;
    switch (type) {
        case GroupScales::fp16:
            bits = float_to_fp16(wanted);
            stored = fp16_to_float(bits);
            break;
        case GroupScales::bf16:
            bits = float_to_bf16(wanted);
            stored = bf16_to_float(bits);
            break;
        case GroupScales::fp32: break;
    }
    if (std::isinf(stored))
        refuse("the group's largest magnitude " + std::to_string(amax) + " needs a scale beyond its dtype's range", row,
               "group", group);
    if (stored == 0.0f) {
        stored = 1.0f;  // an all-zero (or underflowing) group: its values round to 0 anyway
        bits = type == GroupScales::fp16 ? 0x3c00 : 0x3f80;
    }
    if (type == GroupScales::fp32)
        std::memcpy(out, &stored, sizeof(stored));
    else
        std::memcpy(out, &bits, sizeof(bits));
    return stored;
}

// The largest |x| of n (a multiple of 4) floats; infinite or NaN where one of them is
// (compared as the bits of |x|, which order NaN above infinity above every finite value).
float largest_magnitude(const float* x, int64_t n) {
    const __m128i magnitude_bits = _mm_set1_epi32(0x7fffffff);
    __m128i top = _mm_setzero_si128();
    for (int64_t c = 0; c < n; c += 4) {
        const __m128i bits = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c)), magnitude_bits);
        const __m128i greater = _mm_cmpgt_epi32(bits, top);  // both below 2^31: signed compare
        top = _mm_or_si128(_mm_and_si128(greater, bits), _mm_andnot_si128(greater, top));
    }
    alignas(16) int32_t lanes[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), top);
    int32_t best = lanes[0];
    for (int i = 1; i < 4; ++i) best = lanes[i] > best ? lanes[i] : best;
    float value;
    std::memcpy(&value, &best, sizeof(value));
    return value;
}

// 4 weights x / scale rounded to nearest, ties to even (cvtps2dq under the default
// rounding mode), within [q_min, q_max] (clipped first, as floats: the same integers).
inline __m128i round_four(const float* x, __m128 scale, __m128 q_min, __m128 q_max) {
    const __m128 v = _mm_div_ps(_mm_loadu_ps(x), scale);
    return _mm_cvtps_epi32(_mm_min_ps(_mm_max_ps(v, q_min), q_max));
}

// 16 weights x / scale as int8 bytes, within [q_min, q_max].
inline __m128i round_sixteen(const float* x, float scale, float q_min, float q_max) {
    const __m128 s = _mm_set1_ps(scale), lo = _mm_set1_ps(q_min), hi = _mm_set1_ps(q_max);
    const __m128i a = _mm_packs_epi32(round_four(x, s, lo, hi), round_four(x + 4, s, lo, hi));
    const __m128i b = _mm_packs_epi32(round_four(x + 8, s, lo, hi), round_four(x + 12, s, lo, hi));
    return _mm_packs_epi16(a, b);
}

// 8 weights x / scale as 16-bit integers, within [q_min, q_max].
inline __m128i round_eight(const float* x, float scale, float q_min, float q_max) {
    const __m128 s = _mm_set1_ps(scale), lo = _mm_set1_ps(q_min), hi = _mm_set1_ps(q_max);
    return _mm_packs_epi32(round_four(x, s, lo, hi), round_four(x + 4, s, lo, hi));
}

// 8 int4 values in 16-bit lanes as 4 bytes of two nibbles (column 2i in the low one).
inline void store_int4(__m128i words, uint8_t* out) {
    // word 2i + 1 shifted into the high nibble of word 2i's byte: (even & 15) | odd << 4
    const __m128i low = _mm_and_si128(words, _mm_set1_epi32(0x0000000f));
    const __m128i high = _mm_and_si128(_mm_srli_epi32(words, 12), _mm_set1_epi32(0x000000f0));
    const __m128i bytes = _mm_or_si128(low, high);  // one byte per dword
    const __m128i packed = _mm_packus_epi16(_mm_packs_epi32(bytes, bytes), _mm_setzero_si128());
    const int32_t four = _mm_cvtsi128_si32(packed);
    std::memcpy(out, &four, sizeof(four));
}

}  // namespace

int64_t group_scale_bytes(GroupScales type) { return type == GroupScales::fp32 ? 4 : 2; }

void check_group_target(int64_t cols, const GroupTarget& to) {
    if (to.group <= 0 || to.group % 16 || cols <= 0 || cols % to.group)
        throw std::invalid_argument("cols=" + std::to_string(cols) + " is not a positive multiple of the group " +
                                    std::to_string(to.group) + " (a multiple of 16)");
}

void quantize_group_row(const float* x_row, int64_t row, int64_t cols, const GroupTarget& to) {
    const bool int4 = to.ints == GroupInts::int4;
    const float q_max = int4 ? 7.0f : 127.0f, q_min = int4 ? -8.0f : -127.0f;
    const int64_t group = to.group, scale_bytes = group_scale_bytes(to.scale_type);
    uint8_t* values = to.values + row * to.values_ld;
    uint8_t* scales = to.scales + row * to.scales_ld;
    for (int64_t g = 0; g < cols / group; ++g) {
        const float* x = x_row + g * group;
        const float amax = largest_magnitude(x, group);
        if (!std::isfinite(amax))
            for (int64_t c = 0; c < group; ++c)
                if (!std::isfinite(x[c])) refuse("the weight holds NaN or infinity", row, "column", g * group + c);
        const float scale = store_scale(amax, q_max, to.scale_type, scales + g * scale_bytes, row, g);
        if (int4)
            for (int64_t c = 0; c < group; c += 8)
                store_int4(round_eight(x + c, scale, q_min, q_max), values + (g * group + c) / 2);
        else
            for (int64_t c = 0; c < group; c += 16)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(values + g * group + c),
                                 round_sixteen(x + c, scale, q_min, q_max));
    }
}

void quantize_groups(const float* w, int64_t w_ld, int64_t rows, int64_t cols, const GroupTarget& to) {
    check_group_target(cols, to);
    for (int64_t r = 0; r < rows; ++r) quantize_group_row(w + r * w_ld, r, cols, to);
}

}  // namespace numa_moe::formats
