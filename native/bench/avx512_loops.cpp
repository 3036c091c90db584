// AVX-512 benchmark loops (loops.hpp). Compiled with the AVX-512 flags; nothing here has
// external linkage but the loops themselves.
#include <immintrin.h>

#include "bench/loops.hpp"

namespace numa_moe::bench {

uint64_t stream_read_avx512(const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= bytes; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    const __m512i all = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    // Fold the lanes as unsigned: _mm512_reduce_add_epi64 adds as signed long long, and
    // an overflow of this checksum would be undefined behaviour.
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, all);
    uint64_t sum = 0;
    for (uint64_t lane : lanes) sum += lane;
    for (; i < bytes; ++i) sum += static_cast<unsigned char>(p[i]);
    return sum;
}

// `n` rounds of 24 independent `insn zmm30, zmm31, zmmI` (I = 0..23) on zero operands, in
// assembly: with intrinsics gcc kept the 24 accumulators in memory. 24 chains hide the
// instruction latency.
#define NUMA_MOE_STEP(insn, i) insn " %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define NUMA_MOE_REGISTER_LOOP(insn, n)                                                                              \
    __asm__ volatile(                                                                                              \
        "vpxord %%zmm30, %%zmm30, %%zmm30\n\t"                                                                     \
        "vpxord %%zmm31, %%zmm31, %%zmm31\n\t"                                                                     \
        "1:\n\t" NUMA_MOE_STEP(insn, 0) NUMA_MOE_STEP(insn, 1) NUMA_MOE_STEP(insn, 2) NUMA_MOE_STEP(insn, 3)     \
        NUMA_MOE_STEP(insn, 4) NUMA_MOE_STEP(insn, 5) NUMA_MOE_STEP(insn, 6) NUMA_MOE_STEP(insn, 7)                \
        NUMA_MOE_STEP(insn, 8) NUMA_MOE_STEP(insn, 9) NUMA_MOE_STEP(insn, 10) NUMA_MOE_STEP(insn, 11)              \
        NUMA_MOE_STEP(insn, 12) NUMA_MOE_STEP(insn, 13) NUMA_MOE_STEP(insn, 14) NUMA_MOE_STEP(insn, 15)            \
        NUMA_MOE_STEP(insn, 16) NUMA_MOE_STEP(insn, 17) NUMA_MOE_STEP(insn, 18) NUMA_MOE_STEP(insn, 19)            \
        NUMA_MOE_STEP(insn, 20) NUMA_MOE_STEP(insn, 21) NUMA_MOE_STEP(insn, 22) NUMA_MOE_STEP(insn, 23)            \
        "dec %0\n\t"                                                                                               \
        "jnz 1b\n\t"                                                                                               \
        : "+r"(n)                                                                                                  \
        :                                                                                                          \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",        \
          "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",       \
          "xmm23", "xmm30", "xmm31", "cc")

double vdpbf16ps_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    int64_t n = iterations;
    NUMA_MOE_REGISTER_LOOP("vdpbf16ps", n);
    return static_cast<double>(iterations) * 24.0 * 64.0;
}

double vpdpbusd_loop(int64_t iterations) {
    if (iterations <= 0) return 0.0;
    int64_t n = iterations;
    NUMA_MOE_REGISTER_LOOP("vpdpbusd", n);
    return static_cast<double>(iterations) * 24.0 * 128.0;
}

#undef NUMA_MOE_REGISTER_LOOP
#undef NUMA_MOE_STEP

}  // namespace numa_moe::bench
