// AVX2 + FMA (+ F16C) intrinsics on every x86-64 CPU, for the avx2_emulated test builds
// (avx2_bf16_emulated.cpp, avx2_quant_emulated.cpp, attention_avx2_emulated.cpp): the AVX2 kernel
// sources compiled with baseline flags, so that the tests run them on CPUs without AVX2.
//
// SIMDe (the simde-py build requirement) supplies the intrinsics as portable code;
// SIMDE_ENABLE_NATIVE_ALIASES maps the _mm256_* names to it. Included first in each such
// translation unit, before <immintrin.h> is included again by the kernel source (whose
// declarations the alias macros would otherwise rename). Without -mfma SIMDe's
// _mm256_fmadd_ps rounds the product before the sum: the bf16 and attention kernels use it
// and are held to the reference within a tolerance; the integer kernels do not use it.
#pragma once

#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx2.h>
#include <simde/x86/fma.h>
#include <simde/x86/f16c.h>
