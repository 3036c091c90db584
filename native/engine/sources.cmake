# Engine: the expert FFN pipeline, the layer step and the single-expert path over worker
# pools. Baseline x86-64: all ISA work goes through KernelOps.
list(APPEND NUMA_MOE_SOURCES
  native/engine/attention.cpp
  native/engine/expert_ffn.cpp
  native/engine/kernel_choice.cpp
  native/engine/moe_layer.cpp
  native/engine/pipeline.cpp
  native/engine/process_pool.cpp
  native/engine/routing.cpp
)
