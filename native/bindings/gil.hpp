// The GIL around long native calls, Ctrl-C inside them, and interpreter exit.
//
// Exit: from the moment finalization begins, CPython 3.11 - 3.13 ends any other thread
// that asks for the GIL with pthread_exit (PyThread_exit_thread), a forced unwind of its
// C++ frames. A daemon thread inside a native call asks for the GIL when the call ends
// (the destructor of py::gil_scoped_release, which is noexcept: std::terminate, "terminate
// called without an active exception", SIGABRT) or when it polls Ctrl-C (inside a pool
// run: the unwind would cross the OpenMP runtime and leave the pool's mutex to static
// destructors). So the long calls release the GIL through NoGil, whose end, and
// check_signals, never ask for it once the interpreter is exiting: numa_moe's atexit
// hook (prepare_exit, registered when the module loads) marks the exit, waits until the
// other threads' calls have stopped at their next poll (they return "stop" from then
// on), and every such thread then parks forever without the GIL, as Python 3.14 does
// with a thread that asks for it too late. The thread that runs the exit is never
// parked.
#pragma once

#include <Python.h>

#include <atomic>
#include <thread>

namespace numa_moe::bindings {

// Releases the GIL for its lifetime (like py::gil_scoped_release); a thread other than
// the exiting one that constructs or destroys it after the exit began parks there
// instead. Usable as a pybind11 call_guard.
class NoGil {
public:
    NoGil();
    ~NoGil();
    NoGil(const NoGil&) = delete;
    NoGil& operator=(const NoGil&) = delete;

private:
    PyThreadState* state_;
};

// keep_going of long native calls: runs Python's signal handlers (on the thread whose
// call it is); false once one raised (KeyboardInterrupt, left set for the binding to
// raise with py::error_already_set), and false without touching the GIL once the
// interpreter is exiting. Call it without the GIL, at most every ~50 ms (Poll).
bool check_signals();

// keep_going for loops that can afford a clock read per iteration: check_signals at most
// every poll_ms on the thread that made it; requested() on any other thread (a pool
// participant) only reads the answer. After a stop the binding raises with
// raise_if_stopped() once it holds the GIL again.
class Poll {
public:
    explicit Poll(int poll_ms = 50);
    // Whether to stop; never takes the GIL on a thread other than the maker's.
    bool stop_requested();
    bool keep_going() { return !stop_requested(); }
    // With the GIL held: throws py::error_already_set (KeyboardInterrupt) after a stop.
    void raise_if_stopped() const;

private:
    std::thread::id owner_;
    long long poll_ns_;
    long long next_ns_;
    std::atomic<bool> stopped_{false};
};

// The atexit hook: see above. Called with the GIL held; waits at most wait_ms for the
// other threads' native calls to stop.
void prepare_exit(int wait_ms = 2000);

}  // namespace numa_moe::bindings
