// The interface every expert-FFN kernel implements, one KernelOps table per instruction
// set. The engine (native/engine) only talks to this table; it never looks inside
// the packed token operand.
//
// Operands (bf16 = raw uint16_t bit patterns, fp32 accumulation everywhere):
//   weights  w[r * ldw + k]   row-major exactly as checkpoints store them (nn.Linear
//                             [out, in]); never repacked. ldw is in elements.
//   tokens   a "packed token operand" of m tokens x k columns, produced by gather() or
//            silu_mul_pack(); its layout is the ISA's own choice for m (token_layout
//            below): plain row-major x[t][k] for the dot-product kernels, column blocks
//            interleaved across tokens for AMX and the AVX-512 token-lane kernels.
//   partials out[r * ldo + t] fp32, one row per weight row (the transposed result
//            H^T[rows, tokens]); kernels add into it (+=), callers zero it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/isa_namespace.hpp"
#include "common/segment.hpp"

namespace numa_moe::kernels {

using bf16 = uint16_t;

// avx2_emulated and avx512_emulated are the AVX2 and AVX-512 kernel sources built over SIMDe's
// portable intrinsics, so that the tests run them on CPUs without those instruction sets
// (docs/kernels.md); they exist only in builds with NUMA_MOE_TEST_HOOKS.
enum class Isa : int { ref = 0, avx2 = 1, avx512 = 2, amx_model = 3, amx = 4, avx2_emulated = 5, avx512_emulated = 6 };

// Every ISA, in the order kernel_isas() lists them: ref first, each emulated build before its
// native ISA.
constexpr Isa kAllIsas[] = {Isa::ref,    Isa::avx2_emulated, Isa::avx2, Isa::avx512_emulated,
                            Isa::avx512, Isa::amx_model,     Isa::amx};

// Weight formats (docs/quantization.md): bf16, or group-wise int8 / int4 / mxfp4 / iq4nl /
// int4_affine with a scale per row and group of columns. int4, mxfp4, iq4nl and
// int4_affine are the nibble formats: two 4-bit codes per byte, each code an integer of the
// format's codebook (nibble_codes.hpp). mxfp4 is OCP MXFP4 (e2m1 codes, an e8m0 scale per
// 32 columns) and only exists with group 32 and e8m0 scales, which no other format takes;
// iq4nl is llama.cpp's IQ4_NL codebook (its block of 32 columns, float scales);
// int4_affine is llama.cpp's Q4_1 / Q4_K: unsigned codes q in [0, 15] and, besides each
// group's scale s, its minimum m: w = s * q + m (group 32, float scales and minimums).
enum class Format : int { bf16 = 0, int8 = 1, int4 = 2, mxfp4 = 3, iq4nl = 4, int4_affine = 5 };
enum class ScaleDtype : int { fp32 = 0, fp16 = 1, bf16 = 2, e8m0 = 3 };

constexpr Format kAllFormats[] = {Format::bf16,  Format::int8,  Format::int4,
                                  Format::mxfp4, Format::iq4nl, Format::int4_affine};

constexpr bool is_nibble_format(Format format) {
    return format == Format::int4 || format == Format::mxfp4 || format == Format::iq4nl ||
           format == Format::int4_affine;
}

// The nibble formats whose codes are looked up in a codebook (int4's are two's complement).
constexpr bool is_codebook_format(Format format) {
    return format == Format::mxfp4 || format == Format::iq4nl || format == Format::int4_affine;
}

// The formats with a minimum per group besides its scale (w = s * q + m). A row's scales
// are then followed by its minimums: row r's k / group scales, then its k / group
// minimums, at scales[r * scales_ld + k / group + c / group] (same dtype).
constexpr bool has_minimums(Format format) { return format == Format::int4_affine; }

// Float values per row and group in the scales array: the scale, and the minimum where the
// format has one.
constexpr int64_t scale_values_per_group(Format format) { return has_minimums(format) ? 2 : 1; }

// Whether a format's scales may be 0: iq4nl's codebook has no zero, so a block of zeros is
// a zero scale (ggml writes d = 0 for one), and int4_affine's block of equal weights has
// scale 0 (its minimums may be 0 too); every other format has a zero code and its scales
// are never 0. The kernels take any finite scale; the bindings hold the rule.
constexpr bool takes_zero_scales(Format format) { return format == Format::iq4nl || format == Format::int4_affine; }

constexpr int64_t scale_dtype_bytes(ScaleDtype dtype) {
    return dtype == ScaleDtype::fp32 ? 4 : dtype == ScaleDtype::e8m0 ? 1 : 2;
}

// The weight operand of matmul_segments. Row r starts at element r * ld of `data` (bf16,
// int8, or a nibble format two per byte with the even column in the low nibble, so ld is
// even). Integer formats: scale of row r, columns [c, c + group) at
// scales[r * scales_ld + c / group].
struct Weights {
    const void* data = nullptr;
    int64_t ld = 0;
    const void* scales = nullptr;
    int64_t scales_ld = 0;
    int64_t group = 0;
    ScaleDtype scale_dtype = ScaleDtype::fp32;
};

// Integer formats quantize the token operand per token and per group of columns of the
// weights it multiplies (symmetric int8, an fp32 scale each): a group's int32 dot product
// is then exact and scaled once. Their tables exist for these groups; segment columns of
// integer weights start and end on groups.
constexpr int64_t kIntegerGroups[] = {32, 64, 128};
constexpr int64_t kDefaultGroup = 128;

constexpr bool is_integer_group(int64_t group) { return group == 32 || group == 64 || group == 128; }

// The group a format's tables are looked up with when none is given.
constexpr int64_t default_group(Format format) { return is_codebook_format(format) ? 32 : kDefaultGroup; }

// The groups a format's tables exist for: the codebook formats only their block of 32
// (mxfp4's MX block, IQ4_NL's).
constexpr bool has_group(Format format, int64_t group) {
    return is_codebook_format(format) ? group == 32 : is_integer_group(group);
}

// Layout of the packed token operand, m tokens x k columns of bf16. The columns come in
// blocks of B = block_columns; a block stores every token's B columns in turn, tokens padded
// with zeros to m_pad, a multiple of token_multiple:
//     packed[(c / B) * (B * m_pad) + t * B + c % B]
// (the last block of a k that is not a multiple of B is padded with zero columns).
// block_columns == 0 means a single block of all k columns: plain row-major packed[t * k + c].
//   dot-product kernels (ref, avx2, avx512 for few tokens)  {0, 1}   plain
//   AMX B operand, pairs B[c / 2][2t + c % 2]               {2, 1}
//   AVX-512 token lanes, T tokens per vector                 {32 / T, T}
// Integer formats: int8 values and fp32 scales, one per token t and group b of the
// weights' G columns, in each table's own layout (ref_quant.cpp: plain, q[t * k + c] then
// scale[t * (k / G) + b]; avx512_quant.cpp: plain, interleaved by weight dword (with a
// bias term per token and group) or 16-token lanes, by token count; amx_quant.cpp: the
// AMX B operand's quads B[c / 4][4t + c % 4] {4, 1}, then scale[b * m + t]; for int4
// weights each 64 (or 32) columns in the order even columns, then odd).
struct TokenLayout {
    int64_t block_columns;
    int64_t token_multiple;
};

inline namespace NUMA_MOE_ISA_NS {

inline int64_t padded_tokens(TokenLayout layout, int64_t m) {
    return (m + layout.token_multiple - 1) / layout.token_multiple * layout.token_multiple;
}

inline int64_t packed_elements(TokenLayout layout, int64_t m, int64_t k) {
    if (layout.block_columns == 0) return m * k;
    const int64_t b = layout.block_columns;
    return (k + b - 1) / b * b * padded_tokens(layout, m);
}

inline int64_t packed_index(TokenLayout layout, int64_t m, int64_t k, int64_t t, int64_t c) {
    if (layout.block_columns == 0) return t * k + c;
    const int64_t b = layout.block_columns;
    return (c / b) * (b * padded_tokens(layout, m)) + t * b + c % b;
}

inline TokenLayout plain_layout(int64_t) { return TokenLayout{0, 1}; }
inline TokenLayout pairs_layout(int64_t) { return TokenLayout{2, 1}; }

}  // namespace NUMA_MOE_ISA_NS

// The expert's gated activation, as data: for gate and up sums g, u of one row and token
// (biases added, ExpertEpilogue),
//     g = min(g, limit),  u = clamp(u, -limit, limit)
//     act = g / (1 + exp(-alpha * g)) * (u + up_offset)
// The default is silu(g) * u (Mixtral, Qwen, DeepSeek: the same expression and bits as
// silu's x / (1 + exp(-x))); gpt-oss's clamped SwiGLU is {1.702, 7, 1}. A NaN stays NaN
// through the clamps.
struct Activation {
    float alpha = 1.0f;
    float limit = INFINITY;
    float up_offset = 0.0f;
};

// What silu_mul_pack applies besides the matmuls' sums: the layer's activation and the
// expert's gate / up biases (fp32 [I], indexed by intermediate row; null: none), added to
// the node-summed partials before the clamps.
struct ExpertEpilogue {
    Activation activation;
    const float* gate_bias = nullptr;
    const float* up_bias = nullptr;
};

struct KernelOps {
    Isa isa;
    const char* name;
    Format format;  // of the weights matmul_segments reads
    int64_t group;  // integer formats: the weights' group, which is also the token operand's
                    // quantization block (0 for bf16)

    // The layout gather and silu_mul_pack write, and matmul_segments reads, for m tokens.
    // Only the bindings (tests) look at it; the worker layer treats the operand as bytes.
    TokenLayout (*token_layout)(int64_t m);

    // Bytes of the packed token operand for m tokens of k columns (callers allocate with
    // 64-byte alignment); 2 * packed_elements(token_layout(m), m, k).
    size_t (*packed_bytes)(int64_t m, int64_t k);

    // packed <- rows token_index[0..m) of x (x[i * ldx + c], c < k), in this ISA's layout.
    void (*gather)(const bf16* x, int64_t ldx, const int64_t* token_index, int64_t m, int64_t k,
                   void* packed);

    // For each segment s, for each row r = s.row0 + j * s.row_stride (j < s.nrows) with
    // row_begin <= r < row_end, for each token t < m:
    //     out[r * ldo + t] += sum_{c in [s.k0, s.k1)} w[r][c] * tokens[t][c]
    // (integer formats: the int32 dot product of each group, times the weight and token
    // scales, summed in fp32 in increasing column order from 0, then added to out; formats
    // with minimums then add each segment's minimum terms, group_minimums.hpp). Threads
    // that own disjoint [row_begin, row_end) ranges may run concurrently on the same out
    // buffer.
    void (*matmul_segments)(const Weights& w, const Segment* segments, int64_t n_segments,
                            int64_t row_begin, int64_t row_end, const void* packed, int64_t m,
                            int64_t k, float* out, int64_t ldo);

    // The gate/up epilogue fused with the cross-node reduction: for rows i in
    // [i_begin, i_end) and tokens t < m,
    //     g = sum_p gate_parts[p][i * ld + t]   (p in order 0..n_parts-1: deterministic)
    //         (+ gate_bias[i])
    //     u = sum_p up_parts[p][i * ld + t] (+ up_bias[i])
    //     act[t][i] = bf16(activation(g, u))   (Activation above: silu(g) * u by default)
    // written into `packed`, the token operand (m tokens x k = i_total columns) of the down
    // projection. Disjoint [i_begin, i_end) ranges may run concurrently; i_begin and
    // i_end are multiples of row_align(*this) except i_end == i_total.
    void (*silu_mul_pack)(const float* const* gate_parts, const float* const* up_parts, int n_parts,
                          int64_t ld, int64_t i_begin, int64_t i_end, int64_t m, int64_t i_total,
                          const ExpertEpilogue& epilogue, void* packed);

    // The down epilogue fused with the cross-node reduction and the top-k combine: for
    // h in [h_begin, h_end), t < m,
    //     y[token_index[t] * ldy + h] += token_weight[t] * (sum_p parts[p][h * ld + t] (+ bias[h]))
    // (partials transposed back to row-major tokens; bias: the expert's down bias, fp32
    // [H], or null). Disjoint [h_begin, h_end) ranges may run concurrently.
    void (*combine_down)(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin,
                         int64_t h_end, int64_t m, const int64_t* token_index,
                         const float* token_weight, const float* bias, float* y, int64_t ldy);

    // The down epilogue of a single expert (expert_ffn): for h in [h_begin, h_end), t < m,
    //     out[t * ldo + h] = sum_p parts[p][h * ld + t] (+ bias[h])
    // stored, not added, as bf16 (round to nearest even) when out_bf16, else as fp32: the
    // transpose of combine_down without an fp32 staging pass. Disjoint [h_begin, h_end)
    // ranges may run concurrently.
    void (*store_down)(const float* const* parts, int n_parts, int64_t ld, int64_t h_begin, int64_t h_end,
                       int64_t m, const float* bias, void* out, int64_t ldo, bool out_bf16);
};

// Row ranges handed to threads are multiples of this: 32 rows (the epilogues' register
// tiles), and for integer formats whole groups, since silu_mul_pack quantizes a group's
// columns of the down projection's operand together.
constexpr int64_t kRowAlign = 32;
inline int64_t row_align(Format format, int64_t group) {
    return format != Format::bf16 && group > kRowAlign ? group : kRowAlign;
}
inline int64_t row_align(const KernelOps& ops) { return row_align(ops.format, ops.group); }

// The table for an ISA, weight format and (integer formats) group, or nullptr when this CPU
// (or OS) cannot run it, the ISA has no kernels for the format, or the format has no table
// for the group (has_group). The group is ignored for bf16; 0 means default_group(format).
const KernelOps* kernel_ops(Isa isa, Format format = Format::bf16, int64_t group = 0);

// The fastest ISA this machine runs, unless NUMA_MOE_ISA (one of isa_names()) names
// another; an unavailable choice there is an error (std::runtime_error).
Isa default_isa();

// The fastest ISA with kernels for a weight format on this machine (amx > avx512 > avx2 >
// ref), NUMA_MOE_ISA not consulted; never amx_model or an emulated build.
Isa fastest_isa(Format format);

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* isa);
// "ref, avx2_emulated, avx2, ...": the names parse_isa accepts, for error messages.
std::string isa_names();

// Why an ISA is not available here for a format ("" when it is).
std::string unavailable_reason(Isa isa, Format format = Format::bf16);

const char* format_name(Format format);
bool parse_format(const char* name, Format* format);
// "bf16, int8, ...": the names parse_format accepts, for error messages.
std::string format_names();

// The portable reference tables, always available (integer ones: nullptr for a group
// the format has no table for).
const KernelOps& ref_ops();
const KernelOps* ref_integer_ops(Format format, int64_t group);

}  // namespace numa_moe::kernels
