// The emulated AMX build: amx_bf16.cpp compiled against the AMX software model
// (amx_model.hpp). A second translation unit because CMake gives one source file one set
// of flags; this one gets AVX2 flags and the AVX-512 intrinsics from avx512_emulated.hpp,
// so that the model runs on every AVX2 CPU.
#define NUMA_MOE_AMX_MODEL 1
#include "kernels/avx512_emulated.hpp"
#include "kernels/amx_bf16.cpp"
