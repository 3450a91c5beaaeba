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
