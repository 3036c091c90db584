// One thread, an integer kernel (gather, then matmul_segments over one segment of all
// rows), back to back: the kernel's own rate without Python, the worker threads or cache
// eviction (docs/kernels.md, AVX-512-VNNI, "Row lanes"; AMX-INT8). Not part of the
// library: it includes a kernel translation unit whole, so that two builds of the kernel
// can be compared by pointing KERNEL at a copy of the previous file.
//
//   g++ -O3 -DNDEBUG -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma -mavx512vnni
//       -ffp-contract=off -falign-functions=64 -falign-loops=64 -Inative
//       -DKERNEL='"kernels/avx512_quant.cpp"'
//       benchmarks/quant_kernel_loop.cpp native/common/util.cpp native/common/segment.cpp
//       native/common/cpu_features.cpp native/kernels/names.cpp -o /tmp/quant_loop
//   (one command line; the alignment flags keep code placement from deciding a comparison:
//   docs/kernels.md, "Measuring kernel loops"). The AMX-INT8 kernel: add -mamx-tile -mamx-int8
//   -DKERNEL='"kernels/amx_quant.cpp"' -DOPS=amx_integer_ops. Against the kernel of an
//   earlier commit REV: git show REV:native/kernels/avx512_quant.cpp > /tmp/prev.cpp, then
//   -DKERNEL='"/tmp/prev.cpp"'; run the two alternately, several times (the machines are
//   shared).
//   /tmp/quant_loop FORMAT[/G] ROWS K M[,M...] [CALLS [CHUNK_ROWS]]   (an integer format:
//       int8, int4, mxfp4, iq4nl, int4-affine; group G 32, 64 or 128, default 128, the
//       formats that fix theirs 32; fp16 scales, mxfp4's e8m0;
//       e.g. int8 256 2048 4,8: 512 KB of weights, in L2; CALLS per M, 2000). CHUNK_ROWS > 0
//       runs the rows as ranges of that many, the even ranges first, then the odd ones: the
//       short row ranges of a layer's threads, whose neighbours are read at another time.
//   From memory on both cores (docs/kernels.md, "Prefetch in address order"):
//   taskset -c 0 /tmp/quant_loop int8 40000 2048 1,8 60 & taskset -c 1 /tmp/quant_loop int8 40000 2048 1,8 60
//
// Prints, per M, the best and the median matmul time over the calls (the best is
// the least disturbed on a shared machine), its rate in GB/s of weights and scales, and
// the best gather time. The weights are random bytes: the time does not depend on them.
#include KERNEL
#include "common/cpu_features.hpp"
#ifndef OPS
#define OPS avx512_integer_ops
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace numa_moe;
using namespace numa_moe::kernels;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
    const std::string spec = argc >= 2 ? argv[1] : "";
    const std::string format_name = spec.substr(0, spec.find('/'));
    Format format = Format::bf16;
    const bool known = parse_format(format_name.c_str(), &format) && format != Format::bf16;
    const bool fixed_group = is_codebook_format(format);  // mxfp4, iq4nl, int4-affine: blocks of 32
    const int64_t group = spec.find('/') != std::string::npos ? std::atoll(spec.c_str() + spec.find('/') + 1)
                          : fixed_group                       ? 32
                                                              : 128;
    if ((argc < 5 || argc > 7) || !known || (group != 32 && group != 64 && group != 128) || (fixed_group && group != 32)) {
        std::fprintf(stderr,
                     "usage: %s FORMAT[/32|/64|/128] ROWS K M[,M...] [CALLS [CHUNK_ROWS]]\n"
                     "  FORMAT: int8, int4 (groups 32, 64, 128), mxfp4, iq4nl, int4-affine (32)\n",
                     argv[0]);
        return 2;
    }
    const int64_t rows = std::atoll(argv[2]), k = std::atoll(argv[3]);
    const int calls = argc >= 6 ? std::atoi(argv[5]) : 2000;
    const int64_t chunk_rows = argc == 7 ? std::atoll(argv[6]) : 0;
    if (rows < 1 || k < group || k % group != 0 || calls < 1 || chunk_rows < 0) {
        std::fprintf(stderr, "ROWS >= 1, K a multiple of %ld, CALLS >= 1, CHUNK_ROWS >= 0\n", static_cast<long>(group));
        return 2;
    }
    request_amx_permission();  // before any AMX kernel runs; a no-op question elsewhere
    const KernelOps* table = OPS(format, group);
    if (table == nullptr) {
        std::fprintf(stderr, "this CPU (or OS) has no kernels of this build (OPS)\n");
        return 2;
    }
    const KernelOps& ops = *table;
    const int64_t row_bytes = format == Format::int8 ? k : k / 2;
    const int64_t scales_ld = scale_values_per_group(format) * (k / group), n_scales = rows * scales_ld;
    const ScaleDtype scale_dtype = format == Format::mxfp4 ? ScaleDtype::e8m0 : ScaleDtype::fp16;
    const int64_t scale_bytes = scale_dtype_bytes(scale_dtype);
    std::mt19937 gen(1);
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(64, (rows * row_bytes + 63) / 64 * 64));
    auto* scales = static_cast<uint8_t*>(std::aligned_alloc(64, (n_scales * scale_bytes + 63) / 64 * 64));
    for (int64_t i = 0; i < rows * row_bytes; i += 4) {  // one draw per 4 bytes: GB of weights fill in seconds
        const uint32_t r = gen();
        std::memcpy(data + i, &r, std::min<int64_t>(4, rows * row_bytes - i));
    }
    for (int64_t i = 0; i < n_scales; ++i) {
        if (scale_dtype == ScaleDtype::e8m0) {
            scales[i] = static_cast<uint8_t>(118 + gen() % 8);  // 2^-9 .. 2^-2
        } else {
            const auto fp16 = static_cast<uint16_t>(0x2000 + gen() % 256);  // ~0.01
            std::memcpy(scales + 2 * i, &fp16, 2);
        }
    }
    Weights w;
    w.data = data;
    w.ld = k;
    w.scales = scales;
    w.scales_ld = scales_ld;
    w.group = group;
    w.scale_dtype = scale_dtype;
    const Segment segment{0, 1, rows, 0, k};
    const std::string list = argv[4];
    for (size_t at = 0; at < list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        const int64_t m = std::atoll(list.substr(at, comma - at).c_str());
        at = comma + 1;
        if (m < 1) continue;
        std::vector<bf16> x(static_cast<size_t>(m * k));
        for (bf16& v : x) v = float_to_bf16(static_cast<float>(gen() % 2001) / 1000.0f - 1.0f);
        std::vector<int64_t> index(static_cast<size_t>(m));
        for (int64_t t = 0; t < m; ++t) index[t] = t;
        void* packed = std::aligned_alloc(64, (ops.packed_bytes(m, k) + 63) / 64 * 64);
        std::vector<float> out(static_cast<size_t>(rows * m));
        std::vector<double> matmul, gather;
        for (int rep = 0; rep < calls; ++rep) {
            const double t0 = now();
            ops.gather(x.data(), k, index.data(), m, k, packed);
            const double t1 = now();
            if (chunk_rows == 0) {
                ops.matmul_segments(w, &segment, 1, 0, rows, packed, m, k, out.data(), m);
            } else {  // the even row ranges, then the odd ones
                for (int64_t parity = 0; parity < 2; ++parity)
                    for (int64_t r0 = parity * chunk_rows; r0 < rows; r0 += 2 * chunk_rows)
                        ops.matmul_segments(w, &segment, 1, r0, std::min(rows, r0 + chunk_rows), packed, m, k,
                                            out.data(), m);
            }
            matmul.push_back(now() - t1);
            gather.push_back(t1 - t0);
        }
        std::sort(matmul.begin(), matmul.end());
        std::sort(gather.begin(), gather.end());
        const double bytes = static_cast<double>(rows * row_bytes + n_scales * scale_bytes);
        std::printf("%s rows=%ld k=%ld m=%ld: matmul best %.1f us median %.1f us (%.1f GB/s at best), gather best %.1f us\n",
                    argv[1], static_cast<long>(rows), static_cast<long>(k), static_cast<long>(m), matmul[0] * 1e6,
                    matmul[matmul.size() / 2] * 1e6, bytes / matmul[0] / 1e9, gather[0] * 1e6);
        std::free(packed);
    }
    std::free(data);
    std::free(scales);
    return 0;
}
