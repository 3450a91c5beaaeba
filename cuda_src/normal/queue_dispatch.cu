// Normal-mode dispatch over ring queues.
//
// Grid: 2 * C blocks. Block c < C is the sender of channel c: its warp group
// g streams this rank's channel-c tokens for destination g (send_list) into
// ring (c, me) of rank g. Block C + c is the receiver of channel c: group g
// drains ring (c, g) of this rank into the compact output, at the row offsets
// the notify pass computed (source-rank-major, then token order).
//
// Slot layout: [x: x_bytes][src_idx: int][topk_idx: k int (global ids)]
//              [topk_weights: k float][x_scales: num_scales float]
//
// Metric (opt-in): with a.queue_occupancy set, every receiver poll records
// how many rows it found waiting in its ring (see DispatchArgs).
//
// Worst-token mode (capacity > received count): the sender blocks, once
// their rows are out, fill this rank's receive rows past the count, a thread
// per entry: recv_src_idx and recv_topk_idx -1, recv_topk_weights 0. recv_x and
// recv_x_scales rows there are not written. The count is recv_rank_offset[R],
// which notify (or the dispatch that made a cached handle) wrote earlier on
// this stream, so the fill needs no host and replays correctly in a CUDA
// graph; no ring row lands at or past it, so the fill and the receivers never
// write the same entry. (In the senders it costs no registers: placed in the
// receivers it made the 80-register specialisations spill.)
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "normal/node_args.cuh"
#include "normal/queue.cuh"

namespace cupyep {
namespace normal {

// Rows [count, capacity) of this rank's receive arrays (none unless
// worst-token mode): ids and sources -1, weights 0. Called by threads
// [0, num_threads) of block `block` of `num_blocks`.
__device__ __forceinline__ void fill_padding_rows(const DispatchArgs& a, int num_ranks, int block, int num_blocks,
                                                  int num_threads) {
    const int64_t cap = a.capacity, k = a.num_topk;
    const int64_t n = max(0, min(a.recv_rank_offset[num_ranks], a.capacity));  // overflow: nothing to fill
    const int64_t first = (int64_t)block * num_threads + threadIdx.x, stride = (int64_t)num_blocks * num_threads;
    for (int64_t r = n + first; r < cap; r += stride) a.recv_src_idx[r] = -1;
    if (a.recv_topk_idx == nullptr) return;
    for (int64_t i = n * k + first; i < cap * k; i += stride) {  // consecutive threads, consecutive entries
        a.recv_topk_idx[i] = -1;
        if (a.recv_topk_weights) a.recv_topk_weights[i] = 0.f;
    }
}

template <int kNumRanks, int kNumThreads, int kL2>
__global__ void __launch_bounds__(kNumThreads, 1) queue_dispatch(DispatchArgs a) {
    constexpr int R = kNumRanks;
    __shared__ int s_flag[R];
    __shared__ int64_t s_avail[R];
    const int C = a.num_channels;
    const bool is_sender = blockIdx.x < C;
    const int c = is_sender ? blockIdx.x : blockIdx.x - C;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wpg = (blockDim.x / 32) / R;
    if (warp >= wpg * R) return;
    const WarpGroup g{warp / wpg, warp % wpg, lane, wpg};
    const RingShape& rs = a.rs;
    const int k = a.num_topk, ns = a.num_scales;
    const int64_t x_int4 = rs.x_bytes / 16;
    const CopyPath<kL2> copy;

    if (is_sender) {
        const int dst = g.index;
        const int begin = a.send_channel_prefix[dst * (C + 1) + c];
        const int n = a.send_channel_prefix[dst * (C + 1) + c + 1] - begin;
        const int* list = a.send_list + (int64_t)dst * a.num_tokens + begin;
        send_stream(g, a.peers[dst], rs, R, c, a.rank, n, a.guard, /*phase=*/0, dst, &s_flag[dst],
                    [=](char* slot, int i) {
                        const int t = __ldg(list + i);
                        // Issue the metadata loads first so they overlap the row copy.
                        int e0 = 0, e1 = 0;
                        float w0 = 0.f, w1 = 0.f, s0 = 0.f, s1 = 0.f;
                        if (lane < k) {
                            e0 = (int)__ldg(a.topk_idx + (int64_t)t * k + lane);
                            if (a.topk_weights) w0 = __ldg(a.topk_weights + (int64_t)t * k + lane);
                        }
                        if (lane + 32 < k) {
                            e1 = (int)__ldg(a.topk_idx + (int64_t)t * k + lane + 32);
                            if (a.topk_weights) w1 = __ldg(a.topk_weights + (int64_t)t * k + lane + 32);
                        }
                        if (a.x_scales) {
                            if (lane < ns) s0 = __ldg(a.x_scales + (int64_t)t * ns + lane);
                            if (lane + 32 < ns) s1 = __ldg(a.x_scales + (int64_t)t * ns + lane + 32);
                        }
                        copy.to_ring(reinterpret_cast<int4*>(slot), a.x + t * x_int4, x_int4, lane);
                        int* meta = reinterpret_cast<int*>(slot + rs.x_bytes);
                        float* fmeta = reinterpret_cast<float*>(meta);
                        if (lane == 0) meta[0] = t;
                        if (lane < k) { meta[1 + lane] = e0; fmeta[1 + k + lane] = w0; }
                        if (lane + 32 < k) { meta[33 + lane] = e1; fmeta[33 + k + lane] = w1; }
                        for (int j = lane + 64; j < k; j += 32) {
                            meta[1 + j] = (int)a.topk_idx[(int64_t)t * k + j];
                            fmeta[1 + k + j] = a.topk_weights ? a.topk_weights[(int64_t)t * k + j] : 0.f;
                        }
                        if (a.x_scales) {
                            if (lane < ns) fmeta[1 + 2 * k + lane] = s0;
                            if (lane + 32 < ns) fmeta[33 + 2 * k + lane] = s1;
                            for (int j = lane + 64; j < ns; j += 32) fmeta[1 + 2 * k + j] = a.x_scales[(int64_t)t * ns + j];
                        }
                    });
        fill_padding_rows(a, R, c, C, wpg * R * 32);  // the warps that reach here
        return;
    }

    // Receiver of channel c, group g drains source g.
    const int src = g.index;
    const int* cp = a.recv_channel_prefix + src * (C + 1);
    const int n = cp[c + 1] - cp[c];
    const int64_t row0 = (int64_t)a.recv_rank_offset[src] + cp[c];
    void* mine = a.peers[a.rank];
    const int64_t* tail = ring_counter(mine, rs.counter_tail, R, c, src);
    int64_t* head = ring_counter(mine, rs.counter_head, R, c, src);
    const int64_t base = *reinterpret_cast<volatile int64_t*>(head);  // only I write my head
    const int64_t lo = (int64_t)a.rank * a.num_local_experts, hi = lo + a.num_local_experts;
    for (int consumed = 0; consumed < n;) {
        if (g.leader()) {
            // A sender may already be pushing the next call's rows: clamp to n.
            int64_t avail = -1;
            if (wait_geq(tail, base + consumed + 1, a.guard, /*phase=*/1, src)) {
                const int64_t waiting = ld_acquire_sys(tail) - base - consumed;  // filled, not yet consumed
                avail = min(waiting, (int64_t)(n - consumed));
                if (a.queue_occupancy) {
                    auto* q = reinterpret_cast<unsigned long long*>(a.queue_occupancy);
                    atomicAdd(q, (unsigned long long)waiting);
                    atomicAdd(q + 1, 1ull);
                    atomicMax(q + 2, (unsigned long long)waiting);
                }
            }
            s_avail[src] = avail;
        }
        g.sync();
        const int avail = (int)s_avail[src];
        if (avail < 0) return;
        for (int j = g.warp; j < avail; j += g.num_warps) {
            const int64_t row = row0 + consumed + j;
            if (row >= a.capacity) continue;  // notify already reported the overflow
            const char* slot = ring_slot(mine, rs, R, c, src, base + consumed + j);
            const int* meta = reinterpret_cast<const int*>(slot + rs.x_bytes);
            // Metadata loads go out before the row copy and land during it.
            int src_idx = 0, e0 = -1, e1 = -1, w0 = 0, w1 = 0, s0 = 0, s1 = 0;
            if (lane == 0) src_idx = ld_volatile(meta);
            if (lane < k) { e0 = ld_volatile(meta + 1 + lane); w0 = ld_volatile(meta + 1 + k + lane); }
            if (lane + 32 < k) { e1 = ld_volatile(meta + 33 + lane); w1 = ld_volatile(meta + 33 + k + lane); }
            if (a.recv_x_scales) {
                if (lane < ns) s0 = ld_volatile(meta + 1 + 2 * k + lane);
                if (lane + 32 < ns) s1 = ld_volatile(meta + 33 + 2 * k + lane);
            }
            copy.from_ring(a.recv_x + row * x_int4, reinterpret_cast<const int4*>(slot), x_int4, lane);
            if (lane == 0) a.recv_src_idx[row] = src_idx;
            auto put = [&](int j2, int64_t e, int w) {
                const bool local = e >= lo && e < hi;
                a.recv_topk_idx[row * k + j2] = local ? e - lo : -1;
                if (a.recv_topk_weights) a.recv_topk_weights[row * k + j2] = local ? __int_as_float(w) : 0.f;
            };
            if (lane < k) put(lane, e0, w0);
            if (lane + 32 < k) put(lane + 32, e1, w1);
            for (int j2 = lane + 64; j2 < k; j2 += 32) put(j2, ld_volatile(meta + 1 + j2), ld_volatile(meta + 1 + k + j2));
            if (a.recv_x_scales) {
                if (lane < ns) a.recv_x_scales[row * ns + lane] = __int_as_float(s0);
                if (lane + 32 < ns) a.recv_x_scales[row * ns + lane + 32] = __int_as_float(s1);
                for (int j2 = lane + 64; j2 < ns; j2 += 32)
                    a.recv_x_scales[row * ns + j2] = __int_as_float(ld_volatile(meta + 1 + 2 * k + j2));
            }
            copy.consumed(slot, rs.slot_bytes, lane);
        }
        g.sync();
        consumed += avail;
        if (g.leader()) st_release_sys(head, base + consumed);
    }
}

}  // namespace normal
}  // namespace cupyep
