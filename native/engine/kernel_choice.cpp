// The per-expert rule's kernel choice (see kernel_choice.hpp). Baseline x86-64 code.
#include "engine/kernel_choice.hpp"

#include <stdexcept>
#include <string>

namespace numa_moe::engine {

const kernels::KernelOps* kernels_for_tokens(int64_t m, kernels::Format format, int64_t group, int64_t amx_min_tokens) {
    using kernels::Isa;
    if (amx_min_tokens <= 0) amx_min_tokens = default_amx_min_tokens(format, group);
    if (m >= amx_min_tokens)
        if (const kernels::KernelOps* ops = kernels::kernel_ops(Isa::amx, format, group)) return ops;
    for (Isa isa : {Isa::avx512, Isa::avx2, Isa::ref})
        if (const kernels::KernelOps* ops = kernels::kernel_ops(isa, format, group)) return ops;
    throw std::logic_error("no kernels for weight format " + std::string(kernels::format_name(format)));
}

}  // namespace numa_moe::engine
