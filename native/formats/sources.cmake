# Formats: conversions of checkpoint weight encodings into the store's layouts. Baseline
# x86-64 only (they stream bytes; the loader calls them on any CPU).
list(APPEND NUMA_MOE_SOURCES
  native/formats/ggml_blocks.cpp
  native/formats/group_quant.cpp
  native/formats/fp8_blocks.cpp
)
