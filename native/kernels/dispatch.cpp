// Chooses a KernelOps table by CPU feature (or NUMA_MOE_ISA). Baseline x86-64 code.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cpu_features.hpp"
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
        default: return nullptr;  // the SIMD and AMX tables are registered by their own TUs
    }
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
    for (Isa isa : {Isa::amx, Isa::avx512, Isa::avx2}) {
        if (kernel_ops(isa)) return isa;
    }
    return Isa::ref;
}

}  // namespace numa_moe::kernels
