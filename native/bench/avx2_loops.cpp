// AVX2 benchmark loops (loops.hpp) for CPUs without AVX-512. Compiled with -mavx2 -mfma;
// nothing here has external linkage but the loops themselves.
#include <immintrin.h>

#include "bench/loops.hpp"

namespace numa_moe::bench {

uint64_t stream_read_avx2(const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= bytes; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    const __m256i all = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), all);
    uint64_t sum = 0;
    for (uint64_t lane : lanes) sum += lane;
    for (; i < bytes; ++i) sum += static_cast<unsigned char>(p[i]);
    return sum;
}

// `n` rounds of 14 independent `insn ymm14, ymm15, ymmI` (I = 0..13) on zero operands, in
// assembly so that the accumulators stay in registers; 14 chains hide the FMA latency on
// two FMA ports. AVX2 has 16 ymm registers: two operands, fourteen destinations.
#define NUMA_MOE_STEP(insn, i) insn " %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define NUMA_MOE_REGISTER_LOOP(insn, n)                                                                              \
    __asm__ volatile(                                                                                              \
        "vpxor %%ymm14, %%ymm14, %%ymm14\n\t"                                                                      \
        "vpxor %%ymm15, %%ymm15, %%ymm15\n\t"                                                                      \
        "1:\n\t" NUMA_MOE_STEP(insn, 0) NUMA_MOE_STEP(insn, 1) NUMA_MOE_STEP(insn, 2) NUMA_MOE_STEP(insn, 3)     \
        NUMA_MOE_STEP(insn, 4) NUMA_MOE_STEP(insn, 5) NUMA_MOE_STEP(insn, 6) NUMA_MOE_STEP(insn, 7)                \
        NUMA_MOE_STEP(insn, 8) NUMA_MOE_STEP(insn, 9) NUMA_MOE_STEP(insn, 10) NUMA_MOE_STEP(insn, 11)              \
        NUMA_MOE_STEP(insn, 12) NUMA_MOE_STEP(insn, 13)                                                            \
        "dec %0\n\t"                                                                                               \
        "jnz 1b\n\t"                                                                                               \
        : "+r"(n)                                                                                                  \
        :                                                                                                          \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",        \
          "xmm12", "xmm13", "xmm14", "xmm15", "cc")

double vfmadd231ps_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    int64_t n = iterations;
    NUMA_MOE_REGISTER_LOOP("vfmadd231ps", n);
    return static_cast<double>(iterations) * 14.0 * 16.0;
}

double vpmaddubsw_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    int64_t n = iterations;
    NUMA_MOE_REGISTER_LOOP("vpmaddubsw", n);
    return static_cast<double>(iterations) * 14.0 * 64.0;
}

#undef NUMA_MOE_REGISTER_LOOP
#undef NUMA_MOE_STEP

}  // namespace numa_moe::bench
