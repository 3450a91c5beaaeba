// FP32 accumulation of BF16 rows, 8 values (one 16-byte word) at a time.
#pragma once
#include <cuda_bf16.h>

namespace cupyep {

// acc[0..8) += w * bf16x8(v), with fused multiply-adds in element order.
__device__ __forceinline__ void fma_bf16x8(float* acc, const int4& v, float w) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
        acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
    }
}

// acc[0..8) rounded to nearest-even BF16, packed into one 16-byte word.
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    int4 out;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return out;
}

}  // namespace cupyep
