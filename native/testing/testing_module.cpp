// numa_moe._native.testing: hooks for the test suite only, built when NUMA_MOE_TEST_HOOKS=ON
// (tools/setup.sh, tools/dev-build.sh and the sanitizer build turn it on). They drive the
// production WorkerPool and the AMX software model from Python.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "common/cpu_features.hpp"
#include "common/openmp_team.hpp"
#include "common/worker_pool.hpp"
#include "kernels/amx_model.hpp"
#include "kernels/isa_tables.hpp"

namespace py = pybind11;

namespace numa_moe::testing {
namespace {

// Each round every participant adds one in a phase and checks in the next that all did.
py::tuple barrier_check(WorkerPool& pool, int rounds) {
    std::atomic<int64_t> counter{0}, failures{0};
    const int64_t n = pool.participants();
    {
        bindings::NoGil no_gil;
        pool.run(2 * rounds, [&](int phase, const ThreadInfo&) {
            if (phase % 2 == 0) counter.fetch_add(1);
            else if (counter.load() < n * (phase / 2 + 1)) failures.fetch_add(1);
        });
    }
    return py::make_tuple(counter.load(), failures.load());
}

// The CPU every participant of one run is on (caller last when it joins), and the
// calling thread's affinity during its share.
py::tuple participant_cpus(WorkerPool& pool) {
    std::vector<int> cpus(pool.participants(), -2);
    std::vector<int> caller_affinity;
    {
        bindings::NoGil no_gil;
        pool.run(1, [&](int, const ThreadInfo& ti) {
            cpus[ti.global] = sched_getcpu();
            if (ti.global != pool.n_threads()) return;
            cpu_set_t set;
            CPU_ZERO(&set);
            if (sched_getaffinity(0, sizeof(set), &set) == 0)
                for (int c = 0; c < CPU_SETSIZE; ++c)
                    if (CPU_ISSET(c, &set)) caller_affinity.push_back(c);
        });
    }
    return py::make_tuple(cpus, caller_affinity);
}

// Every participant works in 1 ms slices for `seconds` (two phases), stopping early when
// the run is aborted; Ctrl-C on the caller raises KeyboardInterrupt.
bool busy_job(WorkerPool& pool, double seconds) {
    bool completed;
    {
        bindings::NoGil no_gil;
        completed = pool.run(2, [&](int, const ThreadInfo&) {
            const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds / 2);
            while (std::chrono::steady_clock::now() < end && !pool.aborted())
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }, bindings::check_signals);
    }
    if (!completed) throw py::error_already_set();
    return completed;
}

// A job of n_phases phases in which participant `thrower` throws in phase `phase`.
void throwing_job(WorkerPool& pool, int n_phases, int phase, int thrower) {
    bindings::NoGil no_gil;
    pool.run(n_phases, [&](int p, const ThreadInfo& ti) {
        if (p == phase && ti.global == thrower)
            throw std::runtime_error("test job: participant " + std::to_string(thrower) + " failed in phase " +
                                     std::to_string(phase));
    });
}

int64_t gettid_now() { return static_cast<int64_t>(syscall(SYS_gettid)); }

// The kernel thread ids of the participants of one run of `pool`, by participant index,
// and the CPU affinity each had (a list of CPUs).
py::tuple participant_threads(WorkerPool& pool) {
    std::vector<int64_t> tids(pool.participants(), -1);
    std::vector<std::vector<int>> affinity(pool.participants());
    {
        bindings::NoGil no_gil;
        pool.run(1, [&](int, const ThreadInfo& ti) {
            tids[ti.global] = gettid_now();
            cpu_set_t set;
            CPU_ZERO(&set);
            if (sched_getaffinity(0, sizeof(set), &set) == 0)
                for (int c = 0; c < CPU_SETSIZE; ++c)
                    if (CPU_ISSET(c, &set)) affinity[ti.global].push_back(c);
        });
    }
    return py::make_tuple(tids, affinity);
}

// The kernel thread ids of a team of n threads of the loaded OpenMP runtime (empty when
// there is none), by OpenMP thread number.
std::vector<int64_t> openmp_team_threads(int n) {
    const OpenMpRuntime* omp = loaded_openmp();
    if (!omp) return {};
    struct Team {
        const OpenMpRuntime* omp;
        std::vector<int64_t> tids;
    } team{omp, std::vector<int64_t>(n, -1)};
    bindings::NoGil no_gil;
    omp->parallel([](void* raw) {
        Team& t = *static_cast<Team*>(raw);
        const int i = t.omp->thread_num();
        if (i < static_cast<int>(t.tids.size())) t.tids[i] = gettid_now();
    }, &team, static_cast<unsigned>(n), 0);
    return team.tids;
}

void amx_model_tile_dot(const py::array& config, bool int8, py::array& c, const py::array& a, const py::array& b) {
    NUMA_MOE_CHECK(config.nbytes() == 64 && (config.flags() & py::array::c_style), "config: expected 64 contiguous bytes");
    for (const py::array* t : std::initializer_list<const py::array*>{&c, &a, &b})
        NUMA_MOE_CHECK(t->nbytes() == 16 * 64 && (t->flags() & py::array::c_style),
                       "tiles: expected 1024 contiguous bytes each");
    NUMA_MOE_CHECK(c.writeable(), "c: must be writable");
    amx_model::tile_dot(config.data(), int8, c.mutable_data(), a.data(), b.data());
}

// The kernel table of an ISA and integer format (its default group), nullptr where none.
const kernels::KernelOps* integer_table_of(const std::string& isa_name, const std::string& format_name) {
    kernels::Isa isa;
    NUMA_MOE_CHECK(kernels::parse_isa(isa_name.c_str(), &isa), "unknown ISA '", isa_name, "'");
    kernels::Format format;
    NUMA_MOE_CHECK(kernels::parse_format(format_name.c_str(), &format) && format != kernels::Format::bf16, "'",
                   format_name, "' is not an integer format");
    return kernels::kernel_ops(isa, format, kernels::default_group(format));
}

// Which build of the AVX2 integer kernels an ISA's table of a format is: "avx_vnni"
// (vpdpbusd, avx2_vnni_quant.cpp), "maddubs" (vpmaddubsw, avx2_quant.cpp), "" for other
// ISAs or none here. Comparing table addresses runs no instruction of either build.
std::string avx2_integer_build(const std::string& isa_name, const std::string& format_name) {
    const kernels::KernelOps* ops = integer_table_of(isa_name, format_name);
    if (!ops) return "";
    const kernels::Format format = ops->format;
    const int64_t group = ops->group;
    if (ops == kernels::avx2_vnni_integer_ops(format, group) || ops == kernels::avx2_vnni_emulated_integer_ops(format, group))
        return "avx_vnni";
    if (ops == kernels::avx2_integer_ops(format, group) || ops == kernels::avx2_emulated_integer_ops(format, group))
        return "maddubs";
    return "";
}

// Which lookup an ISA's table of a codebook format (mxfp4, iq4nl) is from the AVX-512
// builds: "vpermb" (VBMI, avx512_vbmi_quant.cpp), "vpshufb" (avx512_quant.cpp), "" for
// other ISAs or none here.
std::string avx512_codebook_build(const std::string& isa_name, const std::string& format_name) {
    const kernels::KernelOps* ops = integer_table_of(isa_name, format_name);
    NUMA_MOE_CHECK(!ops || kernels::is_codebook_format(ops->format), "'", format_name,
                   "' is not a codebook format (mxfp4, iq4nl)");
    if (!ops) return "";
    const kernels::Format format = ops->format;
    const int64_t group = ops->group;
    if (ops == kernels::avx512_vbmi_integer_ops(format, group) || ops == kernels::avx512_vbmi_emulated_integer_ops(format, group))
        return "vpermb";
    if (ops == kernels::avx512_integer_ops(format, group) || ops == kernels::avx512_emulated_integer_ops(format, group))
        return "vpshufb";
    return "";
}

}  // namespace

void register_testing(py::module_& parent) {
    py::module_ m = parent.def_submodule("testing");
    m.doc() = "numa-moe test hooks (test builds only)";
    m.def("barrier_check", &barrier_check, py::arg("pool"), py::arg("rounds"),
          "Self-test of the phase barrier: returns (increments, failures).");
    m.def("participant_cpus", &participant_cpus, py::arg("pool"));
    m.def("busy_job", &busy_job, py::arg("pool"), py::arg("seconds"));
    m.def("throwing_job", &throwing_job, py::arg("pool"), py::arg("n_phases"), py::arg("phase"), py::arg("thrower"));
    m.def("participant_threads", &participant_threads, py::arg("pool"),
          "(thread ids, CPU affinities) of the participants of one run, by participant index.");
    m.def("openmp_team_threads", &openmp_team_threads, py::arg("n"),
          "Thread ids of a team of n threads of the loaded OpenMP runtime (empty: none loaded).");
    m.def("openmp_lookups", &openmp_lookups,
          "How many times the dynamic loader has been asked for libgomp (it is asked again only after it loaded "
          "something).");
    m.def("amx_model_tile_dot", &amx_model_tile_dot, py::arg("config"), py::arg("int8"), py::arg("c"), py::arg("a"),
          py::arg("b"), "One TDPBF16PS/TDPBSSD of the AMX software model on tmm0 += tmm1 . tmm2.");
    m.def("avx2_integer_build", &avx2_integer_build, py::arg("isa"), py::arg("format") = "int8",
          "Which build of the AVX2 integer kernels the ISA's table of a format is: 'avx_vnni', 'maddubs', or '' "
          "(another ISA, or none here).");
    m.def("avx512_codebook_build", &avx512_codebook_build, py::arg("isa"), py::arg("format") = "mxfp4",
          "Which build of the AVX-512 kernels of a codebook format (mxfp4, iq4nl) the ISA's table is: 'vpermb' "
          "(VBMI), 'vpshufb', or '' (another ISA, or none here).");
    m.def("amx_model_counts", [](bool reset) {
        const amx_model::InstructionCounts c = amx_model::instruction_counts();
        if (reset) amx_model::reset_instruction_counts();
        return py::dict(py::arg("loadconfig") = c.loadconfig, py::arg("loads") = c.loads,
                        py::arg("stream_loads") = c.stream_loads, py::arg("stores") = c.stores,
                        py::arg("zeros") = c.zeros, py::arg("dpbf16ps") = c.dpbf16ps, py::arg("dpbssd") = c.dpbssd);
    }, py::arg("reset") = false,
          "Tile instructions the AMX model executed on this thread since the last reset (reset=True: read, then "
          "zero them).");
}

}  // namespace numa_moe::testing
