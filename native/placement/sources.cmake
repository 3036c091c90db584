# Placement: syscalls (mmap/mbind/move_pages/get_mempolicy), affinity. Baseline x86-64.
list(APPEND NUMA_MOE_SOURCES
  native/placement/syscalls.cpp
)
