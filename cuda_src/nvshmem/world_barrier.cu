// GPU barrier across every PE (all ranks of all nodes) on NVSHMEM signals:
// what lines calls up across nodes, where the node's IPC barrier
// (common/barrier.cuh) cannot reach. It orders the ranks in time, not their
// memory: a rank's earlier puts are not fenced by it.
//
// world_barrier (one block, `iters` barriers in a row): each barrier's epoch
// is this PE's last one plus one; thread p sets arrive[my_pe] on PE p to the
// epoch (a signal set), then waits (bounded, naming p) until arrive[p] here
// has reached it. Epochs live on the device, so a barrier inside a CUDA graph
// stays correct across replays.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "nvshmem/signal.cuh"

namespace cupyep {
namespace shmem {

struct WorldBarrierArgs {
    uint64_t* arrive;  // symmetric [num_pes]: the latest epoch each PE announced to me
    int64_t* epoch;    // private [1]: my latest epoch
    int num_pes;
    int my_pe;
    Guard guard;
};

__global__ void world_barrier(WorldBarrierArgs a, int iters) {
    pdl_launch_dependents();  // a kernel launched after it as a programmatic dependent may become resident
    __shared__ int64_t s_epoch;
    __shared__ int s_ok;
    for (int i = 0; i < iters; ++i) {
        __syncthreads();
        if (threadIdx.x == 0) {
            s_epoch = *a.epoch + 1;
            s_ok = 1;
        }
        __syncthreads();
        const int64_t e = s_epoch;
        for (int p = threadIdx.x; p < a.num_pes; p += blockDim.x)
            nvshmemx_signal_op(a.arrive + a.my_pe, (uint64_t)e, NVSHMEM_SIGNAL_SET, p);
        for (int p = threadIdx.x; p < a.num_pes; p += blockDim.x)
            if (!wait_signal(a.arrive + p, e, a.guard, /*phase=*/0, p)) s_ok = 0;
        __syncthreads();
        if (!s_ok) return;
        if (threadIdx.x == 0) *a.epoch = e;
    }
}

}  // namespace shmem
}  // namespace cupyep
