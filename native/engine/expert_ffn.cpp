#include "engine/expert_ffn.hpp"

#include <memory>

#include "common/check.hpp"
#include "engine/pipeline.hpp"
#include "engine/process_pool.hpp"

namespace numa_moe::engine {
namespace {

MatrixPart whole_or_segments(const kernels::Weights& w, kernels::Format format, int64_t rows, int64_t cols,
                             const std::vector<Segment>& segments) {
    MatrixPart part;
    part.weights = w;
    part.format = format;
    part.rows = rows;
    part.cols = cols;
    part.node_segments = {segments.empty() ? std::vector<Segment>{Segment{0, 1, rows, 0, cols}} : segments};
    return part;
}

}  // namespace

bool expert_ffn(const kernels::KernelOps& ops, const ExpertFfnArgs& a, const std::function<bool()>& keep_going) {
    if (a.m == 0) return true;
    const std::shared_ptr<WorkerPool> pool = a.threads > 1 ? process_pool(a.threads) : nullptr;
    Team team(pool.get());
    check_one_format("expert_ffn", {a.format, a.format, a.format}, {a.gate.group, a.up.group, a.down.group});
    NUMA_MOE_CHECK(ops.format == a.format, "expert_ffn: ", kernels::format_name(a.format), " weights handed to ",
                   kernels::format_name(ops.format), " kernels");
    NUMA_MOE_CHECK(a.format == kernels::Format::bf16 || a.gate.group == ops.group, "expert_ffn: weights of group ",
                   a.gate.group, " handed to kernels of group ", ops.group);
    ExpertParts parts{whole_or_segments(a.gate, a.format, a.intermediate, a.hidden, a.gate_segments),
                      whole_or_segments(a.up, a.format, a.intermediate, a.hidden, a.up_segments),
                      whole_or_segments(a.down, a.format, a.hidden, a.intermediate, a.down_segments), a.epilogue,
                      a.down_bias};
    prepare_matrix(parts.gate, team.node_participants(), "gate_segments", false);
    prepare_matrix(parts.up, team.node_participants(), "up_segments", false);
    prepare_matrix(parts.down, team.node_participants(), "down_segments", false);
    const std::vector<ExpertTask> tasks{ExpertTask{&parts, &ops, a.m, a.token_index, nullptr, nullptr}};
    StepShape shape;
    shape.x = a.x;
    shape.ldx = a.ldx;
    shape.n_tokens = a.m;
    shape.hidden = a.hidden;
    shape.intermediate = a.intermediate;
    // Kept per calling thread: a model calls the same expert shapes over and over.
    thread_local StepArena arena;
    return run_step(team, tasks, shape, StepOutput{a.out, a.out_bf16, true}, arena, nullptr, keep_going);
}

}  // namespace numa_moe::engine
