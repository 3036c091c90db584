// GQA decode attention over a KV cache, split across the nodes that hold its pages.
//
// Operands (bf16 = raw uint16_t bit patterns):
//   q        q[(b * q_heads + j) * d + c]: one new query per sequence b and query head j;
//            query head j reads KV head j / group (group = q_heads / kv_heads)
//   k, v     contiguous: [batch, kv_heads, capacity, d], row (b * kv_heads + h) * capacity + t
//            paged:      [n_blocks, kv_heads, block_size, d], position t of sequence b in
//                        block block_table[b * blocks_per_seq + t / block_size], row
//                        (block * kv_heads + h) * block_size + t % block_size
//   lengths  positions [0, lengths[b]) of sequence b are attended, the last `window` of them
//            when window > 0 (a sliding window); a sequence of length 0 gets a zero output
//   out      out[(b * q_heads + j) * d + c], bf16 or fp32
//
// Work: the positions of every (sequence, KV head) are cut into runs of consecutive cache
// rows on one node (row_nodes: the cache's pages; none: one node) and at most a chunk
// long; each node's runs are split over that node's participants by length, and each
// participant folds its runs into its own softmax state (m, l, o) per (sequence, KV head).
// After a barrier the states are merged by the log-sum-exp rule in a fixed order (node,
// then participant): deterministic for a given team.
#pragma once

#include <cstdint>
#include <functional>

#include "common/segment.hpp"
#include "common/worker_pool.hpp"
#include "kernels/attention_api.hpp"

namespace numa_moe::engine {

struct DecodeAttentionArgs {
    const kernels::bf16* q = nullptr;
    int64_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
    const kernels::bf16* k = nullptr;
    const kernels::bf16* v = nullptr;
    int64_t capacity = 0;                   // contiguous form
    const int64_t* block_table = nullptr;   // paged form when not null
    int64_t blocks_per_seq = 0, block_size = 0;
    const int64_t* lengths = nullptr;
    int64_t window = 0;
    float scale = 0.0f;
    void* out = nullptr;
    bool out_bf16 = true;
    const RowNodes* row_nodes = nullptr;  // node of each cache row, or null
};

// The log-sum-exp merge of softmax states (m_p, l_p, o_p), p in order: M = max m_p,
// l = sum l_p e^(m_p - M), o = sum o_p e^(m_p - M); states with l_p = 0 are empty and
// skipped. Writes o / l (zeros when every state is empty) into out[0, d).
void merge_states(const float* const* m, const float* const* l, const float* const* o, int n_states, int64_t d,
                  float* out);

// Threads worth waking for a call on one node: one per kAutoPositionsPerThread attended
// (position, KV head) pairs, at least 1, at most `cpus` (a short context is done before
// another thread would be awake).
constexpr int64_t kAutoPositionsPerThread = 2048;
int auto_attention_threads(const DecodeAttentionArgs& args, int cpus);

// Runs on `pool` (null: the calling thread alone). Returns false when keep_going aborted.
bool gqa_decode(WorkerPool* pool, const kernels::AttentionOps& ops, const DecodeAttentionArgs& args,
                const std::function<bool()>& keep_going);

}  // namespace numa_moe::engine
