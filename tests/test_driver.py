"""Host side of cupyep.driver: the launch structs match cuda.h's layout, and
launch dimensions are checked."""
import ctypes

import pytest

from cupyep import driver



def test_launch_config_layout_matches_cuda_h():
    # CUlaunchConfig: gridDim{X,Y,Z}, blockDim{X,Y,Z}, sharedMemBytes, hStream, attrs, numAttrs.
    c = driver._Config
    assert (c.grid.offset, c.block.offset, c.shared_mem.offset) == (0, 12, 24)
    assert (c.stream.offset, c.attrs.offset, c.num_attrs.offset) == (32, 40, 48)
    # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union.
    a = driver._Attr
    assert (a.id.offset, a.value.offset, ctypes.sizeof(a)) == (0, 8, 72)
    assert driver._PROGRAMMATIC[0].id == driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert driver._PROGRAMMATIC[0].value.value == 1


@pytest.mark.parametrize("dims,expected", [(16, (16, 1, 1)), ((4, 2), (4, 2, 1)), ([1, 2, 3], (1, 2, 3))])
def test_dims(dims, expected):
    assert driver._dims(dims) == expected


@pytest.mark.parametrize("dims", [0, (1, 2, 3, 4), (), (2, -1)])
def test_bad_dims(dims):
    with pytest.raises(ValueError, match="launch dimensions"):
        driver._dims(dims)


def test_launch_passes_config_and_arguments(monkeypatch):
    """What reaches cuLaunchKernelEx: dimensions, shared memory, stream, the PDL
    attribute, and each argument's bytes (a fake driver records them)."""
    import numpy as np
    seen = {}

    class FakeDriver:
        @staticmethod
        def cuLaunchKernelEx(cfg_ref, fn, params, extra):
            cfg = cfg_ref._obj
            seen.update(grid=tuple(cfg.grid), block=tuple(cfg.block), smem=cfg.shared_mem, stream=cfg.stream,
                        num_attrs=cfg.num_attrs, fn=fn,
                        args=[ctypes.string_at(params[0], 8), ctypes.string_at(params[1], 4)])
            if cfg.num_attrs:
                seen["attr"] = (cfg.attrs[0].id, cfg.attrs[0].value.value)
            return seen.get("rc", 0)

    class Stream:
        ptr = 0x1234

    class Function:
        ptr = 0x99

    monkeypatch.setattr(driver, "_lib", FakeDriver)
    driver.launch(Function(), (4, 2), 256, (np.int64(7), np.float32(1.5)), shared_mem=1024, stream=Stream(),
                  programmatic=True)
    assert seen["grid"] == (4, 2, 1) and seen["block"] == (256, 1, 1) and seen["smem"] == 1024
    assert seen["stream"] == 0x1234 and seen["fn"] == 0x99 and seen["num_attrs"] == 1
    assert seen["attr"] == (driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert seen["args"] == [np.int64(7).tobytes(), np.float32(1.5).tobytes()]
    # A plain launch carries no attribute; a failing one raises with the driver's code.
    driver.launch(Function(), 1, 32, (np.int64(0), np.float32(0)), stream=Stream())
    assert seen["num_attrs"] == 0
    seen["rc"] = 1
    with pytest.raises(RuntimeError, match="CUresult 1"):
        driver.launch(Function(), 1, 32, (np.int64(0), np.float32(0)), stream=Stream())


def test_peer_native_atomics_asks_the_driver(monkeypatch):
    """cuDeviceGet for both ordinals, then the native-atomics P2P attribute of
    the pair; one device needs no query; a driver error raises."""
    calls = []

    class FakeDriver:
        rc = 0

        @staticmethod
        def cuDeviceGet(handle, ordinal):
            handle._obj.value = 100 + ordinal
            return 0

        @classmethod
        def cuDeviceGetP2PAttribute(cls, value, attr, dev, peer):
            calls.append((attr, dev, peer))
            value._obj.value = int(peer == 101)
            return cls.rc

    monkeypatch.setattr(driver, "_driver", lambda: FakeDriver)
    assert driver.peer_native_atomics(0, 1) is True
    assert driver.peer_native_atomics(1, 2) is False
    assert driver.peer_native_atomics(3, 3) is True
    assert calls == [(driver.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, 100, 101),
                     (driver.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, 101, 102)]
    FakeDriver.rc = 101
    with pytest.raises(RuntimeError, match="cuDeviceGetP2PAttribute"):
        driver.peer_native_atomics(0, 1)
