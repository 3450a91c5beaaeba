// Expert-major positions of a sender's (token, slot) pairs, for the direct
// transport's dispatch into per-expert blocks: pos[t * k + j] is the number
// of this rank's pairs before (t, j), in (token, slot) order, whose expert is
// topk_idx[t, j] (-1 for empty slots and ids outside [0, E)). A receiver's
// block for expert e holds the pairs of source 0, then source 1, ..., so the
// pair's expert-major row at destination d is expand_base[d, e_local] + pos
// (expand_base: notify.cuh). That is the order of the reference's
// expert_major_order: by received row (source, then token), then slot.
#pragma once
#include "common/types.cuh"

namespace cupyep {
namespace normal {

// By every thread of one block; the first `num_warps` warps take contiguous
// segments of the T * k pairs. s_hist: num_warps * E ints of shared memory.
__device__ __forceinline__ void expert_positions(const int64_t* topk_idx, int num_tokens, int num_topk,
                                                 int num_experts, int num_warps, int* pos, int* s_hist) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int E = num_experts;
    const int64_t P = (int64_t)num_tokens * num_topk;
    const int64_t seg = ((P + num_warps - 1) / num_warps + 31) / 32 * 32;
    const int64_t begin = warp * seg, end = min(P, begin + seg);
    for (int i = threadIdx.x; i < num_warps * E; i += blockDim.x) s_hist[i] = 0;
    __syncthreads();
    // 1. Pairs per expert in each warp's segment.
    if (warp < num_warps)
        for (int64_t p = begin + lane; p < end; p += 32) {
            const int64_t e = topk_idx[p];
            if (e >= 0 && e < E) atomicAdd(&s_hist[warp * E + e], 1);
        }
    __syncthreads();
    // 2. Exclusive prefix over the segments, per expert.
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int acc = 0;
        for (int w = 0; w < num_warps; ++w) {
            const int c = s_hist[w * E + e];
            s_hist[w * E + e] = acc;
            acc += c;
        }
    }
    __syncthreads();
    // 3. Each segment in order, 32 pairs at a time: lanes naming the same
    //    expert rank among themselves, the highest of them advances the count.
    if (warp < num_warps)
        for (int64_t p0 = begin; p0 < end; p0 += 32) {
            const int64_t p = p0 + lane;
            const int64_t e = p < end ? topk_idx[p] : -1;
            const bool valid = e >= 0 && e < E;
            const int key = valid ? (int)e : -1 - lane;  // invalid lanes match nobody
            const unsigned peers = __match_any_sync(0xffffffffu, key);
            const int before = __popc(peers & ((1u << lane) - 1u));
            int base = 0;
            if (valid) base = s_hist[warp * E + e];
            if (p < end) pos[p] = valid ? base + before : -1;
            __syncwarp();
            if (valid && lane == 31 - __clz(peers)) s_hist[warp * E + e] = base + __popc(peers);
            __syncwarp();
        }
    __syncthreads();
}

}  // namespace normal
}  // namespace cupyep
