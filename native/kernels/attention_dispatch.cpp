// Chooses an AttentionOps table by CPU feature (or NUMA_MOE_ISA), by the rules of the
// expert kernels (dispatch.cpp). Baseline x86-64 code.
#include <stdexcept>
#include <string>

#include "common/cpu_features.hpp"
#include "kernels/attention_api.hpp"

namespace numa_moe::kernels {

const AttentionOps* attention_ops(Isa isa) {
    switch (isa) {
        case Isa::ref: return &attention_ref_ops();
        case Isa::avx2: return has_avx2_kernels() ? &attention_avx2_ops() : nullptr;
        case Isa::avx512: return has_avx512_bf16_kernels() ? &attention_avx512_ops() : nullptr;
        case Isa::amx_model: return has_avx2_kernels() ? &attention_amx_model_ops() : nullptr;
        case Isa::amx:
            return has_avx512_bf16_kernels() && request_amx_permission() ? &attention_amx_ops() : nullptr;
        // Test builds only; the expert kernels' table says when they run (dispatch.cpp).
        case Isa::avx2_emulated:
        case Isa::avx512_emulated:
#ifdef NUMA_MOE_TEST_HOOKS
            if (!kernel_ops(isa)) return nullptr;
            return isa == Isa::avx2_emulated ? &attention_avx2_emulated_ops() : &attention_avx512_emulated_ops();
#else
            return nullptr;
#endif
    }
    return nullptr;
}

std::string attention_unavailable_reason(Isa isa) {
    if (attention_ops(isa)) return "";
    return unavailable_reason(isa);
}

Isa default_attention_isa() {
    const Isa isa = default_isa();
    if (attention_ops(isa)) return isa;
    return Isa::ref;
}

}  // namespace numa_moe::kernels
