#include "engine/routing.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/check.hpp"

namespace numa_moe::engine {
namespace {

// Index j' < j of the first earlier occurrence of ids[j] in the row, or j.
int64_t first_occurrence(const int64_t* row, int64_t j) {
    int64_t q = 0;
    while (q < j && row[q] != row[j]) ++q;
    return q;
}

}  // namespace

void route(const int64_t* ids, const float* weights, int64_t n_tokens, int64_t top_k, int64_t n_experts,
           Routing& routing) {
    std::vector<int64_t>& offset = routing.expert_offset;
    offset.assign(n_experts + 1, 0);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int64_t* row = ids + t * top_k;
        for (int64_t j = 0; j < top_k; ++j) {
            NUMA_MOE_CHECK(row[j] >= 0 && row[j] < n_experts, "topk_ids[", t, ", ", j, "] = ", row[j],
                           " is out of range [0, ", n_experts, ")");
            const float w = weights[t * top_k + j];
            NUMA_MOE_CHECK(std::isfinite(w), "topk_weights[", t, ", ", j, "] = ", std::to_string(w), ": NaN or infinity");
            if (first_occurrence(row, j) == j) ++offset[row[j] + 1];
        }
    }
    for (int64_t e = 0; e < n_experts; ++e) offset[e + 1] += offset[e];
    routing.slot_token.resize(offset[n_experts]);
    routing.slot_weight.resize(offset[n_experts]);
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    std::vector<int64_t> slot_of(top_k);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int64_t* row = ids + t * top_k;
        for (int64_t j = 0; j < top_k; ++j) {
            const int64_t q = first_occurrence(row, j);
            if (q < j) {
                routing.slot_weight[slot_of[q]] += weights[t * top_k + j];
                continue;
            }
            slot_of[j] = fill[row[j]]++;
            routing.slot_token[slot_of[j]] = t;
            routing.slot_weight[slot_of[j]] = weights[t * top_k + j];
        }
    }
}

}  // namespace numa_moe::engine
