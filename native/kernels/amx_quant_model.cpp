// The emulated AMX-INT8 build: amx_quant.cpp compiled against the AMX software model
// (amx_model.hpp), as amx_bf16_model.cpp is for BF16: AVX-512 flags, no -mamx-*.
#define NUMA_MOE_AMX_MODEL 1
#include "kernels/amx_quant.cpp"
