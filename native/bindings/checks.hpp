// The one checking layer between Python and the native core: every binding checks the
// arrays and arguments it is handed with these functions (dtype, shape, C-contiguity,
// alignment, segment rules, index ranges) before any pointer reaches a kernel, so the
// rules are the same everywhere. Violations throw std::invalid_argument, which pybind11
// raises as ValueError; messages name the argument.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/segment.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::bindings {

namespace py = pybind11;
using kernels::bf16;

enum class Kind { bf16, f32, i64 };

// bf16 is ml_dtypes.bfloat16 or its bit pattern as uint16 / int16.
bool has_kind(const py::array& a, Kind kind);

std::string shape_text(const py::array& a);

// dtype, dimensionality, C-contiguity, element alignment (and writability).
void check_array(const py::array& a, const std::string& name, Kind kind, int ndim, bool writable = false);

// A checked C-contiguous array from any object (std::invalid_argument if it is none).
py::array checked_array(const py::object& obj, const std::string& name, Kind kind, int ndim, bool writable = false);

// The same without the dtype (for arguments of several accepted dtypes, which the caller
// checks): an array, ndim, C-contiguous, aligned.
py::array checked_layout(const py::object& obj, const std::string& name, int ndim);

// A writable [rows, cols] array of `itemsize`-byte elements (any dtype: the caller's
// format tells) whose rows are contiguous (any row stride): a conversion's output.
py::array byte_rows(const py::object& obj, const std::string& name, int64_t rows, int64_t cols, int64_t itemsize);

// The output array of a kernel: float32 or bf16, C-contiguous, writable, of this shape.
// Returns whether it is bf16.
bool check_output(const py::array& out, const std::string& name, int64_t rows, int64_t cols);

// A weight format name: bf16, int8 or int4 (anything else is refused).
kernels::Format weight_format_named(const std::string& name);

// "32, 64, 128": the groups a weight format's tables exist for (kernels::has_group), for
// error messages.
std::string group_choices(kernels::Format format);

// A group given with a weight format: 0 (the format's default), any for bf16, else one of
// group_choices (anything else is refused).
void check_group_of(kernels::Format format, int64_t group);

// The KernelOps of an ISA name for a weight format (and group; 0: the format's default,
// kernels::default_group); unknown or unavailable names are refused.
const kernels::KernelOps& ops_for(const std::string& isa, kernels::Format format = kernels::Format::bf16,
                                  int64_t group = 0);

// An int64 [n, 5] array as segments, not yet checked against a matrix.
std::vector<Segment> segment_array(const py::object& obj, const std::string& name);

// An int64 [n, 5] segment array (None: empty list) whose segments lie in rows x cols.
std::vector<Segment> read_segments(const py::object& obj, const std::string& name, int64_t rows, int64_t cols);

// An int64 1-D index whose values lie in [0, n_rows).
void check_index(const py::array& index, const std::string& name, int64_t n_rows);

// A 2-D bf16 array whose rows are contiguous (any row stride): the layer's weights.
struct Bf16Rows {
    const bf16* data;
    int64_t rows, cols, ld;
};
Bf16Rows bf16_rows(const py::array& a, const std::string& name);

// A weight matrix argument: bf16 values (scales None), or int8 [rows, cols] / uint8
// [rows, cols / 2] (the nibble formats, two per byte) values with their group scales
// [rows, cols / group] (float32, float16 or bfloat16, mxfp4's float8_e8m0fnu; finite,
// non-zero; group 32, 64 or 128, the codebook formats' 32). Rows must be contiguous (any
// row stride). `format` names the weight format ("": the one the dtypes tell: bf16
// without scales, int8, mxfp4 with e8m0 scales, else int4; iq4nl only by name) and must
// agree with the dtypes. `name` names the values, name + "_scales" the scales in messages.
struct WeightArg {
    kernels::Weights weights;
    kernels::Format format = kernels::Format::bf16;
    int64_t rows = 0, cols = 0;
};
WeightArg weight_operand(const py::array& values, const py::object& scales, const std::string& name,
                         const std::string& format = "");

// A list of fp32 [rows, cols] partial arrays, all shaped like the first.
struct PartList {
    int64_t rows, cols;
    std::vector<const float*> pointers;
};
PartList part_list(const py::list& parts, const std::string& name);

// An argument range [begin, end) inside [0, size); `align` > 1 asks for multiples of it
// (end may also be size).
void check_range(int64_t begin, int64_t end, int64_t size, int64_t align, const std::string& what);

// An expert's bias: None (nullptr), or a contiguous float32 [n] of finite values.
const float* bias_vector(const py::object& bias, int64_t n, const std::string& name);

// The activation's parameters (kernel_api.hpp Activation), checked: alpha finite and > 0,
// limit > 0 (infinity: no clamp), up_offset finite.
kernels::Activation activation_of(double alpha, double limit, double up_offset);

}  // namespace numa_moe::bindings

namespace numa_moe::engine {
struct ExpertFfnArgs;
}
namespace numa_moe::bindings {
// The checked operands of one expert_ffn call (x [T, H], token_index [m], w_gate and w_up
// [I, H], w_down [H, I]; threads 0 = this process's CPUs); segments and out not set.
engine::ExpertFfnArgs expert_ffn_args(const py::array& x, const py::array& token_index, const WeightArg& gate,
                                      const WeightArg& up, const WeightArg& down, int threads);
}  // namespace numa_moe::bindings

