"""The "internode" GPU study's host side (CPU only): its registration and
knobs, what it skips before anything touches a GPU, and the measurement core
(cupyep.lab.bench.internode) on a fake TwoHopDispatch: which calls each kind
makes, the record's fields, the slowest rank's figures, and the oracle check
on rows rebuilt from the reference (and on a corrupted copy)."""
from types import SimpleNamespace

import numpy as np
import pytest

from cupyep.lab import experiments
from cupyep import reference as ref

from cupyep.lab.bench import internode as BI
from cupyep.lab.experiments import gpu_internode as G
from cupyep.lab.experiments.studies import Skip
from cupyep.reference import internode as I
from cupyep.testing import bf16_to_f32, f32_to_bf16, global_routing, payload_bf16


class _Comm:
    """allreduce over this rank and fixed other ranks' values (MAX / LAND);
    allgather: this rank's value, then ``gathered`` (the other ranks')."""

    def __init__(self, others=(), gathered=()):
        self.others, self.gathered = list(others), list(gathered)

    def allreduce(self, v, op=None):
        from mpi4py import MPI
        vals = [v, *self.others]
        return all(vals) if op is MPI.LAND else max(vals)

    def allgather(self, v):
        return [v, *self.gathered]


class _Host:
    """A device array stand-in: .get() gives the NumPy array, .copy() itself."""

    def __init__(self, a):
        self.a = np.asarray(a)

    def get(self):
        return self.a

    def copy(self):
        return _Host(self.a.copy())


def _stamp(row, start_ns, us):
    """Fill a kernel-stamps row as a kernel would: start, start + us."""
    if row is not None:
        row[0], row[1] = start_ns, start_ns + int(round(us * 1e3))


class _FakeHop:
    """Records the calls; each kernel 'takes' the next duration on the
    kernel clock (its stamps) and event_factor times it on CUDA events."""

    def __init__(self, kernel_us, notify_us=5.0, event_factor=1.5):
        self.kernel_us, self.notify_us, self.calls = list(kernel_us), notify_us, []
        self.event_factor = event_factor
        self.direct = False  # the two-hop route
        self.last_kernel_us = self.last_notify_us = None
        self.clock = 10_000

    def _run(self, row):
        us = self.kernel_us.pop(0)
        self.clock += 1_000_000
        _stamp(row, self.clock, us)
        self.last_kernel_us = us * self.event_factor

    def dispatch(self, x, topk_idx=None, topk_weights=None, handle=None, kernel_ns=None, notify_ns=None):
        self.calls.append(("dispatch", "cached" if handle is not None else "counted"))
        _stamp(notify_ns, self.clock, self.notify_us)
        self._run(kernel_ns)
        self.last_notify_us = self.notify_us * self.event_factor
        return SimpleNamespace(recv_x=_Host(np.zeros((3, 4), np.uint16)), handle="h")

    def combine(self, y, handle, kernel_ns=None):
        self.calls.append(("combine", None))
        self._run(kernel_ns)


def _host_stamps(n):
    """cupyep.lab.bench.stamps.new_kernel_stamps on the host."""
    st = np.zeros((n, 2), dtype=np.int64)
    st[:, 0] = np.iinfo(np.int64).max
    return st


def _group(others=(), gathered=(), ranks_per_gpu=2):
    return SimpleNamespace(comm=_Comm(others, gathered), world_size=2, ranks_per_gpu=ranks_per_gpu)


TRAFFIC = I.TwoHopTraffic(rdma_bytes=4000, rdma_bytes_without_dedup=6000, saved_bytes=2000, nvlink_bytes=8000,
                          rdma_bytes_per_rank=np.zeros(2), rail_in_bytes=np.zeros(2))


def test_the_study_is_registered_with_its_knobs():
    study = experiments.studies.get("internode")
    assert study.needs_gpu and list(study.knobs) == list(G.KNOBS)
    assert study.knobs["kind"] in BI.KINDS


def test_a_bad_kind_and_one_node_are_skipped_before_any_gpu_work():
    group = SimpleNamespace(num_nodes=1, world_size=4, rank=0, local_size=4)
    with pytest.raises(Skip, match="kind must be one of"):
        G.run(group, {**G.KNOBS, "kind": "dispatch_fp8"})
    with pytest.raises(Skip, match="--ranks-per-node"):
        G.run(group, dict(G.KNOBS))


@pytest.mark.parametrize("kind,calls", [
    ("dispatch_bf16", [("dispatch", "counted")] * 3),
    ("dispatch_bf16_cached", [("dispatch", "cached")] * 3),
    ("combine_bf16", [("dispatch", "counted"), ("combine", None)] * 3),
])
def test_measure_makes_each_kinds_calls_and_reports_the_slowest_rank(kind, calls):
    durations = [10.0, 30.0, 20.0] if kind != "combine_bf16" else [1.0, 10.0, 1.0, 30.0, 1.0, 20.0]
    hop = _FakeHop(durations)
    # the other rank's kernels: each starts 4 us before this rank's and ends 2 us before it (one GPU's
    # timer); a combine's untimed dispatch before it also moves the fake's clock
    mine = _host_stamps(3)
    for i, us in enumerate(durations[1::2] if kind == "combine_bf16" else durations):
        _stamp(mine[i], 10_000 + (i + 1) * 1_000_000 * (2 if kind == "combine_bf16" else 1) - 4_000, us + 2.0)
    rec = BI.measure(_group([0.0], [mine]), hop, kind, "x", "ids", "ws", "h", 3, TRAFFIC, new_stamps=_host_stamps)
    assert hop.calls == calls
    assert rec["clock"] == "kernel"
    assert rec["time_us"] == pytest.approx(20.0) and rec["kernel_us_p90"] == pytest.approx(28.0)
    assert rec["event_us"] == pytest.approx(30.0)  # the events, beside: 1.5 x the kernel in the fake
    assert rec["span_us"] == pytest.approx(24.0)  # the other rank's start to this rank's end
    assert rec["notify_us"] == (None if kind == "combine_bf16" else pytest.approx(5.0))
    assert rec["notify_event_us"] == (None if kind == "combine_bf16" else pytest.approx(7.5))
    assert rec["rdma_GBps"] == pytest.approx(4000 / 20.0 / 1e3) and rec["nvlink_GBps"] == pytest.approx(0.4)
    assert rec["dedup_saved_bytes"] == 2000 and rec["rdma_bytes_without_dedup"] == 6000
    slow = BI.measure(_group([50.0], [mine]), _FakeHop(durations), kind, "x", "ids", "ws", "h", 3, TRAFFIC,
                      new_stamps=_host_stamps)
    assert slow["time_us"] == 50.0  # another rank was slower
    apart = BI.measure(_group([0.0], [mine], ranks_per_gpu=1), _FakeHop(durations), kind, "x", "ids", "ws", "h",
                       3, TRAFFIC, new_stamps=_host_stamps)
    assert apart["span_us"] is None  # ranks on different GPUs: their timers are not comparable


@pytest.mark.parametrize("kind,calls", [
    ("dispatch_bf16", ["barrier", ("dispatch", "counted")] * 2),
    ("combine_bf16", [("dispatch", "counted"), "barrier", ("combine", None)] * 2),
])
def test_measure_lines_each_timed_call_up_behind_the_barrier(kind, calls):
    """With ``before`` (a GPU barrier), the barrier runs right before each
    timed call (a combine's untimed dispatch comes before it); the record
    says so, and says when it was not."""
    hop = _FakeHop([10.0, 20.0] if kind != "combine_bf16" else [1.0, 10.0, 1.0, 20.0])
    rec = BI.measure(_group(), hop, kind, "x", "ids", "ws", "h", 2, TRAFFIC, new_stamps=_host_stamps,
                     before=lambda: hop.calls.append("barrier"), sleep_us=0)
    assert hop.calls == calls and rec["lined_up"] is True
    plain = BI.measure(_group(), _FakeHop([10.0, 20.0, 30.0, 40.0]), kind, "x", "ids", "ws", "h", 2, TRAFFIC,
                       new_stamps=_host_stamps)
    assert plain["lined_up"] is False


def test_measure_refuses_a_bad_kind_or_no_calls():
    group = _group()
    with pytest.raises(ValueError, match="kind"):
        BI.measure(group, _FakeHop([1.0]), "dispatch_fp8", "x", "i", "w", None, 1, TRAFFIC)
    with pytest.raises(ValueError, match="iters"):
        BI.measure(group, _FakeHop([1.0]), "dispatch_bf16", "x", "i", "w", None, 0, TRAFFIC)


def test_the_oracle_check_passes_the_reference_rows_and_catches_a_misrouted_one():
    R, E, k, H, T = 4, 16, 4, 128, 12
    tokens = [T] * R
    idx, w = global_routing(3, tokens, E, k)
    me = 1
    group = SimpleNamespace(comm=_Comm(), world_size=R, rank=me)
    exp = ref.intranode_dispatch([np.arange(t, dtype=np.int32)[:, None] for t in tokens], idx, E, topk_weights=w)[me]
    rows = np.empty((exp.num_recv_tokens, H), dtype=np.uint16)
    for s in range(R):
        sel = exp.recv_src_rank == s
        rows[sel] = payload_bf16(s, exp.recv_src_idx[sel], H)
    visits = ref.get_dispatch_layout(idx[me], E, R).is_token_in_rank.sum(axis=1)[:, None]
    combined = f32_to_bf16(bf16_to_f32(payload_bf16(me, np.arange(T), H)) * visits)
    out = SimpleNamespace(recv_x=_Host(rows), recv_src_idx=_Host(exp.recv_src_idx))
    BI.check_against_oracle(group, out, _Host(combined), idx, w, tokens, E, H)
    swapped = rows.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]  # two rows in each other's place
    with pytest.raises(RuntimeError, match="differ from the oracle"):
        BI.check_against_oracle(group, SimpleNamespace(recv_x=_Host(swapped), recv_src_idx=out.recv_src_idx),
                                _Host(combined), idx, w, tokens, E, H)


def test_each_kind_takes_its_own_hop_times():
    hops = {"dispatch_hop_us": {"network": 1.0}, "combine_hop_us": {"node": 2.0}}
    assert BI.hop_times_of(hops, "dispatch_bf16") == BI.hop_times_of(hops, "dispatch_bf16_cached") == {"network": 1.0}
    assert BI.hop_times_of(hops, "combine_bf16") == {"node": 2.0}


def test_the_direct_route_counts_its_own_traffic():
    """The direct route sends one row per (token, remote rank) over the network
    and only the rows within a node over NVLink; the two-hop route's counts
    are the reference's as they are."""
    from types import SimpleNamespace
    t = SimpleNamespace(rdma_bytes=40, rdma_bytes_without_dedup=100, saved_bytes=60, nvlink_bytes=250)
    two_hop, direct = BI.route_bytes(t, False, 1.0), BI.route_bytes(t, True, 1.0)
    assert (two_hop["rdma_bytes"], two_hop["nvlink_bytes"], two_hop["dedup_saved_bytes"]) == (40, 250, 60)
    assert (direct["rdma_bytes"], direct["nvlink_bytes"], direct["dedup_saved_bytes"]) == (100, 150, 0)
    assert direct["rdma_GBps"] == 100 / 1e3 and G.KNOBS["route"] == "two_hop"
