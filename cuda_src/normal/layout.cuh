// The layout of one token: which ranks it goes to, counted per rank and per
// expert. Shared by the layout kernel and the direct transport's fused dispatch.
#pragma once
#include "common/timeout.cuh"

namespace cupyep {
namespace normal {

// Row t of is_token_in_rank [T, R] from topk_idx [T, k]; adds 1 to s_rank[r]
// for every rank the token goes to and to s_expert[e] for every slot's expert
// (shared-memory counters). An id outside [-1, E) is reported as bad input
// (phase 0 of the caller's guard) and skipped.
__device__ __forceinline__ void token_layout(const int64_t* topk_idx, int t, int num_topk, int num_experts,
                                             int num_ranks, bool* is_token_in_rank, int* s_rank, int* s_expert,
                                             const Guard& guard) {
    const int experts_per_rank = num_experts / num_ranks;
    bool* row = is_token_in_rank + (int64_t)t * num_ranks;
    for (int r = 0; r < num_ranks; ++r) row[r] = false;
    for (int j = 0; j < num_topk; ++j) {
        const int64_t e = topk_idx[(int64_t)t * num_topk + j];
        if (e < 0) {
            if (e != -1) report_error(guard, kErrorBadInput, 0, -1, e, num_experts);
            continue;
        }
        if (e >= num_experts) { report_error(guard, kErrorBadInput, 0, -1, e, num_experts); continue; }
        atomicAdd(&s_expert[e], 1);
        const int r = (int)(e / experts_per_rank);
        if (!row[r]) { row[r] = true; atomicAdd(&s_rank[r], 1); }
    }
}

}  // namespace normal
}  // namespace cupyep
