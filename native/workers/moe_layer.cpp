// The NUMA-partitioned MoE layer step (see moe_layer.hpp for the operand layouts and
// the phases). Baseline x86-64 code: all ISA-specific work goes through KernelOps.
#include "workers/moe_layer.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <tuple>

#include "kernels/bf16.hpp"

namespace numa_moe::workers {
namespace {

constexpr size_t kAlign = 64;

size_t round_up(size_t value, size_t align) { return (value + align - 1) / align * align; }

int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

template <typename T>
void grow(std::unique_ptr<T, void (*)(void*)>& buffer, size_t& capacity, size_t bytes) {
    if (bytes <= capacity && buffer) return;
    bytes = std::max<size_t>(round_up(bytes, kAlign), kAlign);
    void* memory = std::aligned_alloc(kAlign, bytes);
    if (!memory) throw std::bad_alloc();
    buffer.reset(static_cast<T*>(memory));
    capacity = bytes;
}

// Equal pieces of [0, total), boundaries multiples of align (except the end).
std::vector<RowRange> split_even(int64_t total, int n, int64_t align) {
    std::vector<RowRange> ranges(n);
    int64_t begin = 0;
    for (int i = 0; i < n; ++i) {
        int64_t end = (i == n - 1) ? total : std::min(total, (total * (i + 1) / n + align / 2) / align * align);
        end = std::max(end, begin);
        ranges[i] = RowRange{begin, end};
        begin = end;
    }
    return ranges;
}

std::string segment_text(const Segment& s) {
    return "(row0=" + std::to_string(s.row0) + ", row_stride=" + std::to_string(s.row_stride) +
           ", nrows=" + std::to_string(s.nrows) + ", k0=" + std::to_string(s.k0) + ", k1=" + std::to_string(s.k1) + ")";
}

void prepare_matrix(MatrixPart& part, const WorkerPool& pool, const std::string& what, bool verify) {
    const int n_nodes = pool.n_nodes();
    if (static_cast<int>(part.node_segments.size()) != n_nodes)
        throw std::invalid_argument(what + ": segments given for " + std::to_string(part.node_segments.size()) +
                                    " nodes, the worker pool has " + std::to_string(n_nodes));
    for (int n = 0; n < n_nodes; ++n) {
        for (const Segment& s : part.node_segments[n]) {
            // last row row0 + (nrows - 1) * row_stride < rows, written so that it cannot overflow
            const bool ok = s.row0 >= 0 && s.row_stride >= 1 && s.nrows >= 0 && s.k0 >= 0 && s.k0 < s.k1 &&
                            s.k1 <= part.cols &&
                            (s.nrows == 0 || (s.row0 < part.rows && s.nrows - 1 <= (part.rows - 1 - s.row0) / s.row_stride));
            if (!ok)
                throw std::invalid_argument(what + ": segment " + segment_text(s) + " of node " + std::to_string(n) +
                                            " lies outside the " + std::to_string(part.rows) + " x " +
                                            std::to_string(part.cols) + " matrix");
        }
    }
    if (verify) check_partition(part.node_segments, part.rows, part.cols, what);
    part.thread_rows.assign(n_nodes, {});
    part.node_bytes.assign(n_nodes, 0);
    std::vector<int64_t> cost(part.rows);
    for (int n = 0; n < n_nodes; ++n) {
        std::fill(cost.begin(), cost.end(), 0);
        for (const Segment& s : part.node_segments[n])
            for (int64_t j = 0; j < s.nrows; ++j) cost[s.row0 + j * s.row_stride] += s.k1 - s.k0;
        int64_t total = 0;
        for (int64_t c : cost) total += c;
        part.node_bytes[n] = total * static_cast<int64_t>(sizeof(bf16));
        part.thread_rows[n] = split_by_cost(cost, pool.threads_of(n), 32);
    }
}

}  // namespace

std::vector<RowRange> split_by_cost(const std::vector<int64_t>& cost, int n, int64_t align) {
    const int64_t rows = static_cast<int64_t>(cost.size());
    std::vector<RowRange> ranges(n);
    int64_t total = 0;
    for (int64_t c : cost) total += c;
    if (total == 0) {
        // Nothing of this matrix on the node; the first thread still owns (zeroes) all
        // rows of the node's partial buffer, which the reduction reads.
        ranges[0] = RowRange{0, rows};
        for (int i = 1; i < n; ++i) ranges[i] = RowRange{rows, rows};
        return ranges;
    }
    int64_t begin = 0, prefix = 0, r = 0;
    for (int i = 0; i < n; ++i) {
        int64_t end = rows;
        if (i < n - 1) {
            const int64_t target = total * (i + 1) / n;
            while (r < rows && prefix + cost[r] <= target) prefix += cost[r++];
            end = std::min(rows, (r + align / 2) / align * align);
            end = std::max(end, begin);
        }
        ranges[i] = RowRange{begin, end};
        begin = end;
    }
    return ranges;
}

void check_partition(const std::vector<std::vector<Segment>>& node_segments, int64_t rows, int64_t cols,
                     const std::string& what) {
    // (row, k0, k1, node) of every covered piece, sorted: a partition has, per row,
    // pieces starting at 0, each starting where the previous ended, the last ending at cols.
    std::vector<std::tuple<int64_t, int64_t, int64_t, int>> pieces;
    for (size_t n = 0; n < node_segments.size(); ++n)
        for (const Segment& s : node_segments[n])
            for (int64_t j = 0; j < s.nrows; ++j)
                pieces.emplace_back(s.row0 + j * s.row_stride, s.k0, s.k1, static_cast<int>(n));
    std::sort(pieces.begin(), pieces.end());
    size_t i = 0;
    for (int64_t row = 0; row < rows; ++row) {
        int64_t covered = 0;
        while (i < pieces.size() && std::get<0>(pieces[i]) == row) {
            const auto& [r, k0, k1, node] = pieces[i];
            (void)r;
            if (k0 != covered)
                throw std::invalid_argument(
                    what + ": the segments do not partition the matrix: row " + std::to_string(row) + " columns [" +
                    std::to_string(std::min(k0, covered)) + ", " + std::to_string(std::max(k0, covered)) + ") are " +
                    (k0 < covered ? "covered twice (again by node " + std::to_string(node) + ")" : "not covered"));
            covered = k1;
            ++i;
        }
        if (covered != cols)
            throw std::invalid_argument(what + ": the segments do not partition the matrix: row " +
                                        std::to_string(row) + " columns [" + std::to_string(covered) + ", " +
                                        std::to_string(cols) + ") are not covered");
    }
}

MoELayerCore::MoELayerCore(std::shared_ptr<WorkerPool> pool, int64_t hidden, int64_t intermediate)
    : pool_(std::move(pool)), hidden_(hidden), intermediate_(intermediate) {
    if (!pool_) throw std::invalid_argument("MoELayerCore needs a worker pool");
    if (hidden <= 0 || intermediate <= 0 || hidden % 2 || intermediate % 2)
        throw std::invalid_argument("MoELayerCore: hidden and intermediate sizes must be positive and even, got " +
                                    std::to_string(hidden) + " and " + std::to_string(intermediate));
    for (int n = 0; n < pool_->n_nodes(); ++n) part_arena_.emplace_back(nullptr, &std::free);
    part_capacity_.assign(pool_->n_nodes(), 0);
}

void MoELayerCore::add_expert(ExpertParts parts, bool verify_partition) {
    const std::string name = "expert " + std::to_string(experts_.size());
    auto check_shape = [&](const MatrixPart& m, int64_t rows, int64_t cols, const char* kind) {
        if (m.rows != rows || m.cols != cols)
            throw std::invalid_argument(name + " " + kind + ": shape [" + std::to_string(m.rows) + ", " +
                                        std::to_string(m.cols) + "], expected [" + std::to_string(rows) + ", " +
                                        std::to_string(cols) + "]");
        if (!m.w || m.ldw < m.cols)
            throw std::invalid_argument(name + " " + kind + ": null weights or row stride below the row length");
    };
    check_shape(parts.gate, intermediate_, hidden_, "gate");
    check_shape(parts.up, intermediate_, hidden_, "up");
    check_shape(parts.down, hidden_, intermediate_, "down");
    prepare_matrix(parts.gate, *pool_, name + " gate", verify_partition);
    prepare_matrix(parts.up, *pool_, name + " up", verify_partition);
    prepare_matrix(parts.down, *pool_, name + " down", verify_partition);
    experts_.push_back(std::move(parts));
}

const KernelOps* MoELayerCore::isa_for_tokens(int64_t m) const {
    if (m >= amx_min_tokens_)
        if (const KernelOps* ops = kernels::kernel_ops(Isa::amx)) return ops;
    for (Isa isa : {Isa::avx512, Isa::avx2})
        if (const KernelOps* ops = kernels::kernel_ops(isa)) return ops;
    return &kernels::ref_ops();
}

bool MoELayerCore::forward(const bf16* x, int64_t ldx, int64_t n_tokens, const int64_t* ids, const float* weights,
                           int64_t top_k, void* out, bool out_fp32, const std::function<bool()>& keep_going) {
    const int64_t t0 = now_ns();
    const int64_t E = n_experts(), H = hidden_, I = intermediate_;
    const int n_nodes = pool_->n_nodes(), n_threads = pool_->n_threads();
    if (E == 0) throw std::invalid_argument("MoELayerCore.forward: the layer has no experts");
    const KernelOps* forced_ops = nullptr;
    if (isa_forced_) {
        forced_ops = kernels::kernel_ops(forced_isa_);
        if (!forced_ops)
            throw std::invalid_argument(std::string("ISA ") + kernels::isa_name(forced_isa_) +
                                        " is not available on this CPU");
    }

    // Group (token, expert) pairs by expert; a repeated expert in a token's row gets one
    // slot with the summed weight.
    expert_count_.assign(E, 0);
    std::vector<int64_t> slot_of(top_k);
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < top_k; ++j) {
            const int64_t e = ids[t * top_k + j];
            if (e < 0 || e >= E)
                throw std::invalid_argument("topk_ids[" + std::to_string(t) + ", " + std::to_string(j) + "] = " +
                                            std::to_string(e) + " is out of range [0, " + std::to_string(E) + ")");
            bool repeated = false;
            for (int64_t q = 0; q < j; ++q) repeated |= ids[t * top_k + q] == e;
            if (!repeated) ++expert_count_[e];
        }
    }
    std::vector<int64_t> offset(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) offset[e + 1] = offset[e] + expert_count_[e];
    const int64_t n_slots = offset[E];
    slot_token_.resize(n_slots);
    slot_weight_.resize(n_slots);
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < top_k; ++j) {
            const int64_t e = ids[t * top_k + j];
            int64_t q = 0;
            while (q < j && ids[t * top_k + q] != e) ++q;
            if (q < j) {
                slot_weight_[slot_of[q]] += weights[t * top_k + j];
                continue;
            }
            slot_of[j] = fill[e]++;
            slot_token_[slot_of[j]] = t;
            slot_weight_[slot_of[j]] = weights[t * top_k + j];
        }
    }

    // Active experts, their ISA and their packed operands.
    active_.clear();
    size_t packed_total = 0;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t m = expert_count_[e];
        if (m == 0) continue;
        ActiveExpert a{e, m, offset[e], forced_ops ? forced_ops : isa_for_tokens(m), 0, 0, 0};
        a.packed_x_offset = packed_total;
        packed_total += round_up(a.ops->packed_bytes(m, H), kAlign);
        a.packed_act_offset = packed_total;
        packed_total += round_up(a.ops->packed_bytes(m, I), kAlign);
        active_.push_back(a);
    }
    grow(packed_arena_, packed_capacity_, packed_total);

    // Groups of experts whose per-node partials fit the budget (at least one expert each).
    std::vector<size_t> group_begin{0};
    size_t part_floats = 0, max_part_floats = 0;
    const size_t budget_floats = static_cast<size_t>(group_budget_bytes_) / sizeof(float);
    for (size_t a = 0; a < active_.size(); ++a) {
        const size_t need = round_up(static_cast<size_t>(active_[a].m * (2 * I + H)), kAlign / sizeof(float));
        if (part_floats > 0 && part_floats + need > budget_floats) {
            group_begin.push_back(a);
            part_floats = 0;
        }
        active_[a].part_offset = part_floats;
        part_floats += need;
        max_part_floats = std::max(max_part_floats, part_floats);
    }
    group_begin.push_back(active_.size());
    for (int n = 0; n < n_nodes; ++n) grow(part_arena_[n], part_capacity_[n], max_part_floats * sizeof(float));
    grow(y_arena_, y_capacity_, static_cast<size_t>(n_tokens * H) * sizeof(float));

    stats_ = StepStats{};
    stats_.n_active_experts = static_cast<int64_t>(active_.size());
    stats_.n_slots = n_slots;
    stats_.node_bytes.assign(n_nodes, 0);
    stats_.thread_busy_ns.assign(n_threads, 0);
    stats_.phase_ns.assign(static_cast<size_t>(n_threads) * 5, 0);
    for (const ActiveExpert& a : active_) {
        const ExpertParts& p = experts_[a.expert];
        for (int n = 0; n < n_nodes; ++n)
            stats_.node_bytes[n] += p.gate.node_bytes[n] + p.up.node_bytes[n] + p.down.node_bytes[n];
        stats_.expert_isa.emplace_back(a.ops->name);
    }

    const std::vector<RowRange> silu_ranges = split_even(I, n_threads, 32);
    const std::vector<RowRange> h_ranges = split_even(H, n_threads, 16);
    uint8_t* packed = packed_arena_.get();
    float* y = y_arena_.get();
    std::vector<float*> node_parts(n_nodes);
    for (int n = 0; n < n_nodes; ++n) node_parts[n] = part_arena_[n].get();
    // per active expert: pointers to each node's gate / up / down partials
    std::vector<const float*> gate_ptrs(active_.size() * n_nodes), up_ptrs(gate_ptrs.size()),
        down_ptrs(gate_ptrs.size());
    for (size_t a = 0; a < active_.size(); ++a)
        for (int n = 0; n < n_nodes; ++n) {
            float* base = node_parts[n] + active_[a].part_offset;
            gate_ptrs[a * n_nodes + n] = base;
            up_ptrs[a * n_nodes + n] = base + I * active_[a].m;
            down_ptrs[a * n_nodes + n] = base + 2 * I * active_[a].m;
        }

    WorkerPool& pool = *pool_;
    const size_t n_groups = group_begin.size() - 1;
    bool completed = true;
    for (size_t g = 0; g < n_groups && completed; ++g) {
        const size_t a_begin = group_begin[g], a_end = group_begin[g + 1];
        const bool first = g == 0, last = g + 1 == n_groups;
        auto job = [&](const ThreadInfo& ti) {
            int64_t* phase_ns = &stats_.phase_ns[static_cast<size_t>(ti.global) * 5];
            int64_t mark = now_ns();
            auto lap = [&](int phase) {
                const int64_t now = now_ns();
                phase_ns[phase] += now - mark;
                mark = now;
            };
            // A: gather each expert's tokens once (experts spread over all threads).
            if (!pool.aborted())
                for (size_t a = a_begin + ti.global; a < a_end; a += n_threads) {
                    const ActiveExpert& ae = active_[a];
                    ae.ops->gather(x, ldx, slot_token_.data() + ae.slot0, ae.m, H, packed + ae.packed_x_offset);
                }
            pool.barrier();
            lap(0);
            // B: gate and up partials, node-local segments only, this thread's rows.
            int64_t busy = now_ns();
            if (!pool.aborted())
                for (size_t a = a_begin; a < a_end; ++a) {
                    const ActiveExpert& ae = active_[a];
                    const ExpertParts& p = experts_[ae.expert];
                    for (int which = 0; which < 2; ++which) {
                        const MatrixPart& mp = which == 0 ? p.gate : p.up;
                        const RowRange rr = mp.thread_rows[ti.node][ti.local];
                        if (rr.begin >= rr.end) continue;
                        float* part = node_parts[ti.node] + ae.part_offset + which * I * ae.m;
                        std::memset(part + rr.begin * ae.m, 0, sizeof(float) * (rr.end - rr.begin) * ae.m);
                        const auto& segs = mp.node_segments[ti.node];
                        ae.ops->matmul_segments(mp.w, mp.ldw, segs.data(), static_cast<int64_t>(segs.size()),
                                                rr.begin, rr.end, packed + ae.packed_x_offset, ae.m, H, part, ae.m);
                    }
                }
            busy = now_ns() - busy;
            pool.barrier();
            lap(1);
            // C: reduce gate/up over nodes (fixed order), activation, pack for down.
            if (!pool.aborted()) {
                const RowRange ir = silu_ranges[ti.global];
                if (ir.begin < ir.end)
                    for (size_t a = a_begin; a < a_end; ++a) {
                        const ActiveExpert& ae = active_[a];
                        ae.ops->silu_mul_pack(&gate_ptrs[a * n_nodes], &up_ptrs[a * n_nodes], n_nodes, ae.m, ir.begin,
                                              ir.end, ae.m, I, packed + ae.packed_act_offset);
                    }
            }
            pool.barrier();
            lap(2);
            // D: down partials per node.
            int64_t busy_down = now_ns();
            if (!pool.aborted())
                for (size_t a = a_begin; a < a_end; ++a) {
                    const ActiveExpert& ae = active_[a];
                    const MatrixPart& mp = experts_[ae.expert].down;
                    const RowRange rr = mp.thread_rows[ti.node][ti.local];
                    if (rr.begin >= rr.end) continue;
                    float* part = node_parts[ti.node] + ae.part_offset + 2 * I * ae.m;
                    std::memset(part + rr.begin * ae.m, 0, sizeof(float) * (rr.end - rr.begin) * ae.m);
                    const auto& segs = mp.node_segments[ti.node];
                    ae.ops->matmul_segments(mp.w, mp.ldw, segs.data(), static_cast<int64_t>(segs.size()), rr.begin,
                                            rr.end, packed + ae.packed_act_offset, ae.m, I, part, ae.m);
                }
            busy += now_ns() - busy_down;
            stats_.thread_busy_ns[ti.global] += busy;
            pool.barrier();
            lap(3);
            // E: reduce down over nodes and combine with the routing weights into y.
            struct LapOnExit {
                std::function<void()> f;
                ~LapOnExit() { f(); }
            } lap_e{[&] { lap(4); }};
            if (pool.aborted()) return;
            const RowRange hr = h_ranges[ti.global];
            if (hr.begin >= hr.end) return;
            if (first)
                for (int64_t t = 0; t < n_tokens; ++t)
                    std::memset(y + t * H + hr.begin, 0, sizeof(float) * (hr.end - hr.begin));
            for (size_t a = a_begin; a < a_end; ++a) {
                const ActiveExpert& ae = active_[a];
                ae.ops->combine_down(&down_ptrs[a * n_nodes], n_nodes, ae.m, hr.begin, hr.end, ae.m,
                                     slot_token_.data() + ae.slot0, slot_weight_.data() + ae.slot0, y, H);
            }
            if (!last) return;
            if (out_fp32) {
                float* o = static_cast<float*>(out);
                for (int64_t t = 0; t < n_tokens; ++t)
                    std::memcpy(o + t * H + hr.begin, y + t * H + hr.begin, sizeof(float) * (hr.end - hr.begin));
            } else {
                bf16* o = static_cast<bf16*>(out);
                for (int64_t t = 0; t < n_tokens; ++t)
                    kernels::floats_to_bf16(y + t * H + hr.begin, o + t * H + hr.begin, hr.end - hr.begin);
            }
        };
        pool.run(job, keep_going);
        if (pool.aborted()) completed = false;
    }
    if (completed && active_.empty()) {
        // no tokens: the output is zero
        if (out_fp32)
            std::memset(out, 0, sizeof(float) * n_tokens * H);
        else
            std::memset(out, 0, sizeof(bf16) * n_tokens * H);
    }
    stats_.wall_ns = now_ns() - t0;
    return completed;
}

}  // namespace numa_moe::workers
