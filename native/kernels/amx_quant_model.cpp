// The emulated AMX-INT8 build: amx_quant.cpp compiled against the AMX software model
// (amx_model.hpp), as amx_bf16_model.cpp is for BF16: AVX2 flags and avx512_emulated.hpp,
// no -mamx-*.
#define NUMA_MOE_AMX_MODEL 1
#include "kernels/avx512_emulated.hpp"
#include "kernels/amx_quant.cpp"
