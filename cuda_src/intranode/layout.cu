// get_dispatch_layout: per-rank and per-expert token counts and the
// token-to-rank map from topk_idx.
#include "common/timeout.cuh"

namespace cupyep {
namespace intranode {

struct LayoutArgs {
    const int64_t* topk_idx;      // [T, k], -1 = no expert
    int* num_tokens_per_rank;     // [R] out (zeroed by the caller)
    int* num_tokens_per_expert;   // [E] out (zeroed by the caller)
    bool* is_token_in_rank;       // [T, R] out
    int num_tokens;
    int num_topk;
    int num_experts;
    int num_ranks;
    Guard guard;                  // an id outside [-1, E) is reported as bad input
};

// One thread per token; block-local counts in shared memory, then one global
// atomic per (block, rank) and (block, expert). Integer atomics: the result
// does not depend on their order. Dynamic shared memory: (R + E) ints.
__global__ void get_dispatch_layout(LayoutArgs a) {
    extern __shared__ int s_counts[];
    int* s_rank = s_counts;
    int* s_expert = s_counts + a.num_ranks;
    for (int i = threadIdx.x; i < a.num_ranks + a.num_experts; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
    const int experts_per_rank = a.num_experts / a.num_ranks;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < a.num_tokens) {
        bool* row = a.is_token_in_rank + (int64_t)t * a.num_ranks;
        for (int r = 0; r < a.num_ranks; ++r) row[r] = false;
        for (int j = 0; j < a.num_topk; ++j) {
            const int64_t e = a.topk_idx[(int64_t)t * a.num_topk + j];
            if (e < 0) {
                if (e != -1) report_error(a.guard, kErrorBadInput, 0, -1, e, a.num_experts);
                continue;
            }
            if (e >= a.num_experts) { report_error(a.guard, kErrorBadInput, 0, -1, e, a.num_experts); continue; }
            atomicAdd(&s_expert[e], 1);
            const int r = (int)(e / experts_per_rank);
            if (!row[r]) { row[r] = true; atomicAdd(&s_rank[r], 1); }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x)
        if (s_rank[i]) atomicAdd(&a.num_tokens_per_rank[i], s_rank[i]);
    for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x)
        if (s_expert[i]) atomicAdd(&a.num_tokens_per_expert[i], s_expert[i]);
}

}  // namespace intranode
}  // namespace cupyep
