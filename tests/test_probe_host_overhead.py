"""The host-path probe's timers (experiments/probes/probe_host_overhead.py),
on the CPU: the phase clock counts and times each wrapped callable and puts
every one back; the line tracer charges cupyep's own lines."""
import importlib.util
from pathlib import Path

import numpy as np

from cupyep import errors, jit
from cupyep.normal import direct_kernels as D

PROBE = Path(__file__).resolve().parents[1] / "experiments" / "probes" / "probe_host_overhead.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_host_overhead", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_phase_names_a_callable_the_library_has():
    import importlib
    for label, module, attr in _probe().PHASES:
        owner = importlib.import_module(module)
        for part in attr.split("."):
            owner = getattr(owner, part)
        assert callable(owner), label


def test_phase_clock_counts_each_call_and_restores_what_it_wrapped():
    probe = _probe()
    phases = (("pack", "cupyep.jit", "pack"), ("validate", "cupyep.normal.direct_kernels", "DirectConfig.validate"))
    pack, validate = jit.pack, D.DirectConfig.__dict__["validate"]
    clock = probe.PhaseClock(phases).install()
    try:
        def call():
            D.DirectConfig().validate()
            jit.pack(errors.GUARD_DTYPE, rank=1)
            jit.pack(errors.GUARD_DTYPE, rank=2)
        times = probe.phase_times(call, 3, clock)
    finally:
        clock.remove()
    assert set(times) == {"pack", "validate"}
    assert times["pack"][1] == 2 and times["validate"][1] == 1
    assert all(us > 0 for us, _ in times.values())
    assert jit.pack is pack and D.DirectConfig.__dict__["validate"] is validate
    assert int(jit.pack(errors.GUARD_DTYPE, rank=3)["rank"]) == 3


def test_line_tracer_charges_cupyeps_own_lines():
    probe = _probe()
    x = np.zeros((4, 8), np.uint16)
    from cupyep.arrays import check
    out = probe.trace_lines(lambda: [check(x, "x", dtype=np.uint16, shape=(None, 8)) for _ in range(5)], 3, top=5)
    lines = [k for k in out if not k.startswith("_")]
    assert lines and all(k.startswith("arrays.py:") for k in lines)
    assert 0 < out["_traced_us"] <= out["_per_call_us"]


def test_the_dispatch_timeline_splits_each_call_between_host_and_gpu():
    path = PROBE.with_name("probe_dispatch_timeline.py")
    spec = importlib.util.spec_from_file_location("probe_dispatch_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # two calls (ns): entry, launched, counts seen, return; kernel start and end on the host's clock
    host = np.array([[0, 100_000, 150_000, 200_000], [210_000, 300_000, 500_000, 560_000]])
    kernel = np.array([[120_000, 400_000], [420_000, 700_000]])
    q = mod.per_call(host, kernel, np.array([110_000, 420_000]))
    assert set(q) == set(mod.QUANTITIES)
    assert q["pre_us"].tolist() == [100, 90] and q["launch_to_start_us"].tolist() == [20, 120]
    assert q["start_to_counts_us"].tolist() == [30, 80] and q["post_us"].tolist() == [50, 60]
    assert q["kernel_us"].tolist() == [280, 280] and q["start_skew_us"].tolist() == [10, 0]
    assert np.isnan(q["gpu_gap_us"][0]) and q["gpu_gap_us"][1] == 20
    assert q["period_us"][0] == 210 and np.isnan(q["period_us"][1])
