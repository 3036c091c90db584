// One expert's FFN, y = (silu(x Wg^T) * (x Wu^T)) Wd^T, driven through a KernelOps table,
// its two phases one run on the process-wide kernel pool (kernel_pool.hpp). A simple
// driver for tests, benchmarks and single-node use; the NUMA layer lives in native/workers.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

struct ExpertFfnArgs {
    const bf16* x = nullptr;  // [T, hidden] row-major, row stride ldx
    int64_t ldx = 0;
    const int64_t* token_index = nullptr;  // m rows of x
    int64_t m = 0;
    int64_t hidden = 0, intermediate = 0;
    const bf16* w_gate = nullptr;  // [intermediate, hidden]
    const bf16* w_up = nullptr;    // [intermediate, hidden]
    const bf16* w_down = nullptr;  // [hidden, intermediate]
    // Segment lists per matrix; empty = the whole matrix as one segment.
    std::vector<Segment> gate_segments, up_segments, down_segments;
    void* out = nullptr;  // [m, hidden] row-major, fp32 or bf16 (overwritten)
    bool out_bf16 = false;
    int threads = 1;
};

// Runs the FFN; exceptions from worker threads are rethrown in the caller.
void expert_ffn(const KernelOps& ops, const ExpertFfnArgs& args);

}  // namespace numa_moe::kernels
