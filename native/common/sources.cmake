# Common: pieces every layer may use (CPU features, the worker pool, segments, utilities).
# Baseline x86-64 only: this code must import on any CPU (the VM guests have AVX2 only).
list(APPEND NUMA_MOE_SOURCES
  native/common/cpu_features.cpp
  native/common/openmp_team.cpp
  native/common/segment.cpp
  native/common/util.cpp
  native/common/worker_pool.cpp
)
