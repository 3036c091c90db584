// Persistent per-node worker threads (see worker_pool.hpp). Linux only: futex(2),
// pthread_setaffinity_np, pthread_atfork.
#include "common/worker_pool.hpp"

#include "common/check.hpp"
#include "common/openmp_team.hpp"
#include "common/util.hpp"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include <dirent.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NUMA_MOE_PAUSE() _mm_pause()
#else
#define NUMA_MOE_PAUSE() ((void)0)
#endif

namespace numa_moe {
namespace {

std::atomic<uint64_t> g_fork_generation{0};

void on_fork_child() { g_fork_generation.fetch_add(1); }

uint64_t fork_generation() {
    // Registered once, the first time any pool asks.
    static const int registered = pthread_atfork(nullptr, nullptr, on_fork_child);
    (void)registered;
    return g_fork_generation.load();
}

// The pool whose job the current thread is running (run() refuses to nest), and the pool
// whose run() the current thread is inside as its caller (it polls keep_going).
thread_local const WorkerPool* t_job_pool = nullptr;
thread_local const WorkerPool* t_calling_pool = nullptr;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, timeout, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Spins until *word != seen or spin_ns elapse; returns whether it changed.
bool spin_until_changed(const std::atomic<uint32_t>& word, uint32_t seen, int64_t spin_ns) {
    if (spin_ns <= 0) return word.load(std::memory_order_acquire) != seen;
    const int64_t deadline = now_ns() + spin_ns;
    for (int i = 0;; ++i) {
        if (word.load(std::memory_order_acquire) != seen) return true;
        NUMA_MOE_PAUSE();
        if ((i & 63) == 63 && now_ns() > deadline) return false;
    }
}

// The CPUs any thread of this process may run on: the union of their affinity masks (and
// `own`, the calling thread's). Not the calling thread's alone: an OpenMP runtime bound
// to a list of CPUs (vLLM's CPU worker) pins the main thread to the first of them, and a
// layer over the whole list is built on that thread.
cpu_set_t process_allowed_cpus(const cpu_set_t& own) {
    cpu_set_t all = own;
    DIR* tasks = opendir("/proc/self/task");
    if (!tasks) return all;
    while (const dirent* entry = readdir(tasks)) {
        char* end = nullptr;
        const long tid = std::strtol(entry->d_name, &end, 10);
        if (end == entry->d_name || *end != '\0') continue;
        cpu_set_t set;
        CPU_ZERO(&set);
        if (sched_getaffinity(static_cast<pid_t>(tid), sizeof(set), &set) == 0) CPU_OR(&all, &all, &set);
    }
    closedir(tasks);
    return all;
}

// "0-3, 8, 10-11".
std::string cpu_set_text(const cpu_set_t& set) {
    std::string text;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (!CPU_ISSET(cpu, &set)) continue;
        int last = cpu;
        while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
        text += (text.empty() ? "" : ", ") + std::to_string(cpu) + (last > cpu ? "-" + std::to_string(last) : "");
        cpu = last;
    }
    return text;
}

}  // namespace

void Barrier::arrive_and_wait() {
    const uint32_t seen = generation_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_threads_) {
        count_.store(0, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
        return;
    }
    if (spin_until_changed(generation_, seen, spin_ns_)) return;
    // Dekker pairing with the releaser: sleepers++ then re-check (inside futex_wait) here,
    // generation++ then read sleepers there; seq_cst on both sides.
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(&generation_, seen, nullptr);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
}

struct WorkerPool::State {
    std::mutex run_mutex;  // one run()/start()/shutdown() at a time
    std::vector<pthread_t> threads;
    bool running = false;

    alignas(64) std::atomic<uint32_t> job_generation{0};
    alignas(64) std::atomic<int> job_sleepers{0};
    alignas(64) std::atomic<int> remaining{0};
    alignas(64) std::atomic<uint32_t> done_generation{0};
    std::atomic<bool> stop{false};
    std::atomic<bool> abort{false};
    const Job* job = nullptr;
    int n_phases = 0;
    Barrier barrier;
    std::mutex job_error_mutex;
    std::exception_ptr job_error;  // the first exception of the current run
    // keep_going of the current run; only the calling thread touches these
    const std::function<bool()>* keep_going = nullptr;
    int64_t poll_ns = 0;
    int64_t next_poll_ns = 0;
    bool interrupted = false;

    // start-up handshake
    std::atomic<int> ready{0};
    std::mutex error_mutex;
    std::string start_error;
};

namespace {
struct ThreadArg {
    WorkerPool* pool;
    void* state;
    ThreadInfo info;
    bool pin;
    int64_t spin_ns;
};
}  // namespace

WorkerPool::WorkerPool(std::vector<std::vector<int>> node_cpus, bool pin, int64_t spin_us, int caller_cpu)
    : node_cpus_(std::move(node_cpus)), pin_(pin), spin_ns_(spin_us * 1000), caller_cpu_(caller_cpu) {
    NUMA_MOE_CHECK(caller_cpu_ < CPU_SETSIZE, "WorkerPool: invalid caller CPU ", caller_cpu_);
    NUMA_MOE_CHECK(!node_cpus_.empty(), "WorkerPool needs at least one node");
    std::set<int> distinct;
    for (size_t n = 0; n < node_cpus_.size(); ++n) {
        NUMA_MOE_CHECK(!node_cpus_[n].empty(), "WorkerPool: node ", n, " has no CPUs");
        for (size_t l = 0; l < node_cpus_[n].size(); ++l) {
            const int cpu = node_cpus_[n][l];
            NUMA_MOE_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "WorkerPool: node ", n, " lists invalid CPU ", cpu);
            distinct.insert(cpu);
            infos_.push_back(ThreadInfo{static_cast<int>(n), static_cast<int>(l), static_cast<int>(infos_.size()),
                                        pin_ ? cpu : -1});
        }
    }
    CPU_ZERO(&process_cpus_);
    if (sched_getaffinity(0, sizeof(process_cpus_), &process_cpus_) != 0) CPU_ZERO(&process_cpus_);
    // On the OpenMP team an unusable CPU would not even fail: pinning is best effort there,
    // and the participant would silently run wherever it is.
    const cpu_set_t allowed = process_allowed_cpus(process_cpus_);
    if (CPU_COUNT(&allowed) > 0) {
        std::set<int> listed = distinct;
        if (caller_cpu_ >= 0) listed.insert(caller_cpu_);
        std::string outside;
        for (const int cpu : listed)
            if (!CPU_ISSET(cpu, &allowed)) outside += (outside.empty() ? "" : ", ") + std::to_string(cpu);
        NUMA_MOE_CHECK(outside.empty(), "WorkerPool: CPU(s) ", outside,
                       " not in this process's allowed set (os.sched_getaffinity of its threads: ", cpu_set_text(allowed),
                       ")");
    }
    const unsigned hw = std::thread::hardware_concurrency();
    // More threads than CPUs (virtual nodes sharing CPUs): a spinning waiter would only
    // steal the time slice of the thread it waits for, so waiters sleep at once.
    CPU_ZERO(&worker_cpus_);
    if (pin_)
        for (const int cpu : distinct) CPU_SET(cpu, &worker_cpus_);
    if (caller_cpu_ >= 0) distinct.insert(caller_cpu_);
    const size_t runners = infos_.size() + (caller_cpu_ >= 0 ? 1 : 0);
    oversubscribed_ = runners > distinct.size() || (hw > 0 && runners > hw);
    fork_generation_ = fork_generation();
    state_ = std::make_unique<State>();
}

WorkerPool::~WorkerPool() {
    try {
        shutdown();
    } catch (...) {
    }
}

void WorkerPool::ensure_fresh_after_fork() {
    const uint64_t generation = fork_generation();
    if (generation == fork_generation_) return;
    // In a forked child: the parent's threads do not exist here and its mutexes may be
    // held forever. Abandon that state (a small deliberate leak) and start afresh.
    (void)state_.release();
    state_ = std::make_unique<State>();
    fork_generation_ = generation;
}

bool WorkerPool::started() {
    ensure_fresh_after_fork();
    std::lock_guard<std::mutex> lock(state_->run_mutex);
    return state_->running;
}

void* WorkerPool::thread_main(void* raw) {
    std::unique_ptr<ThreadArg> arg(static_cast<ThreadArg*>(raw));
    State* state = static_cast<State*>(arg->state);
    const ThreadInfo info = arg->info;
    if (arg->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(info.cpu, &set);
        const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        if (rc != 0) {
            std::lock_guard<std::mutex> lock(state->error_mutex);
            if (state->start_error.empty())
                state->start_error = "pinning the worker thread of node " + std::to_string(info.node) + " to CPU " +
                                     std::to_string(info.cpu) + " failed: " + std::strerror(rc) +
                                     " (errno " + std::to_string(rc) + "; is the CPU in this process's allowed set?)";
        }
    }
    state->ready.fetch_add(1);
    uint32_t seen = 0;
    const int64_t spin_ns = arg->spin_ns;
    for (;;) {
        if (!spin_until_changed(state->job_generation, seen, spin_ns)) {
            state->job_sleepers.fetch_add(1, std::memory_order_seq_cst);
            while (state->job_generation.load(std::memory_order_seq_cst) == seen)
                futex_wait(&state->job_generation, seen, nullptr);
            state->job_sleepers.fetch_sub(1, std::memory_order_seq_cst);
        }
        seen = state->job_generation.load(std::memory_order_acquire);
        if (state->stop.load(std::memory_order_acquire)) break;
        arg->pool->run_phases(info);
        if (state->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            state->done_generation.fetch_add(1, std::memory_order_seq_cst);
            futex_wake_all(&state->done_generation);
        }
    }
    return nullptr;
}

void WorkerPool::start() {
    ensure_fresh_after_fork();
    State& state = *state_;
    std::lock_guard<std::mutex> lock(state.run_mutex);
    if (state.running) return;
    state.stop.store(false);
    state.ready.store(0);
    state.start_error.clear();
    const uint32_t first_generation = state.job_generation.load();
    if (first_generation != 0) state.job_generation.store(0);
    for (const ThreadInfo& info : infos_) {
        auto* arg = new ThreadArg{this, &state, info, pin_, oversubscribed_ ? 0 : spin_ns_};
        pthread_t thread;
        const int rc = pthread_create(&thread, nullptr, &WorkerPool::thread_main, arg);
        if (rc != 0) {
            delete arg;
            stop_threads();
            throw std::runtime_error("WorkerPool: creating worker thread " + std::to_string(info.global + 1) + " of " +
                                     std::to_string(n_threads()) + " failed: " + std::strerror(rc) +
                                     " (process or memory limits?)");
        }
        state.threads.push_back(thread);
    }
    while (state.ready.load() < n_threads()) std::this_thread::yield();
    ++start_count_;
    state.running = true;
    std::string error;
    {
        std::lock_guard<std::mutex> error_lock(state.error_mutex);
        error = state.start_error;
    }
    if (!error.empty()) {
        stop_threads();
        state.running = false;
        throw std::runtime_error("WorkerPool: " + error);
    }
}

// Wakes every started thread with the stop flag set and joins it. Caller holds run_mutex.
void WorkerPool::stop_threads() {
    State& state = *state_;
    state.stop.store(true, std::memory_order_seq_cst);
    state.job_generation.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&state.job_generation);
    for (pthread_t t : state.threads) pthread_join(t, nullptr);
    state.threads.clear();
}

void WorkerPool::shutdown() {
    ensure_fresh_after_fork();
    State& state = *state_;
    std::lock_guard<std::mutex> lock(state.run_mutex);
    if (!state.running) return;
    stop_threads();
    state.running = false;
}

ThreadInfo WorkerPool::caller_info() const { return ThreadInfo{0, threads_of(0), n_threads(), caller_cpu_}; }

namespace {
// Pins the calling thread to one CPU for its lifetime, then restores its affinity.
class ScopedPin {
public:
    explicit ScopedPin(int cpu) {
        CPU_ZERO(&saved_);
        if (pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_) != 0) return;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        pinned_ = pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0;
    }
    ~ScopedPin() {
        if (pinned_) pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
    }
    ScopedPin(const ScopedPin&) = delete;
    ScopedPin& operator=(const ScopedPin&) = delete;

private:
    cpu_set_t saved_;
    bool pinned_ = false;
};
}  // namespace

bool WorkerPool::aborted() const {
    State& state = *state_;
    if (t_calling_pool == this && state.keep_going && !state.interrupted) {
        const int64_t now = now_ns();
        if (now >= state.next_poll_ns) {
            state.next_poll_ns = now + state.poll_ns;
            if (!(*state.keep_going)()) {
                state.interrupted = true;
                state.abort.store(true, std::memory_order_relaxed);
            }
        }
    }
    return state.abort.load(std::memory_order_relaxed);
}

// One participant's share of a run: every phase, a barrier between phases. After an
// abort the remaining phases are skipped but their barriers still passed, because the
// other participants may not have seen the abort yet and wait there.
void WorkerPool::run_phases(const ThreadInfo& info) {
    State& state = *state_;
    t_job_pool = this;
    for (int phase = 0; phase < state.n_phases; ++phase) {
        if (phase > 0) state.barrier.arrive_and_wait();
        if (aborted()) continue;
        try {
            (*state.job)(phase, info);
        } catch (...) {
            std::lock_guard<std::mutex> lock(state.job_error_mutex);
            if (!state.job_error) state.job_error = std::current_exception();
            state.abort.store(true, std::memory_order_relaxed);
        }
    }
    t_job_pool = nullptr;
}

ThreadInfo WorkerPool::participant(int index) const {
    return index < n_threads() ? infos_[index] : caller_info();
}

// Sets up the shared state of a run. Caller holds run_mutex.
void WorkerPool::begin_run(int n_phases, const Job& job, const std::function<bool()>& keep_going, int poll_ms) {
    State& state = *state_;
    // Inside a step the other threads are about to arrive (phases are balanced), so a
    // barrier spins longer than an idle worker waiting for the next call does.
    const int64_t barrier_spin_ns = (oversubscribed_ || spin_ns_ == 0) ? 0 : std::max<int64_t>(spin_ns_, 250000);
    state.barrier.reset(participants(), barrier_spin_ns);
    state.job = &job;
    state.n_phases = n_phases;
    state.job_error = nullptr;
    state.keep_going = keep_going ? &keep_going : nullptr;
    state.poll_ns = static_cast<int64_t>(poll_ms) * 1000000;
    state.next_poll_ns = now_ns() + state.poll_ns;
    state.interrupted = false;
    state.abort.store(false);
}

// Clears the run and rethrows its first error; returns whether it completed.
bool WorkerPool::end_run() {
    State& state = *state_;
    state.job = nullptr;
    state.keep_going = nullptr;
    if (state.job_error) {
        std::exception_ptr error = state.job_error;
        state.job_error = nullptr;
        std::rethrow_exception(error);
    }
    return !state.interrupted;
}

namespace {
// The CPU an OpenMP team thread was last pinned to by a pool (-1: never).
thread_local int t_pinned_cpu = -1;
}  // namespace

struct WorkerPool::OpenMpRun {
    WorkerPool* pool;
    const OpenMpRuntime* omp;
    int caller_slot;  // the participant the calling thread (team thread 0) plays
    std::atomic<bool> team_too_small{false};
};

void WorkerPool::openmp_participant(void* raw) {
    OpenMpRun& run = *static_cast<OpenMpRun*>(raw);
    WorkerPool& pool = *run.pool;
    if (run.omp->num_threads() != pool.participants()) {
        // Every thread sees the same team size, so all return before any barrier.
        run.team_too_small.store(true);
        return;
    }
    const int t = run.omp->thread_num();
    const int slot = t == 0 ? run.caller_slot : (t - 1 < run.caller_slot ? t - 1 : t);
    const ThreadInfo info = pool.participant(slot);
    std::optional<ScopedPin> caller_pin;
    if (t == 0) {
        // The calling thread plays the participant of the CPU it is on (chosen before the
        // run), pinned there for the run only (it is the application's thread) where it
        // matters: on several nodes its reads must stay on its node. On one node, already
        // on its CPU, the scheduler keeps it there among busy participants, and the three
        // affinity calls are a tenth of a small step.
        const bool on_its_cpu = sched_getcpu() == info.cpu;
        if (pool.pin_ && info.cpu >= 0 && (pool.n_nodes() > 1 || !on_its_cpu)) caller_pin.emplace(info.cpu);
        t_calling_pool = &pool;
    } else if (pool.pin_ && info.cpu >= 0 && t_pinned_cpu != info.cpu) {
        // Team threads stay pinned between runs: the next run (ours or torch's) finds
        // them where they were, at no syscall.
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(info.cpu, &set);
        if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0) t_pinned_cpu = info.cpu;
    } else if (!pool.pin_ && t_pinned_cpu != -1 && CPU_COUNT(&pool.process_cpus_) > 0) {
        if (pthread_setaffinity_np(pthread_self(), sizeof(pool.process_cpus_), &pool.process_cpus_) == 0)
            t_pinned_cpu = -1;
    }
    pool.run_phases(info);
    t_calling_pool = nullptr;
}

bool WorkerPool::run_on_openmp(const OpenMpRuntime& omp, bool* completed) {
    State& state = *state_;
    OpenMpRun run{this, &omp, 0, {}};
    if (caller_cpu_ >= 0) {
        run.caller_slot = n_threads();  // the joining caller
    } else {
        const int cpu = sched_getcpu();
        for (int i = 0; i < n_threads(); ++i)
            if (infos_[i].cpu == cpu) run.caller_slot = i;
    }
    omp.parallel(&WorkerPool::openmp_participant, &run, static_cast<unsigned>(participants()), 0);
    if (run.team_too_small.load()) return false;
    (void)state;
    *completed = end_run();
    return true;
}

bool WorkerPool::run(int n_phases, const Job& job, const std::function<bool()>& keep_going, int poll_ms) {
    if (t_job_pool) throw std::logic_error("WorkerPool::run called from inside a pool job (it would deadlock)");
    if (n_phases <= 0) return true;
    ensure_fresh_after_fork();
    if (const OpenMpRuntime* omp = loaded_openmp(); omp && !oversubscribed_ && !omp->in_parallel()) {
        std::lock_guard<std::mutex> lock(state_->run_mutex);
        begin_run(n_phases, job, keep_going, poll_ms);
        bool completed = false;
        if (run_on_openmp(*omp, &completed)) return completed;
    }
    if (!started()) start();
    State& state = *state_;
    std::lock_guard<std::mutex> lock(state.run_mutex);
    if (!state.running) throw std::runtime_error("WorkerPool: shut down while starting a run");
    begin_run(n_phases, job, keep_going, poll_ms);
    state.remaining.store(n_threads(), std::memory_order_release);
    const uint32_t done_seen = state.done_generation.load(std::memory_order_acquire);
    state.job_generation.fetch_add(1, std::memory_order_seq_cst);
    if (state.job_sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&state.job_generation);
    if (caller_cpu_ >= 0) {
        // Moving the caller costs two affinity syscalls (more in a VM), so only when it
        // sits on a worker's CPU.
        const int cpu = sched_getcpu();
        std::optional<ScopedPin> pin;
        if (cpu >= 0 && cpu < CPU_SETSIZE && CPU_ISSET(cpu, &worker_cpus_)) pin.emplace(caller_cpu_);
        t_calling_pool = this;
        run_phases(caller_info());
        t_calling_pool = nullptr;
        // The workers are about to finish too (jobs split work evenly): spin before sleeping.
        spin_until_changed(state.done_generation, done_seen, oversubscribed_ ? 0 : spin_ns_);
    }
    const timespec poll{poll_ms / 1000, static_cast<long>(poll_ms % 1000) * 1000000L};
    while (state.done_generation.load(std::memory_order_acquire) == done_seen) {
        futex_wait(&state.done_generation, done_seen, keep_going ? &poll : nullptr);
        if (keep_going && !state.interrupted && state.done_generation.load(std::memory_order_acquire) == done_seen &&
            !keep_going()) {
            state.interrupted = true;
            state.abort.store(true, std::memory_order_relaxed);
        }
    }
    return end_run();
}

}  // namespace numa_moe
