#pragma once

#include <cstdint>

#include "kernels/kernel_api.hpp"

namespace numa_moe::engine {

// The per-expert rule's kernel choice: which ISA's tables run an expert, from its real
// token count m (docs/kernels.md, "The per-expert rule"; the token blocking that follows is
// in pipeline.hpp). The MoE layer and the bindings' ISA report both go through it.
//
// Kernels (not forced by the caller): AMX (real, when this CPU and OS allow it) from
// amx_min_tokens tokens (0: the format's and group's default below), else AVX-512, else AVX2, else
// ref, the first with kernels for the format (and group). Within the table, the token
// layout and k blocking follow from m (KernelOps.token_layout, the kernel files).
const kernels::KernelOps* kernels_for_tokens(int64_t m, kernels::Format format, int64_t group, int64_t amx_min_tokens);
// AMX's crossover per format and group: AMX from one token for bf16 (the AMX-BF16 kernel
// reads at the memory's rate from one token); int8 and the nibble formats from where
// AMX-INT8 reads faster than the AVX-512-VNNI kernels on the Intel Xeon measured, which
// depends on the group: a tdpbssd covers at most one group (32 columns at group 32, where
// every 32 columns also pay a tile store and an epilogue), while VNNI's cost per group is
// small. Both give the same bits (docs/kernels.md, "The per-expert rule").
constexpr int64_t kAmxMinTokensBf16 = 1;
constexpr int64_t kAmxMinTokensInt8 = 5;
constexpr int64_t kAmxMinTokensNibble = 5;
constexpr int64_t kAmxMinTokensNibbleGroup64 = 7;
constexpr int64_t kAmxMinTokensNibbleGroup32 = 14;
// group 0: the format's default group (kernel_api.hpp default_group).
inline int64_t default_amx_min_tokens(kernels::Format format, int64_t group = 0) {
    if (format == kernels::Format::bf16) return kAmxMinTokensBf16;
    if (group == 0) group = kernels::default_group(format);
    if (format == kernels::Format::int8) return kAmxMinTokensInt8;
    return group == 32 ? kAmxMinTokensNibbleGroup32 : group == 64 ? kAmxMinTokensNibbleGroup64 : kAmxMinTokensNibble;
}

}  // namespace numa_moe::engine
