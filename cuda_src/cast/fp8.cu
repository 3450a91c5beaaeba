// Per-token, per-128-channel FP8 e4m3 quantisation of BF16 rows (see
// common/fp8.cuh for the arithmetic).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "common/fp8.cuh"
#include "common/types.cuh"

namespace cupyep {

// One warp per 128-channel block: each lane handles 4 channels.
__global__ void per_token_cast_to_fp8(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ out,
                                      float* __restrict__ scales, int64_t num_tokens, int hidden, int round_scale) {
    const int lane = threadIdx.x % 32;
    const int64_t blocks_per_row = hidden / 128;
    const int64_t warp_id = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    if (warp_id >= num_tokens * blocks_per_row) return;
    const int64_t t = warp_id / blocks_per_row, b = warp_id % blocks_per_row;
    const int64_t base = t * hidden + b * 128 + lane * 4;
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(x + base);
    const float2 v0 = __bfloat1622float2(p[0]), v1 = __bfloat1622float2(p[1]);
    float amax = fmaxf(fmaxf(fabsf(v0.x), fabsf(v0.y)), fmaxf(fabsf(v1.x), fabsf(v1.y)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = fp8_scale(amax, round_scale);
    const float inv = 1.f / scale;
    *reinterpret_cast<uint32_t*>(out + base) = pack_e4m3x4(v0.x * inv, v0.y * inv, v1.x * inv, v1.y * inv);
    if (lane == 0) scales[t * blocks_per_row + b] = scale;
}

}  // namespace cupyep
