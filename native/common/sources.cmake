# Common: pieces every area may use (CPU features, the persistent pinned worker pool).
# Baseline x86-64 only: this code must import on any CPU (the numa-vm guest has AVX2 only).
list(APPEND NUMA_MOE_SOURCES
  native/common/cpu_features.cpp
  native/common/worker_pool.cpp
)
