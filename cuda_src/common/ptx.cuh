// Memory-ordering and cache-hint wrappers, one line each, named by semantics.
//
// Scopes: `sys` orders against other GPUs and processes (peers reached through
// CUDA IPC may sit on another device); `gpu` orders within one device.
// Ranks that share a GPU under MPS are separate processes on one device, but
// a rank never knows that statically, so protocol flags always use `sys`.
#pragma once
#include "common/types.cuh"

namespace cupyep {

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v; asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* p) {
    int64_t v; asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
    int v; asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) {
    int v; asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int64_t ld_volatile64(const int64_t* p) {
    return *reinterpret_cast<const volatile int64_t*>(p);
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ int atomic_add_release_sys(int* p, int v) {
    int old; asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory"); return old;
}

// Streaming 16-byte copies: the source is read once (no L1 allocation, read-only
// path), the destination is written once.
__device__ __forceinline__ int4 ld_nc_na_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// Plain (coherent) 16-byte load, for data another rank wrote and published
// with a release that this thread has acquired.
__device__ __forceinline__ int4 ld_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

// L2 residency hints. A policy from createpolicy tags the lines an access
// touches: evict_first for data streamed once, evict_last for data read back
// soon (ring slots). discard_l2 drops a 128-byte line without writing it back
// to HBM: for ring slots that have been consumed and will be overwritten.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
    uint64_t p; asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p)); return p;
}
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
    uint64_t p; asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p)); return p;
}
__device__ __forceinline__ int4 ld_nc_na_v4(const int4* p, uint64_t policy) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
    return v;
}
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v, uint64_t policy) {
    asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.s32 [%0], {%1,%2,%3,%4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
}
__device__ __forceinline__ void discard_l2(const void* p) {
    asm volatile("discard.global.L2 [%0], 128;" :: "l"(p) : "memory");
}

// Coherent 16-byte load that never allocates in L1, for memory other ranks
// write between calls (an L1 line left from an earlier call is never hit).
__device__ __forceinline__ int4 ld_na_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

// Programmatic dependent launch (sm_90). pdl_wait: block until the kernels this
// one depends on have finished and their memory is visible; a no-op unless
// this kernel was launched as a programmatic dependent (cupyep.driver).
// pdl_launch_dependents: let the next kernel in the stream, if launched as a
// programmatic dependent, start now (it still waits in pdl_wait for this one).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}

// Kernel stamps, what a profiler shows of a kernel: t[0] the first block's start (min), t[1] the last
// block's end (max), %globaltimer ns; the caller sets t to {INT64_MAX, 0} first
// (cupyep.lab.bench.stamps.new_kernel_stamps). Null t: nothing. stamp_end is per warp (the latest warp's end
// is the last block's), so it holds no block barrier: every lane of a warp that reaches it must reach it.
__device__ __forceinline__ void stamp_start(int64_t* t) {
    if (t && threadIdx.x == 0) atomicMin(reinterpret_cast<unsigned long long*>(t), (unsigned long long)global_timer_ns());
}
__device__ __forceinline__ void stamp_end(int64_t* t) {
    if (t) {
        __syncwarp();
        if (threadIdx.x % 32 == 0)
            atomicMax(reinterpret_cast<unsigned long long*>(t) + 1, (unsigned long long)global_timer_ns());
    }
}

}  // namespace cupyep
