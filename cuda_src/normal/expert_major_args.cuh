// Argument structs of the expert-major kernels (normal/expert_major.cu). Every
// field is mirrored, in order, by a NumPy struct dtype in
// cupyep/normal/expert_major.py.
//
// Names: N = rows of the rank-major dispatch output (recv_x), k = top-k,
// E_local = experts of this rank, A = expert alignment, M_cap = rows of the
// expert-major arrays (`capacity`). `num_recv` is the device-side receive
// count (worst-token mode: recv_rank_offset[R] of the dispatch handle), or
// null when all N rows are valid; rows at or after it are never read.
#pragma once
#include "common/types.cuh"
#include "common/timeout.cuh"

namespace cupyep {
namespace normal {

struct ExpertMajorCountArgs {
    const int64_t* recv_topk_idx;  // [N, k] local expert id or -1
    const int* num_recv;           // device receive count, or null: N
    int* expert_counts;            // [E_local] out: pairs per expert (zeroed by the caller)
    int* recv_expert_row;          // [N, k] out: -1 for every slot that is not a valid local pair
    int num_rows;                  // N
    int num_topk;                  // k
    int num_local_experts;         // E_local
};

struct ExpertMajorMapArgs {
    const int64_t* recv_topk_idx;  // [N, k]
    const int* num_recv;           // device receive count, or null: N
    const int* expert_counts;      // [E_local] from expert_major_count
    int* expert_offsets;           // [E_local + 1] out: block starts, block e has round_up(count_e, A) rows
    int* recv_expert_row;          // [N, k] out: expert-major row of each valid local pair
    int* expert_src_row;           // [M_cap] out: rank-major row of each expert-major row, -1 for padding
    int num_rows;                  // N
    int num_topk;                  // k
    int num_local_experts;         // E_local
    int expert_alignment;          // A >= 1
    int capacity;                  // M_cap; more rows are reported (kErrorCapacity), never written
    Guard guard;
};

struct ExpertMajorCopyArgs {
    const int4* x;                 // [N, x_int4] rank-major rows (recv_x)
    const float* x_scales;         // [N, num_scales] or null
    const int* expert_src_row;     // [M_cap]
    const int* expert_offsets;     // [E_local + 1]
    int4* expert_x;                // [M_cap, x_int4] out
    float* expert_x_scales;        // [M_cap, num_scales] out, or null
    int64_t x_int4;                // 16-byte words per row
    int num_scales;
    int num_local_experts;
    int capacity;                  // M_cap
};

struct ExpertMajorReduceArgs {
    const int4* y;                 // [M_cap, H * 2 / 16] BF16 expert outputs, expert-major
    const int* recv_expert_row;    // [N, k] from dispatch, -1 for non-local slots
    const float* pair_weights;     // [N, k] or null (weight 1)
    const int* num_recv;           // device receive count, or null: N
    int4* out;                     // [N, H * 2 / 16] BF16, rank-major
    int64_t x_int4;                // 16-byte words per row (H / 8)
    int num_rows;                  // N
    int num_topk;                  // k
    int capacity;                  // M_cap: rows of y
};

}  // namespace normal
}  // namespace cupyep
