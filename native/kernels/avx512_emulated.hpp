// AVX-512 intrinsics on CPUs that only have AVX2, for the AMX software-model builds
// (amx_bf16_model.cpp, amx_quant_model.cpp, attention_amx_model.cpp): their epilogues,
// token packing and softmax are AVX-512 code shared with the real AMX kernels, and the
// model must run wherever the tests run, not only on AVX-512 CPUs.
//
// SIMDe (SIMD Everywhere, the simde-py build requirement) supplies the intrinsics as
// portable code over 256-bit vectors; SIMDE_ENABLE_NATIVE_ALIASES maps the _mm512_* names
// to it. Included first in each model translation unit (compiled with -mavx2 -mfma),
// before <immintrin.h> is included again by the kernel source.
//
// What this header replaces in SIMDe 0.8.2, because it is wrong for the kernels' tails:
//   - masked loads read all 64 bytes before masking, past the end of a buffer;
//   - masked stores write zeros to the masked-off lanes, clobbering the neighbours.
// Both are redone lane by lane (whole vectors when every lane is set). And four intrinsics
// SIMDe lacks: _mm512_cvtneps_pbh, _mm512_cvtepi32_epi8, _mm512_cvtepu8_epi16 and
// _mm512_maskz_loadu_epi32.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace numa_moe::kernels::avx512_emulated {
namespace {

// Copies the lanes of `lane_bytes` bytes selected by `mask` from src to dst.
inline void copy_masked_lanes(void* dst, const void* src, uint64_t mask, int lanes, int lane_bytes) {
    for (int i = 0; i < lanes; ++i) {
        if ((mask >> i) & 1u) {
            std::memcpy(static_cast<char*>(dst) + i * lane_bytes, static_cast<const char*>(src) + i * lane_bytes,
                        static_cast<size_t>(lane_bytes));
        }
    }
}

inline bool all_lanes(uint64_t mask, int lanes) { return mask == (lanes == 64 ? ~uint64_t{0} : (uint64_t{1} << lanes) - 1); }

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
    if (all_lanes(k, 16)) return simde_mm512_loadu_ps(p);
    alignas(64) float lanes[16] = {};
    copy_masked_lanes(lanes, p, k, 16, 4);
    return simde_mm512_load_ps(lanes);
}

inline simde__m512 mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
    alignas(64) float lanes[16];
    simde_mm512_store_ps(lanes, src);
    copy_masked_lanes(lanes, p, k, 16, 4);
    return simde_mm512_load_ps(lanes);
}

inline simde__m512i maskz_loadu_epi32(simde__mmask16 k, const void* p) {
    return simde_mm512_castps_si512(maskz_loadu_ps(k, p));
}

inline simde__m256i maskz_loadu_epi16_256(simde__mmask16 k, const void* p) {
    if (all_lanes(k, 16)) return simde_mm256_loadu_si256(static_cast<const simde__m256i*>(p));
    alignas(32) uint16_t lanes[16] = {};
    copy_masked_lanes(lanes, p, k, 16, 2);
    return simde_mm256_load_si256(reinterpret_cast<const simde__m256i*>(lanes));
}

inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
    if (all_lanes(k, 16)) return simde_mm512_storeu_ps(p, a);
    alignas(64) float lanes[16];
    simde_mm512_store_ps(lanes, a);
    copy_masked_lanes(p, lanes, k, 16, 4);
}

inline void mask_storeu_epi32(void* p, simde__mmask16 k, simde__m512i a) {
    mask_storeu_ps(p, k, simde_mm512_castsi512_ps(a));
}

inline void mask_storeu_epi16_512(void* p, simde__mmask32 k, simde__m512i a) {
    if (all_lanes(k, 32)) return simde_mm512_storeu_si512(p, a);
    alignas(64) uint16_t lanes[32];
    simde_mm512_store_si512(lanes, a);
    copy_masked_lanes(p, lanes, k, 32, 2);
}

inline void mask_storeu_epi16_256(void* p, simde__mmask16 k, simde__m256i a) {
    if (all_lanes(k, 16)) return simde_mm256_storeu_si256(static_cast<simde__m256i*>(p), a);
    alignas(32) uint16_t lanes[16];
    simde_mm256_store_si256(reinterpret_cast<simde__m256i*>(lanes), a);
    copy_masked_lanes(p, lanes, k, 16, 2);
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

}  // namespace
}  // namespace numa_moe::kernels::avx512_emulated

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
#define _mm512_maskz_loadu_ps(k, p) ::numa_moe::kernels::avx512_emulated::maskz_loadu_ps(k, p)
#define _mm512_mask_loadu_ps(src, k, p) ::numa_moe::kernels::avx512_emulated::mask_loadu_ps(src, k, p)
#define _mm512_maskz_loadu_epi32(k, p) ::numa_moe::kernels::avx512_emulated::maskz_loadu_epi32(k, p)
#define _mm256_maskz_loadu_epi16(k, p) ::numa_moe::kernels::avx512_emulated::maskz_loadu_epi16_256(k, p)
#define _mm512_mask_storeu_ps(p, k, a) ::numa_moe::kernels::avx512_emulated::mask_storeu_ps(p, k, a)
#define _mm512_mask_storeu_epi32(p, k, a) ::numa_moe::kernels::avx512_emulated::mask_storeu_epi32(p, k, a)
#define _mm512_mask_storeu_epi16(p, k, a) ::numa_moe::kernels::avx512_emulated::mask_storeu_epi16_512(p, k, a)
#define _mm256_mask_storeu_epi16(p, k, a) ::numa_moe::kernels::avx512_emulated::mask_storeu_epi16_256(p, k, a)
#define _mm512_cvtneps_pbh(a) ::numa_moe::kernels::avx512_emulated::cvtneps_pbh(a)
#define _mm512_cvtepi32_epi8(a) ::numa_moe::kernels::avx512_emulated::cvtepi32_epi8(a)
#define _mm512_cvtepu8_epi16(a) ::numa_moe::kernels::avx512_emulated::cvtepu8_epi16(a)
