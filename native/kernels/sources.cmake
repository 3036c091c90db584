# Kernels: one translation unit per instruction set, each with its own flags (the rest of
# the library is baseline x86-64; dispatch.cpp picks a table at run time).
set(NUMA_MOE_AVX512_FLAGS -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma)
list(APPEND NUMA_MOE_SOURCES
  native/kernels/dispatch.cpp
  native/kernels/ref.cpp
  native/kernels/kernel_pool.cpp
  native/kernels/expert_ffn.cpp
  native/kernels/kernel_bindings.cpp
)
# Linked after every baseline object, least demanding first (see CMakeLists.txt).
list(APPEND NUMA_MOE_ISA_SOURCES
  native/kernels/avx2.cpp
  native/kernels/avx512_bf16.cpp
  native/kernels/amx_bf16_model.cpp
  native/kernels/amx_bf16.cpp
)
set_source_files_properties(native/kernels/avx2.cpp PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma")
set_source_files_properties(native/kernels/avx512_bf16.cpp PROPERTIES COMPILE_OPTIONS "${NUMA_MOE_AVX512_FLAGS}")
set_source_files_properties(native/kernels/amx_bf16.cpp PROPERTIES COMPILE_OPTIONS "${NUMA_MOE_AVX512_FLAGS};-mamx-tile;-mamx-bf16")
set_source_files_properties(native/kernels/amx_bf16_model.cpp PROPERTIES COMPILE_OPTIONS "${NUMA_MOE_AVX512_FLAGS}")
