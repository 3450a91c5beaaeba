// get_dispatch_layout: per-rank and per-expert token counts and the
// token-to-rank map from topk_idx.
#include "common/timeout.cuh"
#include "normal/layout.cuh"

namespace cupyep {
namespace normal {

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
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < a.num_tokens)
        token_layout(a.topk_idx, t, a.num_topk, a.num_experts, a.num_ranks, a.is_token_in_rank, s_rank, s_expert,
                     a.guard);
    __syncthreads();
    for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x)
        if (s_rank[i]) atomicAdd(&a.num_tokens_per_rank[i], s_rank[i]);
    for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x)
        if (s_expert[i]) atomicAdd(&a.num_tokens_per_expert[i], s_expert[i]);
}

}  // namespace normal
}  // namespace cupyep
