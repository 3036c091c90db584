# Placement: syscalls (mmap/mbind/move_pages/get_mempolicy), CPU features, affinity.
list(APPEND NUMA_MOE_SOURCES
  native/common/cpu_features.cpp
  native/placement/placement_bindings.cpp
)
