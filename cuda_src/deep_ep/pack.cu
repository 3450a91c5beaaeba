// DeepEP's packed low-latency layout over cupyep's region layout.
//
// cupyep's low-latency dispatch leaves local expert e's rows from source r at
// rows [r * C, r * C + count[e][r]) of the expert's R * C rows (C: the
// buffer's capacity), each row a message of `row_stride` bytes. DeepEP packs
// them at rows [0, recv_count[e]) of an [E_local, R * T] array, source by
// source; here in rank order, so source r's rows begin at
// prefix[e][r] = count[e][0] + ... + count[e][r - 1].
//
// The kernel runs one block per region row (grid R * C by E_local): a block
// whose row is past its (expert, source) count returns at once, the others
// copy one row with 16-byte loads and stores. The prefix is summed by warp 0
// of each copying block, from the counts on the device: no host sync, so the
// kernel can be captured in a CUDA graph. (The combine reads packed rows in
// place: cuda_src/low_latency/combine.cu, x_row.)
#include "common/types.cuh"

namespace cupyep {
namespace deep_ep {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// prefix[e][r] for this block's (e, r), summed by warp 0 and shared with the block.
__device__ __forceinline__ int source_prefix(const int* __restrict__ count_e, int r) {
    __shared__ int prefix;
    if (threadIdx.x < 32) {
        int s = 0;
        for (int j = threadIdx.x; j < r; j += 32) s += count_e[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) prefix = s;
    }
    __syncthreads();
    return prefix;
}

// Copy n16 16-byte words from src to dst (both 16-byte aligned) with the block.
__device__ __forceinline__ void copy_row(const int4* __restrict__ src, int4* __restrict__ dst, int n16) {
    int k = threadIdx.x;
    for (; k + (kUnroll - 1) * kThreads < n16; k += kUnroll * kThreads) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = src[k + u * kThreads];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) dst[k + u * kThreads] = v[u];
    }
    for (; k < n16; k += kThreads) dst[k] = src[k];
}

// Region layout -> packed layout (one dispatch's received rows).
//
//   src_x: the first row's payload; row (e, i) is at src_x + e * expert_stride + i * row_stride (bytes)
//   src_scales: the first row's scales (same strides), or null; scale_words 4-byte words a row
//   src_tag: the first row's int32 source token (same strides)
//   layout_count: [E_local][R] int32
//   dst_x: [E_local][packed_rows][row_bytes] bytes (row_bytes a multiple of 16)
//   dst_scales: [E_local][scale_words][packed_rows] 4-byte words (DeepEP's column-major scales), or null
//   dst_src: [E_local][packed_rows] int32 source token of each packed row
//   layout_range: [E_local][R] int64, prefix << 32 | count (written by the block of row 0 of each region)
__global__ void __launch_bounds__(kThreads) pack_rows(
    const uint8_t* __restrict__ src_x, const uint8_t* __restrict__ src_scales, const uint8_t* __restrict__ src_tag,
    int64_t expert_stride, int64_t row_stride, int row_bytes, int scale_words,
    const int* __restrict__ layout_count, int num_ranks, int capacity, int packed_rows,
    uint8_t* __restrict__ dst_x, uint32_t* __restrict__ dst_scales, int* __restrict__ dst_src,
    int64_t* __restrict__ layout_range) {
    const int e = blockIdx.y, i = blockIdx.x;
    const int r = i / capacity, q = i - r * capacity;
    const int* count_e = layout_count + (int64_t)e * num_ranks;
    const int count = count_e[r];
    if (q >= count && q != 0) return;  // past the region's rows (row 0 still writes the range)
    const int prefix = source_prefix(count_e, r);
    if (q == 0 && threadIdx.x == 0)
        layout_range[(int64_t)e * num_ranks + r] = ((int64_t)prefix << 32) | (int64_t)(uint32_t)count;
    if (q >= count) return;
    const int64_t p = (int64_t)e * packed_rows + prefix + q;  // the packed row
    const int64_t src_off = e * expert_stride + i * row_stride;
    copy_row(reinterpret_cast<const int4*>(src_x + src_off), reinterpret_cast<int4*>(dst_x + p * row_bytes),
             row_bytes / 16);
    if (src_scales != nullptr) {
        const uint32_t* s = reinterpret_cast<const uint32_t*>(src_scales + src_off);
        uint32_t* d = dst_scales + (int64_t)e * scale_words * packed_rows + prefix + q;
        for (int j = threadIdx.x; j < scale_words; j += kThreads) d[(int64_t)j * packed_rows] = s[j];
    }
    if (threadIdx.x == 0) dst_src[p] = *reinterpret_cast<const int*>(src_tag + src_off);
}

}  // namespace deep_ep
}  // namespace cupyep
