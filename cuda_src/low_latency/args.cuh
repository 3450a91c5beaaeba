// Argument structs of the low-latency kernels. Every field is mirrored, in
// order, by a NumPy struct dtype in cupyep/low_latency/kernels.py.
//
// A rank's symmetric buffer holds two sets (cupyep/low_latency/layout.py has
// the byte offsets). The signals (counts, flags) of successive calls
// alternate between them, and every call clears the flags of the set the next
// call uses, so no clean launch is ever needed; which copy of the data a call
// uses is the host's choice (layout.CallSchedule), passed in `cur` like the
// signals. One set:
//   dispatch_count  [E_local][R] int32   tokens source r sent to local expert e
//   dispatch_flag   [R] int32            arrivals of source r's blocks (sync.cuh): rows and counts written
//   combine_flag    [R] int32            arrivals of expert rank r's blocks (sync.cuh): my rows written
//   recv_x          [E_local][R * max] messages (message_layout): payload, FP8 scales, tag
//   combine_send    [E_local][R * max][H] BF16 (zero-copy combine input)
//   combine_recv    [R][max * min(max_topk, E_local)][H] BF16: expert rank r's rows for my
//                   tokens, in the order of my dispatch's rows to r (DispatchArgs::combine_pos)
// Source r's tokens for local expert e sit at rows [r * max, r * max + count)
// of expert e, in ascending token order (positions are prefix counts over the
// source's tokens, so the layout is deterministic). A row's scales and tag
// travel inside its message, and the combine returns each expert rank's rows
// packed, so that a call writes few distinct pages of a peer's buffer
// (cupyep/low_latency/layout.py).
//
// Across nodes (the specialisation built with CUPYEP_LL_NVSHMEM, linked
// against NVSHMEM): the buffer is on the NVSHMEM symmetric heap, and a peer on
// another node (CallArgs::ranks_per_node) is reached by puts instead of
// stores. Two more regions per set serve it:
//   remote_signal   [4][R] uint64: from each rank on another node, [0] its
//                   counts arrived (one per call), [1] its dispatch messages
//                   arrived, [2] its combine rows arrived, [3] its combine
//                   started (one per call, so that an owner finishes a
//                   combine only once every expert rank has finished the
//                   dispatch before it, rows for the owner or not)
//   stage           [M * max_topk] messages: my rows to ranks of other nodes,
//                   staged for the puts (one message per (token, slot): the
//                   tag differs by slot); size 0 within one node
#pragma once
#ifdef CUPYEP_LL_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif
#include "common/types.cuh"
#include "common/timeout.cuh"
#include "common/ptx.cuh"

namespace cupyep {
namespace low_latency {

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;
constexpr int kChunkElems = 512;  // hidden elements a warp moves per work item (16 per lane)

// Ablations (CallArgs::ablate), for profiling only: parts of
// a call's work that are skipped, so that their cost can be measured. The
// protocol (counts, flags, waits) always runs; the results are wrong.
// Mirrored by cupyep/low_latency/kernels.py ABLATIONS.
constexpr int kAblateRows = 1;    // row payloads are not stored (dispatch and combine)
constexpr int kAblateTags = 2;    // dispatch: recv_src / recv_slot are not stored
constexpr int kAblateScales = 4;  // dispatch: FP8 scales are not stored

// Wait sites, indexed as in cupyep/errors.py KERNELS["low_latency_*"].
constexpr int kWaitPeerFlag = 0;  // a peer's flag
constexpr int kBadExpertId = 1;   // not a wait: an expert id outside [-1, E) (dispatch)
constexpr int kWaitRemoteCounts = 2;  // across nodes, dispatch: a source's counts (its signal)
constexpr int kWaitRemoteRows = 3;    // across nodes, dispatch: a source's messages (their signal)
constexpr int kWaitRemoteReturn = 1;  // across nodes, combine: an expert rank's start, then its rows (signals)

struct SetOffsets {
    int64_t dispatch_count, dispatch_flag, combine_flag;
    int64_t recv_x, combine_send, combine_recv;
    int64_t remote_signal, stage;  // across nodes only (see above)
};

// Byte offsets within one dispatch message and its size: payload (H bytes FP8
// or 2H BF16) at 0, FP8 scales (H / 128 float32 or UE8M0 bytes, padded to 16)
// at `scales`, a 16-byte tag at `tag`: int32 source token, uint8 top-k slot;
// from a dispatch given the weights (for the partial combine, combine.cu) also,
// after the slot, a byte that is 1 for the token's first row on this rank (by
// slot) and a uint16 p, the token's row among the source's tokens to this rank
// (words 0 and 1 = token, slot | head << 8 | p << 16), then the slot's float32
// weight and the region row (local expert * capacity + row) of the token's
// next row on this rank, -1 after its last.
// Mirrored by cupyep/low_latency/layout.py message_layout.
struct Message {
    int64_t scales, tag, bytes;
};
__device__ __forceinline__ Message message_layout(int hidden, int fp8, int ue8m0) {
    const int64_t payload = fp8 ? hidden : 2 * (int64_t)hidden;
    const int64_t scales = fp8 ? ((hidden / 128) * (ue8m0 ? 1 : 4) + 15) / 16 * 16 : 0;
    return {payload, payload + scales, payload + scales + 16};
}

// The dispatch's report of an expert whose rows from this rank exceed the
// capacity of its region (value: rows, expected: capacity): its phase number,
// after the waits each build reports (cupyep/errors.py KERNELS).
#ifdef CUPYEP_LL_NVSHMEM
constexpr int kRegionCapacity = 4;
#else
constexpr int kRegionCapacity = 2;
#endif

// Rows of one expert rank's range in combine_recv: a source sends a rank at
// most max_tokens * min(max_topk, El) rows, and at most El * capacity.
__device__ __forceinline__ int64_t return_rows(int max_tokens, int max_topk, int num_local_experts, int capacity) {
    return min((int64_t)max_tokens * min(max_topk, num_local_experts), (int64_t)num_local_experts * capacity);
}

// What every low-latency launch carries, dispatch or combine (DispatchArgs::c,
// CombineArgs::c).
struct CallArgs {
    void* const* peers;      // [R] every rank's buffer base (mine included)
    SetOffsets cur;          // the set this call uses
    SetOffsets next;         // the set the next call uses: its flags are cleared here
    int64_t* kernel_time;    // [2] or null: min start / max end %globaltimer over blocks
    int64_t* trace;          // [G][kNumMarks] or null: %globaltimer of each block at each mark
    int* mask;               // [R] or null (shrink mode off): mask[r] != 0: rank r is masked (sync.cuh)
    int num_tokens;          // T of this rank
    int hidden;
    int num_topk;
    int num_experts;
    int num_ranks;
    int max_tokens;
    int max_topk;
    int capacity;            // rows of each (local expert, source) region of recv_x: max_tokens, or fewer
    int phases;              // kPhaseSend | kPhaseRecv
    int num_waiters;         // blocks b < num_waiters also wait and receive; the rest only send
    int rank;
    int ablate;              // kAblate* bits (profiling only; 0 for real calls)
    int ranks_per_node;      // ranks d with d / ranks_per_node != rank / ranks_per_node are on other nodes
                             // (reached by NVSHMEM puts; only in the CUPYEP_LL_NVSHMEM build)
    Guard guard;
};

// Whether rank d sits on another node than this rank (never within one node's build).
__device__ __forceinline__ bool is_remote(const CallArgs& c, int d) {
#ifdef CUPYEP_LL_NVSHMEM
    return d / c.ranks_per_node != c.rank / c.ranks_per_node;
#else
    (void)c, (void)d;
    return false;
#endif
}

struct DispatchArgs {
    CallArgs c;
    const int4* x;           // [T, H] BF16
    const int64_t* topk_idx; // [T, k], distinct experts per row, -1 for none
    int* layout_count;       // [E_local, R] out: rows of (expert, source)
    int* recv_count;         // [E_local] out: rows per local expert
    int* combine_pos;        // [T, k] out: row of (t, j) in the range its expert rank returns to me
    int* slot_pos;           // [T, k] out: row of (t, j) within its (expert, me) region at the expert's rank
    int* cumulative_stats;   // [E_local] or null: += recv_count
    int* status;             // [num_waiters] out: 1 where the waiter's wait for the sources timed out, else 0
    int64_t* wait_stats;     // [R] or null: += ns block 0 waited for each source
    // For the partial combine (combine.cu combine_partial), or null: each message's tag also carries
    // its slot's weight and the token's row among this rank's tokens to the expert's rank.
    const float* topk_weights;  // [T, k] float32 or null
    int* rank_pos;           // [T, k] out (with topk_weights): row of token t among this rank's tokens with an
                             // expert on the rank of slot j's expert (-1 for empty slots)
    // DeepEP's packed layout, filled by the receive half of dispatch_packed (cupyep.deep_ep.packing):
    uint8_t* packed_x;       // [E_local][packed_rows][H or 2H] the received rows, expert e's at [0, recv_count[e])
    uint32_t* packed_scales; // [E_local][S][packed_rows] the FP8 scales (float32, or words of 4 UE8M0 bytes), or null
    int* packed_src;         // [E_local][packed_rows] each packed row's source token
    int64_t* packed_range;   // [E_local][R] begin << 32 | count of each source's rows
    int64_t packed_rows;     // R * max_tokens
    int mask_words;          // 32-token words per expert of the position scan's window (shared [E][mask_words])
    int fp8;                 // 1: cast to e4m3 with per-128 scales
    int round_scale;         // 1: power-of-two scales
    int ue8m0;               // 1: scales stored as UE8M0 bytes
};

struct CombineArgs {
    CallArgs c;
    const int4* x;              // [E_local, R * max, H] BF16 expert outputs
    const int* layout_count;    // [E_local, R] from the dispatch
    const int* combine_pos;     // [T, k] from the dispatch
    const int* slot_pos;        // [T, k] from the dispatch
    const int64_t* topk_idx;    // [T, k] the dispatched routing
    const float* topk_weights;  // [T, k]
    int4* out;                  // [T, H] BF16
    int64_t x_row_bytes;        // bytes between rows of x (a multiple of 16)
    int64_t* wait_stats;        // [R] or null: += ns block 0 waited for each expert rank's rows
    int64_t x_expert_rows;      // 0: x in the region layout (expert e's rows from source s at rows
                                // [s * capacity, s * capacity + count)); else x is packed as DeepEP's:
                                // [E_local, x_expert_rows, H], expert e's rows at [0, recv_count[e]),
                                // source after source in rank order
    // The partial combine (combine.cu combine_partial):
    const char* tags;           // the dispatch's tag of region row 0 (the tags of its recv_x messages)
    int64_t tag_stride;         // bytes between two rows' tags (a message's size)
    const int* rank_pos;        // [T, k] from a dispatch given the weights (DispatchArgs::rank_pos)
    int pull;                   // 1: owners read the expert outputs from the expert ranks' combine_send
    const int* dispatch_status; // [num_waiters] the dispatch's DispatchArgs::status, or null: with any 1 there,
                                // the arrivals are poisoned (sync.cuh arrive) and the owners time out
};

// Trace marks: with a trace array, thread 0 of block b writes %globaltimer to
// trace[b][m] once the whole block reaches mark m (cupyep/low_latency/kernels.py
// TRACE_MARKS names them). Marks add block barriers, so only traced calls pay.
enum Mark {
    kMarkStart = 0,     // send half entered
    kMarkPrep = 1,      // positions (dispatch) / row prefix (combine) ready
    kMarkSent = 2,      // this block's rows all issued
    kMarkFlagged = 3,   // this block arrived on every destination's flag
    kMarkArrived = 4,   // receive half: every peer's flag complete
    kMarkEnd = 5,       // receive half done
    kNumMarks = 8
};

__device__ __forceinline__ void trace_mark(int64_t* trace, int m) {
    if (trace) {
        __syncthreads();
        if (threadIdx.x == 0) trace[blockIdx.x * kNumMarks + m] = (int64_t)global_timer_ns();
    }
}

// A kernel's frame around its body: the wait for the work ahead (programmatic
// dependent launch), start stamp, the end mark of the
// blocks that received, end stamp (all no-ops without the profiling arrays).
template <typename Body>
__device__ __forceinline__ void profiled(const CallArgs& c, Body&& body) {
    pdl_wait();  // launched as a programmatic dependent: the work ahead has ended here
    stamp_start(c.kernel_time);
    body();
    if ((c.phases & kPhaseRecv) && (int)blockIdx.x < c.num_waiters) trace_mark(c.trace, kMarkEnd);
    stamp_end(c.kernel_time);
}

}  // namespace low_latency
}  // namespace cupyep
