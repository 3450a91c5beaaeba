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
