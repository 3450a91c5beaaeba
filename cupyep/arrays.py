"""Array interop and input checks.

Public functions take CuPy arrays and also anything that speaks DLPack or
``__cuda_array_interface__`` (torch tensors included), without copying.
CuPy has no bfloat16 or float8, so cupyep carries BF16 as ``uint16`` and FP8
e4m3 as ``uint8``; torch ``bfloat16`` / ``float8_e4m3fn`` tensors are viewed
as those automatically.
"""
from __future__ import annotations

import math

import numpy as np

BF16 = np.dtype(np.uint16)   # bfloat16 bit pattern
FP8 = np.dtype(np.uint8)     # float8 e4m3fn bit pattern

# torch dtype name -> the NumPy dtype cupyep sees (BF16 and FP8 as their bits)
_TORCH_NAMES = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float32": np.float32, "int64": np.int64,
                "int32": np.int32, "bool": np.bool_, "uint8": np.uint8, "int16": np.int16, "float16": np.float16,
                "float64": np.float64, "int8": np.int8}
_TORCH_DTYPES: dict = {}  # torch dtype -> NumPy dtype (filled when the first tensor is seen)


def xp_of(a):
    """numpy or cupy, whichever ``a`` belongs to (numpy when cupy is absent)."""
    try:
        import cupy
    except ImportError:  # pragma: no cover - cupy is a dependency, but keep the CPU path free of it
        return np
    return cupy.get_array_module(a)


def to_host(a) -> np.ndarray:
    """``a`` as a NumPy array (a CuPy array read back; anything else through np.asarray)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def as_cupy(a, name: str):
    """Zero-copy view of ``a`` as a cupy array (None passes through).

    A CUDA torch tensor is viewed directly (:func:`torch_view`); anything
    else speaking ``__cuda_array_interface__`` or DLPack through CuPy.
    TypeError for host data."""
    import cupy
    if a is None or isinstance(a, cupy.ndarray):
        return a
    if type(a).__module__.startswith("torch"):
        return torch_view(a, name)
    if hasattr(a, "__cuda_array_interface__"):
        return cupy.asarray(a)
    if hasattr(a, "__dlpack__"):
        return cupy.from_dlpack(a)
    raise TypeError(f"{name} must be a CuPy array or a GPU array speaking DLPack or __cuda_array_interface__, "
                    f"got {type(a).__name__}")


def torch_view(t, name: str):
    """A CuPy array over a CUDA torch tensor's memory, holding the tensor
    alive: BF16 as ``uint16`` bits, FP8 e4m3 as ``uint8`` bits, the others as
    their NumPy dtype, strides kept. Nothing is copied and no stream is
    synchronised (the caller orders its work after the tensor's producer).
    A tensor that carries the CuPy array it was made from
    (``t._cupyep_array``, set by ``cupyep.deep_ep``) gives that array back.
    TypeError for a CPU tensor or a dtype cupyep does not carry."""
    import cupy
    a = getattr(t, "_cupyep_array", None)
    if a is not None and a.data.ptr == t.data_ptr() and a.shape == t.shape:
        return a
    if not _TORCH_DTYPES:
        import torch
        _TORCH_DTYPES.update({getattr(torch, n): np.dtype(d) for n, d in _TORCH_NAMES.items() if hasattr(torch, n)})
    dtype = _TORCH_DTYPES.get(getattr(t, "dtype", None))
    if dtype is None:
        raise TypeError(f"{name} must be a CUDA torch tensor (or a CuPy array), got "
                        f"{type(t).__name__} {getattr(t, 'dtype', '')}")
    if not t.is_cuda:
        raise TypeError(f"{name} must be on a CUDA device, got a tensor on {t.device}")
    shape = t.shape  # a torch.Size, a tuple
    n = t.numel()
    if n == 0:
        return cupy.empty(shape, dtype=dtype)
    if t.is_contiguous():  # the common case: no strides to convert
        strides, span = None, n * dtype.itemsize
    else:
        strides = tuple(s * dtype.itemsize for s in t.stride())
        if any(s < 0 for s in strides):
            raise TypeError(f"{name} has negative strides")
        span = sum((d - 1) * s for d, s in zip(shape, strides)) + dtype.itemsize
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(t.data_ptr(), span, t, t.get_device()), 0), strides)


def carve(shapes: dict, dtype=np.int32, zero: bool = False, dtypes: dict | None = None) -> "Carved":
    """Arrays for ``shapes`` ({name: shape}) in one device allocation, each
    64-byte aligned: of ``dtype``, or of ``dtypes[name]`` where given; zeroed
    by one memset on the current stream when ``zero``. Returns a
    :class:`Carved` (``carved[name]`` is the cupy array; each keeps the
    allocation alive)."""
    import cupy
    plan, nbytes = carve_plan(shapes, dtype, dtypes)
    base = cupy.empty(nbytes, dtype=np.uint8)
    if zero:
        cupy.cuda.runtime.memsetAsync(base.data.ptr, 0, base.nbytes, cupy.cuda.get_current_stream().ptr)
    return Carved(base, plan)


def carve_plan(shapes: dict, dtype=np.int32, dtypes: dict | None = None) -> tuple[dict, int]:
    """({name: (byte offset, shape, dtype)}, bytes of the allocation) of
    :func:`carve`'s arguments (cached: a caller that keeps the plan makes
    its Carved from one allocation of that many bytes)."""
    key = (tuple(shapes.items()), dtype, tuple(dtypes.items()) if dtypes else None)
    plan = _carve_plans.get(key)
    if plan is None:
        if len(_carve_plans) >= _MAX_PLANS:  # shapes that vary per call (a received count) would grow it
            _carve_plans.clear()
        parts, end = {}, 0
        for name, shape in shapes.items():
            dt = np.dtype(dtypes.get(name, dtype) if dtypes else dtype)
            parts[name] = (end, tuple(shape), dt)
            end += -(-math.prod(shape) * dt.itemsize // 64) * 64
        plan = _carve_plans[key] = (parts, max(end, 1))
    return plan


_carve_plans: dict = {}  # carve's arguments -> ({name: (offset, shape, dtype)}, bytes)
_MAX_PLANS = 1024


class Carved:
    """The arrays of one :func:`carve`: ``carved[name]`` is a cupy view of
    its part of the allocation, made when first asked for (a view costs the
    host a couple of microseconds, and a kernel needs only the address:
    ``carved.ptr(name)``, integer arithmetic). Entries set with
    ``carved[name] = value`` (an array of the caller's instead of its part,
    or any value) are held as given; ``ptr`` of an absent name is 0."""

    __slots__ = ("base", "base_ptr", "_plan", "_items")

    def __init__(self, base, plan: dict):
        self.base, self.base_ptr, self._plan, self._items = base, base.data.ptr, plan, {}

    @property
    def parts(self) -> dict:
        """{name: (byte offset, shape, dtype)}: the carve plan (cupyep.arrays.carve_plan)."""
        return self._plan

    def __getitem__(self, name):
        item = self._items.get(name)
        if item is None:
            if name not in self._plan:
                raise KeyError(name)
            item = self._items[name] = self.view(name)
        return item

    def __setitem__(self, name, value) -> None:
        self._items[name] = value

    def __contains__(self, name) -> bool:
        return name in self._items or name in self._plan

    def get(self, name, default=None):
        return self[name] if name in self else default

    def ptr(self, name) -> int:
        """Device address of ``name``'s array (0 when absent)."""
        item = self._items.get(name)
        if item is not None:
            return item.data.ptr
        part = self._plan.get(name)
        return self.base_ptr + part[0] if part is not None else 0

    def view(self, name, shape=None):
        """A new cupy view of ``name``'s part, of its carved shape or of
        ``shape`` (no more elements than carved)."""
        import cupy
        off, carved, dt = self._plan[name]
        if shape is not None and math.prod(shape) > math.prod(carved):
            raise ValueError(f"{name}: a view of shape {tuple(shape)} exceeds the carved {carved}")
        return cupy.ndarray(carved if shape is None else shape, dt, self.base.data + off)


def copy(a):
    """A C-contiguous device copy of ``a`` on the current stream: one memcpy
    when ``a`` is C-contiguous (a kernel's strided copy otherwise)."""
    import cupy
    if not a.flags.c_contiguous:
        return a.copy(order="C")
    out = cupy.empty(a.shape, dtype=a.dtype)
    if a.nbytes:
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, a.data.ptr, a.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)
    return out


def check(a, name: str, dtype=None, shape: tuple | None = None, ndim: int | None = None, contiguous: bool = True):
    """Raise ValueError unless ``a`` has the dtype, shape (None entries match
    anything) and number of dimensions asked for. Returns ``a``."""
    if dtype is not None and a.dtype != dtype:  # a dtype compares equal to what np.dtype() makes of it
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        got = a.shape
        bad = len(got) != len(shape)
        for s, d in zip(shape, got):  # a plain loop: no generator on the calls' host path
            if s is not None and s != d:
                bad = True
        if bad:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a


def dispatch_rows(x, x_scales=None):
    """The rows a dispatch sends and their FP8 scales, checked: x [T, H]
    uint16 (BF16 bits) with no scales, or uint8 (FP8 e4m3 bits) with
    x_scales [T, H / 128] float32, given beside it or as the tuple
    (x, x_scales). Returns (x, x_scales or None) as cupy arrays."""
    if isinstance(x, tuple):
        if x_scales is not None:
            raise ValueError("pass FP8 scales either in the x tuple or as x_scales, not both")
        x, x_scales = x
    x = check(as_cupy(x, "x"), "x", ndim=2)
    if x.dtype not in (BF16, FP8):
        raise ValueError(f"x must be uint16 (BF16 bits) or uint8 (FP8 bits), got {x.dtype}")
    T, H = x.shape
    x_scales = as_cupy(x_scales, "x_scales")
    if x.dtype == FP8:
        if x_scales is None:
            raise ValueError("FP8 x needs x_scales [T, H / 128] float32")
        check(x_scales, "x_scales", np.float32, shape=(T, H // 128))
    elif x_scales is not None:
        raise ValueError("x_scales is only for FP8 (uint8) x")
    return x, x_scales


def check_expert_ids(topk_idx, num_experts: int) -> None:
    """ValueError unless every id of cupy ``topk_idx`` lies in [-1, num_experts)
    (one pass on the device and one read back; not under graph capture)."""
    if topk_idx.size:
        lo, hi, _ = routing_range(topk_idx)
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_idx holds expert ids in [{lo}, {hi}], outside [-1, {num_experts})")


def routing_range(topk_idx, duplicates: bool = False) -> tuple[int, int, int]:
    """(smallest id, largest id, repeats) of cupy ``topk_idx`` ([T, k]
    integer ids, T * k > 0), host ints; repeats (with ``duplicates``, else
    0): the slots whose id >= 0 an earlier slot of the same token names.

    One elementwise pass over the tokens (atomic min, max and add into three
    words) and one read back: no sort and no reductions (CuPy's compile
    for seconds on their first use, which a rank would spend inside a
    collective call while its peers wait)."""
    import cupy
    ids = cupy.ascontiguousarray(topk_idx)
    T, k = ids.shape
    out = cupy.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 0], dtype=np.int64)
    _routing_range_kernel()(ids, np.int64(k), np.int64(bool(duplicates)), out, size=T)
    lo, hi, rep = (int(v) for v in out.get())
    return lo, hi, rep


_ELEMENTWISE: dict = {}  # name -> the cupy.ElementwiseKernel of this module, built on first use


def _routing_range_kernel():
    if "range" not in _ELEMENTWISE:
        import cupy
        _ELEMENTWISE["range"] = cupy.ElementwiseKernel(
            "raw T ids, int64 k, int64 dup", "raw int64 out",
            """const T* row = &ids[i * k];
               long long lo = row[0], hi = row[0], rep = 0;
               for (long long a = 0; a < k; ++a) {
                   const long long e = row[a];
                   lo = min(lo, e);
                   hi = max(hi, e);
                   if (dup && e >= 0)
                       for (long long b = 0; b < a; ++b)
                           if ((long long)row[b] == e) { ++rep; break; }
               }
               atomicMin(&out[0], lo);
               atomicMax(&out[1], hi);
               if (rep) atomicAdd(reinterpret_cast<unsigned long long*>(&out[2]), (unsigned long long)rep);""",
            "cupyep_routing_range")
    return _ELEMENTWISE["range"]


def expert_counts(topk_idx, num_experts: int):
    """[E] int64 (the array module of ``topk_idx``): how many slots of
    ``topk_idx`` ([T, k] integer ids in [-1, E), NumPy or CuPy) name each
    expert; -1 slots (and any id outside [0, E)) count for none.

    On the device one elementwise pass of atomic adds: no reduction (CuPy's
    bincount takes the ids' max and min first, two reductions whose first
    use compiles for seconds, on the path between a dispatch and its
    combine) and nothing read back."""
    xp = xp_of(topk_idx)
    if xp is np:
        ids = np.asarray(topk_idx).ravel()
        return np.bincount(ids[(ids >= 0) & (ids < num_experts)], minlength=num_experts).astype(np.int64)
    counts = xp.zeros(int(num_experts), dtype=np.int64)
    if topk_idx.size:
        _count_kernel()(topk_idx, np.int64(num_experts), counts)
    return counts


def _count_kernel():
    if "count" not in _ELEMENTWISE:
        import cupy
        _ELEMENTWISE["count"] = cupy.ElementwiseKernel(
            "T e, int64 n", "raw int64 counts",
            "if (e >= 0 && e < n) atomicAdd(reinterpret_cast<unsigned long long*>(&counts[e]), 1ull)",
            "cupyep_expert_counts")
    return _ELEMENTWISE["count"]
