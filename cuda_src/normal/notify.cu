// Notify pass of normal-mode dispatch: one block per rank.
//  1. Build this rank's send streams: for every (destination, channel), the
//     tokens it sends in token order (send_list) and each token's position in
//     its stream (send_head, which combine reuses).
//  2. Barrier, then write this rank's counts into every peer's notify region:
//     tokens per rank, tokens per expert of that peer, tokens per channel.
//  3. Barrier, then read what every source wrote: the rank prefix matrix, the
//     per-source channel offsets, the receive count and per-expert counts.
// After this pass every receive offset is known, which is also all a one-copy
// transport (senders writing straight into the receiver's output) needs.
// With host_counts, the host also gets [1 + E_local + s * R + d]: rows s sends d.
#include "common/ptx.cuh"
#include "common/barrier.cuh"
#include "normal/layout.cuh"
#include "normal/notify.cuh"

namespace cupyep {
namespace normal {

// Dynamic shared memory: kNumRanks * (C + 1) ints.
template <int kNumRanks>
__global__ void __launch_bounds__(1024, 1) notify(NotifyArgs a) {
    extern __shared__ int s_prefix[];  // [R][C + 1]: counts, then exclusive prefix
    notify_pass<kNumRanks>(a, s_prefix, a.num_tokens_per_rank, a.num_tokens_per_expert);
}

// The layout (counts per rank and expert in shared memory, is_token_in_rank
// written) and then the notify pass, in one block: a notified dispatch
// without the caller's layout makes one launch instead of a memset and two.
// Dynamic shared memory: kNumRanks * (C + 1) + kNumRanks + E ints.
template <int kNumRanks>
__global__ void __launch_bounds__(1024, 1) notify_layout(NotifyLayoutArgs a) {
    extern __shared__ int s_dyn[];
    constexpr int R = kNumRanks;
    const NotifyArgs& n = a.notify;
    const int E = n.num_experts, T = n.num_tokens;
    int* s_prefix = s_dyn;
    int* s_rank = s_prefix + R * (n.num_channels + 1);
    int* s_expert = s_rank + R;
    for (int i = threadIdx.x; i < R + E; i += blockDim.x) s_rank[i] = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < T; t += blockDim.x)
        token_layout(a.topk_idx, t, a.num_topk, E, R, const_cast<bool*>(n.is_token_in_rank), s_rank, s_expert,
                     a.layout_guard);
    __syncthreads();
    notify_pass<R>(n, s_prefix, s_rank, s_expert);
}

}  // namespace normal
}  // namespace cupyep
