// The numa_moe._native extension: each layer registers its own bindings.
#include <pybind11/pybind11.h>

namespace numa_moe {
void register_placement(pybind11::module_& m);
void register_kernels(pybind11::module_& m);
void register_workers(pybind11::module_& m);
}  // namespace numa_moe

PYBIND11_MODULE(_native, m) {
    m.doc() = "numa-moe native core: placement syscalls, expert FFN kernels, per-node workers";
    numa_moe::register_placement(m);
    numa_moe::register_kernels(m);
    numa_moe::register_workers(m);
}
