#pragma once

#include <cstdint>

#include "kernels/kernel_api.hpp"

namespace numa_moe::engine {

// The per-expert rule's kernel choice: which ISA's tables run an expert, from its real
// token count m (docs/kernels.md, "The per-expert rule"; the token blocking that follows is
// in pipeline.hpp). The MoE layer and the bindings' ISA report both go through it.
//
// Kernels (not forced by the caller): AMX (real, when this CPU and OS allow it) from
// amx_min_tokens tokens (0: the format's default below), else AVX-512, else AVX2, else
// ref, the first with kernels for the format (and group). Within the table, the token
// layout and k blocking follow from m (KernelOps.token_layout, the kernel files).
const kernels::KernelOps* kernels_for_tokens(int64_t m, kernels::Format format, int64_t group, int64_t amx_min_tokens);
// AMX from one token for bf16 (the AMX-BF16 kernel reads at the memory's rate from one
// token); int8 and the nibble formats from 5 tokens: below those the AVX-512-VNNI kernels read
// faster than AMX-INT8 on the Intel Xeon measured, and both give the same bits
// (docs/kernels.md, "The per-expert rule").
constexpr int64_t kAmxMinTokensBf16 = 1;
constexpr int64_t kAmxMinTokensInt8 = 5;
constexpr int64_t kAmxMinTokensInt4 = 5;
inline int64_t default_amx_min_tokens(kernels::Format format) {
    switch (format) {
        case kernels::Format::int8: return kAmxMinTokensInt8;
        case kernels::Format::int4:
        case kernels::Format::mxfp4:
        case kernels::Format::iq4nl: return kAmxMinTokensInt4;
        case kernels::Format::bf16: break;
    }
    return kAmxMinTokensBf16;
}

}  // namespace numa_moe::engine
