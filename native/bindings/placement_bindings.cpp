// Python bindings of the placement layer: syscall wrappers, the interleaved mapping (a
// Python buffer exporter: 1-D, bytes, writable), CPU features. Addresses cross the
// boundary as Python ints; page status arrays as numpy int32, one entry per base page.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <string>
#include <thread>
#include <utility>

#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "common/cpu_features.hpp"
#include "common/segment.hpp"
#include "placement/syscalls.hpp"

namespace py = pybind11;

namespace numa_moe::bindings {
namespace {

using placement::SyscallError;

// The native syscall error: an OSError subclass with errno, strerror and `.call` set.
PyObject* g_syscall_error = nullptr;

void raise_syscall_error(const SyscallError& e) {
    py::tuple args = py::make_tuple(e.error_number(), py::str(e.what()));
    PyObject* instance = PyObject_Call(g_syscall_error, args.ptr(), nullptr);
    if (!instance) return;  // the constructor's own exception stays set
    py::str call(e.call());
    PyObject_SetAttrString(instance, "call", call.ptr());
    PyErr_SetObject(g_syscall_error, instance);
    Py_DECREF(instance);
}

// ValueError unless [address, address + nbytes) stays below the end of the address space.
void check_address_range(std::uintptr_t address, std::size_t nbytes) {
    NUMA_MOE_CHECK(address + nbytes >= address, "the range [", address, ", +", nbytes,
                   " bytes) wraps around the end of the address space");
}

// Pages covering [address, address + nbytes): the base-page-aligned address of each.
std::vector<std::uintptr_t> pages_of(std::uintptr_t address, std::size_t nbytes) {
    const std::size_t page = placement::base_page_bytes();
    const std::uintptr_t first = address / page * page;
    std::vector<std::uintptr_t> pages;
    if (nbytes == 0) return pages;  // zero bytes cover no page (as resident_pages says)
    const std::uintptr_t end = address + nbytes;
    check_address_range(address, nbytes);
    // counted, not `p += page` until end: near the top of the address space p would wrap
    const std::size_t n_pages = (end - 1 - first) / page + 1;
    pages.reserve(n_pages);
    for (std::size_t i = 0; i < n_pages; ++i) pages.push_back(first + i * page);
    return pages;
}

py::dict cpu_features_dict() {
    const CpuFeatures& f = cpu_features();
    const std::pair<const char*, bool> flags[] = {
        {"avx2", f.avx2}, {"fma", f.fma}, {"f16c", f.f16c}, {"avx_vnni", f.avx_vnni}, {"avx512f", f.avx512f}, {"avx512bw", f.avx512bw},
        {"avx512vl", f.avx512vl}, {"avx512dq", f.avx512dq}, {"avx512_bf16", f.avx512_bf16},
        {"avx512_vnni", f.avx512_vnni}, {"avx512_vbmi", f.avx512_vbmi}, {"amx_tile", f.amx_tile}, {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8}, {"os_avx", f.os_avx}, {"os_avx512", f.os_avx512}};
    py::dict d;
    for (const auto& [name, present] : flags) d[name] = present;
    return d;
}

void register_constants_and_errors(py::module_& m) {
    g_syscall_error = PyErr_NewExceptionWithDoc(
        "numa_moe._native.SyscallError",
        "A placement system call failed: OSError with errno, and `.call` naming the call.",
        PyExc_OSError, nullptr);
    m.attr("SyscallError") = py::handle(g_syscall_error);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const SyscallError& e) {
            raise_syscall_error(e);
        }
    });

    m.attr("MPOL_DEFAULT") = placement::kMpolDefault;
    m.attr("MPOL_PREFERRED") = placement::kMpolPreferred;
    m.attr("MPOL_BIND") = placement::kMpolBind;
    m.attr("MPOL_INTERLEAVE") = placement::kMpolInterleave;
    m.attr("MPOL_LOCAL") = placement::kMpolLocal;
    m.attr("HUGE_PAGE_BYTES") = placement::kHugePageBytes;

    m.def("base_page_bytes", &placement::base_page_bytes, "The kernel's base page size in bytes.");
    m.def("cpu_features", &cpu_features_dict, "CPU features from cpuid/xgetbv, as a dict of bools.");
    m.def(
        "request_amx_permission",
        [] {
            std::string reason;
            const bool granted = request_amx_permission(&reason);
            return py::make_tuple(granted, granted ? std::string() : reason);
        },
        "Asks Linux for AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM); returns (granted, reason).");

}

void register_mapping(py::module_& m) {
    py::class_<placement::InterleavedMapping>(m, "InterleavedMapping", py::buffer_protocol(), R"doc(
Anonymous private mapping with MPOL_INTERLEAVE over `nodes`, bound before first touch,
MADV_HUGEPAGE (2 MiB aligned) or MADV_NOHUGEPAGE, populated by `touch_threads` threads.
Exposes the buffer protocol (1-D, bytes, writable); munmapped when the object dies,
which numpy/torch views prevent while they are alive.)doc")
        .def(py::init([](std::size_t nbytes, const std::vector<int>& nodes, bool huge_pages, int touch_threads) {
                 NoGil released;
                 return new placement::InterleavedMapping(nbytes, nodes, huge_pages, touch_threads);
             }),
             py::arg("nbytes"), py::arg("nodes"), py::arg("huge_pages") = false, py::arg("touch_threads") = 0)
        .def_property_readonly("address", [](const placement::InterleavedMapping& self) {
            return reinterpret_cast<std::uintptr_t>(self.data());
        })
        .def_property_readonly("nbytes", &placement::InterleavedMapping::nbytes)
        .def_property_readonly("mapped_bytes", &placement::InterleavedMapping::mapped_bytes)
        .def_property_readonly("page_bytes", &placement::InterleavedMapping::page_bytes)
        .def_property_readonly("huge_pages", &placement::InterleavedMapping::huge_pages)
        .def_property_readonly("nodes", [](const placement::InterleavedMapping& self) {
            return py::tuple(py::cast(self.nodes()));
        })
        .def_buffer([](placement::InterleavedMapping& self) {
            return py::buffer_info(self.data(), 1, py::format_descriptor<unsigned char>::format(), 1,
                                   {static_cast<py::ssize_t>(self.nbytes())}, {py::ssize_t{1}});
        });

    m.def("live_interleaved_mappings", [] { return placement::InterleavedMapping::live_count().load(); },
          "Number of InterleavedMapping objects not yet unmapped.");

}

// Page queries and policies of address ranges, and affinity.
void register_page_calls(py::module_& m) {
    m.def(
        "page_nodes",
        [](std::uintptr_t address, std::size_t nbytes) {
            std::vector<std::uintptr_t> pages = pages_of(address, nbytes);
            py::array_t<int32_t> status(static_cast<py::ssize_t>(pages.size()));
            int* out = status.mutable_data();
            {
                NoGil released;
                placement::query_page_nodes(pages.data(), pages.size(), out);
            }
            return status;
        },
        py::arg("address"), py::arg("nbytes"),
        "move_pages(2) query (NULL nodes) of each base page covering [address, address+nbytes): "
        "node id, or negative errno (-ENOENT not present, -EFAULT unmapped or zero page).");

    m.def(
        "resident_pages",
        [](std::uintptr_t address, std::size_t nbytes) {
            const std::size_t page = placement::base_page_bytes();
            check_address_range(address, nbytes);
            const std::uintptr_t first = address & ~(static_cast<std::uintptr_t>(page) - 1);
            const std::size_t length = nbytes == 0 ? 0 : address + nbytes - first;
            py::array_t<uint8_t> resident(static_cast<py::ssize_t>((length + page - 1) / page));
            unsigned char* out = resident.mutable_data();
            {
                NoGil released;
                placement::query_resident_pages(reinterpret_cast<const void*>(first), length, out);
            }
            return resident;
        },
        py::arg("address"), py::arg("nbytes"),
        "mincore(2) of each base page covering [address, address+nbytes): 1 if resident, else 0.");

    m.def(
        "move_pages",
        [](std::uintptr_t address, std::size_t nbytes, py::array_t<int32_t, py::array::c_style | py::array::forcecast> targets) {
            std::vector<std::uintptr_t> pages = pages_of(address, nbytes);
            NUMA_MOE_CHECK(targets.ndim() == 1 && static_cast<std::size_t>(targets.shape(0)) == pages.size(),
                           "move_pages: targets must be 1-D with one node per page (", pages.size(),
                           " pages), got shape ", targets.ndim() == 1 ? targets.shape(0) : -1);
            py::array_t<int32_t> status(static_cast<py::ssize_t>(pages.size()));
            int* out = status.mutable_data();
            const int* target_nodes = targets.data();
            long not_migrated = 0;
            {
                NoGil released;
                not_migrated = placement::move_pages_to(pages.data(), target_nodes, pages.size(), out);
            }
            return py::make_tuple(status, not_migrated);
        },
        py::arg("address"), py::arg("nbytes"), py::arg("targets"),
        "move_pages(2) with MPOL_MF_MOVE of each base page to targets[i]; returns (status, not_migrated).");

    m.def(
        "get_mempolicy",
        [](std::uintptr_t address) {
            placement::MemPolicy policy = placement::get_mempolicy_of(reinterpret_cast<const void*>(address));
            return py::make_tuple(policy.mode, py::tuple(py::cast(policy.nodes)));
        },
        py::arg("address") = 0,
        "get_mempolicy(2): (mode, nodes) of the VMA holding `address` (MPOL_F_ADDR), or of the "
        "calling thread when address is 0.");
    m.def("mems_allowed", [] { return py::tuple(py::cast(placement::mems_allowed())); },
          "Nodes this process may allocate on (get_mempolicy MPOL_F_MEMS_ALLOWED).");
    m.def("sched_getaffinity", [](int pid) { return py::tuple(py::cast(placement::get_affinity(pid))); },
          py::arg("pid") = 0);
    m.def("sched_setaffinity", &placement::set_affinity, py::arg("pid"), py::arg("cpus"));
    m.def("hardware_threads", [] { return std::thread::hardware_concurrency(); });
}

// The partition rule of common/segment.hpp for numa_moe.segments, which has no rule of its
// own: node n's segments are node_segments[n] (an int64 [k, 5] array, or None for none).
void register_segment_checks(py::module_& m) {
    m.def(
        "check_partition",
        [](const py::list& node_segments, int64_t rows, int64_t cols, const std::string& what) {
            std::vector<std::vector<Segment>> segments;
            for (size_t n = 0; n < node_segments.size(); ++n)
                segments.push_back(read_segments(node_segments[n], message(what, " of node ", n), rows, cols));
            check_partition(segments, rows, cols, what);
        },
        py::arg("node_segments"), py::arg("rows"), py::arg("cols"), py::arg("what") = "segments",
        "ValueError unless every segment lies in the rows x cols matrix and the nodes' segments "
        "together cover each element exactly once.");
}

}  // namespace

void register_placement(py::module_& m) {
    register_constants_and_errors(m);
    register_mapping(m);
    register_page_calls(m);
    register_segment_checks(m);
}

}  // namespace numa_moe::bindings
