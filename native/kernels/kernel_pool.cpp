// Process-wide kernel pools (see kernel_pool.hpp). Baseline x86-64 code.
#include "kernels/kernel_pool.hpp"

#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <utility>

#include <pthread.h>
#include <sched.h>

#include "common/worker_pool.hpp"

namespace numa_moe::kernels {
namespace {

// Idle workers spin this long for the next call before sleeping: back-to-back calls
// (a layer's experts, a benchmark loop) then skip the futex wake-up.
constexpr int64_t kIdleSpinUs = 50;

thread_local bool t_inside_pool_job = false;

using PoolKey = std::pair<int, std::vector<int>>;  // (threads, affinity CPUs)

struct PoolCache {
    std::mutex mutex;
    std::map<PoolKey, std::unique_ptr<WorkerPool>> pools;
};

// Never destroyed: pools outlive every caller, including static destructors at exit.
PoolCache* g_cache = nullptr;

void reset_cache_mutex_in_child() {
    // The parent may have held the mutex in another thread at fork(); the child has only
    // the forking thread, so a fresh mutex is correct. The pools themselves notice the
    // fork and restart their threads.
    if (g_cache) new (&g_cache->mutex) std::mutex();
}

PoolCache& cache() {
    static PoolCache* const instance = [] {
        g_cache = new PoolCache();
        pthread_atfork(nullptr, nullptr, reset_cache_mutex_in_child);
        return g_cache;
    }();
    return *instance;
}

WorkerPool& pool_for(int threads) {
    std::vector<int> cpus = affinity_cpus();
    PoolCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    auto& slot = c.pools[PoolKey(threads, cpus)];
    if (!slot) {
        // With a CPU per thread: threads - 1 workers on cpus[1..], and the calling thread as
        // the last participant on cpus[0] (see WorkerPool's caller CPU). Otherwise (more
        // threads than CPUs) `threads` unpinned workers while the caller waits.
        const bool pin = !cpus.empty() && threads <= static_cast<int>(cpus.size());
        std::vector<int> node;
        for (int i = pin ? 1 : 0; i < threads; ++i) node.push_back(cpus.empty() ? 0 : cpus[i % cpus.size()]);
        slot = std::make_unique<WorkerPool>(std::vector<std::vector<int>>{node}, pin, kIdleSpinUs, pin ? cpus[0] : -1);
    }
    return *slot;
}

}  // namespace

int64_t kernel_pool_start_count() {
    PoolCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    int64_t total = 0;
    for (const auto& entry : c.pools) total += entry.second->start_count();
    return total;
}

std::vector<int> affinity_cpus() {
    std::vector<int> cpus;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
        if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    return cpus;
}

void run_phases(int threads, int n_phases, const std::function<void(int, int, int)>& body) {
    if (threads <= 1 || t_inside_pool_job) {
        for (int phase = 0; phase < n_phases; ++phase) body(phase, 0, 1);
        return;
    }
    WorkerPool& pool = pool_for(threads);
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex error_mutex;
    pool.run([&](const ThreadInfo& info) {
        t_inside_pool_job = true;
        for (int phase = 0; phase < n_phases; ++phase) {
            if (phase > 0) pool.barrier();
            // Read after the barrier: every thread sees the same value, so all skip together.
            if (failed.load(std::memory_order_acquire)) break;
            try {
                body(phase, info.global, threads);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_mutex);
                if (!error) error = std::current_exception();
                failed.store(true, std::memory_order_release);
            }
        }
        t_inside_pool_job = false;
    });
    if (error) std::rethrow_exception(error);
}

}  // namespace numa_moe::kernels
