// One expert's FFN, out = act(x Wg^T + b_g, x Wu^T + b_u) Wd^T + b_d (act: silu(g) * u by
// default, kernels::Activation; the biases optional): the one-expert, one-node case of the
// pipeline (pipeline.hpp), on the process pool (process_pool.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/kernel_api.hpp"

namespace numa_moe::engine {

using kernels::bf16;

struct ExpertFfnArgs {
    const bf16* x = nullptr;  // [T, hidden] row-major, row stride ldx
    int64_t ldx = 0;
    const int64_t* token_index = nullptr;  // m rows of x; output row t is token_index[t]'s
    int64_t m = 0;
    int64_t hidden = 0, intermediate = 0;
    kernels::Weights gate, up;  // [intermediate, hidden]
    kernels::Weights down;      // [hidden, intermediate]
    kernels::Format format = kernels::Format::bf16;  // of all three
    // Segment lists per matrix; empty = the whole matrix as one segment.
    std::vector<Segment> gate_segments, up_segments, down_segments;
    kernels::ExpertEpilogue epilogue;  // the activation, gate / up biases (fp32 [intermediate] or null)
    const float* down_bias = nullptr;  // fp32 [hidden] or null
    void* out = nullptr;  // [m, hidden] row-major, bf16 or fp32 (overwritten)
    bool out_bf16 = false;
    int threads = 1;
};

// Runs the FFN with `ops` (a table of args.format). Returns false when keep_going aborted it (out is then unspecified);
// exceptions from any thread are rethrown here.
bool expert_ffn(const kernels::KernelOps& ops, const ExpertFfnArgs& args, const std::function<bool()>& keep_going = {});

}  // namespace numa_moe::engine
