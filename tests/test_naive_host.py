"""CPU tests of the naive baseline's host logic (cupyep.bench.naive), against
the NumPy reference.

The array-module functions (routing_mask, send_order, gather_rows,
widen_bf16) run here with NumPy, the same code the GPU path runs with CuPy.
The whole protocol is replayed for every rank of a node: each rank's staging
and combine regions are NumPy arrays, and every copy and scatter-add is the
one NaiveBuffer makes, driven by NaivePlan and RegionSchedule. What this
cannot check: the CuPy calls themselves, the IPC mappings, and the ordering
that the stream syncs and MPI barriers give (tests/gpu/test_naive_gpu.py).
"""
import numpy as np
import pytest

from cupyep import reference as ref
from cupyep.bench.naive import (NaivePlan, RegionSchedule, check_peer_atomics, gather_rows, routing_mask,
                                send_order, widen_bf16)
from cupyep.testing import bf16_to_f32, f32_to_bf16, global_routing, payload_bf16

NUM_TOPK = 8
SENTINEL = 0xFFFF   # staging rows nobody wrote


def _routing(seed, tokens, num_experts, case):
    idx, _ = global_routing(seed, tokens, num_experts, min(NUM_TOPK, num_experts),
                            "one_expert" if case == "one_expert" else "random")
    if case == "sparse":        # most tokens go nowhere: T exceeds the rows any rank receives
        for a in idx:
            a[np.arange(a.shape[0]) % 16 != 0] = -1
    return idx


class _Node:
    """Every rank's buffers of one node, as NumPy arrays, and the calls of
    NaiveBuffer replayed on them in the order the barriers allow."""

    def __init__(self, num_ranks, hidden):
        self.R, self.H = num_ranks, hidden
        self.rows = self.tokens = 0
        self.staging_x = self.staging_idx = self.regions = None
        self.schedules = [RegionSchedule() for _ in range(num_ranks)]

    def _grow(self, rows, tokens):
        """A fresh, zeroed buffer on every rank (the dispatch staging poisoned
        instead, to catch rows nobody wrote)."""
        self.rows, self.tokens = max(rows, self.rows), max(tokens, self.tokens)
        self.staging_x = [np.full((self.rows, self.H), SENTINEL, np.uint16) for _ in range(self.R)]
        self.staging_idx = [np.full(self.rows, -1, np.int32) for _ in range(self.R)]
        self.regions = [np.zeros((2, self.tokens * self.H), np.float32) for _ in range(self.R)]
        for s in self.schedules:
            s.reset()

    def dispatch(self, x, idx, num_experts):
        """Per rank: (recv_x, recv_src_idx, recv_src_rank, plan)."""
        R = self.R
        masks = [routing_mask(np, idx[r], num_experts, R) for r in range(R)]
        send_tokens = [send_order(np, m) for m in masks]
        table = np.stack([np.concatenate([m.sum(axis=1), [idx[r].shape[0]]]) for r, m in enumerate(masks)])
        plans = [NaivePlan.build(table, r) for r in range(R)]
        for r in range(R):
            assert send_tokens[r].dtype == np.int32 and send_tokens[r].size == masks[r].sum()
        if plans[0].staging_rows > self.rows or plans[0].staging_tokens > self.tokens:
            self._grow(plans[0].staging_rows, plans[0].staging_tokens)
        for r, plan in enumerate(plans):
            send_x = gather_rows(np, x[r], send_tokens[r])
            for d, first, num, at in plan.send_copies:
                self.staging_x[d][at:at + num] = send_x[first:first + num]
                self.staging_idx[d][at:at + num] = send_tokens[r][first:first + num]
        # Barrier, then every rank copies its rows out.
        out = [(self.staging_x[r][:p.recv_rows].copy(), self.staging_idx[r][:p.recv_rows].copy(), p.recv_src_rank, p)
               for r, p in enumerate(plans)]
        for r in range(R):
            self.staging_x[r][:] = SENTINEL
            self.staging_idx[r][:] = -1
        return out

    def combine(self, ys, handles):
        """handles: per rank (recv_src_idx, plan) of one dispatch; ys: per rank [N, H] uint16."""
        R, H = self.R, self.H
        calls = [s.next() for s in self.schedules]
        assert len({c[0] for c in calls}) == 1, "ranks disagree on the region"
        region = calls[0][0]
        for r, (_, other, nbytes) in enumerate(calls):
            assert nbytes % 4 == 0
            self.regions[r][other][:nbytes // 4] = 0
        for r in range(R):
            assert not self.regions[r][region].any(), f"rank {r}'s region {region} is not clean when peers add"
        for r, (src_idx, plan) in enumerate(handles):
            values = widen_bf16(np, ys[r])
            assert values.dtype == np.float32 and values.shape == ys[r].shape
            for s, first, num in plan.recv_ranges:
                T_s = int(plan.tokens[s])
                dst = self.regions[s][region][:T_s * H].reshape(T_s, H)
                np.add.at(dst, src_idx[first:first + num], values[first:first + num])
        # Barrier, then every rank copies its region out.
        out = []
        for r, (_, plan) in enumerate(handles):
            T = plan.num_tokens
            out.append(self.regions[r][region][:T * H].reshape(T, H).copy())
            if T:
                self.schedules[r].used(region, T * H * 4)
        return out


def _check_dispatch(got, expected):
    for r, ((recv_x, src_idx, src_rank, plan), exp) in enumerate(zip(got, expected)):
        assert np.array_equal(recv_x, exp.recv_x), f"rank {r}: recv_x"
        assert np.array_equal(src_idx, exp.recv_src_idx), f"rank {r}: recv_src_idx"
        assert np.array_equal(src_rank, exp.recv_src_rank), f"rank {r}: recv_src_rank"
        assert np.array_equal(plan.rank_prefix_matrix, exp.rank_prefix_matrix), f"rank {r}: rank_prefix_matrix"
        assert plan.recv_rows == exp.num_recv_tokens


def _check_combine(got, ys, expected_dispatch, tokens):
    expected = ref.intranode_combine([bf16_to_f32(y) for y in ys], expected_dispatch, tokens)
    for r, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == np.float32, (r, g.shape, e.shape)
        assert np.allclose(g, e, rtol=1e-6, atol=1e-7), (r, float(np.abs(g - e).max()))


CASES = [
    # (ranks, experts, seed, tokens per rank, hidden, routing, rank with zero tokens)
    (1, 256, 1, 64, 32, "random", None),
    (2, 256, 2, 100, 64, "random", None),
    (3, 96, 3, 50, 16, "random", 1),
    (4, 256, 4, 1, 32, "random", None),
    (8, 256, 5, 1, 32, "random", None),
    (8, 256, 6, 128, 16, "random", None),
    (8, 256, 7, 300, 16, "one_expert", None),
    (8, 256, 8, 200, 16, "random", 0),
    (4, 256, 9, 300, 16, "sparse", None),
]


@pytest.mark.parametrize("R,E,seed,T,H,case,zero_rank", CASES)
def test_protocol_matches_reference(R, E, seed, T, H, case, zero_rank):
    tokens = [0 if r == zero_rank else T for r in range(R)]
    idx = _routing(seed, tokens, E, case)
    x = [payload_bf16(r, np.arange(t), H) for r, t in enumerate(tokens)]
    expected = ref.intranode_dispatch(x, idx, E)
    node = _Node(R, H)
    got = node.dispatch(x, idx, E)
    _check_dispatch(got, expected)
    if case == "sparse":
        assert got[0][3].staging_tokens > got[0][3].staging_rows
    handles = [(src_idx, plan) for _, src_idx, _, plan in got]
    rng = np.random.default_rng(seed)
    for _ in range(3):   # both regions, then the first again (zeroed in between)
        ys = [f32_to_bf16(rng.standard_normal((p.recv_rows, H)).astype(np.float32)) for _, p in handles]
        _check_combine(node.combine(ys, handles), ys, expected, tokens)


def test_interleaved_combines_of_different_sizes():
    """Handles of different T combined in an order that gives each region a
    smaller T after a larger one and the other way round."""
    R, E, H = 8, 256, 16
    node = _Node(R, H)
    cases = []
    for seed, T in ((11, 128), (12, 33), (13, 200), (14, 1)):
        tokens = [T] * R
        idx = _routing(seed, tokens, E, "random")
        x = [payload_bf16(r, np.arange(t), H) for r, t in enumerate(tokens)]
        expected = ref.intranode_dispatch(x, idx, E)
        got = node.dispatch(x, idx, E)
        _check_dispatch(got, expected)
        cases.append((tokens, expected, [(src_idx, plan) for _, src_idx, _, plan in got]))
    rng = np.random.default_rng(0)
    for i in (0, 1, 2, 2, 3, 1, 0, 0, 3, 2):
        tokens, expected, handles = cases[i]
        ys = [f32_to_bf16(rng.standard_normal((p.recv_rows, H)).astype(np.float32)) for _, p in handles]
        _check_combine(node.combine(ys, handles), ys, expected, tokens)


def test_routing_mask_matches_reference_layout():
    R, E = 8, 256
    idx = _routing(3, [77] * R, E, "random")[2]
    idx[5] = -1                                    # a token that goes nowhere
    mask = routing_mask(np, idx, E, R)
    assert mask.shape == (R, 77) and mask.dtype == np.bool_
    assert np.array_equal(mask, ref.get_dispatch_layout(idx, E, R).is_token_in_rank.T)
    assert not mask[:, 5].any()
    assert np.array_equal(routing_mask(np, idx, E, R, np.arange(R, dtype=np.int64)), mask)
    assert routing_mask(np, np.zeros((0, 8), np.int64), E, R).shape == (R, 0)


def test_send_order_is_destination_then_token():
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    order = send_order(np, mask)
    assert order.dtype == np.int32
    assert order.tolist() == [1, 2, 0, 0, 1, 2, 3]
    assert send_order(np, np.zeros((3, 0), bool)).tolist() == []
    assert send_order(np, np.zeros((3, 5), bool)).dtype == np.int32


def test_gather_rows_is_bit_exact():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 16, size=(9, 24), dtype=np.uint16)   # every bit pattern, NaNs included
    rows = np.array([8, 0, 3, 3, 5], dtype=np.int32)
    got = gather_rows(np, x, rows)
    assert got.dtype == np.uint16 and np.array_equal(got, x[rows])
    assert gather_rows(np, x, rows.astype(np.int64)).tobytes() == x[rows].tobytes()
    assert gather_rows(np, x, np.zeros(0, np.int32)).shape == (0, 24)
    assert gather_rows(np, np.zeros((0, 8), np.uint16), np.zeros(0, np.int32)).shape == (0, 8)


def test_widen_bf16_matches_testing_helper():
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    got = widen_bf16(np, bits)
    assert got.dtype == np.float32 and got.tobytes() == bf16_to_f32(bits).tobytes()


def _brute_plan(C, tokens, me):
    R = C.shape[0]
    send_copies, recv_ranges = [], []
    first = 0
    for d in range(R):
        if C[me, d]:
            send_copies.append((d, first, int(C[me, d]), int(sum(C[s, d] for s in range(me)))))
        first += int(C[me, d])
    first = 0
    for s in range(R):
        if C[s, me]:
            recv_ranges.append((s, first, int(C[s, me])))
        first += int(C[s, me])
    return tuple(send_copies), tuple(recv_ranges)


@pytest.mark.parametrize("R", [1, 2, 5, 8])
def test_plan_offsets(R):
    rng = np.random.default_rng(R)
    for _ in range(20):
        C = rng.integers(0, 4, size=(R, R)) * (rng.random((R, R)) < 0.6)
        tokens = C.max(axis=1) + rng.integers(0, 3, size=R)
        table = np.concatenate([C, tokens[:, None]], axis=1)
        for me in range(R):
            plan = NaivePlan.build(table, me)
            assert (plan.send_copies, plan.recv_ranges) == _brute_plan(C, tokens, me)
            assert plan.recv_rows == C[:, me].sum() and plan.num_tokens == tokens[me]
            assert plan.staging_rows == C.sum(axis=0).max() and plan.staging_tokens == tokens.max()
            assert np.array_equal(plan.rank_prefix_matrix, np.cumsum(C, axis=0).astype(np.int32))
            assert plan.recv_src_rank.tolist() == [s for s in range(R) for _ in range(C[s, me])]
            assert plan.num_ranks == R


def test_plan_rejects_bad_tables():
    with pytest.raises(ValueError, match="R \\+ 1"):
        NaivePlan.build(np.zeros((3, 3), np.int64), 0)
    with pytest.raises(ValueError, match="rank"):
        NaivePlan.build(np.zeros((3, 4), np.int64), 3)
    with pytest.raises(ValueError, match="negative"):
        NaivePlan.build(-np.ones((2, 3), np.int64), 0)


def test_region_schedule():
    s = RegionSchedule()
    assert s.next() == (0, 1, 0)
    s.used(0, 400)
    assert s.next() == (1, 0, 400)          # the region of the call before is zeroed now
    s.used(1, 80)
    assert s.next() == (0, 1, 80)
    s.used(0, 12)
    s.reset()                               # a fresh buffer: nothing to zero, parity kept
    assert s.next() == (1, 0, 0)
    assert s.next() == (0, 1, 0)


def test_check_peer_atomics():
    check_peer_atomics([0, 0, 0, 0], lambda a, b: False)       # one GPU: nothing to ask
    check_peer_atomics([0, 1, 0, 1], lambda a, b: True)
    with pytest.raises(RuntimeError, match=r"\(0, 1\)"):
        check_peer_atomics([0, 1], lambda a, b: (a, b) != (0, 1))


# ------------------------------------------------------------------------
# NaiveBuffer itself, on host memory: one thread per rank, a fake cupy module
# whose arrays are NumPy arrays with .data.ptr, memcpyAsync / memsetAsync as
# ctypes memmove / memset, and a SymmetricBuffer of host memory mapped by all
# "ranks" (threads of one process). This runs NaiveBuffer's own pointer and
# byte-offset arithmetic; copies are synchronous here, so it checks what the
# calls compute, not the ordering the GPU needs.

import ctypes
import sys
import threading
import types

from cupyep.bench import naive as naive_mod

_TIMEOUT_S = 60


class _HostArray(np.ndarray):
    """A NumPy array standing in for a cupy one."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.array(self)


def _host(a):
    return np.asarray(a).view(_HostArray)


def _fake_cupy():
    lock = threading.Lock()     # np.add.at is not atomic across threads; the GPU's atomics are

    def add_at(a, idx, values):
        with lock:
            np.add.at(a, np.asarray(idx), np.asarray(values))

    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    runtime = types.SimpleNamespace(
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, n, kind, s: ctypes.memmove(dst, src, n),
        memsetAsync=lambda ptr, value, n, s: ctypes.memset(ptr, value, n))
    m = types.ModuleType("cupy")
    m.ascontiguousarray = lambda a: _host(np.ascontiguousarray(a))
    m.empty = lambda shape, dtype=np.float64: _host(np.empty(shape, dtype))
    m.asarray = lambda a: _host(np.array(a))
    m.arange = lambda *a, **k: _host(np.arange(*a, **k))
    m.flatnonzero = lambda a: _host(np.flatnonzero(a))
    m.take = lambda a, i, axis=None: _host(np.take(np.asarray(a), np.asarray(i), axis=axis))
    m.left_shift = lambda a, b, dtype=None: _host(np.left_shift(np.asarray(a), b, dtype=dtype))
    m.add = types.SimpleNamespace(at=add_at)
    m.cuda = types.SimpleNamespace(get_current_stream=lambda: stream, runtime=runtime)
    return m


class _Comm:
    """node_comm of one thread-rank."""

    def __init__(self, shared, rank):
        self.shared, self.rank = shared, rank

    def Barrier(self):
        self.shared["barrier"].wait(_TIMEOUT_S)

    def allgather(self, obj):
        slots = self.shared["slots"]
        slots[self.rank] = obj
        self.Barrier()
        out = list(slots)
        self.Barrier()
        return out

    def Allgather(self, send, recv):
        recv[...] = np.stack(self.allgather(np.array(send)))


class _HostSymmetricBuffer:
    """SymmetricBuffer's interface on zeroed host memory."""

    def __init__(self, group, nbytes):
        self.group, self.nbytes = group, int(nbytes)
        self._mem = np.zeros(self.nbytes, np.uint8)
        self.ptr = self._mem.ctypes.data
        self.peer_ptr_list = group.node_comm.allgather(self.ptr)
        group.shared["allocations"] += 1 if group.local_rank == 0 else 0

    def view(self, offset, shape, dtype, peer=None):
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        n = int(np.prod(shape)) * dtype.itemsize
        assert 0 <= offset and offset + n <= self.nbytes and n > 0, (offset, n, self.nbytes)
        base = self.ptr if peer is None else self.peer_ptr_list[peer]
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(base + offset))
        return raw.view(dtype).reshape(shape).view(_HostArray)

    def destroy(self):
        self.group.node_comm.Barrier()     # nobody touches the memory any more
        self._mem = None
        self.ptr = 0
        self.group.node_comm.Barrier()


def _run_ranks(R, fn):
    """fn(group) on R threads at once; the per-rank results."""
    shared = {"barrier": threading.Barrier(R), "slots": [None] * R, "allocations": 0}
    results, errors = [None] * R, []

    def body(r):
        group = types.SimpleNamespace(local_size=R, local_rank=r, num_nodes=1, device_id=0, shared=shared,
                                      node_comm=_Comm(shared, r), require_gpu=lambda what: None)
        try:
            results[r] = fn(group)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append((r, e))
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * _TIMEOUT_S)
    real = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0][1]
    return results, shared


@pytest.fixture
def host_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(naive_mod, "SymmetricBuffer", _HostSymmetricBuffer)


def test_naive_buffer_on_host_memory(host_cupy):
    """Dispatches of growing and shrinking sizes (the buffer grows for rows,
    then for tokens only), their combines repeated and interleaved."""
    R, E, H = 8, 256, 16
    cases = [(41, 40, "random", None), (42, 1, "random", None), (43, 150, "random", 3), (44, 120, "one_expert", None),
             (45, 1100, "sparse", None)]
    inputs = []
    for seed, T, case, zero_rank in cases:
        tokens = [0 if r == zero_rank else T for r in range(R)]
        idx = _routing(seed, tokens, E, case)
        x = [payload_bf16(r, np.arange(t), H) for r, t in enumerate(tokens)]
        res = ref.intranode_dispatch(x, idx, E)
        ys = [f32_to_bf16(np.random.default_rng([seed, d]).standard_normal((res[d].num_recv_tokens, H))
                          .astype(np.float32)) for d in range(R)]
        combined = ref.intranode_combine([bf16_to_f32(y) for y in ys], res, tokens)
        inputs.append((idx, x, res, ys, combined))
    order = [(0, 0), (1, 0), (1, 1), (0, 1), (2, 0), (2, 1), (0, 0), (3, 0), (3, 1), (4, 0), (4, 1), (1, 2)]

    def rank(group):
        me, bad = group.local_rank, []
        buf = naive_mod.NaiveBuffer(group, H)
        outs = {}
        for i, k in order:
            idx, x, res, ys, combined = inputs[i]
            if k == 0:
                out = buf.dispatch(_host(x[me]), _host(idx[me]), E)
                outs[i] = out
                exp = res[me]
                for name, got, want in (("recv_x", out.recv_x, exp.recv_x),
                                        ("recv_src_idx", out.recv_src_idx, exp.recv_src_idx),
                                        ("recv_src_rank", out.recv_src_rank, exp.recv_src_rank),
                                        ("rank_prefix_matrix", out.handle.rank_prefix_matrix,
                                         exp.rank_prefix_matrix)):
                    if not (np.asarray(got).shape == want.shape and np.array_equal(got, want)):
                        bad.append((i, name))
            got = buf.combine(_host(ys[me]), outs[i].handle)
            if not (got.shape == combined[me].shape and got.dtype == np.float32
                    and np.allclose(got, combined[me], rtol=1e-6, atol=1e-7)):
                bad.append((i, k, "combine"))
        caps = (buf.num_max_rows, buf.num_max_tokens)
        buf.destroy()
        return bad, caps

    results, shared = _run_ranks(R, rank)
    for r, (bad, _) in enumerate(results):
        assert not bad, f"rank {r}: {bad}"
    rows, tokens = results[0][1]
    assert tokens >= 1100 and rows < tokens         # the sparse case grew the regions, not the staging rows
    assert shared["allocations"] >= 3               # first call, growth for rows, growth for tokens


def test_naive_buffer_rejects_combine_beyond_its_regions(host_cupy):
    def rank(group):
        buf = naive_mod.NaiveBuffer(group, 8)
        plan = NaivePlan.build(np.array([[1, 0, 9], [0, 1, 1]]), group.local_rank)
        handle = naive_mod.NaiveHandle(plan=plan, recv_src_idx=_host(np.zeros(1, np.int32)))
        with pytest.raises(ValueError, match="combine regions of 9 tokens"):
            buf.combine(_host(np.zeros((1, 8), np.uint16)), handle)
        with pytest.raises(ValueError, match="y must be"):
            buf.combine(_host(np.zeros((2, 8), np.uint16)), handle)
        return True

    assert _run_ranks(2, rank)[0] == [True, True]
