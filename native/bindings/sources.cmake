# Bindings: the module (_native's own file), the one checking layer, each layer's API
# registration.
list(APPEND NUMA_MOE_MODULE_SOURCES native/bindings/module.cpp)
list(APPEND NUMA_MOE_SOURCES
  native/bindings/attention_bindings.cpp
  native/bindings/attention_checks.cpp
  native/bindings/checks.cpp
  native/bindings/engine_bindings.cpp
  native/bindings/format_bindings.cpp
  native/bindings/gil.cpp
  native/bindings/kernel_bindings.cpp
  native/bindings/placement_bindings.cpp
)
