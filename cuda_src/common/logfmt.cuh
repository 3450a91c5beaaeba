// LogFMT-10 on the device: the format of cupyep.reference.logfmt (which
// defines it) for rows of BF16 values.
//
// A row of H values (H a multiple of 128) is H / 128 groups. Its bytes:
//   [G][2] float32  (lo, hi) of each group: log2 of its smallest nonzero and
//                   largest magnitude, lo >= hi - 32 (0, 0 for an all-zero group)
//   [G][160] bytes  each group's 128 codes of 10 bits (sign << 9 | magnitude),
//                   as 16 runs of 8 (run r: codes 8 r .. 8 r + 7, code i of the run
//                   at bits [10 i, 10 i + 10) of its 80 bits, little-endian): the
//                   runs' low 64 bits as [16] uint64, then their high 16 bits as
//                   [16] uint16, so that the 16 lanes holding a group store and
//                   load each part as one contiguous block
// padded to a multiple of 16 bytes. Magnitude code c in 1..511 is
// 2 ** (lo + (c - 1) * step), step = (hi - lo) / 510; 0 is zero. Encoding
// rounds to the nearer level in linear terms; below 2 ** lo to the nearer of
// zero and the lowest level.
//
// The helpers work on 8 consecutive values (one int4 of BF16) of one group,
// as 16 lanes cover a group; the group's (lo, hi) come from a reduction over
// those lanes (group_range).
#pragma once
#include <cuda_bf16.h>
#include "common/types.cuh"

namespace cupyep {
namespace logfmt {

constexpr int kGroup = 128;
constexpr int kLevels = 511;
constexpr float kMaxOctaves = 32.f;
constexpr int kCodeBytesPerGroup = kGroup * 10 / 8;  // 160

__host__ __device__ constexpr int64_t meta_bytes(int hidden) { return (int64_t)(hidden / kGroup) * 8; }
__host__ __device__ constexpr int64_t row_bytes(int hidden) {
    return (meta_bytes(hidden) + (int64_t)(hidden / kGroup) * kCodeBytesPerGroup + 15) / 16 * 16;
}

__device__ __forceinline__ void unpack8(const int4& v, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __bfloat1622float2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

// (lo, hi) of a group whose 128 values 16 lanes hold 8 each (lanes l with the
// same l / 16): the reduction stays within each half of the warp.
__device__ __forceinline__ float2 group_range(const float (&f)[8]) {
    float amax = 0.f, amin = __int_as_float(0x7f800000);  // +inf (NVRTC has no <math.h> INFINITY)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float a = fabsf(f[i]);
        amax = fmaxf(amax, a);
        if (a > 0.f) amin = fminf(amin, a);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, o));
    }
    if (amax == 0.f) return make_float2(0.f, 0.f);
    const float hi = __log2f(amax);  // the hardware's log2, as encode1's
    return make_float2(fmaxf(__log2f(amin), hi - kMaxOctaves), hi);
}

// A group's encoding constants, computed once per 8 values (a lane's share of a group).
struct Encoder {
    float lo, inv_step, lowest, theta;
};
__device__ __forceinline__ Encoder encoder(float lo, float hi) {
    const float step = (hi - lo) / (float)(kLevels - 1);
    const bool flat = !(step > 0.f);
    Encoder e;
    e.lo = lo;
    e.inv_step = flat ? 0.f : 1.f / step;
    e.lowest = exp2f(lo);
    // Rounding to the nearer level in linear terms, in the log domain: a lies above the midpoint of
    // levels c and c + 1 exactly when the fraction of t = (log2 a - lo) / step exceeds
    // log2((1 + 2 ** step) / 2) / step (above 1: never, for a flat group).
    e.theta = flat ? 2.f : __log2f(0.5f * (1.f + exp2f(step))) * e.inv_step;
    return e;
}

// The 10-bit code of one value of a group (sign << 9 | magnitude code).
__device__ __forceinline__ uint32_t encode1(float x, const Encoder& e) {
    const float a = fabsf(x);
    if (a == 0.f) return 0u;
    uint32_t c;
    if (a < e.lowest) {
        c = a >= 0.5f * e.lowest ? 1u : 0u;  // under the range: the nearer of zero and the lowest level
    } else {
        // (__log2f: the hardware's log2, within about 2 ** -22 of it; a value that close to the
        // midpoint of two levels may take the other one, as float32 rounding may anyway)
        const float t = fmaxf((__log2f(a) - e.lo) * e.inv_step, 0.f);
        const float below = fminf(floorf(t), (float)(kLevels - 1));  // the level at or below a, less one
        c = (uint32_t)below + 1u;
        if (c < (uint32_t)kLevels && t - below > e.theta) ++c;
    }
    return c == 0u ? 0u : (c | (x < 0.f ? 1u << 9 : 0u));
}

// The value of a 10-bit code in a group whose levels start at lo, step apart.
__device__ __forceinline__ float decode1(uint32_t code, float lo, float step) {
    const uint32_t m = code & 0x1ffu;
    if (m == 0u) return 0.f;
    const float v = exp2f(lo + (float)((int)m - 1) * step);
    return (code >> 9) & 1u ? -v : v;
}

// One run of 8 codes: its 80 bits as the low 64 and the high 16.
struct Codes {
    uint64_t low;
    uint32_t high;
};

// The codes of 8 BF16 values (one int4) of a group of range (lo, hi). Not inlined, and given the
// values as they are packed (registers, not an array in memory): a warp's loop encodes many words,
// and one copy of this code keeps the loop small.
__device__ __noinline__ Codes encode8(int4 v, float lo, float hi) {
    float f[8];
    unpack8(v, f);
    const Encoder e = encoder(lo, hi);
    uint32_t code[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) code[i] = encode1(f[i], e);
    uint64_t low = 0;
#pragma unroll
    for (int i = 0; i < 6; ++i) low |= (uint64_t)code[i] << (10 * i);  // bits 0..59
    low |= (uint64_t)(code[6] & 0xfu) << 60;                           // bits 60..63
    return {low, (code[6] >> 4) | (code[7] << 6)};                     // bits 64..79
}

// The 8 values of a run of codes in a group of range (lo, hi).
__device__ __forceinline__ void decode8(const Codes& c, float lo, float hi, float (&f)[8]) {
    const float step = (hi - lo) / (float)(kLevels - 1);
#pragma unroll
    for (int i = 0; i < 6; ++i) f[i] = decode1((uint32_t)(c.low >> (10 * i)) & 0x3ffu, lo, step);
    f[6] = decode1((uint32_t)((c.low >> 60) & 0xfu) | ((c.high & 0x3fu) << 4), lo, step);
    f[7] = decode1((c.high >> 6) & 0x3ffu, lo, step);
}

// Word w (8 values, w = group * 16 + r) of a LogFMT row: where its run of codes lies.
__device__ __forceinline__ int64_t run_offset(int hidden, int w) {
    return meta_bytes(hidden) + (int64_t)(w / 16) * kCodeBytesPerGroup;
}
__device__ __forceinline__ void store_codes(char* row, int hidden, int w, const Codes& c) {
    char* g = row + run_offset(hidden, w);
    reinterpret_cast<uint64_t*>(g)[w % 16] = c.low;
    reinterpret_cast<uint16_t*>(g + 128)[w % 16] = (uint16_t)c.high;
}
__device__ __forceinline__ Codes load_codes(const char* row, int hidden, int w) {
    const char* g = row + run_offset(hidden, w);
    return {reinterpret_cast<const uint64_t*>(g)[w % 16], reinterpret_cast<const uint16_t*>(g + 128)[w % 16]};
}
__device__ __forceinline__ float2 range_of(const char* row, int w) {
    return reinterpret_cast<const float2*>(row)[w / 16];
}

// Word w (lane l of a warp holds word w, the 16 lanes l / 16 of it one group) of a row into the
// LogFMT row at row: the half-warp finds its group's range (every lane takes part in the shuffles,
// store or not); a storing lane writes its codes, and lane 0 of each half the group's (lo, hi).
__device__ __forceinline__ void encode_word(char* row, int hidden, int w, const int4& v, int lane, bool store) {
    float f[8];
    unpack8(v, f);
    const float2 range = group_range(f);
    if (!store) return;
    store_codes(row, hidden, w, encode8(v, range.x, range.y));
    if (lane % 16 == 0) reinterpret_cast<float2*>(row)[w / 16] = range;
}

}  // namespace logfmt
}  // namespace cupyep
