// One NUMA-partitioned MoE layer step over a WorkerPool.
//
// Operands (bf16 = raw uint16_t bit patterns):
//   x        hidden states x[t * ldx + h], T x H bf16
//   ids      topk_ids[t * k + j] int64 in [0, E)
//   weights  topk_weights[t * k + j] fp32
//   out      out[t * H + h], T x H, bf16 or fp32
//   per expert: gate, up [I, H] and down [H, I] bf16 row-major (any row stride), and for
//   each matrix and each pool node the segments of the matrix on that node (rows
//   renumbered from 0 within the expert's matrix).
//
// Step: tokens are grouped by expert (a token that lists the same expert more than once
// gets one slot with the weights summed: w1 f(x) + w2 f(x) = (w1 + w2) f(x)); then per
// group of experts, one pool run with four barriers:
//   A gather each active expert's tokens once into its ISA's packed operand
//   B gate/up partials: node n's threads run node n's segments, rows split by bytes
//   C silu(sum_n g_n) * (sum_n u_n) -> packed down operand (node order fixed)
//   D down partials per node, same split
//   E y[:, h-range] += w * sum_n d_n per thread-owned h range (experts in ascending id
//     order, nodes in order: the summation order is fixed, so results are deterministic
//     and independent of the thread count), then y -> out on the last group.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/segment.hpp"
#include "kernels/kernel_api.hpp"
#include "common/worker_pool.hpp"

namespace numa_moe::workers {

using kernels::bf16;
using kernels::Isa;
using kernels::KernelOps;

struct RowRange {
    int64_t begin = 0;
    int64_t end = 0;
};

struct MatrixPart {
    const bf16* w = nullptr;
    int64_t ldw = 0;
    int64_t rows = 0;
    int64_t cols = 0;
    std::vector<std::vector<Segment>> node_segments;    // [node][i]
    std::vector<std::vector<RowRange>> thread_rows;     // [node][local thread]
    std::vector<int64_t> node_bytes;                    // weight bytes per node
};

struct ExpertParts {
    MatrixPart gate, up, down;
};

// Per-step measurements, for the work-balance report.
struct StepStats {
    int64_t wall_ns = 0;
    int64_t n_active_experts = 0;
    int64_t n_slots = 0;
    std::vector<int64_t> node_bytes;        // weight bytes read per node
    std::vector<int64_t> thread_busy_ns;    // time in phases B + D per thread
    std::vector<int64_t> phase_ns;          // [thread * 5 + phase]: time in phases A..E (incl. barrier waits)
    std::vector<std::string> expert_isa;    // per active expert, ascending id
};

// Splits rows [0, rows) into n pieces of about equal cost (cost[r] per row), boundaries
// rounded to multiples of align. Pure; exposed for tests.
std::vector<RowRange> split_by_cost(const std::vector<int64_t>& cost, int n, int64_t align);

// Throws std::invalid_argument unless the segments of all nodes partition [rows, cols)
// exactly (no gap, no overlap); `what` names the matrix in the message.
void check_partition(const std::vector<std::vector<Segment>>& node_segments, int64_t rows, int64_t cols,
                     const std::string& what);

class MoELayerCore {
public:
    MoELayerCore(std::shared_ptr<WorkerPool> pool, int64_t hidden, int64_t intermediate);

    int64_t hidden() const { return hidden_; }
    int64_t intermediate() const { return intermediate_; }
    int64_t n_experts() const { return static_cast<int64_t>(experts_.size()); }
    const std::shared_ptr<WorkerPool>& pool() const { return pool_; }
    const ExpertParts& expert(int64_t e) const { return experts_.at(e); }

    // Takes ownership of the description; checks shapes and the partition.
    void add_expert(ExpertParts parts, bool verify_partition);

    // forced: run every expert with this ISA; otherwise the rule in isa_for_tokens.
    void set_isa(bool forced, Isa isa) {
        isa_forced_ = forced;
        forced_isa_ = isa;
    }
    void set_amx_min_tokens(int64_t m) { amx_min_tokens_ = m; }
    // Per-node fp32 partial memory a group of experts may use before the step is split
    // into several pool runs.
    void set_group_budget_bytes(int64_t bytes) { group_budget_bytes_ = bytes; }

    // The ISA an expert with m tokens runs with (not forced): AMX (real, when this CPU
    // and OS allow it) from amx_min_tokens tokens, else AVX-512-BF16, else AVX2, else ref.
    const KernelOps* isa_for_tokens(int64_t m) const;

    // Returns false when keep_going() asked to abort (out is then unspecified).
    bool forward(const bf16* x, int64_t ldx, int64_t n_tokens, const int64_t* ids, const float* weights, int64_t top_k,
                 void* out, bool out_fp32, const std::function<bool()>& keep_going);

    const StepStats& last_stats() const { return stats_; }

private:
    struct ActiveExpert {
        int64_t expert;
        int64_t m;
        int64_t slot0;  // into slot_token / slot_weight
        const KernelOps* ops;
        size_t packed_x_offset, packed_act_offset;  // bytes, in packed_arena_
        size_t part_offset;                         // floats, in each node's partial arena
    };

    std::shared_ptr<WorkerPool> pool_;
    int64_t hidden_, intermediate_;
    std::vector<ExpertParts> experts_;
    bool isa_forced_ = false;
    Isa forced_isa_ = Isa::ref;
    int64_t amx_min_tokens_ = 1;
    int64_t group_budget_bytes_ = int64_t(256) << 20;

    // reused between steps (grown as needed)
    std::vector<int64_t> slot_token_;
    std::vector<float> slot_weight_;
    std::vector<int64_t> expert_count_;
    std::vector<ActiveExpert> active_;
    std::unique_ptr<uint8_t, void (*)(void*)> packed_arena_{nullptr, &std::free};
    size_t packed_capacity_ = 0;
    std::vector<std::unique_ptr<float, void (*)(void*)>> part_arena_;
    std::vector<size_t> part_capacity_;
    std::unique_ptr<float, void (*)(void*)> y_arena_{nullptr, &std::free};
    size_t y_capacity_ = 0;
    StepStats stats_;
};

}  // namespace numa_moe::workers
