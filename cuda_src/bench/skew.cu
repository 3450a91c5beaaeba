// Kernels that time how far apart the ranks sharing a GPU start a kernel
// after a GPU barrier has released them (cupyep/lab/bench/skew.py).
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "common/barrier.cuh"

namespace cupyep {

// One barrier (one block); `exit_ns` gets the %globaltimer when it was passed.
// With `trigger`, the kernel lets a dependent launch (programmatic dependent
// launch) proceed as soon as it starts.
__global__ void skew_barrier(BarrierArgs a, int64_t* exit_ns, int trigger) {
    if (trigger) pdl_launch_dependents();
    barrier_block(a.peers, a.offset, a.rank, a.num_ranks, a.guard, /*phase=*/0);
    if (threadIdx.x == 0) *exit_ns = (int64_t)global_timer_ns();
}

// Stamps when its first block got past the dependency wait (a no-op unless
// launched as a programmatic dependent), then ends.
__global__ void skew_stamp(int64_t* start_ns) {
    pdl_wait();
    if (threadIdx.x == 0) atomicMin(reinterpret_cast<unsigned long long*>(start_ns), (unsigned long long)global_timer_ns());
}

}  // namespace cupyep
