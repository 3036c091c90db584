// See gil.hpp.
#include "bindings/gil.hpp"

#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>

#include <pthread.h>
#include <unistd.h>

#include "common/util.hpp"

namespace numa_moe::bindings {
namespace {

// g_inside: threads between NoGil's start and its GIL re-acquired (or parked); the exit
// waits for it to reach 0. Guarded by g_mutex.
std::mutex g_mutex;
std::condition_variable g_changed;
bool g_exiting = false;
std::thread::id g_exit_thread;
int g_inside = 0;

// Under g_mutex: whether the calling thread must not ask for the GIL any more.
bool barred_locked() { return g_exiting && std::this_thread::get_id() != g_exit_thread; }

// A forked child has only the forking thread, which held the GIL (os.fork does): no
// other thread is inside, and one that held the mutex at fork() no longer exists.
void reset_in_child() {
    new (&g_mutex) std::mutex();
    g_inside = 0;
}
[[maybe_unused]] const int g_atfork_registered = pthread_atfork(nullptr, nullptr, reset_in_child);

[[noreturn]] void park_forever() {
    for (;;) pause();
}

void leave_locked() {
    if (--g_inside == 0 && g_exiting) g_changed.notify_all();
}

}  // namespace

NoGil::NoGil() {
    bool barred;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        barred = barred_locked();
        if (!barred) ++g_inside;
    }
    state_ = PyEval_SaveThread();
    if (barred) park_forever();
}

NoGil::~NoGil() {
    {
        std::unique_lock<std::mutex> lock(g_mutex);
        if (barred_locked()) {
            leave_locked();
            lock.unlock();
            park_forever();
        }
    }
    // Still counted while it waits for the GIL: the exit releases the GIL while it waits
    // for g_inside, so this thread gets it and returns to Python before finalization.
    PyEval_RestoreThread(state_);
    std::lock_guard<std::mutex> lock(g_mutex);
    leave_locked();
}

bool check_signals() {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (barred_locked()) return false;
        ++g_inside;
    }
    bool keep_going;
    {
        pybind11::gil_scoped_acquire gil;
        keep_going = PyErr_CheckSignals() == 0;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    leave_locked();
    return keep_going;
}

Poll::Poll(int poll_ms)
    : owner_(std::this_thread::get_id()),
      poll_ns_(static_cast<long long>(poll_ms) * 1000000),
      next_ns_(now_ns() + poll_ns_) {}

bool Poll::stop_requested() {
    if (stopped_.load(std::memory_order_relaxed)) return true;
    if (std::this_thread::get_id() != owner_) return false;
    const long long now = now_ns();
    if (now < next_ns_) return false;
    next_ns_ = now + poll_ns_;
    if (check_signals()) return false;
    stopped_.store(true, std::memory_order_relaxed);
    return true;
}

void Poll::raise_if_stopped() const {
    if (stopped_.load(std::memory_order_relaxed)) throw pybind11::error_already_set();
}

void prepare_exit(int wait_ms) {
    std::unique_lock<std::mutex> lock(g_mutex);
    g_exiting = true;
    g_exit_thread = std::this_thread::get_id();
    if (g_inside == 0) return;
    PyThreadState* state = PyEval_SaveThread();
    g_changed.wait_for(lock, std::chrono::milliseconds(wait_ms), [] { return g_inside == 0; });
    lock.unlock();
    PyEval_RestoreThread(state);
}

}  // namespace numa_moe::bindings
