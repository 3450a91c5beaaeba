// Argument structs of the direct (one-copy) transport of normal mode. Every
// field is mirrored, in order, by a NumPy struct dtype in
// cupyep/normal/direct_kernels.py.
//
// Memory of every rank (all IPC-registered, the same sizes on every rank):
//   sync buffer:   five [R] arrays of int64 counters, kDirectSyncStride bytes apart
//                  (DirectSync gives their byte offsets);
//   dispatch pool: the receive arrays of a dispatch (DirectRecvLayout), which
//                  the senders write straight into;
//   combine pool:  the partial rows expert ranks send back to a token's owner.
// and, private to the rank, `state` (int64, kStateWords(R) words):
//   [kDispatchEpoch] dispatch calls done, [kDispatchExited] blocks of the running
//   dispatch that have exited, [kCombineEpoch], [kCombineExited] likewise for
//   combine, [kFusedSeq], [kFusedExited] likewise for fused dispatches,
//   [kFusedReady] the latest fused call whose notify block is done and
//   [kFusedStatus] its outcome, [kFusedPosReady] the latest fused call whose
//   expert-major positions are written, then [R] rows received from each source over all dispatch calls,
//   then [R] partial rows received from each expert rank over all combine calls.
// Counters only grow across calls and epochs live on the device, so no cleaning
// pass is needed and a CUDA graph replays correctly.
#pragma once
#include "common/types.cuh"
#include "common/timeout.cuh"
#include "normal/node_args.cuh"

namespace cupyep {
namespace normal {

constexpr int kDirectSyncStride = 64;
constexpr int kDispatchEpoch = 0, kDispatchExited = 1, kCombineEpoch = 2, kCombineExited = 3;
constexpr int kFusedSeq = 4, kFusedExited = 5, kFusedReady = 6, kFusedStatus = 7, kFusedPosReady = 8;
constexpr int kStateHeader = 9;

struct DirectSync {
    int64_t dispatch_ready;    // in sender s's buffer, entry d: the latest dispatch call receiver d is ready for
    int64_t dispatch_arrived;  // in receiver d's buffer, entry s: rows source s has delivered, all calls
    int64_t combine_ready;     // in expert rank d's buffer, entry s: the latest combine call owner s is ready for
    int64_t combine_arrived;   // in owner s's buffer, entry d: partial rows expert rank d has delivered, all calls
    int64_t combine_done;      // in expert rank d's buffer, entry s: the latest in-place combine call in which
                               // owner s has finished reading d's x
};

constexpr int kMaxInPlaceRanks = 16;  // x_peers entries: a node's ranks (the combine keeps R * words <= 16 in flight)

struct DirectXPeers {  // an in-place combine's every rank's x, as this process addresses it
    const int4* x[16];
};
static_assert(sizeof(DirectXPeers) == kMaxInPlaceRanks * sizeof(void*), "one entry per rank");

// Byte offsets of a dispatch's receive arrays in every rank's dispatch pool.
struct DirectRecvLayout {
    int64_t x;             // [rows, x_bytes], or -1 (expert-major dispatch: rows go to em_x only)
    int64_t x_scales;      // [rows, num_scales] float, or -1
    int64_t topk_idx;      // [rows, k] int64, or -1
    int64_t topk_weights;  // [rows, k] float, or -1
    int64_t src_idx;       // [rows] int
    int64_t x_bytes;       // payload bytes per row, a multiple of 16
    int64_t rows;          // rows the pool holds for this layout
    int64_t em_x;          // expert-major dispatch: [em_rows, x_bytes], or -1 (then every em_* is unused)
    int64_t em_x_scales;   // [em_rows, num_scales] float, or -1
    int64_t em_src_row;    // [em_rows] int: rank-major row of each expert-major row, -1 for padding
    int64_t em_recv_row;   // [rows, k] int: expert-major row of each (row, slot) pair, -1 for other ranks' slots
    int64_t em_rows;       // expert-major rows the pool holds for this layout
};

// Expert-major dispatch: where each (token, slot) pair goes (expand.cuh).
struct DirectExpand {
    const int* base;       // [R, E_local + 1] from notify (expand_base)
    int* pos;              // [T, k] pair positions (expert_positions), written by the fused kernel when
                           // compute_pos, else by direct_expert_positions before the send
    const int* meta;       // [2 * E_local + 1] this rank's block offsets, then pair counts (notify's expert_meta)
    int num_experts;       // E
    int hist_warps;        // warps of the position pass (its shared memory: hist_warps * E ints)
    int compute_pos;
};

struct DirectDispatchArgs {
    void* const* pools;              // [R] dispatch pool bases
    void* const* syncs;              // [R] sync buffer bases
    DirectSync sync;
    DirectRecvLayout out;
    const int4* x;                   // [T, x_bytes / 16]
    const float* x_scales;           // [T, num_scales] or null
    const int64_t* topk_idx;         // [T, k] or null
    const float* topk_weights;       // [T, k] or null
    const int* send_list;            // [R, T] from notify
    const int* send_channel_prefix;  // [R, C + 1] from notify
    const int* rank_prefix_matrix;   // [R, R] from notify
    const int* recv_rank_offset;     // [R + 1] from notify
    int64_t* state;                  // private, see above
    int64_t* kernel_time;            // [2] or null: first block's start (min) / last block's end (max), ns
    int* src_copy;                   // or null: where the last block out copies this rank's received source
                                     // indices (the handle's own array; padding included in worst-token mode)
    DirectExpand expand;             // used when out.em_x >= 0
    int num_tokens;
    int num_scales;
    int num_topk;
    int num_local_experts;
    int num_channels;
    int capacity;                    // rows of the receive arrays; rows past recv_rank_offset[R] are padding
    int rank;
    int bulk_stage;                  // > 0: rows move by bulk copies through two stages of this many bytes
                                     // per warp (dynamic shared memory); 0: warp copies of 16-byte words
    Guard guard;
};

struct DirectFusedArgs {
    NotifyArgs notify;               // the notify pass (is_token_in_rank is written, the count inputs unused)
    DirectDispatchArgs dispatch;     // the send (its topk_idx feeds the layout)
    Guard layout_guard;              // expert ids outside [-1, E)
    int* host_status;                // mapped host int: 1 sent, 2 pools too small (nothing sent), 3 notify failed;
                                     // null in worst-token mode
};

struct DirectCombineArgs {
    void* const* pools;              // [R] combine pool bases
    void* const* syncs;              // [R] sync buffer bases
    DirectSync sync;
    int64_t partial_x;               // byte offset of the [rows, H * 2] BF16 partials in every combine pool
    int64_t partial_meta;            // byte offset of the [rows, meta_stride] float row weight and topk weights
    int64_t zc_x;                    // zero-copy: byte offset of every rank's [N, H * 2] expert outputs, which
                                     // the owners read in place (x is this rank's); -1: rows are pushed
                                     // (or, with in_place, read where each rank's caller left them)
    int64_t rows;                    // partial rows the pool holds
    int64_t meta_stride;             // floats per partial row's metadata, >= 1 + k
    const int4* x;                   // [N, H * 2 / 16] one BF16 row per received row
    const float* row_weights;        // [N] or null
    const float* recv_topk_weights;  // [N, k] or null
    const int* rank_prefix_matrix;   // [R, R] from dispatch
    const int* recv_rank_offset;     // [R + 1] from dispatch
    const int* send_head;            // [T, R] from dispatch
    const int* send_channel_prefix;  // [R, C + 1] from dispatch
    int4* combined_x;                // [T, H * 2 / 16]
    float* combined_topk_weights;    // [T, k] or null
    int64_t* state;                  // private, see above
    int64_t* kernel_time;            // [2] or null: first block's start (min) / last block's end (max), ns
    int num_tokens;
    int x_int4;
    int num_topk;
    int num_channels;
    int rank;
    int bulk_stage;                  // as DirectDispatchArgs::bulk_stage, for the pushed rows
    int in_place;                    // 1: the owners read each expert rank's rows from x_peers[d] (its caller's
                                     // own [N, H * 2] x, mapped into this process), only the weights are pushed,
                                     // and the kernel ends after every owner has read this rank's x
    DirectXPeers x_peers;            // with in_place: rank d's x as this process addresses it
    Guard guard;
};

}  // namespace normal
}  // namespace cupyep
