// The ring-queue transport shared by dispatch and combine.
//
// Warps of a block are split into kNumRanks groups of `warps_per_group`
// warps; group g serves peer g. Within a group the first lane of the first
// warp is the leader: it owns the ring counters, and group members
// synchronise with a named barrier (id g + 1).
#pragma once
#include "common/copy.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "normal/node_args.cuh"

namespace cupyep {
namespace normal {

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

// Reads of ring slots another rank wrote: no stale L1 line of an earlier lap.
__device__ __forceinline__ int4 ld_ring_v4(const int4* p) { return ld_na_v4(p); }

constexpr int kCopyUnroll = 4;

// How the copies of a kernel treat L2 (template parameter kL2 of dispatch and
// combine):
//   0: plain streaming copies;
//   1: a receiver discards every ring slot it has consumed, so slot lines that
//      are still in L2 are never written back to HBM;
//   2: as 1, and the source rows and outputs (touched once) are tagged
//      evict-first while ring slots are tagged evict-last, so slots tend to
//      stay in L2 between the sender's write and the receiver's read.
// With slots served from L2 the two-copy queue moves close to one copy's
// worth of HBM traffic.
template <int kL2>
struct CopyPath {
    uint64_t first, last;
    __device__ __forceinline__ CopyPath() {
        if (kL2 >= 2) { first = l2_evict_first_policy(); last = l2_evict_last_policy(); }
    }
    // Source rows this rank owns (read-only during the call) into a ring slot.
    __device__ __forceinline__ void to_ring(int4* slot, const int4* src, int64_t n, int lane) const {
        const uint64_t f = first, l = last;
        if (kL2 >= 2)
            warp_copy<kCopyUnroll>(slot, src, n, lane, [f](const int4* p) { return ld_nc_na_v4(p, f); },
                                   [l](int4* p, const int4& v) { st_na_v4(p, v, l); });
        else
            warp_copy<kCopyUnroll>(slot, src, n, lane, [](const int4* p) { return ld_nc_na_v4(p); },
                                   [](int4* p, const int4& v) { st_na_v4(p, v); });
    }
    // A ring slot another rank wrote into this rank's output.
    __device__ __forceinline__ void from_ring(int4* dst, const int4* slot, int64_t n, int lane) const {
        const uint64_t f = first;
        if (kL2 >= 2)
            warp_copy<kCopyUnroll>(dst, slot, n, lane, [](const int4* p) { return ld_ring_v4(p); },
                                   [f](int4* p, const int4& v) { st_na_v4(p, v, f); });
        else
            warp_copy<kCopyUnroll>(dst, slot, n, lane, [](const int4* p) { return ld_ring_v4(p); },
                                   [](int4* p, const int4& v) { st_na_v4(p, v); });
    }
    // An output row computed in registers.
    __device__ __forceinline__ void store_out(int4* p, const int4& v) const {
        if (kL2 >= 2) st_na_v4(p, v, first);
        else st_na_v4(p, v);
    }
    // The warp has read every byte of a consumed slot: drop its lines. The
    // caller orders this before releasing the slot (head counter), so the
    // sender's next write to the slot comes after the discard.
    __device__ __forceinline__ void consumed(const char* slot, int64_t slot_bytes, int lane) const {
        if (kL2 >= 1) {
            __syncwarp();
            for (int64_t o = (int64_t)lane * 128; o < slot_bytes; o += 32 * 128) discard_l2(slot + o);
        }
    }
};

}  // namespace normal
}  // namespace cupyep
