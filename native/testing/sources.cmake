# Test hooks (numa_moe._native.testing), only in builds with NUMA_MOE_TEST_HOOKS=ON.
if(NUMA_MOE_TEST_HOOKS)
  list(APPEND NUMA_MOE_MODULE_SOURCES native/testing/testing_module.cpp)
endif()
