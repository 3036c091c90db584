// Software prefetch of weight rows in address order, shared by the SIMD kernels of every
// ISA (prefetch is an SSE instruction: this header needs no ISA flags). Internal linkage,
// like the other kernel helpers, so each translation unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace numa_moe::kernels {
namespace {

// The lines of a later row block of weights in address order: row by row, bytes
// [begin, end) of each (a segment's columns), one request per call, kBytes on (32-byte
// steps ask for each line twice). Past the segment's last row it requests lines no one
// reads: prefetch never faults. The kernels read 8-32 rows side by side, which the
// hardware prefetchers do not follow well (docs/kernels.md, "Prefetch in address order").
struct LinePrefetcher {
    const uint8_t* row;
    int64_t at, begin, end, step;
    LinePrefetcher(const uint8_t* first_row, int64_t begin_, int64_t end_, int64_t step_)
        : row(first_row), at(begin_), begin(begin_), end(end_), step(step_) {}
    template <int64_t kBytes = 64>
    void next() {
        _mm_prefetch(reinterpret_cast<const char*>(row + at), _MM_HINT_T2);
        at += kBytes;
        if (at >= end) {
            at = begin;
            row += step;
        }
    }
};

}  // namespace
}  // namespace numa_moe::kernels
