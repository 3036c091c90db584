// The per-ISA KernelOps tables, each defined in the translation
// unit compiled with that ISA's flags. Only dispatch.cpp and the bindings include this;
// callers reach the tables through kernel_ops(Isa).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

const KernelOps& avx2_ops();       // avx2_bf16.cpp   (-mavx2 -mfma)
// avx2_quant.cpp (-mavx2 -mfma -mf16c): int8 / int4, nullptr for a group outside
// kIntegerGroups; avx2_vnni_quant.cpp, the same source with AVX-VNNI's vpdpbusd, serves the
// avx2 integer tables of CPUs that have it.
const KernelOps* avx2_integer_ops(Format format, int64_t group);
const KernelOps* avx2_vnni_integer_ops(Format format, int64_t group);
const KernelOps& avx512_ops();     // avx512_bf16.cpp (-mavx512f/bw/vl/bf16 -mfma)
// avx512_quant.cpp (... and -mavx512vnni): int8 / int4, nullptr for a group outside
// kIntegerGroups.
const KernelOps* avx512_integer_ops(Format format, int64_t group);
// avx512_vbmi_quant.cpp (... and -mavx512vbmi): the codebook formats' tables alone (mxfp4,
// iq4nl), nullptr otherwise.
const KernelOps* avx512_vbmi_integer_ops(Format format, int64_t group);
const KernelOps& amx_ops();        // amx_bf16.cpp    (real AMX instructions)
const KernelOps& amx_model_ops();  // amx_bf16_model.cpp: amx_bf16.cpp against the AMX model
// amx_quant.cpp (real AMX-INT8 instructions), amx_quant_model.cpp (the same source against
// the AMX model): int8 / int4, nullptr for a group outside kIntegerGroups.
const KernelOps* amx_integer_ops(Format format, int64_t group);
const KernelOps* amx_model_integer_ops(Format format, int64_t group);
// Test builds only (NUMA_MOE_TEST_HOOKS): avx2_bf16.cpp / avx2_quant.cpp over SIMDe's AVX2 at baseline
// flags (avx2_bf16_emulated.cpp, avx2_quant_emulated.cpp), avx512_bf16.cpp / avx512_quant.cpp over
// SIMDe's AVX-512 at AVX2 flags (avx512_bf16_emulated.cpp, avx512_quant_emulated.cpp).
const KernelOps& avx2_emulated_ops();
const KernelOps* avx2_emulated_integer_ops(Format format, int64_t group);
// avx2_vnni_quant_emulated.cpp: the AVX-VNNI build of avx2_quant.cpp over SIMDe.
const KernelOps* avx2_vnni_emulated_integer_ops(Format format, int64_t group);
const KernelOps& avx512_emulated_ops();
const KernelOps* avx512_emulated_integer_ops(Format format, int64_t group);
// avx512_vbmi_quant_emulated.cpp: the VBMI build's tables over SIMDe.
const KernelOps* avx512_vbmi_emulated_integer_ops(Format format, int64_t group);

}  // namespace numa_moe::kernels
