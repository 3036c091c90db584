// The per-ISA KernelOps tables, each defined in the translation
// unit compiled with that ISA's flags. Only dispatch.cpp and the bindings include this;
// callers reach the tables through kernel_ops(Isa).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

const KernelOps& avx2_ops();       // avx2.cpp        (-mavx2 -mfma)
const KernelOps& avx512_ops();     // avx512_bf16.cpp (-mavx512f/bw/vl/bf16 -mfma)
const KernelOps& avx512_int8_ops();  // avx512_quant.cpp (... and -mavx512vnni)
const KernelOps& avx512_int4_ops();  // avx512_quant.cpp
const KernelOps& amx_ops();        // amx_bf16.cpp    (real AMX instructions)
const KernelOps& amx_model_ops();  // amx_bf16_model.cpp: amx_bf16.cpp against the AMX model
const KernelOps& amx_int8_ops();         // amx_quant.cpp   (real AMX-INT8 instructions)
const KernelOps& amx_int4_ops();         // amx_quant.cpp
const KernelOps& amx_model_int8_ops();   // amx_quant_model.cpp: amx_quant.cpp against the AMX model
const KernelOps& amx_model_int4_ops();   // amx_quant_model.cpp

}  // namespace numa_moe::kernels
