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
#include "normal/notify.cuh"

namespace cupyep {
namespace normal {

// Dynamic shared memory: kNumRanks * (C + 1) ints.
template <int kNumRanks>
__global__ void __launch_bounds__(1024, 1) notify(NotifyArgs a) {
    extern __shared__ int s_prefix[];  // [R][C + 1]: counts, then exclusive prefix
    notify_pass<kNumRanks>(a, s_prefix, a.num_tokens_per_rank, a.num_tokens_per_expert);
}

}  // namespace normal
}  // namespace cupyep
