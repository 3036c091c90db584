// How fast a core reads weight rows from memory in the integer kernels' access pattern,
// with no kernel around it (docs/kernels.md, "Prefetch in address order"): R rows side
// by side, 64 bytes of each in turn (one vpdpbusd per load, as the kernels' cheapest
// path), with no software prefetch, with each load requesting its own row's line two row
// blocks on (the kernels' earlier prefetch), or with the loads requesting the row block
// after next line by line in address order (LinePrefetcher's), against one sequential
// stream. Not part of the library.
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vnni -pthread
//       benchmarks/row_stream_read.cpp -o /tmp/row_stream_read   (one command line)
//   /tmp/row_stream_read ROW_BYTES THREADS     (e.g. 2048 2: 160 MB of 2 KB rows, 2 cores)
//
// Prints per pattern the best and the median GB/s of 9 passes over the buffer, each
// thread on its own CPU and its own rows.
#include <immintrin.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

enum class Prefetch { none, own_row, address_order };

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

inline void dpbusd(__m512i& acc, __m512i u, __m512i s) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s)); }

// Rows [r0, r1) of row_bytes each, R at a time side by side (R = 1: one stream).
template <int R, Prefetch P>
__attribute__((noinline)) int read_rows(const uint8_t* base, int64_t row_bytes, int64_t r0, int64_t r1) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const __m512i x = _mm512_set1_epi8(3), bias = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t ahead = 2 * R * row_bytes;  // the row block after next
    for (int64_t j = r0; j < r1; j += R) {
        const uint8_t* block = base + j * row_bytes;
        for (int64_t c = 0; c < row_bytes; c += 64) {
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const uint8_t* p = block + r * row_bytes + c;
                if (P == Prefetch::own_row) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T2);
                if (P == Prefetch::address_order)
                    _mm_prefetch(reinterpret_cast<const char*>(block + ahead + (c / 64 * R + r) * 64), _MM_HINT_T2);
                dpbusd(acc[r], _mm512_xor_si512(_mm512_loadu_si512(p), bias), x);
            }
        }
    }
    alignas(64) int32_t lanes[16];
    _mm512_store_si512(lanes, acc[0]);
    for (int r = 1; r < R; ++r) _mm512_store_si512(lanes, _mm512_add_epi32(_mm512_load_si512(lanes), acc[r]));
    int total = 0;
    for (int32_t v : lanes) total += v;
    return total;
}

using ReadRows = int (*)(const uint8_t*, int64_t, int64_t, int64_t);

}  // namespace

int main(int argc, char** argv) {
    const int64_t row_bytes = argc == 3 ? std::atoll(argv[1]) : 0;
    const int threads = argc == 3 ? std::atoi(argv[2]) : 0;
    if (row_bytes < 64 || row_bytes % 64 != 0 || threads < 1) {
        std::fprintf(stderr, "usage: %s ROW_BYTES THREADS   (ROW_BYTES a multiple of 64)\n", argv[0]);
        return 2;
    }
    const int64_t rows = (int64_t{160} << 20) / row_bytes / 64 * 64;
    const size_t bytes = static_cast<size_t>(rows * row_bytes);
    auto* buffer = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, bytes));
    madvise(buffer, bytes, MADV_HUGEPAGE);
    std::memset(buffer, 1, bytes);
    const struct {
        const char* name;
        ReadRows read;
    } patterns[] = {
        {"one stream", read_rows<1, Prefetch::none>},
        {"8 rows, no prefetch", read_rows<8, Prefetch::none>},
        {"8 rows, own-row prefetch", read_rows<8, Prefetch::own_row>},
        {"8 rows, address-order prefetch", read_rows<8, Prefetch::address_order>},
        {"16 rows, no prefetch", read_rows<16, Prefetch::none>},
        {"16 rows, own-row prefetch", read_rows<16, Prefetch::own_row>},
        {"16 rows, address-order prefetch", read_rows<16, Prefetch::address_order>},
    };
    volatile int sink = 0;
    std::printf("%ld rows of %ld bytes, %d threads\n", static_cast<long>(rows), static_cast<long>(row_bytes), threads);
    for (const auto& pattern : patterns) {
        std::vector<double> seconds;
        for (int pass = 0; pass < 9; ++pass) {
            std::vector<std::thread> team;
            const double start = now();
            for (int t = 0; t < threads; ++t)
                team.emplace_back([&, t] {
                    cpu_set_t cpus;
                    CPU_ZERO(&cpus);
                    CPU_SET(t, &cpus);
                    pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
                    const int64_t r0 = rows * t / threads / 64 * 64, r1 = rows * (t + 1) / threads / 64 * 64;
                    sink = sink + pattern.read(buffer, row_bytes, r0, r1);
                });
            for (std::thread& member : team) member.join();
            seconds.push_back(now() - start);
        }
        std::sort(seconds.begin(), seconds.end());
        std::printf("  %-34s best %5.1f GB/s  median %5.1f GB/s\n", pattern.name, bytes / seconds.front() / 1e9,
                    bytes / seconds[seconds.size() / 2] / 1e9);
    }
    std::free(buffer);
    return 0;
}
