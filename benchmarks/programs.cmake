# The measurement programs of benchmarks/*.cpp (CMakeLists.txt includes this file with
# -DNUMA_MOE_BENCHMARKS=ON; `cmake --build DIR --target benchmarks` builds them all), each
# with the flags its header comment gives. They only compile on a machine without AMX; they
# run where their instructions do. ggml_moe_step.cpp is not among them: it builds against
# the ggml that tools/build-ggml.sh checks out (its own header has the command).
add_custom_target(benchmarks)
set(NUMA_MOE_BENCH_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma)

function(numa_moe_benchmark name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "SOURCES;OPTIONS;DEFINITIONS")
  add_executable(${name} ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/native)
  # -Wno-(maybe-)uninitialized: GCC 12 flags the _mm512_undefined_*() placeholders inside its
  # own avx512fintrin.h once their intrinsics are inlined here (none in our code); the
  # library's LTO build does not show them.
  target_compile_options(${name} PRIVATE ${NUMA_MOE_WARNINGS} -Wno-uninitialized -Wno-maybe-uninitialized
                         ${ARG_OPTIONS})
  target_compile_definitions(${name} PRIVATE ${ARG_DEFINITIONS})
  target_link_libraries(${name} PRIVATE Threads::Threads)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/benchmarks)
  add_dependencies(benchmarks ${name})
endfunction()

numa_moe_benchmark(amx_stream_overlap
  SOURCES benchmarks/amx_stream_overlap.cpp native/common/cpu_features.cpp
  OPTIONS -O2 -mamx-tile -mamx-int8 -mavx512f)
numa_moe_benchmark(amx_vector_overlap
  SOURCES benchmarks/amx_vector_overlap.cpp native/common/cpu_features.cpp
  OPTIONS -O2 -ffp-contract=off -mamx-tile -mamx-int8 -mavx512f)
numa_moe_benchmark(attention_kernel_loop
  SOURCES benchmarks/attention_kernel_loop.cpp native/kernels/names.cpp
  OPTIONS -O3 ${NUMA_MOE_BENCH_AVX512}
  DEFINITIONS [=[KERNEL="native/kernels/attention_avx512.cpp"]=])
numa_moe_benchmark(combine_loop
  SOURCES benchmarks/combine_loop.cpp
  OPTIONS -O3 ${NUMA_MOE_BENCH_AVX512}
  DEFINITIONS NDEBUG)
numa_moe_benchmark(quant_kernel_loop
  SOURCES benchmarks/quant_kernel_loop.cpp native/common/util.cpp native/common/segment.cpp
          native/common/cpu_features.cpp native/kernels/names.cpp
  OPTIONS -O3 ${NUMA_MOE_BENCH_AVX512} -mavx512vnni -ffp-contract=off -falign-functions=64 -falign-loops=64
  DEFINITIONS NDEBUG [=[KERNEL="kernels/avx512_quant.cpp"]=])
numa_moe_benchmark(row_stream_read
  SOURCES benchmarks/row_stream_read.cpp
  OPTIONS -O3 -mavx512f -mavx512bw -mavx512vnni)
