# Per-node pinned workers and the cross-node reduction.
list(APPEND NUMA_MOE_SOURCES
  native/workers/moe_layer.cpp
  native/workers/worker_bindings.cpp
)
