// Bounded waits on NVSHMEM signal words (uint64, growing across calls).
#pragma once
#include "common/timeout.cuh"

namespace cupyep {
namespace shmem {

// Spin (acquire) until *sig >= want; false after reporting a timeout for
// (phase, peer) in the guard, or when another waiter of this rank already
// has. Signals stay below 2^63, so they compare as int64.
__device__ __forceinline__ bool wait_signal(const uint64_t* sig, int64_t want, const Guard& guard, int phase,
                                            int peer) {
    return wait_geq(reinterpret_cast<const int64_t*>(sig), want, guard, phase, peer);
}

}  // namespace shmem
}  // namespace cupyep
