// Low-latency combine: expert outputs travel back to the rank that owns each
// token, which reduces them with its top-k weights in FP32.
//
// Grid: G blocks; send and receive halves as in dispatch.cu.
// Send half (the expert side): the received rows of this rank, listed by
// (local expert, source) pair from the dispatch's layout counts, are cut into
// pieces of 4 KiB (8 words a lane, loaded at once), spread over all warps (so
// a few rows still keep many warps busy). Source s's rows go, in (expert, position)
// order, to my range of s's combine_recv: the order in which s's dispatch
// listed its rows to me, so s finds the row of its (token, slot) at the
// dispatch's combine_pos. Then every block arrives on every source's flag
// (sync.cuh).
// Receive half (the token side, blocks b < num_waiters): wait for every expert
// rank's flag, then each warp takes a run of (token, chunk) items and sums
// weight * row over the token's top-k slots, in slot order, so the result is
// bitwise deterministic.
//
// Shrink mode (CallArgs::mask, sync.cuh): no row goes back to a masked owner,
// and an owner leaves out the slots whose expert rank is masked (their rows
// were never sent, or are not waited for).
//
// LogFMT-10 (the combine_logfmt kernel, pushed within a node): the send half
// encodes each row per 128-channel group (common/logfmt.cuh, the format of
// cupyep.reference.logfmt) into the owner's combine_recv, 10.5 bits a value;
// the receive half decodes as it reduces.
//
// Partial (the combine_partial kernel, pushed within a node; the dispatch was
// given the weights): each received row's tag (args.cuh) holds its slot's
// weight, whether it is its token's first row on this rank (the head), p (the
// token's row among the source's tokens to this rank) and the region row of
// the token's next row here. The send half gives a warp each head row: it
// follows the chain and sums the token's rows, in FP32 in slot order, into
// one BF16 partial row at row p of its range of the owner's combine_recv. The
// owner sums its token's partials, one per expert rank, in FP32 in rank order
// (cupyep.reference.low_latency_partial_combine, bit for bit): a third fewer
// rows at top-8 over 8 ranks. combine_partial_logfmt sends those BF16
// partial rows in LogFMT-10 and the owner decodes them as it sums.
//
// Packed x (CombineArgs::x_expert_rows > 0): the expert outputs arrive in
// DeepEP's packed layout instead of the region layout; only where each row is
// read from changes (x_row).
//
// Pull (CombineArgs::pull): the expert outputs sit in every expert rank's
// combine_send, where the owner knows each of its rows (its dispatch put (t, j)
// at row slot_pos of region (expert, me)), and the owners read them from the
// expert ranks' buffers as they reduce. With zero-copy they are there already
// and the send half only sets the flags (block 0 arrives alone); otherwise it first copies x into
// its own combine_send, slot for slot (local writes: no peer pages touched). A
// row is read remotely once, never written remotely. This copy of combine_send
// is written again only for a call at least two calls later
// (layout.CallSchedule); the call in between completes only once every rank
// has flagged it, which each rank does after finishing this reduce.
#include <cuda_bf16.h>
#include "common/bf16.cuh"
#include "common/copy.cuh"
#include "common/logfmt.cuh"
#include "common/scan.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "low_latency/args.cuh"
#include "low_latency/sync.cuh"

namespace cupyep {
namespace low_latency {

// A copy's unroll as a type, for a generic lambda: Unroll<N>{} -> unroll_of == N.
template <int N>
struct Unroll {};
template <int N>
__device__ constexpr int unroll_of(Unroll<N>) { return N; }

// The row of x that holds received row q of pair lo = (local expert le, source
// s): its region slot, or in DeepEP's packed layout (x_expert_rows > 0) row q
// after the rows of expert le's earlier sources (prefix: the rows of all
// pairs before each pair, in (expert, source) order).
__device__ __forceinline__ int64_t x_row(const CombineArgs& a, const int* prefix, int lo, int le, int R, int q,
                                         int64_t slot) {
    return a.x_expert_rows ? (int64_t)le * a.x_expert_rows + (prefix[lo] - prefix[le * R]) + q : slot;
}

template <int kNumThreads, bool kLogFMT, bool kPartial = false>
__device__ __forceinline__ void combine_body(const CombineArgs& a) {
    extern __shared__ int smem[];
    const int R = a.c.num_ranks, E = a.c.num_experts, El = E / R, T = a.c.num_tokens, k = a.c.num_topk, H = a.c.hidden;
    const int G = gridDim.x, b = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    const int num_chunks = (H + kChunkElems - 1) / kChunkElems;
    const int64_t slots = (int64_t)R * a.c.capacity;  // rows per local expert
    void* mine = a.c.peers[a.c.rank];

    if (a.c.phases & kPhaseSend) {
        trace_mark(a.c.trace, kMarkStart);
        clear_next_flags(mine, a.c.next, R);
#ifdef CUPYEP_LL_NVSHMEM
        // Block 0, after its clear: every owner on another node learns that this combine began (so this
        // rank's dispatch before it is done), even one I return no rows to.
        if (b == 0)
            for (int dst = threadIdx.x; dst < R; dst += blockDim.x)
                if (is_remote(a.c, dst) && !is_masked(a.c, dst))
                    nvshmemx_signal_op(signal_word(remote_signal(mine, a.c.cur, R, kSigCombineStart, a.c.rank)), 1,
                                       NVSHMEM_SIGNAL_ADD, dst);
#endif
        // Whether the dispatch of this handle timed out (its waiters' status): then block 0's
        // arrival is poisoned (sync.cuh arrive). Warp 0 of block 0 looks: its lanes load the first
        // 32 words early (their latency hides behind the counts' loads) and publish the verdict in
        // shared memory ahead of a block barrier.
        __shared__ int s_poisoned;
        const bool looks = b == 0 && warp == 0;
        const int status0 = looks && a.dispatch_status && lane < a.c.num_waiters ? __ldg(a.dispatch_status + lane) : 0;
        auto publish_status = [&] {
            if (!looks) return;
            bool poison = status0 != 0;
            for (int i = lane + 32; a.dispatch_status && i < a.c.num_waiters; i += 32)
                poison |= __ldg(a.dispatch_status + i) != 0;
            poison = __any_sync(0xffffffffu, poison);
            if (lane == 0) s_poisoned = poison;
        };
        int4* local_send = at<int4>(mine, a.c.cur.combine_send);
        // Pulled from where they are (zero-copy): no rows to move, only flags to set.
        const bool moves_rows = !(a.pull && a.x == local_send);
        if (moves_rows) {
            // prefix[p] = rows of pairs before p = (expert e, source s), p = e * R + s;
            // colprefix[p] (pushed only) = rows of source s for my experts before e (where
            // pair p's rows start in my range of s's combine_recv).
            const int P = El * R;
            int* count = smem;                // [P] the dispatch's layout counts, loaded once by the block
            int* prefix = count + P;          // [P + 1]
            int* colprefix = prefix + P + 1;  // [P]
            for (int p = threadIdx.x; p < P; p += blockDim.x) count[p] = __ldg(a.layout_count + p);
            publish_status();
            __syncthreads();
            // Warp 0 scans all pairs; warps 1.. scan each source's pairs (stride R).
            if (warp == 0) {
                const int total = warp_exclusive_scan(P, lane, [&](int p) { return count[p]; },
                                                      [&](int p, int v) { prefix[p] = v; });
                if (lane == 0) prefix[P] = total;
            }
            for (int s = warp - 1; !a.pull && s >= 0 && s < R; s += num_warps - 1)
                warp_exclusive_scan(El, lane, [&](int le) { return count[le * R + s]; },
                                    [&](int le, int v) { colprefix[le * R + s] = v; });
            __syncthreads();
            trace_mark(a.c.trace, kMarkPrep);
            auto pair_of = [&](int64_t r) {  // the pair of received row r: the last p with prefix[p] <= r
                int lo = 0, hi = P;
                while (hi - lo > 1) {
                    const int mid = (lo + hi) / 2;
                    if (prefix[mid] <= r) lo = mid; else hi = mid;
                }
                return lo;
            };
            const int64_t row_int4 = H / 8, ret_rows = return_rows(a.c.max_tokens, a.c.max_topk, El, a.c.capacity);
            if constexpr (kPartial) {
                // A warp per head row (its token's first row on this rank, by slot): it follows the
                // token's chain of rows here (each tag names the next), lane i keeping the i-th row and
                // weight, then sums them chunk by chunk into the partial row the owner reads at p.
                // Units of 1024 channels: each lane owns words lane + 32 i (i < 4) of a unit, so a row
                // keeps 2 KiB in flight per warp. The partial row goes out in BF16, or (kLogFMT) those
                // BF16 values through LogFMT-10: lanes 0-15 and 16-31 of each i hold a group of 128.
                const int64_t dst_row_bytes = kLogFMT ? logfmt::row_bytes(H) : 2 * (int64_t)H;
                constexpr int kUnitWords = 128, kRowsInFlight = kNumThreads <= 512 ? 2 : 1;
                const int row_words = H / 8, units = (row_words + kUnitWords - 1) / kUnitWords;
                for (int64_t r = (int64_t)b * num_warps + warp; r < prefix[P]; r += (int64_t)G * num_warps) {
                    const int lo = pair_of(r);
                    const int le = lo / R, s = lo % R, q = (int)(r - prefix[lo]);
                    if (is_masked(a.c, s)) continue;  // warp-uniform: nothing goes to a masked owner
                    int64_t slot = (int64_t)le * slots + (int64_t)s * a.c.capacity + q;
                    int4 tag = *reinterpret_cast<const int4*>(a.tags + slot * a.tag_stride);
                    if (!((tag.y >> 8) & 1)) continue;  // not the token's first row here: its head sums it
                    const int p = (int)((unsigned)tag.y >> 16);
                    if (p >= ret_rows) continue;
                    int my_row = -1, n = 0, cle = le, cq = q;
                    float my_w = 0.f;
                    for (;;) {  // every lane walks the chain (the same loads), lane n keeps element n
                        if (lane == n) {
                            my_row = (int)x_row(a, prefix, cle * R + s, cle, R, cq, slot);
                            my_w = __int_as_float(tag.z);
                        }
                        ++n;
                        if (tag.w < 0 || tag.w >= El * a.c.capacity || n >= k) break;
                        cle = tag.w / a.c.capacity, cq = tag.w % a.c.capacity;
                        slot = (int64_t)cle * slots + (int64_t)s * a.c.capacity + cq;
                        tag = *reinterpret_cast<const int4*>(a.tags + slot * a.tag_stride);
                    }
                    char* dst = at<char>(a.c.peers[s], a.c.cur.combine_recv) +
                                ((int64_t)a.c.rank * ret_rows + p) * dst_row_bytes;
                    for (int unit = 0; unit < units; ++unit) {
                        float acc[32];
#pragma unroll
                        for (int i = 0; i < 32; ++i) acc[i] = 0.f;
                        for (int j0 = 0; j0 < n; j0 += kRowsInFlight) {
                            int4 v[kRowsInFlight][4];
                            float w[kRowsInFlight];
#pragma unroll
                            for (int uu = 0; uu < kRowsInFlight; ++uu) {
                                const int row = __shfl_sync(0xffffffffu, my_row, (j0 + uu) & 31);
                                w[uu] = j0 + uu < n ? __shfl_sync(0xffffffffu, my_w, (j0 + uu) & 31) : 0.f;
                                const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) +
                                                                                (int64_t)row * a.x_row_bytes);
#pragma unroll
                                for (int i = 0; i < 4; ++i) {
                                    const int word = unit * kUnitWords + lane + 32 * i;
                                    v[uu][i] = j0 + uu < n && word < row_words ? ld_nc_na_v4(src + word)
                                                                               : make_int4(0, 0, 0, 0);
                                }
                            }
                            // Product, then sum, each rounded, subnormals kept (bf16.cuh): the reference's
                            // FP32 arithmetic, in slot order (an absent row adds +0 * 0: no change, the sum
                            // starting at +0 and a sum rounded to nearest being -0 only when both terms are).
#pragma unroll
                            for (int uu = 0; uu < kRowsInFlight; ++uu)
#pragma unroll
                                for (int i = 0; i < 4; ++i) mul_add_bf16x8_ieee(acc + 8 * i, v[uu][i], w[uu]);
                        }
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int word = unit * kUnitWords + lane + 32 * i;
                            const bool store = word < row_words && !(a.c.ablate & kAblateRows);
                            const int4 packed = pack_bf16x8(acc + 8 * i);
                            if constexpr (kLogFMT) logfmt::encode_word(dst, H, word, packed, lane, store);
                            else if (store) st_na_v4(reinterpret_cast<int4*>(dst) + word, packed);
                        }
                    }
                }
            } else if constexpr (kLogFMT) {
                // LogFMT-10 (pushed within a node): a warp per piece of a received row, kLfWords words a
                // lane (lane l: words l + 32 i), all loaded at once; then word by word, the half-warp
                // holding a group (16 words) finds its range, every lane stores its codes and lane 0
                // of each half the group's (lo, hi). Pieces of 8 words a lane when they keep every
                // warp busy, else of one, so that a few rows still spread over many warps.
                const int row_words = H / 8, lane_words = (row_words + 31) / 32;
                const int64_t lf_row = logfmt::row_bytes(H);
                auto encode_rows = [&](auto unroll) {
                    constexpr int kLfWords = unroll_of(decltype(unroll){});
                    const int pieces = (lane_words + kLfWords - 1) / kLfWords;
                    const int64_t num_items = (int64_t)prefix[P] * pieces;
                    for (int64_t item = (int64_t)b * num_warps + warp; item < num_items;
                         item += (int64_t)G * num_warps) {
                        const int r = (int)(item / pieces), lw0 = (int)(item % pieces) * kLfWords;
                        const int lo = pair_of(r);
                        const int le = lo / R, s = lo % R, q = r - prefix[lo];
                        if (is_remote(a.c, s) || is_masked(a.c, s)) continue;  // warp-uniform: one row per item
                        const int64_t slot = (int64_t)le * slots + (int64_t)s * a.c.capacity + q;
                        const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) +
                                                                        x_row(a, prefix, lo, le, R, q, slot) *
                                                                            a.x_row_bytes);
                        char* dst = at<char>(a.c.peers[s], a.c.cur.combine_recv) +
                                    ((int64_t)a.c.rank * ret_rows + colprefix[lo] + q) * lf_row;
                        int4 v[kLfWords];
#pragma unroll
                        for (int i = 0; i < kLfWords; ++i) {
                            const int word = lane + 32 * (lw0 + i);
                            v[i] = lw0 + i < lane_words && word < row_words ? ld_nc_na_v4(src + word)
                                                                            : make_int4(0, 0, 0, 0);
                        }
#pragma unroll
                        for (int i = 0; i < kLfWords; ++i) {
                            if (lw0 + i >= lane_words) break;  // warp-uniform
                            const int word = lane + 32 * (lw0 + i);
                            logfmt::encode_word(dst, H, word, v[i], lane,
                                                word < row_words && !(a.c.ablate & kAblateRows));
                        }
                    }
                };
                constexpr int kLfBig = 8;  // words a lane of the wide pieces
                if ((int64_t)prefix[P] * ((lane_words + kLfBig - 1) / kLfBig) >= (int64_t)G * num_warps)
                    encode_rows(Unroll<kLfBig>{});
                else
                    encode_rows(Unroll<1>{});
            } else {
                // A warp per piece of kPiece 16-byte words of a received row (grid-strided):
                // one round of kUnroll words per lane, all loads in flight at once.
                // Pushed: into my range of the owner's combine_recv; pulled: into the same
                // slot of my own combine_send. One piece size, so the call's code stays small:
                // a call fetches its instructions cold (results/ll_trace, "code"), and a second
                // size of 8 KiB pieces measured slower at 1 and 128 tokens.
                constexpr int kUnroll = 8, kPiece = kUnroll * 32;
                const int pieces = (int)((row_int4 + kPiece - 1) / kPiece);
                const int64_t num_pieces = (int64_t)prefix[P] * pieces;
                for (int64_t item = (int64_t)b * num_warps + warp; item < num_pieces; item += (int64_t)G * num_warps) {
                    const int r = (int)(item / pieces), piece = (int)(item % pieces);
                    const int lo = pair_of(r);
                    const int le = lo / R, s = lo % R, q = r - prefix[lo];
                    if (is_remote(a.c, s) || is_masked(a.c, s)) continue;  // remote: whole rows, put below
                    const int64_t slot = (int64_t)le * slots + (int64_t)s * a.c.capacity + q;
                    const int64_t first = (int64_t)piece * kPiece;
                    const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) +
                                                                    x_row(a, prefix, lo, le, R, q, slot) *
                                                                        a.x_row_bytes) + first;
                    int4* dst = (a.pull ? local_send + slot * row_int4
                                        : at<int4>(a.c.peers[s], a.c.cur.combine_recv) +
                                              ((int64_t)a.c.rank * ret_rows + colprefix[lo] + q) * row_int4) + first;
                    if (!(a.c.ablate & kAblateRows))
                        warp_copy<kUnroll, true>(dst, src, min((int64_t)kPiece, row_int4 - first), lane,
                                                 [](const int4* p) { return ld_nc_na_v4(p); },
                                                 [](int4* p, const int4& v) { st_na_v4(p, v); });
                }
            }
#ifdef CUPYEP_LL_NVSHMEM
            // Rows for owners on other nodes: a warp per row, staged in the same slot of my own
            // combine_send (unless x is that buffer already), then put with a signal that counts it.
            for (int64_t r = (int64_t)b * num_warps + warp; r < prefix[P]; r += (int64_t)G * num_warps) {
                const int lo = pair_of(r);
                const int le = lo / R, s = lo % R, q = (int)(r - prefix[lo]);
                if (!is_remote(a.c, s) || is_masked(a.c, s)) continue;
                const int64_t slot = (int64_t)le * slots + (int64_t)s * a.c.capacity + q;
                int4* stage = local_send + slot * row_int4;
                const int4* src = reinterpret_cast<const int4*>(reinterpret_cast<const char*>(a.x) +
                                                                x_row(a, prefix, lo, le, R, q, slot) * a.x_row_bytes);
                if (src != stage) {
                    warp_copy<8, true>(stage, src, row_int4, lane, [](const int4* p) { return ld_nc_na_v4(p); },
                                       [](int4* p, const int4& v) { st_na_v4(p, v); });
                    __syncwarp();
                    __threadfence();
                }
                nvshmemx_putmem_signal_nbi_warp(
                    at<int4>(mine, a.c.cur.combine_recv) + ((int64_t)a.c.rank * ret_rows + colprefix[lo] + q) * row_int4,
                    stage, row_int4 * 16, signal_word(remote_signal(mine, a.c.cur, R, kSigReturnRows, a.c.rank)), 1,
                    NVSHMEM_SIGNAL_ADD, s);
            }
#endif
            trace_mark(a.c.trace, kMarkSent);
        }
        if (!moves_rows) publish_status();
        arrive(a.c, a.c.cur.combine_flag, moves_rows ? G : 1, &s_poisoned);
        trace_mark(a.c.trace, kMarkFlagged);
    }

    if (a.c.phases & kPhaseRecv) {
        if (b >= a.c.num_waiters) return;  // a sender only
        const int4* recv = at<int4>(mine, a.c.cur.combine_recv);
        const int64_t ret_rows = return_rows(a.c.max_tokens, a.c.max_topk, El, a.c.capacity);
        // A returned row's 16-byte words: H / 8 of BF16, or a LogFMT-10 row's (common/logfmt.cuh).
        const int64_t recv_row_int4 = kLogFMT ? logfmt::row_bytes(H) / 16 : H / 8;
        // Where slot j of token t's row starts (null for an empty slot), and its weight.
        // The three loads are independent (none waits for another's value), and none
        // reads what the peers write, so they may run before the flags are in.
        auto slot_row = [&](int t, int j, float& w) -> const int4* {
            const int64_t tj = (int64_t)t * k + j;
            const int e = (int)__ldg(a.topk_idx + tj);
            const float wt = __ldg(a.topk_weights + tj);
            const int pos = __ldg((a.pull ? a.slot_pos : a.combine_pos) + tj);
            w = 0.f;
            // A slot past its region (an overflow the dispatch reported) was never sent: no row;
            // nor is there one from a masked expert rank (shrink mode).
            if (e < 0 || e >= E || __ldg(a.slot_pos + tj) >= a.c.capacity || is_masked(a.c, e / El)) return nullptr;
            w = wt;
            if (a.pull)
                return at<int4>(a.c.peers[e / El], a.c.cur.combine_send) +
                       (((int64_t)(e % El) * R + a.c.rank) * a.c.capacity + pos) * H / 8;
            return recv + ((int64_t)(e / El) * ret_rows + pos) * recv_row_int4;
        };
        // Partial: token t's partial rows, one per expert rank, handed to lanes 0, 1, ... in rank order
        // (weight 1; null past them). Lane j < k looks slot j up; a slot counts if it is the token's
        // first on its rank, and its rank's place is the number of counted slots on lower ranks.
        // Every lane takes part (shuffles); the result is warp-uniform in t.
        auto partial_row = [&](int t, float& w) -> const int4* {
            int r = -1, p = 0;
            if (lane < k) {
                const int64_t tj = (int64_t)t * k + lane;
                const int e = (int)__ldg(a.topk_idx + tj);
                if (e >= 0 && e < E && __ldg(a.slot_pos + tj) < a.c.capacity && !is_masked(a.c, e / El)) {
                    p = __ldg(a.rank_pos + tj);
                    r = p < ret_rows ? e / El : -1;
                }
            }
            bool first = r >= 0;
            for (int j = 0; j < k; ++j) {
                const int rj = __shfl_sync(0xffffffffu, r, j);
                if (j < lane && rj == r) first = false;
            }
            const unsigned firsts = __ballot_sync(0xffffffffu, first);
            int place = 0;
            for (int j = 0; j < k; ++j) {
                const int rj = __shfl_sync(0xffffffffu, r, j);
                if (((firsts >> j) & 1u) && rj < r) ++place;
            }
            const int4* row = nullptr;
            for (int j = 0; j < k; ++j) {
                const int pj = __shfl_sync(0xffffffffu, place, j), rj = __shfl_sync(0xffffffffu, r, j);
                const int qj = __shfl_sync(0xffffffffu, p, j);
                if (((firsts >> j) & 1u) && pj == lane) row = recv + ((int64_t)rj * ret_rows + qj) * recv_row_int4;
            }
            w = row != nullptr ? 1.f : 0.f;
            return row;
        };
        // Lane `lane`'s row of token t and its weight: slot `lane`'s, or (partial) the lane's partial.
        auto lookup = [&](int t, float& w) -> const int4* {
            if constexpr (kPartial) return partial_row(t, w);
            w = 0.f;
            return lane < k ? slot_row(t, lane, w) : nullptr;
        };
        // Slots whose chunks a warp has in flight: 4 (LogFMT: each slot's two runs of codes
        // and ranges loaded before any is decoded). 8 at 512 threads measured slower, at 1
        // token by the code a cold call fetches and at 128 tokens too (results/ll_trace).
        constexpr int kBatch = 4;
        constexpr int kChunkWords = kChunkElems / 8;  // int4 words of a chunk: lane owns lane and lane + 32
        // Each warp takes a contiguous run of (token, chunk) items, so it looks a
        // token's slots up once: lane j holds slot j's row and weight (slots from 32 on,
        // for a top-k above 32, are looked up per item), handed out by shuffles. The
        // next token's lookup is issued when a token starts, so a warp whose run
        // crosses tokens does not wait for it; the first one is issued before the flags.
        const int64_t num_items = (int64_t)T * num_chunks;
        const int64_t num_workers = (int64_t)a.c.num_waiters * num_warps, worker = (int64_t)b * num_warps + warp;
        const int64_t item_begin = num_items * worker / num_workers, item_end = num_items * (worker + 1) / num_workers;
        int cached_t = item_begin < item_end ? (int)(item_begin / num_chunks) : -1;
        const int4* lane_row = nullptr;
        float lane_w = 0.f;
        if (cached_t >= 0) lane_row = lookup(cached_t, lane_w);
        const int last_t = item_begin < item_end ? (int)((item_end - 1) / num_chunks) : -1;
        const int4* next_row = nullptr;
        float next_w = 0.f;
        if (cached_t >= 0 && cached_t < last_t) next_row = lookup(cached_t + 1, next_w);
        // An expert rank r of another node: its start (as a flag within the node, also with no rows for
        // me), then one row per slot of mine on its experts: that many signals.
        auto remote_rows = [&](int r) {
            if (!wait_peer_geq(a.c, remote_signal(mine, a.c.cur, R, kSigCombineStart, r), (int64_t)1,
                               kWaitRemoteReturn, r))
                return false;
            int64_t n = 0;
            for (int64_t tj = 0; tj < (int64_t)T * k; ++tj) {
                const int e = (int)__ldg(a.topk_idx + tj);  // the rows r returns: those it received
                n += e >= r * El && e < (r + 1) * El && __ldg(a.slot_pos + tj) < a.c.capacity;
            }
            return wait_peer_geq(a.c, remote_signal(mine, a.c.cur, R, kSigReturnRows, r), n, kWaitRemoteReturn, r);
        };
        const int row_words = H / 8;
        if (!wait_peer_flags(a.c, at<int>(mine, a.c.cur.combine_flag), a.c.guard, a.wait_stats, remote_rows)) {
            // Timed out (reported): the warp's rows are zeros, never uninitialised memory.
            for (int64_t item = item_begin; item < item_end; ++item) {
                const int ch = (int)(item % num_chunks), end = min(row_words, (ch + 1) * kChunkWords);
                int4* out = a.out + (item / num_chunks) * row_words;
                for (int w = ch * kChunkWords + lane; w < end; w += 32) out[w] = make_int4(0, 0, 0, 0);
            }
            return;
        }
        if (shrinking(a.c)) {  // shrink mode: look the first slots up again, now that the mask is final
            if (cached_t >= 0) lane_row = lookup(cached_t, lane_w);
            if (cached_t >= 0 && cached_t < last_t) next_row = lookup(cached_t + 1, next_w);
        }
        trace_mark(a.c.trace, kMarkArrived);
        for (int64_t item = item_begin; item < item_end; ++item) {
            const int t = (int)(item / num_chunks), ch = (int)(item % num_chunks);
            if (t != cached_t) {  // warp-uniform: the next token, looked up ahead
                cached_t = t;
                lane_row = next_row, lane_w = next_w;
                next_row = nullptr, next_w = 0.f;
                if (t < last_t) next_row = lookup(t + 1, next_w);
            }
            const int w0 = ch * kChunkWords + lane, w1 = w0 + 32;
            const bool active0 = w0 < row_words, active1 = w1 < row_words;  // every lane stays for the shuffles
            float acc[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[i] = 0.f;
            for (int j0 = 0; j0 < k; j0 += kBatch) {
                int4 v[kBatch][2];
                float w[kBatch];
                logfmt::Codes lf[kLogFMT ? kBatch : 1][2];
                float2 rg[kLogFMT ? kBatch : 1][2];
                bool on[kLogFMT ? kBatch : 1];
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    const int j = j0 + u;
                    const int4* p = nullptr;
                    w[u] = 0.f;
                    if (j < 32) {
                        p = reinterpret_cast<const int4*>(
                            __shfl_sync(0xffffffffu, reinterpret_cast<long long>(lane_row), j));
                        w[u] = __shfl_sync(0xffffffffu, lane_w, j);
                    } else if (j < k) {
                        p = slot_row(t, j, w[u]);
                    }
                    const bool some = j < k && p != nullptr;
                    if constexpr (kLogFMT) {  // the lane's two runs of codes and their ranges (decoded below)
                        const char* row = reinterpret_cast<const char*>(p);
                        on[u] = some;
                        lf[u][0] = some && active0 ? logfmt::load_codes(row, H, w0) : logfmt::Codes{0, 0};
                        lf[u][1] = some && active1 ? logfmt::load_codes(row, H, w1) : logfmt::Codes{0, 0};
                        rg[u][0] = some && active0 ? logfmt::range_of(row, w0) : make_float2(0.f, 0.f);
                        rg[u][1] = some && active1 ? logfmt::range_of(row, w1) : make_float2(0.f, 0.f);
                        continue;
                    }
                    v[u][0] = some && active0 ? ld_na_v4(p + w0) : make_int4(0, 0, 0, 0);
                    v[u][1] = some && active1 ? ld_na_v4(p + w1) : make_int4(0, 0, 0, 0);
                    if (!some) w[u] = 0.f;
                }
                if constexpr (kLogFMT) {
#pragma unroll
                    for (int u = 0; u < kBatch; ++u) {
                        if (!on[u]) continue;
                        float f[8];
                        if (active0) {
                            logfmt::decode8(lf[u][0], rg[u][0].x, rg[u][0].y, f);
#pragma unroll
                            for (int i = 0; i < 8; ++i) acc[i] = fmaf(f[i], w[u], acc[i]);
                        }
                        if (active1) {
                            logfmt::decode8(lf[u][1], rg[u][1].x, rg[u][1].y, f);
#pragma unroll
                            for (int i = 0; i < 8; ++i) acc[8 + i] = fmaf(f[i], w[u], acc[8 + i]);
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < kBatch && !kLogFMT; ++u) {  // (LogFMT: summed as decoded, above)
                    if constexpr (kPartial) {  // weight 1 or an absent lane's zeros: IEEE sums (bf16.cuh)
                        add_bf16x8_ieee(acc, v[u][0]);
                        add_bf16x8_ieee(acc + 8, v[u][1]);
                    } else {
                        fma_bf16x8(acc, v[u][0], w[u]);
                        fma_bf16x8(acc + 8, v[u][1], w[u]);
                    }
                }
            }
            int4* out = a.out + (int64_t)t * row_words;
            if (active0) out[w0] = pack_bf16x8(acc);
            if (active1) out[w1] = pack_bf16x8(acc + 8);
        }
    }
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) combine(CombineArgs a) {
    profiled(a.c, [&] { combine_body<kNumThreads, false>(a); });
}

// The same with the rows in LogFMT-10 (pushed, within a node; the host refuses the rest).
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) combine_logfmt(CombineArgs a) {
    profiled(a.c, [&] { combine_body<kNumThreads, true>(a); });
}

// The same with the expert side's partial reduce (pushed, within a node; the host refuses the rest).
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) combine_partial(CombineArgs a) {
    profiled(a.c, [&] { combine_body<kNumThreads, false, true>(a); });
}

// The partial reduce with its partial rows in LogFMT-10 (pushed, within a node).
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) combine_partial_logfmt(CombineArgs a) {
    profiled(a.c, [&] { combine_body<kNumThreads, true, true>(a); });
}

}  // namespace low_latency
}  // namespace cupyep
