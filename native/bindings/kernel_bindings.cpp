// Python API of the kernels and the single-expert path (numa_moe._native). Arguments are
// checked by bindings/checks.hpp; nothing is copied; compute runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "common/util.hpp"
#include "engine/expert_ffn.hpp"
#include "engine/kernel_choice.hpp"
#include "engine/pipeline.hpp"
#include "engine/process_pool.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::bindings {

namespace {

using kernels::Isa;
using kernels::KernelOps;

// out[r, t] += sum_c weight[r, c] * tokens[t, c] over the segments (tokens gathered by the
// ISA's gather with the identity index).
void py_matmul_segments(const std::string& isa, const py::array& weight, const py::object& segments,
                        const py::array& tokens, py::array& out, int64_t row_begin, int64_t row_end,
                        const py::object& scales, const std::string& format) {
    const WeightArg w = weight_operand(weight, scales, "weight", format);
    const KernelOps& ops = ops_for(isa, w.format, w.weights.group);
    check_array(tokens, "tokens", Kind::bf16, 2);
    check_array(out, "out", Kind::f32, 2, true);
    const int64_t rows = w.rows, k = w.cols, m = tokens.shape(0);
    NUMA_MOE_CHECK(tokens.shape(1) == k, "tokens: ", tokens.shape(1), " columns, weight has ", k);
    NUMA_MOE_CHECK(out.shape(0) == rows && out.shape(1) >= m, "out: shape ", shape_text(out), ", expected [", rows, ", >= ",
                   m, "]");
    NUMA_MOE_CHECK(!segments.is_none(), "segments: required (int64 [n, 5])");
    const std::vector<Segment> segs = read_segments(segments, "segments", rows, k);
    if (w.format != kernels::Format::bf16)
        check_block_edges(segs.data(), static_cast<int64_t>(segs.size()), k, w.weights.group, "segments");
    if (row_end < 0) row_end = rows;
    check_range(row_begin, row_end, rows, 1, "[row_begin, row_end)");
    const auto* x = static_cast<const bf16*>(tokens.data());
    auto* o = static_cast<float*>(out.mutable_data());
    const int64_t ldo = out.shape(1);
    NoGil released;
    AlignedBuffer packed = aligned_buffer(ops.packed_bytes(m, k));
    std::vector<int64_t> identity(m);
    for (int64_t t = 0; t < m; ++t) identity[t] = t;
    if (m > 0) ops.gather(x, k, identity.data(), m, k, packed.get());
    ops.matmul_segments(w.weights, segs.data(), static_cast<int64_t>(segs.size()), row_begin, row_end, packed.get(), m,
                        k, o, ldo);
}

// silu_mul_pack over [i_begin, i_end) from partials [I, m]; returns act [m, I] (uint16
// bf16 bits, unpacked from the ISA layout; columns outside the range are 0).
py::array py_silu_mul_pack(const std::string& isa, const py::list& gate_parts, const py::list& up_parts,
                           int64_t i_begin, int64_t i_end, double alpha, double limit, double up_offset,
                           const py::object& gate_bias, const py::object& up_bias) {
    const KernelOps& ops = ops_for(isa);
    const PartList gate = part_list(gate_parts, "gate_parts");
    const PartList up = part_list(up_parts, "up_parts");
    NUMA_MOE_CHECK(up.rows == gate.rows && up.cols == gate.cols && up.pointers.size() == gate.pointers.size(),
                   "up_parts: must match gate_parts in number and shape [I, m]");
    const int64_t inter = gate.rows, m = gate.cols;
    check_range(i_begin, i_end, inter, 32, "[i_begin, i_end)");
    const kernels::ExpertEpilogue epilogue{activation_of(alpha, limit, up_offset),
                                           bias_vector(gate_bias, inter, "gate_bias"),
                                           bias_vector(up_bias, inter, "up_bias")};
    py::array_t<uint16_t> result({m, inter});
    auto* res = result.mutable_data();
    {
        NoGil released;
        const size_t bytes = ops.packed_bytes(m, inter);
        AlignedBuffer packed = aligned_buffer(bytes);
        std::memset(packed.get(), 0, bytes);
        ops.silu_mul_pack(gate.pointers.data(), up.pointers.data(), static_cast<int>(gate.pointers.size()), m,
                          i_begin, i_end, m, inter, epilogue, packed.get());
        const auto* src = static_cast<const bf16*>(packed.get());
        const kernels::TokenLayout layout = ops.token_layout(m);
        for (int64_t t = 0; t < m; ++t)
            for (int64_t i = 0; i < inter; ++i) res[t * inter + i] = src[kernels::packed_index(layout, m, inter, t, i)];
    }
    return result;
}

void py_combine_down(const std::string& isa, const py::list& parts, int64_t h_begin, int64_t h_end,
                     const py::array& token_index, const py::array& token_weight, py::array& y, const py::object& bias) {
    const KernelOps& ops = ops_for(isa);
    const PartList down = part_list(parts, "parts");
    const int64_t hidden = down.rows, m = down.cols;
    check_array(y, "y", Kind::f32, 2, true);
    NUMA_MOE_CHECK(y.shape(1) == hidden, "y: shape ", shape_text(y), ", expected [T, ", hidden, "]");
    check_index(token_index, "token_index", y.shape(0));
    NUMA_MOE_CHECK(token_index.shape(0) == m, "token_index: length ", token_index.shape(0), " != m = ", m);
    check_array(token_weight, "token_weight", Kind::f32, 1);
    NUMA_MOE_CHECK(token_weight.shape(0) == m, "token_weight: length ", token_weight.shape(0), " != m");
    check_range(h_begin, h_end, hidden, 1, "[h_begin, h_end)");
    const float* b = bias_vector(bias, hidden, "bias");
    const auto* idx = static_cast<const int64_t*>(token_index.data());
    const auto* tw = static_cast<const float*>(token_weight.data());
    auto* yp = static_cast<float*>(y.mutable_data());
    NoGil released;
    ops.combine_down(down.pointers.data(), static_cast<int>(down.pointers.size()), m, h_begin, h_end, m, idx, tw, b, yp,
                     hidden);
}

void py_store_down(const std::string& isa, const py::list& parts, int64_t h_begin, int64_t h_end, py::array& out,
                   const py::object& bias) {
    const KernelOps& ops = ops_for(isa);
    const PartList down = part_list(parts, "parts");
    const int64_t hidden = down.rows, m = down.cols;
    const bool out_bf16 = check_output(out, "out", m, hidden);
    check_range(h_begin, h_end, hidden, 1, "[h_begin, h_end)");
    const float* b = bias_vector(bias, hidden, "bias");
    void* dst = out.mutable_data();
    NoGil released;
    ops.store_down(down.pointers.data(), static_cast<int>(down.pointers.size()), m, h_begin, h_end, m, b, dst, hidden,
                   out_bf16);
}

void py_expert_ffn(const std::string& isa, const py::array& x, const py::array& token_index, const py::array& w_gate,
                   const py::array& w_up, const py::array& w_down, const py::object& gate_segments,
                   const py::object& up_segments, const py::object& down_segments, py::array& out, int threads,
                   const py::object& gate_scales, const py::object& up_scales, const py::object& down_scales,
                   double alpha, double limit, double up_offset, const py::object& gate_bias, const py::object& up_bias,
                   const py::object& down_bias, const std::string& format) {
    engine::ExpertFfnArgs args = expert_ffn_args(x, token_index, weight_operand(w_gate, gate_scales, "w_gate", format),
                                                 weight_operand(w_up, up_scales, "w_up", format),
                                                 weight_operand(w_down, down_scales, "w_down", format), threads);
    args.gate_segments = read_segments(gate_segments, "gate_segments", args.intermediate, args.hidden);
    args.up_segments = read_segments(up_segments, "up_segments", args.intermediate, args.hidden);
    args.down_segments = read_segments(down_segments, "down_segments", args.hidden, args.intermediate);
    args.epilogue = kernels::ExpertEpilogue{activation_of(alpha, limit, up_offset),
                                            bias_vector(gate_bias, args.intermediate, "gate_bias"),
                                            bias_vector(up_bias, args.intermediate, "up_bias")};
    args.down_bias = bias_vector(down_bias, args.hidden, "down_bias");
    args.out_bf16 = check_output(out, "out", args.m, args.hidden);
    args.out = out.mutable_data();
    const KernelOps& ops = ops_for(isa, args.format, args.gate.group);
    bool completed;
    {
        NoGil released;
        completed = engine::expert_ffn(ops, args, check_signals);
    }
    if (!completed) throw py::error_already_set();
}

}  // namespace

void register_kernels(py::module_& m) {
    m.def("kernel_isas", [](const std::string& format) {
        const kernels::Format f = weight_format_named(format);
        std::vector<std::string> names;
        for (Isa isa : kernels::kAllIsas)
            if (kernels::kernel_ops(isa, f)) names.emplace_back(kernels::isa_name(isa));
        return names;
    }, py::arg("format") = "bf16", "Names of the kernel ISAs this CPU (and OS) can run for a weight format (ref first, each emulated build before its ISA).");
    m.def("fastest_kernel_isa", [](const std::string& format) {
        return std::string(kernels::isa_name(kernels::fastest_isa(weight_format_named(format))));
    }, py::arg("format") = "bf16",
          "The fastest ISA with kernels for a weight format here (amx > avx512 > avx2 > ref; never amx_model), "
          "NUMA_MOE_ISA not consulted.");
    m.def("kernel_isa_for_tokens", [](int64_t m, const std::string& format, int64_t group) {
        NUMA_MOE_CHECK(m >= 1, "tokens must be >= 1, got ", m);
        const kernels::Format f = weight_format_named(format);
        check_group_of(f, group);
        return std::string(engine::kernels_for_tokens(m, f, group, 0)->name);
    }, py::arg("m"), py::arg("format") = "bf16", py::arg("group") = 0,
          "The ISA an MoE layer with the default amx_min_tokens runs an expert of m tokens with (AMX from the "
          "format's and group's crossover, else the fastest other), NUMA_MOE_ISA not consulted. group: the "
          "weights' columns per scale (0: the format's default; ignored for bf16).");
    m.def("default_kernel_isa", [] { return std::string(kernels::isa_name(kernels::default_isa())); },
          "The ISA chosen by default (amx > avx512 > avx2 > ref, or NUMA_MOE_ISA).");
    m.def("matmul_segments", &py_matmul_segments, py::arg("isa"), py::arg("weight"), py::arg("segments"),
          py::arg("tokens"), py::arg("out"), py::arg("row_begin") = 0, py::arg("row_end") = -1,
          py::arg("scales") = py::none(), py::arg("format") = "",
          "out[r, t] += sum over segment columns of weight[r, c] * tokens[t, c] (rows of the segments in "
          "[row_begin, row_end)); with scales, weight is int8 (or uint8: int4, mxfp4 with float8_e8m0fnu scales, "
          "iq4nl when format says so) and tokens are quantized per group of the weights as the kernels do. format: "
          "the weight format (default: the one the dtypes tell).");
    m.def("silu_mul_pack", &py_silu_mul_pack, py::arg("isa"), py::arg("gate_parts"), py::arg("up_parts"),
          py::arg("i_begin"), py::arg("i_end"), py::arg("alpha") = 1.0, py::arg("limit") = INFINITY,
          py::arg("up_offset") = 0.0, py::arg("gate_bias") = py::none(), py::arg("up_bias") = py::none(),
          "act[t, i] = bf16(activation(sum gate (+ gate_bias), sum up (+ up_bias))), unpacked to [m, I] uint16; "
          "the activation's defaults are silu(g) * u.");
    m.def("combine_down", &py_combine_down, py::arg("isa"), py::arg("parts"), py::arg("h_begin"), py::arg("h_end"),
          py::arg("token_index"), py::arg("token_weight"), py::arg("y"), py::arg("bias") = py::none(),
          "y[token_index[t], h] += token_weight[t] * (sum_p parts[p][h, t] (+ bias[h])).");
    m.def("store_down", &py_store_down, py::arg("isa"), py::arg("parts"), py::arg("h_begin"), py::arg("h_end"),
          py::arg("out"), py::arg("bias") = py::none(),
          "out[t, h] = sum_p parts[p][h, t] (+ bias[h]) (stored, bf16 or float32) for h in [h_begin, h_end).");
    m.def("expert_ffn", &py_expert_ffn, py::arg("isa"), py::arg("x"), py::arg("token_index"), py::arg("w_gate"),
          py::arg("w_up"), py::arg("w_down"), py::arg("gate_segments"), py::arg("up_segments"),
          py::arg("down_segments"), py::arg("out"), py::arg("threads") = 0, py::arg("gate_scales") = py::none(),
          py::arg("up_scales") = py::none(), py::arg("down_scales") = py::none(), py::arg("alpha") = 1.0,
          py::arg("limit") = INFINITY, py::arg("up_offset") = 0.0, py::arg("gate_bias") = py::none(),
          py::arg("up_bias") = py::none(), py::arg("down_bias") = py::none(), py::arg("format") = "",
          "out = act(x[idx] Wg^T + gate_bias, x[idx] Wu^T + up_bias) Wd^T + down_bias (act: silu(g) * u by default; "
          "biases optional float32); out is float32 or bfloat16 [m, H]; with scales the weights are int8 (or uint8: "
          "int4, mxfp4 with float8_e8m0fnu scales, iq4nl when format says so). format: the weights' format "
          "(default: the one the dtypes tell). Ctrl-C interrupts it.");
    m.def("process_pool_start_count", &engine::process_pool_start_count,
          "Thread creations over the process pool of the single-expert path so far (none per call).");
    m.def("affinity_cpu_count", &engine::affinity_cpu_count, "CPUs in this process's affinity mask.");
    m.def("token_split_block", &engine::token_split_block, py::arg("m"), py::arg("participants"), py::arg("one_node"),
          "The blocking rule (engine/pipeline.hpp): tokens per block of an expert of m tokens split by tokens over "
          "`participants` threads of one node, 0 when its rows are split instead.");
}

}  // namespace numa_moe::bindings
