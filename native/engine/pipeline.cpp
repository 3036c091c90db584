// The expert FFN pipeline (see pipeline.hpp). Baseline x86-64 code: all ISA-specific work
// goes through KernelOps.
#include "engine/pipeline.hpp"

#include <algorithm>
#include <atomic>
#include <memory>
#include <cstring>
#include <stdexcept>

#include "common/check.hpp"
#include "kernels/bf16.hpp"

namespace numa_moe::engine {
namespace {

constexpr size_t kAlign = 64;

// Rows one kernel call covers at most, so that a long phase can notice an abort.
constexpr int64_t kRowsPerCall = 1024;

// Token bytes up to which the calling thread gathers a group alone, before the run.
constexpr int64_t kCallerGatherBytes = 256 * 1024;

// Token ranges handed to threads by a token split are multiples of this: the widest
// token vector of the AVX-512 lanes and the AMX tiles, so no thread's block pads more than
// one vector.
constexpr int64_t kTokenAlign = 16;

bool is_whole_matrix(const std::vector<Segment>& segments, int64_t rows, int64_t cols) {
    return segments.size() == 1 && segments[0].row0 == 0 && segments[0].row_stride == 1 &&
           segments[0].nrows == rows && segments[0].k0 == 0 && segments[0].k1 == cols;
}

// Row chunks per participant that a node's threads claim in turn. Several, so that a thread
// the machine slows down (another tenant, an interrupt) leaves the rest of its share to the
// others instead of holding up the step; few, so that each chunk's row blocks still stream
// long enough for the kernels' prefetch to run ahead.
constexpr int kChunksPerParticipant = 4;

// Splits the rows of one node's segments over its participants by weight elements, in
// multiples of `align` rows; `elements` receives the node's total.
std::vector<Range> split_node_rows(const std::vector<Segment>& segments, int64_t rows, int64_t cols,
                                   int participants, int64_t align, int64_t* elements) {
    if (is_whole_matrix(segments, rows, cols)) {
        *elements = rows * cols;
        return split_even(rows, participants, align);
    }
    std::vector<int64_t> cost(rows, 0);
    for (const Segment& s : segments)
        for (int64_t j = 0; j < s.nrows; ++j) cost[s.row0 + j * s.row_stride] += s.k1 - s.k0;
    *elements = 0;
    for (int64_t c : cost) *elements += c;
    return split_by_cost(cost, participants, align);
}

// The silu rows of a step: whole groups of the widest integer group among its experts.
int64_t step_row_align(const std::vector<ExpertTask>& tasks) {
    int64_t align = kernels::kRowAlign;
    for (const ExpertTask& t : tasks) align = std::max(align, kernels::row_align(*t.ops));
    return align;
}

}  // namespace

int64_t weight_bytes(const MatrixPart& part, int64_t elements) {
    switch (part.format) {
        case kernels::Format::bf16: return elements * 2;
        case kernels::Format::int8:
        case kernels::Format::int4:
        case kernels::Format::mxfp4:
        case kernels::Format::iq4nl:
        case kernels::Format::int4_affine: {
            const int64_t values = part.format == kernels::Format::int8 ? elements : elements / 2;
            return values + elements / std::max<int64_t>(part.weights.group, 1) *
                                kernels::scale_values_per_group(part.format) *
                                kernels::scale_dtype_bytes(part.weights.scale_dtype);
        }
    }
    return 0;
}

void check_one_format(const std::string& what, const std::array<kernels::Format, 3>& formats,
                      const std::array<int64_t, 3>& groups) {
    NUMA_MOE_CHECK(formats[1] == formats[0] && formats[2] == formats[0], what,
                   ": gate, up and down must share one weight format, got ", kernels::format_name(formats[0]), ", ",
                   kernels::format_name(formats[1]), " and ", kernels::format_name(formats[2]));
    NUMA_MOE_CHECK(formats[0] == kernels::Format::bf16 || (groups[1] == groups[0] && groups[2] == groups[0]), what,
                   ": gate, up and down must share one group, got ", groups[0], ", ", groups[1], " and ", groups[2]);
}

void prepare_matrix(MatrixPart& part, const std::vector<int>& node_participants, const std::string& what,
                    bool verify_partition) {
    const size_t n_nodes = node_participants.size();
    NUMA_MOE_CHECK(part.node_segments.size() == n_nodes, what, ": segments given for ", part.node_segments.size(),
                   " nodes, the worker pool has ", n_nodes);
    for (size_t n = 0; n < n_nodes; ++n) {
        const std::string name = message(what, " segments of node ", n);
        check_segments(part.node_segments[n].data(), static_cast<int64_t>(part.node_segments[n].size()), part.rows,
                       part.cols, name);
        if (part.format != kernels::Format::bf16)
            check_block_edges(part.node_segments[n].data(), static_cast<int64_t>(part.node_segments[n].size()),
                              part.cols, part.weights.group, name);
    }
    if (verify_partition) check_partition(part.node_segments, part.rows, part.cols, what);
    const int64_t align = kernels::row_align(part.format, part.weights.group);
    part.thread_rows.assign(n_nodes, {});
    part.node_chunks.assign(n_nodes, {});
    part.node_bytes.assign(n_nodes, 0);
    for (size_t n = 0; n < n_nodes; ++n) {
        int64_t elements = 0;
        part.thread_rows[n] = split_node_rows(part.node_segments[n], part.rows, part.cols, node_participants[n],
                                              align, &elements);
        part.node_bytes[n] = weight_bytes(part, elements);
        for (const Range& chunk : split_node_rows(part.node_segments[n], part.rows, part.cols,
                                                  node_participants[n] * kChunksPerParticipant, align,
                                                  &elements))
            if (!chunk.empty()) part.node_chunks[n].push_back(chunk);
    }
    part.even_split =
        n_nodes == 1 && part.thread_rows[0] == split_even(part.rows, node_participants[0], align);
}

int64_t token_split_block(int64_t m, int participants, bool one_node) {
    if (!one_node || m < token_split_min_tokens(participants)) return 0;
    return kTokenBlock;
}

std::vector<Range> token_blocks(int64_t m, int64_t block) {
    return split_even(m, static_cast<int>((m + block - 1) / block), kTokenAlign);
}

Team::Team(WorkerPool* pool) : pool_(pool) {
    if (!pool_) {
        node_participants_ = {1};
        participants_ = 1;
        return;
    }
    for (int n = 0; n < pool_->n_nodes(); ++n) node_participants_.push_back(pool_->participants_of(n));
    participants_ = pool_->participants();
}

bool Team::run(int n_phases, const WorkerPool::Job& job, const std::function<bool()>& keep_going) {
    if (pool_) return pool_->run(n_phases, job, keep_going);
    const ThreadInfo self{0, 0, 0, -1};
    for (int phase = 0; phase < n_phases; ++phase) {
        if (keep_going && !keep_going()) return false;
        job(phase, self);
    }
    return true;
}

namespace {

enum PhaseKind { kGather, kGateUp, kSilu, kDown, kEpilogue };

// One call of run_step: the plan (arena offsets, groups) and the phase bodies.
class StepRun {
public:
    StepRun(Team& team, const std::vector<ExpertTask>& tasks, const StepShape& shape, const StepOutput& output,
            StepArena& arena, StepTimes* times)
        : team_(team), tasks_(tasks), shape_(shape), output_(output), arena_(arena), times_(times),
          n_nodes_(team.n_nodes()),
          silu_ranges_(split_even(shape.intermediate, team.participants(), step_row_align(tasks))),
          h_ranges_(split_even(shape.hidden, team.participants(), kernels::kRowAlign)),
          y_ld_(static_cast<int64_t>(spread_row_bytes(sizeof(float) * shape.hidden) / sizeof(float))) {}

    bool run(const std::function<bool()>& keep_going);

private:
    struct Placed {
        size_t packed_x, packed_act;  // bytes into arena.packed
        size_t partials;              // floats into each node's partial arena
        size_t down_offset;           // floats from there to the down partial
        int64_t token_block;          // > 0: split by tokens (token_split_block), blocks of at most this
    };
    struct Group {
        size_t begin, end;
        bool fused;  // silu and the epilogue run on each thread's own matmul rows
        bool first, last;
        size_t items_begin = 0;          // the token blocks of its token-split experts in items_
        std::vector<Range> item_split;   // per participant, items relative to items_begin
    };
    struct TokenItem {
        size_t task;
        Range tokens;
    };
    // A unit of work the threads of a node claim in turn (row-split experts): rows `rows` of
    // task a's gate, its up, or both with their silu (fused groups); of its down; or, in a
    // fused group, a range of output columns over all its experts (down, then combine).
    enum class UnitKind { gate, up, gate_up_silu, down, down_combine };
    struct Unit {
        size_t a;
        UnitKind kind;
        Range rows;
    };
    enum ClaimedPhase { kGateUpUnits = 0, kDownUnits = 1 };

    void plan();
    void plan_units(const Group& g);
    template <class Fn>
    void claim(ClaimedPhase phase, const ThreadInfo& ti, Fn&& fn);
    void grow_arena(size_t packed_bytes, size_t partial_floats);
    bool run_group(const Group& g, const std::function<bool()>& keep_going);
    void gather(const ExpertTask& task, const Placed& p) const;
    void matmul_rows(const ExpertTask& task, const MatrixPart& mp, const std::vector<Segment>& segs, Range rows,
                     const void* tokens, int64_t m, int64_t k, float* out, int64_t ldo) const;
    void token_block(size_t a, Range tokens, const ThreadInfo& ti);
    void gate_up(const Group& g, const ThreadInfo& ti);
    void silu(Range rows, size_t a) const;
    void down(const Group& g, const ThreadInfo& ti);
    void epilogue(const Group& g, Range h) const;
    void clear_y(Range h) const;
    void combine(size_t a, Range h) const;
    void write_out(Range h) const;
    float* partial(int node, size_t a, int which) const;
    const float* const* partial_ptrs(size_t a, int which) const { return &part_ptrs_[(a * 3 + which) * n_nodes_]; }
    uint8_t* packed() const { return static_cast<uint8_t*>(arena_.packed.get()); }

    Team& team_;
    const std::vector<ExpertTask>& tasks_;
    const StepShape& shape_;
    const StepOutput& output_;
    StepArena& arena_;
    StepTimes* times_;
    const int n_nodes_;
    const std::vector<Range> silu_ranges_, h_ranges_;
    const int64_t y_ld_;  // floats between the rows of arena.y (spread_row_bytes)
    std::vector<Placed> placed_;
    std::vector<Group> groups_;
    std::vector<const float*> part_ptrs_;  // [task][gate, up, down][node]
    std::vector<TokenItem> items_;
    std::vector<Unit> units_[2];                      // of the running group, per phase: node n's from
    std::vector<size_t> unit_begin_[2];               // unit_begin_[phase][n] to unit_begin_[phase][n + 1]
    std::unique_ptr<std::atomic<int64_t>[]> next_unit_;  // [phase * n_nodes + node]: next unclaimed
    size_t token_work_stride_ = 0;         // bytes of arena.token_work per participant

    // A token block's own operands: packed x, packed activation, gate, up and down partials.
    size_t token_work_bytes(const ExpertTask& t, int64_t block) const {
        return round_up(t.ops->packed_bytes(block, shape_.hidden), kAlign) +
               round_up(t.ops->packed_bytes(block, shape_.intermediate), kAlign) +
               round_up(sizeof(float) * static_cast<size_t>(block * (2 * shape_.intermediate + shape_.hidden)), kAlign);
    }
};

bool even_split(const ExpertParts& p) { return p.gate.even_split && p.up.even_split && p.down.even_split; }

void StepRun::plan() {
    const int64_t H = shape_.hidden, I = shape_.intermediate;
    placed_.resize(tasks_.size());
    size_t packed_total = 0, part_floats = 0, max_part_floats = 0;
    const size_t budget_floats = static_cast<size_t>(shape_.group_budget_bytes) / sizeof(float);
    size_t group_begin = 0;
    for (size_t a = 0; a < tasks_.size(); ++a) {
        const ExpertTask& t = tasks_[a];
        // A token-split expert keeps its operands in its threads' token blocks: the step
        // holds only its down partial, for the epilogue.
        const int64_t block = token_split_block(t.m, team_.participants(), n_nodes_ == 1);
        placed_[a].token_block = block;
        placed_[a].down_offset = block > 0 ? 0 : static_cast<size_t>(2 * I * t.m);
        placed_[a].packed_x = packed_total;
        if (block == 0) packed_total += round_up(t.ops->packed_bytes(t.m, H), kAlign);
        placed_[a].packed_act = packed_total;
        if (block == 0) packed_total += round_up(t.ops->packed_bytes(t.m, I), kAlign);
        const size_t need = round_up(placed_[a].down_offset + static_cast<size_t>(t.m * H), kAlign / sizeof(float));
        if (part_floats > 0 && part_floats + need > budget_floats) {
            groups_.push_back(Group{group_begin, a, false, false, false, 0, {}});
            group_begin = a;
            part_floats = 0;
        }
        placed_[a].partials = part_floats;
        part_floats += need;
        max_part_floats = std::max(max_part_floats, part_floats);
    }
    groups_.push_back(Group{group_begin, tasks_.size(), false, false, false, 0, {}});
    // Fused phases run each thread's own rows: every expert of the group must split its
    // rows alike (the same even split; formats with other alignments differ).
    for (Group& g : groups_) {
        g.fused = n_nodes_ == 1;
        const ExpertParts& first = *tasks_[g.begin].parts;
        for (size_t a = g.begin; a < g.end; ++a) {
            const ExpertParts& p = *tasks_[a].parts;
            g.fused = g.fused && even_split(p) && p.gate.thread_rows == first.gate.thread_rows &&
                      p.down.thread_rows == first.down.thread_rows && p.gate.node_chunks == p.up.node_chunks &&
                      p.down.node_chunks == first.down.node_chunks;
        }
    }
    groups_.front().first = true;
    groups_.back().last = true;
    // Token-split experts: their blocks are fixed by m alone (so a token's sums do not depend
    // on the thread count), and the blocks of all such experts of a group are dealt to the
    // threads by tokens.
    size_t work_bytes = 0;
    for (Group& g : groups_) {
        g.items_begin = items_.size();
        std::vector<int64_t> cost;
        for (size_t a = g.begin; a < g.end; ++a) {
            const ExpertTask& t = tasks_[a];
            if (placed_[a].token_block == 0) continue;
            for (const Range& b : token_blocks(t.m, placed_[a].token_block)) {
                items_.push_back(TokenItem{a, b});
                cost.push_back(b.end - b.begin);
                work_bytes = std::max(work_bytes, token_work_bytes(t, b.end - b.begin));
            }
        }
        g.item_split = split_by_cost(cost, team_.participants(), 1);
    }
    grow(arena_.token_work, arena_.token_work_capacity, work_bytes * team_.participants());
    token_work_stride_ = work_bytes;
    grow_arena(packed_total, max_part_floats);
    part_ptrs_.resize(tasks_.size() * 3 * n_nodes_);
    for (size_t a = 0; a < tasks_.size(); ++a)
        for (int which = 0; which < 3; ++which)
            for (int n = 0; n < n_nodes_; ++n) part_ptrs_[(a * 3 + which) * n_nodes_ + n] = partial(n, a, which);
}

void StepRun::grow_arena(size_t packed_bytes, size_t partial_floats) {
    grow(arena_.packed, arena_.packed_capacity, packed_bytes);
    arena_.node_partials.resize(n_nodes_);
    arena_.node_partials_capacity.resize(n_nodes_, 0);
    for (int n = 0; n < n_nodes_; ++n)
        grow(arena_.node_partials[n], arena_.node_partials_capacity[n], partial_floats * sizeof(float));
    if (!output_.store)
        grow(arena_.y, arena_.y_capacity, static_cast<size_t>(shape_.n_tokens * y_ld_) * sizeof(float));
}

// Node `node`'s partial of task a: which = 0 gate [I, m], 1 up [I, m], 2 down [H, m].
float* StepRun::partial(int node, size_t a, int which) const {
    float* base = static_cast<float*>(arena_.node_partials[node].get()) + placed_[a].partials;
    return which == 2 ? base + placed_[a].down_offset : base + which * shape_.intermediate * tasks_[a].m;
}

void StepRun::gather(const ExpertTask& task, const Placed& p) const {
    task.ops->gather(shape_.x, shape_.ldx, task.x_rows, task.m, shape_.hidden, packed() + p.packed_x);
}

// Rows `rows` of one matrix over the segments `segs`: out zeroed for tokens [0, m), then
// accumulated, in calls of at most kRowsPerCall rows.
void StepRun::matmul_rows(const ExpertTask& task, const MatrixPart& mp, const std::vector<Segment>& segs, Range rows,
                          const void* tokens, int64_t m, int64_t k, float* out, int64_t ldo) const {
    if (rows.empty()) return;
    if (ldo == m)  // rows back to back: one memset, not one a row (decode: m = 1)
        std::memset(out + rows.begin * ldo, 0, sizeof(float) * (rows.end - rows.begin) * m);
    else
        for (int64_t r = rows.begin; r < rows.end; ++r) std::memset(out + r * ldo, 0, sizeof(float) * m);
    for (int64_t r = rows.begin; r < rows.end && !team_.aborted(); r += kRowsPerCall)
        task.ops->matmul_segments(mp.weights, segs.data(), static_cast<int64_t>(segs.size()), r,
                                  std::min(rows.end, r + kRowsPerCall), tokens, m, k, out, ldo);
}

// Tokens [tb.begin, tb.end) of expert a through gate/up, silu and down while their operands
// are in this thread's caches: the weights stream once per block, the activation is
// consumed by the down projection right after it is written. The down partial goes to the
// step's arena (the epilogue combines it) or, for a stored output, straight to out.
void StepRun::token_block(size_t a, Range tb, const ThreadInfo& ti) {
    const ExpertTask& t = tasks_[a];
    const int64_t H = shape_.hidden, I = shape_.intermediate, mb = tb.end - tb.begin;
    uint8_t* work = static_cast<uint8_t*>(arena_.token_work.get()) + token_work_stride_ * ti.global;
    uint8_t* px = work;
    uint8_t* pact = px + round_up(t.ops->packed_bytes(mb, H), kAlign);
    float* gate = reinterpret_cast<float*>(pact + round_up(t.ops->packed_bytes(mb, I), kAlign));
    float* up = gate + I * mb;
    float* down = up + I * mb;
    t.ops->gather(shape_.x, shape_.ldx, t.x_rows + tb.begin, mb, H, px);
    const ExpertParts& p = *t.parts;
    matmul_rows(t, p.gate, p.gate.node_segments[0], Range{0, I}, px, mb, H, gate, mb);
    matmul_rows(t, p.up, p.up.node_segments[0], Range{0, I}, px, mb, H, up, mb);
    if (team_.aborted()) return;
    const float* g = gate;
    const float* u = up;
    t.ops->silu_mul_pack(&g, &u, 1, mb, 0, I, mb, I, p.epilogue, pact);
    if (output_.store) {
        matmul_rows(t, p.down, p.down.node_segments[0], Range{0, H}, pact, mb, I, down, mb);
        const size_t element = output_.out_bf16 ? sizeof(bf16) : sizeof(float);
        const float* d = down;
        t.ops->store_down(&d, 1, mb, 0, H, mb, p.down_bias,
                          static_cast<uint8_t*>(output_.out) + tb.begin * H * element, H, output_.out_bf16);
        return;
    }
    matmul_rows(t, p.down, p.down.node_segments[0], Range{0, H}, pact, mb, I, partial(0, a, 2) + tb.begin, t.m);
}

void StepRun::gate_up(const Group& g, const ThreadInfo& ti) {
    const Range mine = g.item_split[ti.global];
    for (int64_t i = mine.begin; i < mine.end && !team_.aborted(); ++i) {
        const TokenItem& item = items_[g.items_begin + i];
        if (!item.tokens.empty()) token_block(item.task, item.tokens, ti);
    }
    claim(kGateUpUnits, ti, [&](const Unit& u) {
        const ExpertTask& t = tasks_[u.a];
        const uint8_t* tokens = packed() + placed_[u.a].packed_x;
        const ExpertParts& p = *t.parts;
        if (u.kind != UnitKind::up)
            matmul_rows(t, p.gate, p.gate.node_segments[ti.node], u.rows, tokens, t.m, shape_.hidden,
                        partial(ti.node, u.a, 0), t.m);
        if (u.kind != UnitKind::gate)
            matmul_rows(t, p.up, p.up.node_segments[ti.node], u.rows, tokens, t.m, shape_.hidden,
                        partial(ti.node, u.a, 1), t.m);
        if (u.kind == UnitKind::gate_up_silu && !team_.aborted()) silu(u.rows, u.a);
    });
}

// The units of group g, per node, and their counters at 0 (before the group's run: the
// pool's start of a run orders these writes before every thread's reads).
void StepRun::plan_units(const Group& g) {
    for (int phase = 0; phase < 2; ++phase) {
        units_[phase].clear();
        unit_begin_[phase].assign(1, 0);
    }
    for (int n = 0; n < n_nodes_; ++n) {
        for (size_t a = g.begin; a < g.end; ++a) {
            if (placed_[a].token_block > 0) continue;
            const ExpertParts& p = *tasks_[a].parts;
            if (g.fused) {
                for (const Range& c : p.gate.node_chunks[n]) units_[kGateUpUnits].push_back(Unit{a, UnitKind::gate_up_silu, c});
                continue;
            }
            for (const Range& c : p.gate.node_chunks[n]) units_[kGateUpUnits].push_back(Unit{a, UnitKind::gate, c});
            for (const Range& c : p.up.node_chunks[n]) units_[kGateUpUnits].push_back(Unit{a, UnitKind::up, c});
            for (const Range& c : p.down.node_chunks[n]) units_[kDownUnits].push_back(Unit{a, UnitKind::down, c});
        }
        if (g.fused)
            for (const Range& c : tasks_[g.begin].parts->down.node_chunks[n])
                units_[kDownUnits].push_back(Unit{g.begin, UnitKind::down_combine, c});
        for (int phase = 0; phase < 2; ++phase) unit_begin_[phase].push_back(units_[phase].size());
    }
    if (!next_unit_) next_unit_ = std::make_unique<std::atomic<int64_t>[]>(2 * static_cast<size_t>(n_nodes_));
    for (int i = 0; i < 2 * n_nodes_; ++i) next_unit_[i].store(0, std::memory_order_relaxed);
}

// Runs fn on the units of this thread's node that it claims, one at a time, until none is
// left. Every unit writes its own rows or columns, the same whichever thread claims it, so
// the results do not depend on the claiming order.
template <class Fn>
void StepRun::claim(ClaimedPhase phase, const ThreadInfo& ti, Fn&& fn) {
    const size_t begin = unit_begin_[phase][ti.node], count = unit_begin_[phase][ti.node + 1] - begin;
    std::atomic<int64_t>& next = next_unit_[phase * n_nodes_ + ti.node];
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < static_cast<int64_t>(count) && !team_.aborted();
         i = next.fetch_add(1, std::memory_order_relaxed))
        fn(units_[phase][begin + static_cast<size_t>(i)]);
}

void StepRun::silu(Range rows, size_t a) const {
    if (rows.empty()) return;
    const ExpertTask& t = tasks_[a];
    t.ops->silu_mul_pack(partial_ptrs(a, 0), partial_ptrs(a, 1), n_nodes_, t.m, rows.begin, rows.end, t.m,
                         shape_.intermediate, t.parts->epilogue, packed() + placed_[a].packed_act);
}

void StepRun::down(const Group& g, const ThreadInfo& ti) {
    const auto down_rows = [&](size_t a, Range rows) {
        const ExpertTask& t = tasks_[a];
        matmul_rows(t, t.parts->down, t.parts->down.node_segments[ti.node], rows, packed() + placed_[a].packed_act, t.m,
                    shape_.intermediate, partial(ti.node, a, 2), t.m);
    };
    claim(kDownUnits, ti, [&](const Unit& u) {
        if (u.kind == UnitKind::down) {
            down_rows(u.a, u.rows);
            return;
        }
        // Fused: the down rows of every expert of the group are cut alike, and each expert's
        // partial is combined right after its down projection, while it is still in this
        // thread's caches (the same additions in the same expert order as the epilogue).
        const Range h = u.rows;
        const bool combine_here = !output_.store;
        if (combine_here && g.first) clear_y(h);
        for (size_t a = g.begin; a < g.end && !team_.aborted(); ++a) {
            if (placed_[a].token_block == 0) down_rows(a, h);  // token-split experts ran theirs in the gate/up phase
            if (combine_here) combine(a, h);
        }
        if (team_.aborted()) return;
        if (combine_here && g.last) write_out(h);
        if (output_.store) epilogue(g, h);
    });
}

// y = 0, columns h (before the first group's combines).
void StepRun::clear_y(Range h) const {
    if (h.empty()) return;
    float* y = static_cast<float*>(arena_.y.get());
    for (int64_t t = 0; t < shape_.n_tokens; ++t)
        std::memset(y + t * y_ld_ + h.begin, 0, sizeof(float) * (h.end - h.begin));
}

// y[token] += weight * (sum of the node partials of expert a), columns h.
void StepRun::combine(size_t a, Range h) const {
    if (h.empty()) return;
    const ExpertTask& t = tasks_[a];
    t.ops->combine_down(partial_ptrs(a, 2), n_nodes_, t.m, h.begin, h.end, t.m, t.y_rows, t.y_weights,
                        t.parts->down_bias, static_cast<float*>(arena_.y.get()), y_ld_);
}

// y -> out, columns h (after the last group).
void StepRun::write_out(Range h) const {
    const int64_t H = shape_.hidden;
    const float* y = static_cast<const float*>(arena_.y.get());
    for (int64_t t = 0; t < shape_.n_tokens; ++t) {
        const float* y_row = y + t * y_ld_ + h.begin;
        if (output_.out_bf16)
            kernels::floats_to_bf16(y_row, static_cast<bf16*>(output_.out) + t * H + h.begin, h.end - h.begin);
        else
            std::memcpy(static_cast<float*>(output_.out) + t * H + h.begin, y_row, sizeof(float) * (h.end - h.begin));
    }
}

// Output columns h of the group: store (one expert) or add into y, y -> out after the last group.
void StepRun::epilogue(const Group& g, Range h) const {
    if (h.empty()) return;
    if (output_.store) {
        if (placed_[g.begin].token_block > 0) return;  // stored by its token blocks
        const ExpertTask& t = tasks_[g.begin];
        t.ops->store_down(partial_ptrs(g.begin, 2), n_nodes_, t.m, h.begin, h.end, t.m, t.parts->down_bias,
                          output_.out, shape_.hidden, output_.out_bf16);
        return;
    }
    if (g.first) clear_y(h);
    for (size_t a = g.begin; a < g.end; ++a) combine(a, h);
    if (g.last) write_out(h);
}

bool StepRun::run_group(const Group& g, const std::function<bool()>& keep_going) {
    // A small gather (decode: a few tokens per expert) is done by the caller before the
    // run, which saves a phase and its barrier; a large one (prefill) is spread.
    std::vector<PhaseKind> phases;
    int64_t gather_bytes = 0;
    for (size_t a = g.begin; a < g.end; ++a)
        if (placed_[a].token_block == 0) gather_bytes += tasks_[a].m * shape_.hidden * 2;
    if (gather_bytes > kCallerGatherBytes) {
        phases.push_back(kGather);
    } else {
        for (size_t a = g.begin; a < g.end; ++a)
            if (placed_[a].token_block == 0) gather(tasks_[a], placed_[a]);
    }
    plan_units(g);
    phases.push_back(kGateUp);
    if (!g.fused) phases.push_back(kSilu);
    phases.push_back(kDown);
    if (!g.fused) phases.push_back(kEpilogue);
    const size_t participants = static_cast<size_t>(team_.participants());
    return team_.run(static_cast<int>(phases.size()), [&](int phase, const ThreadInfo& ti) {
        const int64_t start = now_ns();
        const PhaseKind kind = phases[phase];
        switch (kind) {
            case kGather:
                for (size_t a = g.begin + ti.global; a < g.end; a += participants)
                    if (placed_[a].token_block == 0) gather(tasks_[a], placed_[a]);
                break;
            case kGateUp: gate_up(g, ti); break;
            case kSilu:
                for (size_t a = g.begin; a < g.end; ++a)
                    if (placed_[a].token_block == 0) silu(silu_ranges_[ti.global], a);
                break;
            case kDown: down(g, ti); break;
            case kEpilogue: epilogue(g, h_ranges_[ti.global]); break;
        }
        if (!times_) return;
        const int64_t elapsed = now_ns() - start;
        times_->phase_ns[static_cast<size_t>(ti.global) * kPhaseKinds + kind] += elapsed;
        if (kind == kGateUp || kind == kDown) times_->busy_ns[ti.global] += elapsed;
    }, keep_going);
}

bool StepRun::run(const std::function<bool()>& keep_going) {
    if (times_) {
        times_->busy_ns.assign(team_.participants(), 0);
        times_->phase_ns.assign(static_cast<size_t>(team_.participants()) * kPhaseKinds, 0);
    }
    if (tasks_.empty()) {
        const size_t element = output_.out_bf16 ? sizeof(bf16) : sizeof(float);
        std::memset(output_.out, 0, element * static_cast<size_t>(shape_.n_tokens * shape_.hidden));
        return true;
    }
    plan();
    for (const Group& g : groups_)
        if (!run_group(g, keep_going)) return false;
    return true;
}

}  // namespace

bool run_step(Team& team, const std::vector<ExpertTask>& tasks, const StepShape& shape, const StepOutput& output,
              StepArena& arena, StepTimes* times, const std::function<bool()>& keep_going) {
    if (output.store && tasks.size() > 1)
        throw std::logic_error("run_step: a stored output takes exactly one expert");
    return StepRun(team, tasks, shape, output, arena, times).run(keep_going);
}

}  // namespace numa_moe::engine
