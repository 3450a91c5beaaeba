// Bounded device waits.
//
// Every spin-wait in cupyep goes through `wait_until`. The budget is
// wall-clock nanoseconds read from %globaltimer, which, unlike clock64(), does
// not depend on the SM clock (boost, throttling) nor on which SM a block
// migrates to. On timeout the first waiter to notice writes a
// record into the host-visible ErrorSlot (mapped pinned memory, so the host can
// read it even after the kernel has stopped) and the waiting block returns.
// The host turns that record into cupyep.errors.CommTimeoutError.
#pragma once
#include "common/types.cuh"
#include "common/ptx.cuh"

namespace cupyep {

// Mirrors cupyep/errors.py: ERROR_SLOT_DTYPE. Keep both in sync.
struct ErrorSlot {
    int flag;          // 0: no error; else kErrorTimeout / kErrorCapacity / kErrorBadInput
    int kernel;        // cupyep.errors.KERNEL_NAMES index
    int rank;          // rank that timed out
    int peer;          // rank it was waiting for (-1: none / local)
    int phase;         // cupyep.errors.PHASE_NAMES index
    int block;         // blockIdx.x of the waiter
    int64_t value;     // counter value last observed
    int64_t expected;  // value that was awaited
};

struct Guard {
    ErrorSlot* slot;      // mapped host pointer
    uint64_t timeout_ns;  // budget per wait
    int kernel;
    int rank;
};

// Error kinds in ErrorSlot::flag.
constexpr int kErrorTimeout = 1;
constexpr int kErrorCapacity = 3;   // more rows than a buffer holds
constexpr int kErrorBadInput = 4;   // e.g. an expert id out of range found on the device

// Another waiter of this rank timed out: stop waiting too. Bad input and
// capacity errors do not stop waits: the kernels that report them skip the
// offending rows and finish the protocol, so peers are never left waiting.
__device__ __forceinline__ bool peer_wait_timed_out(const Guard& g) {
    return ld_volatile(&g.slot->flag) == kErrorTimeout;
}

__device__ __noinline__ void report_error(Guard g, int kind, int phase, int peer, int64_t value, int64_t expected) {
    if (atomicCAS(&g.slot->flag, 0, 2) == 0) {  // 2: being written
        g.slot->kernel = g.kernel;
        g.slot->rank = g.rank;
        g.slot->peer = peer;
        g.slot->phase = phase;
        g.slot->block = blockIdx.x;
        g.slot->value = value;
        g.slot->expected = expected;
        __threadfence_system();
        atomicExch(&g.slot->flag, kind);
    }
}

__device__ __forceinline__ void report_timeout(Guard g, int phase, int peer, int64_t value, int64_t expected) {
    report_error(g, kErrorTimeout, phase, peer, value, expected);
}

// Spin until done(*p), acquire semantics. Returns false after reporting a
// timeout, with the (value, expected) pair report(v) makes of the last value
// seen, or when another waiter of this rank already reported one (so one
// timeout stops every block quickly). T is int or int64_t.
template <typename T, typename Done, typename Report>
__device__ __forceinline__ bool wait_until(const T* p, Done&& done, Report&& report, const Guard& g, int phase,
                                           int peer) {
    T v = ld_acquire_sys(p);
    if (done(v)) return true;
    const uint64_t start = global_timer_ns();
    for (uint32_t iter = 1;; ++iter) {
        v = ld_acquire_sys(p);
        if (done(v)) return true;
        if ((iter & 1023u) == 0) {
            if (global_timer_ns() - start > g.timeout_ns) {
                const longlong2 r = report(v);
                report_timeout(g, phase, peer, r.x, r.y);
                return false;
            }
            if (peer_wait_timed_out(g)) return false;
        }
    }
}

// Spin until *p >= expected (wrap-safe for int counters).
__device__ __forceinline__ bool wait_geq(const int* p, int expected, const Guard& g, int phase, int peer) {
    return wait_until(
        p, [=](int v) { return v - expected >= 0; }, [=](int v) { return make_longlong2(v, expected); }, g, phase,
        peer);
}
__device__ __forceinline__ bool wait_geq(const int64_t* p, int64_t expected, const Guard& g, int phase, int peer) {
    return wait_until(
        p, [=](int64_t v) { return v >= expected; }, [=](int64_t v) { return make_longlong2(v, expected); }, g,
        phase, peer);
}

}  // namespace cupyep
