#include "bindings/checks.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "common/check.hpp"
#include "engine/expert_ffn.hpp"
#include "engine/pipeline.hpp"
#include "engine/process_pool.hpp"

namespace numa_moe::bindings {
namespace {

const char* kind_name(Kind kind) {
    switch (kind) {
        case Kind::bf16: return "bfloat16 (or its uint16 bit pattern)";
        case Kind::f32: return "float32";
        case Kind::i64: return "int64";
    }
    return "?";
}

std::string dtype_text(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

}  // namespace

bool has_kind(const py::array& a, Kind kind) {
    const py::dtype dt = a.dtype();
    switch (kind) {
        case Kind::bf16: return dt.itemsize() == 2 && (dt.kind() == 'u' || dt.kind() == 'i' || dtype_text(a) == "bfloat16");
        case Kind::f32: return dt.kind() == 'f' && dt.itemsize() == 4;
        case Kind::i64: return dt.kind() == 'i' && dt.itemsize() == 8;
    }
    return false;
}

std::string shape_text(const py::array& a) {
    std::ostringstream s;
    s << "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
    s << (a.ndim() == 1 ? ",)" : ")");
    return s.str();
}

void check_array(const py::array& a, const std::string& name, Kind kind, int ndim, bool writable) {
    NUMA_MOE_CHECK(has_kind(a, kind), name, ": dtype ", dtype_text(a), ", expected ", kind_name(kind));
    NUMA_MOE_CHECK(a.ndim() == ndim, name, ": expected ", ndim, "-D array, got shape ", shape_text(a));
    NUMA_MOE_CHECK(a.flags() & py::array::c_style, name, ": must be C-contiguous (row-major), got strides that are not");
    const auto address = reinterpret_cast<uintptr_t>(a.data());
    NUMA_MOE_CHECK(address % a.itemsize() == 0, name, ": data at 0x", address, " is not aligned to its ", a.itemsize(),
                   "-byte elements");
    NUMA_MOE_CHECK(!writable || a.writeable(), name, ": must be writable");
}

namespace {

py::array as_array(const py::object& obj, const std::string& name) {
    NUMA_MOE_CHECK(py::isinstance<py::array>(obj), name, ": expected a numpy array, got ",
                   py::str(py::type::of(obj)).cast<std::string>());
    return py::reinterpret_borrow<py::array>(obj);
}

}  // namespace

py::array checked_array(const py::object& obj, const std::string& name, Kind kind, int ndim, bool writable) {
    py::array a = as_array(obj, name);
    check_array(a, name, kind, ndim, writable);
    return a;
}

py::array checked_layout(const py::object& obj, const std::string& name, int ndim) {
    py::array a = as_array(obj, name);
    NUMA_MOE_CHECK(a.ndim() == ndim, name, ": expected ", ndim, "-D array, got shape ", shape_text(a));
    NUMA_MOE_CHECK(a.flags() & py::array::c_style, name, ": must be C-contiguous (row-major)");
    NUMA_MOE_CHECK(reinterpret_cast<uintptr_t>(a.data()) % a.itemsize() == 0, name, ": data is not aligned to its elements");
    return a;
}

py::array byte_rows(const py::object& obj, const std::string& name, int64_t rows, int64_t cols, int64_t itemsize) {
    NUMA_MOE_CHECK(py::isinstance<py::array>(obj), name, ": expected a numpy array");
    py::array a = py::reinterpret_borrow<py::array>(obj);
    NUMA_MOE_CHECK(a.ndim() == 2 && a.shape(0) == rows && a.shape(1) == cols, name, ": shape ", shape_text(a),
                   ", expected [", rows, ", ", cols, "]");
    NUMA_MOE_CHECK(a.itemsize() == itemsize, name, ": ", a.itemsize(), "-byte elements, expected ", itemsize);
    NUMA_MOE_CHECK(a.strides(1) == itemsize && a.strides(0) >= cols * itemsize, name, ": rows must be contiguous");
    NUMA_MOE_CHECK(a.writeable(), name, ": must be writable");
    return a;
}

bool check_output(const py::array& out, const std::string& name, int64_t rows, int64_t cols) {
    const bool bf16 = has_kind(out, Kind::bf16);
    check_array(out, name, bf16 ? Kind::bf16 : Kind::f32, 2, true);
    NUMA_MOE_CHECK(out.shape(0) == rows && out.shape(1) == cols, name, ": shape ", shape_text(out), ", expected (", rows,
                   ", ", cols, ")");
    return bf16;
}

kernels::Format weight_format_named(const std::string& name) {
    kernels::Format format;
    NUMA_MOE_CHECK(kernels::parse_format(name.c_str(), &format), "format '", name, "' is not one of ",
                   kernels::format_names());
    return format;
}

std::string group_choices(kernels::Format format) {
    return kernels::is_codebook_format(format) ? message("32 (", kernels::format_name(format), "'s block)")
                                               : std::string("32, 64, 128");
}

void check_group_of(kernels::Format format, int64_t group) {
    NUMA_MOE_CHECK(group == 0 || format == kernels::Format::bf16 || kernels::has_group(format, group), "group ", group,
                   " is not one of ", group_choices(format), " for ", kernels::format_name(format), " weights");
}

const kernels::KernelOps& ops_for(const std::string& isa, kernels::Format format, int64_t group) {
    kernels::Isa parsed;
    NUMA_MOE_CHECK(kernels::parse_isa(isa.c_str(), &parsed), "unknown ISA '", isa, "': not one of ", kernels::isa_names());
    const kernels::KernelOps* ops = kernels::kernel_ops(parsed, format, group);
    NUMA_MOE_CHECK(ops, "isa '", isa, "' is not available",
                   format == kernels::Format::bf16 ? "" : message(" for ", kernels::format_name(format), " weights"), ": ",
                   kernels::unavailable_reason(parsed, format));
    return *ops;
}

std::vector<Segment> segment_array(const py::object& obj, const std::string& name) {
    const py::array a = checked_array(obj, name, Kind::i64, 2);
    NUMA_MOE_CHECK(a.shape(1) == 5, name, ": expected shape [n, 5], got ", shape_text(a));
    const auto* first = static_cast<const Segment*>(a.data());
    return std::vector<Segment>(first, first + a.shape(0));
}

std::vector<Segment> read_segments(const py::object& obj, const std::string& name, int64_t rows, int64_t cols) {
    if (obj.is_none()) return {};
    std::vector<Segment> segments = segment_array(obj, name);
    check_segments(segments.data(), static_cast<int64_t>(segments.size()), rows, cols, name);
    return segments;
}

void check_index(const py::array& index, const std::string& name, int64_t n_rows) {
    check_array(index, name, Kind::i64, 1);
    const auto* idx = static_cast<const int64_t*>(index.data());
    for (py::ssize_t t = 0; t < index.shape(0); ++t)
        NUMA_MOE_CHECK(idx[t] >= 0 && idx[t] < n_rows, name, "[", t, "] = ", idx[t], " is outside [0, ", n_rows, ")");
}

Bf16Rows bf16_rows(const py::array& a, const std::string& name) {
    NUMA_MOE_CHECK(has_kind(a, Kind::bf16), name, ": dtype ", dtype_text(a), ", expected ", kind_name(Kind::bf16));
    NUMA_MOE_CHECK(a.ndim() == 2, name, ": expected a 2-D array, got ", a.ndim(), "-D");
    // An empty array has no bytes to lay out (numpy may report zero strides for it).
    const bool empty = a.shape(0) == 0 || a.shape(1) == 0;
    NUMA_MOE_CHECK(empty || (a.strides(1) == 2 && a.strides(0) % 2 == 0 && (a.shape(0) <= 1 || a.strides(0) >= 2 * a.shape(1))),
                   name, ": rows must be contiguous (strides ", a.strides(0), ", ", a.strides(1), " bytes)");
    NUMA_MOE_CHECK(reinterpret_cast<uintptr_t>(a.data()) % 2 == 0, name, ": data is not aligned to its 2-byte elements");
    const int64_t ld = a.shape(0) > 1 && !empty ? a.strides(0) / 2 : a.shape(1);
    return Bf16Rows{static_cast<const bf16*>(a.data()), a.shape(0), a.shape(1), ld};
}

PartList part_list(const py::list& parts, const std::string& name) {
    NUMA_MOE_CHECK(!parts.empty(), name, ": needs at least one partial array");
    PartList list{0, 0, {}};
    for (size_t p = 0; p < parts.size(); ++p) {
        const std::string label = message(name, "[", p, "]");
        const py::array a = checked_array(parts[p], label, Kind::f32, 2);
        if (p == 0) {
            list.rows = a.shape(0);
            list.cols = a.shape(1);
        }
        NUMA_MOE_CHECK(a.shape(0) == list.rows && a.shape(1) == list.cols, label, ": shape ", shape_text(a), ", expected [",
                       list.rows, ", ", list.cols, "] like ", name, "[0]");
        list.pointers.push_back(static_cast<const float*>(a.data()));
    }
    return list;
}

void check_range(int64_t begin, int64_t end, int64_t size, int64_t align, const std::string& what) {
    const bool aligned = align <= 1 || (begin % align == 0 && (end % align == 0 || end == size));
    NUMA_MOE_CHECK(begin >= 0 && end <= size && begin <= end && aligned, what, " = [", begin, ", ", end,
                   ") must lie in [0, ", size, ")", align > 1 ? message(" with multiples of ", align, " (except the end)") : "");
}

const float* bias_vector(const py::object& bias, int64_t n, const std::string& name) {
    if (bias.is_none()) return nullptr;
    const py::array a = checked_array(bias, name, Kind::f32, 1);
    NUMA_MOE_CHECK(a.shape(0) == n, name, ": length ", a.shape(0), ", expected ", n);
    const float* values = static_cast<const float*>(a.data());
    for (int64_t i = 0; i < n; ++i)
        NUMA_MOE_CHECK(std::isfinite(values[i]), name, ": entry ", i, " is not finite (", values[i], ")");
    return values;
}

kernels::Activation activation_of(double alpha, double limit, double up_offset) {
    NUMA_MOE_CHECK(std::isfinite(alpha) && alpha > 0, "activation alpha must be finite and > 0, got ", alpha);
    NUMA_MOE_CHECK(limit > 0, "activation limit must be > 0 (inf: no clamp), got ", limit);
    NUMA_MOE_CHECK(std::isfinite(up_offset), "activation up_offset must be finite, got ", up_offset);
    return kernels::Activation{static_cast<float>(alpha), static_cast<float>(limit), static_cast<float>(up_offset)};
}

namespace {

kernels::ScaleDtype scale_type_of(const py::array& scales, const std::string& name) {
    const py::dtype dt = scales.dtype();
    if (dt.kind() == 'f' && dt.itemsize() == 4) return kernels::ScaleDtype::fp32;
    if (dt.kind() == 'f' && dt.itemsize() == 2) return kernels::ScaleDtype::fp16;
    if (dtype_text(scales) == "bfloat16") return kernels::ScaleDtype::bf16;
    if (dtype_text(scales) == "float8_e8m0fnu") return kernels::ScaleDtype::e8m0;
    fail(name, ": dtype ", dtype_text(scales), ", expected float32, float16, bfloat16 or (mxfp4) float8_e8m0fnu");
}

// The format the dtypes tell (weight_operand), checked against the one named, if any.
kernels::Format format_of(const py::array& values, kernels::ScaleDtype scale_dtype, const std::string& named,
                          const std::string& name) {
    const bool e8m0 = scale_dtype == kernels::ScaleDtype::e8m0, signed_values = values.dtype().kind() == 'i';
    if (named.empty()) {
        // The scales' dtype tells mxfp4 from int4: mxfp4 comes with e8m0 scales, and
        // nothing else does (e8m0 scales decode as mxfp4's, nibble_codes.hpp).
        NUMA_MOE_CHECK(!e8m0 || !signed_values, name, "_scales: e8m0 scales go with mxfp4 weights (uint8, two per byte), not ",
                       dtype_text(values));
        return signed_values ? kernels::Format::int8 : e8m0 ? kernels::Format::mxfp4 : kernels::Format::int4;
    }
    const kernels::Format format = weight_format_named(named);
    NUMA_MOE_CHECK(format != kernels::Format::bf16, name, ": bf16 weights take no scales");
    NUMA_MOE_CHECK((format == kernels::Format::int8) == signed_values, name, ": dtype ", dtype_text(values),
                   " does not hold ", named, " weights (", format == kernels::Format::int8 ? "int8" : "uint8, two per byte",
                   ")");
    NUMA_MOE_CHECK((format == kernels::Format::mxfp4) == e8m0, name, "_scales: ",
                   e8m0 ? "e8m0 scales go with mxfp4 weights only" : "mxfp4 weights take e8m0 scales (float8_e8m0fnu)",
                   ", got ", named, " weights with ", e8m0 ? "e8m0" : "float", " scales");
    return format;
}

// Whether a scale's bits are NaN, infinite or (signed) zero (unless kZeroAllowed), per
// scale type: bit tests only, so that the loop over every scale of a matrix vectorises
// (expert_ffn checks them each call).
template <typename Bits, Bits kExponent, Bits kMagnitude, bool kZeroAllowed>
bool bad_scale_bits(Bits bits) {
    return (bits & kExponent) == kExponent || (!kZeroAllowed && (bits & kMagnitude) == 0);
}

// Index of the first element of bits[0, n) that is_bad, or -1. The scan for any first
// accumulates the flags in a Bits-wide integer, without an early exit, and stays out of
// line, so that it vectorises: inlined into the checking code, or with a bool
// accumulator, GCC 12 kept it one scale a step (a DeepSeek-V3 expert has 1.4 million
// fp16 scales at groups of 32, checked on every expert_ffn call).
template <typename Bits, typename IsBad>
__attribute__((noinline)) int64_t first_index_where(const Bits* bits, int64_t n, IsBad is_bad) {
    Bits any = 0;
    for (int64_t i = 0; i < n; ++i) any |= static_cast<Bits>(is_bad(bits[i]));
    if (!any) return -1;
    for (int64_t i = 0;; ++i)
        if (is_bad(bits[i])) return i;
}

template <typename Bits, Bits kExponent, Bits kMagnitude, bool kZeroAllowed>
int64_t first_bad_scale_of(const void* data, int64_t n) {
    return first_index_where(static_cast<const Bits*>(data), n,
                             [](Bits bits) { return bad_scale_bits<Bits, kExponent, kMagnitude, kZeroAllowed>(bits); });
}

template <bool kZeroAllowed>
int64_t first_bad_float_scale(const void* data, int64_t n, kernels::ScaleDtype type) {
    switch (type) {
        case kernels::ScaleDtype::fp32: return first_bad_scale_of<uint32_t, 0x7f800000u, 0x7fffffffu, kZeroAllowed>(data, n);
        case kernels::ScaleDtype::fp16: return first_bad_scale_of<uint16_t, 0x7c00u, 0x7fffu, kZeroAllowed>(data, n);
        case kernels::ScaleDtype::bf16: return first_bad_scale_of<uint16_t, 0x7f80u, 0x7fffu, kZeroAllowed>(data, n);
        case kernels::ScaleDtype::e8m0: break;
    }
    return -1;
}

// Index of the first NaN, infinite or (where the format has a zero code) zero scale, or -1
// (e8m0 has neither zero nor infinity: its one bad byte is the NaN 0xff).
int64_t first_bad_scale(const void* data, int64_t n, kernels::ScaleDtype type, kernels::Format format) {
    switch (type) {
        case kernels::ScaleDtype::e8m0:
            return first_index_where(static_cast<const uint8_t*>(data), n, [](uint8_t byte) { return byte == 0xff; });
        default:
            return kernels::takes_zero_scales(format) ? first_bad_float_scale<true>(data, n, type)
                                                      : first_bad_float_scale<false>(data, n, type);
    }
}

}  // namespace

WeightArg weight_operand(const py::array& values, const py::object& scales_obj, const std::string& name,
                         const std::string& format) {
    WeightArg arg;
    if (scales_obj.is_none()) {
        NUMA_MOE_CHECK(format.empty() || weight_format_named(format) == kernels::Format::bf16, name, ": ", format,
                       " weights need their group scales");
        const Bf16Rows w = bf16_rows(values, name);
        arg.weights.data = w.data;
        arg.weights.ld = w.ld;
        arg.rows = w.rows;
        arg.cols = w.cols;
        return arg;
    }
    const py::dtype dt = values.dtype();
    NUMA_MOE_CHECK(dt.itemsize() == 1 && (dt.kind() == 'i' || dt.kind() == 'u'), name, ": dtype ", dtype_text(values),
                   ", expected int8 (int8 weights) or uint8 (the nibble formats, two per byte) since scales are given");
    const std::string scales_name = name + "_scales";
    const py::array scales = checked_layout(scales_obj, scales_name, 2);
    arg.weights.scale_dtype = scale_type_of(scales, scales_name);
    arg.format = format_of(values, arg.weights.scale_dtype, format, name);
    const int per_byte = kernels::is_nibble_format(arg.format) ? 2 : 1;
    NUMA_MOE_CHECK(values.ndim() == 2, name, ": expected a 2-D array, got shape ", shape_text(values));
    NUMA_MOE_CHECK(values.shape(1) <= 1 || values.strides(1) == 1, name, ": rows must be contiguous");
    const int64_t row_bytes = values.shape(0) > 1 ? values.strides(0) : values.shape(1);
    NUMA_MOE_CHECK(row_bytes >= values.shape(1), name, ": rows overlap (row stride below the row length)");
    arg.rows = values.shape(0);
    arg.cols = values.shape(1) * per_byte;
    arg.weights.data = values.data();
    arg.weights.ld = row_bytes * per_byte;
    const int64_t per_group = kernels::scale_values_per_group(arg.format);
    NUMA_MOE_CHECK(scales.shape(0) == arg.rows && scales.shape(1) >= per_group && scales.shape(1) % per_group == 0 &&
                       arg.cols % (scales.shape(1) / per_group) == 0,
                   scales_name, ": shape ", shape_text(scales), " does not give a group for a ", arg.rows, " x ",
                   arg.cols, " matrix ", per_group == 1 ? "([rows, cols / group])" : "([rows, 2 cols / group]: the "
                   "scales, then the minimums)");
    arg.weights.group = arg.cols / (scales.shape(1) / per_group);
    NUMA_MOE_CHECK(kernels::has_group(arg.format, arg.weights.group), scales_name, ": group ", arg.weights.group,
                   " (cols / scale columns) is not one of ", group_choices(arg.format));
    arg.weights.scales = scales.data();
    arg.weights.scales_ld = scales.shape(1);
    const int64_t bad = first_bad_scale(scales.data(), scales.size(), arg.weights.scale_dtype, arg.format);
    if (bad >= 0) {
        const py::object value = scales.attr("reshape")(-1).attr("__getitem__")(bad).attr("item")();
        const bool zero = value.cast<double>() == 0.0;
        fail(scales_name, ": entry ", bad, " is ", zero ? "zero" : "not finite",
             kernels::has_minimums(arg.format)       ? " (scales and minimums must be finite)"
             : kernels::takes_zero_scales(arg.format) ? " (scales must be finite)"
                                                      : " (scales must be finite and non-zero)");
    }
    return arg;
}

engine::ExpertFfnArgs expert_ffn_args(const py::array& x, const py::array& token_index, const WeightArg& gate,
                                      const WeightArg& up, const WeightArg& down, int threads) {
    check_array(x, "x", Kind::bf16, 2);
    const int64_t hidden = x.shape(1), inter = gate.rows;
    NUMA_MOE_CHECK(gate.cols == hidden, "w_gate: shape [", gate.rows, ", ", gate.cols, "], expected [I, H] with H = ", hidden);
    NUMA_MOE_CHECK(up.rows == inter && up.cols == hidden, "w_up: shape [", up.rows, ", ", up.cols, "], expected [", inter,
                   ", ", hidden, "]");
    NUMA_MOE_CHECK(down.rows == hidden && down.cols == inter, "w_down: shape [", down.rows, ", ", down.cols,
                   "], expected [", hidden, ", ", inter, "]");
    engine::check_one_format("expert_ffn", {gate.format, up.format, down.format},
                             {gate.weights.group, up.weights.group, down.weights.group});
    check_index(token_index, "token_index", x.shape(0));
    NUMA_MOE_CHECK(threads >= 0, "threads: must be >= 1 (or 0 for the CPUs of this process)");
    engine::ExpertFfnArgs args;
    args.x = static_cast<const bf16*>(x.data());
    args.ldx = hidden;
    args.token_index = static_cast<const int64_t*>(token_index.data());
    args.m = token_index.shape(0);
    args.hidden = hidden;
    args.intermediate = inter;
    args.gate = gate.weights;
    args.up = up.weights;
    args.down = down.weights;
    args.format = gate.format;
    args.threads = threads == 0 ? engine::affinity_cpu_count() : threads;
    return args;
}

}  // namespace numa_moe::bindings
