"""Sweep records on disk: one JSON object per line (JSONL), appended.

The fields of a record are listed in ``cupyep.lab.experiments.worker``. A sweep
killed while writing leaves at most one truncated last line, which
:func:`load` skips; a malformed line elsewhere is an error (the file is not
what it claims to be).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["load", "append", "repair", "select", "record_ranks_per_node"]


def load(path) -> list[dict]:
    """Every record of the JSONL file ``path``, in file order; [] when the
    file does not exist. A last line that does not parse (a write cut short)
    is skipped; ValueError for a bad line before it."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record: {line[:120]!r}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i + 1}: a record is a JSON object, got {type(rec).__name__}")
        out.append(rec)
    return out


def append(path, record: dict) -> None:
    """Append ``record`` as one line and flush it to the disk (a killed
    process keeps every record appended before). A last line cut short by
    an earlier kill is removed first (:func:`repair`)."""
    path = Path(path)
    repair(path)
    with path.open("ab") as f:
        f.write((json.dumps(record, allow_nan=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def repair(path) -> None:
    """End ``path`` on a complete line: a last line without its newline is
    completed when it parses as JSON, else cut off."""
    path = Path(path)
    if not path.exists():
        return
    with path.open("rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        try:
            json.loads(data[start:])
        except ValueError:
            f.truncate(start)
        else:
            f.write(b"\n")


def record_ranks_per_node(rec: dict):
    """The ranks per node of the layout that produced ``rec``: its
    "ranks_per_node" field, else its "ranks" (a record without the field
    ran on one node)."""
    value = rec.get("ranks_per_node")
    return rec.get("ranks") if value is None else value


def select(records, study: str, keys, ranks: int | None = None, ranks_per_node: int | None = None) -> dict:
    """The latest record of ``study`` for each key in ``keys`` whose layout
    matches: dict key -> record (keys without one are absent).

    A record's ranks per node is :func:`record_ranks_per_node` (its
    "ranks_per_node" field, else its "ranks": a record without it is of one node).

    - ``ranks`` given: only records with that "ranks"; ``ranks_per_node``
      given: only those of that ranks per node; ``ranks_per_node`` None:
      only one-node records (ranks per node == ``ranks``).
    - ``ranks`` None: any rank count; ``ranks_per_node`` given: only
      records of that ranks per node; both None: any layout.
    """
    wanted = set(keys)
    if ranks is not None and ranks_per_node is None:
        ranks_per_node = ranks
    out = {}
    for rec in records:
        if rec.get("study") != study or rec.get("key") not in wanted:
            continue
        if ranks is not None and rec.get("ranks") != ranks:
            continue
        if ranks_per_node is not None and record_ranks_per_node(rec) != ranks_per_node:
            continue
        out[rec["key"]] = rec
    return out
