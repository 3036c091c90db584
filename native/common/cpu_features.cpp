#include "common/cpu_features.hpp"

#include <cerrno>
#include <cpuid.h>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/check.hpp"

namespace numa_moe {
namespace {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

unsigned long long read_xcr0() {
    unsigned int eax = 0, edx = 0;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (static_cast<unsigned long long>(edx) << 32) | eax;
}

CpuFeatures detect() {
    CpuFeatures f;
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
    const bool osxsave = ecx & (1u << 27);
    f.fma = ecx & (1u << 12);
    f.f16c = ecx & (1u << 29);
    if (osxsave) {
        const unsigned long long xcr0 = read_xcr0();
        f.os_avx = (xcr0 & 0x6) == 0x6;
        f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;
    }
    if (__get_cpuid_max(0, nullptr) < 7) return f;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    f.avx2 = ebx & (1u << 5);
    f.avx512f = ebx & (1u << 16);
    f.avx512dq = ebx & (1u << 17);
    f.avx512bw = ebx & (1u << 30);
    f.avx512vl = ebx & (1u << 31);
    f.avx512_vbmi = ecx & (1u << 1);
    f.avx512_vnni = ecx & (1u << 11);
    f.amx_bf16 = edx & (1u << 22);
    f.amx_tile = edx & (1u << 24);
    f.amx_int8 = edx & (1u << 25);
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx_vnni = eax & (1u << 4);
    f.avx512_bf16 = eax & (1u << 5);
    return f;
}

#ifdef NUMA_MOE_TEST_HOOKS
// NUMA_MOE_TEST_HIDE_ISA=avx2|avx512|amx (comma-separated), test builds only: the CPU is taken
// to lack that instruction set and every wider one (the wider kernels use the narrower
// instructions too), so that a test run on a large CPU sees what a smaller one would, the
// emulated builds included (docs/development.md).
CpuFeatures hide_for_tests(CpuFeatures f) {
    const char* hidden = std::getenv("NUMA_MOE_TEST_HIDE_ISA");
    if (!hidden) return f;
    const std::string list = hidden;
    for (size_t begin = 0; begin <= list.size();) {
        size_t end = list.find(',', begin);
        if (end == std::string::npos) end = list.size();
        const std::string name = list.substr(begin, end - begin);
        begin = end + 1;
        if (name.empty()) continue;
        NUMA_MOE_CHECK(name == "avx2" || name == "avx512" || name == "amx", "NUMA_MOE_TEST_HIDE_ISA: '", name,
                       "' is not one of avx2, avx512, amx");
        if (name == "avx2") f.avx2 = f.fma = f.avx_vnni = false;
        if (name == "avx2" || name == "avx512")
            f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512_bf16 = f.avx512_vnni = f.avx512_vbmi = false;
        f.amx_tile = f.amx_bf16 = f.amx_int8 = false;
    }
    return f;
}
#endif

}  // namespace

const CpuFeatures& cpu_features() {
#ifdef NUMA_MOE_TEST_HOOKS
    static const CpuFeatures features = hide_for_tests(detect());
#else
    static const CpuFeatures features = detect();
#endif
    return features;
}


bool has_avx512_bf16_kernels() {
    const CpuFeatures& f = cpu_features();
    return f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16;
}

bool has_avx512_vnni_kernels() { return has_avx512_bf16_kernels() && cpu_features().avx512_vnni; }

bool has_avx512_vbmi_kernels() { return has_avx512_vnni_kernels() && cpu_features().avx512_vbmi; }

bool has_avx2_kernels() {
    const CpuFeatures& f = cpu_features();
    return f.os_avx && f.avx2 && f.fma && f.f16c;
}

bool has_avx_vnni_kernels() { return has_avx2_kernels() && cpu_features().avx_vnni; }

bool request_amx_permission(std::string* error) {
    static std::once_flag once;
    static bool granted = false;
    static std::string reason;
    std::call_once(once, [] {
        const CpuFeatures& f = cpu_features();
        if (!(f.amx_tile && f.amx_bf16)) {
            reason = "CPU has no AMX-TILE/AMX-BF16";
            return;
        }
        if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
            reason = std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") +
                     std::strerror(errno);
            return;
        }
        unsigned long long bitmask = 0;
        if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0 ||
            !(bitmask & (1ull << kXfeatureXtiledata))) {
            reason = "arch_prctl granted no XTILEDATA permission";
            return;
        }
        granted = true;
    });
    if (!granted && error) *error = reason;
    return granted;
}

}  // namespace numa_moe
