// Persistent worker threads, one group per NUMA node (real or virtual), each thread pinned
// to one CPU of its node.
//
// Dispatch: run(n_phases, job) hands one job to every worker thread and returns when all
// of them have finished it. A job is a sequence of phases with a barrier between
// consecutive phases (phase p of every participant ends before phase p + 1 of any starts);
// jobs never synchronise by themselves, so no participant can wait for one that left.
// Workers wait for the next job spinning briefly, then sleeping on a futex; barriers spin,
// then sleep. Threads are created lazily by the first run() (or start()), never per call.
//
// A pool made with a caller CPU (caller_cpu >= 0) also runs the job on the calling
// thread, as one more participant (the last ThreadInfo index), and pins the caller to
// caller_cpu for the duration of run() when it finds itself on a worker's CPU (its
// affinity is restored on return): n worker threads plus a caller that only sleeps would
// be n + 1 threads on n CPUs, and the sleeping caller's wake-up at the end of every run
// would wait for a CPU behind a spinning worker; an unpinned caller can share a worker's
// CPU, where every spinning wait of either starves the other.
//
// Errors and abort: the pool owns both. An exception thrown by the job on any participant
// is caught there and aborts the run; so does keep_going() returning false (polled by the
// calling thread while it waits). An aborted run skips every remaining phase on every
// participant (barriers are still passed, so nothing hangs); long phases may poll
// aborted() to stop early. run() rethrows the first exception once all participants are
// done, and the pool stays usable. Thread-creation and pinning failures throw from run()
// (or start()) with nothing left running.
//
// Threads: when the process has an OpenMP runtime loaded (PyTorch's libgomp), run()
// executes the job on that runtime's thread team instead of the pool's own threads,
// pinned the same way (openmp_team.hpp says why); the own threads are then never
// started. A pool with more participants than CPUs (virtual nodes sharing CPUs) keeps
// its own threads, so the team never grows beyond the CPUs; so do NUMA_MOE_THREADS=own, a
// forked child, a call from inside an OpenMP region and a team smaller than asked for.
//
// Lifetime: shutdown() (also the destructor) stops and joins the threads. After fork()
// the child has none of the parent's threads: the pool notices (pthread_atfork
// generation counter), abandons the parent's thread state without touching it and
// starts fresh threads on the child's next run().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <pthread.h>
#include <sched.h>

namespace numa_moe {

struct OpenMpRuntime;

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
    // job(phase, thread): phase in [0, n_phases) of a run.
    using Job = std::function<void(int phase, const ThreadInfo& thread)>;

    // node_cpus[n] = CPUs of node n; one worker thread per listed CPU. With pin=false the
    // threads are left to the scheduler (cpu = -1). spin_us: how long idle workers spin
    // before sleeping (0 = sleep at once). caller_cpu: see above (-1: the caller only waits).
    // Every listed CPU (and caller_cpu) must be one this process may run on (in the
    // affinity mask of one of its threads), pinned or not: std::invalid_argument names
    // those that are not.
    WorkerPool(std::vector<std::vector<int>> node_cpus, bool pin, int64_t spin_us, int caller_cpu = -1);
    ~WorkerPool();
    WorkerPool(const WorkerPool&) = delete;
    WorkerPool& operator=(const WorkerPool&) = delete;

    int n_nodes() const { return static_cast<int>(node_cpus_.size()); }
    int n_threads() const { return static_cast<int>(infos_.size()); }
    // Threads that run each job: the workers, and the caller when it joins.
    int participants() const { return n_threads() + (caller_cpu_ >= 0 ? 1 : 0); }
    // The calling thread's ThreadInfo when it joins: node 0, global index n_threads().
    ThreadInfo caller_info() const;
    int threads_of(int node) const { return static_cast<int>(node_cpus_[node].size()); }
    // Participants of a node: its threads, and the caller for node 0 when it joins.
    int participants_of(int node) const { return threads_of(node) + (node == 0 && caller_cpu_ >= 0 ? 1 : 0); }
    const std::vector<ThreadInfo>& threads() const { return infos_; }
    const std::vector<std::vector<int>>& node_cpus() const { return node_cpus_; }
    bool started();

    void start();
    void shutdown();

    // Runs phases 0 .. n_phases-1 of job on every worker thread (and on the calling thread
    // when it joins), a barrier between phases; returns when all are done. keep_going (may
    // be empty) is called on the calling thread every poll_ms while it waits. Returns false
    // when keep_going aborted the run; rethrows the first exception a participant threw.
    // Calling run() from inside a job throws std::logic_error (it would deadlock).
    bool run(int n_phases, const Job& job, const std::function<bool()>& keep_going = {}, int poll_ms = 50);

    // For jobs: whether the current run was aborted (an error elsewhere, or keep_going).
    // On the calling thread it also polls keep_going (at most every poll_ms), so a long
    // phase of a joining caller still sees Ctrl-C.
    bool aborted() const;

    // Number of times threads were created (tests: no thread creation per call).
    int64_t start_count() const { return start_count_; }

private:
    struct State;
    struct OpenMpRun;
    static void* thread_main(void* arg);
    static void openmp_participant(void* run);
    // Runs the job on the loaded OpenMP team; false when the team came out smaller than
    // the participants (nothing ran then).
    bool run_on_openmp(const OpenMpRuntime& omp, bool* completed);
    void begin_run(int n_phases, const Job& job, const std::function<bool()>& keep_going, int poll_ms);
    bool end_run();
    ThreadInfo participant(int index) const;
    void ensure_fresh_after_fork();
    void stop_threads();
    void run_phases(const ThreadInfo& info);

    std::vector<std::vector<int>> node_cpus_;
    std::vector<ThreadInfo> infos_;
    bool pin_;
    int64_t spin_ns_;
    bool oversubscribed_;
    int caller_cpu_;
    cpu_set_t worker_cpus_;   // the workers' CPUs when pinned
    cpu_set_t process_cpus_;  // the creating thread's affinity: what unpinned threads get
    std::unique_ptr<State> state_;
    uint64_t fork_generation_ = 0;
    int64_t start_count_ = 0;
};

}  // namespace numa_moe
