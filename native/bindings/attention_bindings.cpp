// Python API of GQA decode attention (numa_moe._native). Arguments are checked by
// bindings/checks.hpp; nothing is copied; compute runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/attention_checks.hpp"
#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "engine/attention.hpp"
#include "engine/process_pool.hpp"

namespace numa_moe::bindings {

namespace {

using kernels::Isa;

void py_gqa_decode(const std::string& isa, const py::array& q, const py::array& k_cache, const py::array& v_cache,
                   const py::array& lengths, py::array& out, double scale, int64_t window, const py::object& block_table,
                   const py::object& node_segments, std::shared_ptr<WorkerPool> pool, int threads) {
    const kernels::AttentionOps& ops = attention_ops_for(isa);
    engine::DecodeAttentionArgs args = attention_args(q, k_cache, v_cache, lengths, block_table, out, window, scale);
    RowNodes nodes;
    if (!node_segments.is_none()) {
        const py::list per_node = node_segments.cast<py::list>();
        std::vector<std::vector<Segment>> segments;
        for (size_t n = 0; n < per_node.size(); ++n)
            segments.push_back(segment_array(per_node[n], message("node_segments[", n, "]")));
        nodes = row_nodes(segments, attention_cache_rows(k_cache), args.head_dim, "k_cache segments");
        args.row_nodes = &nodes;
    }
    NUMA_MOE_CHECK(threads >= 0, "threads: must be >= 0 (0 = this process's CPUs), got ", threads);
    bool completed;
    {
        NoGil released;
        if (!pool) {
            const int n = threads == 0 ? engine::auto_attention_threads(args, engine::affinity_cpu_count()) : threads;
            if (n > 1) pool = engine::process_pool(n);
        }
        completed = engine::gqa_decode(pool.get(), ops, args, check_signals);
    }
    if (!completed) throw py::error_already_set();
}

py::array_t<float> py_merge_states(const py::array& m, const py::array& l, const py::array& o) {
    check_array(m, "m", Kind::f32, 1);
    check_array(l, "l", Kind::f32, 1);
    check_array(o, "o", Kind::f32, 2);
    const int64_t n = m.shape(0), d = o.shape(1);
    NUMA_MOE_CHECK(l.shape(0) == n && o.shape(0) == n, "m, l, o: one state per row expected, got shapes ", shape_text(m),
                   ", ", shape_text(l), ", ", shape_text(o));
    std::vector<const float*> mp, lp, op;
    for (int64_t p = 0; p < n; ++p) {
        mp.push_back(static_cast<const float*>(m.data()) + p);
        lp.push_back(static_cast<const float*>(l.data()) + p);
        op.push_back(static_cast<const float*>(o.data()) + p * d);
    }
    py::array_t<float> result(d);
    engine::merge_states(mp.data(), lp.data(), op.data(), static_cast<int>(n), d, result.mutable_data());
    return result;
}

}  // namespace

void register_attention(py::module_& m) {
    m.def("attention_isas", [] {
        std::vector<std::string> names;
        for (Isa isa : kernels::kAllIsas)
            if (kernels::attention_ops(isa)) names.emplace_back(kernels::isa_name(isa));
        return names;
    }, "Names of the ISAs whose decode-attention kernels this CPU (and OS) runs, in the order of kernel_isas.");
    m.def("default_attention_isa", [] { return std::string(kernels::isa_name(kernels::default_attention_isa())); },
          "The attention ISA chosen by default (amx > avx512 > avx2 > ref, or NUMA_MOE_ISA).");
    m.def("gqa_decode", &py_gqa_decode, py::arg("isa"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("lengths"), py::arg("out"), py::arg("scale"), py::arg("window") = 0,
          py::arg("block_table") = py::none(), py::arg("node_segments") = py::none(), py::arg("pool") = nullptr,
          py::arg("threads") = 0,
          "out[b, j] = softmax(scale q[b, j] . K[b, j / group]^T) V[b, j / group] over the positions of each "
          "sequence (the last `window` when > 0); contiguous or paged (block_table) caches; with node_segments (one "
          "int64 [n, 5] array per pool node over the cache's rows), each node's workers take the positions on its "
          "pages and the partial results are merged by log-sum-exp. Ctrl-C interrupts it.");
    m.def("merge_attention_states", &py_merge_states, py::arg("m"), py::arg("l"), py::arg("o"),
          "The log-sum-exp merge of softmax states (m[p], l[p], o[p, :]) in order: sum_p o_p e^(m_p - M) / "
          "sum_p l_p e^(m_p - M); states with l = 0 are empty.");
}

}  // namespace numa_moe::bindings
