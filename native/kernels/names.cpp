// The names of the ISAs and weight formats (kernel_api.hpp), apart from the dispatcher so
// that programs which include one kernel source whole (benchmarks/) link without the
// kernel tables. Baseline x86-64 code.
#include <cstring>
#include <string>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::ref: return "ref";
        case Isa::avx2: return "avx2";
        case Isa::avx512: return "avx512";
        case Isa::amx_model: return "amx_model";
        case Isa::amx: return "amx";
        case Isa::avx2_emulated: return "avx2_emulated";
        case Isa::avx512_emulated: return "avx512_emulated";
    }
    return "unknown";
}

bool parse_isa(const char* name, Isa* isa) {
    for (Isa candidate : kAllIsas) {
        if (std::strcmp(name, isa_name(candidate)) == 0) {
            *isa = candidate;
            return true;
        }
    }
    return false;
}

std::string isa_names() {
    std::string names;
    for (Isa isa : kAllIsas) names += std::string(names.empty() ? "" : ", ") + isa_name(isa);
    return names;
}

const char* format_name(Format format) {
    switch (format) {
        case Format::bf16: return "bf16";
        case Format::int8: return "int8";
        case Format::int4: return "int4";
        case Format::mxfp4: return "mxfp4";
        case Format::iq4nl: return "iq4nl";
        case Format::int4_affine: return "int4-affine";
    }
    return "unknown";
}

bool parse_format(const char* name, Format* format) {
    for (Format candidate : kAllFormats) {
        if (std::strcmp(name, format_name(candidate)) == 0) {
            *format = candidate;
            return true;
        }
    }
    return false;
}

std::string format_names() {
    std::string names;
    for (Format format : kAllFormats) names += std::string(names.empty() ? "" : ", ") + format_name(format);
    return names;
}

}  // namespace numa_moe::kernels
