// AVX-512 intrinsics on CPUs that only have AVX2, for the builds that run AVX-512 kernel
// code there: the AMX software model (amx_bf16_model.cpp, amx_quant_model.cpp,
// attention_amx_model.cpp), whose epilogues, token packing and softmax are AVX-512 code
// shared with the real AMX kernels, and the avx512_emulated test builds of the AVX-512
// kernels themselves (avx512_bf16_emulated.cpp, avx512_quant_emulated.cpp,
// attention_avx512_emulated.cpp). Both must run wherever the tests run.
//
// SIMDe (SIMD Everywhere, the simde-py build requirement) supplies the intrinsics as
// portable code over 256-bit vectors; SIMDE_ENABLE_NATIVE_ALIASES maps the _mm512_* names
// to it. Included first in each such translation unit (compiled with -mavx2 -mfma),
// before <immintrin.h> is included again by the kernel source.
//
// What this header replaces in SIMDe 0.8.2, because it is wrong for the kernels:
//   - masked loads read all 64 bytes before masking, past the end of a buffer;
//   - masked stores write zeros to the masked-off lanes, clobbering the neighbours;
//   - _mm512_dpbf16_ps adds the even product first, rounds each product, and keeps
//     denormals; VDPBF16PS adds the odd one first, each as an FMA, with denormal inputs as
//     zero and denormal results flushed (SDM);
//   - _mm512_dpbusd_epi32 overflows a signed int (undefined) where VPDPBUSD wraps.
// Masked loads and stores are redone lane by lane (whole vectors when every lane is set),
// the dot products lane by lane as the SDM defines them. And the intrinsics SIMDe lacks:
// _mm512_cvtneps_pbh, _mm512_cvtne2ps_pbh, _mm512_cvtepi32_epi8, _mm512_cvtepu8_epi16,
// _mm512_permute_ps, _mm512_zextsi256_si512 and the masked loads and stores of 128-bit
// vectors.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace numa_moe::kernels::avx512_emulated {
namespace {

// Copies the lanes of `lane_bytes` bytes selected by `mask` from src to dst, and never
// touches an unselected lane of either (all at once when every lane is selected).
inline void copy_masked_lanes(void* dst, const void* src, uint64_t mask, int lanes, int lane_bytes) {
    const uint64_t every = lanes == 64 ? ~uint64_t{0} : (uint64_t{1} << lanes) - 1;
    if ((mask & every) == every) {
        std::memcpy(dst, src, static_cast<size_t>(lanes) * static_cast<size_t>(lane_bytes));
        return;
    }
    for (int i = 0; i < lanes; ++i) {
        if ((mask >> i) & 1u) {
            std::memcpy(static_cast<char*>(dst) + i * lane_bytes, static_cast<const char*>(src) + i * lane_bytes,
                        static_cast<size_t>(lane_bytes));
        }
    }
}

// A masked load: the selected lanes from p, the others those of `rest` (SIMDe's vectors
// are plain trivially copyable values).
template <class Vector>
inline Vector load_selected(Vector rest, uint64_t mask, const void* p, int lane_bytes) {
    copy_masked_lanes(&rest, p, mask, static_cast<int>(sizeof(Vector)) / lane_bytes, lane_bytes);
    return rest;
}

// A masked store: the selected lanes of v to p, nothing else written.
template <class Vector>
inline void store_selected(void* p, uint64_t mask, Vector v, int lane_bytes) {
    copy_masked_lanes(p, &v, mask, static_cast<int>(sizeof(Vector)) / lane_bytes, lane_bytes);
}

// VCVTNEPS2BF16 as the SDM defines it: round to nearest even, NaN kept quiet, and zero or
// denormal inputs to a zero of their sign (the instruction ignores MXCSR).
inline simde__m256i cvtneps_pbh(simde__m512 a) {
    alignas(64) uint32_t in[16];
    alignas(32) uint16_t out[16];
    simde_mm512_store_ps(in, a);
    for (int i = 0; i < 16; ++i) {
        const uint32_t bits = in[i];
        const uint32_t magnitude = bits & 0x7fffffffu;
        if (magnitude < 0x00800000u) {
            out[i] = static_cast<uint16_t>((bits >> 16) & 0x8000u);
        } else if (magnitude > 0x7f800000u) {
            out[i] = static_cast<uint16_t>((bits >> 16) | 0x0040u);
        } else if (magnitude == 0x7f800000u) {
            out[i] = static_cast<uint16_t>(bits >> 16);
        } else {
            out[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        }
    }
    return simde_mm256_load_si256(reinterpret_cast<const simde__m256i*>(out));
}

// VCVTNE2PS2BF16: b's 16 values to the low half, a's to the high half.
inline simde__m512i cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(cvtneps_pbh(b)), cvtneps_pbh(a), 1);
}

// The DAZ and FTZ of VDPBF16PS: a denormal to a zero of its sign.
inline float flush_denormal(float value) {
    return std::fpclassify(value) == FP_SUBNORMAL ? std::copysign(0.0f, value) : value;
}

inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof(value));
    return value;
}

// VDPBF16PS: per fp32 lane, srcdest += a.odd * b.odd, then += a.even * b.even, each an FMA
// rounded to nearest even, denormal inputs read as zero and denormal results flushed.
template <class Pairs>
inline simde__m512 dpbf16_ps(simde__m512 src, Pairs a, Pairs b) {
    static_assert(sizeof(Pairs) == 64, "32 bf16 pairs");
    float acc[16];
    uint16_t x[32], y[32];
    std::memcpy(acc, &src, sizeof(acc));
    std::memcpy(x, &a, sizeof(x));
    std::memcpy(y, &b, sizeof(y));
    for (int i = 0; i < 16; ++i) {
        float sum = flush_denormal(acc[i]);
        for (int half : {1, 0}) {
            const float p = flush_denormal(bf16_to_float(x[2 * i + half]));
            const float q = flush_denormal(bf16_to_float(y[2 * i + half]));
            sum = flush_denormal(std::fma(p, q, sum));
        }
        acc[i] = sum;
    }
    simde__m512 result;
    std::memcpy(&result, acc, sizeof(acc));
    return result;
}

// VPDPBUSD: per int32 lane, four unsigned-byte x signed-byte products added to srcdest,
// wrapping around (no saturation).
inline simde__m512i dpbusd_epi32(simde__m512i src, simde__m512i a, simde__m512i b) {
    uint32_t acc[16];
    uint8_t x[64];
    int8_t y[64];
    std::memcpy(acc, &src, sizeof(acc));
    std::memcpy(x, &a, sizeof(x));
    std::memcpy(y, &b, sizeof(y));
    for (int i = 0; i < 16; ++i) {
        for (int j = 4 * i; j < 4 * i + 4; ++j) acc[i] += static_cast<uint32_t>(int32_t{x[j]} * int32_t{y[j]});
    }
    simde__m512i result;
    std::memcpy(&result, acc, sizeof(acc));
    return result;
}

// VPMOVDB: the low byte of each int32.
inline simde__m128i cvtepi32_epi8(simde__m512i a) {
    alignas(64) uint32_t in[16];
    alignas(16) uint8_t out[16];
    simde_mm512_store_si512(in, a);
    for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(in[i]);
    return simde_mm_load_si128(reinterpret_cast<const simde__m128i*>(out));
}

// VPMOVZXBW zmm: 32 bytes zero-extended to 32 int16.
inline simde__m512i cvtepu8_epi16(simde__m256i a) {
    const simde__m256i lo = simde_mm256_cvtepu8_epi16(simde_mm256_castsi256_si128(a));
    const simde__m256i hi = simde_mm256_cvtepu8_epi16(simde_mm256_extracti128_si256(a, 1));
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}

// VPERMILPS zmm, imm8: within each 128-bit lane, element i from position imm8[2i + 1 : 2i].
inline simde__m512 permute_ps(simde__m512 a, int imm8) {
    float in[16], out[16];
    std::memcpy(in, &a, sizeof(in));
    for (int i = 0; i < 16; ++i) out[i] = in[(i & ~3) + ((imm8 >> (2 * (i & 3))) & 3)];
    simde__m512 result;
    std::memcpy(&result, out, sizeof(out));
    return result;
}

// The 256 bits of a in the low half, zeros above.
inline simde__m512i zextsi256_si512(simde__m256i a) {
    return simde_mm512_inserti64x4(simde_mm512_setzero_si512(), a, 0);
}

}  // namespace
}  // namespace numa_moe::kernels::avx512_emulated

#undef _mm_maskz_loadu_ps
#undef _mm_mask_storeu_ps
#undef _mm256_maskz_loadu_epi8
#undef _mm512_maskz_loadu_epi8
#undef _mm512_maskz_loadu_epi16
#undef _mm512_cvtne2ps_pbh
#undef _mm512_dpbf16_ps
#undef _mm512_dpbusd_epi32
#undef _mm512_permute_ps
#undef _mm512_zextsi256_si512
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#undef _mm512_maskz_loadu_epi32
#undef _mm256_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#undef _mm512_mask_storeu_epi32
#undef _mm512_mask_storeu_epi16
#undef _mm256_mask_storeu_epi16
#undef _mm512_cvtneps_pbh
#undef _mm512_cvtepi32_epi8
#undef _mm512_cvtepu8_epi16
#define _mm512_maskz_loadu_ps(k, p) \
    ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm512_setzero_ps(), k, p, 4)
#define _mm512_mask_loadu_ps(src, k, p) ::numa_moe::kernels::avx512_emulated::load_selected(src, k, p, 4)
#define _mm512_maskz_loadu_epi32(k, p) \
    ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm512_setzero_si512(), k, p, 4)
#define _mm256_maskz_loadu_epi16(k, p) \
    ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm256_setzero_si256(), k, p, 2)
#define _mm512_mask_storeu_ps(p, k, a) ::numa_moe::kernels::avx512_emulated::store_selected(p, k, a, 4)
#define _mm512_mask_storeu_epi32(p, k, a) ::numa_moe::kernels::avx512_emulated::store_selected(p, k, a, 4)
#define _mm512_mask_storeu_epi16(p, k, a) ::numa_moe::kernels::avx512_emulated::store_selected(p, k, a, 2)
#define _mm256_mask_storeu_epi16(p, k, a) ::numa_moe::kernels::avx512_emulated::store_selected(p, k, a, 2)
#define _mm_maskz_loadu_ps(k, p) ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm_setzero_ps(), k, p, 4)
#define _mm_mask_storeu_ps(p, k, a) ::numa_moe::kernels::avx512_emulated::store_selected(p, k, a, 4)
#define _mm256_maskz_loadu_epi8(k, p) \
    ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm256_setzero_si256(), k, p, 1)
#define _mm512_maskz_loadu_epi8(k, p) \
    ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm512_setzero_si512(), k, p, 1)
#define _mm512_maskz_loadu_epi16(k, p) \
    ::numa_moe::kernels::avx512_emulated::load_selected(simde_mm512_setzero_si512(), k, p, 2)
#define _mm512_cvtne2ps_pbh(a, b) ::numa_moe::kernels::avx512_emulated::cvtne2ps_pbh(a, b)
#define _mm512_dpbf16_ps(src, a, b) ::numa_moe::kernels::avx512_emulated::dpbf16_ps(src, a, b)
#define _mm512_dpbusd_epi32(src, a, b) ::numa_moe::kernels::avx512_emulated::dpbusd_epi32(src, a, b)
#define _mm512_permute_ps(a, imm8) ::numa_moe::kernels::avx512_emulated::permute_ps(a, imm8)
#define _mm512_zextsi256_si512(a) ::numa_moe::kernels::avx512_emulated::zextsi256_si512(a)
#define _mm512_cvtneps_pbh(a) ::numa_moe::kernels::avx512_emulated::cvtneps_pbh(a)
#define _mm512_cvtepi32_epi8(a) ::numa_moe::kernels::avx512_emulated::cvtepi32_epi8(a)
#define _mm512_cvtepu8_epi16(a) ::numa_moe::kernels::avx512_emulated::cvtepu8_epi16(a)
