"""The measured SM defaults (cupyep.sm_defaults): the rule, the table built
from sweep records, its lookup, and where the direct route and the
low-latency buffer take it."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cupyep import sm_defaults as S

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "results" / "sm_economy" / "defaults"
ENV = {"gpu": "GPU X", "sms": 100, "ranks_per_node": 4, "ranks_per_gpu": 4, "sm_capped": False}


def normal_rec(kind, blocks, kernel_us, tokens=4096, hidden=7168, timing="strict", sweep=True, env=ENV):
    cfg = {"num_sms": blocks}
    return {"bench": "normal", "transport": "direct", "kind": f"{kind}_direct", "timing": timing, "sweep": sweep,
            "kernel_us": kernel_us, "tokens": tokens, "hidden": hidden, "dispatch_config": cfg,
            "combine_config": cfg, "env": env}


def ll_rec(kind, blocks, kernel_us, tokens=128):
    return {"bench": "low_latency", "kind": kind, "timing": "strict", "num_blocks": blocks,
            "kernel_median_us": kernel_us, "tokens": tokens, "hidden": 7168, "env": ENV}


def test_smallest_within_takes_the_fewest_blocks_within_the_tolerance_of_the_best():
    assert S.smallest_within({4: 200.0, 8: 104.0, 16: 100.0}) == 8
    assert S.smallest_within({4: 200.0, 8: 106.0, 16: 100.0}) == 16
    assert S.smallest_within({4: 100.0, 8: 120.0}) == 4  # the fewest is also the best
    assert S.smallest_within({2: 103.0, 8: 100.0, 6: 150.0}, tolerance=0.0) == 8
    assert S.smallest_within({"12": 100.0, "3": 104.9}) == 3  # JSON keys are strings
    with pytest.raises(ValueError):
        S.smallest_within({})
    with pytest.raises(ValueError):
        S.smallest_within({4: 0.0})


def test_build_takes_medians_over_runs_and_only_explicit_strict_kernel_clock_points():
    recs = [normal_rec("dispatch_bf16", b, t) for b, t in ((4, 210), (8, 100), (16, 98))]
    recs += [normal_rec("dispatch_bf16", 8, 130), normal_rec("dispatch_bf16", 8, 101)]  # median 101 of 3
    recs += [normal_rec("dispatch_bf16", 0, 50, sweep=False),  # the default point: blocks unknown
             normal_rec("dispatch_bf16", 2, 1.0, timing="deepep"),  # not the strict boundary
             normal_rec("dispatch_bf16", 2, 1.0, env={**ENV, "sm_capped": True}),  # under an SM cap
             {"kind": "copy_probe", "blocks": 8, "copy_GBps": 700.0},
             normal_rec("dispatch_bf16_notify", 2, 1.0)]  # not a kind of the table
    recs += [ll_rec("combine", 4, 300.0), ll_rec("combine", 16, 100.0), ll_rec("combine_pull", 4, 1.0)]
    table = S.build(recs)
    assert [(e["route"], e["kind"]) for e in table] == [("direct", "dispatch_bf16"), ("low_latency", "combine")]
    d = table[0]
    assert d["times_us"] == {"4": 210, "8": 101, "16": 98} and d["blocks"] == 8 and d["runs"] == 1
    assert (d["gpu"], d["sms"], d["ranks"], d["ranks_per_gpu"], d["tokens"], d["hidden"]) == \
        ("GPU X", 100, 4, 4, 4096, 7168)
    assert table[1]["blocks"] == 16


def test_lookup_prefers_the_users_table_and_can_be_turned_off(tmp_path, monkeypatch):
    mine = [{**e, "blocks": 3} for e in S.build([normal_rec("combine_bf16", 3, 100.0),
                                                 normal_rec("combine_bf16", 6, 99.0)])]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(mine))
    args = ("direct", "combine_bf16", "GPU X", 100, 4, 4, 4096)
    monkeypatch.delenv(S.ENV_VAR, raising=False)
    assert S.lookup(*args) is None  # the packaged table knows no "GPU X"
    monkeypatch.setenv(S.ENV_VAR, str(path))
    assert S.lookup(*args) == 3
    assert S.lookup("direct", "combine_bf16", "GPU X", 100, 8, 8, 4096) is None  # another layout
    monkeypatch.setenv(S.ENV_VAR, S.OFF)
    assert S.lookup(*args) is None
    with pytest.raises(ValueError, match="unknown route"):
        S.lookup("queue", "combine_bf16", "GPU X", 100, 4, 4, 4096)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"route": "direct"}]))
    with pytest.raises(ValueError, match="not an SM-defaults table"):
        S.load_table(bad)


def test_lookup_picks_the_entry_of_the_fewest_tokens_at_or_above_the_shape(tmp_path, monkeypatch):
    recs = [ll_rec("combine", b, t, tokens=1) for b, t in ((4, 10.0), (16, 10.2))]
    recs += [ll_rec("combine", b, t, tokens=128) for b, t in ((4, 200.0), (16, 100.0))]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(S.build(recs)))
    monkeypatch.setenv(S.ENV_VAR, str(path))
    at = lambda tokens: S.lookup("low_latency", "combine", "GPU X", 100, 4, 4, tokens)  # noqa: E731
    assert (at(1), at(2), at(128), at(4096)) == (4, 16, 16, 16)


def test_the_packaged_table_is_the_rule_over_the_committed_sweeps():
    files = sorted(SWEEPS.glob("sms_*ranks_*.jsonl")) + sorted(SWEEPS.glob("ll_sms_*ranks_*.jsonl"))
    assert len(files) == 18
    records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    assert S.build(records) == S.load_table(S.PACKAGED)
    for e in S.load_table(S.PACKAGED):
        assert e["runs"] >= 3 and e["blocks"] == S.smallest_within(e["times_us"])


def fake_group(local_size=8, ranks_per_gpu=8, sm_share=16, capped=False, gpu=True):
    return SimpleNamespace(has_gpu=gpu, sm_capped=capped, device_id=0, local_size=local_size,
                           ranks_per_gpu=ranks_per_gpu, sm_share=sm_share)


def test_blocks_for_reads_the_device_and_skips_capped_or_gpu_less_ranks(monkeypatch):
    monkeypatch.delenv(S.ENV_VAR, raising=False)
    monkeypatch.setattr(S, "device", lambda device_id: ("NVIDIA H200", 132))
    g = fake_group()
    table = {(e["route"], e["kind"], e["tokens"]): e["blocks"] for e in S.load_table(S.PACKAGED)
             if e["ranks"] == 8 and e["gpu"] == "NVIDIA H200"}
    assert S.blocks_for(g, "direct", "dispatch_fp8", 4096, 7168) == table[("direct", "dispatch_fp8", 4096)]
    assert S.blocks_for(fake_group(capped=True), "direct", "dispatch_fp8", 4096) is None
    assert S.blocks_for(fake_group(gpu=False), "direct", "dispatch_fp8", 4096) is None
    assert S.blocks_for(fake_group(local_size=3, ranks_per_gpu=3), "direct", "dispatch_fp8", 4096) is None


def test_direct_route_budget_takes_the_measured_default_below_the_nodes_budget(monkeypatch):
    from cupyep.normal.direct import DirectRoute
    from cupyep.normal.direct_kernels import BULK_MAX_BLOCKS, DirectConfig
    from cupyep.sizes import DeclaredSizes
    measured = {"dispatch_bf16": 14, "dispatch_fp8": 6, "combine_bf16": 40}
    monkeypatch.setattr(S, "blocks_for", lambda group, route, kind, tokens, hidden: measured[kind])
    for on in (True, False):
        d = DirectRoute(SimpleNamespace(num_ranks=8, sm_budget=16, group=None), DeclaredSizes(), 1, measured=on)
        got = {k: d.budget(k) for k in measured}
        assert got == ({"dispatch_bf16": 14, "dispatch_fp8": 6, "combine_bf16": 16} if on else
                       dict.fromkeys(measured, 16))
        # The config's bulk copies follow the measured count: at most BULK_MAX_BLOCKS blocks use them.
        fp8, bf16 = d.dispatch_config(None, True, None), d.dispatch_config(None, False, None)
        assert (fp8.bulk_stage_bytes > 0) == (on and 6 <= BULK_MAX_BLOCKS)
        assert bf16.bulk_stage_bytes == 0
        assert d.dispatch_config(DirectConfig(num_sms=3), True, None).num_sms == 3  # a config's own count wins


def test_low_latency_default_blocks_is_the_most_over_the_kinds_and_needs_every_kind(monkeypatch):
    from cupyep.low_latency.buffer import default_blocks
    g = fake_group(sm_share=16)
    monkeypatch.setattr(S, "blocks_for", lambda group, route, kind, tokens, hidden:
                        {"dispatch_fp8": 12, "dispatch_bf16": 8, "combine": 4}[kind])
    assert default_blocks(g, 1, 7168) == 12
    monkeypatch.setattr(S, "blocks_for", lambda group, route, kind, tokens, hidden:
                        None if kind == "combine" else 4)
    assert default_blocks(g, 1, 7168) == 16  # a kind never measured: the share
    monkeypatch.setattr(S, "blocks_for", lambda *a: 64)
    assert default_blocks(g, 128, 7168) == 16  # never above the share


def test_the_readme_shows_the_packaged_table():
    from cupyep.lab.sm_table import markdown
    readme = (ROOT / "results" / "sm_economy" / "README.md").read_text()
    assert markdown(S.load_table(S.PACKAGED)) in readme
