// Python API of the worker pool and the MoE layer step (numa_moe._native). Arguments are
// checked by bindings/checks.hpp before any pointer reaches a kernel.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>

#include <optional>
#include <stdexcept>

#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "common/openmp_team.hpp"
#include "common/worker_pool.hpp"
#include "engine/moe_layer.hpp"

namespace numa_moe::bindings {

namespace {

using engine::ExpertParts;
using engine::MatrixPart;
using engine::MoELayerCore;

// One int64 [n, 5] segment array per pool node (checked against the matrix later).
std::vector<std::vector<Segment>> node_segments(const py::list& per_node, const std::string& what) {
    std::vector<std::vector<Segment>> result;
    for (size_t n = 0; n < per_node.size(); ++n)
        result.push_back(segment_array(per_node[n], message(what, " segments of node ", n)));
    return result;
}

MatrixPart matrix_part(const py::array& a, const py::object& scales, const py::list& segments,
                       const std::string& what, const std::string& format) {
    const WeightArg w = weight_operand(a, scales, what, format);
    MatrixPart part;
    part.weights = w.weights;
    part.format = w.format;
    part.rows = w.rows;
    part.cols = w.cols;
    part.node_segments = node_segments(segments, what);
    return part;
}

// Keeps the weight arrays alive as long as the layer.
struct PyLayer {
    std::unique_ptr<MoELayerCore> core;
    std::vector<py::object> keep_alive;  // the weight and scale arrays
};

// The matrix `kind` ("gate", "up", "down") of an expert, with errors for a bad index or kind.
const MatrixPart& layer_matrix(const PyLayer& l, int64_t expert, const std::string& kind) {
    NUMA_MOE_CHECK(expert >= 0 && expert < l.core->n_experts(), "expert ", expert, " is out of range (the layer has ",
                   l.core->n_experts(), " expert(s))");
    const ExpertParts& p = l.core->expert(expert);
    if (kind == "gate") return p.gate;
    if (kind == "up") return p.up;
    if (kind == "down") return p.down;
    fail("unknown matrix kind '", kind, "' (gate, up, down)");
}

void layer_forward(PyLayer& l, const py::array& hidden, const py::array& topk_ids, const py::array& topk_weights,
                   py::array& out) {
    const Bf16Rows x = bf16_rows(hidden, "hidden");
    NUMA_MOE_CHECK(x.cols == l.core->hidden(), "hidden: ", x.cols, " columns, the layer's hidden size is ",
                   l.core->hidden());
    check_array(topk_ids, "topk_ids", Kind::i64, 2);
    NUMA_MOE_CHECK(topk_ids.shape(0) == x.rows, "topk_ids: shape ", shape_text(topk_ids), ", expected [", x.rows,
                   ", k] (one row per token)");
    const int64_t k = topk_ids.shape(1);
    check_array(topk_weights, "topk_weights", Kind::f32, 2);
    NUMA_MOE_CHECK(topk_weights.shape(0) == x.rows && topk_weights.shape(1) == k, "topk_weights: shape ",
                   shape_text(topk_weights), ", expected [", x.rows, ", ", k, "]");
    const bool out_bf16 = check_output(out, "out", x.rows, x.cols);
    bool completed;
    {
        NoGil released;
        completed = l.core->forward(x.data, x.ld, x.rows, static_cast<const int64_t*>(topk_ids.data()),
                                    static_cast<const float*>(topk_weights.data()), k, out.mutable_data(), out_bf16,
                                    check_signals);
    }
    if (!completed) throw py::error_already_set();
}

}  // namespace

namespace {

void register_worker_pool(py::module_& m) {
    py::class_<WorkerPool, std::shared_ptr<WorkerPool>>(m, "WorkerPool", R"doc(
Persistent worker threads, one group per node, each thread pinned to one CPU of its node.
node_cpus[n] lists node n's CPUs (one thread per CPU). Threads start on first use.)doc")
        .def(py::init<std::vector<std::vector<int>>, bool, int64_t, int>(), py::arg("node_cpus"), py::arg("pin") = true,
             py::arg("spin_us") = 50, py::arg("caller_cpu") = -1)
        .def_property_readonly("n_nodes", &WorkerPool::n_nodes)
        .def_property_readonly("n_threads", &WorkerPool::n_threads)
        .def_property_readonly("participants", &WorkerPool::participants)
        .def_property_readonly("node_cpus", &WorkerPool::node_cpus)
        .def_property_readonly("started", &WorkerPool::started)
        .def_property_readonly("start_count", &WorkerPool::start_count)
        .def("threads_of", [](const WorkerPool& p, int node) {
            NUMA_MOE_CHECK(node >= 0 && node < p.n_nodes(), "node ", node, " is not in the pool (", p.n_nodes(), " nodes)");
            return p.threads_of(node);
        }, py::arg("node"))
        .def("start", &WorkerPool::start, py::call_guard<NoGil>())
        .def("shutdown", &WorkerPool::shutdown, py::call_guard<NoGil>())
        .def("thread_affinity", [](WorkerPool& p) {
            std::vector<std::vector<int>> cpus(p.n_threads());
            {
                NoGil released;
                p.run(1, [&](int, const ThreadInfo& ti) {
                    if (ti.global >= p.n_threads()) return;  // the joining caller
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
        }, "(node, local index, CPU affinity) as seen by each worker thread itself.");
}

void register_layer(py::module_& m) {
    py::class_<PyLayer>(m, "MoELayerCore", R"doc(
The NUMA-partitioned MoE layer step over a WorkerPool (see numa_moe.moe.MoELayer).)doc")
        .def(py::init([](std::shared_ptr<WorkerPool> pool, int64_t hidden, int64_t intermediate) {
                 return PyLayer{std::make_unique<MoELayerCore>(std::move(pool), hidden, intermediate), {}};
             }),
             py::arg("pool"), py::arg("hidden"), py::arg("intermediate"))
        .def_property_readonly("n_experts", [](const PyLayer& l) { return l.core->n_experts(); })
        .def_property_readonly("hidden", [](const PyLayer& l) { return l.core->hidden(); })
        .def_property_readonly("intermediate", [](const PyLayer& l) { return l.core->intermediate(); })
        .def("add_expert",
             [](PyLayer& l, py::array gate, py::array up, py::array down, py::list gate_segments,
                py::list up_segments, py::list down_segments, bool verify_partition, py::object gate_scales,
                py::object up_scales, py::object down_scales, py::object gate_bias, py::object up_bias,
                py::object down_bias, const std::string& format) {
                 const std::string name = message("expert ", l.core->n_experts());
                 const int64_t inter = l.core->intermediate(), hidden = l.core->hidden();
                 const kernels::ExpertEpilogue epilogue{kernels::Activation{},  // the layer's, set by add_expert
                                                        bias_vector(gate_bias, inter, name + " gate_bias"),
                                                        bias_vector(up_bias, inter, name + " up_bias")};
                 ExpertParts parts{matrix_part(gate, gate_scales, gate_segments, name + " gate", format),
                                   matrix_part(up, up_scales, up_segments, name + " up", format),
                                   matrix_part(down, down_scales, down_segments, name + " down", format), epilogue,
                                   bias_vector(down_bias, hidden, name + " down_bias")};
                 {
                     NoGil released;
                     l.core->add_expert(std::move(parts), verify_partition);
                 }
                 l.keep_alive.insert(l.keep_alive.end(),
                                     {gate, up, down, gate_scales, up_scales, down_scales, gate_bias, up_bias, down_bias});
             },
             py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("gate_segments"), py::arg("up_segments"),
             py::arg("down_segments"), py::arg("verify_partition") = true, py::arg("gate_scales") = py::none(),
             py::arg("up_scales") = py::none(), py::arg("down_scales") = py::none(), py::arg("gate_bias") = py::none(),
             py::arg("up_bias") = py::none(), py::arg("down_bias") = py::none(), py::arg("format") = "",
             "Adds the next expert: gate, up [I, H] and down [H, I] bf16 (uint16 views), or int8 / uint8 (int4; mxfp4 "
             "with float8_e8m0fnu scales; iq4nl when format says so) with their group scales, and, per matrix, a list "
             "with one int64 [n, 5] segment array per pool node; optional float32 biases: gate_bias, up_bias [I], "
             "down_bias [H]; format: the weights' format (default: the one the dtypes tell).")
        .def("set_activation",
             [](PyLayer& l, double alpha, double limit, double up_offset) {
                 l.core->set_activation(activation_of(alpha, limit, up_offset));
             },
             py::arg("alpha") = 1.0, py::arg("limit") = INFINITY, py::arg("up_offset") = 0.0,
             "The experts' activation: g = min(g, limit), u = clamp(u, -limit, limit), "
             "g / (1 + exp(-alpha g)) * (u + up_offset); the defaults are silu(g) * u.")
        .def("set_isa",
             [](PyLayer& l, std::optional<std::string> name) {
                 if (!name) l.core->set_isa(false, kernels::Isa::ref);
                 else l.core->set_isa(true, ops_for(*name).isa);
             },
             py::arg("isa"), "Force one ISA for every expert, or None for the per-expert rule.")
        .def("set_amx_min_tokens", [](PyLayer& l, int64_t m) {
            NUMA_MOE_CHECK(m >= 0, "amx_min_tokens must be >= 1 (or 0 for the format's default), got ", m);
            l.core->set_amx_min_tokens(m);
        }, py::arg("m"), "AMX from m tokens; 0: each weight format's default (engine::default_amx_min_tokens).")
        .def("set_group_budget_bytes", [](PyLayer& l, int64_t b) {
            NUMA_MOE_CHECK(b >= 0, "group budget must be >= 0 bytes, got ", b);
            l.core->set_group_budget_bytes(b);
        })
        .def("isa_for_tokens", [](const PyLayer& l, int64_t m, const std::string& format, int64_t group) {
            const kernels::Format f = weight_format_named(format);
            check_group_of(f, group);
            return std::string(l.core->isa_for_tokens(m, f, group)->name);
        }, py::arg("m"), py::arg("format") = "bf16", py::arg("group") = 0)
        .def("thread_rows",
             [](const PyLayer& l, int64_t expert, const std::string& kind) {
                 py::list result;
                 for (const auto& node : layer_matrix(l, expert, kind).thread_rows) {
                     py::list per;
                     for (const Range& r : node) per.append(py::make_tuple(r.begin, r.end));
                     result.append(per);
                 }
                 return result;
             },
             py::arg("expert"), py::arg("kind"), "Row ranges [begin, end) per node per participant of a matrix.")
        .def("node_bytes",
             [](const PyLayer& l, int64_t expert, const std::string& kind) {
                 return layer_matrix(l, expert, kind).node_bytes;
             },
             py::arg("expert"), py::arg("kind"))
        .def("forward", &layer_forward, py::arg("hidden"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("out"))
        .def("last_stats", [](const PyLayer& l) {
            const auto& s = l.core->last_stats();
            py::dict d;
            d["wall_ns"] = s.wall_ns;
            d["n_active_experts"] = s.n_active_experts;
            d["n_slots"] = s.n_slots;
            d["node_bytes"] = s.node_bytes;
            d["thread_busy_ns"] = s.times.busy_ns;
            d["expert_isa"] = s.expert_isa;
            d["phase_ns"] = s.times.phase_ns;
            return d;
        });
}

}  // namespace

void register_engine(py::module_& m) {
    m.def("thread_backend", &thread_backend,
          "Whose threads run the pools' jobs: 'openmp (<libgomp path>)', the team of the OpenMP runtime "
          "the process loaded (PyTorch's), or 'own threads (<why>)'. NUMA_MOE_THREADS=own forces the latter.");
    register_worker_pool(m);
    register_layer(m);
}

}  // namespace numa_moe::bindings
