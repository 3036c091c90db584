# Kernels: one translation unit per instruction set, each with its own flags.
list(APPEND NUMA_MOE_SOURCES
  native/kernels/dispatch.cpp
  native/kernels/ref.cpp
  native/kernels/kernel_bindings.cpp
)
