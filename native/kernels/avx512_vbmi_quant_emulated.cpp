// The VBMI build of avx512_quant.cpp's codebook formats' tables over SIMDe (avx512_emulated.hpp), a test
// build that runs on every AVX2 CPU. A translation unit of its own for its own flags.
#define NUMA_MOE_EMULATED 1
#define NUMA_MOE_AVX512_VBMI 1
#include "kernels/avx512_emulated.hpp"
#include "kernels/avx512_quant.cpp"
