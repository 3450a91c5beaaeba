// Low-latency dispatch: every (token, expert) pair becomes one row written
// straight into the expert owner's receive buffer; no notify pass.
//
// Grid: G blocks, each a complete sender and receiver (send and receive halves
// can also run as separate launches: DispatchArgs::phases).
// Send half, block b:
//   1. clears the next set's flags;
//   2. computes the row position of every (token, slot) of its own tokens
//      (t = b, b + G, ...): the number of earlier tokens of this rank that
//      picked the same expert. For a window of up to 32 * mask_words tokens,
//      every (token, slot) sets its token's bit in a per-expert bitmask in
//      shared memory; positions are popcounts of the bits below the token,
//      plus the earlier windows' totals. Every block does this for all tokens
//      (it needs the counts of earlier tokens), which is cheap at decode sizes,
//      and OR commutes, so the layout is deterministic. At T * k <= 32 warp 0
//      computes the same positions from one load of the ids, with lane matches
//      and no block barrier before the one that hands them to the senders
//      (decode_positions);
//   3. moves its tokens: a warp takes (token, 512-channel chunk) items, loads
//      the BF16 chunk once, casts it to FP8 if asked (8 lanes per 128-channel
//      scale group) and stores it, with its scales, into the message of each
//      of the token's experts (args.cuh message_layout); chunk 0 also writes
//      the message's tag;
//   4. writes the per-expert counts of the destinations it owns (d % G == b)
//      and arrives on every destination's flag (sync.cuh).
// Receive half (blocks b < num_waiters): wait for every source's flag, then
// publish counts and stats, a warp per local expert.
// Shrink mode (CallArgs::mask, sync.cuh): nothing is sent to a masked rank and
// a masked source's counts are zero, so its rows are never read.
#include <cuda_bf16.h>
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "common/scan.cuh"
#include "common/timeout.cuh"
#include "low_latency/args.cuh"
#include "low_latency/sync.cuh"

namespace cupyep {
namespace low_latency {

// Load the BF16 chunk of item `item` of this block's tokens (token t = b + tl * G,
// tl = item / num_chunks; lane: 16 channels); zeros past the items or the hidden size.
// A warp keeps two items in flight: the next one's loads are issued before the
// current one is sent. Batches of four, unrolled, measured slower at 1 token and at
// 128: a call fetches its instructions cold, and four inlined copies of the send
// doubled the kernel's code (results/ll_trace).
__device__ __forceinline__ void load_item(const DispatchArgs& a, int4 (&v)[2], int item, int num_items,
                                          int num_chunks, int b, int G, int lane) {
    const int tl = item / num_chunks, elem0 = (item % num_chunks) * kChunkElems + lane * 16;
    v[0] = v[1] = make_int4(0, 0, 0, 0);
    if (item < num_items && elem0 < a.c.hidden) {
        const int4* src = a.x + ((int64_t)(b + tl * G) * a.c.hidden + elem0) / 8;
        v[0] = ld_nc_na_v4(src);
        v[1] = ld_nc_na_v4(src + 1);
    }
}

// Cast one item (token tl of this block, chunk ch) to FP8 if asked and store it
// to the message of each of the token's experts; lane 0 of chunk 0 also writes
// the message's tag (source token and slot).
__device__ __forceinline__ void send_item(const DispatchArgs& a, const int* own_e, const int* own_pos,
                                          const int* own_rpos, int tl, int ch, int b, int G, int lane,
                                          const int4 (&v)[2]) {
    const int R = a.c.num_ranks, El = a.c.num_experts / R, k = a.c.num_topk, H = a.c.hidden, t = b + tl * G;
    const int elem0 = ch * kChunkElems + lane * 16;
    const bool active = elem0 < H;
    const Message m = message_layout(H, a.fp8, a.ue8m0);
    int4 q = v[0];
    float scale = 0.f;
    if (a.fp8) {
        float f[16];
        const __nv_bfloat162* h0 = reinterpret_cast<const __nv_bfloat162*>(&v[0]);
        const __nv_bfloat162* h1 = reinterpret_cast<const __nv_bfloat162*>(&v[1]);
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 p = __bfloat1622float2(h0[i]), r = __bfloat1622float2(h1[i]);
            f[2 * i] = p.x; f[2 * i + 1] = p.y; f[8 + 2 * i] = r.x; f[8 + 2 * i + 1] = r.y;
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        scale = fp8_scale(amax, a.round_scale);
        const float inv = 1.f / scale;
        q.x = (int)pack_e4m3x4(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv);
        q.y = (int)pack_e4m3x4(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv);
        q.z = (int)pack_e4m3x4(f[8] * inv, f[9] * inv, f[10] * inv, f[11] * inv);
        q.w = (int)pack_e4m3x4(f[12] * inv, f[13] * inv, f[14] * inv, f[15] * inv);
    }
    for (int j = 0; j < k; ++j) {
        const int e = own_e[tl * k + j];
        if (e < 0) continue;
        const int dst = e / El, le = e % El;
        if (own_pos[tl * k + j] >= a.c.capacity) continue;  // past the region: reported, never written
        if (is_masked(a.c, dst)) continue;                    // shrink mode: nothing goes to a masked rank
        const int64_t row = ((int64_t)le * R + a.c.rank) * a.c.capacity + own_pos[tl * k + j];
        // A rank of another node: into my staged message of (t, j), put once the block's are all written.
        char* base = is_remote(a.c, dst)
                         ? at<char>(a.c.peers[a.c.rank], a.c.cur.stage) + ((int64_t)t * k + j) * m.bytes
                         : at<char>(a.c.peers[dst], a.c.cur.recv_x) + row * m.bytes;
        if (active) {
            if (a.fp8) {
                if (!(a.c.ablate & kAblateRows)) st_na_v4(reinterpret_cast<int4*>(base + elem0), q);
                if (lane % 8 == 0 && !(a.c.ablate & kAblateScales)) {
                    if (a.ue8m0) reinterpret_cast<uint8_t*>(base + m.scales)[elem0 / 128] = (uint8_t)ue8m0_byte(scale);
                    else reinterpret_cast<float*>(base + m.scales)[elem0 / 128] = scale;
                }
            } else if (!(a.c.ablate & kAblateRows)) {
                int4* d = reinterpret_cast<int4*>(base + 2 * (int64_t)elem0);
                st_na_v4(d, v[0]);
                st_na_v4(d + 1, v[1]);
            }
        }
        if (ch == 0 && lane == 0 && !(a.c.ablate & kAblateTags)) {
            // Source token; slot in the low byte; with weights, the partial combine's chain (args.cuh):
            // head, p, weight, and the next of the token's rows sent to this rank.
            if (a.topk_weights) {
                bool head = true;
                int next = -1;
                for (int j2 = 0; j2 < k; ++j2) {
                    const int e2 = own_e[tl * k + j2];
                    if (j2 == j || e2 < 0 || e2 / El != dst || own_pos[tl * k + j2] >= a.c.capacity) continue;
                    if (j2 < j) head = false;
                    else if (next < 0) next = (e2 % El) * a.c.capacity + own_pos[tl * k + j2];
                }
                *reinterpret_cast<int4*>(base + m.tag) =
                    make_int4(t, j | (int)head << 8 | own_rpos[tl * k + j] << 16,
                              __float_as_int(__ldg(a.topk_weights + (int64_t)t * k + j)), next);
            } else {
                *reinterpret_cast<int2*>(base + m.tag) = make_int2(t, j);
            }
        }
    }
}

#ifdef CUPYEP_LL_NVSHMEM
// Across nodes: the block's staged messages to ranks of other nodes, a warp per
// (own token, slot), each put with a signal that counts it at the destination.
// Every thread fences its staging writes, then the block barrier: the whole
// block's messages are staged before any warp puts one.
__device__ __forceinline__ void put_remote_messages(const DispatchArgs& a, const int* own_e, const int* own_pos,
                                                    int n_own, int b, int G, int warp, int num_warps) {
    const int R = a.c.num_ranks, El = a.c.num_experts / R, k = a.c.num_topk;
    const Message m = message_layout(a.c.hidden, a.fp8, a.ue8m0);
    void* mine = a.c.peers[a.c.rank];
    __threadfence();
    __syncthreads();
    for (int i = warp; i < n_own * k; i += num_warps) {  // warp-uniform: every lane takes part in the put
        const int e = own_e[i];
        if (e < 0 || !is_remote(a.c, e / El) || own_pos[i] >= a.c.capacity || is_masked(a.c, e / El)) continue;
        const int t = b + (i / k) * G, j = i % k;
        const int64_t row = ((int64_t)(e % El) * R + a.c.rank) * a.c.capacity + own_pos[i];
        nvshmemx_putmem_signal_nbi_warp(at<char>(mine, a.c.cur.recv_x) + row * m.bytes,
                                        at<char>(mine, a.c.cur.stage) + ((int64_t)t * k + j) * m.bytes, m.bytes,
                                        signal_word(remote_signal(mine, a.c.cur, R, kSigRows, a.c.rank)), 1,
                                        NVSHMEM_SIGNAL_ADD, e / El);
    }
}
#endif

// DeepEP's packed layout (the dispatch_packed kernel; cupyep.deep_ep.packing gives
// the definition): after its waits, every waiter's warps take region rows
// (expert le, source r, q-th) of all experts, and copy a received one to row
// prefix + q of its expert, the prefix being the counts of the sources before
// r (summed by the warp); row q = 0 of each (le, r) also writes its range (empty
// ranges after a timed-out wait: `arrived` false). The
// same as cuda_src/deep_ep/pack.cu's kernel, without a launch of its own.
__device__ __forceinline__ void pack_received(const DispatchArgs& a, const int* counts, int b, bool arrived) {
    const int R = a.c.num_ranks, El = a.c.num_experts / R, H = a.c.hidden, C = a.c.capacity;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    const Message m = message_layout(H, a.fp8, a.ue8m0);
    const int64_t row_words = (a.fp8 ? (int64_t)H : 2 * (int64_t)H) / 16;
    const int scale_words = a.fp8 ? (a.ue8m0 ? H / 512 : H / 128) : 0;
    const char* recv = at<char>(a.c.peers[a.c.rank], a.c.cur.recv_x);
    const int64_t items = (int64_t)El * R * C;
    for (int64_t item = (int64_t)b * num_warps + warp; item < items; item += (int64_t)a.c.num_waiters * num_warps) {
        const int le = (int)(item / ((int64_t)R * C)), i = (int)(item % ((int64_t)R * C));
        const int r = i / C, q = i - r * C;
        const int count = !arrived || is_masked(a.c, r) ? 0 : ld_volatile(counts + le * R + r);
        if (q >= count && q != 0) continue;  // warp-uniform
        int prefix = 0;
        for (int j = lane; j < r && arrived; j += 32) prefix += is_masked(a.c, j) ? 0 : ld_volatile(counts + le * R + j);
        prefix = warp_sum(prefix);
        if (q == 0 && lane == 0) a.packed_range[le * R + r] = ((int64_t)prefix << 32) | (int64_t)(uint32_t)count;
        if (q >= count) continue;
        const int64_t p = (int64_t)le * a.packed_rows + prefix + q;
        const char* msg = recv + ((int64_t)(le * R + r) * C + q) * m.bytes;
        const int4* src = reinterpret_cast<const int4*>(msg);
        int4* dst = reinterpret_cast<int4*>(a.packed_x) + p * row_words;
        for (int64_t w = lane; w < row_words; w += 32) dst[w] = ld_na_v4(src + w);
        if (a.packed_scales != nullptr) {
            const uint32_t* sc = reinterpret_cast<const uint32_t*>(msg + m.scales);
            uint32_t* d = a.packed_scales + (int64_t)le * scale_words * a.packed_rows + prefix + q;
            for (int j = lane; j < scale_words; j += 32) d[(int64_t)j * a.packed_rows] = sc[j];
        }
        if (lane == 0) a.packed_src[p] = *reinterpret_cast<const int*>(msg + m.tag);
    }
}

// Positions at decode sizes (T * k <= 32), by warp 0 of each block, with no block
// barrier: lane t * k + j holds (token t, slot j)'s expert `e` (lanes of earlier
// tokens come first), so (t, j)'s row for its expert is the number of lanes below
// it with the same expert (a token names each expert once), and its token's row
// among mine to the expert's rank the number of earlier tokens with a lane on
// that rank. The same results as the windowed scan of dispatch_body, which
// cupyep.reference defines. Writes this block's combine_pos, slot_pos, rank_pos
// and own_e / own_pos / own_rpos, and total[e] for every expert.
__device__ __forceinline__ void decode_positions(const DispatchArgs& a, int e, int* total, int* own_e, int* own_pos,
                                                 int* own_rpos, bool ranked, int b, int G, int lane) {
    const int R = a.c.num_ranks, E = a.c.num_experts, El = E / R, k = a.c.num_topk, n = a.c.num_tokens * k;
    if (lane >= n) e = -1;
    if (e >= E || e < -1) {
        report_error(a.c.guard, kErrorBadInput, kBadExpertId, -1, e, E);
        e = -1;
    }
    const bool valid = e >= 0;
    const int t = lane / k, j = lane % k, d = valid ? e / El : -1;
    // Lanes without an expert get keys of their own, so they match nothing.
    const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
    const unsigned same_rank = __match_any_sync(0xffffffffu, valid ? d : -1 - lane);
    const int pos = __popc(same & ((1u << lane) - 1u));
    int seg = 0;  // rows to rank d for experts before e
    for (int l = 0; l < n; ++l) {
        const int el = __shfl_sync(0xffffffffu, e, l);
        seg += ((same_rank >> l) & 1u) && el < e;
    }
    int rpos = 0;  // earlier tokens with an expert on rank d
    if (ranked)
        for (int t2 = 0; t2 < t; ++t2) rpos += ((same_rank >> (t2 * k)) & ((1u << k) - 1u)) != 0u;
    for (int i = lane; i < E; i += 32) total[i] = 0;
    __syncwarp();
    if (valid && pos == 0) total[e] = __popc(same);
    // A region holds `capacity` rows: an expert past it is reported (block 0, its first row).
    if (b == 0 && valid && pos == 0 && __popc(same) > a.c.capacity)
        report_error(a.c.guard, kErrorCapacity, kRegionCapacity, -1, __popc(same), a.c.capacity);
    if (lane < n && t % G == b) {
        a.combine_pos[lane] = valid ? seg + pos : -1;
        a.slot_pos[lane] = valid ? pos : -1;
        if (ranked) a.rank_pos[lane] = valid ? rpos : -1;
        const int own = (t / G) * k + j;
        own_e[own] = e;
        own_pos[own] = pos;
        if (ranked) own_rpos[own] = rpos;
    }
}

template <bool kPacked>
__device__ __forceinline__ void dispatch_body(const DispatchArgs& a) {
    extern __shared__ int smem[];
    const int R = a.c.num_ranks, E = a.c.num_experts, El = E / R, T = a.c.num_tokens, k = a.c.num_topk, H = a.c.hidden;
    const int G = gridDim.x, b = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    void* mine = a.c.peers[a.c.rank];

    if (a.c.phases & kPhaseSend) {
        trace_mark(a.c.trace, kMarkStart);
        const int W = a.mask_words;               // 32-token mask words per expert per window
        // This thread's first expert ids are loaded first, then the first item of
        // this warp's rows, so the rows' latency hides behind the position scan
        // and the ids do not queue behind the rows.
        constexpr int kIdsAhead = 4;
        int ids_ahead[kIdsAhead];
#pragma unroll
        for (int u = 0; u < kIdsAhead; ++u) {
            const int i = threadIdx.x + u * blockDim.x;  // (t, j) = (i / k, i % k) of the first window
            ids_ahead[u] = i < min(T, 32 * W) * k ? (int)__ldg(a.topk_idx + i) : -1;
        }
        const int num_chunks = (H + kChunkElems - 1) / kChunkElems;
        const int n_own = b < T ? (T - b + G - 1) / G : 0;
        const int num_items = n_own * num_chunks;
        int4 v[2];
        load_item(a, v, warp, num_items, num_chunks, b, G, lane);
        clear_next_flags(mine, a.c.next, R);
        const int Tb = (T + G - 1) / G;           // own tokens, at most
        // With weights (for the partial combine), the masks and totals have a row per rank
        // after the experts' (row E + d: the tokens with an expert on rank d).
        const bool ranked = a.topk_weights != nullptr;
        const int Er = E + (ranked ? R : 0);
        int* total = smem;                        // [Er] rows to e, tokens to rank d (after the windows so far)
        int* seg = total + Er;                    // [E] rows to e's rank for experts before e
        int* own_e = seg + E;                     // [Tb][k] global expert, -1 for none
        int* own_pos = own_e + Tb * k;            // [Tb][k] row within (expert, this source)
        int* own_rpos = own_pos + Tb * k;         // [Tb][k] (ranked only) the token's row among mine to that rank
        unsigned* mask = reinterpret_cast<unsigned*>(own_rpos + (ranked ? Tb * k : 0));  // [Er][W] per window
        if (T * k <= 32) {  // decode sizes: warp 0 of each block, one barrier
            if (warp == 0) decode_positions(a, ids_ahead[0], total, own_e, own_pos, own_rpos, ranked, b, G, lane);
            __syncthreads();
        } else {
            for (int e = threadIdx.x; e < Er; e += blockDim.x) total[e] = 0;
            // Token windows of 32 * W: each (token, slot) sets its token's bit in its expert's
            // mask (OR commutes, so the result does not depend on the order); a token's row
            // for expert e is then the count of e's tokens before it: popcounts of the bits
            // below it plus the earlier windows' total. The same over ranks gives a token's
            // row among this rank's tokens to rank d.
            for (int t0 = 0; t0 < T; t0 += 32 * W) {
                const int nt = min(T - t0, 32 * W);
                for (int i = threadIdx.x; i < Er * W; i += blockDim.x) mask[i] = 0u;
                __syncthreads();
                for (int u = 0, i = threadIdx.x; i < nt * k; ++u, i += blockDim.x) {
                    const int t = t0 + i / k, j = i % k;
                    int e = -1;
                    if (t0 == 0 && u < kIdsAhead) {
    #pragma unroll
                        for (int q = 0; q < kIdsAhead; ++q)
                            if (q == u) e = ids_ahead[q];
                    } else {
                        e = (int)__ldg(a.topk_idx + (int64_t)t * k + j);
                    }
                    if (e >= E || e < -1) {
                        report_error(a.c.guard, kErrorBadInput, kBadExpertId, -1, e, E);
                        e = -1;
                    }
                    if (e >= 0) atomicOr(mask + e * W + (t - t0) / 32, 1u << ((t - t0) % 32));
                    if (e >= 0 && ranked) atomicOr(mask + (E + e / El) * W + (t - t0) / 32, 1u << ((t - t0) % 32));
                    if (t % G == b) own_e[(t / G) * k + j] = e;
                }
                __syncthreads();
                for (int i = threadIdx.x; i < n_own * k; i += blockDim.x) {
                    const int tw = b + (i / k) * G - t0;
                    if (tw < 0 || tw >= nt) continue;
                    const int e = own_e[i];
                    if (e < 0) continue;
                    const unsigned* me_mask = mask + e * W;
                    int c = total[e];
                    for (int w = 0; w < tw / 32; ++w) c += __popc(me_mask[w]);
                    own_pos[i] = c + __popc(me_mask[tw / 32] & ((1u << (tw % 32)) - 1u));
                    if (ranked) {
                        const unsigned* rk_mask = mask + (E + e / El) * W;
                        int cr = total[E + e / El];
                        for (int w = 0; w < tw / 32; ++w) cr += __popc(rk_mask[w]);
                        own_rpos[i] = cr + __popc(rk_mask[tw / 32] & ((1u << (tw % 32)) - 1u));
                    }
                }
                __syncthreads();
                for (int e = threadIdx.x; e < Er; e += blockDim.x) {
                    int c = 0;
                    for (int w = 0; w < W; ++w) c += __popc(mask[e * W + w]);
                    total[e] += c;
                }
                __syncthreads();
            }
            // A region holds `capacity` rows: an expert past it is reported (never silently cut);
            // its rows past the region are not written, and the receiver counts at most `capacity`.
            if (b == 0)
                for (int e = threadIdx.x; e < E; e += blockDim.x)
                    if (total[e] > a.c.capacity) report_error(a.c.guard, kErrorCapacity, kRegionCapacity, -1, total[e],
                                                              a.c.capacity);
            for (int d = warp; d < R; d += num_warps)  // a warp per destination rank
                warp_exclusive_scan(El, lane, [&](int le) { return total[d * El + le]; },
                                    [&](int le, int v) { seg[d * El + le] = v; });
            __syncthreads();
            // Final positions; (t, j)'s row in the range its expert rank returns to me
            // in the combine: my rows to that rank in (expert, position) order.
            for (int i = threadIdx.x; i < n_own * k; i += blockDim.x) {
                const int e = own_e[i];
                const int64_t tj = (int64_t)(b + (i / k) * G) * k + i % k;
                a.combine_pos[tj] = e >= 0 ? seg[e] + own_pos[i] : -1;
                a.slot_pos[tj] = e >= 0 ? own_pos[i] : -1;
                if (ranked) a.rank_pos[tj] = e >= 0 ? own_rpos[i] : -1;
            }
            __syncthreads();
        }
        trace_mark(a.c.trace, kMarkPrep);

        // Rows: a warp per (token, chunk of 512 channels) item; lane owns 16 channels.
        for (int item = warp; item < num_items; item += num_warps) {
            int4 next[2];  // the warp's next item, loaded before this one is sent
            load_item(a, next, item + num_warps, num_items, num_chunks, b, G, lane);
            send_item(a, own_e, own_pos, own_rpos, item / num_chunks, item % num_chunks, b, G, lane, v);
            v[0] = next[0];
            v[1] = next[1];
        }

#ifdef CUPYEP_LL_NVSHMEM
        put_remote_messages(a, own_e, own_pos, n_own, b, G, warp, num_warps);
#endif
        trace_mark(a.c.trace, kMarkSent);
        for (int dst = b; dst < R; dst += G) {
            if (is_remote(a.c, dst) || is_masked(a.c, dst)) continue;
            int* counts = at<int>(a.c.peers[dst], a.c.cur.dispatch_count);
            for (int le = threadIdx.x; le < El; le += blockDim.x)
                counts[le * R + a.c.rank] = min(total[dst * El + le], a.c.capacity);
        }
#ifdef CUPYEP_LL_NVSHMEM
        // Block 0 (which cleared the next set's signals first) sends every remote destination its counts:
        // a thread per destination puts them, fences, then signals, so they land before the signal.
        if (b == 0)
            for (int dst = threadIdx.x; dst < R; dst += blockDim.x) {
                if (!is_remote(a.c, dst) || is_masked(a.c, dst)) continue;
                int* counts = at<int>(mine, a.c.cur.dispatch_count);
                for (int le = 0; le < El; ++le)
                    nvshmem_int_p(counts + le * R + a.c.rank, min(total[dst * El + le], a.c.capacity), dst);
                nvshmem_fence();
                nvshmemx_signal_op(signal_word(remote_signal(mine, a.c.cur, R, kSigCounts, a.c.rank)), 1,
                                   NVSHMEM_SIGNAL_ADD, dst);
            }
#endif
        arrive(a.c, a.c.cur.dispatch_flag, G);
        trace_mark(a.c.trace, kMarkFlagged);
    }

    if (a.c.phases & kPhaseRecv) {
        if (b >= a.c.num_waiters) return;  // a sender only
        // After a timeout (reported) the block still publishes its counts, as zeros: a combine of
        // this handle then moves no rows, never rows counted by uninitialised or stale memory.
        const bool arrived = wait_peer_flags(a.c, at<int>(mine, a.c.cur.dispatch_flag), a.c.guard, a.wait_stats,
                                             [&](int r) { return wait_remote_dispatch(a.c, r, a.c.guard); });
        trace_mark(a.c.trace, kMarkArrived);
        if (threadIdx.x == 0) a.status[b] = !arrived;
        const int* counts = at<int>(mine, a.c.cur.dispatch_count);
        // A warp per local expert (spread over the waiters first), a lane per source: no block
        // barriers, so a few waiters still publish many experts' counts quickly (a block per
        // expert, with two barriers each, made a one-token call at 8 ranks 1.1-6.8 us slower
        // with 8 to 2 waiters, results/ll_trace). The source loop stays rolled: one pass up to 32 ranks.
        const int num_workers = a.c.num_waiters * num_warps;
        for (int le = warp * a.c.num_waiters + b; le < El; le += num_workers) {
            int sum = 0;
#pragma unroll 1
            for (int r = lane; r < R; r += 32) {
                const int c = !arrived || is_masked(a.c, r) ? 0 : ld_volatile(counts + le * R + r);  // masked: none
                a.layout_count[le * R + r] = c;
                sum += c;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                a.recv_count[le] = sum;
                if (a.cumulative_stats) a.cumulative_stats[le] += sum;
            }
        }
        if constexpr (kPacked) pack_received(a, counts, b, arrived);
    }
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) dispatch(DispatchArgs a) {
    profiled(a.c, [&] { dispatch_body<false>(a); });
}

// The same, the receive half also filling DeepEP's packed layout (DispatchArgs::packed_x): a kernel of its
// own, so that the plain dispatch keeps its registers.
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) dispatch_packed(DispatchArgs a) {
    profiled(a.c, [&] { dispatch_body<true>(a); });
}

}  // namespace low_latency
}  // namespace cupyep
