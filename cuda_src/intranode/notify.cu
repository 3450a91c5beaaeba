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
#include "intranode/args.cuh"

namespace cupyep {
namespace intranode {

// Dynamic shared memory: kNumRanks * (C + 1) ints.
template <int kNumRanks>
__global__ void __launch_bounds__(1024, 1) notify(NotifyArgs a) {
    extern __shared__ int s_prefix[];  // [R][C + 1]: counts, then exclusive prefix
    __shared__ int s_total;
    constexpr int R = kNumRanks;
    const int C = a.num_channels, T = a.num_tokens;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;

    // 1. Per-(destination, channel) counts, then positions.
    for (int pair = warp; pair < R * C; pair += num_warps) {
        const int d = pair / C, c = pair % C;
        const int b = token_begin(T, C, c), e = token_begin(T, C, c + 1);
        int cnt = 0;
        for (int t = b + lane; t - lane < e; t += 32) {
            const bool in = t < e && a.is_token_in_rank[(int64_t)t * R + d];
            cnt += __popc(__ballot_sync(0xffffffffu, in));
        }
        if (lane == 0) s_prefix[d * (C + 1) + c + 1] = cnt;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
        int* row = s_prefix + d * (C + 1);
        row[0] = 0;
        for (int c = 0; c < C; ++c) row[c + 1] += row[c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < R * (C + 1); i += blockDim.x) a.send_channel_prefix[i] = s_prefix[i];
    for (int pair = warp; pair < R * C; pair += num_warps) {
        const int d = pair / C, c = pair % C;
        const int b = token_begin(T, C, c), e = token_begin(T, C, c + 1);
        int* list = a.send_list + (int64_t)d * T + s_prefix[d * (C + 1) + c];
        int pos = 0;
        for (int t = b + lane; t - lane < e; t += 32) {
            const bool in = t < e && a.is_token_in_rank[(int64_t)t * R + d];
            const unsigned m = __ballot_sync(0xffffffffu, in);
            const int mine = pos + __popc(m & ((1u << lane) - 1u));
            if (t < e) a.send_head[(int64_t)t * R + d] = in ? mine : -1;
            if (in) list[mine] = t;
            pos += __popc(m);
        }
    }

    // 2. Everyone has finished reading its notify region of the previous call.
    if (!barrier_block(a.peers, a.off.barrier, a.rank, R, a.guard, /*phase=*/0)) return;
    const int E_local = a.num_experts / R;
    const int ni = (int)a.off.notify_row_ints;
    for (int d = warp; d < R; d += num_warps) {
        int* row = reinterpret_cast<int*>(static_cast<char*>(a.peers[d]) + a.off.notify) + a.rank * ni;
        for (int i = lane; i < R; i += 32) row[i] = a.num_tokens_per_rank[i];
        for (int i = lane; i < E_local; i += 32) row[R + i] = a.num_tokens_per_expert[d * E_local + i];
        for (int i = lane; i < C; i += 32) row[R + E_local + i] = s_prefix[d * (C + 1) + i + 1] - s_prefix[d * (C + 1) + i];
    }
    if (!barrier_block(a.peers, a.off.barrier, a.rank, R, a.guard, /*phase=*/1)) return;

    // 3. What every source sends me.
    const int* mine = reinterpret_cast<const int*>(static_cast<const char*>(a.peers[a.rank]) + a.off.notify);
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            acc += mine[s * ni + j];
            a.rank_prefix_matrix[s * R + j] = acc;
            // The whole count matrix for the host (the direct transport sizes its pools from it).
            if (a.host_counts) a.host_counts[1 + E_local + s * R + j] = mine[s * ni + j];
        }
    }
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
        int* p = a.recv_channel_prefix + s * (C + 1);
        int acc = 0;
        p[0] = 0;
        for (int c = 0; c < C; ++c) { acc += mine[s * ni + R + E_local + c]; p[c + 1] = acc; }
    }
    for (int e = threadIdx.x; e < E_local; e += blockDim.x) {
        int acc = 0;
        for (int s = 0; s < R; ++s) acc += mine[s * ni + R + e];
        const int aligned = (acc + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
        a.num_recv_tokens_per_expert[e] = aligned;
        if (a.host_counts) a.host_counts[1 + e] = acc;  // unaligned: the host aligns (also for cached calls)
    }
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int s = 0; s < R; ++s) { a.recv_rank_offset[s] = acc; acc += mine[s * ni + a.rank]; }
        a.recv_rank_offset[R] = acc;
        s_total = acc;
        if (acc > a.capacity) report_error(a.guard, kErrorCapacity, /*phase=*/2, -1, acc, a.capacity);
        if (a.host_counts) a.host_counts[0] = acc;
    }
}

}  // namespace intranode
}  // namespace cupyep
