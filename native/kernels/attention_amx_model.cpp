// The emulated AMX build of the decode-attention kernel: attention_amx.cpp compiled
// against the AMX software model (amx_model.hpp), with the AVX-512 flags but no -mamx-*.
#define NUMA_MOE_AMX_MODEL 1
#include "kernels/attention_amx.cpp"
