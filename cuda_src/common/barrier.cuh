// GPU barrier across the ranks of a node through their IPC buffers.
//
// Layout (inside every rank's symmetric buffer, at `offset`):
//   int arrive[num_ranks]   arrive[p]: the latest epoch rank p announced to me
//   int epoch               my own epoch; only I write it
// Epochs live on the device, so a barrier inside a CUDA graph stays correct
// across replays.
#pragma once
#include "common/ptx.cuh"
#include "common/timeout.cuh"

namespace cupyep {

__host__ __device__ constexpr int64_t barrier_region_bytes(int num_ranks) {
    return ((int64_t)(num_ranks + 1) * 4 + 127) / 128 * 128;
}

// Kernel argument of a barrier launch; mirrors cupyep/barrier.py: BARRIER_ARGS_DTYPE.
struct BarrierArgs {
    void* const* peers;  // [num_ranks] device pointers to each rank's buffer base
    int64_t offset;      // byte offset of the barrier region in every buffer
    int rank;
    int num_ranks;
    Guard guard;
};

// Called by every thread of ONE block. Returns false on timeout.
// NOTES: the st_release on the peer's arrive slot orders every store this rank
// made before the barrier (including stores into peers' buffers, after the
// caller's __syncthreads) before the arrival; the ld_acquire in wait_geq orders
// everything after the barrier after the peer's arrival.
__device__ __forceinline__ bool barrier_block(void* const* peers, int64_t offset, int rank, int num_ranks,
                                              const Guard& g, int phase) {
    __shared__ int s_epoch;
    __shared__ int s_ok;
    int* mine = reinterpret_cast<int*>(static_cast<char*>(peers[rank]) + offset);
    __syncthreads();
    if (threadIdx.x == 0) { s_epoch = mine[num_ranks] + 1; s_ok = 1; }
    __syncthreads();
    const int epoch = s_epoch;
    for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
        int* theirs = reinterpret_cast<int*>(static_cast<char*>(peers[p]) + offset);
        st_release_sys(theirs + rank, epoch);
    }
    for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
        if (!wait_geq(mine + p, epoch, g, phase, p)) s_ok = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) mine[num_ranks] = epoch;
    return s_ok != 0;
}

}  // namespace cupyep
