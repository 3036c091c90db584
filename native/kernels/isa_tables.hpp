// The per-ISA KernelOps tables and the benchmark helpers, each defined in the translation
// unit compiled with that ISA's flags. Only dispatch.cpp and the bindings include this;
// callers reach the tables through kernel_ops(Isa).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

const KernelOps& avx2_ops();       // avx2.cpp        (-mavx2 -mfma)
const KernelOps& avx512_ops();     // avx512_bf16.cpp (-mavx512f/bw/vl/bf16 -mfma)
const KernelOps& amx_ops();        // amx_bf16.cpp    (real AMX instructions)
const KernelOps& amx_model_ops();  // amx_bf16.cpp built with -DNUMA_MOE_AMX_MODEL

// The AMX software model on its own (tests): see amx_bf16.cpp.
void amx_model_tile_dot(const void* config, bool int8, void* c, const void* a, const void* b);

// Benchmark helpers (avx512_bf16.cpp; call only when has_avx512_bf16_kernels()).
// Reads `bytes` bytes at `data` with 512-bit loads (the streaming-read ceiling);
// returns a checksum so the loads cannot be elided.
uint64_t stream_read_avx512(const void* data, size_t bytes);
// Runs `iterations` x 24 independent vdpbf16ps on registers only; returns the flop count
// (2 * 32 per instruction). The caller times it.
double dpbf16ps_peak_loop(int64_t iterations);

}  // namespace numa_moe::kernels
