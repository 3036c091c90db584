// Chooses a KernelOps table by CPU feature (or NUMA_MOE_ISA). Baseline x86-64 code.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cpu_features.hpp"
#include "kernels/isa_tables.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

namespace {

// The emulated builds exist in test builds only; avx2_emulated is baseline x86-64 code, and
// avx512_emulated is compiled with AVX2 flags, as the AMX model (sources.cmake).
constexpr bool kEmulatedBuilds =
#ifdef NUMA_MOE_TEST_HOOKS
    true;
#else
    false;
#endif

const KernelOps* emulated_ops(Isa isa, Format format, int64_t group) {
#ifdef NUMA_MOE_TEST_HOOKS
    const bool bf16 = format == Format::bf16;
    if (isa == Isa::avx2_emulated) {
        if (bf16) return &avx2_emulated_ops();
        // The AVX2 integer build this CPU does not run natively, so that the tests run both
        // (the AVX-VNNI one on a CPU with AVX2 but no AVX-VNNI; else the vpmaddubsw one).
        const bool vnni = has_avx2_kernels() && !has_avx_vnni_kernels();
        return vnni ? avx2_vnni_emulated_integer_ops(format, group) : avx2_emulated_integer_ops(format, group);
    }
    if (isa == Isa::avx512_emulated && has_avx2_kernels()) {
        if (bf16) return &avx512_emulated_ops();
        // The codebook formats' lookup likewise: the VBMI build unless this CPU runs that one natively.
        if (!has_avx512_vbmi_kernels())
            if (const KernelOps* vbmi = avx512_vbmi_emulated_integer_ops(format, group)) return vbmi;
        return avx512_emulated_integer_ops(format, group);
    }
#else
    (void)isa, (void)format, (void)group;
#endif
    return nullptr;
}

// The integer formats: reference kernels, AVX2 ones, AVX-512-VNNI ones (the codebook formats' from the
// VBMI build where the CPU has VBMI), and AMX-INT8 ones (real, or over the AMX model; their epilogues and token
// packing are AVX-512 code, emulated on AVX2 in the model build).
bool has_amx_int8_kernels() {
    return has_avx512_bf16_kernels() && cpu_features().amx_int8 && request_amx_permission();
}

const KernelOps* integer_ops(Isa isa, Format format, int64_t group) {
    switch (isa) {
        case Isa::ref: return ref_integer_ops(format, group);
        case Isa::avx2:
            if (!has_avx2_kernels()) return nullptr;
            return has_avx_vnni_kernels() ? avx2_vnni_integer_ops(format, group) : avx2_integer_ops(format, group);
        case Isa::avx512:
            if (!has_avx512_vnni_kernels()) return nullptr;
            if (has_avx512_vbmi_kernels())
                if (const KernelOps* vbmi = avx512_vbmi_integer_ops(format, group)) return vbmi;
            return avx512_integer_ops(format, group);
        case Isa::amx_model: return has_avx2_kernels() ? amx_model_integer_ops(format, group) : nullptr;
        case Isa::amx: return has_amx_int8_kernels() ? amx_integer_ops(format, group) : nullptr;
        case Isa::avx2_emulated:
        case Isa::avx512_emulated: return emulated_ops(isa, format, group);
    }
    return nullptr;
}

}  // namespace

const KernelOps* kernel_ops(Isa isa, Format format, int64_t group) {
    if (format != Format::bf16) return integer_ops(isa, format, group == 0 ? default_group(format) : group);
    switch (isa) {
        case Isa::ref: return &ref_ops();
        case Isa::avx2: return has_avx2_kernels() ? &avx2_ops() : nullptr;
        case Isa::avx512: return has_avx512_bf16_kernels() ? &avx512_ops() : nullptr;
        // The model's tiles are plain C++, its AVX-512 epilogues emulated on AVX2 (avx512_emulated.hpp).
        case Isa::amx_model: return has_avx2_kernels() ? &amx_model_ops() : nullptr;
        case Isa::amx: return has_avx512_bf16_kernels() && request_amx_permission() ? &amx_ops() : nullptr;
        case Isa::avx2_emulated:
        case Isa::avx512_emulated: return emulated_ops(isa, format, group);
    }
    return nullptr;
}

std::string unavailable_reason(Isa isa, Format format) {
    if (kernel_ops(isa, format)) return "";
    if (format != Format::bf16 && kernel_ops(isa)) {
        if (isa == Isa::avx512) return "this CPU (or OS) lacks AVX-512 VNNI";
        if (isa == Isa::amx) return "this CPU has AMX-BF16 but no AMX-INT8";
        return std::string("it has no ") + format_name(format) + " kernels";
    }
    switch (isa) {
        case Isa::ref: return "";
        case Isa::avx2:
        case Isa::amx_model: return "this CPU (or OS) lacks AVX2 + FMA + F16C";
        case Isa::avx512: return "this CPU (or OS) lacks AVX-512 with BF16";
        case Isa::amx: {
            if (!has_avx512_bf16_kernels()) return "this CPU (or OS) lacks AVX-512 with BF16";
            std::string reason;
            request_amx_permission(&reason);
            return reason;
        }
        case Isa::avx2_emulated:
        case Isa::avx512_emulated:
            if (!kEmulatedBuilds)
                return std::string(isa_name(isa)) + " is a test build, compiled only with NUMA_MOE_TEST_HOOKS=ON "
                       "(tools/setup.sh)";
            return "this CPU (or OS) lacks AVX2 + FMA + F16C";
    }
    return "unknown ISA";
}

Isa default_isa() {
    if (const char* forced = std::getenv("NUMA_MOE_ISA"); forced && *forced) {
        Isa isa;
        if (!parse_isa(forced, &isa))
            throw std::runtime_error(std::string("NUMA_MOE_ISA=") + forced + " is not one of " + isa_names());
        if (!kernel_ops(isa))
            throw std::runtime_error(std::string("NUMA_MOE_ISA=") + forced + " is not available on this CPU");
        return isa;
    }
    return fastest_isa(Format::bf16);
}

Isa fastest_isa(Format format) {
    // amx_model and the emulated builds are never a default: they are test vehicles, orders of
    // magnitude slower.
    for (Isa isa : {Isa::amx, Isa::avx512, Isa::avx2}) {
        if (kernel_ops(isa, format)) return isa;
    }
    return Isa::ref;
}

}  // namespace numa_moe::kernels
