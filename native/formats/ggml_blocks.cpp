// One pass over a matrix of ggml blocks (ggml_blocks.hpp): per block the scale checked and
// copied, the codes copied or re-paired. Plain loops the compiler vectorizes; the loader
// runs one matrix a thread.
#include "formats/ggml_blocks.hpp"

#include "common/fp16.hpp"

#include <emmintrin.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace numa_moe::formats {
namespace {

constexpr int64_t kBlock = 32;
constexpr uint16_t kFp16ExponentMask = 0x7c00, kFp16SignMask = 0x8000, kFp16One = 0x3c00;
constexpr uint8_t kE8m0Nan = 0xff;

[[noreturn]] void refuse(int64_t row, int64_t block, const std::string& what) {
    throw std::invalid_argument(what + " (row " + std::to_string(row) + ", block " + std::to_string(block) + ")");
}

uint16_t fp16_at(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }

// A block's fp16 scale, checked; zero scales of the formats that refuse them become +-1
// (the caller then writes the block's codes as zeros).
uint16_t checked_scale(uint16_t d, bool keeps_zero, int64_t row, int64_t block, bool* zero_block) {
    if ((d & kFp16ExponentMask) == kFp16ExponentMask) refuse(row, block, "a NaN or infinite block scale");
    *zero_block = !keeps_zero && (d & ~kFp16SignMask) == 0;
    return *zero_block ? static_cast<uint16_t>((d & kFp16SignMask) | kFp16One) : d;
}

// ggml's 16 code bytes (weight j low in byte j, weight j + 16 high) as the store pairs
// them: byte i holds weights 2i (low) and 2i + 1 (high), each nibble xor-ed with flip.
// Taken as 8 words w = codes[2i] | codes[2i + 1] << 8, whose low bytes become
//     out[i]     = (w & 0x0f) | (w >> 4 & 0xf0)       the low nibbles
//     out[8 + i] = (w >> 4 & 0x0f) | (w >> 8 & 0xf0)  the high ones
// and SSE2 (the baseline) does the 8 words at once.
inline void pair_nibbles(const uint8_t* codes, uint8_t* out, uint8_t flip) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i low_mask = _mm_set1_epi16(0x0f), high_mask = _mm_set1_epi16(0xf0);
    const __m128i w4 = _mm_srli_epi16(w, 4);
    const __m128i lows = _mm_or_si128(_mm_and_si128(w, low_mask), _mm_and_si128(w4, high_mask));
    const __m128i highs = _mm_or_si128(_mm_and_si128(w4, low_mask), _mm_and_si128(_mm_srli_epi16(w, 8), high_mask));
    const __m128i paired = _mm_xor_si128(_mm_packus_epi16(lows, highs), _mm_set1_epi8(static_cast<char>(flip)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), paired);
}

// Whether 32 int8 codes hold -128 (byte 0x80): a word has a byte 0x80 where its xor with
// 0x80 bytes has a zero byte, which (v - 0x01..) & ~v & 0x80.. tells without false positives
// for the word as a whole.
bool holds_minus_128(const uint8_t* codes) {
    constexpr uint64_t kOnes = 0x0101010101010101ull, kHighs = 0x8080808080808080ull;
    uint64_t found = 0;
    for (int i = 0; i < 4; ++i) {
        uint64_t word;
        std::memcpy(&word, codes + 8 * i, sizeof(word));
        word ^= kHighs;
        found |= (word - kOnes) & ~word & kHighs;
    }
    return found != 0;
}

void store_fp16(uint8_t* p, uint16_t v) {
    p[0] = static_cast<uint8_t>(v);
    p[1] = static_cast<uint8_t>(v >> 8);
}

// Q4_K / Q5_K's 12 bytes of 6-bit scales and minima of the 8 sub-blocks: bytes 0-3 hold
// sub-blocks 0-3's scales (low 6 bits) and the top bits of 4-7's, bytes 4-7 the same for
// the minima, bytes 8-11 the low 4 bits of 4-7's scale (low nibble) and minimum (high).
void scales_and_minima(const uint8_t* p, int sc[8], int m[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = p[j] & 63;
        m[j] = p[4 + j] & 63;
        sc[4 + j] = (p[8 + j] & 0x0f) | ((p[j] >> 2) & 0x30);
        m[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30);
    }
}

// A K-quant super-scale (d or dmin), checked.
float checked_super_scale(const uint8_t* p, int64_t row, int64_t block, const char* name) {
    const uint16_t bits = fp16_at(p);
    if ((bits & kFp16ExponentMask) == kFp16ExponentMask) refuse(row, block, std::string("a NaN or infinite ") + name);
    return fp16_to_float(bits);
}

// One Q4_K super-block (row, block b: for errors) into its 128 code bytes and its 8
// sub-blocks' fp32 scales d * sc and minimums -(dmin * m) at scales / minimums + 4 * (8 b + j):
// w = (d sc) q - (dmin m), the gguf package's expression, since x + -y is x - y.
void convert_q4_k_block(const uint8_t* in, int64_t row, int64_t b, uint8_t* codes, uint8_t* scales,
                        uint8_t* minimums) {
    const float d = checked_super_scale(in, row, b, "d"), dmin = checked_super_scale(in + 2, row, b, "dmin");
    int sc[8], m[8];
    scales_and_minima(in + 4, sc, m);
    const uint8_t* q = in + 16;
    for (int j = 0; j < 8; ++j) {
        const float scale = d * static_cast<float>(sc[j]), minimum = -(dmin * static_cast<float>(m[j]));
        std::memcpy(scales + 4 * (8 * b + j), &scale, sizeof(scale));
        std::memcpy(minimums + 4 * (8 * b + j), &minimum, sizeof(minimum));
        const uint8_t* bytes = q + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 16; ++i)
            codes[16 * j + i] = static_cast<uint8_t>((bytes[2 * i] >> shift & 0x0f) | (bytes[2 * i + 1] >> shift & 0x0f) << 4);
    }
}

}  // namespace

int64_t ggml_block_weights(GgmlBlocks type) {
    return type == GgmlBlocks::iq4_xs || type == GgmlBlocks::q4_k ? kGgmlSuperBlock : kBlock;
}

int64_t ggml_block_bytes(GgmlBlocks type) {
    switch (type) {
        case GgmlBlocks::q8_0: return 2 + kBlock;
        case GgmlBlocks::q4_0:
        case GgmlBlocks::iq4_nl: return 2 + kBlock / 2;
        case GgmlBlocks::mxfp4: return 1 + kBlock / 2;
        case GgmlBlocks::q5_0: return 2 + 4 + kBlock / 2;
        case GgmlBlocks::iq4_xs: return 2 + 2 + 4 + 8 * kBlock / 2;
        case GgmlBlocks::q4_1: return 2 + 2 + kBlock / 2;
        case GgmlBlocks::q4_k: return 2 + 2 + 12 + kGgmlSuperBlock / 2;
    }
    return 0;
}

int64_t ggml_scale_bytes(GgmlBlocks type) {
    return type == GgmlBlocks::mxfp4 ? 1 : type == GgmlBlocks::iq4_xs || type == GgmlBlocks::q4_k ? 4 : 2;
}

void convert_ggml_blocks(GgmlBlocks type, const uint8_t* raw, int64_t rows, int64_t cols, uint8_t* values,
                         int64_t values_ld, uint8_t* scales, int64_t scales_ld) {
    const int64_t block_weights = ggml_block_weights(type), block_bytes = ggml_block_bytes(type);
    if (cols % block_weights)
        throw std::invalid_argument("cols=" + std::to_string(cols) + " is not a multiple of " +
                                    std::to_string(block_weights));
    const int64_t blocks = cols / block_weights;
    // Types with minimums: a row's minimums follow its cols / 32 scales.
    const int64_t minimums_at = cols / kBlock * ggml_scale_bytes(type);
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* in = raw + r * blocks * block_bytes;
        uint8_t* v = values + r * values_ld;
        uint8_t* s = scales + r * scales_ld;
        uint8_t* mins = s + minimums_at;
        for (int64_t b = 0; b < blocks; ++b, in += block_bytes) {
            bool zero = false;
            switch (type) {
                case GgmlBlocks::q8_0: {
                    store_fp16(s + 2 * b, checked_scale(fp16_at(in), false, r, b, &zero));
                    uint8_t* out = v + b * kBlock;
                    if (holds_minus_128(in + 2)) refuse(r, b, "a block holds q = -128, outside the symmetric int8 [-127, 127]");
                    if (zero)
                        std::memset(out, 0, kBlock);
                    else
                        std::memcpy(out, in + 2, kBlock);
                    break;
                }
                case GgmlBlocks::q4_0:
                case GgmlBlocks::iq4_nl: {
                    const bool q4 = type == GgmlBlocks::q4_0;
                    store_fp16(s + 2 * b, checked_scale(fp16_at(in), !q4, r, b, &zero));
                    uint8_t* out = v + b * kBlock / 2;
                    if (zero)
                        std::memset(out, 0, kBlock / 2);
                    else
                        pair_nibbles(in + 2, out, q4 ? 0x88 : 0x00);  // Q4_0: q + 8 -> q's two's complement
                    break;
                }
                case GgmlBlocks::mxfp4:
                    if (in[0] == kE8m0Nan) refuse(r, b, "scale byte 0xFF (NaN in e8m0)");
                    s[b] = in[0];
                    pair_nibbles(in + 1, v + b * kBlock / 2, 0x00);
                    break;
                case GgmlBlocks::q5_0: {
                    store_fp16(s + 2 * b, checked_scale(fp16_at(in), false, r, b, &zero));
                    uint32_t fifth;
                    std::memcpy(&fifth, in + 2, sizeof(fifth));  // little-endian, as x86-64
                    auto* out = reinterpret_cast<int8_t*>(v + b * kBlock);
                    for (int j = 0; j < kBlock; ++j) {
                        const int low = j < 16 ? in[6 + j] & 0x0f : in[6 + j - 16] >> 4;
                        out[j] = zero ? 0 : static_cast<int8_t>((low | (fifth >> j & 1) << 4) - 16);
                    }
                    break;
                }
                case GgmlBlocks::iq4_xs: {
                    const float d = fp16_to_float(checked_scale(fp16_at(in), true, r, b, &zero));
                    const uint16_t high_bits = fp16_at(in + 2);
                    for (int sub = 0; sub < 8; ++sub) {
                        const int ls = (in[4 + sub / 2] >> 4 * (sub % 2) & 0x0f) | (high_bits >> 2 * sub & 3) << 4;
                        const float scale = d * static_cast<float>(ls - 32);
                        std::memcpy(s + 4 * (8 * b + sub), &scale, sizeof(scale));
                        pair_nibbles(in + 8 + 16 * sub, v + (8 * b + sub) * kBlock / 2, 0x00);
                    }
                    break;
                }
                case GgmlBlocks::q4_1:
                    store_fp16(s + 2 * b, checked_scale(fp16_at(in), true, r, b, &zero));
                    if ((fp16_at(in + 2) & kFp16ExponentMask) == kFp16ExponentMask)
                        refuse(r, b, "a NaN or infinite block minimum");
                    store_fp16(mins + 2 * b, fp16_at(in + 2));
                    pair_nibbles(in + 4, v + b * kBlock / 2, 0x00);
                    break;
                case GgmlBlocks::q4_k: convert_q4_k_block(in, r, b, v + b * kGgmlSuperBlock / 2, s, mins); break;
            }
        }
    }
}

namespace {

// Q4_K and Q5_K (fifth = the 32 bytes of fifth bits, or null): sub-block j's weights
// are the low (j even) or high nibbles of bytes 32 (j / 2) ..+ 32, the fifth bit bit j of
// fifth[i].
void dequantize_q45_k(const uint8_t* block, const uint8_t* fifth, const uint8_t* codes, int64_t row, int64_t b,
                      float* out) {
    const float d = checked_super_scale(block, row, b, "d"), dmin = checked_super_scale(block + 2, row, b, "dmin");
    int sc[8], m[8];
    scales_and_minima(block + 4, sc, m);
    for (int j = 0; j < 8; ++j) {
        const float scale = d * static_cast<float>(sc[j]), minimum = dmin * static_cast<float>(m[j]);
        const uint8_t* bytes = codes + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; ++i) {
            int q = bytes[i] >> shift & 0x0f;
            if (fifth != nullptr) q |= (fifth[i] >> j & 1) << 4;
            out[32 * j + i] = scale * static_cast<float>(q) - minimum;
        }
    }
}

// Q6_K: weight e = 128 h + 32 s + i (h < 2, s < 4, i < 32) has its low 4 bits in byte
// 64 h + 32 (s % 2) + i of the low bits (nibble s / 2), its high 2 in bits 2 s of byte
// 32 h + i of the high bits; scale e / 16.
void dequantize_q6_k(const uint8_t* block, int64_t row, int64_t b, float* out) {
    const uint8_t *low = block, *high = block + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = checked_super_scale(block + 208, row, b, "d");
    for (int e = 0; e < kGgmlSuperBlock; ++e) {
        const int h = e / 128, s = e % 128 / 32, i = e % 32;
        const int q = (low[64 * h + 32 * (s % 2) + i] >> 4 * (s / 2) & 0x0f) | (high[32 * h + i] >> 2 * s & 3) << 4;
        out[e] = (d * static_cast<float>(scales[e / 16])) * static_cast<float>(q - 32);
    }
}

// Q3_K: weight e = 128 h + 32 s + i: 2 bits at 2 s of byte 32 h + i, the high bit bit
// (4 h + s) of hmask[i]; scale e / 16, its low 4 bits in byte k % 8 (nibble k / 8), its
// high 2 at 2 (k / 4) of byte 8 + k % 4.
void dequantize_q3_k(const uint8_t* block, int64_t row, int64_t b, float* out) {
    const uint8_t *hmask = block, *codes = block + 32, *packed = block + 96;
    const float d = checked_super_scale(block + 108, row, b, "d");
    for (int e = 0; e < kGgmlSuperBlock; ++e) {
        const int h = e / 128, s = e % 128 / 32, i = e % 32, k = e / 16;
        const int scale = ((packed[k % 8] >> 4 * (k / 8) & 0x0f) | (packed[8 + k % 4] >> 2 * (k / 4) & 3) << 4) - 32;
        const int q = (codes[32 * h + i] >> 2 * s & 3) - 4 * (1 - (hmask[i] >> (4 * h + s) & 1));
        out[e] = (d * static_cast<float>(scale)) * static_cast<float>(q);
    }
}

// Q2_K: weight e = 128 h + 32 s + i: 2 bits at 2 s of byte 32 h + i; sub-block e / 16's
// scale in the low nibble of its byte, its minimum in the high one.
void dequantize_q2_k(const uint8_t* block, int64_t row, int64_t b, float* out) {
    const uint8_t *packed = block, *codes = block + 16;
    const float d = checked_super_scale(block + 80, row, b, "d"), dmin = checked_super_scale(block + 82, row, b, "dmin");
    for (int e = 0; e < kGgmlSuperBlock; ++e) {
        const int h = e / 128, s = e % 128 / 32, i = e % 32, k = e / 16;
        const float scale = d * static_cast<float>(packed[k] & 0x0f), minimum = dmin * static_cast<float>(packed[k] >> 4);
        out[e] = scale * static_cast<float>(codes[32 * h + i] >> 2 * s & 3) - minimum;
    }
}

}  // namespace

int64_t ggml_k_block_bytes(GgmlKQuant type) {
    switch (type) {
        case GgmlKQuant::q2_k: return 16 + 64 + 2 + 2;
        case GgmlKQuant::q3_k: return 32 + 64 + 12 + 2;
        case GgmlKQuant::q4_k: return 2 + 2 + 12 + 128;
        case GgmlKQuant::q5_k: return 2 + 2 + 12 + 32 + 128;
        case GgmlKQuant::q6_k: return 128 + 64 + 16 + 2;
    }
    return 0;
}

void dequantize_ggml_k_row(GgmlKQuant type, const uint8_t* raw_row, int64_t row, int64_t cols, float* out) {
    const int64_t block_bytes = ggml_k_block_bytes(type);
    const uint8_t* in = raw_row;
    for (int64_t b = 0; b < cols / kGgmlSuperBlock; ++b, in += block_bytes) {
        float* o = out + b * kGgmlSuperBlock;
        switch (type) {
            case GgmlKQuant::q2_k: dequantize_q2_k(in, row, b, o); break;
            case GgmlKQuant::q3_k: dequantize_q3_k(in, row, b, o); break;
            case GgmlKQuant::q4_k: dequantize_q45_k(in, nullptr, in + 16, row, b, o); break;
            case GgmlKQuant::q5_k: dequantize_q45_k(in, in + 16, in + 48, row, b, o); break;
            case GgmlKQuant::q6_k: dequantize_q6_k(in, row, b, o); break;
        }
    }
}

namespace {

void check_k_columns(int64_t cols) {
    if (cols <= 0 || cols % kGgmlSuperBlock)
        throw std::invalid_argument("cols=" + std::to_string(cols) + " is not a positive multiple of " +
                                    std::to_string(kGgmlSuperBlock));
}

}  // namespace

void dequantize_ggml_k_blocks(GgmlKQuant type, const uint8_t* raw, int64_t rows, int64_t cols, float* out,
                              int64_t out_ld) {
    check_k_columns(cols);
    const int64_t row_bytes = cols / kGgmlSuperBlock * ggml_k_block_bytes(type);
    for (int64_t r = 0; r < rows; ++r) dequantize_ggml_k_row(type, raw + r * row_bytes, r, cols, out + r * out_ld);
}

void requantize_ggml_k_blocks(GgmlKQuant type, const uint8_t* raw, int64_t rows, int64_t cols,
                              const GroupTarget& to) {
    check_k_columns(cols);
    check_group_target(cols, to);
    const int64_t row_bytes = cols / kGgmlSuperBlock * ggml_k_block_bytes(type);
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
        dequantize_ggml_k_row(type, raw + r * row_bytes, r, cols, row.data());
        quantize_group_row(row.data(), r, cols, to);
    }
}

}  // namespace numa_moe::formats
