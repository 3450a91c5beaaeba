// FP8 e4m3 quantisation shared by every kernel that casts BF16 to FP8, as
// cupyep.reference.fp8 defines it: per 128 channels, amax clamped at 1e-4,
// scale = amax / 448, optionally rounded up to a power of two (UE8M0), values
// x * (1 / scale) cast with saturation.
#pragma once
#include <cuda_fp8.h>
#include "common/types.cuh"

namespace cupyep {

__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
    float scale = fmaxf(amax, 1e-4f) / 448.f;
    if (round_scale) scale = exp2f(ceilf(log2f(scale)));
    return scale;
}

// Four floats (already multiplied by 1 / scale) to four packed e4m3 bytes.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    return (uint32_t)__nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3) |
           (uint32_t)__nv_cvt_float_to_fp8(b, __NV_SATFINITE, __NV_E4M3) << 8 |
           (uint32_t)__nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3) << 16 |
           (uint32_t)__nv_cvt_float_to_fp8(d, __NV_SATFINITE, __NV_E4M3) << 24;
}

// UE8M0 byte of a power-of-two scale: its biased exponent.
__device__ __forceinline__ uint32_t ue8m0_byte(float pow2_scale) {
    return (__float_as_uint(pow2_scale) >> 23) & 0xffu;
}

}  // namespace cupyep
