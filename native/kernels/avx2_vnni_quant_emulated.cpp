// The emulated build of avx2_vnni_quant.cpp: the same source with baseline x86-64 flags, the
// AVX2 intrinsics from SIMDe (avx2_emulated.hpp) and vpdpbusd from SIMDe's AVX-512 VNNI (its
// 256-bit form computes what the VEX one does), a test build that runs on every CPU
// (docs/kernels.md, "The emulated AVX2 and AVX-512 builds").
#define NUMA_MOE_EMULATED 1
#define NUMA_MOE_AVX_VNNI 1
#include "kernels/avx2_emulated.hpp"
#include <simde/x86/avx512/dpbusd.h>
#define _mm256_dpbusd_avx_epi32 simde_mm256_dpbusd_epi32
#include "kernels/avx2_quant.cpp"
