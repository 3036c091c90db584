// Python bindings of the kernels (numa_moe._native): every array argument is checked
// here (dtype, shape, C-contiguity, alignment, index ranges) and a violation raises
// ValueError naming the argument; nothing is copied. Compute runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/cpu_features.hpp"
#include "kernels/bf16.hpp"
#include "kernels/expert_ffn.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/kernel_api.hpp"
#include "kernels/kernel_pool.hpp"

namespace py = pybind11;

namespace numa_moe {
namespace {

using kernels::bf16;
using kernels::Isa;
using kernels::KernelOps;

[[noreturn]] void fail(const std::string& message) { throw py::value_error(message); }

std::string shape_str(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    return s + (a.ndim() == 1 ? ",)" : ")");
}

enum class Kind { bf16, f32, i64 };

const char* kind_name(Kind kind) {
    switch (kind) {
        case Kind::bf16: return "bfloat16 (or its uint16 bit pattern)";
        case Kind::f32: return "float32";
        case Kind::i64: return "int64";
    }
    return "?";
}

bool has_kind(const py::array& a, Kind kind) {
    const py::dtype dt = a.dtype();
    switch (kind) {
        case Kind::bf16:
            return dt.itemsize() == 2 && (dt.kind() == 'u' || py::str(dt).cast<std::string>() == "bfloat16");
        case Kind::f32: return dt.kind() == 'f' && dt.itemsize() == 4;
        case Kind::i64: return dt.kind() == 'i' && dt.itemsize() == 8;
    }
    return false;
}

// Checks dtype, dimensionality, C-contiguity and element alignment of an argument.
void check_array(const py::array& a, const char* name, Kind kind, int ndim, bool writable = false) {
    if (!has_kind(a, kind))
        fail(std::string(name) + ": dtype " + py::str(a.dtype()).cast<std::string>() + ", expected " + kind_name(kind));
    if (a.ndim() != ndim)
        fail(std::string(name) + ": expected " + std::to_string(ndim) + "-D array, got shape " + shape_str(a));
    if (!(a.flags() & py::array::c_style))
        fail(std::string(name) + ": must be C-contiguous (row-major), got strides that are not");
    const auto address = reinterpret_cast<uintptr_t>(a.data());
    if (address % a.itemsize())
        fail(std::string(name) + ": data at 0x" + std::to_string(address) + " is not aligned to its " +
             std::to_string(a.itemsize()) + "-byte elements");
    if (writable && !a.writeable()) fail(std::string(name) + ": must be writable");
}

const KernelOps& ops_for(const std::string& isa_name) {
    Isa isa;
    if (!kernels::parse_isa(isa_name.c_str(), &isa))
        fail("isa '" + isa_name + "' is not one of ref, avx2, avx512, amx_model, amx");
    const KernelOps* ops = kernels::kernel_ops(isa);
    if (!ops) {
        std::string reason;
        if (isa == Isa::amx && !request_amx_permission(&reason)) fail("isa 'amx' is not available: " + reason);
        fail("isa '" + isa_name + "' is not available on this CPU");
    }
    return *ops;
}

std::vector<Segment> read_segments(const py::object& obj, const char* name, int64_t rows, int64_t cols) {
    std::vector<Segment> segments;
    if (obj.is_none()) return segments;
    const py::array a = py::array::ensure(obj);
    if (!a) fail(std::string(name) + ": expected an int64 array of shape [n, 5]");
    check_array(a, name, Kind::i64, 2);
    if (a.shape(1) != 5) fail(std::string(name) + ": expected shape [n, 5], got " + shape_str(a));
    const auto* fields = static_cast<const int64_t*>(a.data());
    for (py::ssize_t i = 0; i < a.shape(0); ++i) {
        const Segment s{fields[5 * i], fields[5 * i + 1], fields[5 * i + 2], fields[5 * i + 3], fields[5 * i + 4]};
        const std::string where = std::string(name) + "[" + std::to_string(i) + "] = (row0=" + std::to_string(s.row0) +
                                  ", row_stride=" + std::to_string(s.row_stride) + ", nrows=" + std::to_string(s.nrows) +
                                  ", k0=" + std::to_string(s.k0) + ", k1=" + std::to_string(s.k1) + ")";
        if (s.nrows < 0) fail(where + ": negative nrows");
        if (s.nrows > 1 && s.row_stride < 1) fail(where + ": row_stride must be >= 1");
        // last row = row0 + (nrows - 1) * stride < rows, written so that it cannot overflow
        const int64_t stride = std::max<int64_t>(s.row_stride, 1);
        if (s.nrows > 0 && (s.row0 < 0 || s.row0 >= rows || s.nrows - 1 > (rows - 1 - s.row0) / stride))
            fail(where + ": rows outside [0, " + std::to_string(rows) + ")");
        if (s.k0 < 0 || s.k1 < s.k0 || s.k1 > cols)
            fail(where + ": columns outside 0 <= k0 <= k1 <= " + std::to_string(cols));
        segments.push_back(s);
    }
    return segments;
}

void check_token_index(const py::array& index, int64_t n_rows, const char* name) {
    check_array(index, name, Kind::i64, 1);
    const auto* idx = static_cast<const int64_t*>(index.data());
    for (py::ssize_t t = 0; t < index.shape(0); ++t)
        if (idx[t] < 0 || idx[t] >= n_rows)
            fail(std::string(name) + "[" + std::to_string(t) + "] = " + std::to_string(idx[t]) + " is outside [0, " +
                 std::to_string(n_rows) + ")");
}

// The operand pointers and sizes of one expert_ffn call, from arrays already checked
// (x [T, H], token_index [m], w_gate/w_up [I, H], w_down [H, I]).
kernels::ExpertFfnArgs expert_args(const py::array& x, const py::array& token_index, const py::array& w_gate,
                                   const py::array& w_up, const py::array& w_down) {
    kernels::ExpertFfnArgs args;
    args.x = static_cast<const bf16*>(x.data());
    args.ldx = x.shape(1);
    args.token_index = static_cast<const int64_t*>(token_index.data());
    args.m = token_index.shape(0);
    args.hidden = x.shape(1);
    args.intermediate = w_gate.shape(0);
    args.w_gate = static_cast<const bf16*>(w_gate.data());
    args.w_up = static_cast<const bf16*>(w_up.data());
    args.w_down = static_cast<const bf16*>(w_down.data());
    return args;
}

struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
};

std::unique_ptr<void, FreeDeleter> aligned_buffer(size_t bytes) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) throw std::bad_alloc();
    return std::unique_ptr<void, FreeDeleter>(p);
}

// out[r, t] += sum_c weight[r, c] * tokens[t, c] over the segments (tokens gathered by the
// ISA's gather with the identity index).
void py_matmul_segments(const std::string& isa, const py::array& weight, const py::object& segments_obj,
                        const py::array& tokens, py::array& out, int64_t row_begin, int64_t row_end) {
    const KernelOps& ops = ops_for(isa);
    check_array(weight, "weight", Kind::bf16, 2);
    check_array(tokens, "tokens", Kind::bf16, 2);
    check_array(out, "out", Kind::f32, 2, true);
    const int64_t rows = weight.shape(0), ldw = weight.shape(1), m = tokens.shape(0), k = tokens.shape(1);
    if (k != ldw) fail("tokens: " + std::to_string(k) + " columns, weight has " + std::to_string(ldw));
    if (out.shape(0) != rows || out.shape(1) < m)
        fail("out: shape " + shape_str(out) + ", expected [" + std::to_string(rows) + ", >= " + std::to_string(m) + "]");
    if (segments_obj.is_none()) fail("segments: required (int64 [n, 5])");
    const std::vector<Segment> segments = read_segments(segments_obj, "segments", rows, k);
    if (row_end < 0) row_end = rows;
    const int64_t ldo = out.shape(1);
    const auto* w = static_cast<const bf16*>(weight.data());
    const auto* x = static_cast<const bf16*>(tokens.data());
    auto* o = static_cast<float*>(out.mutable_data());
    py::gil_scoped_release release;
    auto packed = aligned_buffer(ops.packed_bytes(m, k));
    std::vector<int64_t> identity(m);
    for (int64_t t = 0; t < m; ++t) identity[t] = t;
    if (m > 0) ops.gather(x, k, identity.data(), m, k, packed.get());
    ops.matmul_segments(w, ldw, segments.data(), static_cast<int64_t>(segments.size()), row_begin, row_end,
                        packed.get(), m, k, o, ldo);
}

std::vector<const float*> part_pointers(const py::list& parts, const char* name, int64_t rows, int64_t cols) {
    if (parts.empty()) fail(std::string(name) + ": needs at least one partial array");
    std::vector<const float*> pointers;
    for (size_t p = 0; p < parts.size(); ++p) {
        const py::array a = py::array::ensure(parts[p]);
        const std::string label = std::string(name) + "[" + std::to_string(p) + "]";
        if (!a) fail(label + ": not an array");
        check_array(a, label.c_str(), Kind::f32, 2);
        if (a.shape(0) != rows || a.shape(1) != cols)
            fail(label + ": shape " + shape_str(a) + ", expected [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
        pointers.push_back(static_cast<const float*>(a.data()));
    }
    return pointers;
}

// A list of fp32 partial arrays, all shaped like the first ([rows, cols]); `shape_name`
// names the expected shape in the error ("[H, m]").
struct PartList {
    int64_t rows, cols;
    std::vector<const float*> pointers;
};
PartList part_list(const py::list& parts, const char* name, const char* shape_name) {
    const py::array first = py::array::ensure(parts.empty() ? py::object(py::none()) : py::object(parts[0]));
    if (!first || first.ndim() != 2)
        fail(std::string(name) + ": expected a list of float32 " + shape_name + " arrays");
    const int64_t rows = first.shape(0), cols = first.shape(1);
    return PartList{rows, cols, part_pointers(parts, name, rows, cols)};
}

// silu_mul_pack over [i_begin, i_end) from partials [I, m]; returns act [m, I] (uint16
// bf16 bits, unpacked from the ISA layout; columns outside the range are 0).
py::array py_silu_mul_pack(const std::string& isa, const py::list& gate_parts, const py::list& up_parts,
                           int64_t i_begin, int64_t i_end) {
    const KernelOps& ops = ops_for(isa);
    const PartList gate = part_list(gate_parts, "gate_parts", "[I, m]");
    const int64_t inter = gate.rows, m = gate.cols;
    const auto& gates = gate.pointers;
    const auto ups = part_pointers(up_parts, "up_parts", inter, m);
    if (gates.size() != ups.size()) fail("gate_parts and up_parts: different numbers of parts");
    if (i_begin < 0 || i_end > inter || i_begin > i_end || i_begin % 32 || (i_end % 32 && i_end != inter))
        fail("[i_begin, i_end) must lie in [0, I) with multiples of 32 (except i_end == I)");
    py::array_t<uint16_t> result({m, inter});
    auto* res = result.mutable_data();
    {
        py::gil_scoped_release release;
        const size_t bytes = ops.packed_bytes(m, inter);
        auto packed = aligned_buffer(bytes);
        std::memset(packed.get(), 0, bytes);
        ops.silu_mul_pack(gates.data(), ups.data(), static_cast<int>(gates.size()), m, i_begin, i_end, m, inter,
                          packed.get());
        const auto* src = static_cast<const bf16*>(packed.get());
        const kernels::TokenLayout layout = ops.token_layout(m);
        for (int64_t t = 0; t < m; ++t)
            for (int64_t i = 0; i < inter; ++i) res[t * inter + i] = src[kernels::packed_index(layout, m, inter, t, i)];
    }
    return result;
}

void py_combine_down(const std::string& isa, const py::list& parts, int64_t h_begin, int64_t h_end,
                     const py::array& token_index, const py::array& token_weight, py::array& y) {
    const KernelOps& ops = ops_for(isa);
    const PartList down = part_list(parts, "parts", "[H, m]");
    const int64_t hidden = down.rows, m = down.cols;
    const auto& pointers = down.pointers;
    check_array(y, "y", Kind::f32, 2, true);
    if (y.shape(1) != hidden) fail("y: shape " + shape_str(y) + ", expected [T, " + std::to_string(hidden) + "]");
    check_token_index(token_index, y.shape(0), "token_index");
    if (token_index.shape(0) != m) fail("token_index: length " + std::to_string(token_index.shape(0)) + " != m = " + std::to_string(m));
    check_array(token_weight, "token_weight", Kind::f32, 1);
    if (token_weight.shape(0) != m) fail("token_weight: length " + std::to_string(token_weight.shape(0)) + " != m");
    if (h_begin < 0 || h_end > hidden || h_begin > h_end) fail("[h_begin, h_end) must lie in [0, H)");
    const auto* idx = static_cast<const int64_t*>(token_index.data());
    const auto* tw = static_cast<const float*>(token_weight.data());
    auto* yp = static_cast<float*>(y.mutable_data());
    py::gil_scoped_release release;
    ops.combine_down(pointers.data(), static_cast<int>(pointers.size()), m, h_begin, h_end, m, idx, tw, yp, hidden);
}

void py_store_down(const std::string& isa, const py::list& parts, int64_t h_begin, int64_t h_end, py::array& out) {
    const KernelOps& ops = ops_for(isa);
    const PartList down = part_list(parts, "parts", "[H, m]");
    const int64_t hidden = down.rows, m = down.cols;
    const auto& pointers = down.pointers;
    const bool out_bf16 = has_kind(out, Kind::bf16);
    check_array(out, "out", out_bf16 ? Kind::bf16 : Kind::f32, 2, true);
    if (out.shape(0) != m || out.shape(1) != hidden)
        fail("out: shape " + shape_str(out) + ", expected (" + std::to_string(m) + ", " + std::to_string(hidden) + ")");
    if (h_begin < 0 || h_end > hidden || h_begin > h_end) fail("[h_begin, h_end) must lie in [0, H)");
    void* dst = out.mutable_data();
    py::gil_scoped_release release;
    ops.store_down(pointers.data(), static_cast<int>(pointers.size()), m, h_begin, h_end, m, dst, hidden, out_bf16);
}

int default_threads() {
    const unsigned n = std::thread::hardware_concurrency();
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return n ? static_cast<int>(n) : 1;
}

void py_expert_ffn(const std::string& isa, const py::array& x, const py::array& token_index, const py::array& w_gate,
                   const py::array& w_up, const py::array& w_down, const py::object& gate_segments,
                   const py::object& up_segments, const py::object& down_segments, py::array& out, int threads) {
    const KernelOps& ops = ops_for(isa);
    check_array(x, "x", Kind::bf16, 2);
    check_array(w_gate, "w_gate", Kind::bf16, 2);
    check_array(w_up, "w_up", Kind::bf16, 2);
    check_array(w_down, "w_down", Kind::bf16, 2);
    const int64_t hidden = x.shape(1), inter = w_gate.shape(0);
    if (w_gate.shape(1) != hidden)
        fail("w_gate: shape " + shape_str(w_gate) + ", expected [I, H] with H = " + std::to_string(hidden));
    if (w_up.shape(0) != inter || w_up.shape(1) != hidden)
        fail("w_up: shape " + shape_str(w_up) + ", expected " + shape_str(w_gate));
    if (w_down.shape(0) != hidden || w_down.shape(1) != inter)
        fail("w_down: shape " + shape_str(w_down) + ", expected [" + std::to_string(hidden) + ", " + std::to_string(inter) + "]");
    check_token_index(token_index, x.shape(0), "token_index");
    const int64_t m = token_index.shape(0);
    const bool out_bf16 = has_kind(out, Kind::bf16);
    check_array(out, "out", out_bf16 ? Kind::bf16 : Kind::f32, 2, true);
    if (out.shape(0) != m || out.shape(1) != hidden)
        fail("out: shape " + shape_str(out) + ", expected (" + std::to_string(m) + ", " + std::to_string(hidden) + ")");
    kernels::ExpertFfnArgs args = expert_args(x, token_index, w_gate, w_up, w_down);
    args.gate_segments = read_segments(gate_segments, "gate_segments", inter, hidden);
    args.up_segments = read_segments(up_segments, "up_segments", inter, hidden);
    args.down_segments = read_segments(down_segments, "down_segments", hidden, inter);
    args.out = out.mutable_data();
    args.out_bf16 = out_bf16;
    if (threads < 0) fail("threads: must be >= 1 (or 0 for the CPUs of this process)");
    args.threads = threads == 0 ? default_threads() : threads;
    py::gil_scoped_release release;
    kernels::expert_ffn(ops, args);
}

void require_avx512(const char* what) {
    if (!has_avx512_bf16_kernels()) throw py::value_error(std::string(what) + ": needs AVX-512-BF16 on this CPU");
}

// Reads every span once on the kernel pool (each thread a contiguous share of each span),
// one pool run with phase_break - 1 barriers: spans [0, phase_break) in phase 0, the rest in
// phase 1 (so that an expert's read pays the dispatch and barrier of an expert_ffn call).
// Returns the checksum.
uint64_t read_spans_on_pool(const std::vector<std::pair<const char*, size_t>>& spans, int threads,
                            size_t phase_break = SIZE_MAX) {
    std::vector<uint64_t> sums(static_cast<size_t>(std::max(1, threads)) * 8, 0);  // a cache line each
    const int n_phases = phase_break < spans.size() ? 2 : 1;
    kernels::run_phases(threads, n_phases, [&](int phase, int id, int n_threads) {
        const size_t first = phase == 0 ? 0 : phase_break, last = phase == 0 ? std::min(phase_break, spans.size()) : spans.size();
        uint64_t sum = 0;
        for (size_t s = first; s < last; ++s) {
            const auto& [data, bytes] = spans[s];
            const size_t share = (bytes / n_threads + 255) / 256 * 256;
            const size_t begin = std::min(bytes, share * id);
            const size_t end = id == n_threads - 1 ? bytes : std::min(bytes, begin + share);
            sum += kernels::stream_read_avx512(data + begin, end - begin);
        }
        sums[static_cast<size_t>(id) * 8] += sum;
    });
    uint64_t total = 0;
    for (uint64_t v : sums) total += v;
    return total;
}

// (data, bytes) of every array in `buffers`, which must be C-contiguous.
std::vector<std::pair<const char*, size_t>> array_spans(const py::list& buffers, const char* what) {
    std::vector<std::pair<const char*, size_t>> spans;
    for (const auto& item : buffers) {
        const py::array a = py::array::ensure(item);
        if (!a || !(a.flags() & py::array::c_style)) fail(std::string(what) + ": buffers must be C-contiguous arrays");
        spans.emplace_back(static_cast<const char*>(a.data()), static_cast<size_t>(a.nbytes()));
    }
    return spans;
}

// Reads every buffer once with `threads` threads (each takes a contiguous share of each
// buffer). Returns the checksum.
uint64_t py_stream_read(const py::list& buffers, int threads) {
    require_avx512("stream_read");
    const auto spans = array_spans(buffers, "stream_read");
    threads = std::max(1, threads);
    py::gil_scoped_release release;
    return read_spans_on_pool(spans, threads);
}

double py_dpbf16ps_peak(int64_t iterations, int threads) {
    require_avx512("dpbf16ps_peak");
    threads = std::max(1, threads);
    py::gil_scoped_release release;
    std::vector<std::thread> pool;
    for (int id = 1; id < threads; ++id) pool.emplace_back([=] { kernels::dpbf16ps_peak_loop(iterations); });
    double flops = kernels::dpbf16ps_peak_loop(iterations);
    for (auto& t : pool) t.join();
    return flops * threads;
}

// One model instruction on 16 x 64-byte tiles given as uint8 [16, 64] arrays; the
// model's faults (std::runtime_error) surface as RuntimeError.
void py_amx_model_tile_dot(const py::array& config, bool int8, py::array& c, const py::array& a, const py::array& b) {
    if (!has_avx512_bf16_kernels()) fail("amx_model_tile_dot: the model build needs AVX-512-BF16");
    if (config.nbytes() != 64 || !(config.flags() & py::array::c_style)) fail("config: expected 64 contiguous bytes");
    for (const py::array* t : std::initializer_list<const py::array*>{&c, &a, &b})
        if (t->nbytes() != 16 * 64 || !((*t).flags() & py::array::c_style)) fail("tiles: expected 1024 contiguous bytes each");
    if (!c.writeable()) fail("c: must be writable");
    kernels::amx_model_tile_dot(config.data(), int8, c.mutable_data(), a.data(), b.data());
}

// Benchmark loop in native code (no Python or argument-checking overhead per call):
// runs expert_ffn `repeats` times, rotating over `experts` (tuples (w_gate, w_up, w_down),
// validated once), and returns the seconds of each call.
struct BenchCalls {
    std::vector<kernels::ExpertFfnArgs> calls;
    std::vector<std::vector<std::pair<const char*, size_t>>> spans;  // per expert: gate, up, down
    std::vector<py::array> keep;  // the arrays behind the pointers (ensure() may have converted)
};

BenchCalls bench_calls(const py::array& x, const py::array& token_index, const py::list& experts, int threads,
                       bool out_bf16) {
    check_array(x, "x", Kind::bf16, 2);
    check_token_index(token_index, x.shape(0), "token_index");
    if (experts.empty()) fail("experts: empty");
    const int64_t hidden = x.shape(1);
    BenchCalls result;
    for (size_t e = 0; e < experts.size(); ++e) {
        const py::tuple triple = experts[e].cast<py::tuple>();
        if (triple.size() != 3) fail("experts: expected (w_gate, w_up, w_down) tuples");
        const py::array wg = py::array::ensure(triple[0]), wu = py::array::ensure(triple[1]), wd = py::array::ensure(triple[2]);
        check_array(wg, "w_gate", Kind::bf16, 2);
        check_array(wu, "w_up", Kind::bf16, 2);
        check_array(wd, "w_down", Kind::bf16, 2);
        const int64_t inter = wg.shape(0);
        if (wg.shape(1) != hidden || wu.shape(0) != inter || wu.shape(1) != hidden || wd.shape(0) != hidden ||
            wd.shape(1) != inter)
            fail("experts[" + std::to_string(e) + "]: shapes do not match x [T, H] and each other");
        kernels::ExpertFfnArgs args = expert_args(x, token_index, wg, wu, wd);
        args.out_bf16 = out_bf16;
        args.threads = threads > 0 ? threads : default_threads();
        result.calls.push_back(args);
        result.keep.insert(result.keep.end(), {wg, wu, wd});
        result.spans.push_back({{static_cast<const char*>(wg.data()), static_cast<size_t>(wg.nbytes())},
                                {static_cast<const char*>(wu.data()), static_cast<size_t>(wu.nbytes())},
                                {static_cast<const char*>(wd.data()), static_cast<size_t>(wd.nbytes())}});
    }
    return result;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<double> py_bench_expert_ffn(const std::string& isa, const py::array& x, const py::array& token_index,
                                        const py::list& experts, int threads, int repeats, bool out_bf16) {
    const KernelOps& ops = ops_for(isa);
    BenchCalls bench = bench_calls(x, token_index, experts, threads, out_bf16);
    std::vector<double> seconds;
    py::gil_scoped_release release;
    std::vector<float> out(static_cast<size_t>(token_index.shape(0) * x.shape(1)) + 16);
    for (auto& c : bench.calls) c.out = out.data();
    for (int r = 0; r < repeats; ++r) {
        const auto start = std::chrono::steady_clock::now();
        kernels::expert_ffn(ops, bench.calls[r % bench.calls.size()]);
        seconds.push_back(seconds_since(start));
    }
    return seconds;
}

// Our kernel and the read ceiling measured interleaved, so that both see the same state
// of a machine whose bandwidth drifts (shared with other VMs): repetition r runs
// expert_ffn on expert 2r and then stream-reads expert 2r+1 (mod the count; its gate and
// up in one phase, down in a second, on the same pool: the same dispatch and barrier
// cost as the kernel). Returns (kernel seconds, read seconds) per repetition.
std::pair<std::vector<double>, std::vector<double>> py_bench_expert_ffn_vs_read(
    const std::string& isa, const py::array& x, const py::array& token_index, const py::list& experts, int threads,
    int repeats, bool out_bf16) {
    require_avx512("bench_expert_ffn_vs_read");
    const KernelOps& ops = ops_for(isa);
    BenchCalls bench = bench_calls(x, token_index, experts, threads, out_bf16);
    const int read_threads = threads > 0 ? threads : default_threads();
    std::vector<double> ours, read;
    py::gil_scoped_release release;
    std::vector<float> out(static_cast<size_t>(token_index.shape(0) * x.shape(1)) + 16);
    for (auto& c : bench.calls) c.out = out.data();
    const size_t n = bench.calls.size();
    volatile uint64_t sink = 0;
    for (int r = 0; r < repeats; ++r) {
        auto start = std::chrono::steady_clock::now();
        kernels::expert_ffn(ops, bench.calls[(2 * static_cast<size_t>(r)) % n]);
        ours.push_back(seconds_since(start));
        start = std::chrono::steady_clock::now();
        sink = sink + read_spans_on_pool(bench.spans[(2 * static_cast<size_t>(r) + 1) % n], read_threads, 2);
        read.push_back(seconds_since(start));
    }
    return {ours, read};
}

// The read ceiling: `threads` threads each read their share of every buffer in turn,
// `repeats` passes over the list, with no per-call overhead; returns the elapsed seconds.
double py_bench_stream_read(const py::list& buffers, int threads, int repeats) {
    require_avx512("bench_stream_read");
    const auto spans = array_spans(buffers, "bench_stream_read");
    threads = std::max(1, threads);
    py::gil_scoped_release release;
    std::vector<std::pair<const char*, size_t>> order;
    for (int r = 0; r < repeats; ++r) order.push_back(spans[r % spans.size()]);
    const auto start = std::chrono::steady_clock::now();
    volatile uint64_t sink = read_spans_on_pool(order, threads);
    (void)sink;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void register_kernels(py::module_& m) {
    m.def("kernel_isas", [] {
        std::vector<std::string> names;
        for (Isa isa : {Isa::ref, Isa::avx2, Isa::avx512, Isa::amx_model, Isa::amx})
            if (kernels::kernel_ops(isa)) names.emplace_back(kernels::isa_name(isa));
        return names;
    }, "Names of the kernel ISAs this CPU (and OS) can run.");
    m.def("default_kernel_isa", [] { return std::string(kernels::isa_name(kernels::default_isa())); },
          "The ISA chosen by default (amx > avx512 > avx2 > ref, or NUMA_MOE_ISA).");
    m.def("matmul_segments", &py_matmul_segments, py::arg("isa"), py::arg("weight"), py::arg("segments"),
          py::arg("tokens"), py::arg("out"), py::arg("row_begin") = 0, py::arg("row_end") = -1,
          "out[r, t] += sum over segment columns of weight[r, c] * tokens[t, c] (rows of the segments in "
          "[row_begin, row_end)).");
    m.def("silu_mul_pack", &py_silu_mul_pack, py::arg("isa"), py::arg("gate_parts"), py::arg("up_parts"),
          py::arg("i_begin"), py::arg("i_end"), "act[t, i] = bf16(silu(sum gate) * sum up), unpacked to [m, I] uint16.");
    m.def("combine_down", &py_combine_down, py::arg("isa"), py::arg("parts"), py::arg("h_begin"), py::arg("h_end"),
          py::arg("token_index"), py::arg("token_weight"), py::arg("y"),
          "y[token_index[t], h] += token_weight[t] * sum_p parts[p][h, t].");
    m.def("store_down", &py_store_down, py::arg("isa"), py::arg("parts"), py::arg("h_begin"), py::arg("h_end"),
          py::arg("out"), "out[t, h] = sum_p parts[p][h, t] (stored, bf16 or float32) for h in [h_begin, h_end).");
    m.def("expert_ffn", &py_expert_ffn, py::arg("isa"), py::arg("x"), py::arg("token_index"), py::arg("w_gate"),
          py::arg("w_up"), py::arg("w_down"), py::arg("gate_segments"), py::arg("up_segments"),
          py::arg("down_segments"), py::arg("out"), py::arg("threads") = 0,
          "out = (silu(x[idx] Wg^T) * (x[idx] Wu^T)) Wd^T; out is float32 or bfloat16 [m, H].");
    m.def("stream_read", &py_stream_read, py::arg("buffers"), py::arg("threads") = 1,
          "Reads the buffers with AVX-512 loads on `threads` threads (bandwidth ceiling); returns a checksum.");
    m.def("dpbf16ps_peak", &py_dpbf16ps_peak, py::arg("iterations"), py::arg("threads") = 1,
          "Register-only vdpbf16ps loop on `threads` threads; returns the flops executed.");
    m.def("amx_model_tile_dot", &py_amx_model_tile_dot, py::arg("config"), py::arg("int8"), py::arg("c"),
          py::arg("a"), py::arg("b"), "Test hook: one TDPBF16PS/TDPBSSD of the AMX software model on tmm0 += tmm1 . tmm2.");
    m.def("bench_expert_ffn", &py_bench_expert_ffn, py::arg("isa"), py::arg("x"), py::arg("token_index"),
          py::arg("experts"), py::arg("threads"), py::arg("repeats"), py::arg("out_bf16") = true,
          "Benchmark: seconds of each of `repeats` expert_ffn calls rotating over `experts`.");
    m.def("bench_expert_ffn_vs_read", &py_bench_expert_ffn_vs_read, py::arg("isa"), py::arg("x"),
          py::arg("token_index"), py::arg("experts"), py::arg("threads"), py::arg("repeats"), py::arg("out_bf16") = true,
          "Benchmark: (kernel seconds, read seconds) per repetition; repetition r runs expert_ffn on expert 2r "
          "and stream-reads expert 2r+1 (rotating), interleaved so both see the same machine state.");
    m.def("bench_stream_read", &py_bench_stream_read, py::arg("buffers"), py::arg("threads"), py::arg("repeats"),
          "Benchmark: seconds to stream-read `repeats` buffers (rotating) with `threads` threads.");
    m.def("kernel_pool_start_count", &kernels::kernel_pool_start_count,
          "Thread creations over the kernels' process-wide worker pools so far (none per call).");
    m.def("affinity_cpu_count", &default_threads, "CPUs in this process's affinity mask.");
}

}  // namespace numa_moe
