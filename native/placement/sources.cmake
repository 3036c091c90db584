# Placement: syscalls (mmap/mbind/move_pages/get_mempolicy), affinity.
# Baseline x86-64 only: this code must import on any CPU (the numa-vm guest has AVX2 only).
list(APPEND NUMA_MOE_SOURCES
  native/placement/syscalls.cpp
  native/placement/placement_bindings.cpp
)
