#include "engine/attention.hpp"

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <limits>
#include <vector>

#include "common/check.hpp"
#include "common/util.hpp"
#include "engine/pipeline.hpp"
#include "kernels/bf16.hpp"

namespace numa_moe::engine {

using kernels::AttentionOps;
using kernels::AttentionState;
using kernels::bf16;
using kernels::kMaxQueryBlock;

void merge_states(const float* const* m, const float* const* l, const float* const* o, int n_states, int64_t d,
                  float* out) {
    float top = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < n_states; ++p)
        if (*l[p] > 0.0f) top = std::fmax(top, *m[p]);
    float sum = 0.0f;
    for (int64_t c = 0; c < d; ++c) out[c] = 0.0f;
    for (int p = 0; p < n_states; ++p) {
        if (!(*l[p] > 0.0f)) continue;
        const float w = std::exp(*m[p] - top);
        sum += *l[p] * w;
        for (int64_t c = 0; c < d; ++c) out[c] += o[p][c] * w;
    }
    if (sum > 0.0f)
        for (int64_t c = 0; c < d; ++c) out[c] /= sum;
}

namespace {

// Units of work per participant (see DecodeRun::plan).
constexpr int kUnitsPerParticipant = 8;

// Positions [t, t + count) of (sequence b, KV head h), cache rows [row, row + count).
struct Run {
    int64_t bh;
    int64_t t;
    int64_t row;
    int64_t count;
};

// Work memory kept between calls on the calling thread (fresh buffers would page-fault).
struct AttentionArena {
    AlignedBuffer states;
    size_t states_capacity = 0;
    AlignedBuffer work;  // per participant: packed query blocks, then kernel scratch
    size_t work_capacity = 0;
};

class DecodeRun {
public:
    DecodeRun(Team& team, const AttentionOps& ops, const DecodeAttentionArgs& a, AttentionArena& arena)
        : team_(team), ops_(ops), a_(a) {
        const int n_nodes = team.n_nodes();
        node_offset_.assign(n_nodes + 1, 0);
        for (int n = 0; n < n_nodes; ++n) node_offset_[n + 1] = node_offset_[n] + team.node_participants()[n];
        slots_ = node_offset_[n_nodes];
        group_ = a.q_heads / a.kv_heads;
        bh_count_ = a.batch * a.kv_heads;
        state_floats_ = group_ * (a.head_dim + 2);
        q_blocks_ = (group_ + kMaxQueryBlock - 1) / kMaxQueryBlock;
        const size_t query_bytes = round_up(ops.query_bytes(kMaxQueryBlock, a.head_dim), 64);
        query_stride_ = query_bytes;
        work_stride_ = round_up(query_bytes * q_blocks_ + ops.scratch_bytes(kMaxQueryBlock, a.head_dim), 64);
        grow(arena.work, arena.work_capacity, work_stride_ * slots_);
        work_ = static_cast<unsigned char*>(arena.work.get());
        plan(n_nodes);
        grow(arena.states, arena.states_capacity, sizeof(float) * state_floats_ * bh_count_ * units_total_);
        states_ = static_cast<float*>(arena.states.get());
        touched_.assign(static_cast<size_t>(units_total_ * bh_count_), 0);
    }

    bool run(const std::function<bool()>& keep_going) {
        return team_.run(2, [this](int phase, const ThreadInfo& ti) {
            const int slot = node_offset_[ti.node] + ti.local;
            if (phase == 0) attend(slot, ti.node, ti.local);
            else merge(slot);
        }, keep_going);
    }

private:
    int64_t row_of(int64_t b, int64_t h, int64_t t) const {
        if (!a_.block_table) return (b * a_.kv_heads + h) * a_.capacity + t;
        const int64_t block = a_.block_table[b * a_.blocks_per_seq + t / a_.block_size];
        return (block * a_.kv_heads + h) * a_.block_size + t % a_.block_size;
    }

    // Runs per node (all on node 0 without a row map), then each node's runs cut into units
    // of about equal positions, a few per participant. A node's participants claim its
    // units as they go (a participant held up by another process on its CPU then does less
    // of the work, instead of holding up the call with a fixed share); each unit folds into
    // states of its own, so the result does not depend on who ran which unit.
    void plan(int n_nodes) {
        const RowNodes* map = a_.row_nodes;
        int64_t total = 0;
        std::vector<Range> windows(static_cast<size_t>(a_.batch));
        for (int64_t b = 0; b < a_.batch; ++b) {
            const int64_t len = a_.lengths[b];
            const int64_t start = a_.window > 0 && len > a_.window ? len - a_.window : 0;
            windows[b] = Range{start, len};
            total += (len - start) * a_.kv_heads;
        }
        // Runs of a few per participant, in whole kernel chunks, so that the units balance.
        int64_t cap = total / (kUnitsPerParticipant * static_cast<int64_t>(slots_));
        cap = (cap + kernels::kAttentionChunk - 1) / kernels::kAttentionChunk * kernels::kAttentionChunk;
        cap = cap < kernels::kAttentionChunk ? kernels::kAttentionChunk : cap > 2048 ? 2048 : cap;
        std::vector<std::vector<Run>> node_runs(static_cast<size_t>(n_nodes));
        for (int64_t b = 0; b < a_.batch; ++b) {
            for (int64_t h = 0; h < a_.kv_heads; ++h) {
                const int64_t bh = b * a_.kv_heads + h;
                for (int64_t t = windows[b].begin; t < windows[b].end;) {
                    const int64_t row = row_of(b, h, t);
                    int64_t count = windows[b].end - t;
                    if (a_.block_table && a_.block_size - t % a_.block_size < count)
                        count = a_.block_size - t % a_.block_size;
                    int node = 0;
                    if (map) {
                        const int64_t c = row % map->period;
                        node = map->node_of_class[c];
                        if (map->run[c] < count) count = map->run[c];
                    }
                    std::vector<Run>& runs = node_runs[node];
                    Run* last = runs.empty() ? nullptr : &runs.back();
                    if (last && last->bh == bh && last->row + last->count == row && last->count < cap) {
                        const int64_t add = count < cap - last->count ? count : cap - last->count;
                        last->count += add;
                        t += add;
                        continue;
                    }
                    if (count > cap) count = cap;
                    runs.push_back(Run{bh, t, row, count});
                    t += count;
                }
            }
        }
        runs_.clear();
        units_.clear();
        node_unit_offset_.assign(static_cast<size_t>(n_nodes) + 1, 0);
        for (int n = 0; n < n_nodes; ++n) {
            const std::vector<Run>& runs = node_runs[n];
            std::vector<int64_t> cost(runs.size());
            for (size_t i = 0; i < runs.size(); ++i) cost[i] = runs[i].count;
            const int parts = kUnitsPerParticipant * (node_offset_[n + 1] - node_offset_[n]);
            const int64_t first = static_cast<int64_t>(runs_.size());
            runs_.insert(runs_.end(), runs.begin(), runs.end());
            for (const Range& r : split_by_cost(cost, parts, 1))
                if (!r.empty()) units_.push_back(Range{first + r.begin, first + r.end});
            node_unit_offset_[n + 1] = static_cast<int>(units_.size());
        }
        units_total_ = static_cast<int64_t>(units_.size());
        next_unit_.reset(new std::atomic<int>[n_nodes]);
        for (int n = 0; n < n_nodes; ++n) next_unit_[n].store(node_unit_offset_[n], std::memory_order_relaxed);
        // The merge: (sequence, query head) pairs split over every participant.
        merge_split_ = split_even(a_.batch * a_.q_heads, slots_, 1);
    }

    float* state_of(int64_t unit, int64_t bh) const { return states_ + (unit * bh_count_ + bh) * state_floats_; }

    void attend(int slot, int node, int) {
        for (;;) {
            const int unit = next_unit_[node].fetch_add(1, std::memory_order_relaxed);
            if (unit >= node_unit_offset_[node + 1] || team_.aborted()) return;
            attend_unit(slot, unit);
        }
    }

    void attend_unit(int slot, int64_t unit) {
        const int64_t d = a_.head_dim, g = group_;
        unsigned char* work = work_ + work_stride_ * slot;
        void* scratch = work + query_stride_ * q_blocks_;
        int64_t current = -1;
        for (int64_t r = units_[unit].begin; r < units_[unit].end; ++r) {
            const Run& run = runs_[r];
            if (team_.aborted()) return;
            float* st = state_of(unit, run.bh);
            if (run.bh != current) {
                current = run.bh;
                // query heads h * g ... of sequence b are rows bh * g ... of q
                const bf16* q = a_.q + run.bh * g * d;
                for (int64_t qb = 0; qb < q_blocks_; ++qb) {
                    const int64_t i0 = qb * kMaxQueryBlock, gb = g - i0 < kMaxQueryBlock ? g - i0 : kMaxQueryBlock;
                    ops_.pack_query(q + i0 * d, gb, d, work + query_stride_ * qb);
                }
                if (!touched_[unit * bh_count_ + run.bh]) {
                    touched_[unit * bh_count_ + run.bh] = 1;
                    for (int64_t i = 0; i < g; ++i) st[i] = -std::numeric_limits<float>::infinity();
                    std::memset(st + g, 0, sizeof(float) * (g + g * d));
                }
            }
            // Runs of the unit that continue this one's rows go in the same call: a kernel
            // prefetches ahead only within its call. Not with several query blocks, each of
            // which reads the rows again, from cache while the call is short.
            int64_t count = run.count;
            while (q_blocks_ == 1 && r + 1 < units_[unit].end && runs_[r + 1].bh == run.bh &&
                   runs_[r + 1].row == run.row + count)
                count += runs_[++r].count;
            const bf16* k = a_.k + run.row * d;
            const bf16* v = a_.v + run.row * d;
            for (int64_t qb = 0; qb < q_blocks_; ++qb) {
                const int64_t i0 = qb * kMaxQueryBlock, gb = g - i0 < kMaxQueryBlock ? g - i0 : kMaxQueryBlock;
                const AttentionState state{st + i0, st + g + i0, st + 2 * g + i0 * d};
                ops_.attend(work + query_stride_ * qb, gb, d, k, v, count, a_.scale, state, scratch);
            }
        }
    }

    void merge(int slot) {
        const int64_t d = a_.head_dim, g = group_;
        std::vector<const float*> m, l, o;
        std::vector<float> result(static_cast<size_t>(d));
        for (int64_t unit = merge_split_[slot].begin; unit < merge_split_[slot].end; ++unit) {
            const int64_t b = unit / a_.q_heads, j = unit % a_.q_heads;
            const int64_t bh = b * a_.kv_heads + j / g, i = j % g;
            m.clear();
            l.clear();
            o.clear();
            for (int64_t u = 0; u < units_total_; ++u) {
                if (!touched_[u * bh_count_ + bh]) continue;
                const float* st = state_of(u, bh);
                m.push_back(st + i);
                l.push_back(st + g + i);
                o.push_back(st + 2 * g + i * d);
            }
            merge_states(m.data(), l.data(), o.data(), static_cast<int>(m.size()), d, result.data());
            if (a_.out_bf16) kernels::floats_to_bf16(result.data(), static_cast<bf16*>(a_.out) + unit * d, d);
            else std::memcpy(static_cast<float*>(a_.out) + unit * d, result.data(), sizeof(float) * d);
        }
    }

    Team& team_;
    const AttentionOps& ops_;
    const DecodeAttentionArgs& a_;
    std::vector<int> node_offset_;
    int slots_ = 0;
    int64_t group_ = 0, bh_count_ = 0, state_floats_ = 0, q_blocks_ = 0;
    size_t query_stride_ = 0, work_stride_ = 0;
    float* states_ = nullptr;
    unsigned char* work_ = nullptr;
    std::vector<uint8_t> touched_;  // [unit][bh]: the unit has a state for bh
    std::vector<Run> runs_;         // every node's runs, node by node
    std::vector<Range> units_;      // ranges of runs_, node by node
    std::vector<int> node_unit_offset_;
    int64_t units_total_ = 0;
    std::unique_ptr<std::atomic<int>[]> next_unit_;  // per node: the next unit to claim
    std::vector<Range> merge_split_;
};

}  // namespace

int auto_attention_threads(const DecodeAttentionArgs& a, int cpus) {
    int64_t pairs = 0;
    for (int64_t b = 0; b < a.batch; ++b) {
        const int64_t len = a.lengths[b];
        pairs += (a.window > 0 && len > a.window ? a.window : len) * a.kv_heads;
    }
    const int64_t wanted = (pairs + kAutoPositionsPerThread - 1) / kAutoPositionsPerThread;
    return static_cast<int>(wanted < 1 ? 1 : wanted > cpus ? cpus : wanted);
}

bool gqa_decode(WorkerPool* pool, const AttentionOps& ops, const DecodeAttentionArgs& args,
                const std::function<bool()>& keep_going) {
    if (args.batch == 0 || args.q_heads == 0) return true;
    Team team(pool);
    if (args.row_nodes) {
        int max_node = 0;
        for (int n : args.row_nodes->node_of_class) max_node = n > max_node ? n : max_node;
        NUMA_MOE_CHECK(max_node < team.n_nodes(), "the cache's segments name node ", max_node, " but the worker pool has ",
                       team.n_nodes(), " node(s)");
    }
    thread_local AttentionArena arena;
    DecodeRun run(team, ops, args, arena);
    return run.run(keep_going);
}

}  // namespace numa_moe::engine
