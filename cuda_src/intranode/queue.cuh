// The ring-queue transport shared by dispatch and combine.
//
// Warps of a block are split into kNumRanks groups of `warps_per_group`
// warps; group g serves peer g. Within a group the first lane of the first
// warp is the leader: it owns the ring counters, and group members
// synchronise with a named barrier (id g + 1).
#pragma once
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "intranode/args.cuh"

namespace cupyep {
namespace intranode {

struct WarpGroup {
    int index;      // peer served
    int warp;       // warp within the group
    int lane;
    int num_warps;  // warps per group
    __device__ __forceinline__ bool leader() const { return warp == 0 && lane == 0; }
    __device__ __forceinline__ void sync() const {
        if (num_warps == 1) __syncwarp();
        else asm volatile("bar.sync %0, %1;" :: "r"(index + 1), "r"(num_warps * 32) : "memory");
    }
};

// Sender side of one ring: push rows [0, n) of a stream into the ring
// (channel, me) in `receiver`'s buffer, `chunk` rows per published step.
// write_row(slot, i) writes stream row i into a slot (called by one warp).
// NOTES: the group barrier orders every member's slot stores before the
// leader's st_release of the tail; the receiver's acquire of the tail then
// makes the slot contents visible. The leader's acquire of the head orders
// our slot overwrites after the receiver's reads of the previous lap.
template <typename WriteRow>
__device__ __forceinline__ bool send_stream(const WarpGroup& g, void* receiver, const RingShape& rs, int num_ranks,
                                            int channel, int me, int n, const Guard& guard, int phase, int peer_rank,
                                            volatile int* s_flag, WriteRow&& write_row) {
    int64_t* tail = ring_counter(receiver, rs.counter_tail, num_ranks, channel, me);
    const int64_t* head = ring_counter(receiver, rs.counter_head, num_ranks, channel, me);
    // Only this sender writes `tail`, so its current value is this call's base.
    const int64_t base = *reinterpret_cast<volatile int64_t*>(tail);
    for (int i0 = 0; i0 < n; i0 += rs.chunk) {
        const int m = min(rs.chunk, n - i0);
        if (g.leader()) *s_flag = wait_geq(head, base + i0 + m - rs.depth, guard, phase, peer_rank) ? 0 : 1;
        g.sync();
        if (*s_flag) return false;
        for (int j = g.warp; j < m; j += g.num_warps)
            write_row(ring_slot(receiver, rs, num_ranks, channel, me, base + i0 + j), i0 + j);
        g.sync();
        if (g.leader()) st_release_sys(tail, base + i0 + m);
    }
    return true;
}

// Warp copies of `n` int4 words with kUnroll independent 16-byte loads in
// flight per lane (memory-level parallelism is what bounds a copy warp).
template <int kUnroll, typename Load>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int64_t n, int lane, Load&& load) {
    int64_t i = lane;
    for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = load(src + i + u * 32);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) st_na_v4(dst + i + u * 32, v[u]);
    }
    for (; i < n; i += 32) st_na_v4(dst + i, load(src + i));
}

// Reads of ring slots another rank wrote: coherent loads that never allocate
// in L1, so no stale line of an earlier lap can be hit.
__device__ __forceinline__ int4 ld_ring_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

constexpr int kCopyUnroll = 4;

// Source rows this rank owns (read-only during the call): streaming loads.
__device__ __forceinline__ void warp_copy_nc(int4* dst, const int4* src, int64_t n, int lane) {
    warp_copy<kCopyUnroll>(dst, src, n, lane, [](const int4* p) { return ld_nc_na_v4(p); });
}
// Ring slots written by another rank.
__device__ __forceinline__ void warp_copy_ring(int4* dst, const int4* src, int64_t n, int lane) {
    warp_copy<kCopyUnroll>(dst, src, n, lane, [](const int4* p) { return ld_ring_v4(p); });
}

}  // namespace intranode
}  // namespace cupyep
