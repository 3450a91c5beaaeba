// Expert-major layout of normal-mode dispatch output, and its inverse for
// combine. Names as in normal/expert_major_args.cuh: N rank-major rows, k top-k
// slots, E_local local experts, A alignment, M_cap expert-major rows.
//
// The received (row, slot) pairs with a local expert are laid out in
// contiguous per-expert blocks: block e starts at expert_offsets[e] and has
// round_up(count_e, A) rows; inside it, pairs are ordered by received row,
// then slot (cupyep.reference.expert_major_order), then come the padding rows.
// Rows from expert_offsets[E_local] to M_cap (M_cap a bound: worst-token mode,
// cached dispatch) are marked -1 in expert_src_row and not written in
// expert_x / expert_x_scales (no recv_expert_row entry points there).
//
//  1. expert_major_count  grid: any (grid-stride over the N * k slots), block
//     kCountThreads, dynamic shared memory E_local ints. Counts pairs per
//     expert (integer atomics: the counts do not depend on their order) and
//     writes -1 into recv_expert_row for every slot that is not a local pair.
//  2. expert_major_map    grid: E_local blocks of kMapThreads. Block e scans
//     the aligned counts for its offset (block 0 writes expert_offsets), then
//     walks the rows in tiles of kMapThreads * kMapRowsPerThread (a thread
//     takes consecutive rows) and places the pairs of expert e with a
//     block-wide exclusive scan of the per-thread counts (warp shuffles +
//     shared memory): the order is fixed, no atomics decide it.
//  3. expert_major_copy   grid: any (grid-stride), a warp per expert-major
//     row: 16-byte loads and stores of the source row (and its scales), or
//     zeros for padding rows.
//  4. expert_major_reduce grid: any (grid-stride), a warp per rank-major row:
//     out[r] = BF16(sum over the row's local slots j, in slot order, of
//     w[r, j] * y[recv_expert_row[r, j]]), accumulated in FP32, rounded to
//     nearest even; zero for rows without a local slot.
#include <cuda_bf16.h>
#include "common/bf16.cuh"
#include "common/types.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "normal/expert_major_args.cuh"

namespace cupyep {
namespace normal {

constexpr int kCountThreads = 256;
constexpr int kMapThreads = 512;
constexpr int kMapRowsPerThread = 4;
constexpr int kCopyThreads = 256;
constexpr int kReduceThreads = 256;

// Rows that hold data: min(*num_recv, num_rows), or num_rows without a count.
// The count was written by an earlier kernel on this stream (notify).
__device__ __forceinline__ int em_valid_rows(const int* num_recv, int num_rows) {
    if (num_recv == nullptr) return num_rows;
    const int n = *num_recv;
    return n < 0 ? 0 : (n < num_rows ? n : num_rows);
}

__device__ __forceinline__ int em_round_up(int v, int a) { return (v + a - 1) / a * a; }

// Block-wide exclusive scan of one int per thread (blockDim.x a multiple of
// 32, at most 1024). Every thread of the block must call it; `s_warp` holds
// 32 ints. Returns the thread's exclusive prefix and sets `total`.
__device__ __forceinline__ int em_block_exclusive_scan(int v, int* s_warp, int& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    if (lane == 31) s_warp[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int w = lane < num_warps ? s_warp[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        s_warp[lane] = w;  // inclusive prefix over warps
    }
    __syncthreads();
    const int before = warp > 0 ? s_warp[warp - 1] : 0;
    total = s_warp[num_warps - 1];
    __syncthreads();  // s_warp is reused by the next call
    return before + inc - v;
}

__global__ void __launch_bounds__(kCountThreads) expert_major_count(ExpertMajorCountArgs a) {
    extern __shared__ int s_count[];  // [E_local]
    const int E = a.num_local_experts, k = a.num_topk;
    for (int i = threadIdx.x; i < E; i += blockDim.x) s_count[i] = 0;
    __syncthreads();
    const int n = em_valid_rows(a.num_recv, a.num_rows);
    const int64_t valid = (int64_t)n * k, total = (int64_t)a.num_rows * k;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i < valid ? a.recv_topk_idx[i] : -1;
        if (e >= 0 && e < E) atomicAdd(&s_count[e], 1);
        else a.recv_expert_row[i] = -1;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x)
        if (s_count[i]) atomicAdd(&a.expert_counts[i], s_count[i]);
}

__global__ void __launch_bounds__(kMapThreads) expert_major_map(ExpertMajorMapArgs a) {
    __shared__ int s_warp[32];
    __shared__ int s_base;
    const int e = blockIdx.x, E = a.num_local_experts, A = a.expert_alignment, k = a.num_topk;
    const int cap = a.capacity;

    // Offsets: exclusive scan of the aligned counts, kMapThreads experts at a time.
    int running = 0;
    for (int i0 = 0; i0 < E; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const int c = i < E ? em_round_up(a.expert_counts[i], A) : 0;
        int total;
        const int excl = em_block_exclusive_scan(c, s_warp, total);
        if (i < E) {
            if (blockIdx.x == 0) a.expert_offsets[i] = running + excl;
            if (i == e) s_base = running + excl;
        }
        running += total;
    }
    const int num_expert_rows = running;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        a.expert_offsets[E] = num_expert_rows;
        if (num_expert_rows > cap) report_error(a.guard, kErrorCapacity, /*phase=*/0, -1, num_expert_rows, cap);
    }
    __syncthreads();
    const int base = s_base;

    // Pairs of expert e, in (row, slot) order: thread t of a tile takes rows
    // [t * kMapRowsPerThread, (t + 1) * kMapRowsPerThread) of it.
    const int n = em_valid_rows(a.num_recv, a.num_rows);
    int pos = base;
    for (int64_t r0 = 0; r0 < n; r0 += (int64_t)blockDim.x * kMapRowsPerThread) {
        const int64_t rb = r0 + (int64_t)threadIdx.x * kMapRowsPerThread;
        const int64_t* idx = a.recv_topk_idx + rb * k;
        int sum = 0;
        for (int u = 0; u < kMapRowsPerThread && rb + u < n; ++u)
            for (int j = 0; j < k; ++j) sum += idx[u * k + j] == e;
        int total;
        const int excl = em_block_exclusive_scan(sum, s_warp, total);
        if (sum) {
            int p = pos + excl;
            for (int u = 0; u < kMapRowsPerThread && rb + u < n; ++u) {
                for (int j = 0; j < k; ++j) {
                    if (idx[u * k + j] != e) continue;
                    a.recv_expert_row[(rb + u) * k + j] = p < cap ? p : -1;
                    if (p < cap) a.expert_src_row[p] = (int)(rb + u);
                    ++p;
                }
            }
        }
        pos += total;
    }
    // My padding rows, then the rows after the last block (split over blocks).
    const int end = base + em_round_up(pos - base, A);
    for (int p = pos + threadIdx.x; p < end && p < cap; p += blockDim.x) a.expert_src_row[p] = -1;
    for (int64_t p = (int64_t)num_expert_rows + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < cap;
         p += (int64_t)gridDim.x * blockDim.x)
        a.expert_src_row[p] = -1;
}

__global__ void __launch_bounds__(kCopyThreads) expert_major_copy(ExpertMajorCopyArgs a) {
    const int lane = threadIdx.x % 32;
    const int64_t num_warps = (int64_t)gridDim.x * blockDim.x / 32;
    const int64_t last = a.expert_offsets[a.num_local_experts];
    const int64_t m_end = last < a.capacity ? last : a.capacity;
    const int64_t w = a.x_int4;
    const int ns = a.num_scales;
    const int4 zero = make_int4(0, 0, 0, 0);
    for (int64_t m = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; m < m_end; m += num_warps) {
        const int src = a.expert_src_row[m];
        int4* dst = a.expert_x + m * w;
        if (src >= 0) {
            const int4* s = a.x + (int64_t)src * w;
            int64_t i = lane;
            for (; i + 3 * 32 < w; i += 4 * 32) {  // four 16-byte loads in flight per lane
                const int4 v0 = ld_nc_na_v4(s + i), v1 = ld_nc_na_v4(s + i + 32);
                const int4 v2 = ld_nc_na_v4(s + i + 64), v3 = ld_nc_na_v4(s + i + 96);
                st_na_v4(dst + i, v0); st_na_v4(dst + i + 32, v1);
                st_na_v4(dst + i + 64, v2); st_na_v4(dst + i + 96, v3);
            }
            for (; i < w; i += 32) st_na_v4(dst + i, ld_nc_na_v4(s + i));
            if (a.expert_x_scales)
                for (int j = lane; j < ns; j += 32) a.expert_x_scales[m * ns + j] = a.x_scales[(int64_t)src * ns + j];
        } else {
            for (int64_t i = lane; i < w; i += 32) st_na_v4(dst + i, zero);
            if (a.expert_x_scales)
                for (int j = lane; j < ns; j += 32) a.expert_x_scales[m * ns + j] = 0.f;
        }
    }
}

__global__ void __launch_bounds__(kReduceThreads) expert_major_reduce(ExpertMajorReduceArgs a) {
    const int lane = threadIdx.x % 32;
    const int64_t num_warps = (int64_t)gridDim.x * blockDim.x / 32;
    const int n = em_valid_rows(a.num_recv, a.num_rows);
    const int k = a.num_topk, cap = a.capacity;
    const int64_t w = a.x_int4;
    for (int64_t r = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; r < n; r += num_warps) {
        const int* rows = a.recv_expert_row + r * k;
        const float* weights = a.pair_weights ? a.pair_weights + r * k : nullptr;
        // Lane j holds slot j (the first 32 slots); the mask lists the local ones.
        int my_row = -1;
        float my_w = 0.f;
        if (lane < k) {
            my_row = rows[lane];
            if (my_row >= cap) my_row = -1;
            my_w = weights ? weights[lane] : 1.f;
        }
        const unsigned mask = __ballot_sync(0xffffffffu, my_row >= 0);
        int4* out = a.out + r * w;
        for (int64_t c0 = 0; c0 < w; c0 += 32) {  // warp-uniform bounds: the shuffles see every lane
            const int64_t c = c0 + lane;
            const bool active = c < w;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (unsigned m = mask; m; m &= m - 1) {  // slot order: lowest bit first
                const int j = __ffs(m) - 1;
                const int row = __shfl_sync(0xffffffffu, my_row, j);
                const float wj = __shfl_sync(0xffffffffu, my_w, j);
                if (active) fma_bf16x8(acc, ld_nc_na_v4(a.y + (int64_t)row * w + c), wj);
            }
            for (int j = 32; j < k; ++j) {  // top-k above 32: the rest of the slots
                const int row = rows[j];
                if (row < 0 || row >= cap) continue;
                if (active) fma_bf16x8(acc, ld_nc_na_v4(a.y + (int64_t)row * w + c), weights ? weights[j] : 1.f);
            }
            if (active) st_na_v4(out + c, pack_bf16x8(acc));
        }
    }
}

}  // namespace normal
}  // namespace cupyep
