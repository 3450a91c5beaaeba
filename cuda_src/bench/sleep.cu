// Keeps the GPU busy for a given time, so that the host can enqueue the work
// to be timed behind it: the timed region then measures GPU time only, not
// the host's launch latency.
#include "common/ptx.cuh"

namespace cupyep {

__global__ void gpu_sleep(uint64_t ns) {
    const uint64_t start = global_timer_ns();
    while (global_timer_ns() - start < ns) __nanosleep(1000);
}

}  // namespace cupyep
