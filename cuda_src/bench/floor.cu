// The floor under a low-latency call on this machine (cupyep/lab/bench/floor.py):
// a grid that runs only the flag protocol of cuda_src/low_latency/sync.cuh,
// optionally after a measured amount of the work a call does before it
// arrives, so that each part's cost can be told apart from the protocol's.
//
// Every block: `loads` dependent global loads (each address comes from the
// previous load), then (code_kib 16 or 64) that many KiB of straight-line
// code run `passes` times, then `barriers` block barriers, then (block 0 only) `rows`
// rows of `row_bytes` stored to peer (row % R)'s buffer after the flags, a warp
// per 512-byte piece, then a block barrier and the arrival: thread d < R adds 1
// to word `rank` of peer d's flags with a release. Blocks b < num_waiters then
// wait, thread r < R, until word r of its own flags reaches (call + 1) * grid
// (acquire loads), for at most timeout_ns; a timeout sets *error to 1 + r.
// The flags only grow, so calls need no clearing; the host zeroes them once.
#include "common/ptx.cuh"

namespace cupyep {

// kFmas independent FMAs in straight-line code (16 bytes of SASS each, 64 a
// KiB), run `passes` times: the first pass fetches the code, later ones find
// it in the instruction cache. Returns a value that depends on all of them.
template <int kFmas>
__device__ __noinline__ float straight_line(float x, float y, int passes) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = x + (float)i;
#pragma unroll 1
    for (int p = 0; p < passes; ++p) {
#pragma unroll
        for (int i = 0; i < kFmas; ++i) acc[i % 8] = fmaf(acc[i % 8], y, (float)i);
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += acc[i];
    return s;
}

__global__ void ll_floor(void* const* peers, int64_t flag_offset, int64_t* kernel_time, const int* chain,
                         int64_t call, int rank, int num_ranks, int num_waiters, int loads, int barriers, int rows,
                         int row_bytes, int code_kib, int passes, int64_t timeout_ns, int* error) {
    pdl_wait();
    stamp_start(kernel_time);
    int idx = 0;
    for (int i = 0; i < loads; ++i) idx = ld_volatile(chain + idx);
    if (code_kib > 0) {  // idx stays 0 (chain is zeros) unless the code's value is a NaN
        const float y = __int_as_float(0x3f800000 + idx);
        const float v = code_kib >= 64 ? straight_line<64 * 64>(1.f, y, passes) : straight_line<16 * 64>(1.f, y, passes);
        idx += v != v;
    }
    for (int i = 0; i < barriers; ++i) __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    if (blockIdx.x == 0) {
        const int pieces = (row_bytes + 511) / 512;
        for (int item = warp; item < rows * pieces; item += num_warps) {
            const int row = item / pieces, off = (item % pieces) * 512 + lane * 16;
            char* dst = static_cast<char*>(peers[row % num_ranks]) + flag_offset + 4096 + (int64_t)row * row_bytes;
            if (off < row_bytes) st_na_v4(reinterpret_cast<int4*>(dst + off), make_int4(idx, row, off, rank));
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < num_ranks; d += blockDim.x)
        atomic_add_release_sys(reinterpret_cast<int*>(static_cast<char*>(peers[d]) + flag_offset) + rank, 1);
    if ((int)blockIdx.x < num_waiters) {
        const int* flags = reinterpret_cast<const int*>(static_cast<char*>(peers[rank]) + flag_offset);
        const int64_t expected = (call + 1) * gridDim.x;
        for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
            const uint64_t start = global_timer_ns();
            while (ld_acquire_sys(flags + r) < expected) {
                if (global_timer_ns() - start > (uint64_t)timeout_ns) {
                    atomicExch(error, 1 + r);
                    break;
                }
            }
        }
        __syncthreads();
    }
    stamp_end(kernel_time);
}

}  // namespace cupyep
