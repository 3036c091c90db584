# The benchmark harness, its own module numa_moe._native_bench: baseline registration, ISA
# loops.
list(APPEND NUMA_MOE_BENCH_SOURCES
  native/bench/bench_module.cpp
  native/bench/avx2_loops.cpp
  native/bench/avx512_loops.cpp
  native/bench/amx_loops.cpp
)
numa_moe_isa_source(native/bench/avx2_loops.cpp bench_avx2 -mavx2 -mfma)
numa_moe_isa_source(native/bench/avx512_loops.cpp bench_avx512 ${NUMA_MOE_AVX512_FLAGS})
numa_moe_isa_source(native/bench/amx_loops.cpp bench_amx -mamx-tile -mamx-bf16 -mamx-int8)
