// Routing: the (token, expert) pairs of a layer step grouped by expert. Pure.
#pragma once

#include <cstdint>
#include <vector>

namespace numa_moe::engine {

// Slots grouped by expert: expert e's slots are [expert_offset[e], expert_offset[e + 1]),
// in token order; slot s gathers row slot_token[s] of x and adds slot_weight[s] times the
// expert's output to that row of y. A token that lists the same expert more than once gets
// one slot with the weights summed: w1 f(x) + w2 f(x) = (w1 + w2) f(x).
struct Routing {
    std::vector<int64_t> expert_offset;  // [E + 1]
    std::vector<int64_t> slot_token;
    std::vector<float> slot_weight;
    int64_t slots() const { return expert_offset.empty() ? 0 : expert_offset.back(); }
    int64_t tokens_of(int64_t e) const { return expert_offset[e + 1] - expert_offset[e]; }
};

// ids[t * top_k + j] in [0, n_experts), weights[t * top_k + j] finite
// (std::invalid_argument naming the entry otherwise). Reuses the vectors of `routing`.
void route(const int64_t* ids, const float* weights, int64_t n_tokens, int64_t top_k, int64_t n_experts,
           Routing& routing);

}  // namespace numa_moe::engine
