"""cupyep.lab.advisor: the rules, the measured crossover and the transport choice."""
import math

import pytest

from cupyep.lab import advisor as A


def _records(ranks=8, ll=None, normal=None, direct=None):
    ll = ll or {1: (10.0, 12.0), 64: (30.0, 60.0), 256: (200.0, 400.0), 1024: (900.0, 1800.0)}
    normal = normal or {64: (300.0, 300.0), 256: (350.0, 350.0), 1024: (700.0, 700.0), 4096: (2400.0, 2200.0)}
    recs = []
    for t, (d, c) in ll.items():
        recs += [{"bench": "low_latency", "kind": "dispatch_fp8", "ranks": ranks, "tokens": t, "kernel_median_us": d},
                 {"bench": "low_latency", "kind": "combine", "ranks": ranks, "tokens": t, "kernel_median_us": c}]
    for t, (d, c) in normal.items():
        recs += [{"bench": "normal", "kind": "dispatch_bf16_notify", "ranks": ranks, "tokens": t, "time_us": d},
                 {"bench": "normal", "kind": "combine_bf16", "ranks": ranks, "tokens": t, "time_us": c}]
    for t, (d, c) in (direct or {}).items():
        recs += [{"bench": "normal", "kind": "dispatch_bf16_notify_direct", "ranks": ranks, "tokens": t, "time_us": d},
                 {"bench": "normal", "kind": "combine_bf16_direct", "ranks": ranks, "tokens": t, "time_us": c}]
    return recs


def test_mode_times_pairs_dispatch_and_combine_and_skips_other_boundaries():
    recs = _records() + [{"bench": "normal", "kind": "combine_bf16", "ranks": 8, "tokens": 64, "time_us": 1.0,
                          "timing": "deepep"},
                         {"bench": "normal", "kind": "combine_bf16", "ranks": 8, "tokens": 64, "time_us": 1.0,
                          "sweep": True}]
    assert A.mode_times(recs, 8, "low_latency")[64] == 90.0
    assert A.mode_times(recs, 8, "normal") == {64: 600.0, 256: 700.0, 1024: 1400.0, 4096: 4600.0}
    assert A.mode_times(recs, 4, "normal") == {}


def test_crossover_is_interpolated_in_log_log():
    recs = _records()
    x = A.crossover_tokens(recs, 8)
    # At 64 tokens low-latency takes 90 us against 600, at 256 tokens 600 against 700, at 1024 2700 against 1400.
    d0, d1 = math.log(1400 / 2700), math.log(700 / 600)  # the sign changes between 256 and 1024
    f = math.log(700 / 600) / (math.log(700 / 600) - math.log(1400 / 2700))
    assert d1 > 0 > d0
    assert x == pytest.approx(math.exp(math.log(256) + f * (math.log(1024) - math.log(256))))
    assert A.crossover_tokens(recs, 4) is None
    # Normal measured only where low-latency was not: nothing to compare.
    assert A.crossover_tokens(_records(ll={1: (10, 10), 128: (40, 60)}, normal={4096: (2000, 2000)}), 8) is None


def test_advice_follows_the_measured_crossover():
    recs = _records()
    x = A.crossover_tokens(recs, 8)
    lo, hi = A.advise(int(x) - 20, 8, records=recs), A.advise(int(x) + 20, 8, records=recs)
    assert lo.mode == "low_latency" and lo.transport is None and lo.calibrated
    assert hi.mode == "normal" and hi.calibrated and hi.crossover_tokens == pytest.approx(x)
    assert "measured crossover" in lo.reasons[0]


def test_uncalibrated_rules():
    a = A.advise(32, 8)
    assert (a.mode, a.calibrated, a.crossover_tokens) == ("low_latency", False, A.DEFAULT_CROSSOVER)
    assert a.reasons[0].startswith("uncalibrated")
    assert A.advise(4096, 8).mode == "normal" and A.advise(4096, 8).transport == "direct"
    assert A.advise(32, 8, latency_sensitive=False).mode == "normal"
    assert A.advise(100, 8).mode == "low_latency" and A.advise(200, 8).mode == "normal"


def test_memory_budget_and_skew_send_to_normal_mode():
    a = A.advise(32, 8, memory_budget_bytes=1 << 20)
    assert a.mode == "normal" and "over the budget" in a.reasons[1]
    b = A.advise(32, 8, imbalance_factor=A.SEVERE_IMBALANCE + 1)
    assert b.mode == "normal" and any("straggler" in r for r in b.reasons) and b.warnings
    c = A.advise(32, 8, imbalance_factor=A.LOAD_BALANCE_AT + 0.5)
    assert c.mode == "low_latency" and "balance the load" in c.warnings[0]
    with pytest.raises(ValueError):
        A.advise(0, 8)


def test_transport_is_the_measured_faster_one():
    recs = _records(direct={4096: (1700.0, 2100.0)})
    a = A.advise(4096, 8, records=recs)
    assert a.transport == "direct" and "measured faster at 4096" in a.reasons[-1]
    recs = _records(direct={4096: (3000.0, 3000.0)})
    assert A.advise(4096, 8, records=recs).transport == "queue"


def test_sweep_records_of_the_two_studies_do_not_mix():
    """Sweep records carry "study", not "bench": a normal-mode cached
    dispatch_bf16 must not count as a low-latency dispatch_bf16."""
    from cupyep.lab import advisor
    ll = [{"study": "low_latency", "kind": k, "ranks": 8, "tokens": 64, "timing": "strict", "time_us": t}
          for k, t in (("dispatch_bf16", 30.0), ("combine", 40.0))]
    normal = [{"study": "normal", "kind": "dispatch_bf16", "measured_kind": "dispatch_bf16", "ranks": 8,
               "tokens": 64, "timing": "strict", "time_us": 5000.0},
              {"study": "normal", "kind": "combine_bf16", "measured_kind": "combine_bf16", "ranks": 8,
               "tokens": 64, "timing": "strict", "time_us": 6000.0}]
    assert advisor.mode_times(ll + normal, 8, "low_latency") == {64: 70.0}
    assert advisor.mode_times(normal + ll, 8, "normal") == {64: 11000.0}


def test_without_a_crossover_the_measurement_at_the_shape_decides():
    """Records where low-latency mode is faster at every measured point (no
    crossover to calibrate): between measured token counts the measured
    faster mode wins over the seed's round-number rule."""
    from cupyep.lab import advisor
    recs = []
    for t, (d, c) in {64: (40.0, 60.0), 512: (500.0, 480.0)}.items():
        recs += [{"study": "low_latency", "kind": "dispatch_bf16", "ranks": 8, "tokens": t, "timing": "strict",
                  "time_us": d},
                 {"study": "low_latency", "kind": "combine", "ranks": 8, "tokens": t, "timing": "strict", "time_us": c}]
    for t, (d, c) in {64: (600.0, 400.0), 512: (900.0, 640.0)}.items():
        recs += [{"study": "normal", "measured_kind": "dispatch_bf16_notify", "ranks": 8, "tokens": t,
                  "timing": "strict", "time_us": d},
                 {"study": "normal", "measured_kind": "combine_bf16", "ranks": 8, "tokens": t, "timing": "strict",
                  "time_us": c}]
    a = advisor.advise(300, 8, records=recs)
    assert a.mode == "low_latency" and not a.calibrated and any("measured at 8 ranks" in r for r in a.reasons)
    assert not any("using 128 tokens" in r for r in a.reasons)  # the measurement decides, not the default
    assert advisor.advise(4096, 8, records=recs).mode == "normal"  # outside the measurements: the rule


def test_across_nodes_the_rules_choose_low_latency_or_two_hop():
    """Across nodes the same rules choose between low-latency mode across nodes
    and the two-hop normal mode (transport "queue", which the two-hop route
    carries across nodes)."""
    a = A.advise(32, 16, num_nodes=2, imbalance_factor=5.0)
    assert (a.mode, a.transport, a.calibrated) == ("low_latency", None, False)
    assert any("2 nodes" in r for r in a.reasons) and any("imbalance" in w for w in a.warnings)
    assert (A.advise(1024, 16, num_nodes=2).mode, A.advise(1024, 16, num_nodes=2).transport) == ("normal", "queue")
    skewed = A.advise(32, 16, num_nodes=2, imbalance_factor=10.0)
    assert (skewed.mode, skewed.transport) == ("normal", "queue")
    with pytest.raises(ValueError, match="num_nodes"):
        A.advise(32, 16, num_nodes=3)


def _study(study, kind, tokens, us, ranks=8, per_node=4):
    return {"study": study, "kind": kind, "tokens": tokens, "time_us": us, "ranks": ranks,
            "ranks_per_node": per_node, "status": "ok", "timing": "strict" if study == "low_latency" else None}


def test_across_nodes_the_crossover_comes_from_records_of_the_same_layout():
    # 2 nodes of 4: low-latency 300 -> 3000 us, two-hop 1000 -> 1500 us from 64 to 512 tokens per rank.
    across = [_study("low_latency", "dispatch_fp8", 64, 150), _study("low_latency", "combine", 64, 150),
              _study("low_latency", "dispatch_fp8", 512, 1500), _study("low_latency", "combine", 512, 1500),
              _study("internode", "dispatch_bf16", 64, 500), _study("internode", "combine_bf16", 64, 500),
              _study("internode", "dispatch_bf16", 512, 750), _study("internode", "combine_bf16", 512, 750)]
    # One node of 8 (no ranks_per_node, as intranode records): low-latency always faster here.
    one_node = [{k: v for k, v in r.items() if k != "ranks_per_node"} | {"time_us": r["time_us"] / 10}
                for r in across if r["study"] == "low_latency"]
    cross = A.crossover_tokens(across, 8, "normal_two_hop", 4)
    assert 64 < cross < 512
    assert A.crossover_tokens(across + one_node, 8, "normal_two_hop", 4) == pytest.approx(cross)
    assert A.crossover_tokens(across, 8, "normal_two_hop", 8) is None  # no two-hop records of one node
    a = A.advise(int(cross) + 50, 8, num_nodes=2, records=across + one_node)
    b = A.advise(max(1, int(cross) - 50), 8, num_nodes=2, records=across + one_node)
    assert (a.mode, a.transport, a.calibrated) == ("normal", "queue", True)
    assert (b.mode, b.transport, b.calibrated) == ("low_latency", None, True)
    assert any("2 nodes of 4" in r for r in a.reasons)

def test_a_two_hop_dispatch_counts_its_notify_and_the_direct_route_is_left_out():
    """A two-hop dispatch's time is its kernel plus its notify kernel (the
    counted call runs both); records of the direct route across nodes are not
    the two-hop mode's."""
    recs = [_study("internode", "dispatch_bf16", 64, 500) | {"notify_us": 200.0},
            _study("internode", "combine_bf16", 64, 400) | {"notify_us": None},
            _study("internode", "dispatch_bf16", 64, 50) | {"route": "direct", "notify_us": 10.0},
            _study("internode", "combine_bf16", 64, 40) | {"route": "direct"}]
    assert A.mode_times(recs, 8, "normal_two_hop", 4) == {64: 1100.0}
    direct_only = [r for r in recs if r.get("route") == "direct"]
    assert A.mode_times(direct_only, 8, "normal_two_hop", 4) == {}


def test_several_runs_of_one_point_count_as_their_median():
    """Records of one kind and token count from several runs (or repeats)
    give their median, not whichever came last."""
    runs = [_records(ll={64: (d, 60.0), 256: (200.0, 400.0)}) for d in (30.0, 90.0, 40.0)]
    times = A.mode_times([r for run in runs for r in run], 8, "low_latency")
    assert times[64] == pytest.approx(40.0 + 60.0) and times[256] == pytest.approx(600.0)


def test_the_command_line_prints_the_advice(tmp_path, capsys):
    import json
    assert A.main(["--tokens", "1024", "--ranks", "16", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mode: normal, transport: queue") and "because" in out
    assert A.main(["--tokens", "32", "--ranks", "8", "--imbalance", "5", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["mode"] == "low_latency" and advice["warnings"] and advice["calibrated"] is False
    with pytest.raises(SystemExit):
        A.main(["--tokens", "32", "--ranks", "8", "--records", str(tmp_path / "missing.jsonl")])
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        A.main(["--tokens", "32", "--ranks", "8", "--nodes", "3"])
