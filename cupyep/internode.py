"""Normal-mode dispatch across nodes, two hops, on the device.

``TwoHopDispatch(group, max_tokens, hidden, num_topk, num_experts)`` moves
one call's rows as the hierarchical mode does (cuda_src/internode/two_hop.cu):
a token crosses to another node once, over NVSHMEM put-with-signal, to its
rail peer, which forwards it over the node's IPC peer pointers to every
destination rank there; tokens for the own node go straight over IPC. Every
rank receives exactly what the dispatch within a node gives (one row per
(token, rank), by source rank then source token), so the oracle is
``cupyep.reference.intranode_dispatch``. With ``route="direct"`` there is
no node dedup and no forwarding: each row for a rank of another node is put
straight into its final row there (the receive pools on the NVSHMEM heap),
and the combine returns each row to its owner, which sums over the ranks.

Each call runs three kernels on the current stream: the notify pass across
nodes (the layout, the count exchange over put with signal, the plan and the
cumulative targets, all on the device; it is also the barrier between calls),
the dispatch, and, for ``combine``, the combine. The host reads back only
how many rows it received from each source (mapped memory), to shape the
outputs.

Shapes: x [T, H] uint16 (BF16 bits), or uint8 (FP8 e4m3) with x_scales
[T, H / 128] float32; topk_idx [T, k] int64, topk_weights [T, k] float32;
T <= max_tokens, the same k on every rank. The combine takes BF16 rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import jit
from .barrier import GUARD_DTYPE

THREADS = 512
NOTIFY_THREADS = 1024
MAX_RANKS_PER_NODE = 32  # two_hop_combine: a network row's destinations in its node, one bit each
INT32_MAX = 2**31 - 1
u64, i64, i32 = np.uint64, np.int64, np.int32
NOTIFY_ARGS_DTYPE = jit.struct_dtype([
    ("topk_idx", u64), ("in_rank", u64), ("send_head", u64), ("rdma_slot", u64), ("rank_prefix", u64),
    ("net_count", u64), ("node_tokens", u64), ("send_node", u64), ("row", u64), ("matrix", u64),
    ("row_signal", u64), ("state", u64), ("host", u64),
    ("capacity", i32), ("delta", u64), ("cached", i32), ("kernel_time", u64), ("num_tokens", i32), ("num_topk", i32),
    ("num_experts", i32), ("num_ranks", i32), ("ranks_per_node", i32), ("rank", i32), ("guard", GUARD_DTYPE)])
ARGS_DTYPE = jit.struct_dtype([
    ("x", u64), ("x_scales", u64), ("topk_idx", u64), ("topk_weights", u64), ("rdma_slot", u64),
    ("send_head", u64), ("rank_prefix", u64), ("node_tokens", u64), ("send_node", u64), ("staging", u64),
    ("net_rows", u64), ("net_signal", u64),
    ("net_target", u64), ("net_count", u64), ("pools", u64), ("out_x", i64), ("out_idx", i64), ("out_w", i64),
    ("out_src", i64), ("out_slot", i64), ("arrived", u64), ("arrived_target", u64), ("row_stride", i64),
    ("out_scales", i64), ("notify_ok", u64), ("capacity", i64), ("rdma_chunk", i32), ("nvlink_chunk", i32),
    ("direct", i32), ("heap_pool", u64), ("direct_signal", u64), ("direct_stage", u64), ("hop_ns", u64),
    ("kernel_time", u64), ("num_tokens", i32),
    ("num_topk", i32), ("x_int4", i32), ("num_scales", i32), ("num_ranks", i32), ("ranks_per_node", i32),
    ("num_local_experts", i32), ("rank", i32), ("guard", GUARD_DTYPE)])
COMBINE_ARGS_DTYPE = jit.struct_dtype([
    ("y", u64), ("recv_src_rank", u64), ("recv_src_idx", u64), ("recv_slot", u64), ("pools", u64),
    ("direct_in", i64), ("gather", i64), ("counters", u64), ("targets", u64), ("net_rows", u64),
    ("row_stride", i64), ("meta_offset", i64), ("net_count", u64), ("staging", u64), ("net_in", u64),
    ("net_signal", u64), ("net_target", u64), ("send_head", u64), ("direct", i32), ("rank_in", u64),
    ("rank_signal", u64), ("rank_target", u64), ("rank_stage", u64), ("out", u64), ("notify_ok", u64),
    ("hop_ns", u64), ("kernel_time", u64), ("num_recv", i32), ("num_tokens", i32), ("max_tokens", i32), ("x_int4", i32),
    ("num_topk", i32), ("num_ranks", i32), ("ranks_per_node", i32), ("rank", i32), ("guard", GUARD_DTYPE)])


# The hop metric (TwoHop*Args::hop_ns): the stamps to start a call from, and
# the hops each kernel's four stamps delimit ((name, first stamp, last stamp)).
HOP_STAMPS_INIT = (2**64 - 1, 0, 0, 0)
DISPATCH_HOPS = (("network", 0, 1), ("forward", 1, 2), ("total", 0, 3))
COMBINE_HOPS = (("node", 0, 1), ("network", 1, 2), ("reduce", 2, 3), ("total", 0, 3))


def hop_times_us(stamps, hops) -> dict:
    """{hop: microseconds} from one call's four %globaltimer stamps (host
    ints) and DISPATCH_HOPS or COMBINE_HOPS; None for a hop whose stamps
    were not both written."""
    st = [int(v) for v in stamps]
    if len(st) != 4:
        raise ValueError(f"a call has four hop stamps, got {len(st)}")
    unset = (HOP_STAMPS_INIT[0], 0)
    return {name: ((st[b] - st[a]) / 1e3 if st[a] not in unset and st[b] not in unset else None)
            for name, a, b in hops}


def _check_stamps(arr, name: str, dtype, n: int):
    """A stamps argument: None, or a cupy ``dtype`` [n] array (ValueError otherwise)."""
    if arr is None:
        return None
    from .arrays import as_cupy, check
    return check(as_cupy(arr, name), name, dtype, shape=(n,))


def _check_hop(hop_ns):
    return _check_stamps(hop_ns, "hop_ns", np.uint64, 4)


def _check_kernel_ns(arr, name: str):
    """Kernel stamps (cupyep.bench.stamps.new_kernel_stamps, a row): int64 [2]."""
    return _check_stamps(arr, name, np.int64, 2)


def _signals(core, n: int):
    """n NVSHMEM signal words on the symmetric heap (uint64), zeroed."""
    sig = core.array((n,), dtype="uint64")
    sig[...] = 0
    return sig


def spec(num_threads: int = THREADS) -> jit.KernelSpec:
    """The two-hop notify, dispatch and combine (one module: they share the NVSHMEM registration)."""
    return jit.KernelSpec(name=f"internode_two_hop_threads_{num_threads}", source="internode/two_hop.cu",
                          kernels=(f"cupyep::internode::two_hop_dispatch<{num_threads}, false>",
                                   f"cupyep::internode::two_hop_combine<{num_threads}, false>",
                                   f"cupyep::internode::two_hop_notify<{NOTIFY_THREADS}>",
                                   f"cupyep::internode::two_hop_combine<{num_threads}, true>",
                                   f"cupyep::internode::two_hop_dispatch<{num_threads}, true>"), nvshmem=True)


def state_words(num_ranks: int, ranks_per_node: int) -> int:
    """int64 words of the notify's private state (two_hop_state_words in two_hop.cu)."""
    n = num_ranks // ranks_per_node
    return 2 + n + num_ranks + 1 + ranks_per_node + n + num_ranks


def state_slices(num_ranks: int, ranks_per_node: int) -> dict:
    """Where each part of the state lies: {"calls", "ok", "net_total",
    "arrived_total", "combine_total", "combine_net_total",
    "combine_rank_total"} -> slice."""
    R, N = num_ranks, num_ranks // ranks_per_node
    out, off = {"calls": slice(0, 1), "ok": slice(1, 2)}, 2
    for name, n in (("net_total", N), ("arrived_total", R), ("combine_total", 1 + ranks_per_node),
                    ("combine_net_total", N),
                    ("combine_rank_total", R)):
        out[name] = slice(off, off + n)
        off += n
    return out


COMBINE_TARGETS = ("combine_total", "combine_net_total", "combine_rank_total")  # the state's combine part, in order


def kernel_specs() -> list[jit.KernelSpec]:
    return [spec()]


def notify_smem(num_ranks: int, num_nodes: int) -> int:
    """Dynamic shared memory of the notify (two_hop_notify): my counts per rank
    and node and the slot bases (int64), then each warp's positions per column
    (int32 [NOTIFY_THREADS / 32][R + N])."""
    return 8 * (num_ranks + 2 * num_nodes) + 4 * (NOTIFY_THREADS // 32) * (num_ranks + num_nodes)


DEFAULT_DYNAMIC_SMEM = 48 * 1024  # a kernel's dynamic shared memory without the opt-in attribute


def check_notify_smem(num_ranks: int, num_nodes: int, optin_limit: int) -> int:
    """The notify's dynamic shared memory (:func:`notify_smem`), or ValueError
    when it exceeds ``optin_limit``, the device's opt-in maximum per block
    (MaxSharedMemoryPerBlockOptin): a world too large for one notify block."""
    smem = notify_smem(num_ranks, num_nodes)
    if smem > optin_limit:
        raise ValueError(f"the two-hop notify needs {smem} bytes of shared memory for {num_ranks} ranks in "
                         f"{num_nodes} nodes; this GPU gives a block at most {optin_limit}")
    return smem


ROUTES = ("two_hop", "direct")


def direct_row_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of a staged row of the direct route (DirectRow in two_hop.cu: the
    payload, the scales, k int64 ids, k float32 weights, the source index and
    the slot, each part at a 16-byte boundary), the larger of BF16 and FP8."""
    a16 = lambda n: -(-n // 16) * 16  # noqa: E731
    rest = a16(8 * num_topk) + a16(4 * num_topk) + 32
    return max(a16(2 * hidden) + rest, a16(hidden + 4 * (hidden // 128)) + rest)


def check_route(route) -> str:
    """A route of TwoHopDispatch (one of ROUTES); ValueError otherwise."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    return route


def check_chunk(name: str, value) -> int:
    """A chunk knob of the two-hop dispatch: an int >= 1; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def row_stride(hidden: int, num_topk: int, ranks_per_node: int, fp8: bool = False) -> int:
    """Bytes of a network row: the payload (BF16: 2 H bytes; FP8: H), then
    the source token, the k top-k ids, the k weights (each in an int64-sized
    word), the positions for the node's K ranks, and for FP8 the H / 128
    float32 scales, rounded up to 16 bytes. A BF16 row is the longer."""
    payload = hidden if fp8 else hidden * 2
    n = payload + 8 * (1 + 2 * num_topk + ranks_per_node) + (4 * (hidden // 128) if fp8 else 0)
    return -(-n // 16) * 16


@dataclass
class TwoHopHandle:
    """A counted call's plan, for cached calls (``dispatch(x, handle=h,
    topk_weights=w)``): the routing (topk_idx [T, k] int64), the plan arrays
    the notify made (send_head, network slots, rank_prefix_matrix, rows per
    source node), the steps of the cumulative targets (``delta``), the rows
    received (``num_rows``: the count, or num_worst_tokens) and each row's
    source rank. All cupy; owned by the TwoHopDispatch that made it."""
    owner: int
    topk_idx: object
    plan: dict
    delta: object
    num_rows: int
    num_worst_tokens: int
    src_rank: object
    recv_expert_counts: tuple | None = None  # unaligned per-local-expert pair counts (cupyep.Buffer sets them)


@dataclass
class TwoHopResult:
    """What this rank received, all cupy: recv_x [N, H] uint16 (FP8: uint8,
    with recv_x_scales [N, H / 128] float32; None for BF16), recv_topk_idx
    [N, k] int64 (local ids, -1 elsewhere), recv_topk_weights [N, k] float32
    (0 there), recv_src_idx [N] int32, recv_src_rank [N] int32,
    rank_prefix_matrix [R, R] int64. N: the rows received, or
    num_worst_tokens in worst-token mode (padding rows past the count: -1
    ids, sources and ranks, 0 weights). The row arrays are views of the
    receive pool, valid until the next call. ``handle``: for cached calls
    of the same routing."""
    recv_x: object
    recv_topk_idx: object
    recv_topk_weights: object
    recv_src_idx: object
    recv_src_rank: object
    rank_prefix_matrix: object
    handle: TwoHopHandle = None
    recv_x_scales: object = None


class TwoHopDispatch:
    """The two-hop dispatch and its combine (``combine(y)`` reduces the last
    dispatch's rows, once; call it before the next dispatch, or not at all). Collective over every
    rank (nodes from the group: real or emulated with ``--ranks-per-node``).
    Every call runs on the current stream, the same one for all calls: the
    next call's notify pass is the barrier that keeps peers from writing the
    pools this call's outputs live in. Worst-token calls (num_worst_tokens)
    read nothing back on the host, so a CUDA graph can capture a dispatch and
    its combine; the arrays such a graph uses live as long as this object.
    Needs NVSHMEM (cupyep.nvshmem), which it initialises. After a device
    error (a timeout) its state is undefined: later calls raise until it is
    destroyed."""

    def __init__(self, group, max_tokens: int, hidden: int, num_topk: int, num_experts: int, num_sms: int = 0,
                 rdma_chunk: int = 1, nvlink_chunk: int = 1, route: str = "two_hop"):
        """Collective. ``num_sms``: blocks per rank of the dispatch and the
        combine (0: the rank's share of the GPU's SMs); every rank's blocks
        must fit on the GPU at once, or ValueError names the most that do.
        The dispatch's knobs (attributes of the same names, settable between
        calls, alike on every rank): ``rdma_chunk``, how many of a rank's
        rows for one node a warp stages and sends with one put (consecutive
        network rows, one signal); ``nvlink_chunk``, how many consecutive
        network rows a warp of the rail peer forwards.

        ``route``: "two_hop" (the default: one network row per (token, node)
        to the rail peer, which forwards it in its node; the combine reduces
        in the node first) or "direct" (no node dedup: every row to a rank
        of another node is put straight into its final row there, the
        receive pools on the NVSHMEM heap, and the combine sends each row
        back to its owner, which sums over the ranks in rank order in FP32).
        The outputs are the same; the chunk knobs apply to "two_hop"."""
        import cupy

        from . import nvshmem as NV
        from .ipc import SymmetricBuffer
        if group.num_nodes < 2:
            raise ValueError("the two-hop dispatch needs ranks on at least two nodes (or --ranks-per-node)")
        if group.local_size > MAX_RANKS_PER_NODE:
            raise ValueError(f"the two-hop kernels take at most {MAX_RANKS_PER_NODE} ranks per node (a rail peer "
                             f"keeps the ranks of its node a network row goes to in one 32-bit mask), got "
                             f"{group.local_size}")
        if hidden % 128 or hidden <= 0:
            raise ValueError(f"hidden must be a positive multiple of 128, got {hidden}")
        self.group, self.R, self.K = group, group.world_size, group.local_size
        self.N, self.me = self.R // self.K, group.rank
        if num_experts % self.R:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the {self.R} ranks")
        if not (isinstance(num_sms, (int, np.integer)) and num_sms >= 0):
            raise ValueError(f"num_sms must be an integer >= 0 (0: the rank's share of the SMs), got {num_sms!r}")
        rt, device = cupy.cuda.runtime, cupy.cuda.Device()
        device_sms = device.attributes["MultiProcessorCount"]
        self._notify_smem = check_notify_smem(
            self.R, self.N, rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device.id))
        self.num_sms = int(num_sms) or max(1, device_sms // max(1, group.ranks_per_gpu))
        self.max_tokens, self.hidden, self.k, self.E = int(max_tokens), int(hidden), int(num_topk), int(num_experts)
        self.rdma_chunk, self.nvlink_chunk = check_chunk("rdma_chunk", rdma_chunk), check_chunk("nvlink_chunk",
                                                                                                nvlink_chunk)
        self.route = check_route(route)
        self.direct = self.route == "direct"
        NV.init(group)
        import nvshmem.core as core
        self._core = core
        fns = jit.load(spec())  # built, loaded and registered with NVSHMEM (after its init)
        self.fn = fns[spec().kernels[4 if self.direct else 0]]
        self.combine_fn = fns[spec().kernels[1]]
        self.notify_fn = fns[spec().kernels[2]]
        self.combine_weights_fn = fns[spec().kernels[3]]  # the float32 rows of the top-k weights
        if self._notify_smem > DEFAULT_DYNAMIC_SMEM:  # large worlds: the opt-in, checked against the device above
            self.notify_fn.max_dynamic_shared_size_bytes = self._notify_smem
        try:  # before anything is allocated: the same verdict on every rank
            for fn, what in ((self.fn, "two-hop dispatch"), (self.combine_fn, "two-hop combine"),
                             (self.combine_weights_fn, "two-hop combine of the top-k weights")):
                jit.require_resident(what, jit.max_resident_blocks(fn, THREADS), self.num_sms, THREADS,
                                     group.ranks_per_gpu, device_sms, "num_sms")
        except ValueError:
            NV.finalize()
            raise
        self.stride = row_stride(hidden, num_topk, self.K)
        cap_net = max(1, (self.N - 1) * self.max_tokens)
        cap = self.R * self.max_tokens  # the most rows a rank can receive
        W = self.R + self.N + 1  # TwoHopNotifyArgs::row: counts per rank, per node, then the capacity
        row = hidden * 2
        wrow = -(-num_topk // 4) * 16  # k float32, whole int4 words
        # Every array this object takes from the NVSHMEM heap (bytes; the signal words aside), checked
        # against the GPU's free memory before the first is allocated.
        heap = {"net_rows": cap_net * self.stride, "row": 8 * W, "matrix": 8 * 2 * self.R * W,
                "cnet_in": self.N * self.max_tokens * row, "wnet_in": self.N * self.max_tokens * wrow}
        if self.direct:
            heap.update(direct_stage=self.max_tokens * self.R * direct_row_bytes(hidden, num_topk),
                        **{f"{name}_{part}": (self.max_tokens * self.R if part == "in" else cap) * nbytes
                           for name, nbytes in (("rows", row), ("weights", wrow)) for part in ("in", "stage")})
        try:
            NV.reserve_heap(group, sum(heap.values()), "TwoHopDispatch")
        except MemoryError:
            NV.finalize()
            raise
        self.net_rows = core.array((heap["net_rows"],), dtype="uint8")
        self.net_signal = _signals(core, self.N)
        self._lay = {}
        off = 0
        for name, nbytes in (("x", cap * hidden * 2), ("idx", cap * num_topk * 8), ("w", cap * num_topk * 4),
                             ("src", cap * 4), ("slot", cap * 8), ("scales", cap * (hidden // 128) * 4)):
            self._lay[name] = off
            off += -(-nbytes // 256) * 256
        if self.direct:  # rows from other nodes are put straight into it: the pool is on the NVSHMEM heap
            from .nvshmem import HeapBuffer
            self.pool = HeapBuffer(group, off)
            node = self.me // self.K
            self.pool_ptrs = cupy.asarray(np.asarray(self.pool.peer_ptr_list[node * self.K:(node + 1) * self.K],
                                                     dtype=u64))
            self.direct_signal = _signals(core, self.R)
            self.direct_stage = core.array((heap["direct_stage"],), dtype="uint8")
        else:
            self.pool = SymmetricBuffer(group, off)
            self.pool_ptrs = self.pool.peer_ptrs
        self.sync = SymmetricBuffer(group, -(-self.R * 8 // 256) * 256)
        self.arrived_ptrs = cupy.asarray(np.asarray([self.sync.peer_ptr_list[j] for j in range(self.K)], dtype=u64))
        # The notify pass: my row of counts, every PE's rows (two matrices, by call parity), their signals,
        # the private cumulative state, and the mapped host ints it reports to.
        self.row = core.array((W,), dtype="int64")
        self.matrix = core.array((2 * self.R * W,), dtype="int64")
        self.row_signal = _signals(core, self.R)
        self.state = cupy.zeros(state_words(self.R, self.K), dtype=np.int64)
        self._state = {name: self.state[sl] for name, sl in state_slices(self.R, self.K).items()}
        self._host_ptr = cupy.cuda.runtime.hostAlloc(4 * (2 + self.R), 2)  # cudaHostAllocMapped
        import ctypes
        self._host = np.frombuffer((ctypes.c_int32 * (2 + self.R)).from_address(self._host_ptr), dtype=np.int32)
        self.calls = 0
        # Combine: direct rows from my node's ranks and the node's rows I reduce as a rail peer (IPC), the
        # partials from other nodes (NVSHMEM), and the counters of both.
        # The top-k weights' pass (combine(..., topk_weights=)) has resources of its own: it runs right after
        # the rows' pass with no barrier between them, so it must not write what that pass still reads.
        self._clay, off = {}, 0
        for name, nbytes in (("direct", self.max_tokens * self.K * row), ("gather", cap_net * self.K * row),
                             ("wdirect", self.max_tokens * self.K * wrow), ("wgather", cap_net * self.K * wrow)):
            self._clay[name] = off
            off += -(-nbytes // 256) * 256
        self.cpool = SymmetricBuffer(group, off)
        # int64 counters of each pass, [1 + K]: direct rows in, then gather rows in from each rank of the
        # node (so a rail peer's wait names the rank whose rows are missing); the rows' pass, then the weights'
        pass_words = 1 + self.K
        self.csync = SymmetricBuffer(group, -(-2 * pass_words * 8 // 256) * 256)
        self.counter_ptrs = cupy.asarray(np.asarray(self.csync.peer_ptr_list, dtype=u64))
        self.wcounter_ptrs = self.counter_ptrs + np.uint64(8 * pass_words)
        self.cnet_in = core.array((heap["cnet_in"],), dtype="uint8")
        self.cnet_signal = _signals(core, self.N)
        self.wnet_in = core.array((heap["wnet_in"],), dtype="uint8")
        self.wnet_signal = _signals(core, self.N)
        # the weights' pass: its own copy of the state's combine targets (COMBINE_TARGETS, the same layout)
        sl = state_slices(self.R, self.K)
        base = sl[COMBINE_TARGETS[0]].start
        wtargets = cupy.zeros(sl[COMBINE_TARGETS[-1]].stop - base, dtype=np.int64)
        self._wtargets = {n: wtargets[sl[n].start - base:sl[n].stop - base] for n in COMBINE_TARGETS}
        self._rank = {}  # the direct route's combine: rows from each rank of another node, per pass
        if self.direct:
            for name in ("rows", "weights"):
                self._rank[name] = dict(rank_in=core.array((heap[f"{name}_in"],), dtype="uint8"),
                                        rank_signal=_signals(core, self.R),
                                        rank_stage=core.array((heap[f"{name}_stage"],), dtype="uint8"))
        self._last = None
        self._failed = None  # the error that left the state undefined, once one has
        self._captured = []  # arrays of the calls captured in CUDA graphs, alive as long as this object
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()

    def _usable(self) -> None:
        """RuntimeError once a call has failed; else raise (and remember) a device
        error an earlier call left (worst-token calls do not wait for theirs)."""
        if self._failed is not None:
            raise RuntimeError(f"rank {self.me}: this TwoHopDispatch failed ({self._failed}); its state is "
                               "undefined: destroy it and make a new one")
        self._check_errors()

    def _check_errors(self) -> None:
        try:
            self.group.check_errors()
        except Exception as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise

    def dispatch(self, x, topk_idx=None, topk_weights=None, hop_ns=None, num_worst_tokens: int = 0,
                 validate: bool = True, handle: TwoHopHandle | None = None, x_scales=None,
                 kernel_ns=None, notify_ns=None) -> TwoHopResult:
        """One two-hop dispatch (collective).

        Arguments:
            x, topk_idx, topk_weights: see the module docstring (topk_weights
                is required). x may also be FP8: [T, H] uint8 (e4m3 bytes)
                with x_scales [T, H / 128] float32 (or a tuple (x, x_scales)),
                which travel with the rows (recv_x_scales).
            handle: a TwoHopHandle of an earlier call of this object: reuse
                its routing and plan ("cached dispatch": topk_idx must be None,
                num_worst_tokens is the handle's); the notify pass is then only
                the barrier between calls.
            hop_ns: cupy uint64 [4] or None, the hop metric: set it to
                :data:`HOP_STAMPS_INIT` before the call and the kernel writes
                its stamps (TwoHopDispatchArgs::hop_ns; :func:`hop_times_us`
                turns them into each hop's time).
            kernel_ns, notify_ns: cupy int64 [2] or None, kernel stamps (a
                row of cupyep.bench.stamps.new_kernel_stamps): the dispatch
                kernel's, and the notify kernel's, first block start (min) and
                last block end (max) in %globaltimer ns.
            num_worst_tokens: if > 0, the outputs hold this many rows and the
                host reads nothing back (CUDA-graph capturable): rows past the
                received count are padding (recv_topk_idx, recv_src_idx,
                recv_src_rank -1, recv_topk_weights 0, recv_x not written);
                more rows to receive is a DeviceCapacityError, never a drop.
                At most R * max_tokens.
            validate: check the expert ids on the host first (skipped under
                graph capture, where nothing may wait for the device).

        Returns:
            TwoHopResult; the host waits for the kernels unless worst-token
            mode, whose device errors the next call (or group.check_errors())
            raises.
        """
        import cupy

        from .arrays import FP8, as_cupy, check, check_expert_ids, dispatch_rows
        self._usable()
        x, x_scales = dispatch_rows(x, x_scales)
        T, H = x.shape
        fp8 = x.dtype == FP8
        ns = H // 128 if fp8 else 0
        hop_ns = _check_hop(hop_ns)
        kernel_ns, notify_ns = _check_kernel_ns(kernel_ns, "kernel_ns"), _check_kernel_ns(notify_ns, "notify_ns")
        if H != self.hidden or T > self.max_tokens:
            raise ValueError(f"x is [{T}, {H}]; this dispatch takes at most {self.max_tokens} tokens of {self.hidden}")
        if handle is not None:
            if not isinstance(handle, TwoHopHandle) or handle.owner != id(self):
                raise ValueError("handle must be a TwoHopHandle made by this TwoHopDispatch")
            if topk_idx is not None:
                raise ValueError("a cached dispatch reuses the handle's topk_idx: pass topk_idx=None")
            if T != handle.topk_idx.shape[0]:
                raise ValueError(f"the handle was made for {handle.topk_idx.shape[0]} tokens, x has {T}")
            topk_idx, num_worst_tokens = handle.topk_idx, handle.num_worst_tokens
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx (or a handle) and topk_weights")
        topk_idx = check(as_cupy(topk_idx, "topk_idx"), "topk_idx", np.int64, shape=(T, self.k))
        topk_weights = check(as_cupy(topk_weights, "topk_weights"), "topk_weights", np.float32, shape=(T, self.k))
        R, N = self.R, self.N
        worst = int(num_worst_tokens) > 0
        if worst and num_worst_tokens > R * self.max_tokens:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} exceeds the {R} x {self.max_tokens} rows a rank "
                             "can receive")
        capturing = cupy.cuda.get_current_stream().is_capturing()
        if validate and not capturing and handle is None:
            check_expert_ids(topk_idx, self.E)
        if capturing and not worst:
            raise ValueError("a two-hop dispatch inside graph capture needs num_worst_tokens (no host read)")
        if handle is None:
            dev = {"in_rank": cupy.empty((max(T, 1), R), dtype=np.uint8),
                   "head": cupy.empty((max(T, 1), R), np.int64), "slot": cupy.empty((max(T, 1), N), np.int64),
                   "rpm": cupy.empty((R, R), np.int64), "net_count": cupy.empty(N, np.int64),
                   "node_tokens": cupy.empty((N, max(T, 1)), np.int32), "send_node": cupy.empty(N, np.int64)}
            delta = cupy.empty(state_words(R, self.K) - 2, dtype=np.int64)
        else:
            dev, delta = handle.plan, handle.delta
        stride = row_stride(H, self.k, self.K, fp8)  # at most self.stride, which the network buffer holds
        staging = cupy.empty((max(1, T * N), stride), dtype=np.uint8)
        self.calls += 1
        if not worst:
            self._host[:] = 0
        guard = self.group.guard("internode_two_hop_notify")
        nargs = jit.pack(
            NOTIFY_ARGS_DTYPE, topk_idx=topk_idx.data.ptr, in_rank=dev["in_rank"].data.ptr,
            send_head=dev["head"].data.ptr, rdma_slot=dev["slot"].data.ptr, rank_prefix=dev["rpm"].data.ptr,
            net_count=dev["net_count"].data.ptr, node_tokens=dev["node_tokens"].data.ptr,
            send_node=dev["send_node"].data.ptr, row=self.row.data.ptr, matrix=self.matrix.data.ptr,
            row_signal=self.row_signal.data.ptr, state=self.state.data.ptr, host=0 if worst else self._host_ptr,
            capacity=int(num_worst_tokens) if worst else INT32_MAX, delta=delta.data.ptr,
            cached=int(handle is not None), kernel_time=jit.ptr(notify_ns), num_tokens=T, num_topk=self.k,
            num_experts=self.E, num_ranks=R, ranks_per_node=self.K, rank=self.me, guard=jit.pack(GUARD_DTYPE, **guard))
        notify_start, notify_end = cupy.cuda.Event(), cupy.cuda.Event()
        notify_start.record()
        self.notify_fn((1,), (NOTIFY_THREADS,), (nargs,), shared_mem=self._notify_smem)
        notify_end.record()
        args = jit.pack(
            ARGS_DTYPE, x=x.data.ptr, x_scales=jit.ptr(x_scales), topk_idx=topk_idx.data.ptr,
            topk_weights=topk_weights.data.ptr,
            rdma_slot=dev["slot"].data.ptr, send_head=dev["head"].data.ptr, rank_prefix=dev["rpm"].data.ptr,
            node_tokens=dev["node_tokens"].data.ptr, send_node=dev["send_node"].data.ptr, staging=staging.data.ptr, net_rows=self.net_rows.data.ptr, net_signal=self.net_signal.data.ptr,
            net_target=self._state["net_total"].data.ptr, net_count=dev["net_count"].data.ptr,
            pools=self.pool_ptrs.data.ptr, out_x=self._lay["x"], out_idx=self._lay["idx"],
            out_w=self._lay["w"], out_src=self._lay["src"], out_slot=self._lay["slot"],
            arrived=self.arrived_ptrs.data.ptr, arrived_target=self._state["arrived_total"].data.ptr,
            row_stride=stride, out_scales=self._lay["scales"], notify_ok=self._state["ok"].data.ptr,
            capacity=int(num_worst_tokens) if worst else 0, rdma_chunk=check_chunk("rdma_chunk", self.rdma_chunk),
            nvlink_chunk=check_chunk("nvlink_chunk", self.nvlink_chunk), direct=int(self.direct),
            heap_pool=self.pool.ptr if self.direct else 0,
            direct_signal=self.direct_signal.data.ptr if self.direct else 0,
            direct_stage=self.direct_stage.data.ptr if self.direct else 0, hop_ns=jit.ptr(hop_ns),
            kernel_time=jit.ptr(kernel_ns), num_tokens=T,
            num_topk=self.k,
            x_int4=H * x.dtype.itemsize // 16, num_scales=ns, num_ranks=self.R, ranks_per_node=self.K,
            num_local_experts=self.E // self.R,
            rank=self.me, guard=jit.pack(GUARD_DTYPE, **self.group.guard("internode_two_hop_dispatch")))
        self._launch(self.fn, args, wait=not worst)
        if not worst:
            self.last_notify_us = cupy.cuda.get_elapsed_time(notify_start, notify_end) * 1e3
            if self._host[0] != 1:  # the kernels ended without a device error (checked above) but no counts
                raise RuntimeError(f"rank {self.me}: the two-hop notify ended without publishing its counts "
                                   f"(status {int(self._host[0])})")
        if handle is not None:
            n, src_rank, keep = handle.num_rows, handle.src_rank, ()
        else:
            n = int(num_worst_tokens) if worst else int(self._host[1])
            # Each row's source: the first source whose cumulative count to me passes the row (-1: padding).
            rows = cupy.arange(n, dtype=np.int64)
            upto = cupy.ascontiguousarray(dev["rpm"][:, self.me])  # rows from sources 0..s, cumulative
            first = cupy.searchsorted(upto, rows, side="right").astype(np.int32)
            src_rank = cupy.where(first < R, first, np.int32(-1))
            keep = (rows, upto, first)
        if capturing:  # a graph keeps raw pointers: its memory must outlive it
            self._captured.append((x, topk_idx, topk_weights, dev, delta, staging, src_rank, *keep))
        self._last = {"T": T, "dev": dev, "n": n, "call": self.calls, "src_rank": src_rank, "worst": worst,
                      "delta": delta, "combined": False, "stride": stride, "meta_offset": H * x.dtype.itemsize}
        made = handle or TwoHopHandle(owner=id(self), topk_idx=topk_idx, plan=dev, delta=delta, num_rows=n,
                                      num_worst_tokens=int(num_worst_tokens) if worst else 0, src_rank=src_rank)
        return TwoHopResult(recv_x=self.pool.view(self._lay["x"], (n, H), x.dtype),
                            recv_x_scales=self.pool.view(self._lay["scales"], (n, ns), np.float32) if fp8 else None,
                            recv_topk_idx=self.pool.view(self._lay["idx"], (n, self.k), np.int64),
                            recv_topk_weights=self.pool.view(self._lay["w"], (n, self.k), np.float32),
                            recv_src_idx=self.pool.view(self._lay["src"], (n,), np.int32),
                            recv_src_rank=src_rank, rank_prefix_matrix=dev["rpm"], handle=made)

    def _launch(self, fn, args, wait: bool = True) -> None:
        """Launch ``fn`` on ``num_sms`` blocks (every block resident: the kernels
        wait on other ranks). ``wait``: wait for it, raise what it
        reported, and put its device time in ``last_kernel_us``."""
        import cupy
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn((self.num_sms,), (THREADS,), (args,))
        end.record()
        if not wait:
            return
        end.synchronize()
        self._check_errors()
        self.last_kernel_us = cupy.cuda.get_elapsed_time(start, end) * 1e3

    def combine(self, y, hop_ns=None, row_weights=None, topk_weights=None, kernel_ns=None):
        """Reduce the expert outputs of the last dispatch back to its tokens.

        Arguments:
            y: cupy [N, H] uint16 BF16 bits, one row per row the last dispatch
               received (its order).
            hop_ns: cupy uint64 [4] or None: the hop metric, as dispatch's
               (TwoHopCombineArgs::hop_ns).
            kernel_ns: cupy int64 [2] or None: the combine kernel's stamps,
               as dispatch's (the rows' pass; the weights' pass has none).
            row_weights: cupy [N] float32 or None: row r counts as
               BF16(weight_r * y_r), scaled in float32 before it leaves
               (one more BF16 rounding than the combine within a node, which
               weights in its float32 sum: calc_diff 2.3e-6 from the exact
               weighted sum at 2 x 4 ranks, T = 256, H = 7168, BF16 partials).
            topk_weights: cupy [N, k] float32 or None (e.g. recv_topk_weights):
               combined too, in float32 all the way (a second pass of the
               same route over rows of k floats).

        Returns:
            cupy [T, H] uint16: per token, the FP32 sum over nodes in node order
            of the node's rows (own node: each rank's row in local rank order;
            other nodes: the rail peer's BF16 partial of its node's rows in
            local rank order), rounded to BF16. With topk_weights, the tuple
            (that, [T, k] float32 sums of the weights over the ranks).
        """
        import cupy

        from .arrays import BF16, as_cupy, check
        self._usable()
        if self._last is None:
            raise ValueError("combine needs a dispatch first (it reduces the last dispatch's rows)")
        L = self._last
        y = check(as_cupy(y, "y"), "y", BF16, shape=(L["n"], self.hidden))
        hop_ns = _check_hop(hop_ns)
        kernel_ns = _check_kernel_ns(kernel_ns, "kernel_ns")
        row_weights = as_cupy(row_weights, "row_weights")
        if row_weights is not None:
            from .moe import bf16_bits_to_f32, f32_to_bf16_bits
            row_weights = check(row_weights, "row_weights", np.float32, shape=(L["n"],))
        topk_weights = as_cupy(topk_weights, "topk_weights")
        if topk_weights is not None:
            check(topk_weights, "topk_weights", np.float32, shape=(L["n"], self.k))
        if L["call"] != self.calls:
            raise ValueError("combine reduces the last dispatch's rows; another dispatch came after it")
        if L["combined"]:
            raise ValueError("the last dispatch's rows are combined already (one combine per dispatch)")
        if row_weights is not None:  # on the current stream, before the combine reads the rows
            y = f32_to_bf16_bits(bf16_bits_to_f32(y) * row_weights[:, None])
        L["combined"] = True
        # Partial rows this rank makes as a rail peer, for the staging of each pass: their count is on the
        # device in worst-token mode (then the most there can be).
        rows_now = (self.N - 1) * self.max_tokens if L["worst"] else int(L["dev"]["net_count"].sum().get())
        rows_pass = dict(direct_in=self._clay["direct"], gather=self._clay["gather"], counters=self.counter_ptrs,
                         **{n: self._state[n] for n in COMBINE_TARGETS}, net_in=self.cnet_in,
                         net_signal=self.cnet_signal, **self._rank.get("rows", {}))
        out = self._route_back(L, y, self.combine_fn, hop_ns, rows_pass, rows_now, kernel_ns)
        if topk_weights is None:
            return out
        kp = -(-self.k // 4) * 4  # rows of whole int4 words of floats
        w_rows = cupy.zeros((L["n"], kp), dtype=np.float32)
        w_rows[:, :self.k] = topk_weights
        weights_pass = dict(direct_in=self._clay["wdirect"], gather=self._clay["wgather"],
                            counters=self.wcounter_ptrs, **self._wtargets,
                            net_in=self.wnet_in, net_signal=self.wnet_signal, **self._rank.get("weights", {}))
        return out, self._route_back(L, w_rows, self.combine_weights_fn, None, weights_pass, rows_now)[:, :self.k]

    def _route_back(self, L, rows, fn, hop_ns, res: dict, rows_now: int, kernel_ns=None):
        """One combine kernel over ``rows`` ([N, W] of int4 words: BF16 rows, or
        float32 rows for the weights' pass) with the last dispatch's route and
        the pass's own resources ``res`` (pool regions, counters, targets,
        network buffer and signals) and ``rows_now`` partial rows to stage;
        returns [T, W] of the same dtype. The
        pass's cumulative targets move by the dispatch's steps first."""
        import cupy
        R, K, me = self.R, self.K, self.me
        x_int4 = rows.shape[1] * rows.dtype.itemsize // 16
        staging = cupy.empty((max(1, rows_now), x_int4 * 16), dtype=np.uint8)
        out = cupy.zeros((L["T"], rows.shape[1]), dtype=rows.dtype)
        args = jit.pack(
            COMBINE_ARGS_DTYPE, y=rows.data.ptr, recv_src_rank=L["src_rank"].data.ptr,
            recv_src_idx=self.pool.view(self._lay["src"], (L["n"],), np.int32).data.ptr,
            recv_slot=self.pool.view(self._lay["slot"], (L["n"],), np.int64).data.ptr,
            pools=self.cpool.peer_ptrs.data.ptr, direct_in=res["direct_in"], gather=res["gather"],
            counters=res["counters"].data.ptr, targets=res["combine_total"].data.ptr,
            net_rows=self.net_rows.data.ptr,
            row_stride=L["stride"], meta_offset=L["meta_offset"], net_count=L["dev"]["net_count"].data.ptr,
            staging=staging.data.ptr,
            net_in=res["net_in"].data.ptr, net_signal=res["net_signal"].data.ptr,
            net_target=res["combine_net_total"].data.ptr, send_head=L["dev"]["head"].data.ptr, direct=int(self.direct),
            rank_in=jit.ptr(res.get("rank_in")), rank_signal=jit.ptr(res.get("rank_signal")),
            rank_target=res["combine_rank_total"].data.ptr, rank_stage=jit.ptr(res.get("rank_stage")),
            out=out.data.ptr, notify_ok=self._state["ok"].data.ptr, hop_ns=jit.ptr(hop_ns),
            kernel_time=jit.ptr(kernel_ns), num_recv=L["n"],
            num_tokens=L["T"], max_tokens=self.max_tokens, x_int4=x_int4, num_topk=self.k, num_ranks=R,
            ranks_per_node=K, rank=me, guard=jit.pack(GUARD_DTYPE, **self.group.guard("internode_two_hop_combine")))
        # This dispatch's steps of the combine's cumulative targets (on the device, in stream order).
        sl, d = state_slices(R, K), L["delta"]  # delta: the state past its first two words
        for name in COMBINE_TARGETS:
            res[name][...] += d[sl[name].start - 2:sl[name].stop - 2]
        if cupy.cuda.get_current_stream().is_capturing():
            self._captured.append((rows, staging, out))
        self._launch(fn, args, wait=not L["worst"])
        return out

    def destroy(self) -> None:
        """Collective: free the buffers and end NVSHMEM."""
        from . import nvshmem as NV
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        self.group.comm.Barrier()
        self._captured = []
        for buf in (self.pool, self.sync, self.cpool, self.csync):
            buf.destroy()
        extra = [self.direct_signal, self.direct_stage] if self.direct else []
        extra += [arr for res in self._rank.values() for arr in res.values()]
        for arr in (self.net_rows, self.net_signal, self.cnet_in, self.cnet_signal, self.wnet_in, self.wnet_signal,
                    self.row, self.matrix, self.row_signal, *extra):
            self._core.free_array(arr)
        if self._host_ptr:
            self._host = None
            cupy.cuda.runtime.freeHost(self._host_ptr)
            self._host_ptr = 0
        NV.finalize()
