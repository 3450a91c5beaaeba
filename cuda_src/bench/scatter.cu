// Row scatter through peer pointers: the data movement of the low-latency
// kernels with nothing else (no casts, no flags, no position scan), so that
// destination patterns can be timed on their own (experiments/probe_scatter.py).
#include "common/copy.cuh"
#include "common/ptx.cuh"

namespace cupyep {

// Row i (i < n_rows) of this rank: src[src_row[i]] -> peers[dst_peer[i]] + offset + dst_row[i] * row bytes.
// A warp per row, grid-strided. With meta_offset > 0, lane 0 also writes the
// row's source row (int32) at peer + meta_offset + 4 * dst_row and its low byte
// at peer + meta_offset + 4 * meta_rows + dst_row, as the low-latency dispatch
// writes recv_src and recv_slot. Dynamic shared memory, if the launch asks for
// any, is left unused (its only effect is the SM's carveout).
// stamp[0] / stamp[1]: first block start / last block end (%globaltimer ns).
__global__ void __launch_bounds__(512, 1) scatter_rows(void* const* peers, int64_t offset, const int4* src,
                                                        const int* src_row, const int* dst_peer,
                                                        const int64_t* dst_row, int n_rows, int row_int4,
                                                        int64_t meta_offset, int64_t meta_rows, int64_t* stamp) {
    if (threadIdx.x == 0) atomicMin(reinterpret_cast<unsigned long long*>(stamp), (unsigned long long)global_timer_ns());
    const int lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    for (int r = blockIdx.x * num_warps + threadIdx.x / 32; r < n_rows; r += gridDim.x * num_warps) {
        const int4* s = src + (int64_t)src_row[r] * row_int4;
        int4* d = reinterpret_cast<int4*>(static_cast<char*>(peers[dst_peer[r]]) + offset) + dst_row[r] * row_int4;
        warp_copy<8, true>(d, s, row_int4, lane, [](const int4* p) { return ld_nc_na_v4(p); },
                           [](int4* p, const int4& v) { st_na_v4(p, v); });
        if (meta_offset > 0 && lane == 0) {
            char* m = static_cast<char*>(peers[dst_peer[r]]) + meta_offset;
            reinterpret_cast<int*>(m)[dst_row[r]] = src_row[r];
            reinterpret_cast<uint8_t*>(m + 4 * meta_rows)[dst_row[r]] = (uint8_t)src_row[r];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned long long*>(stamp) + 1, (unsigned long long)global_timer_ns());
}

}  // namespace cupyep
