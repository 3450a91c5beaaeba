// Flag protocol of the low-latency kernels (see args.cuh for the buffer sets).
//
// Send side: every block writes its rows with plain stores to the peers and
// then arrives on each destination's flag for this rank with a release add
// (`arrive`). The flag counts arrivals; block 0 adds the number of arriving
// blocks in the high half as well, so a flag is complete when its low half
// equals its high half, and zero still means "nothing arrived". A block
// arrives after a block barrier, so its release covers the rows every thread
// of the block wrote; the receive side acquires the flag. There is no wait on
// the send side: no block depends on another block of its own rank, so a grid
// may have more blocks than can be resident with every other rank's. Only the
// first num_waiters blocks wait (for the peers' flags), and the host checks
// that the waiters of all ranks sharing a GPU fit with room to spare. The
// adds are atomics on peer memory, so the host also checks that the ranks'
// GPUs take each other's atomics natively (kernels.check_peer_atomics). The
// alternative without them, each block counting itself on a local counter
// and the last one storing the flags, measured 2-3 us slower per call
// (results/archive/low_latency_last_block.jsonl).
//
// Masked ranks (shrink mode: the CUPYEP_LL_SHRINK build, CallArgs::mask
// non-null; the other build compiles every test of the mask out): no rows, counts or
// arrivals go to a masked rank, and no wait waits for one; its counts read as
// zero and the combine leaves out the slots of its experts. A wait for a peer
// that runs out of time masks that peer (mask[r] = 1) instead of reporting a
// timeout, and waits for a peer that another block masked stop at once. The
// host sets, reads and clears the mask in stream order
// (LowLatencyBuffer.update_mask / query_mask / clean_mask); a change between a
// dispatch and the combine of its handle is not defined, and so is unmasking
// a rank that was masked by a timeout while the ranks are not in step (its
// late arrivals may land on flags already cleared): make a new buffer then.
// Positions do not depend on the mask (they count per expert), so blocks that
// read it at different moments still agree on every row of the ranks they
// send to.
//
// Flags are cleared one call ahead: block 0 of a call clears the flags of the
// set the next call uses. A peer writes those flags only during the next call,
// after it has seen this call's flag from this rank complete, which needs block
// 0's arrival, which block 0 makes after the clear; so the clear always lands
// first.
#pragma once
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "low_latency/args.cuh"

namespace cupyep {
namespace low_latency {

template <typename T>
__device__ __forceinline__ T* at(void* base, int64_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// Across nodes: the rows of a set's remote_signal [4][R] (args.cuh), and the word of row `which` that
// rank r on another node adds to (int64: the waits read it as a count).
enum RemoteSignal { kSigCounts = 0, kSigRows = 1, kSigReturnRows = 2, kSigCombineStart = 3 };
constexpr int kRemoteSignalRows = 4;  // cupyep.low_latency.layout: remote_signal is 4 * R words
__device__ __forceinline__ int64_t* remote_signal(void* base, const SetOffsets& set, int num_ranks, RemoteSignal which,
                                                  int r) {
    return at<int64_t>(base, set.remote_signal) + (int64_t)which * num_ranks + r;
}
// The same word as NVSHMEM's signal operations name it.
__device__ __forceinline__ uint64_t* signal_word(int64_t* p) { return reinterpret_cast<uint64_t*>(p); }

// Block 0 zeroes the next set's flags (and, across nodes, its signals: the
// same argument covers them, since block 0 also sends the counts that
// complete a remote peer's wait, after this clear).
__device__ __forceinline__ void clear_next_flags(void* mine, const SetOffsets& next, int num_ranks) {
    if (blockIdx.x != 0) return;
    int* dispatch_flag = at<int>(mine, next.dispatch_flag);
    int* combine_flag = at<int>(mine, next.combine_flag);
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x) {
        dispatch_flag[i] = 0;
        combine_flag[i] = 0;
    }
#ifdef CUPYEP_LL_NVSHMEM
    uint64_t* signals = at<uint64_t>(mine, next.remote_signal);
    for (int i = threadIdx.x; i < kRemoteSignalRows * num_ranks; i += blockDim.x) signals[i] = 0;
#endif
}

#ifdef CUPYEP_LL_SHRINK
constexpr bool kShrink = true;
#else
constexpr bool kShrink = false;
#endif

// Whether this call reads a mask (shrink mode).
__device__ __forceinline__ bool shrinking(const CallArgs& c) { return kShrink && c.mask != nullptr; }

// Whether rank r is masked (always false outside shrink mode).
__device__ __forceinline__ bool is_masked(const CallArgs& c, int r) {
    return shrinking(c) && ld_volatile(c.mask + r) != 0;
}

// Shrink mode's wait on peer r: like wait_until, but it ends when r is masked
// (by another block, or here: after the budget it masks r, reporting nothing).
// Returns true when done(*p) holds, false when r is (now) masked.
template <typename T, typename Done>
__device__ __forceinline__ bool wait_unless_masked(const CallArgs& c, const T* p, Done&& done, int r) {
    T v = ld_acquire_sys(p);
    if (done(v)) return true;
    const uint64_t start = global_timer_ns();
    for (uint32_t iter = 1;; ++iter) {
        v = ld_acquire_sys(p);
        if (done(v)) return true;
        if ((iter & 1023u) == 0) {
            if (is_masked(c, r)) return false;
            if (global_timer_ns() - start > c.guard.timeout_ns) {
                atomicExch(c.mask + r, 1);
                return false;
            }
        }
    }
}

// A wait for *p >= expected from peer r: bounded (a reported timeout, false),
// or in shrink mode until r is masked (false, nothing reported).
template <typename T>
__device__ __forceinline__ bool wait_peer_geq(const CallArgs& c, const T* p, T expected, int phase, int r) {
    if (shrinking(c)) return !is_masked(c, r) && wait_unless_masked(c, p, [=](T v) { return v >= expected; }, r);
    return wait_geq(p, expected, c.guard, phase, r);
}

// The value block b adds to a flag when num_blocks (<= kernels.MAX_BLOCKS) blocks arrive.
__device__ __forceinline__ int arrival(int b, int num_blocks) { return 1 + (b == 0 ? num_blocks << 16 : 0); }

// Whether a flag holds every arrival its sender announced (see above).
__device__ __forceinline__ bool arrivals_complete(int v) {
    return v != 0 && (v & 0xffff) == ((unsigned)v >> 16);
}

// A poisoned arrival: block 0 also adds this to the low half, which then never
// equals the announced count (at most kernels.MAX_BLOCKS = 0x7FFF), so the flag
// never completes and its waiters time out naming this rank.
constexpr int kPoison = 0x8000;

// Blocks b < num_blocks (every block that wrote rows, or just block 0 when there
// were none) arrive on flags[rank] of every peer's buffer of this node at byte
// offset flag_offset, after a block barrier so that the release covers the
// block's rows. (Peers on other nodes learn of their rows from signals.)
// `poisoned` (block 0's shared word, read after the barrier, or null): nonzero
// for a combine of a dispatch whose wait for its sources timed out. That
// dispatch counted no rows, so this combine returns none; its owners must not
// reduce without them, and time out instead (across nodes they do already:
// they count the rows' signals).
__device__ __forceinline__ void arrive(const CallArgs& c, int64_t flag_offset, int num_blocks,
                                       const int* poisoned = nullptr) {
    __syncthreads();
    if ((int)blockIdx.x >= num_blocks) return;
    const int v = arrival(blockIdx.x, num_blocks) + (blockIdx.x == 0 && poisoned != nullptr && *poisoned ? kPoison : 0);
    for (int dst = threadIdx.x; dst < c.num_ranks; dst += blockDim.x)
        if (!is_remote(c, dst) && !is_masked(c, dst)) atomic_add_release_sys(at<int>(c.peers[dst], flag_offset) + c.rank, v);
}

// Wait (every block) until all R peers' flags in `flags` are complete; a peer
// on another node through remote(r) instead (bool: false after a timeout).
// Block 0 adds the nanoseconds it waited for each peer to wait_stats. In
// shrink mode a masked peer is not waited for, a peer that runs out of time is
// masked, and the result is true: the callers read the mask afterwards.
template <typename Remote>
__device__ __forceinline__ bool wait_peer_flags(const CallArgs& c, const int* flags, const Guard& guard,
                                                int64_t* wait_stats, Remote&& remote) {
    __shared__ int s_fail;
    if (threadIdx.x == 0) s_fail = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < c.num_ranks; r += blockDim.x) {
        const uint64_t t0 = global_timer_ns();
        if (shrinking(c)) {  // shrink mode: a peer that does not come is masked, not an error
            if (is_remote(c, r)) (void)remote(r);
            else if (!is_masked(c, r))
                (void)wait_unless_masked(c, flags + r, [](int v) { return arrivals_complete(v); }, r);
            if (wait_stats && blockIdx.x == 0)
                atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + r),
                          (unsigned long long)(global_timer_ns() - t0));
            continue;
        }
        // A timeout reports (blocks arrived, blocks announced; 0 before block 0 arrived).
        if (is_remote(c, r) ? !remote(r)
                            : !wait_until(
                                  flags + r, [](int v) { return arrivals_complete(v); },
                                  [](int v) { return make_longlong2(v & 0xffff, (unsigned)v >> 16); }, guard,
                                  kWaitPeerFlag, r))
            s_fail = 1;
        else if (wait_stats && blockIdx.x == 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + r),
                      (unsigned long long)(global_timer_ns() - t0));
    }
    __syncthreads();
    return !s_fail;
}

// Across nodes: source r's dispatch to me, on another node: its counts'
// signal (block 0 of r puts the counts, fences, then signals), then as many
// messages as the counts announce (each put with a signal). Thread-level.
__device__ __forceinline__ bool wait_remote_dispatch(const CallArgs& c, int r, const Guard& guard) {
    const int R = c.num_ranks, El = c.num_experts / R;
    void* mine = c.peers[c.rank];
    (void)guard;
    if (!wait_peer_geq(c, remote_signal(mine, c.cur, R, kSigCounts, r), (int64_t)1, kWaitRemoteCounts, r))
        return false;
    const int* counts = at<int>(mine, c.cur.dispatch_count);
    int64_t n = 0;
    for (int le = 0; le < El; ++le) n += ld_volatile(counts + le * R + r);
    return wait_peer_geq(c, remote_signal(mine, c.cur, R, kSigRows, r), n, kWaitRemoteRows, r);
}

}  // namespace low_latency
}  // namespace cupyep
