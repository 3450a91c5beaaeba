"""Benchmark output: one JSON object per line (JSONL), written by rank 0."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def environment(group) -> dict:
    """Where a result came from: GPU, ranks, sharing, versions."""
    import cupy
    import numpy
    env = {"ranks": group.world_size, "ranks_per_node": group.local_size, "ranks_per_gpu": group.ranks_per_gpu,
           "sm_capped": group.sm_capped, "sm_share": group.sm_share,
           "cupy": cupy.__version__, "numpy": numpy.__version__, "host": platform.node(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if group.has_gpu:
        from ...sm_defaults import device
        gpu, sms = device(group.device_id)
        env.update(gpu=gpu, sms=sms)
    return env


class JsonlWriter:
    """Appends records to ``path`` (rank 0 only) and echoes a short line."""

    def __init__(self, path: str | None, group, echo=print):
        self.path = Path(path) if path else None
        self.group = group
        self.echo = echo
        self.env = environment(group)
        if self.path and group.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.group.rank != 0:
            return
        rec = {**record, "env": self.env}
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        self.echo(json.dumps({k: v for k, v in record.items() if not isinstance(v, (list, dict))}))


def write_document(doc: dict, path: str | None) -> None:
    """One JSON document (a probe's whole record, indented): printed, and
    written to ``path`` when given (call on one rank)."""
    text = json.dumps(doc, indent=1)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
