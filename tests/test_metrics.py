"""Host side of the in-kernel metrics (cupyep.lab.metrics): the reductions a
sweep record gets from what the kernels write."""
import numpy as np
import pytest

from cupyep.lab import metrics as M


def test_percentiles_interpolate_and_are_none_without_samples():
    assert M.percentiles(range(101)) == {"p50": 50.0, "p99": 99.0}
    assert M.percentiles([3.0]) == {"p50": 3.0, "p99": 3.0}
    assert M.percentiles([]) == {"p50": None, "p99": None}
    assert M.percentiles([1, 2, 3, 4], qs=(25, 75)) == {"p25": pytest.approx(1.75), "p75": pytest.approx(3.25)}


def test_imbalance_is_max_over_mean():
    assert M.imbalance([1, 1, 1, 1]) == 1.0
    assert M.imbalance([[0, 4], [0, 0]]) == 4.0
    assert M.imbalance([0, 0]) is None and M.imbalance([]) is None


def test_notify_samples_are_per_call_microseconds():
    # Successive readings of a notify_time_ns array: (ns added, calls added) per reading.
    assert M.notify_samples_us([(15000, 1), (30000, 2), (0, 0), (7000, 1)]) == [15.0, 15.0, 7.0]
    assert M.notify_samples_us([]) == []


class _Comm:
    def allreduce(self, v, op=None):
        return v


class _Group:
    comm = _Comm()


def test_normal_metrics_reads_each_call_on_its_own(monkeypatch):
    """normal_metrics against a fake device: each call adds its own time; the
    record holds the median, p99 and the largest of them."""
    cupy = pytest.importorskip("cupy")
    mpi4py = pytest.importorskip("mpi4py")  # noqa: F841

    class FakeStats:
        def __init__(self):
            self.v = np.zeros(2, dtype=np.int64)

        def get(self):
            return self.v.copy()

    stats = FakeStats()
    monkeypatch.setattr(cupy, "zeros", lambda n, dtype=None: stats)
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: None)
    times = iter([10_000, 20_000, 30_000, 40_000])

    def call(notify_time_ns):
        notify_time_ns.v += np.array([next(times), 1])

    m = M.normal_metrics(_Group(), call, calls=4)
    assert m == {"notify_us_p50": 25.0, "notify_us_p99": pytest.approx(39.7), "notify_us_max": 40.0}


def test_occupancy_is_rows_waiting_per_poll_over_the_depth():
    assert M.occupancy([96, 12, 16], 32) == {"queue_occupancy_mean": 0.25, "queue_occupancy_max": 0.5}
    assert M.occupancy(np.array([0, 0, 0], dtype=np.uint64), 32) == {"queue_occupancy_mean": None,
                                                                    "queue_occupancy_max": None}


class _MaxComm:
    """allreduce(MAX) against one other rank whose values come in call order."""

    def __init__(self, others):
        self.others = list(others)

    def allreduce(self, v, op=None):
        return max(v, self.others.pop(0))


def test_slowest_medians_skip_missing_values():
    group = type("G", (), {"comm": _MaxComm([2.5, -1.0])})()  # the other rank: a's median 2.5, no b
    got = M.slowest_medians(group, [{"a": 1.0, "b": None}, {"a": 3.0, "b": None}, {"a": 2.0, "b": None}])
    assert got == {"a": 2.5, "b": None}
    group = type("G", (), {"comm": _MaxComm([0.0])})()
    assert M.slowest_medians(group, [{"a": 1.0}, {"a": 5.0}]) == {"a": 3.0}
