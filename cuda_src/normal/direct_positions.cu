// The expert-major position pass of a direct-transport dispatch that is not
// fused (the fused kernel runs expert_positions in one of its own blocks).
#include "normal/direct_args.cuh"
#include "normal/direct_positions.cuh"

namespace cupyep {
namespace normal {

// One block, before the send; dynamic shared memory: expand.hist_warps * E ints.
__global__ void __launch_bounds__(1024, 1) direct_expert_positions(DirectDispatchArgs a) {
    extern __shared__ int s_hist[];
    expert_positions(a.topk_idx, a.num_tokens, a.num_topk, a.expand.num_experts, a.expand.hist_warps, a.expand.pos,
                     s_hist);
}

}  // namespace normal
}  // namespace cupyep
