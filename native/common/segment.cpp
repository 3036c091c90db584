#include "common/segment.hpp"

#include <algorithm>
#include <stdexcept>
#include <tuple>

#include "common/check.hpp"

namespace numa_moe {

std::string segment_text(const Segment& s) {
    return message("(row0=", s.row0, ", row_stride=", s.row_stride, ", nrows=", s.nrows, ", k0=", s.k0, ", k1=", s.k1, ")");
}

namespace {

// Why the segment is invalid, or "" when it is valid.
std::string segment_fault(const Segment& s, int64_t rows, int64_t cols) {
    if (s.nrows < 0) return "negative nrows";
    if (s.row_stride < 1) return "row_stride must be >= 1";
    // last row = row0 + (nrows - 1) * row_stride < rows, written so that it cannot overflow
    if (s.nrows > 0 && (s.row0 < 0 || s.row0 >= rows || s.nrows - 1 > (rows - 1 - s.row0) / s.row_stride))
        return message("rows outside [0, ", rows, ")");
    if (s.k0 < 0 || s.k1 < s.k0 || s.k1 > cols) return message("columns outside 0 <= k0 <= k1 <= ", cols);
    return "";
}

}  // namespace

void check_segments(const Segment* segments, int64_t n_segments, int64_t rows, int64_t cols, const std::string& what) {
    for (int64_t i = 0; i < n_segments; ++i) {
        const std::string fault = segment_fault(segments[i], rows, cols);
        NUMA_MOE_CHECK(fault.empty(), what, "[", i, "] = ", segment_text(segments[i]), " lies outside the ", rows, " x ",
                       cols, " matrix: ", fault);
    }
}

void segment_row_range(const Segment& seg, int64_t row_begin, int64_t row_end, int64_t* j_lo, int64_t* j_hi) {
    *j_lo = *j_hi = 0;
    if (seg.nrows <= 0 || row_end <= row_begin) return;
    const int64_t stride = seg.row_stride > 0 ? seg.row_stride : 1;
    int64_t lo = 0, hi = seg.nrows;
    if (seg.row0 < row_begin) lo = (row_begin - seg.row0 + stride - 1) / stride;
    if (seg.row0 + (hi - 1) * stride >= row_end) hi = row_end <= seg.row0 ? 0 : (row_end - seg.row0 + stride - 1) / stride;
    *j_lo = lo;
    *j_hi = hi > lo ? hi : lo;
}

void check_block_edges(const Segment* segments, int64_t n_segments, int64_t cols, int64_t block,
                       const std::string& what) {
    for (int64_t i = 0; i < n_segments; ++i) {
        const Segment& s = segments[i];
        NUMA_MOE_CHECK(s.k0 % block == 0 && (s.k1 % block == 0 || s.k1 == cols), what, "[", i, "] = ", segment_text(s),
                       " cuts a ", block, "-column block of integer weights (k0 and k1 must be multiples of ", block, ")");
    }
}

void check_partition(const std::vector<std::vector<Segment>>& node_segments, int64_t rows, int64_t cols,
                     const std::string& what) {
    // (row, k0, k1, node) of every covered piece, sorted: a partition has, per row,
    // pieces starting at 0, each starting where the previous ended, the last ending at cols.
    std::vector<std::tuple<int64_t, int64_t, int64_t, int>> pieces;
    for (size_t n = 0; n < node_segments.size(); ++n)
        for (const Segment& s : node_segments[n])
            for (int64_t j = 0; j < s.nrows; ++j)
                pieces.emplace_back(s.row0 + j * s.row_stride, s.k0, s.k1, static_cast<int>(n));
    std::sort(pieces.begin(), pieces.end());
    const std::string prefix = what + ": the segments do not partition the matrix: row ";
    size_t i = 0;
    for (int64_t row = 0; row < rows; ++row) {
        int64_t covered = 0;
        for (; i < pieces.size() && std::get<0>(pieces[i]) == row; ++i) {
            const auto& [r, k0, k1, node] = pieces[i];
            (void)r;
            NUMA_MOE_CHECK(k0 == covered, prefix, row, " columns [", std::min(k0, covered), ", ", std::max(k0, covered),
                           ") are ", k0 < covered ? message("covered twice (again by node ", node, ")") : "not covered");
            covered = k1;
        }
        NUMA_MOE_CHECK(covered == cols, prefix, row, " columns [", covered, ", ", cols, ") are not covered");
    }
}

}  // namespace numa_moe

namespace numa_moe {

RowNodes row_nodes(const std::vector<std::vector<Segment>>& node_segments, int64_t rows, int64_t cols,
                   const std::string& what) {
    RowNodes result;
    result.period = rows;
    for (size_t n = 0; n < node_segments.size(); ++n) {
        const std::string name = message(what, " of node ", n);
        check_segments(node_segments[n].data(), static_cast<int64_t>(node_segments[n].size()), rows, cols, name);
        for (size_t i = 0; i < node_segments[n].size(); ++i) {
            const Segment& s = node_segments[n][i];
            const std::string at = message(name, "[", i, "] = ", segment_text(s));
            NUMA_MOE_CHECK(s.nrows <= 0 || (s.k0 == 0 && s.k1 == cols), at,
                           " covers part of a row: every cache row (one position of one head) must lie whole on one "
                           "node (columns [0, ", cols, "))");
            if (s.nrows > 1 && result.period == rows) result.period = s.row_stride;
            NUMA_MOE_CHECK(s.nrows <= 1 || s.row_stride == result.period, at, " repeats every ", s.row_stride,
                           " rows, another segment every ", result.period, ": not one periodic table");
        }
    }
    const int64_t period = result.period;
    result.node_of_class.assign(static_cast<size_t>(period), -1);
    for (size_t n = 0; n < node_segments.size(); ++n) {
        for (size_t i = 0; i < node_segments[n].size(); ++i) {
            const Segment& s = node_segments[n][i];
            if (s.nrows == 0) continue;
            const std::string at = message(what, " of node ", n, "[", i, "] = ", segment_text(s));
            const int64_t class_rows = (rows - s.row0 + period - 1) / period;
            NUMA_MOE_CHECK(s.row0 < period && s.nrows == class_rows, at,
                           " does not cover every row of its class modulo the period ", period);
            NUMA_MOE_CHECK(result.node_of_class[s.row0] < 0, at, ": row ", s.row0, " is covered twice (also by node ",
                           result.node_of_class[s.row0], ")");
            result.node_of_class[s.row0] = static_cast<int>(n);
        }
    }
    for (int64_t c = 0; c < period; ++c)
        NUMA_MOE_CHECK(result.node_of_class[c] >= 0, what, ": row ", c, " is not covered by any node");
    result.run.assign(static_cast<size_t>(period), 1);
    for (int64_t c = period - 2; c >= 0; --c)
        if (result.node_of_class[c] == result.node_of_class[c + 1]) result.run[c] = result.run[c + 1] + 1;
    return result;
}

}  // namespace numa_moe
