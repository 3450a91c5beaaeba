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

// IEEE single-precision product and sum, each rounded to nearest even, with
// subnormals kept: CuPy compiles every kernel with -ftz=true, which flushes
// them in plain float arithmetic (fmaf, *, +, __fmul_rn), so a result that
// must equal the NumPy reference bit for bit uses these (PTX without .ftz).
__device__ __forceinline__ float mul_ieee(float a, float b) {
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
__device__ __forceinline__ float add_ieee(float a, float b) {
    float d;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// acc[0..8) += bf16x8(v), IEEE (add_ieee) in element order.
__device__ __forceinline__ void add_bf16x8_ieee(float* acc, const int4& v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] = add_ieee(acc[2 * i], f.x);
        acc[2 * i + 1] = add_ieee(acc[2 * i + 1], f.y);
    }
}

// acc[0..8) += w * bf16x8(v), the product and the sum each rounded, IEEE.
__device__ __forceinline__ void mul_add_bf16x8_ieee(float* acc, const int4& v, float w) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] = add_ieee(acc[2 * i], mul_ieee(f.x, w));
        acc[2 * i + 1] = add_ieee(acc[2 * i + 1], mul_ieee(f.y, w));
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
