// The interface of the GQA decode-attention kernels, one AttentionOps table per
// instruction set (attention is a different operation from the expert matmul, so it has
// its own small table; the ISA rules are the same: attention_ops(), default_isa()).
//
// One call of `attend` folds a run of n cache positions into the running softmax state of
// one query block: the g <= kMaxQueryBlock query heads that share one KV head.
//
// Operands (bf16 = raw uint16_t bit patterns, fp32 softmax and accumulation):
//   query    q[i * d + c], g x d bf16 rows as the model produced them; pack_query turns
//            them once per block into the ISA's layout (plain rows, or AMX pairs
//            q[(c / 2) * 2g + 2i + c % 2])
//   k, v     k[t * d + c], v[t * d + c] for t < n: the cache rows of the run, in their plain
//            layout, never repacked in memory
//   state    m[i] running max of the scaled scores, l[i] running sum of exp(s - m),
//            o[i * d + c] running sum of exp(s - m) * v (unnormalised); m = -inf, l = 0,
//            o = 0 before the first run
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/kernel_api.hpp"

namespace numa_moe::kernels {

// Query heads per block: an AMX tile holds 16 rows.
constexpr int64_t kMaxQueryBlock = 16;
// Positions per softmax step inside `attend`.
constexpr int64_t kAttentionChunk = 64;

// Head sizes with kernels.
inline bool attention_head_dim_supported(int64_t d) { return d == 64 || d == 128 || d == 256; }

// fn(std::integral_constant<int, D>{}) for head size d, one of the supported ones (the
// driver admits no other; nothing is called for one): how the ISA files reach their
// kernels compiled per head size.
template <class Fn>
void with_head_dim(int64_t d, Fn&& fn) {
    switch (d) {
        case 64: fn(std::integral_constant<int, 64>{}); break;
        case 128: fn(std::integral_constant<int, 128>{}); break;
        case 256: fn(std::integral_constant<int, 256>{}); break;
        default: break;
    }
}

struct AttentionState {
    float* m;
    float* l;
    float* o;
};

struct AttentionOps {
    Isa isa;
    const char* name;
    // Bytes of the packed query block and of the work memory of one `attend` call
    // (callers allocate both with 64-byte alignment).
    size_t (*query_bytes)(int64_t g, int64_t d);
    size_t (*scratch_bytes)(int64_t g, int64_t d);
    void (*pack_query)(const bf16* q, int64_t g, int64_t d, void* packed);
    // For every query i < g and position t < n, s = scale * q_i . k_t; the state absorbs
    // the run by the online-softmax rule:
    //     m' = max(m, max_t s), l' = l e^(m - m') + sum_t e^(s - m'),
    //     o' = o e^(m - m') + sum_t e^(s - m') v_t
    // (AMX rounds e^(s - m') to bf16 for the P.V product and sums the rounded values into
    // l, so that numerator and denominator agree).
    void (*attend)(const void* packed_query, int64_t g, int64_t d, const bf16* k, const bf16* v, int64_t n,
                   float scale, const AttentionState& state, void* scratch);
};

// The table for an ISA, or nullptr when this CPU (or OS) cannot run it.
const AttentionOps* attention_ops(Isa isa);
std::string attention_unavailable_reason(Isa isa);
// default_isa() (every ISA has attention kernels).
Isa default_attention_isa();

const AttentionOps& attention_ref_ops();     // attention_ref.cpp     baseline
const AttentionOps& attention_avx2_ops();    // attention_avx2.cpp    AVX2 + FMA, fp32
const AttentionOps& attention_avx512_ops();  // attention_avx512.cpp  AVX-512-BF16
const AttentionOps& attention_amx_ops();     // attention_amx.cpp     real AMX
const AttentionOps& attention_amx_model_ops();  // attention_amx_model.cpp: the same source on the AMX model
// Test builds only (NUMA_MOE_TEST_HOOKS): the AVX2 and AVX-512 sources over SIMDe
// (attention_avx2_emulated.cpp, attention_avx512_emulated.cpp).
const AttentionOps& attention_avx2_emulated_ops();
const AttentionOps& attention_avx512_emulated_ops();

}  // namespace numa_moe::kernels
