#include <pybind11/pybind11.h>

namespace numa_moe {
void register_workers(pybind11::module_& m) { (void)m; }
}  // namespace numa_moe
