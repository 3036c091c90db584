// Python bindings of the worker pool and the MoE layer step. Every array handed over is
// checked here (dtype, shape, contiguity) before any pointer reaches a kernel.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>

#include <atomic>
#include <optional>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "workers/moe_layer.hpp"
#include "common/worker_pool.hpp"

namespace py = pybind11;

namespace numa_moe {
namespace {

using workers::ExpertParts;
using workers::MatrixPart;
using workers::MoELayerCore;

// A 2-D array of 2-byte elements (bf16 as uint16 / int16 / ml_dtypes.bfloat16) with
// contiguous rows.
const uint16_t* bf16_matrix(const py::array& a, int64_t* rows, int64_t* cols, int64_t* ld, const std::string& what) {
    if (a.itemsize() != 2 || a.dtype().kind() == 'f')
        throw py::value_error(what + ": expected bf16 data as a uint16/int16/bfloat16 array, got dtype " +
                              std::string(py::str(a.dtype())));
    if (a.ndim() != 2) throw py::value_error(what + ": expected a 2-D array, got " + std::to_string(a.ndim()) + "-D");
    // An empty array has no bytes to lay out (numpy may report zero strides for it).
    const bool empty = a.shape(0) == 0 || a.shape(1) == 0;
    if (!empty && (a.strides(1) != 2 || a.strides(0) % 2 != 0 || (a.shape(0) > 1 && a.strides(0) < 2 * a.shape(1))))
        throw py::value_error(what + ": rows must be contiguous (strides " + std::to_string(a.strides(0)) + ", " +
                              std::to_string(a.strides(1)) + " bytes)");
    *rows = a.shape(0);
    *cols = a.shape(1);
    *ld = a.shape(0) > 1 && !empty ? a.strides(0) / 2 : a.shape(1);
    return static_cast<const uint16_t*>(a.data());
}

std::vector<std::vector<Segment>> node_segments(const py::list& per_node, const std::string& what) {
    std::vector<std::vector<Segment>> result;
    for (size_t n = 0; n < per_node.size(); ++n) {
        py::array arr = py::reinterpret_borrow<py::array>(per_node[n]);
        if (!py::isinstance<py::array_t<int64_t>>(per_node[n]) || arr.ndim() != 2 || arr.shape(1) != 5 ||
            !(arr.flags() & py::array::c_style))
            throw py::value_error(what + " segments of node " + std::to_string(n) +
                                  ": expected a C-contiguous int64 array of shape [n, 5] (row0, row_stride, nrows, k0, k1)");
        const Segment* s = static_cast<const Segment*>(arr.data());
        result.emplace_back(s, s + arr.shape(0));
    }
    return result;
}

// Keeps the weight arrays alive as long as the layer.
struct PyLayer {
    std::unique_ptr<MoELayerCore> core;
    std::vector<py::object> keep_alive;
};

// The matrix `kind` ("gate", "up", "down") of an expert, with errors for a bad index or kind.
const MatrixPart& matrix_part(const PyLayer& l, int64_t expert, const std::string& kind) {
    if (expert < 0 || expert >= l.core->n_experts())
        throw py::value_error("expert " + std::to_string(expert) + " is out of range (the layer has " +
                              std::to_string(l.core->n_experts()) + " expert(s))");
    const ExpertParts& p = l.core->expert(expert);
    if (kind == "gate") return p.gate;
    if (kind == "up") return p.up;
    if (kind == "down") return p.down;
    throw py::value_error("unknown matrix kind '" + kind + "' (gate, up, down)");
}

bool check_signals() {
    py::gil_scoped_acquire gil;
    return PyErr_CheckSignals() == 0;
}

}  // namespace

void register_workers(py::module_& m) {
    py::class_<WorkerPool, std::shared_ptr<WorkerPool>>(m, "WorkerPool", R"doc(
Persistent worker threads, one group per node, each thread pinned to one CPU of its node.
node_cpus[n] lists node n's CPUs (one thread per CPU). Threads start on first use.)doc")
        .def(py::init([](std::vector<std::vector<int>> node_cpus, bool pin, int64_t spin_us, int caller_cpu) {
                 try {
                     return std::make_shared<WorkerPool>(std::move(node_cpus), pin, spin_us, caller_cpu);
                 } catch (const std::invalid_argument& e) {
                     throw py::value_error(e.what());
                 }
             }),
             py::arg("node_cpus"), py::arg("pin") = true, py::arg("spin_us") = 50, py::arg("caller_cpu") = -1)
        .def_property_readonly("n_nodes", &WorkerPool::n_nodes)
        .def_property_readonly("n_threads", &WorkerPool::n_threads)
        .def_property_readonly("participants", &WorkerPool::participants)
        .def_property_readonly("node_cpus", &WorkerPool::node_cpus)
        .def_property_readonly("started", &WorkerPool::started)
        .def_property_readonly("start_count", &WorkerPool::start_count)
        .def("threads_of", [](const WorkerPool& p, int node) {
            if (node < 0 || node >= p.n_nodes())
                throw py::value_error("node " + std::to_string(node) + " is not in the pool (" +
                                      std::to_string(p.n_nodes()) + " nodes)");
            return p.threads_of(node);
        }, py::arg("node"))
        .def("start", [](WorkerPool& p) {
            py::gil_scoped_release release;
            p.start();
        })
        .def("shutdown", [](WorkerPool& p) {
            py::gil_scoped_release release;
            p.shutdown();
        })
        .def("thread_affinity", [](WorkerPool& p) {
            // (node, local, cpu set) seen by each worker thread itself
            std::vector<std::vector<int>> cpus(p.n_threads());
            {
                py::gil_scoped_release release;
                p.run([&](const ThreadInfo& ti) {
                    cpu_set_t set;
                    CPU_ZERO(&set);
                    if (sched_getaffinity(0, sizeof(set), &set) == 0)
                        for (int c = 0; c < CPU_SETSIZE; ++c)
                            if (CPU_ISSET(c, &set)) cpus[ti.global].push_back(c);
                });
            }
            py::list result;
            for (const ThreadInfo& ti : p.threads()) result.append(py::make_tuple(ti.node, ti.local, cpus[ti.global]));
            return result;
        }, "Runs a job that reports, per worker thread, (node, local index, its CPU affinity).")
        .def("barrier_check", [](WorkerPool& p, int rounds) {
            // Each round every thread adds one, crosses a barrier, and checks that all did.
            std::atomic<int64_t> counter{0};
            std::atomic<int64_t> failures{0};
            {
                py::gil_scoped_release release;
                const int n = p.participants();
                p.run([&](const ThreadInfo&) {
                    for (int r = 0; r < rounds; ++r) {
                        counter.fetch_add(1);
                        p.barrier();
                        if (counter.load() < static_cast<int64_t>(n) * (r + 1)) failures.fetch_add(1);
                        p.barrier();
                    }
                });
            }
            return py::make_tuple(counter.load(), failures.load());
        }, py::arg("rounds"), "Self-test of the barrier: returns (increments, failures).")
        .def("participant_cpus", [](WorkerPool& p) {
            // The CPU each participant of one run is on (caller last when it joins), and
            // the calling thread's affinity during its share.
            std::vector<int> cpus(p.participants(), -2);
            std::vector<int> caller_affinity;
            {
                py::gil_scoped_release release;
                p.run([&](const ThreadInfo& ti) {
                    cpus[ti.global] = sched_getcpu();
                    if (ti.global == p.n_threads()) {
                        cpu_set_t set;
                        CPU_ZERO(&set);
                        if (sched_getaffinity(0, sizeof(set), &set) == 0)
                            for (int c = 0; c < CPU_SETSIZE; ++c)
                                if (CPU_ISSET(c, &set)) caller_affinity.push_back(c);
                    }
                });
            }
            return py::make_tuple(cpus, caller_affinity);
        }, "Runs a job that reports the CPU of every participant and the caller's affinity.")
        .def("busy_job", [](WorkerPool& p, double seconds) {
            // Every thread works in 1 ms slices for `seconds`, stopping early when the
            // caller aborts; Ctrl-C on the caller raises KeyboardInterrupt (tests).
            bool completed;
            {
                py::gil_scoped_release release;
                p.run([&](const ThreadInfo&) {
                    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
                    while (std::chrono::steady_clock::now() < end && !p.aborted())
                        std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    p.barrier();
                }, check_signals);
                completed = !p.aborted();
            }
            if (!completed) throw py::error_already_set();
            return completed;
        }, py::arg("seconds"));

    py::class_<PyLayer>(m, "MoELayerCore", R"doc(
The NUMA-partitioned MoE layer step over a WorkerPool (see numa_moe.moe.MoELayer).)doc")
        .def(py::init([](std::shared_ptr<WorkerPool> pool, int64_t hidden, int64_t intermediate) {
                 try {
                     return PyLayer{std::make_unique<MoELayerCore>(std::move(pool), hidden, intermediate), {}};
                 } catch (const std::invalid_argument& e) {
                     throw py::value_error(e.what());
                 }
             }),
             py::arg("pool"), py::arg("hidden"), py::arg("intermediate"))
        .def_property_readonly("n_experts", [](const PyLayer& l) { return l.core->n_experts(); })
        .def_property_readonly("hidden", [](const PyLayer& l) { return l.core->hidden(); })
        .def_property_readonly("intermediate", [](const PyLayer& l) { return l.core->intermediate(); })
        .def("add_expert",
             [](PyLayer& l, py::array gate, py::array up, py::array down, py::list gate_segments,
                py::list up_segments, py::list down_segments, bool verify_partition) {
                 const std::string name = "expert " + std::to_string(l.core->n_experts());
                 ExpertParts parts;
                 auto fill = [&](MatrixPart& mp, const py::array& a, const py::list& segs, const char* kind) {
                     mp.w = bf16_matrix(a, &mp.rows, &mp.cols, &mp.ldw, name + " " + kind);
                     mp.node_segments = node_segments(segs, name + " " + kind);
                 };
                 fill(parts.gate, gate, gate_segments, "gate");
                 fill(parts.up, up, up_segments, "up");
                 fill(parts.down, down, down_segments, "down");
                 try {
                     py::gil_scoped_release release;
                     l.core->add_expert(std::move(parts), verify_partition);
                 } catch (const std::invalid_argument& e) {
                     throw py::value_error(e.what());
                 }
                 l.keep_alive.push_back(gate);
                 l.keep_alive.push_back(up);
                 l.keep_alive.push_back(down);
             },
             py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("gate_segments"), py::arg("up_segments"),
             py::arg("down_segments"), py::arg("verify_partition") = true,
             "Adds the next expert: gate, up [I, H] and down [H, I] bf16 (uint16 views) and, per matrix, a list "
             "with one int64 [n, 5] segment array per pool node.")
        .def("set_isa",
             [](PyLayer& l, std::optional<std::string> name) {
                 if (!name) {
                     l.core->set_isa(false, kernels::Isa::ref);
                     return;
                 }
                 kernels::Isa isa;
                 if (!kernels::parse_isa(name->c_str(), &isa))
                     throw py::value_error("unknown ISA '" + *name + "' (ref, avx2, avx512, amx_model, amx)");
                 if (!kernels::kernel_ops(isa)) throw py::value_error("ISA " + *name + " is not available on this CPU");
                 l.core->set_isa(true, isa);
             },
             py::arg("isa"), "Force one ISA for every expert, or None for the per-expert rule.")
        .def("set_amx_min_tokens", [](PyLayer& l, int64_t m) { l.core->set_amx_min_tokens(m); })
        .def("set_group_budget_bytes", [](PyLayer& l, int64_t b) {
            if (b < 0) throw py::value_error("group budget must be >= 0 bytes, got " + std::to_string(b));
            l.core->set_group_budget_bytes(b);
        })
        .def("isa_for_tokens", [](const PyLayer& l, int64_t m) { return std::string(l.core->isa_for_tokens(m)->name); })
        .def("thread_rows",
             [](const PyLayer& l, int64_t expert, const std::string& kind) {
                 const MatrixPart& mp = matrix_part(l, expert, kind);
                 py::list result;
                 for (const auto& node : mp.thread_rows) {
                     py::list per;
                     for (const auto& r : node) per.append(py::make_tuple(r.begin, r.end));
                     result.append(per);
                 }
                 return result;
             },
             py::arg("expert"), py::arg("kind"), "Row ranges [begin, end) per node per thread of a matrix.")
        .def("node_bytes",
             [](const PyLayer& l, int64_t expert, const std::string& kind) {
                 return matrix_part(l, expert, kind).node_bytes;
             },
             py::arg("expert"), py::arg("kind"))
        .def("forward",
             [](PyLayer& l, py::array x, py::array_t<int64_t, 0> ids, py::array_t<float, 0> weights, py::array out) {
                 int64_t T, H, ldx;
                 const uint16_t* xp = bf16_matrix(x, &T, &H, &ldx, "hidden");
                 if (H != l.core->hidden())
                     throw py::value_error("hidden: " + std::to_string(H) + " columns, the layer's hidden size is " +
                                           std::to_string(l.core->hidden()));
                 if (ids.ndim() != 2 || ids.shape(0) != T || !(ids.flags() & py::array::c_style))
                     throw py::value_error("topk_ids: expected a C-contiguous int64 array [tokens, k] with " +
                                           std::to_string(T) + " rows");
                 const int64_t k = ids.shape(1);
                 if (weights.ndim() != 2 || weights.shape(0) != T || weights.shape(1) != k ||
                     !(weights.flags() & py::array::c_style))
                     throw py::value_error("topk_weights: expected a C-contiguous float32 array of shape [" +
                                           std::to_string(T) + ", " + std::to_string(k) + "]");
                 const bool out_fp32 = out.dtype().kind() == 'f' && out.itemsize() == 4;
                 if (!out_fp32 && (out.itemsize() != 2 || out.dtype().kind() == 'f'))
                     throw py::value_error("out: expected float32 or bf16 (uint16 view), got " +
                                           std::string(py::str(out.dtype())));
                 if (out.ndim() != 2 || out.shape(0) != T || out.shape(1) != H || !(out.flags() & py::array::c_style) ||
                     !out.writeable())
                     throw py::value_error("out: expected a writeable C-contiguous array of shape [" +
                                           std::to_string(T) + ", " + std::to_string(H) + "]");
                 bool completed;
                 try {
                     py::gil_scoped_release release;
                     completed = l.core->forward(xp, ldx, T, ids.data(), weights.data(), k, out.mutable_data(),
                                                 out_fp32, check_signals);
                 } catch (const std::invalid_argument& e) {
                     throw py::value_error(e.what());
                 }
                 if (!completed) throw py::error_already_set();
             },
             py::arg("hidden"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("out"))
        .def("last_stats", [](const PyLayer& l) {
            const auto& s = l.core->last_stats();
            py::dict d;
            d["wall_ns"] = s.wall_ns;
            d["n_active_experts"] = s.n_active_experts;
            d["n_slots"] = s.n_slots;
            d["node_bytes"] = s.node_bytes;
            d["thread_busy_ns"] = s.thread_busy_ns;
            d["expert_isa"] = s.expert_isa;
            d["phase_ns"] = s.phase_ns;
            return d;
        });
}

}  // namespace numa_moe
