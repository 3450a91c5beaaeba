// Warp-level prefix sums.
#pragma once

namespace cupyep {

// Inclusive prefix sum of one int per lane of a full warp.
__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

// The sum of one int per lane of a full warp, in every lane.
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Exclusive prefix sums of n values by one full warp, 32 at a time:
// store(i, load(0) + ... + load(i - 1)) for i < n. Returns the total (on every lane).
template <typename Load, typename Store>
__device__ __forceinline__ int warp_exclusive_scan(int n, int lane, Load&& load, Store&& store) {
    int run = 0;
    for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        const int v = i < n ? load(i) : 0;
        const int inc = warp_inclusive_scan(v, lane);
        if (i < n) store(i, run + inc - v);
        run += __shfl_sync(0xffffffffu, inc, 31);
    }
    return run;
}

}  // namespace cupyep
