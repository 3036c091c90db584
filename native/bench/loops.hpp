// The benchmarks' register and memory loops, each in the translation unit compiled with
// its ISA's flags (call only when that ISA is available).
#pragma once

#include <cstddef>
#include <cstdint>

namespace numa_moe::bench {

// Reads `bytes` bytes at `data` with 512-bit loads (the streaming-read ceiling); returns
// a checksum so the loads cannot be elided.                         avx512_loops.cpp
uint64_t stream_read_avx512(const void* data, size_t bytes);

// The same with 256-bit loads, for CPUs without AVX-512.          avx2_loops.cpp
uint64_t stream_read_avx2(const void* data, size_t bytes);

// `iterations` x 24 independent vdpbf16ps on registers only; returns the flops
// (2 * 32 per instruction). The caller times it.                    avx512_loops.cpp
double vdpbf16ps_loop(int64_t iterations);

// `iterations` x 24 independent vpdpbusd on registers only (needs AVX-512 VNNI); returns
// the integer operations (2 * 64 per instruction).                  avx512_loops.cpp
double vpdpbusd_loop(int64_t iterations);

// `iterations` x 14 independent vfmadd231ps on ymm registers (what the AVX2 bf16 kernels
// multiply with, after widening bf16 to fp32); returns the flops (2 * 8 per instruction).
//                                                                   avx2_loops.cpp
double vfmadd231ps_loop(int64_t iterations);

// `iterations` x 14 independent vpmaddubsw on ymm registers (the AVX2 integer kernels'
// multiply, u8 x s8 pairs summed to int16); returns the integer operations (2 * 32 per
// instruction).                                                     avx2_loops.cpp
double vpmaddubsw_loop(int64_t iterations);

// `iterations` x 4 independent tdpbf16ps on 16 x 16 fp32 tiles with 32-deep bf16 operands
// (register tiles only); returns the flops (2 * 16 * 16 * 32 per instruction). Needs
// the AMX tile permission (request_amx_permission).                 amx_loops.cpp
double tdpbf16ps_loop(int64_t iterations);

// `iterations` x 4 independent tdpbssd on 16 x 16 int32 tiles with 64-deep int8 operands;
// returns the integer operations (2 * 16 * 16 * 64 per instruction). Needs AMX-INT8 and
// the tile permission.                                              amx_loops.cpp
double tdpbssd_loop(int64_t iterations);

}  // namespace numa_moe::bench
