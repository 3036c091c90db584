// One strided segment of a weight matrix, in elements: rows row0, row0 + row_stride, ...
// (nrows of them), columns [k0, k1). A node's share of a matrix is a list of these
// (see numa_moe/segments.py, which computes them); the Python side hands them over as
// an int64 array of shape [n, 5] with the fields in this order.
#pragma once

#include <cstdint>

namespace numa_moe {

struct Segment {
    int64_t row0;
    int64_t row_stride;
    int64_t nrows;
    int64_t k0;
    int64_t k1;
};
static_assert(sizeof(Segment) == 5 * sizeof(int64_t), "Segment must match the [n, 5] int64 array");

}  // namespace numa_moe
