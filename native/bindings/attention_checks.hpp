// The checks of the decode attention bindings, on top of the checking layer (checks.hpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/checks.hpp"
#include "kernels/attention_api.hpp"

namespace numa_moe::engine {
struct DecodeAttentionArgs;
}

namespace numa_moe::bindings {

// The checked operands of one gqa_decode call: q [B, Hq, D] bf16; k_cache, v_cache
// [B, Hkv, T, D] (block_table None) or paged [n_blocks, Hkv, block_size, D] with
// block_table int64 [B, max_blocks] (every block a sequence's length reaches in
// [0, n_blocks)); Hq a multiple of Hkv, D in {64, 128, 256}; lengths int64 [B] within the
// cache; window >= 0; scale finite; out bf16 or float32 [B, Hq, D]. All C-contiguous.
// row_nodes not set.
engine::DecodeAttentionArgs attention_args(const py::array& q, const py::array& k_cache, const py::array& v_cache,
                                           const py::array& lengths, const py::object& block_table,
                                           py::array& out, int64_t window, double scale);
// The rows of the cache operand (the matrix the segment tables describe): rows x D.
int64_t attention_cache_rows(const py::array& k_cache);
// The attention ISA of a name; unknown names and ISAs without attention kernels refused.
const kernels::AttentionOps& attention_ops_for(const std::string& isa);

}  // namespace numa_moe::bindings
