// Kernels of the rank runtime: the GPU barrier and the IPC self-checks.
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "common/barrier.cuh"

namespace cupyep {

// One barrier per launch (one block). A kernel launched after it as a
// programmatic dependent may become resident at once (it waits in pdl_wait).
__global__ void barrier_kernel(BarrierArgs a) {
    pdl_launch_dependents();
    barrier_block(a.peers, a.offset, a.rank, a.num_ranks, a.guard, /*phase=*/0);
}

// `iters` barriers inside one launch: the device-side round trip without
// launch overhead. Stops at the first timeout.
__global__ void barrier_loop_kernel(BarrierArgs a, int iters) {
    for (int i = 0; i < iters; ++i)
        if (!barrier_block(a.peers, a.offset, a.rank, a.num_ranks, a.guard, /*phase=*/0)) return;
}

__device__ __forceinline__ uint32_t ipc_tag(int writer, int reader, int64_t i) {
    return (uint32_t)(writer + 1) * 0x01000193u ^ (uint32_t)(reader + 1) * 0x9E3779B1u ^ (uint32_t)i * 0x85EBCA6Bu;
}

// Rank `rank` writes words [rank * n, (rank + 1) * n) of every peer's buffer
// (starting at `offset`) through the peer table.
__global__ void ipc_write_pattern(void* const* peers, int64_t offset, int rank, int num_ranks, int64_t n) {
    for (int p = 0; p < num_ranks; ++p) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<char*>(peers[p]) + offset) + rank * n;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
            dst[i] = ipc_tag(rank, p, i);
    }
}

// Counts mismatches: words this rank received from every writer (its own
// buffer) and words this rank wrote into every peer (read back remotely).
__global__ void ipc_check_pattern(void* const* peers, int64_t offset, int rank, int num_ranks, int64_t n,
                                  unsigned long long* num_bad) {
    unsigned long long bad = 0;
    const uint32_t* mine = reinterpret_cast<const uint32_t*>(static_cast<const char*>(peers[rank]) + offset);
    for (int w = 0; w < num_ranks; ++w) {
        const uint32_t* theirs = reinterpret_cast<const uint32_t*>(static_cast<const char*>(peers[w]) + offset);
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
            bad += mine[w * n + i] != ipc_tag(w, rank, i);      // received from w
            bad += theirs[rank * n + i] != ipc_tag(rank, w, i);  // what I wrote into w
        }
    }
    if (bad) atomicAdd(num_bad, bad);
}

}  // namespace cupyep
