// The VBMI build of avx512_quant.cpp's codebook formats' (mxfp4, iq4nl) tables: the same
// source with -mavx512vbmi, whose vpermb looks their codes up without masking the nibbles
// (biased_low_nibbles). Chosen for avx512 mxfp4 and iq4nl where the CPU has VBMI
// (dispatch.cpp): every CPU with the avx512 integer kernels but Cooper Lake. A translation unit of its own for its own flags.
#define NUMA_MOE_AVX512_VBMI 1
#include "kernels/avx512_quant.cpp"
