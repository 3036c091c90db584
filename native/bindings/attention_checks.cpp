#include "bindings/attention_checks.hpp"

#include <cmath>
#include <string>

#include "common/check.hpp"
#include "engine/attention.hpp"

namespace numa_moe::bindings {

int64_t attention_cache_rows(const py::array& k_cache) {
    return k_cache.shape(0) * k_cache.shape(1) * k_cache.shape(2);
}

const kernels::AttentionOps& attention_ops_for(const std::string& isa) {
    kernels::Isa parsed;
    NUMA_MOE_CHECK(kernels::parse_isa(isa.c_str(), &parsed), "unknown ISA '", isa, "': not one of ", kernels::isa_names());
    const kernels::AttentionOps* ops = kernels::attention_ops(parsed);
    NUMA_MOE_CHECK(ops, "isa '", isa, "' is not available for attention: ", kernels::attention_unavailable_reason(parsed));
    return *ops;
}

engine::DecodeAttentionArgs attention_args(const py::array& q, const py::array& k_cache, const py::array& v_cache,
                                           const py::array& lengths, const py::object& block_table,
                                           py::array& out, int64_t window, double scale) {
    check_array(q, "q", Kind::bf16, 3);
    check_array(k_cache, "k_cache", Kind::bf16, 4);
    check_array(v_cache, "v_cache", Kind::bf16, 4);
    for (int i = 0; i < 4; ++i)
        NUMA_MOE_CHECK(v_cache.shape(i) == k_cache.shape(i), "v_cache: shape ", shape_text(v_cache), " differs from k_cache's ",
                       shape_text(k_cache));
    engine::DecodeAttentionArgs a;
    a.batch = q.shape(0);
    a.q_heads = q.shape(1);
    a.head_dim = q.shape(2);
    a.kv_heads = k_cache.shape(1);
    NUMA_MOE_CHECK(k_cache.shape(3) == a.head_dim, "k_cache: head size ", k_cache.shape(3), " (shape ", shape_text(k_cache),
                   "), q has ", a.head_dim);
    NUMA_MOE_CHECK(kernels::attention_head_dim_supported(a.head_dim), "q: head size ", a.head_dim,
                   " has no kernels (64, 128 or 256)");
    NUMA_MOE_CHECK(a.kv_heads >= 1 && a.q_heads % a.kv_heads == 0, "q: ", a.q_heads,
                   " query heads are not a multiple of the cache's ", a.kv_heads, " KV heads (group size must divide)");
    check_array(lengths, "lengths", Kind::i64, 1);
    NUMA_MOE_CHECK(lengths.shape(0) == a.batch, "lengths: shape ", shape_text(lengths), ", expected (", a.batch,
                   ",) (one per sequence)");
    a.lengths = static_cast<const int64_t*>(lengths.data());
    int64_t capacity;
    if (block_table.is_none()) {
        NUMA_MOE_CHECK(k_cache.shape(0) == a.batch, "k_cache: shape ", shape_text(k_cache), ", expected [", a.batch,
                       ", kv_heads, T, D] (one cache per sequence of q)");
        a.capacity = capacity = k_cache.shape(2);
    } else {
        const py::array table = checked_array(block_table, "block_table", Kind::i64, 2);
        NUMA_MOE_CHECK(table.shape(0) == a.batch, "block_table: shape ", shape_text(table), ", expected [", a.batch,
                       ", max_blocks]");
        a.block_table = static_cast<const int64_t*>(table.data());
        a.blocks_per_seq = table.shape(1);
        a.block_size = k_cache.shape(2);
        capacity = a.blocks_per_seq * a.block_size;
    }
    for (int64_t b = 0; b < a.batch; ++b) {
        NUMA_MOE_CHECK(a.lengths[b] >= 0 && a.lengths[b] <= capacity, "lengths[", b, "] = ", a.lengths[b],
                       " is outside the cache's [0, ", capacity, "] positions");
        if (!a.block_table) continue;
        const int64_t used = (a.lengths[b] + a.block_size - 1) / a.block_size;
        for (int64_t j = 0; j < used; ++j) {
            const int64_t block = a.block_table[b * a.blocks_per_seq + j];
            NUMA_MOE_CHECK(block >= 0 && block < k_cache.shape(0), "block_table[", b, ", ", j, "] = ", block,
                           " is outside the cache's [0, ", k_cache.shape(0), ") blocks");
        }
    }
    NUMA_MOE_CHECK(window >= 0, "window: must be >= 0 (0 = no sliding window), got ", window);
    NUMA_MOE_CHECK(std::isfinite(scale), "scale: must be finite, got ", std::to_string(scale));
    a.window = window;
    a.scale = static_cast<float>(scale);
    const bool out_bf16 = has_kind(out, Kind::bf16);
    check_array(out, "out", out_bf16 ? Kind::bf16 : Kind::f32, 3, true);
    NUMA_MOE_CHECK(out.shape(0) == a.batch && out.shape(1) == a.q_heads && out.shape(2) == a.head_dim, "out: shape ",
                   shape_text(out), ", expected ", shape_text(q));
    a.q = static_cast<const kernels::bf16*>(q.data());
    a.k = static_cast<const kernels::bf16*>(k_cache.data());
    a.v = static_cast<const kernels::bf16*>(v_cache.data());
    a.out = out.mutable_data();
    a.out_bf16 = out_bf16;
    return a;
}

}  // namespace numa_moe::bindings
