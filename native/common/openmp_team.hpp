// The OpenMP runtime an application already loaded (PyTorch loads libgomp for its
// intra-op threads), reached through dlsym: numa-moe never links an OpenMP runtime of its
// own, which would be a second thread team competing for the same CPUs.
//
// Why: after each parallel torch op, its OpenMP threads keep spinning for a while; pinned
// workers of our own on the same CPUs would share them with those spinners and a layer
// step right after torch work (the router, attention) would take about twice as long.
// Running our jobs on torch's own team makes the two the same threads, so they cannot
// compete, whichever was imported first and whatever torch's thread count.
#pragma once

#include <string>

namespace numa_moe {

struct OpenMpRuntime {
    // GOMP_parallel: the entry `#pragma omp parallel` compiles to (GCC ABI, libgomp 4.9+).
    void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) = nullptr;
    int (*thread_num)() = nullptr;
    int (*num_threads)() = nullptr;
    int (*in_parallel)() = nullptr;
    int (*max_threads)() = nullptr;
    std::string path;  // of the loaded library
};

// The libgomp this process has loaded, or nullptr when there is none (yet), when
// NUMA_MOE_THREADS=own asks for numa-moe's own threads, or in a forked child (libgomp's
// team does not survive fork). Cheap enough to call per run: a found runtime is cached,
// and the loader is asked again only after it has loaded something.
const OpenMpRuntime* loaded_openmp();

// How many times the loader has been asked for libgomp so far (the test hooks' view of
// the rule above).
long long openmp_lookups();

// "openmp (<path>)" or "own threads (<why>)", for diagnostics.
std::string thread_backend();

}  // namespace numa_moe
