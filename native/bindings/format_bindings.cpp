// Python API of the weight-format conversions (numa_moe._native): checked here, run
// without the GIL (the loader converts one matrix a thread).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "formats/fp8_blocks.hpp"
#include "formats/ggml_blocks.hpp"
#include "formats/group_quant.hpp"

namespace numa_moe::bindings {

namespace {

using formats::GgmlBlocks;

GgmlBlocks ggml_blocks_named(const std::string& name) {
    if (name == "Q8_0") return GgmlBlocks::q8_0;
    if (name == "Q4_0") return GgmlBlocks::q4_0;
    if (name == "IQ4_NL") return GgmlBlocks::iq4_nl;
    if (name == "MXFP4") return GgmlBlocks::mxfp4;
    if (name == "IQ4_XS") return GgmlBlocks::iq4_xs;
    if (name == "Q5_0") return GgmlBlocks::q5_0;
    if (name == "Q4_1") return GgmlBlocks::q4_1;
    if (name == "Q4_K") return GgmlBlocks::q4_k;
    NUMA_MOE_CHECK(false, "ggml type '", name, "' is not one of Q8_0, Q4_0, IQ4_NL, MXFP4, IQ4_XS, Q5_0, Q4_1, Q4_K");
    return GgmlBlocks::q8_0;
}

// The raw bytes of a rows x cols matrix of ggml blocks (block weights, block_bytes bytes
// each), checked: shape against the block, a 1-D byte array of exactly their size.
const uint8_t* checked_blocks(const std::string& type_name, const py::object& raw_obj, int64_t rows, int64_t cols,
                              int64_t block, int64_t block_bytes) {
    NUMA_MOE_CHECK(rows > 0 && cols > 0 && cols % block == 0, type_name, ": a ", rows, " x ", cols,
                   " matrix: rows must be positive and cols a positive multiple of ", block);
    py::array raw = checked_layout(raw_obj, "raw", 1);
    NUMA_MOE_CHECK(raw.itemsize() == 1, "raw: expected bytes (uint8), got ", raw.itemsize(), "-byte elements");
    const int64_t expected = rows * (cols / block) * block_bytes;
    NUMA_MOE_CHECK(raw.size() == expected, type_name, ": ", raw.size(), " bytes for a ", rows, " x ", cols,
                   " matrix, expected ", expected);
    return static_cast<const uint8_t*>(raw.data());  // the caller's raw_obj keeps the array alive
}

void py_convert_ggml_blocks(const std::string& type_name, const py::object& raw_obj, int64_t rows, int64_t cols,
                            const py::object& values_obj, const py::object& scales_obj) {
    const GgmlBlocks type = ggml_blocks_named(type_name);
    const uint8_t* in = checked_blocks(type_name, raw_obj, rows, cols, formats::ggml_block_weights(type),
                                       formats::ggml_block_bytes(type));
    const bool bytes_a_weight = type == GgmlBlocks::q8_0 || type == GgmlBlocks::q5_0;
    py::array values = byte_rows(values_obj, "values", rows, bytes_a_weight ? cols : cols / 2, 1);
    const int64_t scale_cols = cols / 32 * (formats::ggml_has_minimums(type) ? 2 : 1);
    py::array scales = byte_rows(scales_obj, "scales", rows, scale_cols, formats::ggml_scale_bytes(type));
    auto* v = static_cast<uint8_t*>(values.mutable_data());
    auto* s = static_cast<uint8_t*>(scales.mutable_data());
    const int64_t values_ld = values.strides(0), scales_ld = scales.strides(0);
    NoGil released;
    formats::convert_ggml_blocks(type, in, rows, cols, v, values_ld, s, scales_ld);
}

formats::GgmlKQuant k_quant_named(const std::string& name) {
    if (name == "Q2_K") return formats::GgmlKQuant::q2_k;
    if (name == "Q3_K") return formats::GgmlKQuant::q3_k;
    if (name == "Q4_K") return formats::GgmlKQuant::q4_k;
    if (name == "Q5_K") return formats::GgmlKQuant::q5_k;
    if (name == "Q6_K") return formats::GgmlKQuant::q6_k;
    NUMA_MOE_CHECK(false, "ggml type '", name, "' is not one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K");
    return formats::GgmlKQuant::q4_k;
}

void py_dequantize_ggml_k_blocks(const std::string& type_name, const py::object& raw_obj, int64_t rows, int64_t cols,
                                 const py::object& out_obj) {
    const formats::GgmlKQuant type = k_quant_named(type_name);
    const uint8_t* in = checked_blocks(type_name, raw_obj, rows, cols, formats::kGgmlSuperBlock,
                                       formats::ggml_k_block_bytes(type));
    py::array out = checked_array(out_obj, "out", Kind::f32, 2, true);
    NUMA_MOE_CHECK(out.shape(0) == rows && out.shape(1) == cols, "out: shape ", shape_text(out), ", expected (", rows,
                   ", ", cols, ")");
    auto* o = static_cast<float*>(out.mutable_data());
    NoGil released;
    formats::dequantize_ggml_k_blocks(type, in, rows, cols, o, cols);
}

// The int8 / int4 groups a rows x cols matrix converts into: format, group and scale dtype
// by name, and the caller's values and scales rows (which keep the arrays alive), checked.
formats::GroupTarget group_target(const std::string& format_name, int64_t group, const std::string& scale_dtype,
                                  const py::object& values_obj, const py::object& scales_obj, int64_t rows,
                                  int64_t cols) {
    NUMA_MOE_CHECK(format_name == "int8" || format_name == "int4", "format '", format_name,
                   "' is not one of int8, int4");
    const auto ints = format_name == "int8" ? formats::GroupInts::int8 : formats::GroupInts::int4;
    NUMA_MOE_CHECK(scale_dtype == "fp16" || scale_dtype == "bf16" || scale_dtype == "fp32", "scale dtype '",
                   scale_dtype, "' is not one of fp16, bf16, fp32");
    const auto scale_type = scale_dtype == "fp16"   ? formats::GroupScales::fp16
                            : scale_dtype == "bf16" ? formats::GroupScales::bf16
                                                    : formats::GroupScales::fp32;
    NUMA_MOE_CHECK(group == 32 || group == 64 || group == 128, "group ", group, " is not one of 32, 64, 128");
    NUMA_MOE_CHECK(rows > 0 && cols > 0 && cols % group == 0, "a ", rows, " x ", cols,
                   " matrix: rows must be positive and cols a positive multiple of the group ", group);
    py::array values = byte_rows(values_obj, "values", rows, ints == formats::GroupInts::int8 ? cols : cols / 2, 1);
    py::array scales = byte_rows(scales_obj, "scales", rows, cols / group, formats::group_scale_bytes(scale_type));
    return formats::GroupTarget{ints,
                                group,
                                scale_type,
                                static_cast<uint8_t*>(values.mutable_data()),
                                values.strides(0),
                                static_cast<uint8_t*>(scales.mutable_data()),
                                scales.strides(0)};
}

void py_quantize_groups(const py::object& w_obj, const std::string& format_name, int64_t group,
                        const std::string& scale_dtype, const py::object& values_obj, const py::object& scales_obj) {
    py::array w = checked_array(w_obj, "w", Kind::f32, 2);
    const int64_t rows = w.shape(0), cols = w.shape(1);
    const formats::GroupTarget to = group_target(format_name, group, scale_dtype, values_obj, scales_obj, rows, cols);
    const auto* x = static_cast<const float*>(w.data());
    NoGil released;
    formats::quantize_groups(x, cols, rows, cols, to);
}

void py_requantize_ggml_k_blocks(const std::string& type_name, const py::object& raw_obj, int64_t rows, int64_t cols,
                                 const std::string& format_name, int64_t group, const std::string& scale_dtype,
                                 const py::object& values_obj, const py::object& scales_obj) {
    const formats::GgmlKQuant type = k_quant_named(type_name);
    const uint8_t* in = checked_blocks(type_name, raw_obj, rows, cols, formats::kGgmlSuperBlock,
                                       formats::ggml_k_block_bytes(type));
    const formats::GroupTarget to = group_target(format_name, group, scale_dtype, values_obj, scales_obj, rows, cols);
    NoGil released;
    formats::requantize_ggml_k_blocks(type, in, rows, cols, to);
}

// FP8 e4m3 bytes w [rows, cols] and their fp32 block scales, checked.
struct Fp8Matrix {
    const uint8_t* bytes;
    int64_t rows, cols;
    const float* scales;
};

Fp8Matrix checked_fp8(const py::array& w, const py::array& scales, int64_t block_rows, int64_t block_cols) {
    NUMA_MOE_CHECK(w.itemsize() == 1, "w: expected e4m3 bytes (1-byte elements), got ", w.itemsize(),
                   "-byte elements");
    const int64_t rows = w.shape(0), cols = w.shape(1);
    NUMA_MOE_CHECK(rows > 0 && cols > 0, "w: shape ", shape_text(w), " holds no weights");
    NUMA_MOE_CHECK(block_rows > 0 && block_cols > 0, "block ", block_rows, " x ", block_cols,
                   ": both sides must be positive");
    const int64_t scale_rows = (rows + block_rows - 1) / block_rows, scale_cols = (cols + block_cols - 1) / block_cols;
    NUMA_MOE_CHECK(scales.shape(0) == scale_rows && scales.shape(1) == scale_cols, "scales: shape ",
                   shape_text(scales), ", expected (", scale_rows, ", ", scale_cols, ") for a ", rows, " x ", cols,
                   " matrix in blocks of ", block_rows, " x ", block_cols);
    return Fp8Matrix{static_cast<const uint8_t*>(w.data()), rows, cols, static_cast<const float*>(scales.data())};
}

void py_dequantize_fp8_blocks(const py::object& w_obj, const py::object& scales_obj, int64_t block_rows,
                              int64_t block_cols, const py::object& out_obj) {
    py::array w = checked_layout(w_obj, "w", 2);
    py::array scales = checked_array(scales_obj, "scales", Kind::f32, 2);
    const Fp8Matrix in = checked_fp8(w, scales, block_rows, block_cols);
    NUMA_MOE_CHECK(py::isinstance<py::array>(out_obj), "out: expected a numpy array");
    const bool bf16 = py::reinterpret_borrow<py::array>(out_obj).itemsize() == 2;
    py::array out = byte_rows(out_obj, "out", in.rows, in.cols, bf16 ? 2 : 4);
    NUMA_MOE_CHECK(has_kind(out, bf16 ? Kind::bf16 : Kind::f32), "out: expected float32 or bfloat16 elements");
    const int64_t out_ld = out.strides(0) / out.itemsize();
    NUMA_MOE_CHECK(out.strides(0) % out.itemsize() == 0, "out: rows must be whole elements apart");
    void* dst = out.mutable_data();
    NoGil released;
    if (bf16)
        formats::dequantize_fp8_blocks_bf16(in.bytes, in.rows, in.cols, in.scales, block_rows, block_cols,
                                            static_cast<uint16_t*>(dst), out_ld);
    else
        formats::dequantize_fp8_blocks(in.bytes, in.rows, in.cols, in.scales, block_rows, block_cols,
                                       static_cast<float*>(dst), out_ld);
}

void py_requantize_fp8_blocks(const py::object& w_obj, const py::object& scales_obj, int64_t block_rows,
                              int64_t block_cols, const std::string& format_name, int64_t group,
                              const std::string& scale_dtype, const py::object& values_obj,
                              const py::object& out_scales_obj) {
    py::array w = checked_layout(w_obj, "w", 2);
    py::array scales = checked_array(scales_obj, "scales", Kind::f32, 2);
    const Fp8Matrix in = checked_fp8(w, scales, block_rows, block_cols);
    const formats::GroupTarget to =
        group_target(format_name, group, scale_dtype, values_obj, out_scales_obj, in.rows, in.cols);
    NoGil released;
    formats::requantize_fp8_blocks(in.bytes, in.rows, in.cols, in.scales, block_rows, block_cols, to);
}

}  // namespace

void register_formats(py::module_& m) {
    m.def("convert_ggml_blocks", &py_convert_ggml_blocks, py::arg("type"), py::arg("raw"), py::arg("rows"),
          py::arg("cols"), py::arg("values"), py::arg("scales"),
          "A rows x cols matrix of llama.cpp Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4 / IQ4_XS / Q4_1 / Q4_K blocks "
          "(raw: its bytes) into the store's layout: values int8 [rows, cols] (Q8_0, Q5_0) or two codes a byte "
          "[rows, cols / 2], scales fp16 (MXFP4: e8m0; IQ4_XS: fp32) [rows, cols / 32] (Q4_1 fp16, Q4_K fp32: "
          "[rows, 2 cols / 32], the scales then the minimums); rows contiguous. Without loss; a zero fp16 scale "
          "of Q8_0 / Q5_0 / Q4_0 becomes zeros under +-1. ValueError naming the row and block of a NaN or "
          "infinite scale (or minimum), an e8m0 0xFF or a Q8_0 q = -128.");
    m.def("dequantize_ggml_k_blocks", &py_dequantize_ggml_k_blocks, py::arg("type"), py::arg("raw"), py::arg("rows"),
          py::arg("cols"), py::arg("out"),
          "A rows x cols matrix of llama.cpp Q2_K / Q3_K / Q4_K / Q5_K / Q6_K blocks (raw: its bytes) as float32 "
          "into out [rows, cols] (C-contiguous): the gguf package's dequantization, bit for bit. ValueError "
          "naming the row and block of a NaN or infinite d or dmin.");
    m.def("dequantize_fp8_blocks", &py_dequantize_fp8_blocks, py::arg("w"), py::arg("scales"), py::arg("block_rows"),
          py::arg("block_cols"), py::arg("out"),
          "FP8 e4m3fn weights w [rows, cols] (bytes, C-contiguous) times their fp32 block scales [ceil(rows / "
          "block_rows), ceil(cols / block_cols)] into out [rows, cols] (rows contiguous): float32, or bfloat16 "
          "rounded to nearest even; torch's w.to(float32) * scale, bit for bit. ValueError naming the row and "
          "column of a NaN weight.");
    m.def("quantize_groups", &py_quantize_groups, py::arg("w"), py::arg("format"), py::arg("group"),
          py::arg("scale_dtype"), py::arg("values"), py::arg("scales"),
          "float32 w [rows, cols] (C-contiguous) into int8 values [rows, cols] or int4 two a byte [rows, cols / 2] "
          "and scales [rows, cols / group] (fp16 / bf16 bits or fp32), rows contiguous: "
          "numa_moe.quant.quantize's rule. ValueError naming the row and column of a NaN or infinite weight, or "
          "the group whose scale is beyond its dtype's range.");
    m.def("requantize_ggml_k_blocks", &py_requantize_ggml_k_blocks, py::arg("type"), py::arg("raw"), py::arg("rows"),
          py::arg("cols"), py::arg("format"), py::arg("group"), py::arg("scale_dtype"), py::arg("values"),
          py::arg("scales"),
          "dequantize_ggml_k_blocks then quantize_groups in one pass a row at a time (the same bytes, no float32 "
          "copy of the matrix): Q2_K / Q3_K / Q4_K / Q5_K / Q6_K blocks into int8 / int4 values and scales as "
          "quantize_groups writes them. ValueError as either raises.");
    m.def("requantize_fp8_blocks", &py_requantize_fp8_blocks, py::arg("w"), py::arg("scales"), py::arg("block_rows"),
          py::arg("block_cols"), py::arg("format"), py::arg("group"), py::arg("scale_dtype"), py::arg("values"),
          py::arg("out_scales"),
          "dequantize_fp8_blocks (float32) then quantize_groups in one pass a row at a time (the same bytes, no "
          "float32 copy of the matrix) into int8 / int4 values and out_scales. ValueError as either raises.");
}

}  // namespace numa_moe::bindings
