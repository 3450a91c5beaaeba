"""cupyep.balance.LayerBalancer on the CPU: a stand-in layer that records
its moves, one rank or several whose exchange stacks every rank's counts."""
import numpy as np
import pytest

from cupyep import routing
from cupyep.balance import LayerBalancer, MigrationPolicy, Placement, align, per_step_decision, rebalance_experts, step_loads
from cupyep.balance.layer import MIN_GAIN

E, R, K, T = 32, 4, 4, 64


class _Group:
    def __init__(self, others=()):
        self.others = list(others)  # the other ranks' count rows, as they would arrive

    def exchange(self, mine, phase):
        assert phase == "balance: expert loads"
        return np.stack([mine] + self.others)


class _Layer:
    """What LayerBalancer uses of cupyep.moe.MoELayer: a placement, moves."""

    def __init__(self, placement, group):
        self.placement, self.buffer = placement, type("B", (), {"group": group})()
        self.moves, self._next, self.prepared = [], None, 0

    def prepare_migration(self):
        self.prepared += 1

    def start_migration(self, placement):
        assert self._next is None
        self._next = align(self.placement, placement)
        self.moves.append("start")

    def finish_migration(self):
        self.placement, self._next = self._next, None
        self.moves.append("finish")


def _uniform_plan():
    return rebalance_experts(np.ones((1, E)), E + 2 * R, 1, 1, R).layer(0)


def _trace(step, kind="hot_expert", **params):
    idx, _ = routing.make(kind, 1, [T] * R, E, K, step=step, **params)
    return idx


def test_step_loads_sums_every_rank_s_pairs_per_expert():
    idx = _trace(0, hot_fraction=0.5)
    mine = np.bincount(idx[0][idx[0] >= 0], minlength=E)
    others = [np.bincount(i[i >= 0], minlength=E) for i in idx[1:]]
    got = step_loads(_Group(others), idx[0], E)
    assert np.array_equal(got, sum([mine] + others)) and got.dtype == np.int64


def test_per_step_balances_each_step_for_its_own_loads_before_it_runs():
    layer = _Layer(_uniform_plan(), _Group())
    bal = LayerBalancer(layer, "per_step")
    for step in range(4):
        idx = _trace(step, kind="drift", s=1.4, period=1)  # the hot set moves every step
        loads = np.concatenate([np.bincount(i[i >= 0], minlength=E)[None] for i in idx]).sum(0)
        bal.group = _Group([np.bincount(i[i >= 0], minlength=E) for i in idx[1:]])  # this step's other ranks
        did = bal.before(idx[0])
        assert did["planned"] and layer.moves[-1:] in ([], ["finish"])  # finished before the forward
        gpu = layer.placement.gpu_loads(loads[None])[0]
        assert gpu.max() / gpu.mean() <= 1.05, (step, gpu)
        assert bal.after(idx[0]) == {"alarm": False}


def test_per_step_keeps_a_placement_that_already_holds_the_step_s_loads():
    layer = _Layer(_uniform_plan(), _Group())
    bal = LayerBalancer(layer, "per_step", tolerance=1.05)
    assert layer.prepared == 1  # the weights are registered when the balancer is made, not in a step
    planned = []
    for step in range(6):
        idx = _trace(step, hot_fraction=0.8)  # a steady hot expert: new tokens each step, the same skew
        loads = np.concatenate([np.bincount(i[i >= 0], minlength=E)[None] for i in idx]).sum(0)
        bal.group = _Group([np.bincount(i[i >= 0], minlength=E) for i in idx[1:]])
        before = layer.placement.gpu_loads(loads[None])[0]
        did = bal.before(idx[0])
        planned.append(did["planned"])
        assert did["planned"] == (before.max() / before.mean() > 1.05)  # re-planned exactly when it is off
        if did["moved_experts"]:  # and moved only for a plan that beats the current one
            after = layer.placement.gpu_loads(loads[None])[0]
            assert after.max() / after.mean() <= before.max() / before.mean() - MIN_GAIN
        gpu = layer.placement.gpu_loads(loads[None])[0]
        assert gpu.max() / gpu.mean() <= 1.05, (step, gpu)  # every step still runs within the tolerance
        bal.after(idx[0])
    assert planned[0] and planned.count(True) < len(planned) // 2, planned
    always = _Layer(_uniform_plan(), _Group())
    bal = LayerBalancer(always, "per_step", tolerance=1.0)
    idx = _trace(0, hot_fraction=0.8)
    bal.group = _Group([np.bincount(i[i >= 0], minlength=E) for i in idx[1:]])
    assert bal.before(idx[0])["planned"]


def test_eplb_plans_every_period_from_past_loads_only_and_moves_beside_the_step():
    layer = _Layer(_uniform_plan(), _Group())
    bal = LayerBalancer(layer, "eplb", period=2, smoothing=1.0)  # the average is the last step's loads
    seen = []
    for step in range(5):
        idx = _trace(step, hot_fraction=0.6, hot_expert=step)  # the hot expert changes every step
        bal.group = _Group([np.bincount(i[i >= 0], minlength=E) for i in idx[1:]])
        did = bal.before(idx[0])
        seen.append(did["planned"])
        if did["moved_experts"]:
            assert layer.moves[-1] == "start"  # in flight during the forward
            # planned from the past: the previous step's hot expert got replicas, this step's did not
            nxt = layer._next
            assert nxt.logcnt[0, step - 1] > 1 and nxt.logcnt[0, step] == 1
        bal.after(idx[0])
        assert layer._next is None  # committed after it
    assert seen == [False, False, True, False, True]


def test_online_moves_only_when_the_policy_says_it_pays():
    idx = _trace(0, hot_fraction=0.6)
    others = [np.bincount(i[i >= 0], minlength=E) for i in idx[1:]]
    for us_per_pair, moves in ((1.0, True), (0.0, False)):  # a free FFN never pays for a move
        layer = _Layer(_uniform_plan(), _Group(others))
        policy = MigrationPolicy(bytes_per_expert=1 << 20, copy_GBps=100.0, us_per_pair=us_per_pair)
        bal = LayerBalancer(layer, "online", policy=policy, alarm=1.01, smoothing=1.0)
        assert bal.before(idx[0])["planned"] is False
        assert bal.after(idx[0]) == {"alarm": True}
        did = bal.before(idx[0])
        assert (did["moved_experts"] > 0) == moves
        bal.after(idx[0])
        assert bal.before(idx[0])["moved_experts"] == 0  # the same plan is not moved to twice


@pytest.mark.parametrize("kwargs,match", [({"mode": "sometimes"}, "mode"), ({"mode": "eplb", "period": 0}, "period"),
                                          ({"mode": "eplb", "smoothing": 0.0}, "smoothing"),
                                          ({"mode": "online"}, "policy"),
                                          ({"mode": "per_step", "tolerance": 0.99}, "tolerance")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerBalancer(_Layer(_uniform_plan(), _Group()), **kwargs)
    with pytest.raises(ValueError, match="placement"):
        LayerBalancer(_Layer(None, _Group()), "per_step")


def test_a_placement_of_the_identity_kind_is_accepted():
    layer = _Layer(Placement.identity(1, E, R), _Group())
    assert LayerBalancer(layer, "per_step").num_logical == E


def test_the_per_step_rule_plans_above_the_tolerance_and_not_again_where_a_plan_did_not_pay():
    start = _uniform_plan()
    plan = lambda w: rebalance_experts(np.asarray(w, float)[None], E + 2 * R, 1, 1, R).layer(0)  # noqa: E731
    even = np.full(E, 100.0)
    assert per_step_decision(start, even, plan, 1.05) == (False, None, 1.0)
    hot = even.copy()
    hot[0] = 5000.0
    planned, new, floor = per_step_decision(start, hot, plan, 1.05)
    gpu, cur = new.gpu_loads(hot[None])[0], start.gpu_loads(hot[None])[0]
    assert planned and floor == 1.0 and gpu.max() / gpu.mean() <= cur.max() / cur.mean() - MIN_GAIN
    assert gpu.max() / gpu.mean() - 1 <= (cur.max() / cur.mean() - 1) / 2  # it removed half the excess at least
    # the same loads again, held to 1.0: the plan cannot beat itself, and the floor remembers where it stood
    planned, none, floor = per_step_decision(new, hot, plan, 1.0)
    assert planned and none is None and floor == pytest.approx(gpu.max() / gpu.mean() + MIN_GAIN)
    assert per_step_decision(new, hot, plan, 1.0, floor) == (False, None, floor)  # not tried again
    assert per_step_decision(start, hot, plan, 1.0, floor)[1] is not None  # loads past the floor plan again
    assert per_step_decision(start, even, plan, 0)[0]  # 0: every step


def test_the_committed_study_s_per_step_decisions_are_the_rule_s():
    """Replayed on the loads of the committed balance study (results/balance_study), the rule plans and
    moves on exactly the steps the GPU runs planned and moved."""
    import json
    from pathlib import Path
    from cupyep.balance import replan
    files = sorted((Path(__file__).resolve().parents[1] / "results" / "balance_study").glob("study_8ranks_run*.jsonl"))
    assert files
    for path in files:
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs = {}
        for r in recs:
            if r["arm"] == "per_step":
                runs.setdefault((r["trace"], json.dumps(r["trace_params"])), []).append(r)
        for key, rs in runs.items():
            placement, floor = None, 1.0
            for r in sorted(rs, key=lambda r: r["step"]):
                loads = np.asarray(r["logical_loads"], dtype=np.float64)
                if placement is None:  # the placement the recorded steps start from is not recorded: plan one
                    placement = replan(rebalance_experts(np.ones((1, r["experts"])), r["physical_experts"], 1, 1,
                                                         r["ranks"]).layer(0), loads)
                    continue
                planned, new, floor = per_step_decision(placement, loads, lambda w: replan(placement, w),
                                                        r["tolerance"], floor)
                assert planned == r["planned"], (path.name, key, r["step"])
                assert (new is not None) == (r["moved_experts"] > 0), (path.name, key, r["step"])
                placement = new or placement
