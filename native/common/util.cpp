#include "common/util.hpp"

#include <algorithm>
#include <ctime>
#include <new>
#include <stdexcept>

namespace numa_moe {

int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

AlignedBuffer aligned_buffer(size_t bytes) {
    void* memory = std::aligned_alloc(64, std::max<size_t>(round_up(bytes, 64), 64));
    if (!memory) throw std::bad_alloc();
    return AlignedBuffer(memory);
}

void grow(AlignedBuffer& buffer, size_t& capacity, size_t bytes) {
    if (buffer && bytes <= capacity) return;
    buffer.reset();  // release first: the old contents are not needed
    buffer = aligned_buffer(bytes);
    capacity = std::max<size_t>(round_up(bytes, 64), 64);
}

void* thread_scratch(int slot, size_t bytes) {
    struct Scratch {
        AlignedBuffer buffer;
        size_t capacity = 0;
    };
    thread_local Scratch scratch[kScratchSlots];
    if (slot < 0 || slot >= kScratchSlots) throw std::logic_error("thread_scratch: no such slot");
    grow(scratch[slot].buffer, scratch[slot].capacity, bytes);
    return scratch[slot].buffer.get();
}

namespace {

// Boundary after item `index` rounded to the nearest multiple of align, kept in
// [begin, items].
int64_t aligned_boundary(int64_t index, int64_t align, int64_t begin, int64_t items) {
    return std::max(begin, std::min(items, (index + align / 2) / align * align));
}

}  // namespace

std::vector<Range> split_by_cost(const std::vector<int64_t>& cost, int n, int64_t align) {
    const int64_t items = static_cast<int64_t>(cost.size());
    std::vector<Range> ranges(std::max(n, 1));
    int64_t total = 0;
    for (int64_t c : cost) total += c;
    if (total == 0) {
        ranges[0] = Range{0, items};
        for (size_t i = 1; i < ranges.size(); ++i) ranges[i] = Range{items, items};
        return ranges;
    }
    int64_t begin = 0, prefix = 0, item = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
        int64_t end = items;
        if (i + 1 < ranges.size()) {
            const int64_t target = total * static_cast<int64_t>(i + 1) / static_cast<int64_t>(ranges.size());
            while (item < items && prefix + cost[item] <= target) prefix += cost[item++];
            end = aligned_boundary(item, align, begin, items);
        }
        ranges[i] = Range{begin, end};
        begin = end;
    }
    return ranges;
}

std::vector<Range> split_even(int64_t items, int n, int64_t align) {
    // split_by_cost with unit costs, without materialising them: the walk stops at the
    // target itself.
    std::vector<Range> ranges(std::max(n, 1));
    int64_t begin = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
        int64_t end = items;
        if (i + 1 < ranges.size())
            end = aligned_boundary(items * static_cast<int64_t>(i + 1) / static_cast<int64_t>(ranges.size()), align,
                                   begin, items);
        ranges[i] = Range{begin, end};
        begin = end;
    }
    if (items == 0) ranges[0] = Range{0, 0};
    return ranges;
}

}  // namespace numa_moe
