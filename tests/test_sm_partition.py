"""cupyep.sm_partition on the CPU: the share of SMs each rank's partition
gets, and when a compute stream is asked for; and the balance study's
pure helpers (experiments/study_balance.py)."""
import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from cupyep import routing, sm_partition

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("num_sms,ranks,share", [(132, 8, 16), (132, 4, 32), (132, 2, 64), (132, 3, 40),
                                                  (132, 16, 8), (132, 1, 128)])
def test_each_rank_gets_an_even_share_in_whole_granules(num_sms, ranks, share):
    assert sm_partition.share_of(num_sms, ranks) == share
    assert share % sm_partition.GRANULE == 0 and share * ranks <= num_sms


@pytest.mark.parametrize("num_sms,ranks", [(132, 17), (132, 0), (0, 2)])
def test_a_gpu_too_small_for_the_partitions_is_refused(num_sms, ranks):
    with pytest.raises(ValueError):
        sm_partition.share_of(num_sms, ranks)


class _Group:
    def __init__(self, has_gpu=True, ranks_per_gpu=8):
        self.has_gpu, self.ranks_per_gpu = has_gpu, ranks_per_gpu


@pytest.mark.parametrize("env,group", [(None, _Group()), ("0", _Group()), ("1", _Group(has_gpu=False)),
                                       ("1", _Group(ranks_per_gpu=1))])
def test_no_partition_unless_asked_for_and_ranks_share_a_gpu(monkeypatch, env, group):
    if env is None:
        monkeypatch.delenv(sm_partition.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(sm_partition.ENV_VAR, env)
    assert sm_partition.compute_stream(group) is None
    assert not sm_partition.in_use(group)


def test_partitions_in_use_when_asked_for_and_ranks_share_a_gpu(monkeypatch):
    monkeypatch.setenv(sm_partition.ENV_VAR, "1")
    assert sm_partition.in_use(_Group())  # a Buffer's default on_partition then


def test_a_stream_for_an_unknown_purpose_is_refused_before_the_driver_is_asked():
    with pytest.raises(ValueError, match="purpose"):
        sm_partition.partition_stream(_Group(), "ffn")


def test_a_stream_no_partition_made_is_not_a_partition_stream():
    class _Stream:
        ptr = 12345
    assert not sm_partition.is_partition_stream(_Stream())
    assert not sm_partition.is_partition_stream(None)


def _study():
    spec = importlib.util.spec_from_file_location("study_balance", REPO / "experiments" / "study_balance.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_study_reads_its_traces_and_refuses_bad_ones():
    study = _study()
    assert study.parse_trace("drift:s=1.2,period=4") == ("drift", {"s": 1.2, "period": 4})
    assert study.parse_trace("hot_expert:hot_fraction=0.5") == ("hot_expert", {"hot_fraction": 0.5})
    assert study.parse_trace("uniform") == ("uniform", {})
    for bad in ("zipff:s=1", "zipf:s"):
        with pytest.raises(argparse.ArgumentTypeError):
            study.parse_trace(bad)
    for text in study.DEFAULT_TRACES:  # every default trace is a routing the generator makes
        kind, params = study.parse_trace(text)
        routing.make(kind, 0, [4], 16, 2, step=1, **params)


def test_what_each_rank_receives_under_a_physical_routing():
    from cupyep.balance import received
    phys = [np.array([[0, 3], [2, -1]]), np.array([[3, -1], [1, 2]])]  # 4 experts on 2 ranks
    pairs, rows = received(phys, 4, 2)
    assert pairs.tolist() == [2, 4]  # rank 0 holds experts 0, 1; rank 1 experts 2, 3
    assert rows.tolist() == [[1, 2], [1, 2]]  # rows source s sends rank d: a token with a slot there
