// The notify pass of normal-mode dispatch as a device function, run by one
// block: the notify kernel's whole body, and block 0 of the direct
// transport's fused dispatch. See notify.cu for what it computes.
#pragma once
#include "common/ptx.cuh"
#include "common/barrier.cuh"
#include "normal/node_args.cuh"

namespace cupyep {
namespace normal {

__device__ __forceinline__ int round_up_int(int v, int a) { return (v + a - 1) / a * a; }

// The expert-major tables of the direct transport, after the notify pass's
// second barrier (every rank's notify region is complete and stays so until
// this rank's next notify): this rank's block offsets and pair counts
// (expert_meta), and for every destination d the expert-major row of this
// rank's first pair for each of d's local experts (expand_base; d's region
// holds every source's pair counts for d's experts). With host_counts, the
// most expert-major rows any rank lays out goes to host_counts[1 + E_local + R * R].
template <int kNumRanks>
__device__ __forceinline__ void expand_tables(const NotifyArgs& a, const int* mine, int ni, int E_local) {
    constexpr int R = kNumRanks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    const int A = a.expert_alignment;
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E_local; ++e) {
            int c = 0;
            for (int s = 0; s < R; ++s) c += mine[s * ni + R + e];
            a.expert_meta[e] = acc;
            a.expert_meta[E_local + 1 + e] = c;
            acc += round_up_int(c, A);
        }
        a.expert_meta[E_local] = acc;
    }
    for (int d = warp; d < R; d += num_warps) {
        const volatile int* region =
            reinterpret_cast<const volatile int*>(static_cast<const char*>(a.peers[d]) + a.off.notify);
        int* base = a.expand_base + d * (E_local + 1);
        int running = 0;
        for (int e0 = 0; e0 < E_local; e0 += 32) {  // warp-uniform bounds: the scan's shuffles see every lane
            const int e = e0 + lane;
            int total = 0, before = 0;
            if (e < E_local)
                for (int s = 0; s < R; ++s) {
                    const int c = region[s * ni + R + e];
                    total += c;
                    before += s < a.rank ? c : 0;
                }
            const int aligned = round_up_int(total, A);
            int incl = aligned;
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            if (e < E_local) base[e] = running + incl - aligned + before;
            running += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) base[E_local] = running;
    }
    __syncthreads();
    if (a.host_counts && threadIdx.x == 0) {
        int most = 0;
        for (int d = 0; d < R; ++d) most = max(most, a.expand_base[d * (E_local + 1) + E_local]);
        a.host_counts[1 + E_local + R * R] = most;
    }
}

// The notify pass, by every thread of one block. s_prefix: kNumRanks * (C + 1)
// ints of shared memory; per_rank [R] and per_expert [E]: this rank's token
// counts (the layout's, in global or shared memory). Returns false when a
// barrier timed out (reported in a.guard).
template <int kNumRanks>
__device__ __forceinline__ bool notify_pass(const NotifyArgs& a, int* s_prefix, const int* per_rank,
                                            const int* per_expert) {
    __shared__ int s_total;
    const uint64_t t_begin = a.notify_time_ns ? global_timer_ns() : 0;
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
    }
    __syncthreads();
    if (a.expand_base) expand_tables<R>(a, mine, ni, E_local);
    if (a.host_counts) {
        // host_counts[0], the rows received, goes last: the host spins on it
        // (Group.wait_word), so every thread's host words are fenced first.
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(a.host_counts) = s_total;
    }
    if (a.notify_time_ns && threadIdx.x == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.notify_time_ns),
                  (unsigned long long)(global_timer_ns() - t_begin));
        atomicAdd(reinterpret_cast<unsigned long long*>(a.notify_time_ns + 1), 1ull);
    }
    return true;
}

}  // namespace normal
}  // namespace cupyep
