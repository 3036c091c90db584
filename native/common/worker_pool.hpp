// Persistent worker threads, one group per NUMA node (real or virtual), each thread pinned
// to one CPU of its node.
//
// Dispatch: run(job) hands one job to every worker thread and returns when all of them
// have finished it. Workers wait for the next job spinning briefly, then sleeping on a
// futex; a job synchronises its phases with barrier() (spin, then futex). Threads are
// created lazily by the first run() (or start()), never per call.
//
// Lifetime: shutdown() (also the destructor) stops and joins the threads. After fork()
// the child has none of the parent's threads: the pool notices (pthread_atfork
// generation counter), abandons the parent's thread state without touching it and
// starts fresh threads on the child's next run().
//
// Interruption: run() takes a keep_going() callback that the calling thread polls while
// it waits; once it returns false, aborted() becomes true and jobs skip the rest of their
// work but still pass every barrier, so the call always returns (never hangs).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <pthread.h>

namespace numa_moe {

struct ThreadInfo {
    int node;    // index of the node in the pool (0 .. n_nodes-1)
    int local;   // index of the thread within its node
    int global;  // index of the thread within the pool
    int cpu;     // the CPU it is pinned to (-1 when not pinned)
};

// Barrier over a fixed number of threads; waiters spin for spin_ns, then futex-sleep.
class Barrier {
public:
    void reset(int n_threads, int64_t spin_ns) {
        n_threads_ = n_threads;
        spin_ns_ = spin_ns;
        count_.store(0);
    }
    void arrive_and_wait();

private:
    int n_threads_ = 0;
    int64_t spin_ns_ = 0;
    alignas(64) std::atomic<int> count_{0};
    alignas(64) std::atomic<uint32_t> generation_{0};
    alignas(64) std::atomic<int> sleepers_{0};
};

class WorkerPool {
public:
    using Job = std::function<void(const ThreadInfo&)>;

    // node_cpus[n] = CPUs of node n; one worker thread per listed CPU. With pin=false the
    // threads are left to the scheduler (cpu = -1). spin_us: how long idle workers spin
    // before sleeping (0 = sleep at once).
    WorkerPool(std::vector<std::vector<int>> node_cpus, bool pin, int64_t spin_us);
    ~WorkerPool();
    WorkerPool(const WorkerPool&) = delete;
    WorkerPool& operator=(const WorkerPool&) = delete;

    int n_nodes() const { return static_cast<int>(node_cpus_.size()); }
    int n_threads() const { return static_cast<int>(infos_.size()); }
    int threads_of(int node) const { return static_cast<int>(node_cpus_[node].size()); }
    const std::vector<ThreadInfo>& threads() const { return infos_; }
    const std::vector<std::vector<int>>& node_cpus() const { return node_cpus_; }
    bool started();

    void start();
    void shutdown();

    // Runs job on every worker thread, waits for all. keep_going (may be empty) is called
    // on the calling thread every poll_ms while waiting.
    void run(const Job& job, const std::function<bool()>& keep_going = {}, int poll_ms = 50);

    // For jobs: whether the caller asked to abort this run.
    bool aborted() const;
    // For jobs: wait until every worker thread of the pool has arrived.
    void barrier();

    // Number of times threads were created (tests: no thread creation per call).
    int64_t start_count() const { return start_count_; }

private:
    struct State;
    static void* thread_main(void* arg);
    void ensure_fresh_after_fork();

    std::vector<std::vector<int>> node_cpus_;
    std::vector<ThreadInfo> infos_;
    bool pin_;
    int64_t spin_ns_;
    bool oversubscribed_;
    std::unique_ptr<State> state_;
    uint64_t fork_generation_ = 0;
    int64_t start_count_ = 0;
};

}  // namespace numa_moe
