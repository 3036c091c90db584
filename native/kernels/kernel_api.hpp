// The interface every expert-FFN kernel implements, one KernelOps table per instruction
// set. The worker layer (native/workers) only talks to this table; it never looks inside
// the packed token operand.
//
// Operands (bf16 = raw uint16_t bit patterns, fp32 accumulation everywhere):
//   weights  w[r * ldw + k]   row-major exactly as checkpoints store them (nn.Linear
//                             [out, in]); never repacked. ldw is in elements.
//   tokens   a "packed token operand" of m tokens x k columns, produced by gather() or
//            silu_mul_pack(); its layout is the ISA's own (plain row-major x[t][k] for
//            the dot-product kernels, pair-interleaved B[k/2][2t + k%2] for AMX).
//   partials out[r * ldo + t] fp32, one row per weight row (the transposed result
//            H^T[rows, tokens]); kernels add into it (+=), callers zero it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/segment.hpp"

namespace numa_moe::kernels {

using bf16 = uint16_t;

enum class Isa : int { ref = 0, avx2 = 1, avx512 = 2, amx_model = 3, amx = 4 };

struct KernelOps {
    Isa isa;
    const char* name;

    // Bytes of the packed token operand for m tokens of k columns (k even; callers
    // allocate with 64-byte alignment).
    size_t (*packed_bytes)(int64_t m, int64_t k);

    // packed <- rows token_index[0..m) of x (x[i * ldx + c], c < k), in this ISA's layout.
    void (*gather)(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k,
                   void* packed);

    // For each segment s, for each row r = s.row0 + j * s.row_stride (j < s.nrows) with
    // row_begin <= r < row_end, for each token t < m:
    //     out[r * ldo + t] += sum_{c in [s.k0, s.k1)} w[r * ldw + c] * tokens[t][c]
    // Threads that own disjoint [row_begin, row_end) ranges may run concurrently on the
    // same out buffer.
    void (*matmul_segments)(const bf16* w, int64_t ldw, const Segment* segments, int64_t n_segments,
                            int64_t row_begin, int64_t row_end, const void* packed, int64_t m,
                            int64_t k, float* out, int64_t ldo);

    // The gate/up epilogue fused with the cross-node reduction: for rows i in
    // [i_begin, i_end) and tokens t < m,
    //     g = sum_p gate_parts[p][i * ld + t]   (p in order 0..n_parts-1: deterministic)
    //     u = sum_p up_parts[p][i * ld + t]
    //     act[t][i] = bf16(silu(g) * u)
    // written into `packed`, the token operand (m tokens x k = i_total columns) of the down
    // projection. Disjoint [i_begin, i_end) ranges may run concurrently; i_begin and
    // i_end are multiples of 32 except i_end == i_total.
    void (*silu_mul_pack)(const float* const* gate_parts, const float* const* up_parts, int n_parts,
                          int64_t ld, int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total,
                          void* packed);

    // The down epilogue fused with the cross-node reduction and the top-k combine: for
    // h in [h_begin, h_end), t < m,
    //     y[token_index[t] * ldy + h] += token_weight[t] * sum_p parts[p][h * ld + t]
    // (partials transposed back to row-major tokens). Disjoint [h_begin, h_end) ranges
    // may run concurrently.
    void (*combine_down)(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin,
                         int64_t h_end, int64_t m, const int64_t* token_index,
                         const float* token_weight, float* y, int64_t ldy);
};

// The table for an ISA, or nullptr when this CPU (or OS) cannot run it.
const KernelOps* kernel_ops(Isa isa);

// The fastest ISA this machine runs, unless NUMA_MOE_ISA (ref|avx2|avx512|amx_model|amx)
// names another; an unavailable choice there is an error (std::runtime_error).
Isa default_isa();

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* isa);

// The per-ISA tables (each defined in its own translation unit).
const KernelOps& ref_ops();

}  // namespace numa_moe::kernels
