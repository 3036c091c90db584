// The avx512_emulated build of avx512_bf16.cpp: the same source with AVX2 flags and the AVX-512
// intrinsics from SIMDe (avx512_emulated.hpp), a test build that runs on every AVX2 CPU
// (docs/kernels.md). A translation unit of its own for its own flags.
#define NUMA_MOE_EMULATED 1
#include "kernels/avx512_emulated.hpp"
#include "kernels/avx512_bf16.cpp"
