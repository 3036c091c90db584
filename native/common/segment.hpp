// One strided segment of a weight matrix, in elements: rows row0, row0 + row_stride, ...
// (nrows of them), columns [k0, k1). A node's share of a matrix is a list of these
// (numa_moe/segments.py computes them); Python hands them over as an int64 array of shape
// [n, 5] with the fields in this order.
//
// The rules of a valid segment list live here and only here: every binding, the layer
// and the single-expert path check segments with these two functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace numa_moe {

struct Segment {
    int64_t row0;
    int64_t row_stride;
    int64_t nrows;
    int64_t k0;
    int64_t k1;
};
static_assert(sizeof(Segment) == 5 * sizeof(int64_t), "Segment must match the [n, 5] int64 array");

// "(row0=…, row_stride=…, nrows=…, k0=…, k1=…)", for error messages.
std::string segment_text(const Segment& s);

// The j range [*j_lo, *j_hi) of the segment's rows r = row0 + j * row_stride that lie in
// [row_begin, row_end) (empty when none do). Pure; the kernels' one row-range rule.
void segment_row_range(const Segment& seg, int64_t row_begin, int64_t row_end, int64_t* j_lo, int64_t* j_hi);

// Calls fn(seg, j_lo, j_hi, stride) for every segment with rows in [row_begin, row_end)
// (segment_row_range) and a non-empty column range; stride = its row stride, at least 1.
// The loop of every kernel's matmul_segments.
template <class Fn>
void for_each_segment_rows(const Segment* segments, int64_t n_segments, int64_t row_begin, int64_t row_end, Fn&& fn) {
    for (int64_t s = 0; s < n_segments; ++s) {
        const Segment& seg = segments[s];
        int64_t j_lo, j_hi;
        segment_row_range(seg, row_begin, row_end, &j_lo, &j_hi);
        if (j_lo >= j_hi || seg.k1 <= seg.k0) continue;
        fn(seg, j_lo, j_hi, seg.row_stride > 0 ? seg.row_stride : 1);
    }
}

// Throws std::invalid_argument unless every segment lies inside a rows x cols matrix:
// row_stride >= 1, nrows >= 0, all its rows in [0, rows), 0 <= k0 <= k1 <= cols. `what`
// names the list in the message ("gate segments of node 1").
void check_segments(const Segment* segments, int64_t n_segments, int64_t rows, int64_t cols, const std::string& what);

// Throws std::invalid_argument unless every segment starts and ends on a multiple of
// `block` columns (or at cols): integer weights are multiplied block by block.
void check_block_edges(const Segment* segments, int64_t n_segments, int64_t cols, int64_t block,
                       const std::string& what);

// Throws std::invalid_argument unless the segments of all nodes together cover every
// element of the rows x cols matrix exactly once (no gap, no overlap).
void check_partition(const std::vector<std::vector<Segment>>& node_segments, int64_t rows, int64_t cols,
                     const std::string& what);

}  // namespace numa_moe

namespace numa_moe {

// Which node holds each row of a matrix whose rows each lie on one node (a KV cache of
// d-element rows in interleaved pages), from per-node segment lists in the canonical
// periodic form of numa_moe.segments: row r lies on node_of_class[r % period]. run[c] is
// the number of consecutive classes c, c + 1, ... < period on the same node.
struct RowNodes {
    int64_t period = 0;
    std::vector<int> node_of_class;
    std::vector<int64_t> run;
};

// Throws std::invalid_argument (naming `what`) unless every segment lies in the matrix,
// covers whole rows (k0 = 0, k1 = cols), all repeating segments share one row stride (the
// period; a table without repeats lists rows one by one), each segment covers every row of
// its class, and every class is covered exactly once.
RowNodes row_nodes(const std::vector<std::vector<Segment>>& node_segments, int64_t rows, int64_t cols,
                   const std::string& what);

}  // namespace numa_moe
