// CPU features from cpuid/xgetbv, and the Linux permission for AMX tile state.
// Baseline x86-64 code: safe to call on any CPU.
#pragma once

#include <string>

namespace numa_moe {

struct CpuFeatures {
    bool avx2 = false;
    bool fma = false;
    bool f16c = false;
    bool avx_vnni = false;  // vpdpbusd in its VEX (ymm) form
    bool avx512f = false;
    bool avx512bw = false;
    bool avx512vl = false;
    bool avx512dq = false;
    bool avx512_bf16 = false;
    bool avx512_vnni = false;
    bool avx512_vbmi = false;  // vpermb
    bool amx_tile = false;
    bool amx_bf16 = false;
    bool amx_int8 = false;
    // The OS saves the register state (XCR0): AVX (ymm), AVX-512 (opmask/zmm).
    bool os_avx = false;
    bool os_avx512 = false;
};

// Detected once, cached.
const CpuFeatures& cpu_features();

// AVX-512 with the BF16 dot product and OS support: what the avx512 kernels need.
bool has_avx512_bf16_kernels();
// ... and VNNI (vpdpbusd): what the avx512 int8 / int4 kernels need.
bool has_avx512_vnni_kernels();
// ... and VBMI (vpermb): the avx512 mxfp4 kernels' codebook lookup without masks.
bool has_avx512_vbmi_kernels();
// AVX2 + FMA + F16C with OS support: the portable SIMD path (every CPU with AVX2 has FMA
// and F16C; the integer kernels convert fp16 scales with F16C).
bool has_avx2_kernels();
// ... and AVX-VNNI: the avx2 integer tables use its vpdpbusd.
bool has_avx_vnni_kernels();

// Asks Linux for AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM) once per
// process; returns whether AMX instructions may be executed. `error` receives the reason
// when it may not (no AMX in cpuid, or the errno of arch_prctl).
bool request_amx_permission(std::string* error = nullptr);

}  // namespace numa_moe
