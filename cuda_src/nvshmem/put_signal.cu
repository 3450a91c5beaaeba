// The primitive of every hop between nodes: rows put into a peer PE's
// symmetric buffer with a signal, and a bounded wait for the signals the
// peers send back. The hierarchical (two-hop) and cross-node modes build on
// the same calls: nvshmemx_putmem_signal_nbi_block (the data and, once it has
// landed, the signal add), nvshmem_signal_wait_until / a bounded poll of the
// signal word, nvshmem_quiet.
//
// put_signal (grid: one block per peer slot, blocks b = 0 .. num_peers - 1):
//   block b sends `bytes` bytes from src + b * bytes to dst + my_slot * bytes
//   on PE peers[b] and adds 1 to sig[my_slot] there; then (every block) waits
//   until its own sig[b] reaches `expected` (the epoch of this call), so the
//   kernel's end means every peer's rows have arrived here. A wait that runs
//   past the guard's timeout reports (phase 0, peer PE) and the kernel ends.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "nvshmem/signal.cuh"

namespace cupyep {
namespace shmem {

struct PutSignalArgs {
    char* dst;               // symmetric: [num_peers, bytes] rows arriving from each peer slot
    const char* src;         // [num_peers, bytes] rows for each peer
    uint64_t* sig;           // symmetric: [num_peers] signal words (cumulative over calls)
    const int* peers;        // [num_peers] destination PE of each slot
    int64_t bytes;           // per peer, a multiple of 16
    uint64_t expected;       // the value every sig[b] reaches in this call
    int num_peers;
    int my_slot;             // this PE's slot at its peers
    Guard guard;
};

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) put_signal(PutSignalArgs a) {
    const int b = blockIdx.x;
    if (b >= a.num_peers) return;
    nvshmemx_putmem_signal_nbi_block(a.dst + (int64_t)a.my_slot * a.bytes, a.src + (int64_t)b * a.bytes, a.bytes,
                                     a.sig + a.my_slot, 1, NVSHMEM_SIGNAL_ADD, a.peers[b]);
    if (threadIdx.x == 0) wait_signal(a.sig + b, (int64_t)a.expected, a.guard, /*phase=*/0, a.peers[b]);
    __syncthreads();
    nvshmem_quiet();
}

}  // namespace shmem
}  // namespace cupyep
