// The notify pass of normal-mode dispatch as a device function, run by one
// block: the notify kernel's whole body, and block 0 of the direct
// transport's fused dispatch. See notify.cu for what it computes.
#pragma once
#include "common/ptx.cuh"
#include "common/barrier.cuh"
#include "intranode/args.cuh"

namespace cupyep {
namespace intranode {

// The notify pass, by every thread of one block. s_prefix: kNumRanks * (C + 1)
// ints of shared memory; per_rank [R] and per_expert [E]: this rank's token
// counts (the layout's, in global or shared memory). Returns false when a
// barrier timed out (reported in a.guard).
template <int kNumRanks>
__device__ __forceinline__ bool notify_pass(const NotifyArgs& a, int* s_prefix, const int* per_rank,
                                            const int* per_expert) {
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
    if (!barrier_block(a.peers, a.off.barrier, a.rank, R, a.guard, /*phase=*/0)) return false;
    const int E_local = a.num_experts / R;
    const int ni = (int)a.off.notify_row_ints;
    for (int d = warp; d < R; d += num_warps) {
        int* row = reinterpret_cast<int*>(static_cast<char*>(a.peers[d]) + a.off.notify) + a.rank * ni;
        for (int i = lane; i < R; i += 32) row[i] = per_rank[i];
        for (int i = lane; i < E_local; i += 32) row[R + i] = per_expert[d * E_local + i];
        for (int i = lane; i < C; i += 32) row[R + E_local + i] = s_prefix[d * (C + 1) + i + 1] - s_prefix[d * (C + 1) + i];
    }
    if (!barrier_block(a.peers, a.off.barrier, a.rank, R, a.guard, /*phase=*/1)) return false;

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
    __syncthreads();
    return true;
}

}  // namespace intranode
}  // namespace cupyep
