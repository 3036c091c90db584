// The integer formats' KernelOps tables of one translation unit, by format and group.
// Each integer TU defines `template <Format F, int64_t G> const KernelOps& table()` and
// exports it through integer_table; the formats and groups are enumerated here once.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/isa_namespace.hpp"
#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {
inline namespace NUMA_MOE_ISA_NS {

// make(std::integral_constant<Format, F>{}, std::integral_constant<int64_t, G>{}) returns
// the table of format F and group G; nullptr for bf16 or a group the format has no table
// for (has_group: the codebook formats only 32, so only that one is instantiated).
template <class Make>
const KernelOps* integer_table(Format format, int64_t group, Make make) {
    const auto by_group = [&](auto f) -> const KernelOps* {
        switch (group) {
            case 32: return &make(f, std::integral_constant<int64_t, 32>{});
            case 64: return &make(f, std::integral_constant<int64_t, 64>{});
            case 128: return &make(f, std::integral_constant<int64_t, 128>{});
            default: return nullptr;
        }
    };
    switch (format) {
        case Format::int8: return by_group(std::integral_constant<Format, Format::int8>{});
        case Format::int4: return by_group(std::integral_constant<Format, Format::int4>{});
        case Format::mxfp4:
            return group == 32 ? &make(std::integral_constant<Format, Format::mxfp4>{}, std::integral_constant<int64_t, 32>{})
                               : nullptr;
        case Format::iq4nl:
            return group == 32 ? &make(std::integral_constant<Format, Format::iq4nl>{}, std::integral_constant<int64_t, 32>{})
                               : nullptr;
        case Format::int4_affine:
            return group == 32 ? &make(std::integral_constant<Format, Format::int4_affine>{},
                                       std::integral_constant<int64_t, 32>{})
                               : nullptr;
        default: return nullptr;
    }
}

}  // namespace NUMA_MOE_ISA_NS
}  // namespace numa_moe::kernels
