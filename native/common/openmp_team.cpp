#include "common/openmp_team.hpp"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace numa_moe {
namespace {

bool own_threads_requested() {
    const char* choice = std::getenv("NUMA_MOE_THREADS");
    return choice && std::strcmp(choice, "own") == 0;
}

std::atomic<bool> g_forked{false};
std::atomic<long long> g_lookups{0};

std::string library_path(void* symbol) {
    Dl_info info;
    return dladdr(symbol, &info) && info.dli_fname ? info.dli_fname : "libgomp.so.1";
}

// How many objects the dynamic loader has loaded so far (dlpi_adds: it only grows).
unsigned long long objects_loaded() {
    unsigned long long adds = 0;
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) {
            *static_cast<unsigned long long*>(out) = info->dlpi_adds;
            return 1;  // the count is the same in every entry: one is enough
        },
        &adds);
    return adds;
}

// Looks the runtime up once it is loaded; until then every call looks again (a dlopen
// with RTLD_NOLOAD finds only what is already there, and loads nothing), but only when
// something was loaded since the last look: a failing dlopen searches the file system
// (ld.so.cache, the library's path), and its munmap interrupts the other CPUs: a program
// without torch would pay that on every call.
const OpenMpRuntime* find_runtime() {
    static std::mutex mutex;
    static OpenMpRuntime runtime;
    static std::atomic<bool> found{false};
    static unsigned long long objects_at_last_look = 0;
    if (found.load(std::memory_order_acquire)) return &runtime;
    std::lock_guard<std::mutex> lock(mutex);
    if (found.load()) return &runtime;
    const unsigned long long objects = objects_loaded();
    if (objects == objects_at_last_look) return nullptr;
    objects_at_last_look = objects;
    g_lookups.fetch_add(1, std::memory_order_relaxed);
    void* handle = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!handle) return nullptr;
    OpenMpRuntime r;
    r.parallel = reinterpret_cast<decltype(r.parallel)>(dlsym(handle, "GOMP_parallel"));
    r.thread_num = reinterpret_cast<decltype(r.thread_num)>(dlsym(handle, "omp_get_thread_num"));
    r.num_threads = reinterpret_cast<decltype(r.num_threads)>(dlsym(handle, "omp_get_num_threads"));
    r.in_parallel = reinterpret_cast<decltype(r.in_parallel)>(dlsym(handle, "omp_in_parallel"));
    r.max_threads = reinterpret_cast<decltype(r.max_threads)>(dlsym(handle, "omp_get_max_threads"));
    // The handle is kept: the runtime stays loaded as long as its loader does.
    if (!r.parallel || !r.thread_num || !r.num_threads || !r.in_parallel || !r.max_threads) return nullptr;
    r.path = library_path(reinterpret_cast<void*>(r.parallel));
    runtime = r;
    found.store(true, std::memory_order_release);
    return &runtime;
}

void on_fork_child() { g_forked.store(true); }

}  // namespace

const OpenMpRuntime* loaded_openmp() {
    static const int registered = pthread_atfork(nullptr, nullptr, on_fork_child);
    (void)registered;
    if (g_forked.load(std::memory_order_relaxed) || own_threads_requested()) return nullptr;
    return find_runtime();
}

long long openmp_lookups() { return g_lookups.load(); }

std::string thread_backend() {
    if (const OpenMpRuntime* omp = loaded_openmp()) return "openmp (" + omp->path + ")";
    if (own_threads_requested()) return "own threads (NUMA_MOE_THREADS=own)";
    if (g_forked.load()) return "own threads (forked child: the OpenMP team does not survive fork)";
    return "own threads (no OpenMP runtime loaded)";
}

}  // namespace numa_moe
