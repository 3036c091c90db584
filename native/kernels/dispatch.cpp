// Chooses a KernelOps table by CPU feature (or NUMA_MOE_ISA). Baseline x86-64 code.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cpu_features.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::ref: return "ref";
        case Isa::avx2: return "avx2";
        case Isa::avx512: return "avx512";
        case Isa::amx_model: return "amx_model";
        case Isa::amx: return "amx";
    }
    return "unknown";
}

bool parse_isa(const char* name, Isa* isa) {
    for (Isa candidate : {Isa::ref, Isa::avx2, Isa::avx512, Isa::amx_model, Isa::amx}) {
        if (std::strcmp(name, isa_name(candidate)) == 0) {
            *isa = candidate;
            return true;
        }
    }
    return false;
}

const KernelOps* kernel_ops(Isa isa) {
    switch (isa) {
        case Isa::ref: return &ref_ops();
        case Isa::avx2: return has_avx2_kernels() ? &avx2_ops() : nullptr;
        case Isa::avx512: return has_avx512_bf16_kernels() ? &avx512_ops() : nullptr;
        // The model's epilogues are AVX-512 code; its tiles are plain C++.
        case Isa::amx_model: return has_avx512_bf16_kernels() ? &amx_model_ops() : nullptr;
        case Isa::amx: return has_avx512_bf16_kernels() && request_amx_permission() ? &amx_ops() : nullptr;
    }
    return nullptr;
}

std::string unavailable_reason(Isa isa) {
    if (kernel_ops(isa)) return "";
    switch (isa) {
        case Isa::ref: return "";
        case Isa::avx2: return "this CPU (or OS) lacks AVX2 + FMA";
        case Isa::avx512:
        case Isa::amx_model: return "this CPU (or OS) lacks AVX-512 with BF16";
        case Isa::amx: {
            if (!has_avx512_bf16_kernels()) return "this CPU (or OS) lacks AVX-512 with BF16";
            std::string reason;
            request_amx_permission(&reason);
            return reason;
        }
    }
    return "unknown ISA";
}

Isa default_isa() {
    if (const char* forced = std::getenv("NUMA_MOE_ISA"); forced && *forced) {
        Isa isa;
        if (!parse_isa(forced, &isa))
            throw std::runtime_error(std::string("NUMA_MOE_ISA=") + forced +
                                     " is not one of ref, avx2, avx512, amx_model, amx");
        if (!kernel_ops(isa))
            throw std::runtime_error(std::string("NUMA_MOE_ISA=") + forced + " is not available on this CPU");
        return isa;
    }
    // amx_model is never a default: it is a test vehicle, orders of magnitude slower.
    for (Isa isa : {Isa::amx, Isa::avx512, Isa::avx2}) {
        if (kernel_ops(isa)) return isa;
    }
    return Isa::ref;
}

}  // namespace numa_moe::kernels
