// The benchmark harness in native code, its own extension module numa_moe._native_bench
// (re-exported as numa_moe._bench), so that the API module carries none of it: loops that
// must not pay Python overhead per call (the kernel against the read ceiling,
// interleaved), the streaming read and the peak-FLOP loops, all on the project's process
// pool (this module's own copy of it).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "bench/loops.hpp"
#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "common/cpu_features.hpp"
#include "common/util.hpp"
#include "engine/expert_ffn.hpp"
#include "engine/pipeline.hpp"
#include "engine/process_pool.hpp"

namespace py = pybind11;

namespace numa_moe::bench {
namespace {

using bindings::Kind;
using bindings::NoGil;
using bindings::Poll;

// What a participant does between polls of Ctrl-C: a few ms of work, so that the loops
// stop within ~50 ms of it (Poll) at no measurable cost.
constexpr size_t kReadChunkBytes = size_t{4} << 20;
constexpr int64_t kPeakChunkIterations = int64_t{1} << 16;

struct Span {
    const char* data;
    size_t bytes;
};

// Baseline x86-64 (SSE2) read for CPUs without AVX2.
uint64_t stream_read_baseline(const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        uint64_t v[4];
        std::memcpy(v, p + i, sizeof(v));
        a0 ^= v[0];
        a1 ^= v[1];
        a2 ^= v[2];
        a3 ^= v[3];
    }
    uint64_t sum = a0 + a1 + a2 + a3;
    for (; i < bytes; ++i) sum += static_cast<unsigned char>(p[i]);
    return sum;
}

// The widest loads this CPU has: the read ceiling is what the kernels' own loads could reach.
using StreamRead = uint64_t (*)(const void*, size_t);
StreamRead stream_reader() {
    static const StreamRead reader = has_avx512_bf16_kernels() ? stream_read_avx512
                                     : has_avx2_kernels()      ? stream_read_avx2
                                                               : stream_read_baseline;
    return reader;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs job(phase, participant, participants) on `threads` threads of the process pool; a
// stop of `poll` aborts the phases not begun (long jobs poll it themselves).
void on_threads(int threads, int n_phases, Poll& poll, const std::function<void(int, int, int)>& job) {
    const std::shared_ptr<WorkerPool> pool = threads > 1 ? engine::process_pool(threads) : nullptr;
    engine::Team team(pool.get());
    const int participants = team.participants();
    team.run(n_phases, [&](int phase, const ThreadInfo& ti) { job(phase, ti.global, participants); },
             [&] { return poll.keep_going(); });
}

// Reads every span once, each thread a contiguous share (in 256-byte units) of each span;
// spans [0, phase_break) in one phase, the rest in a second, so that an expert's read
// pays the dispatch and barrier of an expert_ffn call. Returns the checksum (unspecified
// after a stop of `poll`).
uint64_t read_spans(const std::vector<Span>& spans, int threads, Poll& poll, size_t phase_break = SIZE_MAX) {
    std::vector<uint64_t> sums(static_cast<size_t>(std::max(1, threads)) * 8, 0);  // a cache line each
    const StreamRead read = stream_reader();
    const int n_phases = phase_break < spans.size() ? 2 : 1;
    on_threads(threads, n_phases, poll, [&](int phase, int id, int n_threads) {
        const size_t first = phase == 0 ? 0 : phase_break;
        const size_t last = phase == 0 ? std::min(phase_break, spans.size()) : spans.size();
        uint64_t sum = 0;
        for (size_t s = first; s < last; ++s) {
            const int64_t units = static_cast<int64_t>((spans[s].bytes + 255) / 256);
            const Range share = split_even(units, n_threads, 1)[id];
            const size_t begin = std::min(spans[s].bytes, static_cast<size_t>(share.begin) * 256);
            const size_t end = std::min(spans[s].bytes, static_cast<size_t>(share.end) * 256);
            for (size_t at = begin; at < end; at += kReadChunkBytes) {
                if (poll.stop_requested()) return;
                sum += read(spans[s].data + at, std::min(kReadChunkBytes, end - at));
            }
        }
        sums[static_cast<size_t>(id) * 8] += sum;
    });
    uint64_t total = 0;
    for (uint64_t v : sums) total += v;
    return total;
}

std::vector<Span> array_spans(const py::list& buffers, const char* what) {
    std::vector<Span> spans;
    for (const auto& item : buffers) {
        NUMA_MOE_CHECK(py::isinstance<py::array>(item), what, ": buffers must be numpy arrays");
        const py::array a = py::reinterpret_borrow<py::array>(item);
        NUMA_MOE_CHECK(a.flags() & py::array::c_style, what, ": buffers must be C-contiguous arrays");
        spans.push_back(Span{static_cast<const char*>(a.data()), static_cast<size_t>(a.nbytes())});
    }
    NUMA_MOE_CHECK(!spans.empty(), what, ": no buffers");
    return spans;
}

int thread_count(int threads) { return threads > 0 ? threads : engine::affinity_cpu_count(); }

uint64_t py_stream_read(const py::list& buffers, int threads) {
    const auto spans = array_spans(buffers, "stream_read");
    Poll poll;
    uint64_t sum;
    {
        NoGil released;
        sum = read_spans(spans, thread_count(threads), poll);
    }
    poll.raise_if_stopped();
    return sum;
}

double py_bench_stream_read(const py::list& buffers, int threads, int repeats) {
    const auto spans = array_spans(buffers, "bench_stream_read");
    Poll poll;
    double seconds;
    {
        NoGil released;
        std::vector<Span> order;
        for (int r = 0; r < repeats; ++r) order.push_back(spans[r % spans.size()]);
        const auto start = std::chrono::steady_clock::now();
        volatile uint64_t sink = read_spans(order, thread_count(threads), poll);
        (void)sink;
        seconds = seconds_since(start);
    }
    poll.raise_if_stopped();
    return seconds;
}

// The experts of a benchmark, checked once: (w_gate, w_up, w_down) bf16 tuples, or
// (w_gate, w_up, w_down, gate_scales, up_scales, down_scales) of integer weights of `format`
// ("": the one the dtypes tell).
struct BenchCalls {
    kernels::Format format = kernels::Format::bf16;
    int64_t group = kernels::kDefaultGroup;  // integer formats
    std::vector<engine::ExpertFfnArgs> calls;
    std::vector<std::vector<Span>> spans;  // per expert: gate, up, down (and their scales)
    std::vector<float> out;
    std::vector<py::array> keep;  // the arrays behind the pointers
};

BenchCalls bench_calls(const py::array& x, const py::array& token_index, const py::list& experts, int threads,
                       bool out_bf16, const std::string& format) {
    NUMA_MOE_CHECK(!experts.empty(), "experts: empty");
    BenchCalls result;
    for (size_t e = 0; e < experts.size(); ++e) {
        const py::tuple tuple = experts[e].cast<py::tuple>();
        NUMA_MOE_CHECK(tuple.size() == 3 || tuple.size() == 6,
                       "experts: expected (w_gate, w_up, w_down) tuples, or with their three scales");
        std::vector<py::array> arrays;
        for (const auto& item : tuple) arrays.push_back(item.cast<py::array>());
        const auto scales = [&](size_t i) { return arrays.size() == 6 ? py::object(arrays[3 + i]) : py::object(py::none()); };
        engine::ExpertFfnArgs args;
        try {
            args = bindings::expert_ffn_args(x, token_index,
                                             bindings::weight_operand(arrays[0], scales(0), "w_gate", format),
                                             bindings::weight_operand(arrays[1], scales(1), "w_up", format),
                                             bindings::weight_operand(arrays[2], scales(2), "w_down", format), threads);
        } catch (const std::invalid_argument& error) {
            fail("experts[", e, "]: shapes do not match x [T, H] and each other (", error.what(), ")");
        }
        NUMA_MOE_CHECK(e == 0 || (args.format == result.format && args.gate.group == result.group),
                       "experts: all in one weight format and group");
        result.format = args.format;
        result.group = args.gate.group;
        args.out_bf16 = out_bf16;
        result.calls.push_back(args);
        std::vector<Span> spans;
        for (const py::array& a : arrays) spans.push_back(Span{static_cast<const char*>(a.data()), static_cast<size_t>(a.nbytes())});
        result.spans.push_back(spans);
        result.keep.insert(result.keep.end(), arrays.begin(), arrays.end());
    }
    result.out.resize(static_cast<size_t>(token_index.shape(0) * x.shape(1)) + 16);
    for (auto& c : result.calls) c.out = result.out.data();
    return result;
}

std::vector<double> py_bench_expert_ffn(const std::string& isa, const py::array& x, const py::array& token_index,
                                        const py::list& experts, int threads, int repeats, bool out_bf16,
                                        const std::string& format) {
    BenchCalls bench = bench_calls(x, token_index, experts, threads, out_bf16, format);
    const kernels::KernelOps& ops = bindings::ops_for(isa, bench.format, bench.group);
    std::vector<double> seconds;
    Poll poll;
    const std::function<bool()> keep_going = [&] { return poll.keep_going(); };
    {
        NoGil released;
        for (int r = 0; r < repeats && keep_going(); ++r) {
            const auto start = std::chrono::steady_clock::now();
            engine::expert_ffn(ops, bench.calls[r % bench.calls.size()], keep_going);
            seconds.push_back(seconds_since(start));
        }
    }
    poll.raise_if_stopped();
    return seconds;
}

// The kernel and the read ceiling measured interleaved, so that both see the same state
// of a machine whose bandwidth drifts: repetition r runs expert_ffn on expert 2r and then
// stream-reads expert 2r+1 (mod the count; gate and up in one phase, down in a second, on
// the same pool: the same dispatch and barrier cost as the kernel).
std::pair<std::vector<double>, std::vector<double>> py_bench_expert_ffn_vs_read(
    const std::string& isa, const py::array& x, const py::array& token_index, const py::list& experts, int threads,
    int repeats, bool out_bf16, const std::string& format) {
    BenchCalls bench = bench_calls(x, token_index, experts, threads, out_bf16, format);
    const kernels::KernelOps& ops = bindings::ops_for(isa, bench.format, bench.group);
    std::vector<double> ours, read;
    Poll poll;
    const std::function<bool()> keep_going = [&] { return poll.keep_going(); };
    {
        NoGil released;
        const size_t n = bench.calls.size();
        volatile uint64_t sink = 0;
        for (int r = 0; r < repeats && keep_going(); ++r) {
            auto start = std::chrono::steady_clock::now();
            engine::expert_ffn(ops, bench.calls[(2 * static_cast<size_t>(r)) % n], keep_going);
            ours.push_back(seconds_since(start));
            start = std::chrono::steady_clock::now();
            sink = sink + read_spans(bench.spans[(2 * static_cast<size_t>(r) + 1) % n], thread_count(threads), poll, 2);
            read.push_back(seconds_since(start));
        }
    }
    poll.raise_if_stopped();
    return {ours, read};
}

// The register-only peak loop of an ISA and weight format (the instruction its kernels
// multiply with) on `threads` threads; returns the operations executed.
double py_peak_flops(const std::string& isa, int64_t iterations, int threads, const std::string& format) {
    kernels::Format parsed;
    NUMA_MOE_CHECK(kernels::parse_format(format.c_str(), &parsed), "peak_flops: format '", format,
                   "' is not one of bf16, int8, int4, mxfp4");
    const kernels::KernelOps& ops = bindings::ops_for(isa, parsed);  // refuses what this CPU cannot run
    const bool integer = parsed != kernels::Format::bf16;
    double (*loop)(int64_t) = nullptr;
    if (ops.isa == kernels::Isa::avx2) loop = integer ? vpmaddubsw_loop : vfmadd231ps_loop;
    if (ops.isa == kernels::Isa::avx512) loop = integer ? vpdpbusd_loop : vdpbf16ps_loop;
    if (ops.isa == kernels::Isa::amx) loop = integer ? tdpbssd_loop : tdpbf16ps_loop;
    NUMA_MOE_CHECK(loop, "peak_flops: no peak loop for isa '", isa,
                   "' (avx2: vfmadd231ps / vpmaddubsw, avx512: vdpbf16ps / vpdpbusd, amx: tdpbf16ps / tdpbssd)");
    const int n = thread_count(threads);
    std::vector<double> flops(static_cast<size_t>(n) * 8, 0.0);
    Poll poll;
    {
        NoGil released;
        on_threads(n, 1, poll, [&](int, int id, int) {
            for (int64_t done = 0; done < iterations && !poll.stop_requested(); done += kPeakChunkIterations)
                flops[static_cast<size_t>(id) * 8] += loop(std::min(kPeakChunkIterations, iterations - done));
        });
    }
    poll.raise_if_stopped();
    double total = 0;
    for (double f : flops) total += f;
    return total;
}

}  // namespace

}  // namespace numa_moe::bench

PYBIND11_MODULE(_native_bench, m) {
    using namespace numa_moe::bench;
    m.doc() = "numa-moe benchmark harness: streaming read, peak loops, kernel-vs-read loops";
    m.def("stream_read", &py_stream_read, py::arg("buffers"), py::arg("threads") = 1,
          "Reads the buffers with the CPU's widest loads (AVX-512, AVX2 or baseline) on `threads` threads (bandwidth "
          "ceiling); returns a checksum.");
    m.def("bench_stream_read", &py_bench_stream_read, py::arg("buffers"), py::arg("threads"), py::arg("repeats"),
          "Seconds to stream-read `repeats` buffers (rotating) with `threads` threads.");
    m.def("bench_expert_ffn", &py_bench_expert_ffn, py::arg("isa"), py::arg("x"), py::arg("token_index"),
          py::arg("experts"), py::arg("threads"), py::arg("repeats"), py::arg("out_bf16") = true, py::arg("format") = "",
          "Seconds of each of `repeats` expert_ffn calls rotating over `experts` (format: the weights' format, "
          "default the one their dtypes tell; iq4nl and int4-affine must be named).");
    m.def("bench_expert_ffn_vs_read", &py_bench_expert_ffn_vs_read, py::arg("isa"), py::arg("x"),
          py::arg("token_index"), py::arg("experts"), py::arg("threads"), py::arg("repeats"), py::arg("out_bf16") = true,
          py::arg("format") = "",
          "(kernel seconds, read seconds) per repetition; repetition r runs expert_ffn on expert 2r and "
          "stream-reads expert 2r+1 (rotating), interleaved so both see the same machine state (format: as "
          "bench_expert_ffn's).");
    m.def("peak_flops", &py_peak_flops, py::arg("isa"), py::arg("iterations"), py::arg("threads") = 1,
          py::arg("format") = "bf16",
          "Register-only peak loop of the ISA and weight format (avx2: vfmadd231ps / vpmaddubsw, avx512: vdpbf16ps / "
          "vpdpbusd, amx: tdpbf16ps / tdpbssd) on `threads` threads; returns the operations executed (time it).");
    // Daemon threads inside native calls at interpreter exit (bindings/gil.hpp): this
    // module's copy of the exit state needs the hook as much as _native's.
    py::module_::import("atexit").attr("register")(py::cpp_function([] { numa_moe::bindings::prepare_exit(); }));
}
