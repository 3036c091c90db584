// The emulated AMX build: amx_bf16.cpp compiled against the AMX software model
// (amx_model.hpp). A second translation unit because CMake gives one source file one set
// of flags; this one gets the AVX-512 flags but no -mamx-*.
#define NUMA_MOE_AMX_MODEL 1
#include "kernels/amx_bf16.cpp"
