# Per-node pinned workers and the cross-node reduction.
list(APPEND NUMA_MOE_SOURCES
  native/workers/worker_pool.cpp
  native/workers/moe_layer.cpp
  native/workers/worker_bindings.cpp
)
