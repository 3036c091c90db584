// The emulated AMX build of the decode-attention kernel: attention_amx.cpp compiled
// against the AMX software model (amx_model.hpp), with AVX2 flags and avx512_emulated.hpp
// (as amx_bf16_model.cpp), no -mamx-*.
#define NUMA_MOE_AMX_MODEL 1
#include "kernels/avx512_emulated.hpp"
#include "kernels/attention_amx.cpp"
