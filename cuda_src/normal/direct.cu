// Direct (one-copy) transport of normal mode: senders write rows straight
// into the receivers' output arrays, which live in IPC-registered pools.
//
// Dispatch (grid: any number of blocks, all resident):
//   1. Block 0 tells every rank that this rank's pool is free for this call
//      (dispatch_ready, an epoch); every block waits until every destination
//      has said so (its previous output may still be in use until then).
//   2. The grid's warps take the (destination, position) pairs of this rank's
//      send lists, a warp per row: row t of x goes to destination d's row
//      rank_prefix_matrix[me - 1, d] + position, the order of the queue
//      transport (source rank, then source token), with its scales, its
//      top-k ids made local to d (-1 for other ranks' experts), weights (0
//      there) and source index.
//   3. Each block adds the rows it delivered to each destination to that
//      destination's dispatch_arrived[me] (release); block 0 then waits until
//      every source has delivered what the count matrix says, so the kernel's
//      end means this rank's output is complete.
//   Rows move by warp copies of 16-byte words, or (bulk_stage > 0) by bulk
//   copies through two shared-memory stages per warp (common/bulk.cuh), which
//   keep more bytes in flight per SM than a warp's registers hold.
//   Worst-token mode: rows past the received count get -1 ids and sources and
//   0 weights (no host work, CUDA-graph safe).
//   Expert-major (out.em_x >= 0): the payload goes, once per local slot,
//   straight into the slot's expert block at d (row expand.base[d, e] +
//   expand.pos[t, slot]), with the pair map (em_recv_row) and each expert
//   row's rank-major row (em_src_row); no rank-major payload is written. Each
//   receiver pads its own blocks (zero rows, source row -1).
//
// Combine (grid: any number of blocks, all resident):
//   1. Block 0 tells every expert rank that this rank's combine pool is free
//      for this call; every block waits until every owner has said so.
//   2. Warps take this rank's received rows: row r from source s (position i
//      in s's block) goes, with its row weight and top-k weights, to s's
//      partial row sum(count[s, d < me]) + i: s's send order. Zero-copy
//      (zc_x >= 0): the rows stay where the caller wrote them, in this rank's
//      pool, and only the weights are pushed; the owners read the rows there.
//      In place (in_place): likewise, but the rows stay in the caller's own x,
//      which every owner reads through the mapping x_peers[d] of rank d's x.
//   3. Each block adds its delivered rows to combine_arrived[me] of each owner;
//      every block waits until every expert rank has delivered its rows.
//   4. Warps take this rank's tokens: the FP32 sum over ranks in rank order of
//      weight * partial, rounded to BF16 (bitwise what the queue transport's
//      combine computes), and the sum of the top-k weights.
//   5. In place: the last block out tells every expert rank that this rank has
//      read its x (combine_done), then waits until every owner has read this
//      rank's, so that the kernel's end frees the caller's x.
#include "common/bf16.cuh"
#include "common/bulk.cuh"
#include "common/copy.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "normal/node_args.cuh"
#include "normal/direct_args.cuh"
#include "normal/direct_positions.cuh"
#include "normal/layout.cuh"
#include "normal/notify.cuh"

namespace cupyep {
namespace normal {

__device__ __forceinline__ int64_t* direct_counter(void* base, int64_t offset, int index) {
    return reinterpret_cast<int64_t*>(static_cast<char*>(base) + offset + (int64_t)index * kDirectSyncStride);
}
__device__ __forceinline__ void red_add_release_sys(int64_t* p, int64_t v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
// Rows rank s sends to rank d, from the [R, R] rank prefix matrix (cumulative over sources).
__device__ __forceinline__ int pair_count(const int* rpm, int num_ranks, int s, int d) {
    return rpm[s * num_ranks + d] - (s > 0 ? rpm[(s - 1) * num_ranks + d] : 0);
}
// Channel of token t: the c with token_begin(c) <= t < token_begin(c + 1).
__device__ __forceinline__ int channel_of(int t, int num_tokens, int num_channels) {
    return (int)(((int64_t)(t + 1) * num_channels + num_tokens - 1) / num_tokens) - 1;
}

// Last block out of the grid advances the epoch (every block read it at its start).
__device__ __forceinline__ bool last_block_out(int64_t* exited) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(reinterpret_cast<unsigned long long*>(exited), 1ull) == gridDim.x - 1;
    }
    __syncthreads();
    return s_last != 0;
}

// A warp's row copy: by the warp's bulk pipe when `bulk` (lane 0 issues it),
// else by the warp's 16-byte loads and stores.
__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int64_t n_int4, bool bulk, BulkPipe& pipe,
                                        int lane) {
    if (bulk)
        pipe.copy(dst, src, n_int4 * 16, lane);
    else
        warp_copy<4, true>(dst, src, n_int4, lane, [](const int4* p) { return ld_nc_na_v4(p); },
                           [](int4* p, const int4& v) { st_na_v4(p, v); });
}

// The calling warp's bulk pipe over its two stages of `stage_bytes` in the
// block's dynamic shared memory (bars: the warp's two mbarriers). Every lane calls it.
__device__ __forceinline__ void init_warp_pipe(BulkPipe& pipe, uint64_t* bars, int stage_bytes, int warp, int lane) {
    extern __shared__ __align__(128) char s_bulk_stages[];
    if (stage_bytes > 0) pipe.init(s_bulk_stages + (int64_t)warp * 2 * stage_bytes, bars, stage_bytes, lane);
}

// Row t of x (and its scales) to row `row` of the arrays at byte offsets
// x_off / scales_off (-1: none) of a destination's pool, by one warp.
__device__ __forceinline__ void send_row(char* pool, int64_t x_off, int64_t scales_off, int64_t row,
                                         const DirectDispatchArgs& a, int t, int64_t x_int4, int lane,
                                         BulkPipe& pipe) {
    const DirectRecvLayout& o = a.out;
    copy_row(reinterpret_cast<int4*>(pool + x_off + row * o.x_bytes), a.x + t * x_int4, x_int4, a.bulk_stage > 0,
             pipe, lane);
    if (a.x_scales && scales_off >= 0) {
        float* sc = reinterpret_cast<float*>(pool + scales_off) + row * a.num_scales;
        for (int q = lane; q < a.num_scales; q += 32) sc[q] = __ldg(a.x_scales + (int64_t)t * a.num_scales + q);
    }
}

// The padding of this rank's expert-major arrays, which no sender writes:
// the alignment rows at the end of each expert's block (zero rows and
// scales, source row -1) and the source row (-1) of every row past the last
// block. Warp `gw` of `num_gw` over the grid; thread `first` of `stride`.
__device__ __forceinline__ void expand_padding(const DirectDispatchArgs& a, char* mine, int64_t first,
                                               int64_t stride, int lane, int gw, int num_gw) {
    const DirectRecvLayout& o = a.out;
    const int E = a.num_local_experts;
    const int* offsets = a.expand.meta;
    const int* counts = a.expand.meta + E + 1;
    int* src_row = reinterpret_cast<int*>(mine + o.em_src_row);
    const int64_t x_int4 = o.x_bytes / 16;
    for (int e = gw; e < E; e += num_gw) {
        const int64_t b = min((int64_t)offsets[e] + counts[e], o.em_rows), end = min((int64_t)offsets[e + 1], o.em_rows);
        for (int64_t m = b; m < end; ++m) {
            int4* row = reinterpret_cast<int4*>(mine + o.em_x + m * o.x_bytes);
            for (int64_t i = lane; i < x_int4; i += 32) st_na_v4(row + i, make_int4(0, 0, 0, 0));
            if (o.em_x_scales >= 0)
                for (int q = lane; q < a.num_scales; q += 32)
                    reinterpret_cast<float*>(mine + o.em_x_scales)[m * a.num_scales + q] = 0.f;
            if (lane == 0) src_row[m] = -1;
        }
    }
    for (int64_t m = max((int64_t)0, (int64_t)offsets[E]) + first; m < o.em_rows; m += stride) src_row[m] = -1;
}

// The dispatch by every block of the grid; `handshake`: announce this call
// to every rank and wait until every destination has announced it (the fused
// kernel's notify barrier has already lined the ranks up).
template <int kNumRanks, int kNumThreads>
__device__ __forceinline__ void direct_dispatch_body(const DirectDispatchArgs& a, bool handshake) {
    constexpr int R = kNumRanks;
    constexpr int kWarps = kNumThreads / 32;
    __shared__ int s_begin[R + 1];  // pair index where each destination's send list starts
    __shared__ int s_row0[R];       // first row of my block at each destination
    __shared__ int s_sent[R];       // rows this block delivered to each destination
    __shared__ int64_t s_epoch;
    __shared__ int s_fail;
    __shared__ __align__(8) uint64_t s_bars[kWarps][2];  // each warp's bulk pipe
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int C = a.num_channels, T = a.num_tokens, k = a.num_topk, ns = a.num_scales;
    const DirectRecvLayout& o = a.out;
    const bool expand = o.em_x >= 0;
    if (threadIdx.x == 0) {
        s_epoch = ld_volatile64(a.state + kDispatchEpoch) + 1;
        s_fail = 0;
        int acc = 0;
        for (int d = 0; d < R; ++d) { s_begin[d] = acc; acc += a.send_channel_prefix[d * (C + 1) + C]; }
        s_begin[R] = acc;
    }
    if (threadIdx.x < R) {
        s_row0[threadIdx.x] = a.rank > 0 ? a.rank_prefix_matrix[(a.rank - 1) * R + threadIdx.x] : 0;
        s_sent[threadIdx.x] = 0;
    }
    // In the fused kernel the bulk stages reuse the shared memory the notify and position passes
    // wrote: every thread orders its own generic accesses before the async proxy's writes.
    if (a.bulk_stage > 0) fence_proxy_async_shared();
    __syncthreads();  // (in the fused kernel, also: the shared memory the notify block used is free)
    const int64_t epoch = s_epoch;
    BulkPipe pipe;
    init_warp_pipe(pipe, s_bars[warp], a.bulk_stage, warp, lane);

    // 1. My pool is free for this call; wait until every destination's is.
    if (handshake && blockIdx.x == 0 && threadIdx.x < R)
        st_release_sys(direct_counter(a.syncs[threadIdx.x], a.sync.dispatch_ready, a.rank), epoch);
    if (handshake && threadIdx.x < R &&
        !wait_geq(direct_counter(a.syncs[a.rank], a.sync.dispatch_ready, threadIdx.x), epoch, a.guard, 0, threadIdx.x))
        s_fail = 1;
    __syncthreads();
    if (s_fail) return;

    // 2. A warp per (destination, position) pair.
    const int64_t x_int4 = o.x_bytes / 16;
    const int total = s_begin[R];
    int d = 0, run = 0;
    for (int j = blockIdx.x * kWarps + warp; j < total; j += gridDim.x * kWarps) {
        int nd = d;
        while (j >= s_begin[nd + 1]) ++nd;
        if (nd != d) {
            if (lane == 0 && run) atomicAdd(&s_sent[d], run);
            d = nd;
            run = 0;
        }
        ++run;  // counted even when skipped, so the receiver's wait completes
        const int i = j - s_begin[d];
        const int64_t row = (int64_t)s_row0[d] + i;
        if (row >= o.rows) {  // the receiver's notify reported it in worst-token mode
            if (lane == 0) report_error(a.guard, kErrorCapacity, 2, d, row + 1, o.rows);
            continue;
        }
        const int t = __ldg(a.send_list + (int64_t)d * T + i);
        char* pool = static_cast<char*>(a.pools[d]);
        if (!expand)
            send_row(pool, o.x, o.x_scales, row, a, t, x_int4, lane, pipe);
        if (lane == 0) reinterpret_cast<int*>(pool + o.src_idx)[row] = t;
        if (a.topk_idx) {
            const int E_local = a.num_local_experts;
            const int64_t lo = (int64_t)d * E_local, hi = lo + E_local;
            int64_t* ids = reinterpret_cast<int64_t*>(pool + o.topk_idx) + row * k;
            float* ws = o.topk_weights >= 0 ? reinterpret_cast<float*>(pool + o.topk_weights) + row * k : nullptr;
            int* pair_rows = expand ? reinterpret_cast<int*>(pool + o.em_recv_row) + row * k : nullptr;
            for (int q0 = 0; q0 < k; q0 += 32) {  // warp-uniform bounds: the ballot sees every lane
                const int q = q0 + lane;
                const int64_t e = q < k ? __ldg(a.topk_idx + (int64_t)t * k + q) : -1;
                const bool local = e >= lo && e < hi;
                if (q < k) {
                    ids[q] = local ? e - lo : -1;
                    if (ws) ws[q] = local ? __ldg(a.topk_weights + (int64_t)t * k + q) : 0.f;
                }
                if (!expand) continue;
                // Expert-major: the row once per local slot, into the slot's expert block.
                int em = -1;
                if (local) {
                    em = __ldg(a.expand.base + d * (E_local + 1) + (e - lo)) + a.expand.pos[(int64_t)t * k + q];
                    if (em >= o.em_rows) {  // only past a worst-token bound; reported, never written out of bounds
                        report_error(a.guard, kErrorCapacity, 2, d, em + 1, o.em_rows);
                        em = -1;
                    }
                }
                if (q < k) pair_rows[q] = em;
                for (unsigned m = __ballot_sync(0xffffffffu, em >= 0); m; m &= m - 1) {
                    const int dst = __shfl_sync(0xffffffffu, em, __ffs(m) - 1);
                    send_row(pool, o.em_x, o.em_x_scales, dst, a, t, x_int4, lane, pipe);
                    if (lane == 0) reinterpret_cast<int*>(pool + o.em_src_row)[dst] = (int)row;
                }
            }
        }
        if (a.x_scales && !expand) {
            float* sc = reinterpret_cast<float*>(pool + o.x_scales) + row * ns;
            for (int q = lane; q < ns; q += 32) sc[q] = __ldg(a.x_scales + (int64_t)t * ns + q);
        }
    }
    if (lane == 0 && run) atomicAdd(&s_sent[d], run);
    if (a.bulk_stage > 0) pipe.drain(lane);

    // Worst-token padding of my own arrays: rows [received, capacity).
    {
        char* mine = static_cast<char*>(a.pools[a.rank]);
        const int64_t cap = min((int64_t)a.capacity, o.rows);
        const int64_t n = max(0, min(a.recv_rank_offset[R], a.capacity));
        const int64_t first = (int64_t)blockIdx.x * kNumThreads + threadIdx.x, stride = (int64_t)gridDim.x * kNumThreads;
        for (int64_t r = n + first; r < cap; r += stride) reinterpret_cast<int*>(mine + o.src_idx)[r] = -1;
        if (a.topk_idx)
            for (int64_t q = n * k + first; q < cap * k; q += stride) {
                reinterpret_cast<int64_t*>(mine + o.topk_idx)[q] = -1;
                if (o.topk_weights >= 0) reinterpret_cast<float*>(mine + o.topk_weights)[q] = 0.f;
                if (expand) reinterpret_cast<int*>(mine + o.em_recv_row)[q] = -1;
            }
        if (expand) expand_padding(a, mine, first, stride, lane, blockIdx.x * kWarps + warp, gridDim.x * kWarps);
    }

    // 3. Publish this block's rows, then (block 0) wait for every source's.
    __syncthreads();
    if (threadIdx.x < R && s_sent[threadIdx.x]) {
        fence_acq_rel_sys();
        red_add_release_sys(direct_counter(a.syncs[threadIdx.x], a.sync.dispatch_arrived, a.rank), s_sent[threadIdx.x]);
    }
    if (blockIdx.x == 0 && threadIdx.x < R) {
        const int s = threadIdx.x;
        const int64_t want = ld_volatile64(a.state + kStateHeader + s) + pair_count(a.rank_prefix_matrix, R, s, a.rank);
        if (wait_geq(direct_counter(a.syncs[a.rank], a.sync.dispatch_arrived, s), want, a.guard, 1, s))
            a.state[kStateHeader + s] = want;
    }
    if (last_block_out(a.state + kDispatchExited)) {
        // Every block is out, block 0 after its wait for every source: my rows are complete.
        if (a.src_copy) {
            __threadfence();
            const int* src = reinterpret_cast<const int*>(static_cast<char*>(a.pools[a.rank]) + o.src_idx);
            const int64_t n = a.capacity > 0 ? min((int64_t)a.capacity, o.rows) : (int64_t)a.recv_rank_offset[R];
            for (int64_t r = threadIdx.x; r < n; r += blockDim.x) a.src_copy[r] = __ldcg(src + r);
        }
        if (threadIdx.x == 0) {
            a.state[kDispatchExited] = 0;
            a.state[kDispatchEpoch] = epoch;
        }
    }
}

template <int kNumRanks, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) direct_dispatch(DirectDispatchArgs a) {
    stamp_start(a.kernel_time);
    direct_dispatch_body<kNumRanks, kNumThreads>(a, /*handshake=*/true);
    stamp_end(a.kernel_time);
}

// Dispatch with the layout and the notify pass fused in (one launch):
//   block 0 lays the tokens out (is_token_in_rank, counts per rank and expert,
//   in shared memory), runs the notify pass, checks that every receiver's rows
//   fit the pools, publishes the outcome (kFusedStatus, and to the host's
//   status word: 1 sent, 2 the pools are too small, 3 notify failed) and
//   releases the other blocks (kFusedReady); then every block sends as
//   direct_dispatch does, unless a receiver's expert-major rows do not fit its
//   slot: then nothing is sent and the host sends the rows rank-major into the
//   slot with direct_dispatch (cupyep.normal.direct). The last block out of the
//   send copies the received source indices into the handle (src_copy).
//   An expert-major dispatch's positions (expert_positions) are computed by
//   block 1 (block 0 alone: after the notify) while block 0 coordinates.
// Dynamic shared memory: the most of R * (C + 1) + R + E ints (block 0) and
// expand.hist_warps * E ints (the position block).
template <int kNumRanks, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) direct_dispatch_fused(DirectFusedArgs a) {
    extern __shared__ int s_dyn[];
    constexpr int R = kNumRanks;
    __shared__ int64_t s_seq;
    __shared__ int s_status;
    const NotifyArgs& n = a.notify;
    int64_t* state = a.dispatch.state;
    const DirectDispatchArgs& da = a.dispatch;
    const bool pos_here = da.out.em_x >= 0 && da.expand.compute_pos;
    const int pos_block = gridDim.x > 1 ? 1 : 0;  // computes the expert-major positions meanwhile
    stamp_start(da.kernel_time);
    if (threadIdx.x == 0) s_seq = ld_volatile64(state + kFusedSeq) + 1;
    __syncthreads();
    const int64_t seq = s_seq;
    if (blockIdx.x == 0) {
        const int C = n.num_channels, E = n.num_experts, T = n.num_tokens;
        int* s_prefix = s_dyn;
        int* s_rank = s_prefix + R * (C + 1);
        int* s_expert = s_rank + R;
        for (int i = threadIdx.x; i < R + E; i += blockDim.x) s_rank[i] = 0;
        __syncthreads();
        for (int t = threadIdx.x; t < T; t += blockDim.x)
            token_layout(a.dispatch.topk_idx, t, a.dispatch.num_topk, E, R, const_cast<bool*>(n.is_token_in_rank),
                         s_rank, s_expert, a.layout_guard);
        __syncthreads();
        const bool ok = notify_pass<R>(n, s_prefix, s_rank, s_expert);
        if (threadIdx.x == 0) {
            int status = ok ? 1 : 3;
            const int E_local = E / R;
            for (int d = 0; ok && d < R; ++d) {
                if (n.rank_prefix_matrix[(R - 1) * R + d] > da.out.rows) status = 2;
                if (da.out.em_x >= 0 && n.expand_base[d * (E_local + 1) + E_local] > da.out.em_rows) status = 2;
            }
            state[kFusedStatus] = status;
            if (a.host_status) {
                __threadfence_system();
                *reinterpret_cast<volatile int*>(a.host_status) = status;
            }
            __threadfence();
            st_release_sys(state + kFusedReady, seq);
            s_status = status;
        }
        __syncthreads();
    }
    if (pos_here && blockIdx.x == pos_block) {
        expert_positions(da.topk_idx, da.num_tokens, da.num_topk, da.expand.num_experts, da.expand.hist_warps,
                         da.expand.pos, s_dyn);
        if (threadIdx.x == 0) {
            __threadfence();
            st_release_sys(state + kFusedPosReady, seq);
        }
    }
    if (blockIdx.x != 0) {
        if (threadIdx.x == 0) {
            s_status = wait_geq(state + kFusedReady, seq, da.guard, 3, -1)
                           ? (int)ld_volatile64(state + kFusedStatus) : 3;
        }
        __syncthreads();
    }
    if (s_status == 1 && pos_here) {
        if (threadIdx.x == 0 && !wait_geq(state + kFusedPosReady, seq, da.guard, 4, -1)) s_status = 3;
        __syncthreads();
    }
    if (s_status == 1) direct_dispatch_body<kNumRanks, kNumThreads>(a.dispatch, /*handshake=*/false);
    if (last_block_out(state + kFusedExited) && threadIdx.x == 0) {
        state[kFusedExited] = 0;
        state[kFusedSeq] = seq;
    }
    stamp_end(da.kernel_time);
}

// kWords: row words (16 bytes) per lane and rank in flight before the reduce
// sums them (cupyep.normal.direct_kernels.combine_words: 4 up to 4 ranks, 2
// above; kWords * R <= 16 keeps them in registers).
template <int kNumRanks, int kNumThreads, int kWords>
__global__ void __launch_bounds__(kNumThreads, 1) direct_combine(DirectCombineArgs a) {
    constexpr int R = kNumRanks;
    constexpr int kWarps = kNumThreads / 32;
    static_assert(kWords >= 1 && kWords * R <= 16, "row words in flight: 1 to 16 / R");
    __shared__ int s_dst0[R];   // first partial row of my rows at each owner
    __shared__ int s_pbase[R];  // first partial row from each expert rank in my pool
    __shared__ int s_sent[R];
    __shared__ int s_zrow0[R];  // zero-copy: first row of my tokens in each expert rank's outputs
    __shared__ const int4* s_rows[R];  // where rank d's rows for my tokens are read
    __shared__ int64_t s_meta_row[kWarps][R];  // per warp: the partial row (metadata) of its token from rank d
    __shared__ int64_t s_epoch;
    __shared__ int s_fail;
    __shared__ __align__(8) uint64_t s_bars[kWarps][2];  // each warp's bulk pipe
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int C = a.num_channels, T = a.num_tokens, k = a.num_topk, me = a.rank;
    const int64_t x_int4 = a.x_int4, meta = a.meta_stride;
    const bool zero_copy = a.zc_x >= 0;
    const bool in_place = a.in_place != 0;
    const bool pull = zero_copy || in_place;  // the owners read the rows where they are; only weights are pushed
    stamp_start(a.kernel_time);
    if (threadIdx.x == 0) {
        s_epoch = ld_volatile64(a.state + kCombineEpoch) + 1;
        s_fail = 0;
        int acc = 0;
        for (int d = 0; d < R; ++d) { s_pbase[d] = acc; acc += a.send_channel_prefix[d * (C + 1) + C]; }
    }
    if (threadIdx.x < R) {
        const int s = threadIdx.x;
        int acc = 0;
        for (int d = 0; d < me; ++d) acc += pair_count(a.rank_prefix_matrix, R, s, d);
        s_dst0[s] = acc;
        s_sent[s] = 0;
        s_zrow0[s] = me > 0 ? a.rank_prefix_matrix[(me - 1) * R + s] : 0;  // here s is an expert rank
        s_rows[s] = zero_copy ? reinterpret_cast<const int4*>(static_cast<const char*>(a.pools[s]) + a.zc_x)
                    : in_place ? a.x_peers.x[s]
                               : reinterpret_cast<const int4*>(static_cast<const char*>(a.pools[me]) + a.partial_x);
    }
    __syncthreads();
    const int64_t epoch = s_epoch;
    const bool bulk = a.bulk_stage > 0 && !pull;
    BulkPipe pipe;
    if (bulk) init_warp_pipe(pipe, s_bars[warp], a.bulk_stage, warp, lane);

    // 1. My partial rows are free for this call; wait until every owner's are.
    if (blockIdx.x == 0 && threadIdx.x < R)
        st_release_sys(direct_counter(a.syncs[threadIdx.x], a.sync.combine_ready, me), epoch);
    if (threadIdx.x < R &&
        !wait_geq(direct_counter(a.syncs[me], a.sync.combine_ready, threadIdx.x), epoch, a.guard, 0, threadIdx.x))
        s_fail = 1;
    __syncthreads();
    if (s_fail) return;

    // 2. A warp per received row, to its owner.
    const int n_recv = a.recv_rank_offset[R];
    int s = 0, run = 0;
    for (int r = blockIdx.x * kWarps + warp; r < n_recv; r += gridDim.x * kWarps) {
        int ns_ = s;
        while (r >= a.recv_rank_offset[ns_ + 1]) ++ns_;
        if (ns_ != s) {
            if (lane == 0 && run) atomicAdd(&s_sent[s], run);
            s = ns_;
            run = 0;
        }
        ++run;
        const int64_t prow = (int64_t)s_dst0[s] + (r - a.recv_rank_offset[s]);
        if (prow >= a.rows) {
            if (lane == 0) report_error(a.guard, kErrorCapacity, 2, s, prow + 1, a.rows);
            continue;
        }
        char* pool = static_cast<char*>(a.pools[s]);
        if (!pull)
            copy_row(reinterpret_cast<int4*>(pool + a.partial_x) + prow * x_int4, a.x + (int64_t)r * x_int4, x_int4,
                     bulk, pipe, lane);
        float* m = reinterpret_cast<float*>(pool + a.partial_meta) + prow * meta;
        if (lane == 0) m[0] = a.row_weights ? __ldg(a.row_weights + r) : 1.f;
        if (a.recv_topk_weights)
            for (int q = lane; q < k; q += 32) m[1 + q] = __ldg(a.recv_topk_weights + (int64_t)r * k + q);
    }
    if (lane == 0 && run) atomicAdd(&s_sent[s], run);
    if (bulk) pipe.drain(lane);

    // 3. Publish; wait for every expert rank's rows.
    __syncthreads();
    if (threadIdx.x < R && s_sent[threadIdx.x]) {
        fence_acq_rel_sys();
        red_add_release_sys(direct_counter(a.syncs[threadIdx.x], a.sync.combine_arrived, me), s_sent[threadIdx.x]);
    }
    int64_t want = 0;
    if (threadIdx.x < R) {
        const int d = threadIdx.x;
        want = ld_volatile64(a.state + kStateHeader + R + d) + a.send_channel_prefix[d * (C + 1) + C];
        if (!wait_geq(direct_counter(a.syncs[me], a.sync.combine_arrived, d), want, a.guard, 1, d)) s_fail = 1;
    }
    __syncthreads();
    if (!s_fail) {
        // 4. A warp per token: lane d finds rank d's row (its partial row here,
        //    or, zero-copy, its output row in rank d's pool) and weight.
        const char* mine = static_cast<const char*>(a.pools[me]);
        const float* metas = reinterpret_cast<const float*>(mine + a.partial_meta);
        for (int t = blockIdx.x * kWarps + warp; t < T; t += gridDim.x * kWarps) {
            int64_t p = -1, src = -1;
            float w = 0.f;
            if (lane < R) {
                const int pos = a.send_head[(int64_t)t * R + lane];
                if (pos >= 0) {
                    const int c = channel_of(t, T, C);
                    const int64_t i = (int64_t)a.send_channel_prefix[lane * (C + 1) + c] + pos;
                    p = s_pbase[lane] + i;
                    src = pull ? s_zrow0[lane] + i : p;
                    w = metas[p * meta];
                }
            }
            __syncwarp();  // the previous token's readers are done
            if (lane < R) s_meta_row[warp][lane] = p;
            __syncwarp();
            int64_t srcs[R];
            float ws[R];
#pragma unroll
            for (int d = 0; d < R; ++d) {
                srcs[d] = __shfl_sync(0xffffffffu, src, d);
                ws[d] = __shfl_sync(0xffffffffu, w, d);
            }
            int4* out = a.combined_x + (int64_t)t * x_int4;
            for (int64_t i0 = lane; i0 < x_int4; i0 += 32 * kWords) {
                int4 v[kWords][R];
#pragma unroll
                for (int u = 0; u < kWords; ++u)
#pragma unroll
                    for (int d = 0; d < R; ++d)
                        v[u][d] = srcs[d] >= 0 && i0 + u * 32 < x_int4
                                      ? ld_v4(s_rows[d] + srcs[d] * x_int4 + i0 + u * 32) : make_int4(0, 0, 0, 0);
#pragma unroll
                for (int u = 0; u < kWords; ++u) {
                    if (i0 + u * 32 >= x_int4) break;
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int d = 0; d < R; ++d)
                        if (srcs[d] >= 0) fma_bf16x8(acc, v[u][d], ws[d]);
                    st_na_v4(out + i0 + u * 32, pack_bf16x8(acc));
                }
            }
            if (a.combined_topk_weights)
                for (int q = lane; q < k; q += 32) {
                    float sum = 0.f;
#pragma unroll
                    for (int d = 0; d < R; ++d)
                        if (srcs[d] >= 0) sum += metas[s_meta_row[warp][d] * meta + 1 + q];
                    a.combined_topk_weights[(int64_t)t * k + q] = sum;
                }
        }
    }
    const bool last = last_block_out(a.state + kCombineExited);
    if (last && in_place && !s_fail && threadIdx.x < R) {
        // 5. Every block has read what it reads of the expert ranks' x (each
        //    block's reads are done before it counts itself out).
        fence_acq_rel_sys();
        st_release_sys(direct_counter(a.syncs[threadIdx.x], a.sync.combine_done, me), epoch);
        wait_geq(direct_counter(a.syncs[me], a.sync.combine_done, threadIdx.x), epoch, a.guard, 3, threadIdx.x);
    }
    if (last && threadIdx.x < R) {
        if (!s_fail) a.state[kStateHeader + R + threadIdx.x] = want;
        if (threadIdx.x == 0) {
            a.state[kCombineExited] = 0;
            a.state[kCombineEpoch] = epoch;
        }
    }
    stamp_end(a.kernel_time);
}

}  // namespace normal
}  // namespace cupyep
