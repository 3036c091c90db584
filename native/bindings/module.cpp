// The numa_moe._native extension: the public API of each layer, registered by that
// layer's binding file, and, in test builds only (NUMA_MOE_TEST_HOOKS), the test hooks as
// `testing`. The benchmark harness is its own module, numa_moe._native_bench
// (bench/bench_module.cpp).
#include <pybind11/pybind11.h>

#include "bindings/gil.hpp"

namespace numa_moe::bindings {
void register_placement(pybind11::module_& m);
void register_formats(pybind11::module_& m);
void register_kernels(pybind11::module_& m);
void register_engine(pybind11::module_& m);
void register_attention(pybind11::module_& m);
}  // namespace numa_moe::bindings
#ifdef NUMA_MOE_TEST_HOOKS
namespace numa_moe::testing {
void register_testing(pybind11::module_& m);
}
#endif

PYBIND11_MODULE(_native, m) {
    m.doc() = "numa-moe native core: placement syscalls, weight-format conversions, expert FFN kernels, per-node workers";
    numa_moe::bindings::register_placement(m);
    numa_moe::bindings::register_formats(m);
    numa_moe::bindings::register_kernels(m);
    numa_moe::bindings::register_engine(m);
    numa_moe::bindings::register_attention(m);
    // Daemon threads inside native calls at interpreter exit (bindings/gil.hpp).
    pybind11::module_::import("atexit").attr("register")(
        pybind11::cpp_function([] { numa_moe::bindings::prepare_exit(); }));
#ifdef NUMA_MOE_TEST_HOOKS
    numa_moe::testing::register_testing(m);
#endif
}
