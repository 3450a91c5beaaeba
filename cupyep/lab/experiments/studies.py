"""The registry of studies a sweep can run.

A :class:`Study` names its knobs with their defaults (a dict, in the order
grids expand and records list them), says whether it needs a GPU, and
holds the rank-side function ``run(group, config) -> dict``:

- collective over the ranks: every rank calls it with the same complete
  configuration (every knob set); rank 0's return is recorded.
- returns the metrics of one configuration: a flat dict of JSON-able values
  whose names are not knobs nor record fields (see ``cupyep.lab.experiments.worker``).
- raises :class:`Skip` (``Skip("hidden must be a multiple of 128")``) for a
  configuration that cannot run; the library's ``ValueError`` for bad sizes
  counts the same. Either is recorded as status "skipped" with its reason;
  any other exception as "error". The sweep goes on either way.

Studies are looked up by name (:func:`get`). The worker imports a study's
module before looking it up, so a study registered outside this package
must live in an importable module (not ``__main__``).

Built-in studies (modules in :data:`BUILTIN_MODULES`, imported on first
lookup): ``"reference"`` (``cupyep.lab.experiments.cpu_reference``, the NumPy
reference dispatch + combine on CPU), ``"normal"``
(``cupyep.lab.experiments.gpu_normal``, normal-mode dispatch and combine on the
GPU, either transport), ``"low_latency"``
(``cupyep.lab.experiments.gpu_low_latency``, low-latency dispatch and combine on
the GPU) and ``"internode"`` (``cupyep.lab.experiments.gpu_internode``, the
two-hop dispatch and combine across emulated or real nodes).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Skip", "Study", "register", "get", "all_studies", "BUILTIN_MODULES"]

BUILTIN_MODULES = ("cupyep.lab.experiments.cpu_reference", "cupyep.lab.experiments.gpu_normal",
                   "cupyep.lab.experiments.gpu_low_latency", "cupyep.lab.experiments.gpu_internode")

_REGISTRY: dict[str, "Study"] = {}
_builtins_loaded = False


class Skip(Exception):
    """Raised by a study's ``run`` for a configuration that cannot run; the
    message is the recorded reason."""


@dataclass(frozen=True)
class Study:
    """One kind of measurement a sweep runs per configuration.

    Attributes:
        name: registry name, e.g. "reference".
        knobs: dict knob -> default value (JSON-able), in declared order.
        run: ``run(group, config) -> dict`` (module docstring).
        needs_gpu: True when it cannot run without a CUDA GPU.
        description: one line for ``--list``.
        module: importable module that registers it (default: ``run``'s).
        choices: dict knob -> the values it may take (checked before
            anything runs; cupyep.lab.experiments.grid.check_value).
    """
    name: str
    knobs: dict
    run: Callable
    needs_gpu: bool = False
    description: str = ""
    module: str = field(default="")
    choices: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.module:
            object.__setattr__(self, "module", getattr(self.run, "__module__", "") or "")


def gpu_fixtures(group, state: dict):
    """(GPU barrier, copy bytes/s) a GPU study keeps in its ``state`` across
    configurations: made on the first call (the node's barrier, or across
    nodes the world's: cupyep.barrier.gpu_barrier); the copy bandwidth (read
    + write) measured once on local rank 0 and shared, for the efficiencies."""
    if "barrier" not in state:
        from ...barrier import gpu_barrier
        from ..bench.copy import copy_bandwidth
        state["barrier"] = gpu_barrier(group)
        bw = copy_bandwidth(2 << 30) if group.local_rank == 0 else 0.0
        state["copy_bw"] = group.comm.bcast(bw)
    return state["barrier"], state["copy_bw"]


def register(study: Study) -> Study:
    """Add ``study`` to the registry (a study of the same name from the same
    module is replaced, so re-imports are harmless) and return it."""
    old = _REGISTRY.get(study.name)
    if old is not None and old.module != study.module:
        raise ValueError(f"study {study.name!r} is already registered by {old.module}")
    _REGISTRY[study.name] = study
    return study


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def get(name: str, module: str | None = None) -> Study:
    """The study registered as ``name``, after importing ``module`` (when
    given) and the built-in study modules; ValueError naming the known ones."""
    _load_builtins()
    if module and name not in _REGISTRY:
        importlib.import_module(module)
    if name not in _REGISTRY:
        raise ValueError(f"unknown study {name!r}; the studies are {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def all_studies() -> list[Study]:
    """Every registered study, by name."""
    _load_builtins()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]
