"""Run-time compilation of the kernels in ``cuda_src/``.

Each kernel specialisation is a frozen :class:`KernelSpec`: a source file, the
kernel name expressions to instantiate (template arguments are the
compile-time constants), and a readable name such as
``intranode_dispatch_ranks_8``. :func:`load` compiles through
``cupy.RawModule`` (NVRTC) and caches per process; CuPy caches the cubin on
disk. CuPy's disk cache key covers the source text and the options but not the
headers pulled in with ``-I``, so the options carry a hash of every file under
``cuda_src/``: editing any header recompiles.

``python -m cupyep.jit --check`` compiles every registered specialisation for
sm_90 with ``nvcc`` (no GPU needed) and prints registers, stack and spills.
``python -m cupyep.jit --warm`` (on a GPU machine) compiles every one into the
caches the run time loads from, so that no rank compiles inside a call.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# The build names, also used as jit.KernelSpec, jit.CUDA_SRC, jit.source_hash, ...
from .nvcc import (BASE_OPTIONS, CUDA_SRC, CompileReport, KernelSpec, _demangle, find_nvcc,  # noqa: F401
                   kernel_symbols, mangled_prefix, nvcc_cubin, source_hash)
from .nvcc import _PTXAS_ENTRY, _PTXAS_FRAME, _PTXAS_REGS, _PTXAS_SMEM
from .nvshmem_build import device_arch, include_options, link_cubin, load_module

# Modules that own kernels; each defines ``kernel_specs() -> list[KernelSpec]``
# listing the specialisations the check command compiles.
SPEC_MODULES = (
    "cupyep.barrier",
    "cupyep.lab.bench.copy",
    "cupyep.lab.bench.floor",
    "cupyep.lab.bench.scatter",
    "cupyep.lab.bench.skew",
    "cupyep.lab.bench.timing",
    "cupyep.fp8",
    "cupyep.normal.layout",
    "cupyep.normal.node_kernels",
    "cupyep.normal.queue_kernels",
    "cupyep.normal.direct_kernels",
    "cupyep.normal.expert_major",
    "cupyep.normal.internode_kernels",
    "cupyep.low_latency.kernels",
    "cupyep.nvshmem",
)


def raw_module(spec: KernelSpec):
    """The ``cupy.RawModule`` of a non-NVSHMEM ``spec`` (NVRTC; compiled at
    first use, through CuPy's disk cache): the one constructor that loading
    and :func:`warm_all` share, so that both hit the same cache entry."""
    import cupy
    code = (CUDA_SRC / spec.source).read_text()
    return cupy.RawModule(code=code, options=spec.options(), name_expressions=list(spec.kernels))


class Module:
    """A compiled specialisation: ``module[kernel_name_expression]`` gives the
    ``cupy.RawKernel``-like function."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        if spec.nvshmem:  # nvcc + nvlink against NVSHMEM's device library, then NVSHMEM's module init
            self._module, self._functions = load_module(spec)
            return
        self._module = raw_module(spec)
        self._functions = {k: self._module.get_function(k) for k in spec.kernels}

    def __getitem__(self, kernel: str):
        return self._functions[kernel]


_modules: dict[tuple[int, KernelSpec], Module] = {}


def load(spec: KernelSpec, group=None) -> Module:
    """Compile (or fetch from cache) ``spec`` for the current device.

    With ``group`` this is collective over the node: local rank 0 compiles
    first and broadcasts its outcome over the node; the others then hit CuPy's
    disk cache. When rank 0's compile fails, every rank of the node raises
    (rank 0 the compiler's error, the others a RuntimeError quoting it), so no
    rank waits for a module that will not come.
    """
    import cupy
    key = (cupy.cuda.Device().id, spec)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    if group is not None and group.local_size > 1:
        failure, error = None, None
        if group.local_rank == 0:
            try:
                mod = Module(spec)
            except Exception as exc:  # every rank of the node raises it, none waits for a module
                failure, error = f"{type(exc).__name__}: {exc}", exc
        failure = group.node_comm.bcast(failure, root=0)
        if failure is not None:
            if error is not None:
                raise error
            raise RuntimeError(f"{spec.name}: local rank 0 of this node could not compile it, so no rank of the "
                               f"node loads it: {failure}")
        if group.local_rank != 0:
            mod = Module(spec)
    else:
        mod = Module(spec)
    _modules[key] = mod
    return mod


def kernel(spec: KernelSpec, group=None):
    """The kernel function of a single-kernel ``spec`` (loaded as by :func:`load`)."""
    if len(spec.kernels) != 1:
        raise ValueError(f"{spec.name} has {len(spec.kernels)} kernels; look one up in jit.load(spec)")
    return load(spec, group)[spec.kernels[0]]


# --- kernel argument structs -------------------------------------------------

def struct_dtype(fields: list[tuple[str, object]]) -> np.dtype:
    """A NumPy dtype laid out like the C struct with the same fields in order
    (natural alignment), for passing structs by value to kernels."""
    return np.dtype(fields, align=True)


_STRUCT_CODES = {"i1": "b", "u1": "B", "b1": "?", "i2": "h", "u2": "H", "i4": "i", "u4": "I", "i8": "q", "u8": "Q",
                 "f4": "f", "f8": "d"}


def _packer(dtype: np.dtype):
    """How :func:`pack` writes one struct dtype: a generated function of the
    keyword dict that reads every field in one ``struct.pack`` call of a
    little-endian format with the dtype's padding (no per-field Python loop:
    launches pack their arguments on the host's critical path)."""
    import struct
    fmt, exprs, consts, end = ["<"], [], {}, 0
    for i, (name, (ft, offset)) in enumerate(sorted(dtype.fields.items(), key=lambda kv: kv[1][1])):
        if offset > end:
            fmt.append(f"{offset - end}x")
        if ft.fields:  # a nested struct: its bytes (zeros by default)
            fmt.append(f"{ft.itemsize}s")
            consts[f"_t{i}"], consts[f"_z{i}"] = ft, bytes(ft.itemsize)
            exprs.append(f"_nested(g({name!r}, _z{i}), _t{i})")
        else:
            code = _STRUCT_CODES.get(f"{ft.kind}{ft.itemsize}")
            if code is None or ft.subdtype is not None:
                raise TypeError(f"pack cannot write field {name!r} of type {ft}")
            fmt.append(code)
            exprs.append(f"g({name!r}, 0)")
        end = offset + ft.itemsize
    if dtype.itemsize > end:
        fmt.append(f"{dtype.itemsize - end}x")
    names = frozenset(dtype.fields)

    def unknown(values: dict):
        raise ValueError(f"{dtype} has no field(s) {sorted(set(values) - names)}")
    env = dict(consts, _pack=struct.Struct("".join(fmt)).pack, _frombuffer=np.frombuffer, _dtype=dtype,
               _names=names, _nested=_nested_bytes, _unknown=unknown)
    src = (f"def packed(values):\n"
           f"    if not _names.issuperset(values):\n"
           f"        _unknown(values)\n"
           f"    g = values.get\n"
           f"    return _frombuffer(_pack({', '.join(exprs)}), _dtype)[0]\n")
    exec(compile(src, f"<pack {dtype}>", "exec"), env)
    return env["packed"]


def _nested_bytes(v, dtype: np.dtype) -> bytes:
    """A nested struct field's bytes: bytes as given, an np.void of ``dtype``
    as its bytes, anything else converted to ``dtype``."""
    if isinstance(v, bytes):
        return v
    if isinstance(v, np.void) and (v.dtype is dtype or v.dtype == dtype):
        return v.tobytes()
    return np.asarray(v, dtype=dtype).tobytes()


_packers: dict = {}  # dtype -> its generated packing function


def pack(dtype: np.dtype, **values) -> np.void:
    """One struct value of ``dtype`` (a :func:`struct_dtype`); unspecified
    fields are zero, nested structs are np.void values of their dtype."""
    packer = _packers.get(dtype)
    if packer is None:
        packer = _packers[dtype] = _packer(dtype)
    return packer(values)


def ptr(a) -> int:
    """Device pointer of a CuPy array for a struct field, or 0 (null) for None."""
    return 0 if a is None else a.data.ptr


class Address:
    """Stands for a CuPy array in a packing function where only its shape
    and address are read (``a.shape``, ``a.data.ptr``; see :func:`ptr`)."""

    __slots__ = ("shape", "data", "ptr")

    def __init__(self, shape: tuple, address: int):
        self.shape, self.ptr = tuple(shape), int(address)
        self.data = self


# Distinct address steps, one per source of an ArgTemplate: far above any device address, and a
# word moved by one of them is told from a word moved by another. An int32 source (a count) moves by
# distinct steps below 2**31 instead, in the low or the high half of its 8-byte word.
_STEP = 1 << 52
_INT_STEP = 1 << 24
#: Launch plans (ArgTemplates) a route keeps, one per call shape; past it the cache is cleared (call
#: shapes that vary per call, a token count, would grow it without bound).
MAX_PLANS = 256


class ArgTemplate:
    """A kernel argument struct packed once per call shape, whose addresses
    of per-call memory are patched at each launch.

    ``pack(addresses)`` must be the launch's own packing function, a pure
    function of ``addresses`` ({source name: device address}, 0 for none)
    returning the struct (an np.void). It is called once with every address
    0 (the template) and once per source with that source moved by a
    distinct step: the 8-byte words that move by the step are the source's
    (a pointer field equal to the source's address plus a fixed offset, as
    a carved array's address is its allocation's plus its offset). A launch
    writes ``template + address`` into those words, so that its bytes equal
    ``pack(addresses)``'s; :meth:`check` compares the two. Sources named in
    ``ints`` are int32 fields (counts in [0, 2**31)) rather than addresses:
    they move by smaller steps, and a launch adds them into the half of
    their word that holds them.

    :meth:`launch` passes the bytes to ``cuLaunchKernel`` through one
    kernel-parameter pointer (the driver copies them at launch, so the one
    buffer serves every call); its addresses come in the order of
    ``sources``."""

    def __init__(self, pack, sources: tuple[str, ...], ints: tuple[str, ...] = ()):
        self.sources = tuple(sources)
        if set(ints) - set(self.sources):
            raise ValueError(f"ArgTemplate: ints {sorted(set(ints) - set(self.sources))} are not sources")
        base = pack(dict.fromkeys(self.sources, 0))
        nbytes = base.dtype.itemsize
        if nbytes % 8:
            raise ValueError(f"an ArgTemplate needs a struct of whole 8-byte words, got {nbytes} bytes")
        template = np.frombuffer(base.tobytes(), dtype=np.uint64)
        idx, which, shifts = [], [], []
        for i, s in enumerate(self.sources):
            step = _INT_STEP * (i + 1) if s in ints else _STEP * (i + 1)
            moved = np.frombuffer(pack({t: (step if t == s else 0) for t in self.sources}).tobytes(),
                                  dtype=np.uint64)
            delta = moved - template  # uint64 wraps: a word that moved by the step reads exactly the step
            low, high = np.uint64(step), np.uint64((step << 32) % 2**64)
            if np.any((delta != 0) & (delta != low) & ((delta != high) | (s not in ints))):
                raise ValueError(f"ArgTemplate: source {s!r} changes a word other than by its value")
            for w in np.flatnonzero(delta).tolist():
                idx.append(w)
                which.append(i)
                shifts.append(0 if delta[w] == low else 32)
        #: {source: the struct's 8-byte words that hold its address (or count)}
        self.words = {s: [w for w, j in zip(idx, which) if j == i] for i, s in enumerate(self.sources)}
        self._buffer = template.copy()  # the words no source moves never change
        self._params = np.array([self._buffer.ctypes.data], dtype=np.uint64)  # void*[1]: the struct's address
        self._params_ptr = int(self._params.ctypes.data)
        # One generated statement per patched word (no per-word loop or array temporaries: the
        # launch is on the host's critical path): word = its template value + its source's address.
        args = ", ".join(f"a{i}" for i in range(len(self.sources)))
        terms: dict = {}  # word -> what it adds (two int32 sources may share one word)
        for w, j, sh in zip(idx, which, shifts):
            terms.setdefault(w, []).append(f"(a{j} << 32)" if sh else f"a{j}")
        body = "".join(f"    w[{w}] = {int(template[w])} + " + " + ".join(t) + "\n"
                       for w, t in terms.items()) or "    pass\n"
        env: dict = {}
        exec(compile(f"def write(w, {args}):\n{body}", "<ArgTemplate>", "exec"), env)
        self._write_words, self._words = env["write"], memoryview(self._buffer)

    def _write(self, addresses) -> None:
        self._write_words(self._words, *addresses)

    def packed(self, *addresses) -> bytes:
        """The bytes a launch with ``addresses`` (in the order of ``sources``) passes."""
        self._write(addresses)
        return self._buffer.tobytes()

    def check(self, pack, *addresses) -> None:
        """AssertionError unless the bytes a launch with ``addresses`` passes
        equal ``pack``'s of them, at the first byte that differs."""
        full = pack(dict(zip(self.sources, addresses))).tobytes()
        got = self.packed(*addresses)
        if got != full:
            at = next(i for i in range(len(full)) if got[i] != full[i])
            raise AssertionError(f"ArgTemplate: the patched struct differs from its pack at byte {at}")

    def launch(self, fn, num_blocks: int, num_threads: int, shared_bytes: int, stream_ptr: int, *addresses) -> None:
        """Launch ``fn`` (a loaded kernel taking this struct by value) on
        ``stream_ptr``, the struct patched for ``addresses``."""
        from cupy.cuda import driver
        self._write_words(self._words, *addresses)
        driver.launchKernel(fn.kernel.ptr, num_blocks, 1, 1, num_threads, 1, 1, shared_bytes, stream_ptr,
                            self._params_ptr, 0)


_resident: dict[tuple[int, int, int], int] = {}


def max_resident_blocks(function, num_threads: int, shared_bytes: int = 0) -> int:
    """Blocks of a loaded kernel ``function`` one SM can hold at once (asked
    of the driver once per kernel and launch shape)."""
    key = (function.kernel.ptr, num_threads, shared_bytes)
    per_sm = _resident.get(key)
    if per_sm is None:
        from cupy.cuda import driver
        per_sm = _resident[key] = driver.occupancyMaxActiveBlocksPerMultiprocessor(*key)
    return per_sm


def require_resident(what: str, per_sm: int, blocks: int, num_threads: int, ranks_per_gpu: int, num_sms: int,
                     knob: str, step: int = 1, spare: int = 0) -> None:
    """ValueError unless ``ranks_per_gpu`` ranks x ``blocks`` blocks (``per_sm``
    fit on one SM), plus ``spare`` more, can all be resident on ``num_sms`` SMs
    at once: kernels whose blocks wait on other ranks' blocks would otherwise
    deadlock (``spare``: room kept for blocks that do not wait, so they always
    progress). ``knob`` names the setting to lower (a multiple of ``step``)."""
    if per_sm < 1 or blocks * ranks_per_gpu + spare > per_sm * num_sms:
        limit = (per_sm * num_sms - spare) // max(1, ranks_per_gpu) // step * step
        raise ValueError(
            f"{what}: {ranks_per_gpu} ranks x {knob}={blocks} blocks of {num_threads} threads cannot all be "
            f"resident on {num_sms} SMs ({per_sm} such blocks per SM); the ranks wait on each other and would "
            f"deadlock. Use {knob} <= {limit}")


# --- offline compile check -----------------------------------------------------

def all_specs() -> list[KernelSpec]:
    """Every registered specialisation, from the modules in SPEC_MODULES."""
    import importlib
    specs: list[KernelSpec] = []
    for name in SPEC_MODULES:
        specs.extend(importlib.import_module(name).kernel_specs())
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate kernel spec names: {sorted(dup)}")
    return specs


def compile_offline(spec: KernelSpec, arch: str = "sm_90", nvcc: str | None = None) -> list[CompileReport]:
    """Compile ``spec`` to a cubin with nvcc and parse ptxas' resource usage
    (NVSHMEM specs are also linked against NVSHMEM's device library, so a
    missing device function shows here).

    Raises RuntimeError with the compiler output when compilation fails.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = nvcc_cubin(spec, Path(tmp) / "k.cubin", arch, nvcc, include_options() if spec.nvshmem else ())
        kernel_symbols(spec, report)  # every name expression has its symbol (what a path-loaded module needs)
        if spec.nvshmem:
            link_cubin(Path(tmp) / "k.cubin", Path(tmp) / "linked.cubin", arch)
    reports: list[CompileReport] = []
    cur: CompileReport | None = None
    for line in report.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            cur = CompileReport(spec.name, m.group(1))
            reports.append(cur)
        elif cur is not None and (m := _PTXAS_FRAME.search(line)):
            cur.stack, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        elif cur is not None and (m := _PTXAS_REGS.search(line)):
            cur.registers = int(m.group(1))
            if s := _PTXAS_SMEM.search(line):
                cur.smem = int(s.group(1))
            cur = None
    names = _demangle([r.kernel for r in reports])
    for r in reports:
        r.kernel = names[r.kernel]
    return reports


def check_all(arch: str = "sm_90", jobs: int | None = None, out=sys.stdout) -> list[CompileReport]:
    """Compile every registered specialisation offline and print a table."""
    specs = all_specs()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda s: compile_offline(s, arch), specs))
    rows = [r for rs in results for r in rs]
    print(f"{'specialisation':44s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s} {'smem':>6s}  kernel", file=out)
    for r in rows:
        print(f"{r.spec:44s} {r.registers:4d} {r.stack:5d} {r.spill_stores:5d}/{r.spill_loads:<5d} {r.smem:6d}  {r.kernel}", file=out)
    print(f"compiled {len(specs)} specialisations ({len(rows)} kernels) for {arch}; "
          f"{sum(r.spill_stores > 0 for r in rows)} kernels spill", file=out)
    return rows


def _warm_one(job: tuple[KernelSpec, str]) -> str:
    """Build one spec into its run-time cache (a worker of :func:`warm_all`);
    returns "" when built, else why it was skipped."""
    spec, arch = job
    if spec.nvshmem:
        from .nvshmem_build import NvshmemUnavailable, build
        try:
            build(spec, arch)  # the linked cubin in nvshmem_build.cache_dir()
        except NvshmemUnavailable as exc:
            return f"NVSHMEM is not installed ({exc})".splitlines()[0]
        return ""
    raw_module(spec).compile()
    return ""


def warm_all(jobs: int | None = None, out=sys.stdout) -> int:
    """Compile every registered specialisation for this machine's GPU into the
    caches :func:`load` reads (CuPy's disk cache for the NVRTC builds,
    ``nvshmem_build.cache_dir()`` for the NVSHMEM ones), in ``jobs`` worker
    processes (default: one per CPU).

    A kernel compiles in seconds when its cache is cold, and a rank that
    compiles inside a collective call (the first call of a route, a lazily
    loaded variant) starts its kernels that much after its peers, whose
    bounded waits may then run out (CommTimeoutError with a short
    ``timeout_s``). After this, no rank compiles. NVSHMEM specs are skipped,
    with a line, where NVSHMEM is not installed. Returns the number of
    specialisations built; RuntimeError naming each one that failed."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    arch = device_arch()
    specs = all_specs()
    workers = max(1, min(len(specs), jobs or os.cpu_count() or 2))
    built, skipped, failed = 0, {}, {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {s.name: pool.submit(_warm_one, (s, arch)) for s in specs}
        for name, fut in futures.items():
            try:
                why = fut.result()
            except Exception as exc:  # reported together below
                failed[name] = f"{type(exc).__name__}: {exc}"
                continue
            if why:
                skipped[name] = why
            else:
                built += 1
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", file=out)
    print(f"warmed {built} of {len(specs)} specialisations for {arch} ({workers} processes)", file=out, flush=True)
    if failed:
        raise RuntimeError("could not compile: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
    return built


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyep.jit", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compile every specialisation with nvcc (no GPU needed)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--list", action="store_true", help="list the specialisations")
    p.add_argument("--warm", action="store_true",
                   help="compile every specialisation into the run-time caches (needs a CUDA GPU)")
    args = p.parse_args(argv)
    if args.list:
        for s in all_specs():
            print(s.name, s.source, *s.kernels)
        return 0
    if args.warm:
        try:
            device_arch()
        except Exception:  # CuPy's error without a GPU or driver
            print("skipped: no GPU (python -m cupyep.jit --warm compiles for this machine's GPU; none found)")
            return 2
        try:
            warm_all(args.jobs)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    if args.check:
        try:
            check_all(args.arch, args.jobs)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

