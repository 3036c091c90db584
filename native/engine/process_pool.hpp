// The process-wide pool of the single-node drivers (expert_ffn, the benchmarks), so that
// a call pays a wake-up, not thread creation.
//
// `threads` participants over the first CPUs of this process's affinity mask: threads - 1
// pinned workers plus the calling thread (WorkerPool's caller CPU), or `threads` unpinned
// workers while the caller waits when more threads than CPUs are asked for. Only the pool
// of the most recent (threads, CPUs) is kept; one still in use by another call lives
// until that call returns, so the number of pools is bounded by the concurrent calls.
// Fork-safe: a WorkerPool starts fresh threads in a forked child.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/worker_pool.hpp"

namespace numa_moe::engine {

// The pool for `threads` (>= 2) participants.
std::shared_ptr<WorkerPool> process_pool(int threads);

// Thread creations over all process pools so far (tests: none per call).
int64_t process_pool_start_count();

// CPUs in this process's affinity mask, ascending; their count (at least 1).
std::vector<int> affinity_cpus();
int affinity_cpu_count();

}  // namespace numa_moe::engine
