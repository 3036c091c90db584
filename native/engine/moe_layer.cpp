// The MoE layer step (see moe_layer.hpp). Baseline x86-64 code.
#include "engine/moe_layer.hpp"

#include <stdexcept>

#include "common/check.hpp"
#include "engine/kernel_choice.hpp"

namespace numa_moe::engine {

MoELayerCore::MoELayerCore(std::shared_ptr<WorkerPool> pool, int64_t hidden, int64_t intermediate)
    : pool_(std::move(pool)), team_(pool_.get()), hidden_(hidden), intermediate_(intermediate) {
    NUMA_MOE_CHECK(pool_, "MoELayerCore needs a worker pool");
    NUMA_MOE_CHECK(hidden > 0 && intermediate > 0 && hidden % 2 == 0 && intermediate % 2 == 0,
                   "MoELayerCore: hidden and intermediate sizes must be positive and even, got ", hidden, " and ",
                   intermediate);
}

namespace {

void check_shape(const MatrixPart& m, int64_t rows, int64_t cols, const std::string& what) {
    NUMA_MOE_CHECK(m.rows == rows && m.cols == cols, what, ": shape [", m.rows, ", ", m.cols, "], expected [", rows, ", ",
                   cols, "]");
    NUMA_MOE_CHECK(m.weights.data && m.weights.ld >= m.cols, what, ": null weights or row stride below the row length");
    NUMA_MOE_CHECK(m.format == kernels::Format::bf16 || (m.weights.scales && kernels::has_group(m.format, m.weights.group)),
                   what, ": ", kernels::format_name(m.format), " weights need scales and a group of 32, 64 or 128 columns (mxfp4, iq4nl, int4-affine: 32)");
}

}  // namespace

void MoELayerCore::add_expert(ExpertParts parts, bool verify_partition) {
    const std::string name = message("expert ", experts_.size());
    check_shape(parts.gate, intermediate_, hidden_, name + " gate");
    check_shape(parts.up, intermediate_, hidden_, name + " up");
    check_shape(parts.down, hidden_, intermediate_, name + " down");
    check_one_format(name, {parts.gate.format, parts.up.format, parts.down.format},
                     {parts.gate.weights.group, parts.up.weights.group, parts.down.weights.group});
    prepare_matrix(parts.gate, team_.node_participants(), name + " gate", verify_partition);
    prepare_matrix(parts.up, team_.node_participants(), name + " up", verify_partition);
    prepare_matrix(parts.down, team_.node_participants(), name + " down", verify_partition);
    parts.epilogue.activation = activation_;
    experts_.push_back(std::move(parts));
}

void MoELayerCore::set_activation(const kernels::Activation& activation) {
    activation_ = activation;
    for (ExpertParts& parts : experts_) parts.epilogue.activation = activation;
}

void MoELayerCore::set_isa(bool forced, Isa isa) {
    NUMA_MOE_CHECK(!forced || kernels::kernel_ops(isa), "ISA ", kernels::isa_name(isa), " is not available on this CPU");
    isa_forced_ = forced;
    forced_isa_ = isa;
}

const KernelOps* MoELayerCore::isa_for_tokens(int64_t m, kernels::Format format, int64_t group) const {
    return kernels_for_tokens(m, format, group, amx_min_tokens_);
}

const KernelOps* MoELayerCore::expert_kernels(int64_t m, const MatrixPart& matrix) const {
    const kernels::Format format = matrix.format;
    if (!isa_forced_) return isa_for_tokens(m, format, matrix.weights.group);
    if (const KernelOps* ops = kernels::kernel_ops(forced_isa_, format, matrix.weights.group)) return ops;
    fail("ISA ", kernels::isa_name(forced_isa_), " cannot run ", kernels::format_name(format), " experts: ",
         kernels::unavailable_reason(forced_isa_, format));
}

// One task per active expert, ascending id.
void MoELayerCore::plan_tasks() {
    tasks_.clear();
    for (int64_t e = 0; e < n_experts(); ++e) {
        const int64_t m = routing_.tokens_of(e);
        if (m == 0) continue;
        const int64_t slot0 = routing_.expert_offset[e];
        const int64_t* tokens = routing_.slot_token.data() + slot0;
        tasks_.push_back(ExpertTask{&experts_[e], expert_kernels(m, experts_[e].gate), m, tokens, tokens,
                                    routing_.slot_weight.data() + slot0});
    }
}

void MoELayerCore::record_stats() {
    stats_.n_active_experts = static_cast<int64_t>(tasks_.size());
    stats_.n_slots = routing_.slots();
    stats_.node_bytes.assign(team_.n_nodes(), 0);
    stats_.expert_isa.clear();
    for (const ExpertTask& t : tasks_) {
        for (int n = 0; n < team_.n_nodes(); ++n)
            stats_.node_bytes[n] += t.parts->gate.node_bytes[n] + t.parts->up.node_bytes[n] + t.parts->down.node_bytes[n];
        stats_.expert_isa.emplace_back(t.ops->name);
    }
}

bool MoELayerCore::forward(const bf16* x, int64_t ldx, int64_t n_tokens, const int64_t* ids, const float* weights,
                           int64_t top_k, void* out, bool out_bf16, const std::function<bool()>& keep_going) {
    const int64_t start = now_ns();
    NUMA_MOE_CHECK(!experts_.empty(), "MoELayerCore.forward: the layer has no experts");
    route(ids, weights, n_tokens, top_k, n_experts(), routing_);
    plan_tasks();
    record_stats();
    StepShape shape;
    shape.x = x;
    shape.ldx = ldx;
    shape.n_tokens = n_tokens;
    shape.hidden = hidden_;
    shape.intermediate = intermediate_;
    shape.group_budget_bytes = group_budget_bytes_;
    const bool completed = run_step(team_, tasks_, shape, StepOutput{out, out_bf16, false}, arena_, &stats_.times,
                                    keep_going);
    stats_.wall_ns = now_ns() - start;
    return completed;
}

}  // namespace numa_moe::engine
