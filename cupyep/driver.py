"""Kernel launches through the CUDA driver's ``cuLaunchKernelEx``, for what
CuPy's launch cannot ask for: programmatic dependent launch (PDL); and the
driver's peer-link attributes.

A kernel launched with ``programmatic=True`` may start before the kernel
ahead of it in the stream has finished, once that kernel has executed
``griddepcontrol.launch_dependents`` (``pdl_launch_dependents`` in
``cuda_src/common/ptx.cuh``) in every block, or has ended. The dependent
must call ``pdl_wait`` before it touches anything the earlier kernel
writes. What PDL saves is the launch: the dependent's blocks are already
resident when the earlier kernel ends. Launches stay capturable in CUDA
graphs (the dependency becomes a programmatic edge).

Arguments are passed as for CuPy: a tuple of NumPy scalars (structured
``np.void`` structs included), each copied by value; the Python side of a
launch costs a few microseconds.
"""
from __future__ import annotations

import ctypes
import threading

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


assert ctypes.sizeof(_Attr) == 72 and ctypes.sizeof(_Config) == 56

_PROGRAMMATIC = (_Attr * 1)()
_PROGRAMMATIC[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PROGRAMMATIC[0].value.value = 1

_lib = None


CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 3


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGet.restype = ctypes.c_int
        lib.cuDeviceGetP2PAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int,
                                                ctypes.c_int]
        lib.cuDeviceGetP2PAttribute.restype = ctypes.c_int
        _lib = lib
    return _lib


def _check(rc: int, call: str) -> None:
    """RuntimeError naming ``call`` unless the driver returned CUDA_SUCCESS."""
    if rc != 0:
        raise RuntimeError(f"{call} failed with CUresult {rc}")


def _dims(d) -> tuple[int, int, int]:
    if isinstance(d, int) and d >= 1:
        return d, 1, 1
    d = tuple(int(v) for v in (d if isinstance(d, (tuple, list)) else (d,)))
    if not 1 <= len(d) <= 3 or min(d) < 1:
        raise ValueError(f"launch dimensions must be 1 to 3 positive ints, got {d}")
    return d + (1,) * (3 - len(d))


_local = threading.local()


def launch(function, grid, block, args: tuple, shared_mem: int = 0, stream=None, programmatic: bool = False) -> None:
    """Launch ``function`` (a ``cupy.RawKernel``, as ``jit.load`` gives, or a
    ``cupy.cuda.Function``) on ``stream`` (default: the current CuPy stream).

    ``args``: NumPy scalars or structured scalars, in the kernel's parameter
    order. ``programmatic``: launch as a programmatic dependent of the work
    ahead of it in the stream (the kernel must ``pdl_wait`` first).
    Raises RuntimeError with the driver's error code if the launch fails.
    """
    if stream is None:
        import cupy
        stream = cupy.cuda.get_current_stream()
    cfg = getattr(_local, "cfg", None)
    if cfg is None:  # one per thread: the driver copies it (and the arguments) during the call
        cfg = _local.cfg = _Config()
    cfg.grid[0], cfg.grid[1], cfg.grid[2] = _dims(grid)
    cfg.block[0], cfg.block[1], cfg.block[2] = _dims(block)
    cfg.shared_mem = int(shared_mem)
    cfg.stream = stream.ptr
    cfg.attrs = _PROGRAMMATIC if programmatic else None
    cfg.num_attrs = 1 if programmatic else 0
    blobs = [ctypes.create_string_buffer(a.tobytes()) for a in args]
    params = (ctypes.c_void_p * max(len(blobs), 1))(*[ctypes.addressof(b) for b in blobs])
    fn = function.kernel if hasattr(function, "kernel") else function  # RawKernel: its Function on this device
    _check(_driver().cuLaunchKernelEx(ctypes.byref(cfg), fn.ptr, params, None), "cuLaunchKernelEx")


def programmatic_supported() -> bool:
    """Whether the current device can take programmatic dependent launches
    (compute capability 9.0 or newer)."""
    import cupy
    return int(cupy.cuda.Device().compute_capability) >= 90


def peer_native_atomics(device: int, peer: int) -> bool:
    """Whether atomic operations of device ``device`` on memory of device ``peer``
    (ordinals as CUDA sees them) are native over their link; True for one device."""
    if device == peer:
        return True
    lib = _driver()
    handles = []
    for ordinal in (device, peer):
        h = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(h), int(ordinal)), f"cuDeviceGet({ordinal})")
        handles.append(h.value)
    value = ctypes.c_int()
    _check(lib.cuDeviceGetP2PAttribute(ctypes.byref(value), CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, *handles),
           f"cuDeviceGetP2PAttribute({device}, {peer})")
    return bool(value.value)
