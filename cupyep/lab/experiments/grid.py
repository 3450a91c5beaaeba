"""Grids of knobs: expansion into configurations and their keys.

A grid is either

- a dict ``knob -> values``: ``values`` is a list (or tuple) of values, or a
  single value (anything else, a dict included, is one value). It expands to
  the cartesian product in this order: knobs in the dict's order, values in
  their listed order, the first knob varying slowest and the last fastest
  (``itertools.product``). ``{"tokens": [4, 8], "hidden": [128, 256]}``
  gives (4, 128), (4, 256), (8, 128), (8, 256).
- a list of explicit configuration dicts ``knob -> value``, kept in order.

Every configuration is completed with the study's defaults for the knobs it
does not set, and its values are normalised through JSON (tuples become
lists, NumPy scalars Python numbers), so a configuration is a plain
JSON-able dict whose keys follow the study's knob order. Configurations
that come out equal are kept once, at their first position.

A configuration's key, :func:`config_key`, is its canonical JSON (keys
sorted, no spaces): the identity used to resume a sweep.
"""
from __future__ import annotations

import itertools
import json
import numbers
from typing import Mapping, Sequence

import numpy as np

__all__ = ["expand", "config_key", "normalize", "parse_value"]

_WORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str):
    """One value written on a command line (``--grid`` of python -m
    cupyep.lab.experiments, ``--where`` of python -m cupyep.lab.plotting): int, else
    float, else true / false / null (any case) as True / False / None, else
    the string itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return _WORDS.get(text.lower(), text)


def _json_default(value):
    if hasattr(value, "item") and callable(value.item):  # NumPy scalars
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def normalize(value, name: str = "value"):
    """``value`` as JSON gives it back (tuples -> lists, NumPy scalars ->
    int/float/bool); ValueError naming ``name`` when it is not JSON-able."""
    try:
        return json.loads(json.dumps(value, default=_json_default, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"knob {name!r}: value {value!r} is not JSON-able ({exc})") from None


def config_key(config: Mapping) -> str:
    """Canonical JSON of a configuration: keys sorted, separators without
    spaces. Equal configurations give equal keys."""
    return json.dumps(normalize(dict(config)), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _check_knobs(names, knobs: Mapping, where: str) -> None:
    unknown = [n for n in names if n not in knobs]
    if unknown:
        raise ValueError(f"unknown knob {unknown[0]!r} in {where}; the knobs are {list(knobs)}")


def _values(name, values) -> list:
    if isinstance(values, (list, tuple)):
        if not values:
            raise ValueError(f"knob {name!r} has an empty list of values")
        return list(values)
    return [values]


def check_value(name: str, value, default, choices=None) -> None:
    """ValueError unless ``value`` has the type of the knob's ``default``
    (bool, int, float: an int too, str) and, with ``choices``, is one of
    them: a typo in a grid is the caller's error, not a configuration that
    cannot run here."""
    if choices is not None and value not in choices:
        raise ValueError(f"knob {name!r}: {value!r} is not one of {list(choices)}")
    integral = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    if isinstance(default, bool):
        ok = isinstance(value, (bool, np.bool_)) or (integral and value in (0, 1))
    elif isinstance(default, int):
        ok = integral
    elif isinstance(default, float):
        ok = integral or isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise ValueError(f"knob {name!r}: {value!r} is not of type {type(default).__name__} (its default is "
                         f"{default!r})")


def expand(grid: Mapping | Sequence[Mapping], knobs: Mapping, choices: Mapping | None = None) -> list[dict]:
    """The configurations of ``grid``, complete and in order (module docstring).

    Arguments:
        grid: dict knob -> value or list of values, or a list of dicts
            knob -> value.
        knobs: the study's knobs, dict name -> default, in declared order.
        choices: dict knob -> the values it may take (knobs not in it: any
            value of the default's type).

    Returns:
        list of dicts, one per distinct configuration, each holding every
        knob of ``knobs`` in its order.

    Raises:
        ValueError: a knob not in ``knobs`` (naming it and the allowed
            ones), an empty value list, a value that is not JSON-able, a
            value of another type than the knob's default or not among its
            choices.
    """
    if isinstance(grid, Mapping):
        _check_knobs(grid, knobs, "the grid")
        names = list(grid)
        partial = [dict(zip(names, combo))
                   for combo in itertools.product(*(_values(n, grid[n]) for n in names))]
    elif isinstance(grid, Sequence) and not isinstance(grid, (str, bytes)):
        partial = []
        for i, config in enumerate(grid):
            if not isinstance(config, Mapping):
                raise ValueError(f"configuration {i} is a {type(config).__name__}, not a dict")
            _check_knobs(config, knobs, f"configuration {i}")
            partial.append(dict(config))
    else:
        raise ValueError(f"a grid is a dict knob -> values or a list of dicts, got {type(grid).__name__}")
    for config in partial:
        for name, value in config.items():
            check_value(name, value, knobs[name], (choices or {}).get(name))
    out, seen = [], set()
    for config in partial:
        full = {name: normalize(config.get(name, default), name) for name, default in knobs.items()}
        key = config_key(full)
        if key not in seen:
            seen.add(key)
            out.append(full)
    return out
