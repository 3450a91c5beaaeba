"""Host side of the two-hop dispatch (cupyep.internode): the plan each rank
computes from the allgathered counts is the one the hop-by-hop emulation
checks against the one-node dispatch (cupyep.reference.internode)."""
import numpy as np
import pytest

from cupyep import internode as INTER
from cupyep.reference import internode as I
from cupyep.reference.layout import get_dispatch_layout
from cupyep.testing import global_routing


class _Comm:
    def __init__(self, per_rank_values):
        self.values = per_rank_values  # list of queues: what allgather returns, call by call
        self.calls = 0

    def allgather(self, _mine):
        out = self.values[self.calls]
        self.calls += 1
        return out


class _Group:
    def __init__(self, comm):
        self.comm = comm

    def exchange(self, _mine, _phase):  # what every rank contributes, stacked (the fake knows them all)
        return np.stack(self.comm.allgather(_mine))


@pytest.mark.parametrize("R,K", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_each_ranks_plan_is_the_reference_plan(R, K):
    E, T = 48, 30
    tokens = [T if r != 2 else 0 for r in range(R)]
    idx, _ = global_routing(9, tokens, E, 4)
    lays = [get_dispatch_layout(i, E, R, K) for i in idx]
    per_rank = [l.num_tokens_per_rank.astype(np.int64) for l in lays]
    per_node = [l.num_tokens_per_node.astype(np.int64) for l in lays]
    plan = I.two_hop_plan(idx, E, R, K)
    for me in range(R):
        d = INTER.TwoHopDispatch.__new__(INTER.TwoHopDispatch)
        d.R, d.K, d.N, d.me, d.E = R, K, R // K, me, E
        d.group = _Group(_Comm([[np.concatenate([a, b]) for a, b in zip(per_rank, per_node)]]))
        counts, node_counts, rpm, head, slot, net_count = d._plan(idx[me])
        assert np.array_equal(rpm, plan.rank_prefix_matrix)
        assert np.array_equal(head, plan.send_head[me]) and np.array_equal(slot, plan.rdma_slot[me])
        # My network buffer's blocks, in source-node order, hold what the plan puts there.
        assert int(net_count.sum()) == int(plan.rdma_rows[me])
        starts = np.concatenate([[0], np.cumsum(net_count)[:-1]])
        for m in range(R // K):
            s = m * K + me % K
            if m != me // K:
                assert plan.rdma_block[me, s] == starts[m]


def test_network_row_layout():
    assert INTER.row_stride(7168, 8, 4) == 14512  # 14336 payload + 168 metadata, rounded up to 16
    assert INTER.row_stride(128, 1, 3) % 16 == 0 and INTER.row_stride(128, 1, 3) >= 256 + 8 * 6


def test_hop_times_are_differences_of_the_stamps_and_none_where_unwritten():
    assert INTER.hop_times_us([1000, 4000, 9000, 10000], INTER.DISPATCH_HOPS) == {
        "network": 3.0, "forward": 5.0, "total": 9.0}
    assert INTER.hop_times_us([1000, 4000, 9000, 10000], INTER.COMBINE_HOPS) == {
        "node": 3.0, "network": 5.0, "reduce": 1.0, "total": 9.0}
    unset = INTER.hop_times_us(list(INTER.HOP_STAMPS_INIT), INTER.DISPATCH_HOPS)
    assert unset == {"network": None, "forward": None, "total": None}
    with pytest.raises(ValueError):
        INTER.hop_times_us([1, 2, 3], INTER.DISPATCH_HOPS)
