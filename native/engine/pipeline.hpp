// The expert FFN pipeline, written once for the layer step and for a single expert:
//
//   gather   each expert's tokens, once, into its ISA's packed operand (KernelOps.gather)
//   gate/up  node n's threads multiply node n's segments of W_gate and W_up, claiming row
//            chunks (cut by weight bytes) in turn; fp32 partials [I, m] per node
//   silu     sum_n g_n, sum_n u_n (node order fixed), the biases, the activation (silu(g) * u
//            or another of kernels::Activation) packed for the down projection
//            (KernelOps.silu_mul_pack)
//   down     node partials [H, m] of W_down, split as gate/up
//   epilogue sum_n d_n (+ the down bias), then either y[token] += w * d (KernelOps.combine_down, experts in
//            ascending order: deterministic and independent of the thread count) and y ->
//            out after the last group, or, for one expert whose slot t is output row t,
//            out[t] = d straight away (KernelOps.store_down)
//
// with a barrier between phases (WorkerPool::run). When the team is one node and every
// matrix of the group is split evenly, a gate/up chunk runs silu on its own rows and a down
// chunk is a range of output columns over all the group's experts, each combined right
// after its down rows (while hot), so those phases fuse and two barriers go. Chunks are
// claimed from one counter per node, and each writes its own rows whichever thread takes
// it: the bits do not depend on the claiming order.
//
// Operands (bf16 = raw uint16_t bit patterns):
//   x        x[t * ldx + h], n_tokens x H
//   weights  per expert gate, up [I, H] and down [H, I] row-major (any row stride), and for
//            each matrix and each node the segments of the matrix on that node
//   out      out[t * H + h], n_tokens x H, bf16 or fp32
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/segment.hpp"
#include "common/util.hpp"
#include "common/worker_pool.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::engine {

using kernels::bf16;
using kernels::KernelOps;

struct MatrixPart {
    kernels::Weights weights;
    kernels::Format format = kernels::Format::bf16;
    int64_t rows = 0;
    int64_t cols = 0;
    std::vector<std::vector<Segment>> node_segments;  // [node][i]
    // Filled by prepare_matrix:
    std::vector<std::vector<Range>> thread_rows;  // [node][local participant]
    // The units a node's participants claim in turn (row-split experts): its rows cut into
    // kChunksPerParticipant x participants ranges by weight bytes, row_align(format,
    // weights.group) apart (kernel_api.hpp).
    std::vector<std::vector<Range>> node_chunks;  // [node][chunk]
    std::vector<int64_t> node_bytes;              // weight (and scale) bytes per node
    bool even_split = false;  // one node, rows split evenly in row_align units
};

struct ExpertParts {
    MatrixPart gate, up, down;  // all three in one format (check_one_format)
    // The layer's activation and the expert's gate / up biases (silu_mul_pack), and its down
    // bias (fp32 [H] or null: combine_down, store_down).
    kernels::ExpertEpilogue epilogue;
    const float* down_bias = nullptr;
};

// Gate, up and down of an expert in one weight format and, for integer formats, one group:
// the down projection's tokens come out of gate/up's epilogue, quantized in that group.
// std::invalid_argument names `what`. The one place this rule is checked (the MoE layer,
// expert_ffn and the bindings' expert_ffn arguments call it).
void check_one_format(const std::string& what, const std::array<kernels::Format, 3>& formats,
                      const std::array<int64_t, 3>& groups);

// Bytes of `elements` weights of a matrix in its format, scales included.
int64_t weight_bytes(const MatrixPart& part, int64_t elements);

// Checks the matrix's segments (each inside the matrix, integer formats on whole
// groups; with verify_partition, all nodes' segments together cover it exactly
// once) and splits each node's rows over that node's participants by weight bytes.
// std::invalid_argument names `what`.
void prepare_matrix(MatrixPart& part, const std::vector<int>& node_participants, const std::string& what,
                    bool verify_partition);

// The threads of a step: a WorkerPool, or the calling thread alone (pool == nullptr).
class Team {
public:
    explicit Team(WorkerPool* pool);
    int n_nodes() const { return static_cast<int>(node_participants_.size()); }
    int participants() const { return participants_; }
    const std::vector<int>& node_participants() const { return node_participants_; }
    // WorkerPool::run semantics (errors rethrown; false when keep_going aborted).
    bool run(int n_phases, const WorkerPool::Job& job, const std::function<bool()>& keep_going);
    bool aborted() const { return pool_ ? pool_->aborted() : false; }

private:
    WorkerPool* pool_;
    std::vector<int> node_participants_;
    int participants_;
};

// One expert's work in a step.
struct ExpertTask {
    const ExpertParts* parts = nullptr;
    const KernelOps* ops = nullptr;
    int64_t m = 0;
    const int64_t* x_rows = nullptr;   // [m] rows of x to gather
    const int64_t* y_rows = nullptr;   // [m] output rows (combine)
    const float* y_weights = nullptr;  // [m] routing weights (combine)
};

// Work memory of steps, grown as needed and kept between them (fresh buffers would cost
// page faults on every call).
struct StepArena {
    AlignedBuffer packed;
    size_t packed_capacity = 0;
    AlignedBuffer token_work;  // per participant: the operands of one token block
    size_t token_work_capacity = 0;
    std::vector<AlignedBuffer> node_partials;
    std::vector<size_t> node_partials_capacity;
    AlignedBuffer y;
    size_t y_capacity = 0;
};

struct StepOutput {
    void* out = nullptr;  // [n_tokens, hidden]
    bool out_bf16 = true;
    // One task whose slot t is output row t with weight 1: store_down, no fp32 y.
    bool store = false;
};

// Per-step measurements, for the work-balance report: [participant] and
// [participant * kPhaseKinds + phase kind] (gather, gate/up, silu, down, epilogue).
constexpr int kPhaseKinds = 5;
struct StepTimes {
    std::vector<int64_t> busy_ns;   // time in the gate/up and down matmuls
    std::vector<int64_t> phase_ns;  // time per phase kind, barrier waits included
};

struct StepShape {
    const bf16* x = nullptr;
    int64_t ldx = 0;
    int64_t n_tokens = 0;
    int64_t hidden = 0;
    int64_t intermediate = 0;
    // Per-node fp32 partial memory a group of experts may use before the step is split
    // into several pool runs.
    int64_t group_budget_bytes = int64_t(256) << 20;
};

// The blocking half of the per-expert rule (docs/kernels.md, "The per-expert rule"; the
// kernel choice is in kernel_choice.hpp): below token_split_min_tokens(participants) tokens, and always on several nodes
// (where a node may only touch its own segments), the expert's rows are split over the
// threads and every thread multiplies all m tokens. From there on, on one node, its tokens
// are cut into token_blocks(m, kTokenBlock), the blocks of all such experts of a step are
// dealt to the threads by tokens, and a thread runs gate/up, silu and down over all rows
// for one block at a time, so the weights stream once per block while the block's operands
// stay in its caches. The blocks depend on m alone, so all thread counts that split an
// expert give the same bits (a row split sums in another order). Returns the block, 0 for
// a row split.
constexpr int64_t kTokenBlock = 128;
constexpr int64_t kTokenSplitBlocksPerThread = 2;
inline int64_t token_split_min_tokens(int participants) {
    return kTokenBlock * kTokenSplitBlocksPerThread * participants;
}
int64_t token_split_block(int64_t m, int participants, bool one_node);
// ceil(m / block) consecutive token ranges, multiples of 16 except the last.
std::vector<Range> token_blocks(int64_t m, int64_t block);

// Runs the pipeline over `tasks` (ascending expert order for a deterministic sum).
// Returns false when keep_going aborted it (out is then unspecified).
bool run_step(Team& team, const std::vector<ExpertTask>& tasks, const StepShape& shape, const StepOutput& output,
              StepArena& arena, StepTimes* times, const std::function<bool()>& keep_going);

}  // namespace numa_moe::engine
