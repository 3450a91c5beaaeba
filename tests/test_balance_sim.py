"""cupyep.lab.balance_sim on the CPU: the per-expert counts against
cupyep.routing's token-level generator (mean loads, the drifting order),
the exact inclusion probabilities, the rows estimate against routed tokens,
the arms (per-step balance, none against per-step under skew, EPLB from
history only, the migration arm's moves), the cost model's calibration and
validation on synthetic records, the break-even, the lenient reader, input
checks and the command's outputs. No timing."""
import itertools
import json
import math
import re
import shlex

import numpy as np
import pytest

from cupyep import routing
from cupyep.balance import Placement, physical_topk, rebalance_experts
from cupyep.lab import balance_sim as bs
from dataclasses import replace

MODEL = bs.CostModel.default()
KNOWN = bs.CostModel(ffn_us=35.0, ffn_us_per_pair=0.031, dispatch_us=12.0, dispatch_us_per_row=0.11,
                     combine_us=18.0, combine_us_per_row=0.09, copy_GBps=150.0, plan_us=250.0, other_us=40.0,
                     overhead_us={"none": 3.0, "eplb": 30.0, "migration": 45.0, "per_step": 60.0})


def _routed_counts(kind, seed, R, T, E, k, **params):
    idx, _ = routing.make(kind, seed, [T] * R, E, k, **params)
    return idx, np.bincount(np.concatenate([i.ravel() for i in idx]), minlength=E)


# ----------------------------------------------------------- the counts ---

def _exact_inclusion(p, k):
    """Inclusion probabilities of k draws without replacement, by enumeration."""
    p = np.asarray(p, dtype=np.float64) / np.sum(p)
    pi = np.zeros(p.size)
    for seq in itertools.permutations(range(p.size), k):
        prob, left = 1.0, 1.0
        for e in seq:
            prob *= p[e] / left
            left -= p[e]
        pi[list(seq)] += prob
    return pi


@pytest.mark.parametrize("p,k", [([5, 3, 1, 1, 0.5], 2), ([10, 1, 1, 1, 1, 1, 0.1], 3),
                                 (1 / np.arange(1, 7.0) ** 2, 5), ([1, 2, 3], 3)])
def test_inclusion_probabilities_are_exact_on_small_cases(p, k):
    pi = bs.inclusion_probabilities(p, k)
    assert pi.sum() == pytest.approx(k)
    np.testing.assert_allclose(pi, _exact_inclusion(p, k), atol=1e-9)


# Tolerance of the count generator against routing.make: each expert's
# routed count within 4.5 standard deviations of the simulator's mean load
# (Binomial(N, pi_e) variance), and the total exact to 0.5 %.
@pytest.mark.parametrize("kind,params", [("zipf", {"s": 1.2}), ("zipf", {"s": 0.6}),
                                         ("hot_expert", {"hot_fraction": 0.3}),
                                         ("hot_expert", {"hot_fraction": 0.6, "hot_expert": 5})])
def test_expected_loads_agree_with_routing_make(kind, params):
    R, T, E, k, seed = 8, 2048, 32, 4, 5
    _, counts = _routed_counts(kind, seed, R, T, E, k, **params)
    mean = bs.expected_loads(kind, seed, R * T, E, k, **params)
    N = R * T
    sd = np.sqrt(np.maximum(mean * (1 - mean / N), 1.0))
    assert np.abs(counts - mean).max() <= 4.5 * sd.max(), (counts, mean.round(1))
    assert np.all(np.abs(counts - mean) <= 4.5 * sd)
    assert counts.sum() == pytest.approx(mean.sum(), rel=5e-3)


def test_with_replacement_popularity_would_fail_the_same_check():
    """The check above can fail: k times the popularity (draws with
    replacement) is far outside it for the hot experts."""
    R, T, E, k, seed = 8, 2048, 32, 4, 5
    _, counts = _routed_counts("zipf", seed, R, T, E, k, s=1.2)
    order = bs.expert_order("zipf", seed, E)
    p = np.empty(E)
    p[order] = 1 / np.arange(1, E + 1) ** 1.2
    wrong = R * T * k * p / p.sum()
    assert np.abs(counts - wrong).max() > 4.5 * np.sqrt(wrong.max())


def test_trace_loads_average_to_the_expected_loads():
    N, E, k, S = 4096, 32, 4, 400
    loads = bs.trace_loads("zipf", 3, N, E, k, S, layers=2, s=1.0)
    assert loads.shape == (S, 2, E) and loads.dtype == np.int64 and (loads >= 0).all()
    for layer in range(2):
        mean = bs.expected_loads("zipf", 3 + layer, N, E, k, s=1.0)
        np.testing.assert_allclose(loads[:, layer].mean(0), mean, atol=5 * np.sqrt(mean.max() / S) + 1e-9)
    hot = bs.trace_loads("hot_expert", 0, N, E, k, 20, hot_fraction=0.25, hot_expert=7)
    assert (hot[:, 0, 7] == round(0.25 * N)).all()  # the hot expert's count is exact, as in routing.make
    # the same arguments, the same trace
    assert np.array_equal(loads, bs.trace_loads("zipf", 3, N, E, k, S, layers=2, s=1.0))


def test_drift_moves_the_hot_set_every_period_like_routing():
    if "drift" not in routing.KINDS:
        pytest.skip("cupyep.routing has no drift trace")
    R, T, E, k, seed, period = 8, 1024, 32, 4, 2, 3
    loads = bs.trace_loads("drift", seed, R * T, E, k, 9, s=1.5, period=period)
    hottest = loads[:, 0].argmax(1).reshape(3, period)  # per epoch
    assert (hottest == hottest[:, :1]).all() and len(set(hottest[:, 0].tolist())) > 1
    for step in (0, 4, 8):
        _, counts = _routed_counts("drift", seed, R, T, E, k, s=1.5, period=period, step=step)
        mean = bs.expected_loads("drift", seed, R * T, E, k, step=step, s=1.5, period=period)
        assert np.all(np.abs(counts - mean) <= 4.5 * np.sqrt(np.maximum(mean, 1.0)))
        assert counts.argmax() == mean.argmax()


# ------------------------------------------------------------- the rows ---

def _routed_rows(idx, placement: Placement | None, E, R):
    rows, pairs = np.zeros(R), np.zeros(R)
    for r, a in enumerate(idx):
        if placement is None:
            dest = a // (E // R)
        else:
            dest = physical_topk(a, placement, r, "round_robin") // placement.experts_per_gpu
        pairs += np.bincount(dest.ravel(), minlength=R)
        rows += [(dest == g).any(1).sum() for g in range(R)]
    return pairs, rows


# The tolerance rows_from_slot_pairs states: 2.5 % of each rank's routed
# rows for Zipf s <= 1.2 and hot-expert loads, 4 % at s = 2.
@pytest.mark.parametrize("kind,params,replicas", [("zipf", {"s": 0.0}, False), ("zipf", {"s": 1.2}, False),
                                                  ("zipf", {"s": 2.0}, False), ("zipf", {"s": 2.0}, True),
                                                  ("hot_expert", {"hot_fraction": 0.3}, False),
                                                  ("hot_expert", {"hot_fraction": 0.5}, True),
                                                  ("zipf", {"s": 1.2}, True)])
def test_rows_from_pairs_agree_with_routed_tokens(kind, params, replicas):
    R, T, E, k = 8, 2048, 64, 8
    idx, counts = _routed_counts(kind, 1, R, T, E, k, **params)
    if replicas:
        pl = rebalance_experts(counts[None].astype(float), E + 2 * R, 1, 1, R).layer(0)
        slot = (counts / pl.logcnt[0])[pl.phy2log[0]].reshape(R, -1)
    else:
        pl, slot = None, counts.reshape(R, -1).astype(float)
    pairs, rows = _routed_rows(idx, pl, E, R)
    est = bs.rows_from_slot_pairs(slot, R * T, E, k)
    tol = 0.04 if params.get("s", 0) > 1.2 else 0.025
    assert (np.abs(est - rows) / rows).max() < tol, (est.round(), rows)
    if kind == "zipf" and params["s"] > 0 and not replicas:  # a flat distinct-rank factor misses skew by far more
        D = R * (1 - np.prod([1 - (E / R) / (E - i) for i in range(k)]))
        assert (np.abs(slot.sum(1) * D / k - rows) / rows).max() > 2 * tol
    np.testing.assert_allclose(slot.sum(1), pairs, rtol=0.02)  # round robin splits an expert about evenly


def test_rows_of_equal_loads_are_the_distinct_rank_factor():
    R, E, k, N = 16, 128, 8, 10_000
    slot = np.full((R, E // R), N * k / E)
    D = R * (1 - np.prod([1 - (E / R) / (E - i) for i in range(k)]))
    np.testing.assert_allclose(bs.rows_from_slot_pairs(slot, N, E, k), slot.sum(1) * D / k, rtol=1e-12)


# ------------------------------------------------------------- the arms ---

def test_per_step_reaches_1_05_on_a_hot_expert_and_none_does_not():
    R, E, T, k = 8, 64, 4096, 8
    loads = bs.trace_loads("hot_expert", 0, R * T, E, k, 10, layers=2, hot_fraction=0.5)
    cfg = bs.ArmConfig(redundant=2)
    per_step = bs.simulate(loads, "per_step", R, 8, MODEL, 1 << 20, T, k, cfg)
    none = bs.simulate(loads, "none", R, 8, MODEL, 1 << 20, T, k, cfg)
    assert per_step.imbalance.max() <= 1.05
    assert none.imbalance.min() > 1.25
    assert per_step.num_physical == E + 2 * R and none.num_physical == E
    assert per_step.planned[0].all() and not none.planned.any() and (none.balance_us == 0).all()
    assert not per_step.planned.all()  # a placement that holds a step's loads stays (LayerBalancer's rule)
    every = bs.simulate(loads, "per_step", R, 8, MODEL, 1 << 20, T, k, bs.ArmConfig(redundant=2, tolerance=0))
    assert every.planned.all() and every.imbalance.max() <= 1.05 and every.moved_experts.sum() > \
        per_step.moved_experts.sum()
    # what gpu_loads gives is what the rank holds
    assert np.allclose(per_step.pairs.sum(-1), loads.sum(-1))


@pytest.mark.parametrize("kind,params", [("zipf", {"s": 1.2}), ("hot_expert", {"hot_fraction": 0.3}),
                                         ("drift", {"s": 1.2, "period": 4})])
def test_none_is_slower_than_per_step_under_skew(kind, params):
    R, T, k = 16, 4096, 8
    E = bs.experts_for(R, 4)
    loads = bs.trace_loads(kind, 0, R * T, E, k, 8, **params)
    none = bs.simulate(loads, "none", R, 8, MODEL, 1 << 16, T, k)
    per_step = bs.simulate(loads, "per_step", R, 8, MODEL, 1 << 16, T, k)
    assert none.imbalance.mean() > per_step.imbalance.mean() + 0.05
    assert none.straggler_us.mean() > per_step.straggler_us.mean()
    assert none.layer_us.mean() > per_step.layer_us.mean()  # small experts: the moves cost little


def test_eplb_plans_from_history_only():
    R, T, k, E = 8, 1024, 4, 32
    loads = bs.trace_loads("drift", 0, R * T, E, k, 12, s=1.5, period=4)
    cfg = bs.ArmConfig(redundant=1, period=4, smoothing=0.5)
    base = bs.simulate(loads, "eplb", R, 4, MODEL, 1000, T, k, cfg)
    assert base.planned[:, 0].tolist() == [s > 0 and s % 4 == 0 for s in range(12)]
    changed = loads.copy()
    changed[8, 0] = changed[8, 0, ::-1]  # the step it plans for, and after
    other = bs.simulate(changed, "eplb", R, 4, MODEL, 1000, T, k, cfg)
    assert np.array_equal(base.phy2log[:12], other.phy2log[:12])  # step 8's plan came from steps 0..7
    later = bs.simulate(changed, "eplb", R, 4, MODEL, 1000, T, k, cfg, step_ids=np.arange(1, 13))
    assert later.planned[:, 0].tolist() == [s % 4 == 0 for s in range(1, 13)]  # the steps' own numbers
    # the plan of step 4: rebalance_experts of the moving average of steps 0..3; its move runs during
    # step 4 (which keeps the old placement, as the GPU study's start/finish_migration around it) and
    # it serves from step 5
    avg = loads[0, 0].astype(float)
    for s in (1, 2, 3):
        avg = 0.5 * loads[s, 0] + 0.5 * avg
    want = rebalance_experts(avg[None], E + R, 8, 2, R, policy="hierarchical")
    assert np.array_equal(np.sort(base.phy2log[5, 0].reshape(R, -1), 1), np.sort(want.phy2log[0].reshape(R, -1), 1))
    assert np.array_equal(base.phy2log[4], base.phy2log[3]) and not np.array_equal(base.phy2log[5], base.phy2log[4])
    # the plan's moves are paid in the step that runs it, nowhere else
    moved = base.moved_experts[:, 0] > 0
    assert not moved[~base.planned[:, 0]].any()
    assert (base.balance_us[base.planned] >= MODEL.plan_us + MODEL.overhead_us["eplb"]).all()
    assert (base.balance_us[~base.planned] == MODEL.overhead_us["eplb"]).all()


def test_migration_moves_only_when_it_pays():
    R, T, k, E = 8, 4096, 8, 64
    loads = bs.trace_loads("hot_expert", 0, R * T, E, k, 12, hot_fraction=0.4)
    small = bs.simulate(loads, "migration", R, 8, MODEL, 1 << 10, T, k, bs.ArmConfig(redundant=2))
    huge = bs.simulate(loads, "migration", R, 8, MODEL, 1 << 40, T, k, bs.ArmConfig(redundant=2))
    assert small.moved_experts.sum() > 0 and small.imbalance[-1].max() < small.imbalance[0].max()
    assert huge.moved_experts.sum() == 0  # a terabyte per expert never pays
    assert small.moved_experts[0].sum() == 0  # step 0 has no history to act on


def test_break_even_expert_bytes_is_where_the_speed_up_reaches_one():
    R, T, k = 16, 4096, 8
    E = bs.experts_for(R, 4)
    loads = bs.trace_loads("hot_expert", 0, R * T, E, k, 10, hot_fraction=0.3)
    every = bs.ArmConfig(tolerance=0)  # per_step moving every step: a move cost that grows with the size
    none = bs.simulate(loads, "none", R, 8, MODEL, 1 << 20, T, k)
    res = bs.simulate(loads, "per_step", R, 8, MODEL, 1 << 20, T, k, every)
    b = bs.break_even_expert_bytes(res, none, MODEL, warmup=2)
    assert 0 < b < math.inf
    at = bs.simulate(loads, "per_step", R, 8, MODEL, int(round(b)), T, k, every)
    assert at.layer_us[2:].mean() == pytest.approx(none.layer_us[2:].mean(), rel=1e-6)
    above = bs.simulate(loads, "per_step", R, 8, MODEL, int(2 * b), T, k, every)
    assert above.layer_us[2:].mean() > none.layer_us[2:].mean()
    assert bs.break_even_expert_bytes(none, none, MODEL) is None


def test_break_even_finds_the_sign_change_of_a_sweep():
    rows = [{"param": "period", "trace": "drift", "ranks": 8, "arm": "eplb", "value": v, "net_saving_us": y}
            for v, y in ((1, -30.0), (2, -10.0), (4, 10.0), (8, 50.0))]
    (be,) = bs.break_even(rows)
    assert be["value"] == pytest.approx(3.0) and not be["pays_at_lowest"] and be["pays_at_highest"]


def test_sweep_and_study_rows():
    rows = bs.study([8, 16], 8, [("hot_expert", {"hot_fraction": 0.3})], bs.ARMS, MODEL, 1 << 20, 1024, 8,
                    steps=6, warmup=2, config=bs.ArmConfig(period=2))
    assert len(rows) == 2 * len(bs.ARMS)
    for r in rows:
        assert {"imbalance_mean", "layer_us_mean", "balance_us_mean", "speedup_vs_none", "nodes"} <= set(r)
        assert r["layer_us_mean"] == pytest.approx(r["straggler_us_mean"] + r["balance_us_mean"]
                                                   + MODEL.map_us.get(r["arm"], 0.0) + MODEL.other_us)
        if r["arm"] == "none":
            assert r["speedup_vs_none"] == 1.0 and r["balance_us_mean"] == 0
        else:
            assert r["balance_us_mean"] >= MODEL.overhead_us[r["arm"]]
    assert {r["nodes"] for r in rows} == {1, 2}
    sw = bs.sweep("period", [1, 4], 16, 8, ("drift", {"s": 1.2}), ["eplb", "per_step"], MODEL, 1 << 20, 1024, 8,
                  steps=6, warmup=2)
    assert [(r["value"], r["arm"]) for r in sw] == [(1, "eplb"), (1, "per_step"), (4, "eplb"), (4, "per_step")]
    assert all(r["trace_params"]["period"] == r["value"] for r in sw)


# ------------------------------------------------------ the cost model ---

def test_default_model_says_it_is_a_placeholder():
    assert "placeholder" in bs.CostModel.default().source
    assert bs.CostModel.default().fit_error is None


def test_fit_recovers_known_coefficients_from_noisy_records():
    recs = bs.synthetic_records(KNOWN, steps=6, layers=2, noise=0.01, expert_bytes=4 << 20,
                                config=bs.ArmConfig(redundant=2, period=2))
    fit = bs.CostModel.fit(recs)
    assert fit.source == f"fit on {len(recs)} records"
    for name in ("ffn_us", "ffn_us_per_pair", "dispatch_us", "dispatch_us_per_row", "combine_us",
                 "combine_us_per_row", "copy_GBps", "plan_us", "other_us"):
        got, want, se = getattr(fit, name), getattr(KNOWN, name), fit.fit_error[name]
        assert se is not None and se >= 0
        assert abs(got - want) <= max(5 * se, 1e-6 * abs(want)), (name, got, want, se)
    for name in ("ffn_us_per_pair", "dispatch_us_per_row", "combine_us_per_row", "copy_GBps", "plan_us"):
        assert getattr(fit, name) == pytest.approx(getattr(KNOWN, name), rel=0.05), name
    assert fit.overhead_us == pytest.approx(KNOWN.overhead_us, abs=1e-6)  # balance times carry no noise
    assert set(fit.fit_error["overhead_us"]) == set(bs.ARMS)
    assert 0.005 < fit.fit_error["rel_rms_ffn"] < 0.02  # the 1 % noise, seen


def test_validate_reports_no_error_on_records_of_the_same_model():
    recs = bs.synthetic_records(KNOWN, steps=6, layers=2, config=bs.ArmConfig(redundant=2, period=2))
    fit = bs.CostModel.fit(recs)
    out = bs.validate(recs, fit)
    assert set(out["arms"]) == set(bs.ARMS)
    for arm, v in out["arms"].items():
        assert v["points"] == 3 * 6 * 2
        assert v["worst_rel_err"] < 1e-3 and v["worst_rel_err_cost"] < 1e-6, (arm, v)


def test_validate_sees_a_wrong_model():
    recs = bs.synthetic_records(KNOWN, steps=4, layers=1, config=bs.ArmConfig(redundant=2, period=2))
    wrong = bs.CostModel(**{**KNOWN.to_dict(), "ffn_us_per_pair": 2 * KNOWN.ffn_us_per_pair, "fit_error": None})
    out = bs.validate(recs, wrong)
    assert all(v["median_rel_err"] > 0.1 for v in out["arms"].values())
    # a different arm configuration than the records' is a different simulation
    no_params = [{k: v for k, v in r.items() if k != "arm_params"} for r in recs if r["arm"] == "eplb"]
    moved = bs.validate(no_params, KNOWN, bs.ArmConfig(period=3))
    assert moved["arms"]["eplb"]["worst_rel_err"] > 1e-3


def test_the_tolerance_must_be_a_max_over_mean_or_zero():
    with pytest.raises(ValueError, match="tolerance"):
        bs.ArmConfig(tolerance=0.5)


def test_records_shaped_like_the_gpu_study_fit_and_validate():
    """Without "planned", per-rank moved bytes or arm parameters, and with
    phases the model does not know: a plan is inferred where experts moved,
    the busiest rank's bytes from the moved count."""
    recs = bs.synthetic_records(KNOWN, steps=12, layers=1, config=bs.ArmConfig(tolerance=0))  # moves of many sizes
    for r in recs:
        for key in ("planned", "moved_bytes_per_rank", "arm_params", "synthetic", "first_move"):
            del r[key]
        r["us"].update(host=[5.0] * 8)
    fit = bs.CostModel.fit(recs)
    for name in ("ffn_us_per_pair", "dispatch_us_per_row", "combine_us_per_row", "other_us"):
        assert getattr(fit, name) == pytest.approx(getattr(KNOWN, name), rel=1e-6)
    # the busiest rank's bytes estimated from the moved count (moves spread evenly) bias the bandwidth
    assert fit.copy_GBps == pytest.approx(KNOWN.copy_GBps, rel=0.25)
    out = bs.validate(recs, fit)
    for arm, v in out["arms"].items():
        assert v["median_rel_err"] < 0.02 and v["worst_rel_err"] < 0.05, (arm, v)


def test_fit_needs_the_copy_bandwidth_when_nothing_moved():
    recs = bs.synthetic_records(KNOWN, steps=4, layers=1, arms=("none",))
    with pytest.raises(ValueError, match="plan_us"):
        bs.CostModel.fit(recs)
    with pytest.raises(ValueError, match="copy_GBps"):
        bs.CostModel.fit(recs, plan_us=5.0)
    fit = bs.CostModel.fit(recs, copy_GBps=100.0, plan_us=5.0)
    assert (fit.copy_GBps, fit.plan_us) == (100.0, 5.0) and fit.fit_error["copy_GBps"] is None
    assert fit.overhead_us == {"none": pytest.approx(KNOWN.overhead_us["none"])}


# ----------------------------------------------------------- the records ---

def test_read_records_is_lenient(tmp_path):
    recs = bs.synthetic_records(KNOWN, steps=2, layers=1, arms=("none",), traces=(("zipf", {"s": 1.0}),))
    for r in recs:
        del r["us"]["balance"], r["ranks_per_node"], r["moved_bytes"], r["moved_bytes_per_rank"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + "{cut short\n"
                    + json.dumps({"study": "other", "x": 1}) + "\n")
    got = bs.read_records(path)
    assert len(got) == 2
    assert (got[0]["us"]["balance"] == 0).all() and got[0]["ranks_per_node"] == 8 and got[0]["balance_us"] == 0
    assert got[0]["pairs_per_rank"].dtype == np.float64 and got[0]["logical_loads"].shape == (64,)


def test_bad_input_raises_value_error_naming_it(tmp_path):
    loads = np.ones((2, 1, 16))
    with pytest.raises(ValueError, match="kind"):
        bs.trace_loads("uniform", 0, 100, 16, 2, 2)
    with pytest.raises(ValueError, match="hot_fraction"):
        bs.trace_loads("hot_expert", 0, 100, 16, 2, 2, hot_fraction=1.5)
    with pytest.raises(ValueError, match="params"):
        bs.trace_loads("zipf", 0, 100, 16, 2, 2, hot_fraction=0.5)
    with pytest.raises(ValueError, match="steps"):
        bs.trace_loads("zipf", 0, 100, 16, 2, 0)
    with pytest.raises(ValueError, match="num_topk"):
        bs.inclusion_probabilities([1, 1], 0)
    with pytest.raises(ValueError, match="arm"):
        bs.simulate(loads, "greedy", 4, 4, MODEL, 1, 10, 2)
    with pytest.raises(ValueError, match="gpus_per_node"):
        bs.simulate(loads, "none", 4, 3, MODEL, 1, 10, 2)
    with pytest.raises(ValueError, match="loads"):
        bs.simulate(-loads, "none", 4, 4, MODEL, 1, 10, 2)
    with pytest.raises(ValueError, match="ranks"):
        bs.simulate(np.ones((2, 1, 15)), "none", 4, 4, MODEL, 1, 10, 2)
    with pytest.raises(ValueError, match="groups_per_node"):
        bs.simulate(np.ones((2, 1, 12)), "eplb", 4, 2, MODEL, 1, 10, 2, bs.ArmConfig(groups_per_node=4))
    with pytest.raises(ValueError, match="step_ids"):
        bs.simulate(loads, "eplb", 4, 4, MODEL, 1, 10, 2, step_ids=[3, 1])
    with pytest.raises(ValueError, match="model"):
        bs.simulate(loads, "none", 4, 4, None, 1, 10, 2)
    with pytest.raises(ValueError, match="overlap"):
        bs.ArmConfig(overlap=2.0)
    with pytest.raises(ValueError, match="copy_GBps"):
        bs.CostModel(1, 1, 1, 1, 1, 1, copy_GBps=0.0)
    with pytest.raises(ValueError, match="num_experts"):
        bs.experts_for(8, num_experts=12)
    with pytest.raises(ValueError, match="records"):
        bs.validate([{"arm": "none"}], MODEL)
    with pytest.raises(ValueError, match="records"):
        bs.read_records(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="param"):
        bs.sweep("tokens", [1], 8, 8, ("drift", {}), ["eplb"], MODEL, 1)


# ------------------------------------------------------------ the command ---

def test_command_writes_records_and_manifest(tmp_path, capsys):
    src = tmp_path / "synthetic.jsonl"
    assert bs.main(["--write-synthetic", str(src)]) == 0
    out = tmp_path / "sim" / "sim.jsonl"
    argv = ["--records", str(src), "--ranks", "16", "32", "--steps", "6", "--period", "2",
            "--drift-periods", "1", "4", "--expert-bytes-sweep", "1e5", "1e9", "--sweep-ranks", "16",
            "--out", str(out)]
    assert bs.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds[0] == "cost_model" and kinds.count("validation") == len(bs.ARMS)
    assert kinds.count("summary") == 2 * 3 * len(bs.ARMS)  # ranks x default traces x arms
    assert kinds.count("sweep") == 4 * 3 and kinds.count("break_even") == 2 * 3
    assert all(r["worst_rel_err"] < 1e-3 for r in rows if r["kind"] == "validation")
    manifest = json.loads((out.parent / "manifest.json").read_text())
    (rec,) = manifest["records"]  # the layout tests/test_results_dataset.py holds a results study to
    assert rec["files"] == ["sim.jsonl"] and shlex.split(rec["command"])[-1] == str(out)
    assert shlex.split(rec["command"])[:3] == ["python", "-m", "cupyep.lab.balance_sim"]
    assert rec["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", rec["commit"])
    assert {"python", "numpy", "host"} <= set(rec["environment"]) and rec["inputs"] == [str(src)]
    assert manifest["num_records"] == 288
    assert manifest["placeholder_model"] is False and manifest["arm_config"]["period"] == 2
    assert "speed-up" in capsys.readouterr().out
    assert bs.main(["--ranks", "16", "--out", str(out)]) == 2  # neither records nor --default-model
    assert "--records" in capsys.readouterr().err


# ------------------------------------------- non-negative costs, waits ---

def _brute_nnls(A, b):
    """min |A x - b| over x >= 0 by trying every set of free coefficients."""
    best, best_x = math.inf, None
    n = A.shape[1]
    for k in range(n + 1):
        for free in itertools.combinations(range(n), k):
            x = np.zeros(n)
            if free:
                x[list(free)] = np.linalg.lstsq(A[:, list(free)], b, rcond=None)[0]
            if (x >= -1e-12).all():
                r = np.linalg.norm(A @ x - b)
                if r < best - 1e-12:
                    best, best_x = r, np.clip(x, 0, None)
    return best_x


@pytest.mark.parametrize("seed", range(8))
def test_nnls_is_the_constrained_optimum(seed):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((12, 5))
    b = rng.standard_normal(12) * 3
    x = bs.nnls(A, b)
    assert (x >= 0).all()
    np.testing.assert_allclose(x, _brute_nnls(A, b), atol=1e-8)
    if (np.linalg.lstsq(A, b, rcond=None)[0] < 0).any():  # the bound binds somewhere
        assert (x == 0).any()


def test_a_cost_is_never_negative():
    """Balancing times below what the other arms' costs explain would give
    an unconstrained least squares a negative overhead; the fit holds it at
    0 and says so."""
    recs = bs.synthetic_records(KNOWN, steps=6, layers=1, config=bs.ArmConfig(redundant=2, period=2))
    for r in recs:
        if r["arm"] == "migration":
            r["us"]["balance"] = [max(v - 300.0, 0.0) for v in r["us"]["balance"]]
    norm = bs.read_records(recs)
    y = np.array([r["balance_us"] for r in norm])
    arms = sorted(bs.ARMS)
    A = np.array([[r["arm"] == a for a in arms] + [bs._planned(r), r["busiest_bytes"] / 1e6] for r in norm], float)
    assert np.linalg.lstsq(A, y, rcond=None)[0][arms.index("migration")] < 0  # what least squares would say
    fit = bs.CostModel.fit(recs)
    assert fit.overhead_us["migration"] == 0.0 and "overhead_us[migration]" in fit.fit_error["at_bound"]
    for name in bs._NUMBERS:
        assert getattr(fit, name) >= 0, name
    assert all(v >= 0 for d in (fit.overhead_us, fit.map_us) for v in d.values())
    with pytest.raises(ValueError, match="overhead_us must map arms .* >= 0"):
        bs.CostModel(**{**KNOWN.to_dict(), "fit_error": None, "overhead_us": {"migration": -1.0}})
    with pytest.raises(ValueError, match="combine_us_per_row"):
        bs.CostModel(**{**KNOWN.to_dict(), "fit_error": None, "combine_us_per_row": -0.1})


def test_fit_reads_each_ranks_own_work_not_its_waits():
    """A rank's combine holds its wait for the slowest rank's FFN: the
    ranks with the fewest rows wait longest, so the combine against rows of
    every rank falls (the slope a plain fit of all ranks would take);
    CostModel.fit reads the combine of the rank whose FFN ended last and the
    dispatch less its wait for the last sender."""
    recs = bs.synthetic_records(KNOWN, steps=6, layers=1, noise=0.005, config=bs.ArmConfig(redundant=2, period=2))
    none = [r for r in recs if r["arm"] == "none"]
    rows = np.concatenate([r["rows_per_rank"] for r in none])
    comb = np.concatenate([r["us"]["combine"] for r in none])
    assert np.polyfit(rows, comb, 1)[0] < 0
    fit = bs.CostModel.fit(recs)
    for name in ("combine_us_per_row", "dispatch_us_per_row"):
        assert getattr(fit, name) == pytest.approx(getattr(KNOWN, name), rel=0.1), name
    for name in ("combine_us", "dispatch_us"):
        assert abs(getattr(fit, name) - getattr(KNOWN, name)) < 5 * fit.fit_error[name], name


def test_the_none_stragglers_ffn_grows_in_proportion_to_its_pairs():
    """At 16 to 256 ranks a hot expert holding half the tokens puts R T / 2
    pairs on one rank: the simulated straggler's FFN is a + b * those pairs,
    and the straggler time (FFN, dispatch and combine) grows with them."""
    T, k = 1024, 8
    fit = bs.CostModel.fit(bs.synthetic_records(KNOWN, steps=4, layers=1, tokens=T,
                                                config=bs.ArmConfig(redundant=2, period=2, tolerance=0)))
    out = {}
    for R in (16, 64, 256):
        loads = bs.trace_loads("hot_expert", 0, R * T, 4 * R, k, 2, hot_fraction=0.5)
        res = bs.simulate(loads, "none", R, 8, fit, 1 << 20, T, k)
        top = res.pairs.max(-1)
        assert (top > 0.5 * R * T).all()  # the hot expert's rank (and its other experts)
        hot = res.pairs.argmax(-1)[..., None]
        rows = np.take_along_axis(res.rows, hot, -1)[..., 0]
        ffn_part = res.straggler_us - fit.dispatch(rows) - fit.combine(rows)
        np.testing.assert_allclose(ffn_part, fit.ffn(top), rtol=1e-12)  # the hot rank is the straggler
        out[R] = (float(top.mean()), float(res.straggler_us.mean()), float((ffn_part - fit.ffn_us).mean()))
    for R in (64, 256):
        grow = out[R][0] / out[16][0]
        assert grow > 0.5 * R / 16
        assert out[R][2] / out[16][2] == pytest.approx(grow, rel=1e-9)  # b * pairs, in proportion
        assert out[R][1] / out[16][1] > 0.8 * grow  # the whole straggler grows with it


def test_first_move_setup_is_its_own_term():
    model = replace(KNOWN, setup_us=50_000.0)
    recs = bs.synthetic_records(model, steps=8, layers=2, noise=0.0, config=bs.ArmConfig(redundant=2, period=2))
    assert sum(r["first_move"] for r in recs) == 3 * 2 * 3  # traces x layers x (eplb, migration, per_step)
    fit = bs.CostModel.fit(recs)
    assert fit.setup_us == pytest.approx(50_000.0, rel=1e-6) and fit.fit_error["first_moves"] == 18
    assert fit.plan_us == pytest.approx(KNOWN.plan_us, rel=1e-6)  # the setup does not leak into the plan
    out = bs.validate(recs, fit)
    for v in out["arms"].values():
        assert v["worst_rel_err"] < 1e-4 and v["worst_rel_err_steady"] < 1e-4  # pairs and rows rounded
    assert out["arms"]["eplb"]["steady_points"] == out["arms"]["eplb"]["points"] - 6
    # a model without the term misses exactly the first moves
    out = bs.validate(recs, replace(fit, setup_us=0.0))
    assert out["arms"]["eplb"]["worst_rel_err"] > 0.5 and out["arms"]["eplb"]["worst_rel_err_steady"] < 1e-4
    # the study's means leave the one-off setup out and report it apart
    loads = bs.trace_loads("hot_expert", 0, 16 * 1024, 64, 8, 8, hot_fraction=0.3)
    res = bs.simulate(loads, "per_step", 16, 8, fit, 1 << 20, 1024, 8)
    assert res.first_move[:, 0].tolist() == [True] + [False] * 7 and res.setup_us[0, 0] == 50_000.0
    row = bs._summary(res, None, 0)
    assert row["setup_us_total"] == 50_000.0
    assert row["layer_us_mean"] == pytest.approx(float((res.layer_us - res.setup_us).mean()))
    moved = bs.simulate(loads, "per_step", 16, 8, fit, 1 << 20, 1024, 8, moved_before=True)
    assert not moved.first_move.any()


def test_the_plan_cost_grows_with_the_experts_planned():
    m = replace(KNOWN, plan_experts=64, plan_exponent=1.0)
    assert m.plan_cost(64) == KNOWN.plan_us and m.plan_cost(8192) == pytest.approx(128 * KNOWN.plan_us)
    assert replace(m, plan_exponent=0.0).plan_cost(8192) == KNOWN.plan_us
    assert replace(m, plan_experts=0).plan_cost(8192) == KNOWN.plan_us
    loads = bs.trace_loads("zipf", 0, 64 * 512, 256, 8, 3, s=1.2)
    res = bs.simulate(loads, "per_step", 64, 8, m, 0, 512, 8, bs.ArmConfig(tolerance=0))  # a plan every step
    assert res.balance_us == pytest.approx(np.full((3, 1), KNOWN.overhead_us["per_step"] + 4 * KNOWN.plan_us))


def test_migration_moves_in_the_step_after_its_plan_and_serves_from_the_next():
    R, T, k, E = 8, 4096, 8, 64
    loads = bs.trace_loads("hot_expert", 0, R * T, E, k, 6, hot_fraction=0.4)
    res = bs.simulate(loads, "migration", R, 8, KNOWN, 1 << 10, T, k, bs.ArmConfig(redundant=2))
    moved = res.moved_experts[:, 0] > 0
    s = int(np.argmax(moved))
    assert s >= 1 and res.planned[s - 1, 0]  # planned after step s - 1, moved during step s
    assert np.array_equal(res.phy2log[s], res.phy2log[s - 1])  # step s still runs on the old placement
    assert res.imbalance[s + 1, 0] < res.imbalance[s, 0] - 0.1


def test_history_loads_regenerate_the_warm_up_of_routing_traces():
    R, T, E, k = 8, 512, 32, 4
    counts = [_routed_counts("drift", 0, R, T, E, k, s=1.2, period=2, step=s)[1] for s in range(4)]
    rec = {"trace": "drift", "trace_params": {"s": 1.2, "period": 2}, "tokens": T, "ranks": R, "experts": E,
           "topk": k, "step": 3, "layer": 0, "logical_loads": counts[3]}
    past = bs.history_loads(rec, [0, 1, 2], [0])
    assert past.shape == (3, 1, E) and np.array_equal(past[:, 0], np.array(counts[:3]))
    assert bs.history_loads({**rec, "logical_loads": counts[2]}, [0, 1, 2], [0]) is None  # not this trace
    assert bs.history_loads({**rec, "trace": "unknown"}, [0], [0]) is None


def _real_records():
    from pathlib import Path
    files = sorted(Path(__file__).resolve().parents[1].glob("results/balance_study/study_8ranks_run*.jsonl"))
    if not files:
        pytest.skip("no measured balance-study records in results/balance_study/")
    return bs.read_records(files)


def test_the_fit_on_the_measured_records_is_non_negative_and_scales():
    """The measured 8-rank records: every fitted cost >= 0, the combine and
    dispatch grow with the rows, and at 256 ranks the none arm's straggler
    on a hot expert takes the FFN of its pairs."""
    recs = _real_records()
    fit = bs.CostModel.fit(recs)
    for name in bs._NUMBERS:
        assert getattr(fit, name) >= 0, name
    assert all(v >= 0 for d in (fit.overhead_us, fit.map_us) for v in d.values())
    assert fit.combine_us_per_row > 0 and fit.dispatch_us_per_row > 0 and fit.ffn_us_per_pair > 0.5
    R, T, k = 256, 4096, 8
    loads = bs.trace_loads("hot_expert", 0, R * T, 8 * R, k, 2, hot_fraction=0.5)
    res = bs.simulate(loads, "none", R, 8, fit, 8 << 20, T, k)
    assert (res.straggler_us >= fit.ffn(res.pairs.max(-1))).all()
    assert res.straggler_us.min() > 0.4 * fit.ffn_us_per_pair * R * T
