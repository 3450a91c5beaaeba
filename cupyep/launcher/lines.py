"""The ranks' output, whole lines at a time.

mpiexec forwards each rank's standard streams as byte streams: a line can
reach the terminal in two pieces with another rank's line between them
(MPICH's Hydra did so for 4 to 10 of 12,000 lines of four ranks, with every
rank writing whole lines; its ``-prepend-pattern`` made it 164). So the
launcher carries the ranks' output itself:

- before mpiexec starts, :class:`LineForwarder` makes one FIFO per rank and
  stream in a private directory (``<rank>.out``, ``<rank>.err``) and opens
  each for reading and writing (so a read never sees end-of-file while the
  job runs, and no open blocks);
- every rank first runs :data:`RANK_BOOT`: it points its file descriptors 1
  and 2 at its own FIFOs (its rank from the variable its mpiexec sets; left
  as they are when there is no FIFO for it) and makes ``sys.stdout`` and
  ``sys.stderr`` line-buffered, then starts mpi4py's runner (which aborts
  the job when a rank raises), with ``sys.path`` and ``sys.argv`` as under
  ``python -m mpi4py``;
- one thread reads every FIFO and writes each complete line to the
  launcher's stdout or stderr in one write; a rank's unfinished last line
  is written when the job ends (:meth:`LineForwarder.close`).

Lines keep their bytes (no rank prefix). This module imports nothing from
CUDA.
"""
from __future__ import annotations

import os
import select
import sys
import threading

ENV_VAR = "CUPYEP_IO_DIR"
#: The variables mpiexec sets to a rank's index (Open MPI, PMIx, MPICH's Hydra).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")

RANK_BOOT = (
    "import os, sys\n"
    f"d = os.environ.get({ENV_VAR!r})\n"
    f"r = next((os.environ[v] for v in {RANK_VARS!r} if v in os.environ), None)\n"
    "if d and r is not None:\n"
    "    for fd, kind in ((1, 'out'), (2, 'err')):\n"
    "        try:\n"
    "            w = os.open(os.path.join(d, r + '.' + kind), os.O_WRONLY | os.O_NONBLOCK)\n"
    "        except OSError:\n"
    "            break\n"
    "        os.set_blocking(w, True)\n"
    "        os.dup2(w, fd)\n"
    "        os.close(w)\n"
    "sys.stdout.reconfigure(line_buffering=True)\n"
    "sys.stderr.reconfigure(line_buffering=True)\n"
    "from mpi4py.run import main\n"
    "main()\n")

_CHUNK = 1 << 16
_POLL_S = 0.05


class LineForwarder:
    """FIFOs for ``num_ranks`` ranks in ``directory`` (which must exist and
    be private), and a thread that forwards whole lines from them to
    ``stdout`` and ``stderr`` (binary streams; default the launcher's).
    Use as a context manager, or call :meth:`start` and :meth:`close`."""

    def __init__(self, directory: str, num_ranks: int, stdout=None, stderr=None):
        self.directory = str(directory)
        self.targets = {"out": stdout or sys.stdout.buffer, "err": stderr or sys.stderr.buffer}
        self._fds = {}  # fd -> (target stream, pending bytes of an unfinished line)
        for r in range(int(num_ranks)):
            for kind in ("out", "err"):
                path = os.path.join(self.directory, f"{r}.{kind}")
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer of its own: no EOF, no blocking open
                self._fds[fd] = [self.targets[kind], b""]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cupyep-rank-lines", daemon=True)

    def start(self) -> "LineForwarder":
        self._thread.start()
        return self

    def _drain(self, fd) -> None:
        target, pending = self._fds[fd]
        data = pending
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
            if len(chunk) < _CHUNK:
                break
        cut = data.rfind(b"\n") + 1
        if cut:
            target.write(data[:cut])
            target.flush()
        self._fds[fd][1] = data[cut:]

    def _run(self) -> None:
        fds = list(self._fds)
        while not self._stop.is_set():
            ready, _, _ = select.select(fds, [], [], _POLL_S)
            for fd in ready:
                self._drain(fd)

    def close(self) -> None:
        """Stop the thread, forward what the FIFOs still hold (and every
        unfinished last line), close them. The ranks must have ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for fd, (target, _) in list(self._fds.items()):
            self._drain(fd)
            rest = self._fds[fd][1]
            if rest:
                target.write(rest + b"\n")
                target.flush()
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
