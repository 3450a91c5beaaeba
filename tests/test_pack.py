"""jit.pack writes every kernel argument struct of the package byte for byte
as NumPy's structured assignment does (the reference), nested structs and
padding included; it rejects unknown fields."""
import importlib

import numpy as np
import pytest

from cupyep import jit


MODULES = ["cupyep.errors", "cupyep.normal.layout", "cupyep.normal.expert_major", "cupyep.normal.node_kernels", "cupyep.normal.queue_kernels",
           "cupyep.normal.direct_kernels", "cupyep.normal.internode_kernels", "cupyep.low_latency.kernels", "cupyep.barrier"]


def struct_dtypes():
    seen = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, v in vars(mod).items():
            if isinstance(v, np.dtype) and v.fields and v not in seen.values():
                seen[f"{name}.{attr}"] = v
    return seen


DTYPES = struct_dtypes()


def reference_pack(dtype, values):
    a = np.zeros((), dtype=dtype)
    for k, v in values.items():
        a[k] = v
    return a[()]


def random_values(dtype, rng):
    values = {}
    for name, (ft, _) in dtype.fields.items():
        if ft.fields:
            values[name] = jit.pack(ft, **random_values(ft, rng))
        elif ft.kind == "f":
            values[name] = float(rng.standard_normal())
        elif ft.kind == "b":
            values[name] = bool(rng.integers(2))
        else:
            info = np.iinfo(ft)
            values[name] = int(rng.integers(max(info.min, -2**62), min(info.max, 2**62)))
    return values


def test_there_are_structs_to_check():
    assert len(DTYPES) >= 10


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_pack_matches_structured_assignment(name):
    dtype = DTYPES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    for _ in range(3):
        values = random_values(dtype, rng)
        got = jit.pack(dtype, **values)
        assert got.dtype == dtype and got.tobytes() == reference_pack(dtype, values).tobytes()
        some = dict(list(values.items())[::2])  # unspecified fields are zero
        assert jit.pack(dtype, **some).tobytes() == reference_pack(dtype, some).tobytes()


def test_pack_rejects_an_unknown_field():
    dtype = next(iter(DTYPES.values()))
    with pytest.raises(ValueError, match="no field"):
        jit.pack(dtype, not_a_field=1)
