"""cupyep.reference.logfmt: the LogFMT-10 format of combine rows (CPU)."""
import numpy as np
import pytest

from cupyep.reference import logfmt as L


def _rows(seed, n=16, h=512, scale=0.05):
    rng = np.random.default_rng(seed)
    import ml_dtypes
    return (rng.standard_normal((n, h)) * scale).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_values_come_back_within_the_stated_bound_with_their_sign():
    x = _rows(0)
    codes, lo, hi = L.encode(x)
    y = L.decode(codes, lo, hi)
    assert codes.dtype == np.uint16 and int(codes.max()) < 1 << (L.CODE_BITS + 1)
    bound = np.repeat(L.max_relative_error(lo, hi), L.GROUP, axis=1)
    nz = x != 0
    rel = np.abs(y[nz] - x[nz]) / np.abs(x[nz])
    assert (rel <= bound[nz] * (1 + 1e-6)).all()
    assert np.array_equal(np.sign(y), np.sign(x))
    assert np.array_equal(L.roundtrip(x), y)


def test_zeros_constant_groups_and_the_ends_of_the_range_are_exact():
    x = np.zeros((3, 256), np.float32)
    x[1, 7] = -0.375                      # one nonzero value in a group: hi == lo, one level
    x[2, :128] = 2.0 ** -3                # every magnitude equal
    x[2, 128:] = np.linspace(-1, 1, 128)
    x[2, 200] = 0.0
    codes, lo, hi = L.encode(x)
    y = L.decode(codes, lo, hi)
    assert (y[0] == 0).all() and (lo[0] == 0).all() and (hi[0] == 0).all()  # an all-zero group
    assert y[1, 7] == -0.375 and (np.delete(y[1], 7) == 0).all()
    assert (y[2, :128] == 2.0 ** -3).all()
    g = x[2, 128:]
    assert y[2, 128:][np.argmax(np.abs(g))] == np.abs(g).max() * np.sign(g[np.argmax(np.abs(g))])  # the top level
    assert y[2, 200] == 0


def test_a_decoded_level_encodes_to_itself():
    x = _rows(1)
    codes, lo, hi = L.encode(x)
    y = L.decode(codes, lo, hi)
    codes2, lo2, hi2 = L.encode(y)
    assert np.array_equal(L.decode(codes2, lo2, hi2), y)


def test_magnitudes_beyond_32_octaves_below_the_largest_go_to_zero_or_the_lowest_level():
    x = np.zeros((1, 128), np.float32)
    x[0, 0] = 1.0
    x[0, 1] = 2.0 ** -40   # under the range's floor 2 ** -32: nearer zero than 2 ** -32
    x[0, 2] = 2.0 ** -32.5  # nearer 2 ** -32 than zero
    codes, lo, hi = L.encode(x)
    y = L.decode(codes, lo, hi)
    assert lo[0, 0] == -L.MAX_OCTAVES and hi[0, 0] == 0
    assert y[0, 1] == 0 and y[0, 2] == np.float32(2.0 ** -32)


def test_the_bound_and_the_bytes():
    assert L.max_relative_error(0.0, 1.0) == pytest.approx(2 ** (1 / 1020) - 1)
    assert L.max_relative_error(-32.0, 0.0) == pytest.approx(0.0220, abs=1e-4)
    assert L.payload_bytes(2, 7168) == 2 * (7168 * 10 // 8 + 56 * 8)
    assert L.payload_bytes(1, 7168) / (7168 * 2) == pytest.approx(0.65625)
    with pytest.raises(ValueError, match="multiple of 128"):
        L.payload_bytes(1, 100)


@pytest.mark.parametrize("bad,match", [(np.zeros((2, 100), np.float32), "multiple of 128"),
                                       (np.zeros(128, np.float32), r"\[N, H\]"),
                                       (np.full((1, 128), np.inf, np.float32), "finite")])
def test_bad_rows_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        L.encode(bad)


def test_the_results_readme_shows_what_the_probe_prints():
    """results/logfmt/README.md holds `probe_logfmt_accuracy.py --table` of its committed records, and the
    records stay inside the BF16 calc_diff bound."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    d = repo / "results" / "logfmt"
    out = subprocess.run([sys.executable, str(repo / "experiments" / "probes" / "probe_logfmt_accuracy.py"), "--table",
                          str(d / "accuracy.json")], capture_output=True, text=True, check=True).stdout
    assert out.strip() in (d / "README.md").read_text()
    assert all(r["calc_diff"] < 5e-6 for r in json.loads((d / "accuracy.json").read_text())["runs"])


# ---------------------------------------------------------------- the device's version (common/logfmt.cuh)
def _pack80(codes):
    """encode8's bits: code i at bit 10 i of 80, as (low 64 bits, high 16 bits) (emulated statement by
    statement)."""
    low = 0
    for i in range(6):
        low |= int(codes[i]) << (10 * i)
    low |= (int(codes[6]) & 0xF) << 60
    return low, (int(codes[6]) >> 4) | (int(codes[7]) << 6)


def _unpack80(low, high):
    """decode8's bits."""
    out = [(low >> (10 * i)) & 0x3FF for i in range(6)]
    out.append(((low >> 60) & 0xF) | ((high & 0x3F) << 4))
    out.append((high >> 6) & 0x3FF)
    return out


def _encode1_f32(x, lo, hi):
    """encode1 in float32, as the device computes it (encoder's group constants, then log2, floorf and
    the log-domain threshold theta for rounding to the nearer level in linear terms)."""
    f = np.float32
    a = abs(f(x))
    if a == 0:
        return 0
    step = f((f(hi) - f(lo)) / f(L.LEVELS - 1))
    flat = not step > 0
    inv_step = f(0) if flat else f(f(1) / step)
    lowest = np.exp2(f(lo), dtype=np.float32)
    theta = f(2) if flat else f(np.log2(f(0.5) * (f(1) + np.exp2(step, dtype=np.float32)), dtype=np.float32)
                                * inv_step)
    if a < lowest:
        c = 1 if a >= f(0.5) * lowest else 0
    else:
        t = max(f((np.log2(a, dtype=np.float32) - f(lo)) * inv_step), f(0))
        below = min(np.floor(t), f(L.LEVELS - 1))
        c = int(below) + 1
        if c < L.LEVELS and f(t - below) > theta:
            c += 1
    return 0 if c == 0 else c | ((1 << 9) if x < 0 else 0)


def test_the_devices_80_bit_packing_inverts():
    rng = np.random.default_rng(4)
    for _ in range(200):
        codes = rng.integers(0, 1 << 10, size=8)
        low, high = _pack80(codes)
        assert 0 <= low < 1 << 64 and 0 <= high < 1 << 16 and _unpack80(low, high) == list(codes)


def test_the_devices_float32_codes_are_the_references_but_for_rare_ties():
    """The device's encode1 in float32 against the reference's float64 codes: the same code for nearly
    every value, one level apart at most (a value at a rounding threshold)."""
    x = _rows(2, n=4, h=256)
    codes, lo, hi = L.encode(x)
    g = x.reshape(4, 2, 128)
    dev = np.array([[[_encode1_f32(v, lo[n, j], hi[n, j]) for v in g[n, j]] for j in range(2)] for n in range(4)])
    ref_codes = codes.reshape(4, 2, 128).astype(np.int64)
    assert ((dev >> 9) == (ref_codes >> 9)).all()  # signs
    diff = np.abs((dev & 0x1FF) - (ref_codes & 0x1FF))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99


def test_the_device_header_has_the_emulated_statements():
    from cupyep import jit
    src = (jit.CUDA_SRC / "common" / "logfmt.cuh").read_text()
    for line in ("low |= (uint64_t)(code[6] & 0xfu) << 60;",
                 "return {low, (code[6] >> 4) | (code[7] << 6)};",
                 "f[6] = decode1((uint32_t)((c.low >> 60) & 0xfu) | ((c.high & 0x3fu) << 4), lo, step);",
                 "f[7] = decode1((c.high >> 6) & 0x3ffu, lo, step);",
                 "e.theta = flat ? 2.f : __log2f(0.5f * (1.f + exp2f(step))) * e.inv_step;",
                 "const float t = fmaxf((__log2f(a) - e.lo) * e.inv_step, 0.f);",
                 "if (c < (uint32_t)kLevels && t - below > e.theta) ++c;",
                 "c = a >= 0.5f * e.lowest ? 1u : 0u;",
                 "return make_float2(fmaxf(__log2f(amin), hi - kMaxOctaves), hi);"):
        assert line in src, line
    assert "constexpr int kLevels = 511;" in src and "constexpr float kMaxOctaves = 32.f;" in src
    assert L.LEVELS == 511 and L.MAX_OCTAVES == 32.0 and L.GROUP == 128
