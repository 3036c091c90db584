// Python API of the weight-format conversions (numa_moe._native): checked here, run
// without the GIL (the loader converts one matrix a thread).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/checks.hpp"
#include "bindings/gil.hpp"
#include "common/check.hpp"
#include "formats/ggml_blocks.hpp"

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
    NUMA_MOE_CHECK(false, "ggml type '", name, "' is not one of Q8_0, Q4_0, IQ4_NL, MXFP4, IQ4_XS, Q5_0");
    return GgmlBlocks::q8_0;
}

void py_convert_ggml_blocks(const std::string& type_name, const py::object& raw_obj, int64_t rows, int64_t cols,
                            const py::object& values_obj, const py::object& scales_obj) {
    const GgmlBlocks type = ggml_blocks_named(type_name);
    const int64_t block = formats::ggml_block_weights(type);
    NUMA_MOE_CHECK(rows > 0 && cols > 0 && cols % block == 0, type_name, ": a ", rows, " x ", cols,
                   " matrix: rows must be positive and cols a positive multiple of ", block);
    py::array raw = checked_layout(raw_obj, "raw", 1);
    NUMA_MOE_CHECK(raw.itemsize() == 1, "raw: expected bytes (uint8), got ", raw.itemsize(), "-byte elements");
    const int64_t expected = rows * (cols / block) * formats::ggml_block_bytes(type);
    NUMA_MOE_CHECK(raw.size() == expected, type_name, ": ", raw.size(), " bytes for a ", rows, " x ", cols,
                   " matrix, expected ", expected);
    const bool bytes_a_weight = type == GgmlBlocks::q8_0 || type == GgmlBlocks::q5_0;
    py::array values = byte_rows(values_obj, "values", rows, bytes_a_weight ? cols : cols / 2, 1);
    py::array scales = byte_rows(scales_obj, "scales", rows, cols / 32, formats::ggml_scale_bytes(type));
    const auto* in = static_cast<const uint8_t*>(raw.data());
    auto* v = static_cast<uint8_t*>(values.mutable_data());
    auto* s = static_cast<uint8_t*>(scales.mutable_data());
    const int64_t values_ld = values.strides(0), scales_ld = scales.strides(0);
    NoGil released;
    formats::convert_ggml_blocks(type, in, rows, cols, v, values_ld, s, scales_ld);
}

}  // namespace

void register_formats(py::module_& m) {
    m.def("convert_ggml_blocks", &py_convert_ggml_blocks, py::arg("type"), py::arg("raw"), py::arg("rows"),
          py::arg("cols"), py::arg("values"), py::arg("scales"),
          "A rows x cols matrix of llama.cpp Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4 / IQ4_XS blocks (raw: its "
          "bytes) into the store's layout: values int8 [rows, cols] (Q8_0, Q5_0) or two codes a byte [rows, "
          "cols / 2], scales fp16 (MXFP4: e8m0; IQ4_XS: fp32) [rows, cols / 32]; rows contiguous. Without "
          "loss; a zero fp16 scale of Q8_0 / Q5_0 / Q4_0 "
          "becomes zeros under +-1. ValueError naming the row and block of a NaN or infinite scale, an e8m0 "
          "0xFF or a Q8_0 q = -128.");
}

}  // namespace numa_moe::bindings
