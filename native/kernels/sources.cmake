# Kernels: one translation unit per instruction set, each with its own flags and its own
# NUMA_MOE_ISA_NS (common/isa_namespace.hpp); the rest of the library is baseline x86-64
# and dispatch.cpp picks a table at run time.
set(NUMA_MOE_AVX512_FLAGS -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma)
list(APPEND NUMA_MOE_SOURCES
  native/kernels/dispatch.cpp
  native/kernels/names.cpp
  native/kernels/ref_bf16.cpp
  native/kernels/ref_quant.cpp
  native/kernels/amx_model.cpp
  native/kernels/attention_dispatch.cpp
  native/kernels/attention_ref.cpp
)
list(APPEND NUMA_MOE_ISA_SOURCES
  native/kernels/avx2_bf16.cpp
  native/kernels/avx2_quant.cpp
  native/kernels/avx2_vnni_quant.cpp
  native/kernels/avx512_bf16.cpp
  native/kernels/avx512_quant.cpp
  native/kernels/avx512_vbmi_quant.cpp
  native/kernels/amx_bf16_model.cpp
  native/kernels/amx_bf16.cpp
  native/kernels/amx_quant_model.cpp
  native/kernels/amx_quant.cpp
  native/kernels/attention_avx2.cpp
  native/kernels/attention_avx512.cpp
  native/kernels/attention_amx_model.cpp
  native/kernels/attention_amx.cpp
)
numa_moe_isa_source(native/kernels/avx2_bf16.cpp avx2 -mavx2 -mfma)
# The integer kernels round as the reference: no contraction.
numa_moe_isa_source(native/kernels/avx2_quant.cpp avx2_quant -mavx2 -mfma -mf16c -ffp-contract=off)
numa_moe_isa_source(native/kernels/avx2_vnni_quant.cpp avx2_vnni_quant -mavx2 -mfma -mf16c -mavxvnni -ffp-contract=off)
numa_moe_isa_source(native/kernels/avx512_bf16.cpp avx512 ${NUMA_MOE_AVX512_FLAGS})
# The integer kernels also need VNNI; no contraction, so that they round as the reference.
numa_moe_isa_source(native/kernels/avx512_quant.cpp avx512_vnni ${NUMA_MOE_AVX512_FLAGS} -mavx512vnni -ffp-contract=off)
# ... and its mxfp4 table once more with VBMI's vpermb, for the CPUs that have it.
numa_moe_isa_source(native/kernels/avx512_vbmi_quant.cpp avx512_vbmi ${NUMA_MOE_AVX512_FLAGS} -mavx512vnni -mavx512vbmi
                    -ffp-contract=off)
# The AMX software-model builds run on every AVX2 CPU: AVX2 flags, the AVX-512 intrinsics of
# the shared epilogues from SIMDe (avx512_emulated.hpp). -Wno-psabi: its 512-bit values are
# returned from internal functions only, so the ABI note does not apply.
set(NUMA_MOE_AMX_MODEL_FLAGS -mavx2 -mfma -Wno-psabi)
numa_moe_isa_source(native/kernels/amx_bf16_model.cpp amx_model ${NUMA_MOE_AMX_MODEL_FLAGS})
numa_moe_isa_source(native/kernels/amx_bf16.cpp amx ${NUMA_MOE_AVX512_FLAGS} -mamx-tile -mamx-bf16)
# The AMX integer kernels, no contraction either (their fp32 epilogue rounds as ref's).
numa_moe_isa_source(native/kernels/amx_quant_model.cpp amx_quant_model ${NUMA_MOE_AMX_MODEL_FLAGS} -ffp-contract=off)
numa_moe_isa_source(native/kernels/amx_quant.cpp amx_quant ${NUMA_MOE_AVX512_FLAGS} -mamx-tile -mamx-int8 -ffp-contract=off)
# Decode attention (attention_api.hpp): the same ISA rules, its own tables.
numa_moe_isa_source(native/kernels/attention_avx2.cpp attn_avx2 -mavx2 -mfma)
numa_moe_isa_source(native/kernels/attention_avx512.cpp attn_avx512 ${NUMA_MOE_AVX512_FLAGS})
numa_moe_isa_source(native/kernels/attention_amx_model.cpp attn_amx_model ${NUMA_MOE_AMX_MODEL_FLAGS})
numa_moe_isa_source(native/kernels/attention_amx.cpp attn_amx ${NUMA_MOE_AVX512_FLAGS} -mamx-tile -mamx-bf16)
# The emulated builds, test builds only (NUMA_MOE_TEST_HOOKS): the AVX-512 kernel sources with
# AVX2 flags and SIMDe's AVX-512 (avx512_emulated.hpp), the AVX2 ones with baseline flags and
# SIMDe's AVX2 (avx2_emulated.hpp), so that the tests run every kernel on every CPU.
# -O1 -fno-lto: GCC 12 at -O2 / -O3 spends over 20 minutes on avx512_quant_emulated.cpp (its
# templates over SIMDe's inlined 512-bit code), at -O1 a minute; a test build needs no more.
if(NUMA_MOE_TEST_HOOKS)
  list(APPEND NUMA_MOE_ISA_SOURCES
    native/kernels/avx2_bf16_emulated.cpp
    native/kernels/avx2_quant_emulated.cpp
    native/kernels/avx2_vnni_quant_emulated.cpp
    native/kernels/attention_avx2_emulated.cpp
    native/kernels/avx512_bf16_emulated.cpp
    native/kernels/avx512_quant_emulated.cpp
    native/kernels/avx512_vbmi_quant_emulated.cpp
    native/kernels/attention_avx512_emulated.cpp
  )
  numa_moe_isa_source(native/kernels/avx2_bf16_emulated.cpp avx2_emulated -Wno-psabi -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/avx2_quant_emulated.cpp avx2_quant_emulated -Wno-psabi -ffp-contract=off -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/avx2_vnni_quant_emulated.cpp avx2_vnni_quant_emulated -Wno-psabi -ffp-contract=off
                      -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/attention_avx2_emulated.cpp attn_avx2_emulated -Wno-psabi -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/avx512_bf16_emulated.cpp avx512_emulated ${NUMA_MOE_AMX_MODEL_FLAGS} -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/avx512_quant_emulated.cpp avx512_vnni_emulated ${NUMA_MOE_AMX_MODEL_FLAGS}
                      -ffp-contract=off -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/avx512_vbmi_quant_emulated.cpp avx512_vbmi_emulated ${NUMA_MOE_AMX_MODEL_FLAGS}
                      -ffp-contract=off -O1 -fno-lto)
  numa_moe_isa_source(native/kernels/attention_avx512_emulated.cpp attn_avx512_emulated ${NUMA_MOE_AMX_MODEL_FLAGS}
                      -O1 -fno-lto)
endif()
