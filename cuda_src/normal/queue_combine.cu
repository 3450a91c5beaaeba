// Normal-mode combine: the reverse route of dispatch, reduced in FP32.
//
// Grid: 2 * C blocks. Block c < C sends: group g streams the rows this rank
// received from source g in channel c (in the order they arrived) back into
// ring (c, me) of rank g. Block C + c receives: each warp reduces one of this
// rank's channel-c tokens at a time, reading the token's row from the ring of
// every rank it was sent to (position = send_head from dispatch), summing in
// FP32 in rank order (so the result is bitwise deterministic), and writing
// BF16. After every batch of tokens the block frees the ring slots it used.
//
// Slot layout: [x: H * 2 bytes][row weight: float][topk_weights: k float]
#include <cuda_bf16.h>
#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "normal/node_args.cuh"
#include "normal/queue.cuh"

namespace cupyep {
namespace normal {

// Row words per lane a receiving warp loads from every rank before summing:
// kWords * R 16-byte loads in flight, within the registers kNumThreads leave.
__host__ __device__ constexpr int combine_words(int num_ranks, int num_threads) {
    return num_threads > 512 ? (num_ranks <= 4 ? 2 : 1) : (num_ranks <= 2 ? 4 : 2);
}

template <int kNumRanks, int kNumThreads, int kL2>
__global__ void __launch_bounds__(kNumThreads, 1) queue_combine(CombineArgs a) {
    constexpr int R = kNumRanks;
    __shared__ int s_flag[R];
    __shared__ int64_t s_base[R];
    __shared__ int s_last[R];
    __shared__ int s_fail;
    const int C = a.num_channels;
    const bool is_sender = blockIdx.x < C;
    const int c = is_sender ? blockIdx.x : blockIdx.x - C;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    const RingShape& rs = a.rs;
    const int k = a.num_topk;
    const int64_t x_int4 = rs.x_bytes / 16;
    const CopyPath<kL2> copy;

    if (is_sender) {
        const int wpg = num_warps / R;
        if (warp >= wpg * R) return;
        const WarpGroup g{warp / wpg, warp % wpg, lane, wpg};
        const int dst = g.index;  // the source rank of these rows in dispatch
        const int* cp = a.recv_channel_prefix + dst * (C + 1);
        const int n = cp[c + 1] - cp[c];
        const int64_t row0 = (int64_t)a.recv_rank_offset[dst] + cp[c];
        send_stream(g, a.peers[dst], rs, R, c, a.rank, n, a.guard, /*phase=*/0, dst, &s_flag[dst],
                    [=](char* slot, int i) {
                        const int64_t row = row0 + i;
                        copy.to_ring(reinterpret_cast<int4*>(slot), a.x + row * x_int4, x_int4, lane);
                        float* meta = reinterpret_cast<float*>(slot + rs.x_bytes);
                        if (lane == 0) meta[0] = a.row_weights ? a.row_weights[row] : 1.f;
                        if (a.recv_topk_weights)
                            for (int j = lane; j < k; j += 32) meta[1 + j] = a.recv_topk_weights[row * k + j];
                    });
        return;
    }

    // Receiver of channel c.
    void* mine = a.peers[a.rank];
    if (threadIdx.x < R) {
        s_base[threadIdx.x] = *reinterpret_cast<volatile int64_t*>(
            ring_counter(mine, rs.counter_head, R, c, threadIdx.x));  // only I write my heads
        s_last[threadIdx.x] = -1;
    }
    if (threadIdx.x == 0) s_fail = 0;
    __syncthreads();
    const int tb = token_begin(a.num_tokens, C, c), te = token_begin(a.num_tokens, C, c + 1);
    for (int t0 = tb; t0 < te; t0 += num_warps) {
        const int t = t0 + warp;
        if (t < te) {
            // Lane d waits for token t's row from rank d and reads its weight.
            int pos = -1;
            float w = 0.f;
            const char* slot = nullptr;
            if (lane < R) {
                pos = a.send_head[(int64_t)t * R + lane];
                if (pos >= 0) {
                    const int64_t abs_pos = s_base[lane] + pos;
                    if (wait_geq(ring_counter(mine, rs.counter_tail, R, c, lane), abs_pos + 1, a.guard, /*phase=*/1, lane)) {
                        slot = ring_slot(mine, rs, R, c, lane, abs_pos);
                        w = __int_as_float(ld_volatile(reinterpret_cast<const int*>(slot + rs.x_bytes)));
                        atomicMax(&s_last[lane], pos);
                    } else {
                        s_fail = 1;
                        pos = -1;
                    }
                }
            }
            const char* slots[R];
            int valid[R];
            float ws[R];
#pragma unroll
            for (int d = 0; d < R; ++d) {
                valid[d] = __shfl_sync(0xffffffffu, pos, d) >= 0;
                slots[d] = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(slot), d));
                ws[d] = __shfl_sync(0xffffffffu, w, d);
            }
            int4* out = a.combined_x + (int64_t)t * x_int4;
            // kWords row words per lane, from every rank, are in flight at once before
            // any is summed (the ring loads are ordered, so summing each word before
            // loading the next would wait a round trip per word).
            constexpr int kWords = combine_words(R, kNumThreads);
            for (int64_t i0 = lane; i0 < x_int4; i0 += 32 * kWords) {
                int4 v[kWords][R];
#pragma unroll
                for (int u = 0; u < kWords; ++u)
#pragma unroll
                    for (int d = 0; d < R; ++d)
                        v[u][d] = valid[d] && i0 + u * 32 < x_int4
                                      ? ld_ring_v4(reinterpret_cast<const int4*>(slots[d]) + i0 + u * 32)
                                      : make_int4(0, 0, 0, 0);
#pragma unroll
                for (int u = 0; u < kWords; ++u) {
                    if (i0 + u * 32 >= x_int4) break;
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int d = 0; d < R; ++d)
                        if (valid[d]) fma_bf16x8(acc, v[u][d], ws[d]);
                    copy.store_out(out + i0 + u * 32, pack_bf16x8(acc));
                }
            }
            if (a.combined_topk_weights) {
                for (int j = lane; j < k; j += 32) {
                    float sum = 0.f;
#pragma unroll
                    for (int d = 0; d < R; ++d)
                        if (valid[d]) sum += __int_as_float(ld_volatile(reinterpret_cast<const int*>(slots[d] + rs.x_bytes) + 1 + j));
                    a.combined_topk_weights[(int64_t)t * k + j] = sum;
                }
            }
#pragma unroll
            for (int d = 0; d < R; ++d)
                if (valid[d]) copy.consumed(slots[d], rs.slot_bytes, lane);
        }
        __syncthreads();
        if (s_fail) return;
        // Every warp is done with this batch's slots: free them.
        if (threadIdx.x < R && s_last[threadIdx.x] >= 0)
            st_release_sys(ring_counter(mine, rs.counter_head, R, c, threadIdx.x), s_base[threadIdx.x] + s_last[threadIdx.x] + 1);
    }
}

}  // namespace normal
}  // namespace cupyep
