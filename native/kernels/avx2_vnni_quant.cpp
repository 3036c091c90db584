// The AVX-VNNI build of avx2_quant.cpp (vpdpbusd in its VEX form, Intel Alder Lake and later,
// AMD Zen 5): the same source with -mavxvnni, chosen for the avx2 integer tables where the CPU
// has AVX-VNNI (dispatch.cpp). A translation unit of its own for its own flags.
#define NUMA_MOE_AVX_VNNI 1
#include "kernels/avx2_quant.cpp"
