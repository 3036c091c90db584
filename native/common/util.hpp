// Small utilities shared by every layer: a monotonic clock, 64-byte aligned buffers, and
// the one work-splitting rule (ranges of about equal cost). Baseline x86-64 code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace numa_moe {

// CLOCK_MONOTONIC in nanoseconds.
int64_t now_ns();

inline size_t round_up(size_t value, size_t align) { return (value + align - 1) / align * align; }

// Bytes between the rows of a scratch matrix whose rows hold `row_bytes`: whole cache lines
// and, where that is a multiple of 1 KiB, one line more. A stride of a multiple of 4 KiB
// (any hidden size of 1024 fp32 columns) puts the same column of every row in one L1 set,
// and code that reads or writes 16 rows at a time (a 16 x 16 transpose) then evicts its own
// lines; with the extra line 16 rows fall in 16 sets.
inline size_t spread_row_bytes(size_t row_bytes) {
    const size_t lines = round_up(row_bytes, 64);
    return lines % 1024 == 0 ? lines + 64 : lines;
}

struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<void, FreeDeleter>;

// 64-byte aligned memory of at least `bytes` (and at least one cache line); throws
// std::bad_alloc.
AlignedBuffer aligned_buffer(size_t bytes);

// Grows `buffer` to hold `bytes` (contents not kept); `capacity` tracks its size.
void grow(AlignedBuffer& buffer, size_t& capacity, size_t bytes);

// Per-thread scratch memory for kernels (ISA translation units must not instantiate
// containers of their own: their weak symbols could be merged with baseline code).
// Returns slot `slot`'s 64-byte aligned buffer of at least `bytes`, valid until this thread
// asks for the same slot again; contents are not kept. slot < kScratchSlots.
constexpr int kScratchSlots = 4;
void* thread_scratch(int slot, size_t bytes);

struct Range {
    int64_t begin = 0;
    int64_t end = 0;
    bool empty() const { return end <= begin; }
    bool operator==(const Range& other) const { return begin == other.begin && end == other.end; }
};

// Splits [0, cost.size()) into n consecutive ranges of about equal total cost (cost[i] per
// item, e.g. weight bytes per row), every boundary a multiple of `align` except the end.
// Ranges may be empty. When the total cost is zero, range 0 takes every item (its owner
// still has to zero them) and the others are empty. Pure.
std::vector<Range> split_by_cost(const std::vector<int64_t>& cost, int n, int64_t align);

// The same rule for `items` items of equal cost.
std::vector<Range> split_even(int64_t items, int n, int64_t align);

}  // namespace numa_moe
