"""The "normal" GPU study's host side: its knobs, the configs it builds and
the configurations it refuses; the benchmark's measurement function's checks."""
import pytest

from cupyep.lab import experiments
from cupyep.lab.bench import normal as BN
from cupyep.lab.experiments import gpu_normal as G
from cupyep.normal import Config
from cupyep.normal.direct_kernels import DirectConfig


class FakeBuffer:
    def default_dispatch_config(self, fp8=False):
        return Config(num_sms=24 if not fp8 else 16, chunk_size=8, queue_depth=32)

    def default_combine_config(self):
        return Config(num_sms=20, chunk_size=4, queue_depth=64)


def _cfg(**kw):
    return {**G.KNOBS, **kw}


def test_normal_study_is_registered_and_needs_a_gpu():
    study = experiments.studies.get("normal")
    assert study.needs_gpu and study.knobs == G.KNOBS
    assert set(BN.KINDS) | set(BN.DIRECT_KINDS) >= {"dispatch_bf16", "combine_bf16_zero_copy"}
    assert len(experiments.expand({"transport": ["queue", "direct"], "kind": list(BN.KINDS)}, G.KNOBS)) == 2 * len(BN.KINDS)


def test_queue_configs_take_the_defaults_unless_a_knob_is_set():
    d, c = G._configs(FakeBuffer(), _cfg())
    assert d == FakeBuffer().default_dispatch_config() and c == FakeBuffer().default_combine_config()
    d, c = G._configs(FakeBuffer(), _cfg(queue_depth=128, chunk_size=2, l2_hints=1, num_sms=32))
    assert (d.queue_depth, d.chunk_size, d.l2_hints, d.num_sms) == (128, 2, 1, 32)
    assert (c.queue_depth, c.chunk_size, c.l2_hints, c.num_sms) == (128, 2, 1, 32)
    d, _ = G._configs(FakeBuffer(), _cfg(kind="dispatch_fp8"))
    assert d.num_sms == 16


def test_direct_configs_and_refusals():
    d, c = G._configs(FakeBuffer(), _cfg(transport="direct", num_sms=8))
    assert d == DirectConfig(num_sms=8, fused=True) and c is None
    d, _ = G._configs(FakeBuffer(), _cfg(transport="direct", fused=False))
    assert d == DirectConfig(fused=False)
    with pytest.raises(experiments.Skip, match="queue transport"):
        G._configs(FakeBuffer(), _cfg(transport="direct", queue_depth=64))
    with pytest.raises(experiments.Skip, match="direct transport"):
        G._configs(FakeBuffer(), _cfg(fused=False))
    with pytest.raises(experiments.Skip, match="needs the direct transport"):
        G.run(None, _cfg(kind="combine_bf16_zero_copy"))
    with pytest.raises(experiments.Skip, match="transport must be"):
        G.run(None, _cfg(transport="nvlink"))


def test_measure_rejects_bad_kinds_before_anything_runs():
    with pytest.raises(ValueError, match="kind must be one of"):
        BN.measure(None, None, None, "dispatch_int4", None, None, None, None, 256, None)
    with pytest.raises(ValueError, match="needs the direct transport"):
        BN.measure(None, None, None, "dispatch_bf16_notify_unfused", None, None, None, None, 256, None)
    with pytest.raises(ValueError, match="timing must be"):
        BN.measure(None, None, None, "dispatch_bf16", None, None, None, None, 256, None, timing="loose")


def _bench_normal():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "experiments" / "bench_normal.py"
    spec = importlib.util.spec_from_file_location("bench_normal", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_blocks_table_takes_medians_and_ranges_over_runs(tmp_path):
    """bench_normal --blocks-table: per (ranks, kind, bulk stage, combine
    words, threads, blocks) the median and [min, max] over the files, on both clocks (the
    span when a record has one); unswept and queue records are left out."""
    import json
    bench = _bench_normal()

    def rec(t, f, kt=None, kf=None, bulk=None, sweep=True, transport="direct"):
        r = {"bench": "normal", "kind": "dispatch_bf16_direct", "transport": transport, "ranks": 2,
             "time_us": t, "of_copy_same_sms": f, "sweep": sweep,
             "dispatch_config": {"num_sms": 6, "num_threads": 512, "bulk_stage_bytes": bulk}}
        if kt is not None:
            r.update(kernel_us=kt + 50, kernel_span_us=kt, of_copy_same_sms_kernel=kf)
        return r
    paths = []
    for i, (t, f, kt, kf) in enumerate(((474, 0.891, 403, 1.048), (476, 0.887, 404, 1.046), (472, 0.893, 403, 1.05))):
        p = tmp_path / f"run{i}.jsonl"
        p.write_text("\n".join(json.dumps(r) for r in (
            rec(t, f, kt, kf, bulk=7168), rec(500 + i, 0.82, bulk=0), rec(1, 1, sweep=False),
            rec(2, 2, transport="queue"))) + "\n")
        paths.append(str(p))
    lines = bench.blocks_table(paths).splitlines()
    assert len(lines) == 4  # header, rule, the warp-copy row and the bulk row
    warp, bulk = lines[2], lines[3]
    assert warp.startswith("| 2 | dispatch_bf16_direct | 0 | default | 512 | 6 | 3 | 501 [500, 502] | "
                           "0.820 [0.820, 0.820] | - | - |")
    assert bulk == ("| 2 | dispatch_bf16_direct | 7168 | default | 512 | 6 | 3 | 474 [472, 476] | "
                    "0.891 [0.887, 0.893] | 403 [403, 404] | 1.048 [1.046, 1.050] |")
    # combine words are a point of their own
    p = tmp_path / "words.jsonl"
    r = rec(300, 0.9)
    r["kind"], r["dispatch_config"]["combine_words"] = "combine_bf16_zero_copy_direct", 8
    p.write_text(json.dumps(r) + "\n")
    assert bench.blocks_table([str(p)]).splitlines()[2].startswith(
        "| 2 | combine_bf16_zero_copy_direct | default | 8 | 512 | 6 | 1 | 300 [300, 300] |")
