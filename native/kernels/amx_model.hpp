// A software model of the AMX intrinsics the kernels use, so that amx_bf16.cpp compiles a
// second time (-DNUMA_MOE_AMX_MODEL) into an emulated build that runs on CPUs without AMX.
// It follows the Operation sections of Intel's SDM entries (LDTILECFG, TILELOADD[T1],
// TDPBF16PS, TDPBSSD, TILESTORED, TILEZERO, TILERELEASE):
//   - eight tiles tmm0..7 of 16 rows x 64 bytes, state per thread (thread_local), like
//     the XTILEDATA register state of a real thread;
//   - LDTILECFG validates the 64-byte configuration (palette 1, start_row 0, reserved
//     bytes zero, rows <= 16, colsb <= 64, rows == 0 iff colsb == 0, tiles 8..15 unused)
//     and zeroes all tiles; palette 0 is TILERELEASE;
//   - loads write the configured rows/colsb and zero the rest (write_row_and_zero,
//     zero_upper_rows);
//   - TDPBF16PS: per output, two fp32 lanes (even/odd bf16 of each pair) accumulate with
//     fused multiply-adds in k order (DAZ on inputs, FTZ on each result), then the two
//     lanes are added to the destination (SDM temp1[2n] + temp1[2n+1]);
//   - TDPBSSD: signed int8 4-way dot products accumulated in int32 (wrapping);
//   - the #UD / #GP cases (unconfigured tiles, shape mismatches, aliasing operands) throw
//     std::runtime_error naming the violated rule, where hardware would fault.
// The gcc macros of the same names are #undef'd; the model functions live in
// numa_moe::amx_model and the kernel source calls them through its TILE_* macros.
// The model is baseline code of its own (amx_model.cpp): its error messages build
// std::strings, and no std:: template may be instantiated in an ISA translation unit.
#pragma once

#include <immintrin.h>

#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbssd

namespace numa_moe::amx_model {

void _tile_loadconfig(const void* config);
void _tile_release();
void _tile_loadd(int dst, const void* base, long stride);
// TILELOADDT1 differs only in its cache hint.
void _tile_stream_loadd(int dst, const void* base, long stride);
void _tile_stored(int src, void* base, long stride);
void _tile_zero(int dst);
void _tile_dpbf16ps(int dst, int a, int b);
void _tile_dpbssd(int dst, int a, int b);

// Instructions this thread executed since the last reset_instruction_counts(): how the
// tests and docs/kernels.md count a kernel's tile work on machines without AMX.
struct InstructionCounts {
    long loadconfig = 0;
    long loads = 0;  // TILELOADD and TILELOADDT1
    long stream_loads = 0;  // TILELOADDT1 alone
    long stores = 0;
    long zeros = 0;
    long dpbf16ps = 0;
    long dpbssd = 0;
};
InstructionCounts instruction_counts();
void reset_instruction_counts();

// Test entry: LDTILECFG `config`, load C/A/B into tmm0/1/2 (row stride 64 bytes), one
// TDPBF16PS (int8 = false) or TDPBSSD (int8 = true), store tmm0, release.
void tile_dot(const void* config, bool int8, void* c, const void* a, const void* b);

}  // namespace numa_moe::amx_model
