#include "engine/process_pool.hpp"

#include <atomic>
#include <mutex>
#include <new>
#include <utility>

#include <pthread.h>
#include <sched.h>

namespace numa_moe::engine {
namespace {

// Idle workers spin this long for the next call before sleeping: back-to-back calls
// (a benchmark loop, a model's experts) then skip the futex wake-up.
constexpr int64_t kIdleSpinUs = 50;

struct PoolCache {
    std::mutex mutex;
    int threads = 0;
    std::vector<int> cpus;
    std::shared_ptr<WorkerPool> pool;
    int64_t retired_starts = 0;  // start counts of the pools replaced so far
};

// Never destroyed: the pool outlives every caller, including static destructors at exit.
PoolCache* g_cache = nullptr;

void reset_cache_mutex_in_child() {
    // The parent may have held the mutex in another thread at fork(); the child has only
    // the forking thread, so a fresh mutex is correct. The pool itself notices the fork.
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

std::shared_ptr<WorkerPool> make_pool(int threads, const std::vector<int>& cpus) {
    const bool pin = !cpus.empty() && threads <= static_cast<int>(cpus.size());
    std::vector<int> workers;
    for (int i = pin ? 1 : 0; i < threads; ++i) workers.push_back(cpus.empty() ? 0 : cpus[i % cpus.size()]);
    return std::make_shared<WorkerPool>(std::vector<std::vector<int>>{workers}, pin, kIdleSpinUs,
                                        pin ? cpus[0] : -1);
}

}  // namespace

std::shared_ptr<WorkerPool> process_pool(int threads) {
    std::vector<int> cpus = affinity_cpus();
    PoolCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (!c.pool || c.threads != threads || c.cpus != cpus) {
        if (c.pool) c.retired_starts += c.pool->start_count();
        c.pool = make_pool(threads, cpus);
        c.threads = threads;
        c.cpus = std::move(cpus);
    }
    return c.pool;
}

int64_t process_pool_start_count() {
    PoolCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    return c.retired_starts + (c.pool ? c.pool->start_count() : 0);
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

int affinity_cpu_count() {
    const size_t n = affinity_cpus().size();
    return n ? static_cast<int>(n) : 1;
}

}  // namespace numa_moe::engine
