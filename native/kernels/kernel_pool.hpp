// The process-wide worker pools of the kernels' single-node drivers (expert_ffn, the
// benchmark's streaming read), so that a call pays a wake-up, not thread creation.
//
// One persistent WorkerPool (native/common) per thread count, its threads pinned to the
// first CPUs of this process's affinity mask (left unpinned when more threads than CPUs
// are asked for), created lazily on first use and kept for the process's life. Fork-safe:
// a WorkerPool starts fresh threads in a forked child.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace numa_moe::kernels {

// Runs body(phase, index, n_threads) for phase = 0 .. n_phases-1 on n_threads threads
// (index 0 .. n_threads-1), with a barrier between phases, and returns when all are done.
// n_threads is `threads`, or 1 when threads <= 1 or when called from inside a pool job
// (nested calls run inline on the calling thread instead of deadlocking on the pool).
// If a body throws, the phases after the current one are skipped on every thread and the
// first exception is rethrown here; the call never hangs.
void run_phases(int threads, int n_phases, const std::function<void(int phase, int index, int n_threads)>& body);

// Thread creations over all kernel pools so far (tests: none per call).
int64_t kernel_pool_start_count();

// CPUs in this process's affinity mask, ascending.
std::vector<int> affinity_cpus();

}  // namespace numa_moe::kernels
