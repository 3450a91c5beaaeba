// Argument structs shared by the normal-mode kernels within a node (notify, queue, direct). Every field is
// mirrored, in order, by a NumPy struct dtype in cupyep/normal/queue_kernels.py.
//
// Buffer layout of every rank's symmetric buffer (offsets computed in
// cupyep/normal/queue_layout.py, passed in `BufferOffsets` / `RingShape`):
//   [barrier region]
//   [ring counters: dispatch tail, dispatch head, combine tail, combine head,
//                   each [MAX_CHANNELS][R] int64 spaced by kCounterStride bytes]
//   [notify region: R rows of notify_row_ints ints]
//   [dispatch region: [C][R src][depth] slots of (x bytes | meta bytes)]
//   [combine region:  [C][R src][depth] slots of (x bytes | meta bytes)]
// A ring (channel c, source s) lives in the receiver's buffer. The sender
// advances `tail` (stores into the receiver's memory); the receiver advances
// `head` (the sender reads it remotely). Both counters only grow, across
// calls, so no cleaning pass is needed: each side starts a call from the
// counter it owns (sender: tail, receiver: head), which are equal between
// calls.
#pragma once
#include "common/types.cuh"
#include "common/timeout.cuh"

namespace cupyep {
namespace normal {

constexpr int kCounterStride = 64;  // bytes between ring counters

struct BufferOffsets {
    int64_t barrier;
    int64_t notify;          // NotifyRow region, [R] rows of notify_row_ints ints
    int64_t notify_row_ints;
    int64_t dispatch_tail, dispatch_head, combine_tail, combine_head;  // [C][R] counters
    int64_t dispatch_ring, combine_ring;
};

struct RingShape {
    int64_t ring;         // byte offset of the ring set in every buffer
    int64_t counter_tail; // byte offsets of the [C][R] counter arrays
    int64_t counter_head;
    int64_t slot_bytes;   // x bytes + meta bytes, multiple of 16
    int64_t x_bytes;      // payload bytes per row, multiple of 16
    int depth;            // slots per ring
    int chunk;            // rows a sender publishes per step
};

__device__ __forceinline__ char* ring_slot(void* base, const RingShape& r, int num_ranks, int channel, int src,
                                           int64_t pos) {
    return static_cast<char*>(base) + r.ring +
           (((int64_t)channel * num_ranks + src) * r.depth + pos % r.depth) * r.slot_bytes;
}
__device__ __forceinline__ int64_t* ring_counter(void* base, int64_t offset, int num_ranks, int channel, int src) {
    return reinterpret_cast<int64_t*>(static_cast<char*>(base) + offset +
                                      ((int64_t)channel * num_ranks + src) * kCounterStride);
}

struct NotifyArgs {
    void* const* peers;
    BufferOffsets off;
    const bool* is_token_in_rank;       // [T, R]
    const int* num_tokens_per_rank;     // [R]
    const int* num_tokens_per_expert;   // [E]
    int* send_head;                     // [T, R] out: position of token t in stream (channel(t), dst), or -1
    int* send_list;                     // [R, T] out: token ids of the stream to dst, channel-major
    int* send_channel_prefix;           // [R, C + 1] out
    int* recv_channel_prefix;           // [R src, C + 1] out
    int* recv_rank_offset;              // [R + 1] out: first row of each source's block
    int* rank_prefix_matrix;            // [R, R] out
    int* num_recv_tokens_per_expert;    // [E_local] out (aligned)
    int* host_counts;                   // mapped host [1 + E_local + R * R]: num_recv_tokens, per-expert (unaligned),
                                        // count matrix [s][d], then (with expand_base) the most expert-major
                                        // rows any rank lays out; may be null
    int* expand_base;                   // [R, E_local + 1] out or null (direct transport): for each destination
                                        // d and local expert e of d, the expert-major row of this rank's first
                                        // pair for e (d's aligned block offset plus the pairs of earlier
                                        // sources); column E_local: d's expert-major rows in all
    int* expert_meta;                   // [2 * E_local + 1] out or null (with expand_base): this rank's expert
                                        // block offsets [E_local + 1], then its unaligned pair counts [E_local]
    int64_t* notify_time_ns;            // [2] or null: the pass adds its nanoseconds (%globaltimer, first
                                        // thread in to last out) to [0] and 1 to [1]
    int num_tokens;
    int num_experts;
    int num_channels;
    int expert_alignment;
    int capacity;                       // rows the receive buffers hold (worst-token mode), or INT_MAX
    int rank;
    Guard guard;
};

// The notify pass with the layout in front of it (notify_layout in
// notify.cu): the counts per rank and expert stay in shared memory, and
// is_token_in_rank is written for the pass (and the handle).
struct NotifyLayoutArgs {
    NotifyArgs notify;              // its count inputs unused
    const int64_t* topk_idx;        // [T, k], -1 = no expert
    int num_topk;
    Guard layout_guard;             // expert ids outside [-1, E)
};

struct DispatchArgs {
    void* const* peers;
    RingShape rs;
    const int4* x;                  // [T, x_bytes / 16]
    const float* x_scales;          // [T, num_scales] or null
    const int64_t* topk_idx;        // [T, k]
    const float* topk_weights;      // [T, k] or null
    const int* send_list;           // [R, T]
    const int* send_channel_prefix; // [R, C + 1]
    const int* recv_channel_prefix; // [R, C + 1]
    const int* recv_rank_offset;    // [R + 1]
    int4* recv_x;                   // [N, x_bytes / 16]
    float* recv_x_scales;           // [N, num_scales] or null
    int64_t* recv_topk_idx;         // [N, k] or null
    float* recv_topk_weights;       // [N, k] or null
    int* recv_src_idx;              // [N]
    // Metric, null when off: each receiver poll of a ring adds the rows it
    // found waiting (filled, not yet consumed) to [0] and 1 to [1], and
    // raises [2] to that count if larger.
    uint64_t* queue_occupancy;      // [3] or null
    int num_tokens;
    int num_scales;
    int num_topk;
    int num_local_experts;
    int num_channels;
    int capacity;                   // rows of the receive arrays; rows past recv_rank_offset[R] are padding
    int rank;
    Guard guard;
};

struct CombineArgs {
    void* const* peers;
    RingShape rs;
    const int4* x;                  // [N, H * 2 / 16] bf16 rows to send back (received rows' results)
    const float* row_weights;       // [N] or null: each row is scaled by this in the FP32 reduction
    const float* recv_topk_weights; // [N, k] or null: combined too when given
    const int* send_head;           // [T, R] from dispatch
    const int* recv_channel_prefix; // [R, C + 1] from dispatch
    const int* recv_rank_offset;    // [R + 1] from dispatch
    int4* combined_x;               // [T, H * 2 / 16] bf16
    float* combined_topk_weights;   // [T, k] or null
    int num_tokens;
    int num_topk;
    int num_channels;
    int rank;
    Guard guard;
};

// Channel c owns tokens [token_begin(c), token_begin(c + 1)).
__device__ __forceinline__ int token_begin(int num_tokens, int num_channels, int c) {
    return (int)((int64_t)num_tokens * c / num_channels);
}

}  // namespace normal
}  // namespace cupyep
