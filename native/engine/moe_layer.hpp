// One NUMA-partitioned MoE layer step over a WorkerPool: route the tokens to experts
// (routing.hpp), choose each active expert's ISA, then run the pipeline (pipeline.hpp).
//
// Operands (bf16 = raw uint16_t bit patterns):
//   x        hidden states x[t * ldx + h], T x H bf16
//   ids      topk_ids[t * k + j] int64 in [0, E)
//   weights  topk_weights[t * k + j] fp32
//   out      out[t * H + h], T x H, bf16 or fp32
//   per expert: gate, up [I, H] and down [H, I] bf16 row-major (any row stride), and for
//   each matrix and each pool node the segments of the matrix on that node (rows
//   renumbered from 0 within the expert's matrix).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/worker_pool.hpp"
#include "engine/pipeline.hpp"
#include "engine/routing.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::engine {

using kernels::Isa;

// Per-step measurements, for the work-balance report.
struct StepStats {
    int64_t wall_ns = 0;
    int64_t n_active_experts = 0;
    int64_t n_slots = 0;
    std::vector<int64_t> node_bytes;  // weight bytes read per node
    StepTimes times;                  // per participant: matmul busy time, time per phase kind
    std::vector<std::string> expert_isa;  // per active expert, ascending id
};

class MoELayerCore {
public:
    MoELayerCore(std::shared_ptr<WorkerPool> pool, int64_t hidden, int64_t intermediate);

    int64_t hidden() const { return hidden_; }
    int64_t intermediate() const { return intermediate_; }
    int64_t n_experts() const { return static_cast<int64_t>(experts_.size()); }
    const std::shared_ptr<WorkerPool>& pool() const { return pool_; }
    const ExpertParts& expert(int64_t e) const { return experts_.at(e); }

    // Takes ownership of the description (its biases stay the caller's memory); checks
    // shapes and segments (and, with verify_partition, that each matrix's segments
    // partition it). The expert gets the layer's activation.
    void add_expert(ExpertParts parts, bool verify_partition);

    // The activation of every expert, those added so far and later (kernel_api.hpp; default
    // silu(g) * u).
    void set_activation(const kernels::Activation& activation);
    const kernels::Activation& activation() const { return activation_; }

    // forced: run every expert with this ISA (std::invalid_argument when this CPU cannot);
    // otherwise the rule in isa_for_tokens.
    void set_isa(bool forced, Isa isa);
    // 0: each weight format's default (default_amx_min_tokens, kernel_choice.hpp).
    void set_amx_min_tokens(int64_t m) { amx_min_tokens_ = m; }
    // Per-node fp32 partial memory a group of experts may use before the step is split
    // into several pool runs.
    void set_group_budget_bytes(int64_t bytes) { group_budget_bytes_ = bytes; }

    // The kernels an expert with m tokens of a weight format and group (0: the format's
    // default, kernel_api.hpp default_group) runs with (not forced): kernels_for_tokens
    // (kernel_choice.hpp) with this layer's amx_min_tokens.
    const KernelOps* isa_for_tokens(int64_t m, kernels::Format format = kernels::Format::bf16,
                                    int64_t group = 0) const;

    // Returns false when keep_going() asked to abort (out is then unspecified).
    bool forward(const bf16* x, int64_t ldx, int64_t n_tokens, const int64_t* ids, const float* weights, int64_t top_k,
                 void* out, bool out_bf16, const std::function<bool()>& keep_going);

    const StepStats& last_stats() const { return stats_; }

private:
    void plan_tasks();
    // isa_for_tokens, or the forced ISA's table (std::invalid_argument when it has no
    // kernels for the format).
    const KernelOps* expert_kernels(int64_t m, const MatrixPart& matrix) const;
    void record_stats();

    std::shared_ptr<WorkerPool> pool_;
    Team team_;
    int64_t hidden_, intermediate_;
    std::vector<ExpertParts> experts_;
    kernels::Activation activation_;
    bool isa_forced_ = false;
    Isa forced_isa_ = Isa::ref;
    int64_t amx_min_tokens_ = 0;
    int64_t group_budget_bytes_ = int64_t(256) << 20;

    // reused between steps
    Routing routing_;
    std::vector<ExpertTask> tasks_;
    StepArena arena_;
    StepStats stats_;
};

}  // namespace numa_moe::engine
