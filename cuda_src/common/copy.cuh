// Warp-cooperative row copies.
#pragma once
#include "common/types.cuh"

namespace cupyep {

// Copy `n` int4 words with a warp: rounds of kUnroll 16-byte loads per lane,
// all in flight before the round's stores (memory-level parallelism is what
// bounds a copy warp). The last, partial round runs word by word, or with
// kMaskTail as one more round with masked stores (fewer round trips, more
// registers).
// `load(const int4*)` and `store(int4*, const int4&)` pick the cache hints.
template <int kUnroll, bool kMaskTail = false, typename Load, typename Store>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int64_t n, int lane, Load&& load, Store&& store) {
    int64_t i = lane;
    for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = load(src + i + u * 32);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) store(dst + i + u * 32, v[u]);
    }
    if (kMaskTail) {
        if (i < n) {
            // Every load unconditional (a lane past the end reads the last word again), so that
            // the compiler issues them all ahead of the stores: predicated, it interleaves them.
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) v[u] = load(src + min(i + u * 32, n - 1));
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * 32 < n) store(dst + i + u * 32, v[u]);
        }
    } else {
        for (; i < n; i += 32) store(dst + i, load(src + i));
    }
}

}  // namespace cupyep
