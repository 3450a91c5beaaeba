// Two-hop (hierarchical) dispatch of normal mode across nodes: the data
// path, given the plan every rank has after the count exchange
// (cupyep.reference.internode.two_hop_plan computes the same offsets).
//
// R ranks in nodes of K; rank me = node * K + local.
//   0. Notify (two_hop_notify, one block, before the dispatch on the same
//      stream): the layout of my tokens, the count exchange (my row of
//      counts per rank and per node, put with a signal to every PE into one
//      of two symmetric matrices by call parity), then from every PE's row
//      the plan: rank_prefix_matrix, send_head, the network slots, the rows
//      in my network buffer per source node, and the steps of the cumulative
//      signal and arrival targets of the dispatch (added to `state`) and of
//      the combine (added when a combine runs).
//      The exchange is also the barrier between calls: a rank puts its row
//      for call n + 1 only after its stream has finished call n, so once
//      every row has arrived no rank still reads the pools or network
//      buffers of call n. Call n + 2 writes call n's matrix, which every rank
//      read before it put its row for call n + 1.
// The dispatch, one launch, every block resident (the blocks of the
// forwarding phase wait on other ranks' puts), runs only when this call's
// notify succeeded (state[0] == call):
//   1. Network hop. For each (token t, remote node n) of the plan, a warp
//      writes a staging row (the payload, then t, the k top-k ids, the k
//      weights and t's position among my tokens for each of node n's K
//      ranks, -1 where it does not go) and puts it with a signal into its
//      slot of the rail peer n * K + local's network buffer
//      (nvshmemx_putmem_signal_nbi_warp: the signal, an add of 1 to
//      net_signal[my node] there, lands after the row).
//   2. Direct rows. Tokens for my own node's ranks go straight into their
//      receive pools (IPC peer pointers) at rank_prefix_matrix[me - 1, d] +
//      position, as the direct transport writes them.
//   3. Forwarding. Once every source node's signal reaches this call's
//      cumulative count, the grid's warps take the rows of my network buffer
//      and write each to every destination rank of my node it names, at
//      rank_prefix_matrix[s - 1, d] + position (s = source node * K + local).
//   4. Every writer adds the rows it delivered to d from s to d's
//      arrived[s] (release, in d's sync memory); block 0 waits until every
//      source's rows have arrived, so the kernel's end means this rank's
//      output is complete. Counters only grow; the host passes this call's
//      cumulative targets.
// Outputs: recv_x [N, H] BF16 bits (or FP8 bytes, with recv_x_scales [N, H / 128]),
// recv_topk_idx [N, k] (local ids, -1 for other ranks' experts),
// recv_topk_weights [N, k] (0 there), recv_src_idx [N].
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/copy.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "nvshmem/signal.cuh"

namespace cupyep {
namespace normal {

using shmem::wait_signal;

// `state` (int64, private to the rank, zero at first): [0] notify calls done,
// [1] 1 when the latest notify succeeded (0 from its start), then the
// cumulative targets: net_total [N] (dispatch: network rows from each
// source node), arrived_total [R] (dispatch: rows from each source rank),
// combine_total [1 + K] (combine: direct rows in, then gather rows in from each rank of my node),
// combine_net_total [N] (combine: partials from each node),
// combine_rank_total [R] (combine, direct route: rows from each rank of another node).
__host__ __device__ constexpr int two_hop_state_words(int R, int K) { return 2 + R / K + R + 1 + K + R / K + R; }
constexpr int kNotifyOk = 1;

struct TwoHopNotifyArgs {
    const int64_t* topk_idx;      // [T, k] global expert ids, -1: none (checked on the host)
    uint8_t* in_rank;             // [T, R] scratch: t goes to rank d
    int64_t* send_head;           // [T, R] out: t's position among my tokens for each rank, -1: not sent
    int64_t* rdma_slot;           // [T, N] out: row of (t, n) in the rail peer's network buffer, -1: none
    int64_t* rank_prefix;         // [R, R] out: rank_prefix_matrix (cumulative over sources)
    int64_t* net_count;           // [N] out: rows from each source node in my network buffer (0: my node)
    int* node_tokens;             // [N, T] out: my tokens for node n in token order (its network rows' order)
    int64_t* send_node;           // [N] out: my tokens for each node (0: my node)
    int64_t* row;                 // symmetric [R + N + 1]: my counts per rank, then per node, then my capacity
    int64_t* matrix;              // symmetric [2, R, R + N + 1]: every PE's row, by call parity
    uint64_t* row_signal;         // symmetric [R]: rows arrived from each PE, all calls
    int64_t* state;               // private, see above
    int* host;                    // mapped host ints: [0] status (1 done, 3 failed), [1] rows I receive,
                                  // [2, 2 + R) rows from each source rank; null in worst-token mode
    int capacity;                 // rows the caller's outputs hold: more for any rank to receive is a
                                  // capacity error on every rank (one verdict: nothing is sent, no target moves)
    int64_t* delta;               // [two_hop_state_words - 2] this call's steps of the cumulative targets:
                                  // written by a counting call; a cached one adds the dispatch's (the
                                  // first N + R); the host adds the combine's before a combine
    int cached;                   // 1: reuse a handle's plan: only the barrier (a signal to every PE) and
                                  // the targets' steps from `delta`
    int64_t* kernel_time;         // [2] or null: the kernel's start and end (stamp_start / stamp_end)
    int num_tokens;
    int num_topk;
    int num_experts;
    int num_ranks;
    int ranks_per_node;
    int rank;
    Guard guard;
};

// The notify's verdict to the host's status word (1 done, 3 failed), after
// everything it wrote there before; nothing without a status word.
__device__ __forceinline__ void publish_status(int* host, bool ok) {
    if (host == nullptr) return;
    __threadfence_system();
    *reinterpret_cast<volatile int*>(host) = ok ? 1 : 3;
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) two_hop_notify(TwoHopNotifyArgs a) {
    constexpr int kWarps = kNumThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int K = a.ranks_per_node, R = a.num_ranks, N = R / K, T = a.num_tokens, k = a.num_topk;
    const int me = a.rank, my_node = me / K, local = me % K, El = a.num_experts / R;
    const int W = R + N + 1;  // words of a row: counts per rank, per node, then the capacity
    // [R + N] my counts, then [N] the slot bases, then int [kWarps][R + N] the plan's positions per warp
    extern __shared__ unsigned long long s_dyn64[];
    unsigned long long* s_cnt = s_dyn64;
    int64_t* s_base = reinterpret_cast<int64_t*>(s_dyn64 + R + N);
    __shared__ int64_t s_call;
    __shared__ int s_fail;
    stamp_start(a.kernel_time);
    for (int i = threadIdx.x; i < R + N; i += blockDim.x) s_cnt[i] = 0;
    if (threadIdx.x == 0) {
        s_call = ld_volatile64(a.state) + 1;
        s_fail = 0;
        a.state[kNotifyOk] = 0;  // this call's dispatch and combine wait for the verdict below
    }
    __syncthreads();

    if (a.cached) {  // the handle's plan: the exchange is only the barrier between calls
        const int64_t call = s_call;
        if (threadIdx.x < R) nvshmemx_signal_op(a.row_signal + me, 1, NVSHMEM_SIGNAL_ADD, threadIdx.x);
        if (threadIdx.x < R && !wait_signal(a.row_signal + threadIdx.x, call, a.guard, /*phase=*/0, threadIdx.x))
            s_fail = 1;
        __syncthreads();
        if (threadIdx.x == 0) {
            if (!s_fail) {
                for (int i = 0; i < N + R; ++i) a.state[2 + i] += a.delta[i];  // the dispatch's targets
                a.state[0] = call;
                a.state[kNotifyOk] = 1;
            }
            publish_status(a.host, !s_fail);
        }
        stamp_end(a.kernel_time);
        return;
    }

    // 1. Layout: which ranks and nodes each token goes to, and how many of mine go to each.
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        uint8_t* in = a.in_rank + (int64_t)t * R;
        for (int d = 0; d < R; ++d) in[d] = 0;
        for (int q = 0; q < k; ++q) {
            const int64_t e = a.topk_idx[(int64_t)t * k + q];
            if (e < -1 || e >= a.num_experts) {  // not checked on the host (validate=False): dropped, reported
                report_error(a.guard, kErrorBadInput, /*phase=*/2, -1, e, a.num_experts);
                continue;
            }
            if (e >= 0) in[e / El] = 1;
        }
        for (int n = 0; n < N; ++n) {
            bool any = false;
            for (int j = 0; j < K; ++j)
                if (in[n * K + j]) {
                    atomicAdd(&s_cnt[n * K + j], 1ull);
                    any = true;
                }
            if (any) atomicAdd(&s_cnt[R + n], 1ull);
        }
    }
    __syncthreads();

    // 2. Count exchange: my row to every PE (blocking puts: the row is reusable after), then every row here.
    const int64_t call = s_call;
    int64_t* mat = a.matrix + (call & 1) * (int64_t)R * W;
    for (int i = threadIdx.x; i < W; i += blockDim.x) a.row[i] = i < R + N ? (int64_t)s_cnt[i] : a.capacity;
    __syncthreads();
    if (threadIdx.x < R) {
        __threadfence_system();
        nvshmem_putmem_signal(mat + (int64_t)me * W, a.row, W * sizeof(int64_t), a.row_signal + me, 1,
                              NVSHMEM_SIGNAL_ADD, threadIdx.x);
    }
    if (threadIdx.x < R && !wait_signal(a.row_signal + threadIdx.x, call, a.guard, /*phase=*/0, threadIdx.x))
        s_fail = 1;
    __syncthreads();
    if (s_fail) {
        if (threadIdx.x == 0) publish_status(a.host, false);
        return;
    }
    // Rows other PEs put during this kernel: loads that bypass L1.
    auto cnt = [&](int src, int d) { return __ldcv(mat + (int64_t)src * W + d); };
    auto node_cnt = [&](int src, int n) { return __ldcv(mat + (int64_t)src * W + R + n); };

    // 3. The plan. rank_prefix_matrix, a thread per destination column, which also checks that
    // column's rows against its rank's capacity (the first rank short of room: s_bad).
    __shared__ int s_bad;
    if (threadIdx.x == 0) s_bad = R;
    __syncthreads();
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
        int64_t acc = 0;
        for (int src = 0; src < R; ++src) {
            acc += cnt(src, d);
            a.rank_prefix[(int64_t)src * R + d] = acc;
        }
        if (acc > __ldcv(mat + (int64_t)d * W + R + N)) atomicMin(&s_bad, d);  // d's capacity, from its row
    }
    // My rows at the rail peer of node n come after those of the earlier source nodes' ranks with my
    // local index; my network buffer holds each source node's block in node order.
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        a.send_node[n] = n == my_node ? 0 : (int64_t)s_cnt[R + n];
        int64_t base = 0;
        for (int m = 0; m < my_node; ++m)
            if (m != n) base += node_cnt(m * K + local, n);
        s_base[n] = base;
        a.net_count[n] = n == my_node ? 0 : node_cnt(n * K + local, my_node);
    }
    __syncthreads();
    // send_head, rdma_slot and node_tokens: each token's position in each column (a rank, then a
    // node), in token order. Warp w takes tokens [w * seg, (w + 1) * seg) and, 32 tokens at a time, all
    // columns of them (a lane's token row loaded once): pass 1 counts each column's tokens per warp,
    // a prefix over the warps gives every warp's first position in each column, pass 2 writes.
    const int C = R + N;
    int* s_pos = reinterpret_cast<int*>(s_base + N);  // [kWarps][C]
    const int seg = (T + kWarps - 1) / kWarps;
    const int t_begin = min(T, warp * seg), t_end = min(T, t_begin + seg);
    auto member = [&](const uint8_t* row, int col) {  // is the lane's token in column col
        if (col < R) return row[col] != 0;
        const int n = col - R;
        bool in = false;
        if (n != my_node)
            for (int j = 0; j < K; ++j) in = in || row[n * K + j];
        return in;
    };
    for (int col = lane; col < C; col += 32) s_pos[warp * C + col] = 0;
    __syncwarp();
    for (int t0 = t_begin; t0 < t_end; t0 += 32) {  // warp-uniform bounds: every lane takes part in the ballots
        const int t = t0 + lane;
        const uint8_t* row = a.in_rank + (int64_t)t * R;
        for (int col = 0; col < C; ++col) {
            const unsigned m = __ballot_sync(0xffffffffu, t < t_end && member(row, col));
            if (lane == 0) s_pos[warp * C + col] += __popc(m);
        }
    }
    __syncthreads();
    for (int col = threadIdx.x; col < C; col += blockDim.x) {  // exclusive prefix over the warps
        int acc = 0;
        for (int w = 0; w < kWarps; ++w) {
            const int v = s_pos[w * C + col];
            s_pos[w * C + col] = acc;
            acc += v;
        }
    }
    __syncthreads();
    for (int t0 = t_begin; t0 < t_end; t0 += 32) {
        const int t = t0 + lane;
        const uint8_t* row = a.in_rank + (int64_t)t * R;
        for (int col = 0; col < C; ++col) {
            const bool in = t < t_end && member(row, col);
            const unsigned m = __ballot_sync(0xffffffffu, in);
            const int64_t mine = s_pos[warp * C + col] + __popc(m & ((1u << lane) - 1u));
            if (t < t_end) {
                if (col < R) {
                    a.send_head[(int64_t)t * R + col] = in ? mine : -1;
                } else {
                    const int n = col - R;
                    a.rdma_slot[(int64_t)t * N + n] = in ? s_base[n] + mine : -1;
                    if (in) a.node_tokens[(int64_t)n * T + mine] = t;
                }
            }
            __syncwarp();
            if (lane == 0) s_pos[warp * C + col] += __popc(m);
            __syncwarp();
        }
    }

    // 4. One verdict on every rank: does every rank's share fit its capacity (checked in step 3)? If
    // not, no target moves and nothing is sent, so the state stays consistent and the next call can run.
    __syncthreads();
    if (threadIdx.x == 0) {
        const int bad = s_bad < R ? s_bad : -1;
        if (bad >= 0) {
            const int64_t bad_rows = a.rank_prefix[(int64_t)(R - 1) * R + bad];
            const int64_t bad_cap = __ldcv(mat + (int64_t)bad * W + R + N);  // mine is my a.capacity
            // My own shortfall names no peer; a peer's names it (its rows and its capacity).
            report_error(a.guard, kErrorCapacity, /*phase=*/1, bad == me ? -1 : bad, bad_rows, bad_cap);
            a.state[0] = call;
            s_fail = 1;
            publish_status(a.host, false);
        }
    }
    __syncthreads();
    if (s_fail) return;

    // 5. The cumulative targets of this call's dispatch and combine, and what the host needs.
    if (threadIdx.x == 0) {
        int64_t* net_total = a.state + 2;
        int64_t* arrived_total = net_total + N;
        // The steps of every target go to `delta`, in the state's order after [0] and [1]: the dispatch's
        // are taken here (and by cached calls from a handle); the combine's when a combine runs
        // (cupyep.normal.internode_kernels adds them before the combine kernel), so a dispatch without a combine
        // leaves the combine's targets alone.
        int64_t received = 0;
        for (int src = 0; src < R; ++src) {
            const int64_t c = cnt(src, me);
            arrived_total[src] += c;
            if (a.delta) a.delta[N + src] = c;
            received += c;
            if (a.host) a.host[2 + src] = (int)c;
        }
        int64_t direct = 0;
        for (int m = 0; m < N; ++m) {
            const int64_t net = m == my_node ? 0 : node_cnt(m * K + local, my_node);
            const int64_t partials = m == my_node ? 0 : node_cnt(me, m);
            net_total[m] += net;
            if (a.delta) {
                a.delta[m] = net;
                a.delta[N + R + 1 + K + m] = partials;
            }
        }
        for (int j = 0; j < K; ++j) direct += cnt(me, my_node * K + j);
        if (a.delta) {
            a.delta[N + R] = direct;
            for (int j = 0; j < K; ++j) {  // as a rail peer: the rows my node's rank j got from my rail sources
                int64_t gather = 0;
                for (int m = 0; m < N; ++m)
                    if (m != my_node) gather += cnt(m * K + local, my_node * K + j);
                a.delta[N + R + 1 + j] = gather;
            }
            // the direct route's combine: rows back from each rank of another node (0 for my node's)
            for (int d = 0; d < R; ++d) a.delta[N + R + 1 + K + N + d] = d / K == my_node ? 0 : cnt(me, d);
        }
        a.state[0] = call;
        a.state[kNotifyOk] = 1;
        if (a.host) a.host[1] = (int)received;
        publish_status(a.host, true);
    }
    stamp_end(a.kernel_time);
}

struct TwoHopDispatchArgs {
    const int4* x;                // [T, x_int4] rows: BF16, or FP8 with x_scales
    const float* x_scales;        // [T, num_scales] FP8 scales, or null
    const int64_t* topk_idx;      // [T, k]
    const float* topk_weights;    // [T, k]
    const int64_t* rdma_slot;     // [T, N] row of (t, n) in the rail peer's network buffer, -1: none
    const int64_t* send_head;     // [T, R] t's position among my tokens for each rank, -1: not sent
    const int64_t* rank_prefix;   // [R, R] rank_prefix_matrix (cumulative over sources)
    const int* node_tokens;       // [N, T] my tokens for each node, in their network rows' order (notify)
    const int64_t* send_node;     // [N] my tokens for each node (notify)
    char* staging;                // [N, T, row_stride] private staging rows of the network hop, by node
    char* net_rows;               // symmetric: [net_rows_cap, row_stride] this rank's network buffer
    uint64_t* net_signal;         // symmetric: [N] rows arrived from each source node, all calls
    const int64_t* net_target;    // [N] this call's cumulative target of net_signal (own node: unused)
    const int64_t* net_count;     // [N] rows from each source node in my network buffer this call, in
                                  // block order (source-node order; 0 for my own node)
    void* const* pools;           // [K] receive pools of my node's ranks (IPC)
    int64_t out_x, out_idx, out_w, out_src;  // byte offsets of the receive arrays in every pool
    int64_t out_slot;             // byte offset of recv_rail_slot [N] int64: the network slot a forwarded
                                  // row came through at its rail peer (-1: sent directly), for combine
    int64_t* const* arrived;      // [K] each local rank's arrived[R] counters (IPC), all calls
    const int64_t* arrived_target;// [R] this call's cumulative target of my arrived[s]
    int64_t row_stride;           // bytes of a network row: payload, then 1 + 2k + K int64-sized words,
                                  // then num_scales floats
    int64_t out_scales;           // byte offset of recv_x_scales [N, num_scales] in every pool (FP8)
    const int64_t* notify_ok;     // the notify's verdict (state[kNotifyOk]): the kernel runs only when 1
    int64_t capacity;             // rows of the caller's outputs; rows [received, capacity) are padding
    int rdma_chunk;               // network rows a warp stages and sends with one put (consecutive rows
                                  // of one node; one signal add of their number)
    int nvlink_chunk;             // network rows a warp forwards in a row (consecutive slots)
    int direct;                   // 1: the direct route (the kernel's kDirect, which it must match): every
                                  // row to a rank of another node is put straight into its final row there
                                  // (no node dedup, no forwarding)
    char* heap_pool;              // direct route: my receive pool's symmetric address (a destination's pool
                                  // is at the same address on its PE); `pools` then point into the same heap
    uint64_t* direct_signal;      // direct route, symmetric [R]: rows arrived from each source of another
                                  // node, all calls (one add per row, after its parts, behind a fence)
    char* direct_stage;           // direct route: [T, R, DirectRow::bytes] my staged rows
    uint64_t* hop_ns;             // [4] or null (a metric, %globaltimer ns): the earliest block start (min),
                                  // when a block saw every source node's rows (the direct route: when
                                  // block 0 saw every row from other nodes), when a block finished
                                  // forwarding (not on the direct route), when block 0 saw every row
                                  // arrive (max each); the caller sets it to {UINT64_MAX, 0, 0, 0} first
    int64_t* kernel_time;         // [2] or null: first block start, last block end (stamp_start / stamp_end)
    int num_tokens;
    int num_topk;
    int x_int4;
    int num_scales;               // per row, FP8 only (0: BF16 rows)
    int num_ranks;
    int ranks_per_node;
    int num_local_experts;
    int rank;
    Guard guard;
};

// A staged row of the direct route, parts at 16-byte boundaries: the payload, the
// scales, the k local ids (int64), the k weights, the source index (int32), the
// network slot (int64, -1). Its size is cupyep.normal.internode_kernels.direct_row_bytes.
struct DirectRow {
    int64_t scales, ids, weights, src, slot, bytes;
};
__host__ __device__ __forceinline__ int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
__host__ __device__ __forceinline__ DirectRow direct_row_layout(int64_t payload, int num_scales, int k) {
    DirectRow r;
    r.scales = payload;
    r.ids = align16(payload + 4 * (int64_t)num_scales);
    r.weights = r.ids + align16(8 * (int64_t)k);
    r.src = r.weights + align16(4 * (int64_t)k);
    r.slot = r.src + 16;
    r.bytes = r.slot + 16;
    return r;
}

// Global expert e as rank d's local expert, -1 when d does not own it.
__device__ __forceinline__ int64_t local_expert(int64_t e, int d, int num_local_experts) {
    return e >= (int64_t)d * num_local_experts && e < (int64_t)(d + 1) * num_local_experts
               ? e - (int64_t)d * num_local_experts : -1;
}

// The hop metric: stamp `which` of a [4] stamps array with this moment
// (slot 0 keeps the earliest, the others the latest). Thread 0 of a block.
__device__ __forceinline__ void hop_stamp(uint64_t* hop_ns, int which) {
    if (hop_ns == nullptr) return;
    auto* h = reinterpret_cast<unsigned long long*>(hop_ns);
    const unsigned long long now = global_timer_ns();
    if (which == 0) atomicMin(h, now);
    else atomicMax(h + which, now);
}

template <int kNumThreads, bool kDirect>  // kDirect: the direct route (TwoHopDispatchArgs::direct)
__global__ void __launch_bounds__(kNumThreads, 1) two_hop_dispatch(TwoHopDispatchArgs a) {
    constexpr int kWarps = kNumThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int K = a.ranks_per_node, R = a.num_ranks, N = R / K, k = a.num_topk, T = a.num_tokens;
    const int me = a.rank, my_node = me / K, local = me % K, El = a.num_local_experts;
    const int64_t gw = (int64_t)blockIdx.x * kWarps + warp, num_gw = (int64_t)gridDim.x * kWarps;
    const int64_t payload = (int64_t)a.x_int4 * 16;
    auto ld = [](const int4* p) { return ld_nc_na_v4(p); };  // inputs: read-only for the whole kernel
    auto ld_cv = [](const int4* p) { return __ldcv(p); };     // network rows: written by peers during it
    auto st = [](int4* p, const int4& v) { st_na_v4(p, v); };
    if (ld_volatile64(a.notify_ok) != 1) return;  // this call's notify failed: nothing to send
    stamp_start(a.kernel_time);
    if (threadIdx.x == 0) hop_stamp(a.hop_ns, 0);
    {   // Padding rows of my outputs (worst-token mode): ids and sources -1, weights 0, slots -1. No row
        // arrives at or past the count, so these writes never meet a delivery.
        char* mine = static_cast<char*>(a.pools[local]);
        const int64_t n = a.rank_prefix[(int64_t)(R - 1) * R + me];
        for (int64_t r = n + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < a.capacity;
             r += (int64_t)gridDim.x * blockDim.x) {
            reinterpret_cast<int*>(mine + a.out_src)[r] = -1;
            reinterpret_cast<int64_t*>(mine + a.out_slot)[r] = -1;
            for (int q = 0; q < k; ++q) {
                reinterpret_cast<int64_t*>(mine + a.out_idx)[r * k + q] = -1;
                reinterpret_cast<float*>(mine + a.out_w)[r * k + q] = 0.f;
            }
        }
    }

    // Writes row `src_row` (payload and its metadata) for destination d at rank-major row `row`;
    // `landed`: the row came over the network during this kernel (coherent loads).
    const int ns = a.num_scales;
    auto deliver = [&](int d_local, int64_t row, const int4* src_row, int64_t t, const int64_t* ids, const float* ws,
                       const float* scales, int64_t slot) {
        const bool landed = slot >= 0;
        char* pool = static_cast<char*>(a.pools[d_local]);
        int4* dst = reinterpret_cast<int4*>(pool + a.out_x + row * payload);
        if (landed) warp_copy<4, true>(dst, src_row, a.x_int4, lane, ld_cv, st);
        else warp_copy<4, true>(dst, src_row, a.x_int4, lane, ld, st);
        for (int q = lane; q < ns; q += 32)
            reinterpret_cast<float*>(pool + a.out_scales)[row * ns + q] = landed ? __ldcv(scales + q) : scales[q];
        const int d = my_node * K + d_local;
        for (int q = lane; q < k; q += 32) {
            const int64_t le = local_expert(__ldcv(ids + q), d, El);
            reinterpret_cast<int64_t*>(pool + a.out_idx)[row * k + q] = le;
            reinterpret_cast<float*>(pool + a.out_w)[row * k + q] = le >= 0 ? __ldcv(ws + q) : 0.f;
        }
        if (lane == 0) {
            reinterpret_cast<int*>(pool + a.out_src)[row] = (int)t;
            reinterpret_cast<int64_t*>(pool + a.out_slot)[row] = slot;
        }
    };
    // Rank-major row of source s's row at position p among its rows for rank d (the queue transport's order).
    auto row_at = [&](int s, int d, int64_t p) { return (s > 0 ? a.rank_prefix[(s - 1) * R + d] : 0) + p; };
    auto count_arrival = [&](int d_local, int s) {  // after the warp's writes: release add of one row
        __syncwarp();
        if (lane == 0) {
            fence_acq_rel_sys();
            atomicAdd(reinterpret_cast<unsigned long long*>(a.arrived[d_local] + s), 1ull);
        }
    };

    // 1. Network hop: a warp per chunk of up to rdma_chunk of my rows for one remote node (consecutive
    // network rows at its rail peer), staged together and sent with one put whose signal adds their number.
    const int C = a.rdma_chunk;
    int64_t num_chunks = 0;
    for (int n = 0; n < N && !kDirect; ++n) num_chunks += (a.send_node[n] + C - 1) / C;
    for (int64_t item = gw; item < num_chunks; item += num_gw) {
        int n = 0;
        int64_t c = item;
        for (; n < N; ++n) {  // the item's node: chunks are numbered node after node
            const int64_t nc = (a.send_node[n] + C - 1) / C;
            if (c < nc) break;
            c -= nc;
        }
        const int64_t first = c * C, rows = min((int64_t)C, a.send_node[n] - first);
        char* stage0 = a.staging + ((int64_t)n * T + first) * a.row_stride;
        for (int64_t i = 0; i < rows; ++i) {
            const int64_t t = a.node_tokens[(int64_t)n * T + first + i];
            const int64_t* ids = a.topk_idx + t * k;
            const float* ws = a.topk_weights + t * k;
            const int64_t* head = a.send_head + t * R;
            char* stage = stage0 + i * a.row_stride;
            warp_copy<4, true>(reinterpret_cast<int4*>(stage), a.x + t * a.x_int4, a.x_int4, lane, ld, st);
            int64_t* meta = reinterpret_cast<int64_t*>(stage + payload);
            if (lane == 0) meta[0] = t;
            for (int q = lane; q < k; q += 32) {
                meta[1 + q] = ids[q];
                reinterpret_cast<float*>(meta + 1 + k)[q] = ws[q];  // k floats in k int64-sized words
            }
            for (int j = lane; j < K; j += 32) meta[1 + 2 * k + j] = head[n * K + j];
            for (int q = lane; q < ns; q += 32)
                reinterpret_cast<float*>(meta + 1 + 2 * k + K)[q] = a.x_scales[t * ns + q];
        }
        __syncwarp();
        __threadfence();  // the staging rows are written before the put reads them
        const int64_t slot = a.rdma_slot[a.node_tokens[(int64_t)n * T + first] * N + n];  // then consecutive
        nvshmemx_putmem_signal_nbi_warp(a.net_rows + slot * a.row_stride, stage0, rows * a.row_stride,
                                        a.net_signal + my_node, (uint64_t)rows, NVSHMEM_SIGNAL_ADD, n * K + local);
    }

    // 1'. The direct route instead: a warp per (token, rank of another node) stages the row as the
    // destination keeps it (DirectRow), puts each part into its final row there, fences, and adds 1 to
    // that rank's direct_signal[me].
    if (kDirect) {
        const DirectRow L = direct_row_layout(payload, ns, k);
        for (int64_t pair = gw; pair < (int64_t)T * R; pair += num_gw) {  // warp-uniform
            const int64_t t = pair / R;
            const int d = (int)(pair % R);
            const int64_t h = a.send_head[t * R + d];
            if (d / K == my_node || h < 0) continue;
            const int64_t row = row_at(me, d, h);
            char* stage = a.direct_stage + pair * L.bytes;
            warp_copy<4, true>(reinterpret_cast<int4*>(stage), a.x + t * a.x_int4, a.x_int4, lane, ld, st);
            for (int q = lane; q < ns; q += 32) reinterpret_cast<float*>(stage + L.scales)[q] = a.x_scales[t * ns + q];
            for (int q = lane; q < k; q += 32) {
                const int64_t le = local_expert(a.topk_idx[t * k + q], d, El);
                reinterpret_cast<int64_t*>(stage + L.ids)[q] = le;
                reinterpret_cast<float*>(stage + L.weights)[q] = le >= 0 ? a.topk_weights[t * k + q] : 0.f;
            }
            if (lane == 0) {
                *reinterpret_cast<int*>(stage + L.src) = (int)t;
                *reinterpret_cast<int64_t*>(stage + L.slot) = -1;
            }
            __syncwarp();
            __threadfence();  // the staged row is written before the puts read it
            char* pool = a.heap_pool;
            nvshmemx_putmem_nbi_warp(pool + a.out_x + row * payload, stage, payload, d);
            if (ns) nvshmemx_putmem_nbi_warp(pool + a.out_scales + row * ns * 4, stage + L.scales, ns * 4, d);
            nvshmemx_putmem_nbi_warp(pool + a.out_idx + row * k * 8, stage + L.ids, k * 8, d);
            nvshmemx_putmem_nbi_warp(pool + a.out_w + row * k * 4, stage + L.weights, k * 4, d);
            nvshmemx_putmem_nbi_warp(pool + a.out_src + row * 4, stage + L.src, 4, d);
            nvshmemx_putmem_nbi_warp(pool + a.out_slot + row * 8, stage + L.slot, 8, d);
            __syncwarp();
            if (lane == 0) {
                nvshmem_fence();  // the parts are delivered before the signal
                nvshmemx_signal_op(a.direct_signal + me, 1, NVSHMEM_SIGNAL_ADD, d);
            }
        }
    }

    // 2. Direct rows, to the ranks of my node: a warp per token.
    for (int64_t t = gw; t < T; t += num_gw) {
        const int4* row = a.x + t * a.x_int4;
        const int64_t* ids = a.topk_idx + t * k;
        const float* ws = a.topk_weights + t * k;
        const int64_t* head = a.send_head + t * R;
        const float* scales = ns ? a.x_scales + t * ns : nullptr;
        for (int j = 0; j < K; ++j) {
            const int d = my_node * K + j;
            if (head[d] < 0) continue;
            deliver(j, row_at(me, d, head[d]), row, t, ids, ws, scales, -1);
            count_arrival(j, me);
        }
    }

    // 3. Forwarding, once every source node's rows are here.
    __shared__ int s_fail;
    if (threadIdx.x == 0) s_fail = 0;
    __syncthreads();
    if (threadIdx.x < N && threadIdx.x != my_node && !kDirect) {  // the direct route forwards nothing
        const int m = threadIdx.x;
        if (!wait_signal(a.net_signal + m, a.net_target[m], a.guard, /*phase=*/0, m * K + local)) s_fail = 1;
    }
    __syncthreads();
    if (s_fail) return;
    if (threadIdx.x == 0 && !kDirect) hop_stamp(a.hop_ns, 1);
    __threadfence_system();
    int64_t rows_now = 0;
    for (int m = 0; m < N && !kDirect; ++m) rows_now += a.net_count[m];
    const int64_t F = a.nvlink_chunk;  // a warp forwards rows [c0, c0 + F) of the network buffer
    for (int64_t c0 = gw * F; c0 < rows_now; c0 += num_gw * F) {
        for (int64_t q = c0; q < min(rows_now, c0 + F); ++q) {
            const char* nrow = a.net_rows + q * a.row_stride;
            const int64_t* meta = reinterpret_cast<const int64_t*>(nrow + payload);
            int s = -1;  // the source of slot q: blocks are in source-node order (two_hop_plan)
            for (int64_t m = 0, acc = 0; m < N && s < 0; acc += a.net_count[m], ++m)
                if (q < acc + a.net_count[m]) s = (int)m * K + local;
            if (s < 0) continue;
            const int64_t t = __ldcv(meta);
            const int64_t* ids = meta + 1;
            const float* ws = reinterpret_cast<const float*>(meta + 1 + k);
            const int64_t* pos = meta + 1 + 2 * k;
            const float* scales = reinterpret_cast<const float*>(pos + K);
            for (int j = 0; j < K; ++j) {
                const int64_t p = __ldcv(pos + j);
                if (p < 0) continue;
                const int d = my_node * K + j;
                deliver(j, row_at(s, d, p), reinterpret_cast<const int4*>(nrow), t, ids, ws, scales, q);
                count_arrival(j, s);
            }
        }
    }
    if (a.hop_ns && !kDirect) {  // the same for every thread: the block's forwarding is done
        __syncthreads();
        if (threadIdx.x == 0) hop_stamp(a.hop_ns, 2);
    }

    // 4. Block 0 waits until every source's rows have arrived here. The direct route waits for the
    //    sources of other nodes first (counted by their signals) and stamps that as its network hop;
    //    it has no forwarding hop (stamp 2 stays unset).
    if (blockIdx.x == 0) {
        bool ok = true;  // this thread's waits so far (after a timeout it waits for nothing more)
        if (kDirect) {
            for (int s = threadIdx.x; s < R && ok; s += blockDim.x)
                if (s / K != my_node) ok = wait_signal(a.direct_signal + s, a.arrived_target[s], a.guard, 1, s);
            if (a.hop_ns) {
                __syncthreads();
                if (threadIdx.x == 0) hop_stamp(a.hop_ns, 1);
            }
        }
        for (int s = threadIdx.x; s < R && ok; s += blockDim.x)
            if (!kDirect || s / K == my_node) ok = wait_geq(a.arrived[local] + s, a.arrived_target[s], a.guard, 1, s);
        if (a.hop_ns) {
            __syncthreads();
            if (threadIdx.x == 0) hop_stamp(a.hop_ns, 3);
        }
    }
    stamp_end(a.kernel_time);
}

// Two-hop combine: the reverse route with the reduction inside each node
// (the order of cupyep.reference.internode.emulate_two_hop_combine, so the
// result is bitwise that emulation's in FP32 with BF16 partials):
//   1. Every rank d takes its received rows (y [N, H] BF16): a row from a
//      source s in d's node goes straight into s's direct_in[t, d % K]; a row
//      of another node's source goes into gather[slot, d % K] of the rail
//      peer in d's node for s (slot: the network slot the row came through,
//      recv_rail_slot of the dispatch). Release counters count both; a
//      gather row counts in its sender's own counter at the rail peer, so a
//      wait there names the rank whose rows are missing.
//   2. Each rail peer, once its K local ranks' rows for every slot are there,
//      sums each slot's rows in FP32 in local rank order (the ranks the
//      token went to, from the slot's metadata), rounds to BF16 and puts the
//      partial with a signal into the source's net_in[node, t].
//   3. Each source, once its own node's rows and every remote node's
//      partials have arrived, sums per token: for each node in order, its
//      own node's rows (summed in local rank order first) or the node's
//      partial, in FP32; rounded to BF16 into out [T, H].
struct TwoHopCombineArgs {
    const int4* y;                // [N, x_int4] expert outputs, one per received row
    const int* recv_src_rank;     // [N] source rank of each received row, -1: a padding row
    const int* recv_src_idx;      // [N] source token of each received row
    const int64_t* recv_slot;     // [N] network slot at the rail peer, -1 for a direct row
    void* const* pools;           // [K] combine pools of my node's ranks (IPC)
    int64_t direct_in;            // byte offset of direct_in [T_max, K, x_int4] in every pool
    int64_t gather;               // byte offset of gather [net_cap, K, x_int4] in every pool
    int64_t* const* counters;     // [K] each local rank's counters (IPC): [0] direct rows in, [1 + j] gather
                                  // rows in from the node's rank j
    const int64_t* targets;       // [1 + K] this call's cumulative targets of my counters
    const char* net_rows;         // symmetric: my network buffer of the dispatch (the slots' metadata)
    int64_t row_stride;           // bytes of a network row of the dispatch
    int64_t meta_offset;          // where a network row's metadata starts (the dispatch's payload bytes)
    const int64_t* net_count;     // [N] rows from each source node in my network buffer, in block order
    char* staging;                // [net_rows_now, x_int4 * 16] private partial rows of step 2
    int4* net_in;                 // symmetric: [N, T_max, x_int4] partials from each node
    uint64_t* net_signal;         // symmetric: [N] partial rows arrived from each node, all calls
    const int64_t* net_target;    // [N] this call's cumulative targets of net_signal (own node: unused)
    const int64_t* send_head;     // [T, R] the dispatch's: where token t went (-1: not to that rank)
    int direct;                   // 1: the direct route: rows for an owner of another node are put straight
                                  // to it, which sums over ranks (no partials in the node)
    int4* rank_in;                // direct route, symmetric: [T_max, R, x_int4] rows from each rank
    uint64_t* rank_signal;        // direct route, symmetric [R]: rows arrived from each rank of another node
    const int64_t* rank_target;   // direct route: [R] this call's cumulative targets of rank_signal
    char* rank_stage;             // direct route: [num_recv, x_int4 * 16] my staged rows for other nodes
    int4* out;                    // [T, x_int4] BF16
    const int64_t* notify_ok;     // the notify's verdict: the kernel runs only when 1
    uint64_t* hop_ns;             // [4] or null (a metric, as the dispatch's): the earliest block start, when
                                  // a block saw its node's rows for every slot (rail peer), when a block saw
                                  // every row and partial of its tokens (source), when a block finished
                                  // its final sums
    int64_t* kernel_time;         // [2] or null: first block start, last block end (stamp_start / stamp_end)
    int num_recv;
    int num_tokens;
    int max_tokens;
    int x_int4;
    int num_topk;
    int num_ranks;
    int ranks_per_node;
    int rank;
    Guard guard;
};

__device__ __forceinline__ void bf16x8_add(float (&acc)[8], const int4& v) {
    const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(w[i] << 16);
        acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint32_t f32_to_bf16_rne(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN stays NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ int4 bf16x8_pack(const float (&acc)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = f32_to_bf16_rne(acc[2 * i]) | (f32_to_bf16_rne(acc[2 * i + 1]) << 16);
    return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
}

// The rows a combine reduces, as int4 words: 8 BF16 values (the expert
// outputs) or 4 float32 (top-k weights, summed exactly in float32 all the way).
template <bool kF32>
struct CombineWords {
    __device__ __forceinline__ static void add(float (&acc)[8], const int4& v) { bf16x8_add(acc, v); }
    __device__ __forceinline__ static int4 pack(const float (&acc)[8]) { return bf16x8_pack(acc); }
};
template <>
struct CombineWords<true> {
    __device__ __forceinline__ static void add(float (&acc)[8], const int4& v) {
        acc[0] += __int_as_float(v.x); acc[1] += __int_as_float(v.y);
        acc[2] += __int_as_float(v.z); acc[3] += __int_as_float(v.w);
    }
    __device__ __forceinline__ static int4 pack(const float (&acc)[8]) {
        return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3]));
    }
};

template <int kNumThreads, bool kF32>
__global__ void __launch_bounds__(kNumThreads, 1) two_hop_combine(TwoHopCombineArgs a) {
    using Words = CombineWords<kF32>;
    constexpr int kWarps = kNumThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int K = a.ranks_per_node, R = a.num_ranks, N = R / K, me = a.rank, my_node = me / K, local = me % K;
    const int64_t w = a.x_int4;
    const int64_t gw = (int64_t)blockIdx.x * kWarps + warp, num_gw = (int64_t)gridDim.x * kWarps;
    auto ld = [](const int4* p) { return ld_nc_na_v4(p); };
    auto st = [](int4* p, const int4& v) { st_na_v4(p, v); };
    __shared__ int s_fail;
    if (ld_volatile64(a.notify_ok) != 1) return;  // the dispatch's notify failed
    stamp_start(a.kernel_time);
    if (threadIdx.x == 0) {
        s_fail = 0;
        hop_stamp(a.hop_ns, 0);
    }

    // 1. Every received row to its source (own node) or to the rail peer for its source.
    for (int64_t r = gw; r < a.num_recv; r += num_gw) {
        const int s = a.recv_src_rank[r];
        if (s < 0) continue;  // a padding row (worst-token mode)
        const int t = a.recv_src_idx[r];
        const int64_t slot = a.recv_slot[r];
        if (a.direct && s / K != my_node) {  // the direct route: straight to the owner, with a signal
            int4* stage = reinterpret_cast<int4*>(a.rank_stage + r * w * 16);
            warp_copy<4, true>(stage, a.y + r * w, w, lane, ld, st);
            __syncwarp();
            __threadfence();  // the staged row is written before the put reads it
            nvshmemx_putmem_signal_nbi_warp(a.rank_in + ((int64_t)t * R + me) * w, stage, w * 16,
                                            a.rank_signal + me, 1, NVSHMEM_SIGNAL_ADD, s);
            continue;
        }
        // s itself (own node) or the rail peer in my node for s: either has s's local index.
        const int target = s % K;
        const bool direct = s / K == my_node;
        const int64_t off = direct ? a.direct_in + ((int64_t)t * K + local) * w * 16
                                   : a.gather + (slot * K + local) * w * 16;
        const int which = direct ? 0 : 1 + local;  // as a gather row: counted as mine at the rail peer
        char* pool = static_cast<char*>(a.pools[target]);
        warp_copy<4, true>(reinterpret_cast<int4*>(pool + off), a.y + r * w, w, lane, ld, st);
        __syncwarp();
        if (lane == 0) {
            fence_acq_rel_sys();
            atomicAdd(reinterpret_cast<unsigned long long*>(a.counters[target] + which), 1ull);
        }
    }

    // 2. As a rail peer: once my node's rows for every slot are here, one partial per slot to its source.
    __syncthreads();
    // Thread j waits for the rows of my node's rank j (the direct route makes no partials: nothing to wait for).
    if (!a.direct && threadIdx.x < K &&
        !wait_geq(a.counters[local] + 1 + threadIdx.x, a.targets[1 + threadIdx.x], a.guard, 0, my_node * K + threadIdx.x))
        s_fail = 1;
    __syncthreads();
    if (s_fail) return;
    if (threadIdx.x == 0) hop_stamp(a.hop_ns, 1);
    __threadfence_system();
    int64_t rows_now = 0;
    for (int m = 0; m < N && !a.direct; ++m) rows_now += a.net_count[m];
    const int64_t payload = w * 16;
    const int4* gather = reinterpret_cast<const int4*>(static_cast<const char*>(a.pools[local]) + a.gather);
    for (int64_t q = gw; q < rows_now; q += num_gw) {
        int s = -1;
        for (int64_t m = 0, acc = 0; m < N && s < 0; acc += a.net_count[m], ++m)
            if (q < acc + a.net_count[m]) s = (int)m * K + local;
        if (s < 0) continue;
        const int64_t* meta = reinterpret_cast<const int64_t*>(a.net_rows + q * a.row_stride + a.meta_offset);
        const int64_t t = __ldcv(meta);
        const int64_t* pos = meta + 1 + 2 * a.num_topk;  // the token's position for each of my node's ranks
        unsigned went = 0;
        for (int j = 0; j < K; ++j) went |= (__ldcv(pos + j) >= 0 ? 1u : 0u) << j;
        int4* part = reinterpret_cast<int4*>(a.staging + q * payload);
        for (int64_t c = lane; c < w; c += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int j = 0; j < K; ++j)  // local rank order
                if (went >> j & 1u) Words::add(acc, __ldcv(gather + (q * K + j) * w + c));
            part[c] = Words::pack(acc);
        }
        __syncwarp();
        __threadfence();  // the staging row is written before the put reads it
        nvshmemx_putmem_signal_nbi_warp(a.net_in + ((int64_t)my_node * a.max_tokens + t) * w, part, payload,
                                        a.net_signal + my_node, 1, NVSHMEM_SIGNAL_ADD, s);
    }

    // 3. As a source: my own node's rows and every other node's partials, then the sums.
    if (threadIdx.x == 0) {
        if (!wait_geq(a.counters[local] + 0, a.targets[0], a.guard, 1, -1)) s_fail = 1;
        for (int m = 0; m < N && !s_fail && !a.direct; ++m)
            if (m != my_node && !wait_signal(a.net_signal + m, a.net_target[m], a.guard, /*phase=*/2, m * K + local))
                s_fail = 1;
        for (int d = 0; d < R && !s_fail && a.direct; ++d)  // the direct route: every rank of another node
            if (d / K != my_node && !wait_signal(a.rank_signal + d, a.rank_target[d], a.guard, /*phase=*/2, d))
                s_fail = 1;
        if (!s_fail) hop_stamp(a.hop_ns, 2);
    }
    __syncthreads();
    if (s_fail) return;
    __threadfence_system();
    const int4* direct = reinterpret_cast<const int4*>(static_cast<const char*>(a.pools[local]) + a.direct_in);
    for (int64_t t = gw; t < a.num_tokens; t += num_gw) {
        const int64_t* head = a.send_head + t * R;
        for (int64_t c = lane; c < w && a.direct; c += 32) {  // the direct route: the FP32 sum in rank order
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int d = 0; d < R; ++d) {
                if (head[d] < 0) continue;
                Words::add(acc, d / K == my_node ? __ldcv(direct + (t * K + d % K) * w + c)
                                                 : __ldcv(a.rank_in + (t * R + d) * w + c));
            }
            a.out[t * w + c] = Words::pack(acc);
        }
        for (int64_t c = lane; c < w && !a.direct; c += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int m = 0; m < N; ++m) {  // node order
                if (m == my_node) {
                    float own[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    for (int j = 0; j < K; ++j)  // local rank order
                        if (head[m * K + j] >= 0) Words::add(own, __ldcv(direct + (t * K + j) * w + c));
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += own[i];
                } else {
                    bool hit = false;
                    for (int j = 0; j < K; ++j) hit |= head[m * K + j] >= 0;
                    if (hit) Words::add(acc, __ldcv(a.net_in + ((int64_t)m * a.max_tokens + t) * w + c));
                }
            }
            a.out[t * w + c] = Words::pack(acc);
        }
    }
    if (a.hop_ns) {
        __syncthreads();
        if (threadIdx.x == 0) hop_stamp(a.hop_ns, 3);
    }
    stamp_end(a.kernel_time);
}

}  // namespace normal
}  // namespace cupyep
