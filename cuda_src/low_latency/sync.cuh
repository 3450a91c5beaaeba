// Flag protocol of the low-latency kernels (see args.cuh for the buffer sets).
//
// Send side: every block writes its rows with plain stores to the peers, then
// arrives on this rank's `done` counter with a release; the blocks that own a
// destination wait for all arrivals (acquire), write that destination's
// metadata and set its flag with a release store. Only the first num_waiters
// blocks (which include the destination owners) wait at all: the others exit
// once their rows are out, so a grid may have more blocks than can be resident
// with every other rank's; the host checks that the waiters of all ranks
// sharing a GPU fit with room to spare. The receive side acquires the
// flag. Release/acquire are cumulative through the block barriers, so every
// row any block of the sender wrote is visible once the flag is.
//
// Flags are cleared one call ahead: a call clears the flags of the set the
// next call uses. A peer writes those flags only during the next call, after
// it has seen this call's flags from this rank, which this rank sets after the
// clear, so the clear always lands first.
#pragma once
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "low_latency/args.cuh"

namespace cupyep {
namespace low_latency {

template <typename T>
__device__ __forceinline__ T* at(void* base, int64_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// Zero the next set's flags and done counters (grid-strided).
__device__ __forceinline__ void clear_next_flags(void* mine, const SetOffsets& next, int num_ranks) {
    int* dispatch_flag = at<int>(mine, next.dispatch_flag);
    int* combine_flag = at<int>(mine, next.combine_flag);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_ranks; i += gridDim.x * blockDim.x) {
        dispatch_flag[i] = 0;
        combine_flag[i] = 0;
    }
    if (blockIdx.x == 0 && threadIdx.x < 4) at<int>(mine, next.done)[threadIdx.x] = 0;
}

// Arrive on this rank's send counter; blocks that own a destination (b < R)
// also wait for all gridDim.x arrivals. Returns false after a timeout.
__device__ __forceinline__ bool finish_sends(int* done, const Guard& guard, int num_ranks) {
    __shared__ int s_ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        atomic_add_release_sys(done, 1);
        s_ok = (int)blockIdx.x >= num_ranks || wait_geq(done, (int)gridDim.x, guard, kWaitSendDone, -1);
    }
    __syncthreads();
    return s_ok;
}

// Wait (every block) until all R peers have set this rank's flag in `flags`.
// Block 0 adds the nanoseconds it waited for each peer to wait_stats.
__device__ __forceinline__ bool wait_peer_flags(const int* flags, int num_ranks, const Guard& guard,
                                                int64_t* wait_stats) {
    __shared__ int s_fail;
    if (threadIdx.x == 0) s_fail = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
        const uint64_t t0 = global_timer_ns();
        if (!wait_nonzero(flags + r, guard, kWaitPeerFlag, r)) s_fail = 1;
        else if (wait_stats && blockIdx.x == 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + r),
                      (unsigned long long)(global_timer_ns() - t0));
    }
    __syncthreads();
    return !s_fail;
}

}  // namespace low_latency
}  // namespace cupyep
