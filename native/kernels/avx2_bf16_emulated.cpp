// The avx2_emulated build of avx2_bf16.cpp: the same source with baseline x86-64 flags and the
// AVX2 / FMA intrinsics from SIMDe (avx2_emulated.hpp), a test build that runs on every
// CPU (docs/kernels.md). A translation unit of its own for its own flags.
#define NUMA_MOE_EMULATED 1
#include "kernels/avx2_emulated.hpp"
#include "kernels/avx2_bf16.cpp"
