// Bulk asynchronous copies (the Hopper copy engine, cp.async.bulk) through
// shared memory, for row copies with few SMs.
//
// A warp copying with 16-byte loads keeps what its registers hold in flight
// (2 KiB per warp at four words a lane), so a copy's rate per SM is bounded
// by its threads. A bulk copy is issued by one thread and moves a whole
// piece of up to `stage_bytes` through shared memory, so the bytes in flight
// per SM are bounded by the shared memory given to the stages instead.
//
// Ordering: a piece's load completes on an mbarrier (the async proxy writes
// shared memory, the same proxy reads it for the store: no proxy fence);
// BulkPipe::drain waits until every store has been performed, then orders the
// async proxy's global writes before the thread's later generic-proxy
// operations (fence.proxy.async), so a release after a __syncthreads covers
// them as it covers ordinary stores.
#pragma once
#include "common/types.cuh"

namespace cupyep {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}
// Orders this thread's earlier generic-proxy accesses to shared memory before
// later async-proxy ones (a bulk copy writing memory the thread used).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Makes initialised mbarriers visible to the async proxy.
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
// Waits for the phase of parity `parity` to complete. The bulk loads it waits
// for are local to the GPU and always complete (a fault traps the kernel).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}
// Global -> shared, completing `bytes` transactions on `bar` (16-byte aligned, a multiple of 16).
__device__ __forceinline__ void bulk_load(void* smem, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(smem)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Shared -> global, in the thread's current bulk async-group.
__device__ __forceinline__ void bulk_store(void* dst, const void* smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(smem_u32(smem)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Every committed group has read its shared memory.
__device__ __forceinline__ void bulk_wait_read_all() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Every committed group has written global memory, ordered before later generic-proxy operations.
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// One warp's chain of bulk copies through two shared-memory stages: lane 0
// issues everything (the other lanes' calls do nothing). A copy is split into
// pieces of at most `stage_bytes`; piece n loads into stage n % 2 while piece
// n - 1 is stored from the other stage, so a load and up to two stores are in
// flight per warp. Pieces are counted over the pipe's life (the mbarrier
// phases follow the count), so copies may follow one another freely; drain()
// before anyone relies on the data.
struct BulkPipe {
    char* stage;          // [2][stage_bytes], 16-byte aligned
    uint64_t* bar;        // [2] mbarriers
    uint32_t stage_bytes;
    uint32_t pieces;      // pieces issued so far
    char* pending_dst;    // the last piece issued, not stored yet (null: none)
    uint32_t pending_bytes;

    // `smem`: 2 * stage_bytes bytes; `bars`: 2 mbarriers. Every lane calls it.
    __device__ __forceinline__ void init(char* smem, uint64_t* bars, uint32_t bytes, int lane) {
        stage = smem;
        bar = bars;
        stage_bytes = bytes;
        pieces = 0;
        pending_dst = nullptr;
        pending_bytes = 0;
        if (lane == 0) {
            mbar_init(bar, 1);
            mbar_init(bar + 1, 1);
            fence_mbar_init();
        }
        __syncwarp();
    }

    // Store the pending piece, number pieces - 1 (later loads may be in flight, not yet counted).
    __device__ __forceinline__ void store_pending() {
        const uint32_t n = pieces - 1, s = n & 1;
        mbar_wait(bar + s, (n >> 1) & 1);
        bulk_store(pending_dst, stage + s * stage_bytes, pending_bytes);
        bulk_commit();
        pending_dst = nullptr;
    }

    // Copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from src to dst.
    __device__ __forceinline__ void copy(void* dst, const void* src, int64_t bytes, int lane) {
        if (lane != 0) return;
        for (int64_t off = 0; off < bytes; off += stage_bytes) {
            const uint32_t nb = (uint32_t)min((int64_t)stage_bytes, bytes - off);
            const uint32_t s = pieces & 1;
            // The store that last read stage s (piece pieces - 2) must be done reading:
            // it is committed (only the pending piece is not), so wait for every group's reads.
            if (pieces >= 2) bulk_wait_read_all();
            mbar_arrive_expect_tx(bar + s, nb);
            bulk_load(stage + s * stage_bytes, static_cast<const char*>(src) + off, nb, bar + s);
            if (pending_dst) store_pending();  // the previous piece, while this one loads
            ++pieces;
            pending_dst = static_cast<char*>(dst) + off;
            pending_bytes = nb;
        }
    }

    // Store what is pending and wait until every store has been performed.
    __device__ __forceinline__ void drain(int lane) {
        if (lane == 0) {
            if (pending_dst) store_pending();
            bulk_wait_all();
        }
        __syncwarp();
    }
};

}  // namespace cupyep
