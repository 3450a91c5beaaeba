"""Per-process call records: what each rank was doing when it stopped.

Under the launcher every rank gets ``CUPYEP_CALLS_DIR``, a directory the
launcher created.  A process that imports this module with the variable set
keeps one record there, ``<pid>.calls``: a small file mapped shared
(``mmap``), holding its pid, its MPI rank (from the launcher's environment),
whether it reached interpreter shutdown, the call it is in, the last call it
entered and how many calls of each kind it entered.  Public methods carry
``@traced_call("LowLatencyBuffer.combine")``; each call writes a few int64
words of the mapping (no system call; about 0.24 us in all), so the record
survives the process however it ends, even by SIGKILL.  Without the
variable, ``traced_call`` returns the function unchanged.

Record layout (native-endian int64 words, then names)::

    words[0..7]     MAGIC, pid, rank (-1 unknown), state, current, last,
                    number of names, raised
                    (state: 1 running, 2 exited through interpreter
                    shutdown, 3 the same after an uncaught exception;
                    current / last / raised: name index + 1, 0 for none;
                    raised: the kind whose latest call ended by an exception;
                    cleared when a later call of that kind returns)
    words[8..8+N)   calls entered, per name (N = MAX_NAMES)
    then N names of NAME_BYTES bytes (UTF-8, NUL-padded)
    then ERROR_BYTES bytes: "Type: message" of the exception the raised
                    call ended by (UTF-8, NUL-padded, cut to fit)

The process also connects a unix socket to the launcher's ``ends`` socket
in that directory and never writes to it.  However the process ends, the
kernel closes that connection together with the process's other
descriptors, before its parent (mpiexec or its proxy) can have reacted by
stopping the other ranks, so the connections close in the order in which
the ranks ended.  The launcher (:class:`EndWatcher`) waits on all of them in
one ``epoll``, whose ready list keeps that order even when the watcher runs
late on a busy host (8 ranks on 2 CPU cores, one SIGKILLed: the right rank
named in 90 runs of 90).  It then reads the records (:func:`read_records`,
:func:`failure_report`) and names the rank that ended first, its exit status
when it saw one (the process's zombie state in ``/proc`` before its parent
reaps it: best effort) and the call it was in.

This module imports nothing beyond the standard library.
"""
from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

__all__ = ["ENV_VAR", "traced_call", "open_record", "close_record", "CallRecord", "read_record",
           "read_records", "EndWatcher", "Ending", "failure_report", "where_report"]

ENV_VAR = "CUPYEP_CALLS_DIR"
SUFFIX = ".calls"
SOCKET_NAME = "ends"
MAGIC = 0x31534C4C41435043  # b"CPCALLS1" read as a little-endian int64
MAX_NAMES = 64
NAME_BYTES = 64
HEADER_WORDS = 8
W_MAGIC, W_PID, W_RANK, W_STATE, W_CURRENT, W_LAST, W_NUM_NAMES, W_RAISED = range(8)
NAMES_OFFSET = 8 * (HEADER_WORDS + MAX_NAMES)
ERROR_OFFSET = NAMES_OFFSET + MAX_NAMES * NAME_BYTES
ERROR_BYTES = 512  # "Type: message" of the last call that raised, UTF-8, NUL-padded
RECORD_BYTES = ERROR_OFFSET + ERROR_BYTES
RUNNING, EXITED, EXITED_AFTER_EXCEPTION = 1, 2, 3
# Variables through which MPI launchers tell a process its rank in COMM_WORLD.
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")

# ------------------------------------------------------------ rank side ---

_names: dict[str, int] = {}   # name -> index, kept also while no record is open
_words = None                 # memoryview 'q' of the open record, or None
_record = None                # (mmap, socket or None, path) of the open record


def env_rank(env=None) -> int:
    """This process's rank in COMM_WORLD as its MPI launcher set it (-1: none)."""
    env = os.environ if env is None else env
    for var in RANK_VARS:
        with contextlib.suppress(KeyError, ValueError):
            return int(env[var])
    return -1


def _write_name(index: int, name: str) -> None:
    mm = _record[0]
    data = name.encode()[:NAME_BYTES - 1]
    off = NAMES_OFFSET + index * NAME_BYTES
    mm[off:off + NAME_BYTES] = data + bytes(NAME_BYTES - len(data))
    _words[W_NUM_NAMES] = max(_words[W_NUM_NAMES], index + 1)


def _write_error(exc: BaseException) -> None:
    """Keep "Type: message" of ``exc`` in the record (the launcher shows it
    when the process is stuck or ends before Python could print it)."""
    if _record is None:
        return
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = text.replace("\n", " ")
    data = text.encode(errors="replace")[:ERROR_BYTES - 1]
    _record[0][ERROR_OFFSET:ERROR_OFFSET + ERROR_BYTES] = data + bytes(ERROR_BYTES - len(data))


def _index(name: str) -> int:
    """Index of ``name`` in the record's name table (registered on first use)."""
    i = _names.get(name)
    if i is None:
        if len(_names) >= MAX_NAMES:
            raise ValueError(f"more than {MAX_NAMES} traced call names")
        i = _names[name] = len(_names)
        if _words is not None:
            _write_name(i, name)
    return i


def open_record(directory: str, rank: int | None = None) -> str:
    """Start this process's record in ``directory``; return its path.

    Called at import when ``CUPYEP_CALLS_DIR`` is set; a process has at most
    one record (a second call returns the open one's path).  ``rank``
    defaults to the rank the MPI launcher put in the environment (-1 when
    none did).  The record appears under its final name only once it is
    filled in, so a reader never sees a half-made one; then the process
    connects to the launcher's socket, if there is one.
    """
    global _words, _record
    if _record is not None:
        return _record[2]
    pid = os.getpid()
    path = os.path.join(directory, f"{pid}{SUFFIX}")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, RECORD_BYTES)
        mm = mmap.mmap(fd, RECORD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # mmap keeps its own descriptor
    words = memoryview(mm).cast("q")
    words[W_PID] = pid
    words[W_RANK] = env_rank() if rank is None else int(rank)
    words[W_STATE] = RUNNING
    _record, _words = (mm, None, path), words
    for name, i in _names.items():
        _write_name(i, name)
    words[W_MAGIC] = MAGIC
    os.rename(tmp, path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    try:
        sock.connect(os.path.join(directory, SOCKET_NAME))
    except OSError:
        sock.close()  # no launcher listening: the record still tells where we were
    else:
        _record = (mm, sock, path)
    return path


def close_record(state: int = EXITED) -> None:
    """Mark the record ``state`` and stop writing it (at interpreter exit)."""
    global _words, _record
    if _record is None:
        return
    _, sock, _ = _record
    _words[W_STATE] = state
    _words = None
    _record = None
    if sock is not None:
        sock.close()


def _at_exit() -> None:
    # An uncaught exception has been printed (sys.last_value set) before
    # atexit handlers run; SystemExit does not set it.
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    close_record(EXITED_AFTER_EXCEPTION if failed is not None else EXITED)


def _after_fork_in_child() -> None:
    # A forked child is not the rank: it stops writing the parent's record
    global _words, _record
    if _record is not None and _record[1] is not None:
        _record[1].close()  # the parent's connection stays open
    _words = None
    _record = None


def traced_call(name: str):
    """Decorator: record each call of the function as a call of ``name``.

    Per call (record open): saves the current call, stores this one as
    current and last, adds one to its count; on return or exception restores
    the current call (an exception also marks the call as raised, until a
    later call of the same kind returns).  Without
    an open record at decoration time the function is returned unchanged.
    """
    i = _index(name)

    def decorate(fn):
        if _words is None:
            return fn
        count = HEADER_WORDS + i
        tag = i + 1

        def traced(*args, **kwargs):
            w = _words
            if w is None:  # record closed (interpreter exit, forked child)
                return fn(*args, **kwargs)
            prev = w[W_CURRENT]
            w[W_CURRENT] = tag
            w[W_LAST] = tag
            w[count] += 1
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                w[W_RAISED] = tag
                _write_error(exc)
                raise
            else:  # a later call of the kind that raised returned: the kind's last call did not raise
                if w[W_RAISED] == tag:
                    w[W_RAISED] = 0
                return result
            finally:
                w[W_CURRENT] = prev

        traced.__wrapped__ = fn
        traced.__name__ = fn.__name__
        traced.__qualname__ = fn.__qualname__
        traced.__doc__ = fn.__doc__
        traced.__module__ = fn.__module__
        return traced

    return decorate


if os.environ.get(ENV_VAR):
    try:
        open_record(os.environ[ENV_VAR])
    except OSError as exc:  # the launcher's directory is gone: run untraced
        print(f"cupyep.launcher.calls: no call record ({exc})", file=sys.stderr)
    else:
        atexit.register(_at_exit)
        os.register_at_fork(after_in_child=_after_fork_in_child)


# -------------------------------------------------------- launcher side ---

@dataclass
class CallRecord:
    """A record as read back.

    Attributes: pid, rank (-1 unknown), state (RUNNING, EXITED,
    EXITED_AFTER_EXCEPTION), current (the name of the call the process is
    in, or None), last (the last call entered, or None), raised (the last
    call that ended by an exception, or None), counts (name -> calls
    entered).
    """
    pid: int
    rank: int
    state: int
    current: str | None
    last: str | None
    counts: dict[str, int] = field(default_factory=dict)
    raised: str | None = None
    error: str | None = None

    def where(self) -> str:
        """'during X, call N of that kind' / 'after X, call N of that kind' /
        'after X raised (Type: message), call N of that kind' / 'before any
        traced call'."""
        if self.current:
            return f"during {self.current}, call {self.counts.get(self.current, 0)} of that kind"
        if self.last:
            raised = ""
            if self.raised == self.last:
                raised = f" raised ({self.error})" if self.error else " raised"
            return f"after {self.last}{raised}, call {self.counts.get(self.last, 0)} of that kind"
        return "before any traced call"

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank >= 0 else f"pid {self.pid}"


def read_record(path: str) -> CallRecord | None:
    """The record in file ``path``, or None if it is missing or not a record."""
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_BYTES)
    except OSError:
        return None
    if len(data) < RECORD_BYTES:
        return None
    words = memoryview(data).cast("q")
    if words[W_MAGIC] != MAGIC:
        return None
    n = min(int(words[W_NUM_NAMES]), MAX_NAMES)
    names = []
    for i in range(n):
        raw = data[NAMES_OFFSET + i * NAME_BYTES:NAMES_OFFSET + (i + 1) * NAME_BYTES]
        names.append(raw.split(b"\0", 1)[0].decode(errors="replace"))

    def name(tag):
        return names[tag - 1] if 0 < tag <= n else None

    counts = {names[i]: int(words[HEADER_WORDS + i]) for i in range(n) if names[i]}
    error = data[ERROR_OFFSET:ERROR_OFFSET + ERROR_BYTES].split(b"\0", 1)[0].decode(errors="replace")
    return CallRecord(pid=int(words[W_PID]), rank=int(words[W_RANK]), state=int(words[W_STATE]),
                      current=name(int(words[W_CURRENT])), last=name(int(words[W_LAST])), counts=counts,
                      raised=name(int(words[W_RAISED])), error=error or None)


def read_records(directory: str) -> list[CallRecord]:
    """Every record in ``directory``, ordered by rank, then pid."""
    try:
        files = [f for f in os.listdir(directory) if f.endswith(SUFFIX)]
    except OSError:
        return []
    recs = [r for r in (read_record(os.path.join(directory, f)) for f in files) if r is not None]
    return sorted(recs, key=lambda r: (r.rank, r.pid))


@dataclass
class Ending:
    """One process's end as a watcher saw it: ``order`` (0 for the first
    connection to close), ``pid`` and ``status`` (a wait status, or None when
    its parent reaped it before the watcher could read it)."""
    order: int
    pid: int
    status: int | None = None


def _zombie_status(pid: int) -> int | None:
    """Wait status of ``pid`` while it is a zombie (``/proc/PID/stat`` field
    52, Linux 3.5 and later), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return int(fields[49])


def describe_status(status: int | None) -> str:
    """'signal 9, SIGKILL' / 'exit status 3' / '' for a wait status."""
    if status is None:
        return ""
    if status & 0x7F:
        sig = status & 0x7F
        try:
            return f"signal {sig}, {signal.Signals(sig).name}"
        except ValueError:
            return f"signal {sig}"
    return f"exit status {(status >> 8) & 0xFF}"


class EndWatcher:
    """Learns in which order the processes keeping records in ``directory``
    end (Linux).

    Listens on ``directory/ends``; every record's process connects once.
    One thread waits in ``epoll`` on the listening socket, on every
    connection (closed when its process ends: the order of the ends) and on
    a pidfd per process (readable once it is a zombie: then its wait status
    is read from /proc, if its parent has not reaped it yet).  The thread is
    a daemon: nothing here delays exit.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(os.path.join(directory, SOCKET_NAME))
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._ep = select.epoll()
        self._ep.register(self._listener.fileno(), select.EPOLLIN)
        self._ep.register(self._wake_r, select.EPOLLIN)
        self._conns: dict[int, tuple[socket.socket, int]] = {}  # fd -> (connection, pid)
        self._pidfds: dict[int, int] = {}   # pidfd -> pid
        self._pids: set[int] = set()
        self._ends: dict[int, Ending] = {}  # pid -> its end
        self._status_done: set[int] = set()
        self._closed = 0                    # connections closed so far
        self._mutex = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="cupyep-calls", daemon=True)

    def start(self) -> "EndWatcher":
        self._thread.start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[0]
            self._conns[conn.fileno()] = (conn, pid)
            self._ep.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            try:
                pidfd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                with self._mutex:
                    self._status_done.add(pid)
            else:
                self._pidfds[pidfd] = pid
                self._ep.register(pidfd, select.EPOLLIN)
            with self._mutex:
                self._pids.add(pid)

    def _loop(self) -> None:
        while True:
            try:
                events = self._ep.poll()
            except InterruptedError:
                continue
            # In the order the kernel saw the descriptors become ready.
            for fd, _ in events:
                if fd == self._wake_r:
                    return
                if fd == self._listener.fileno():
                    self._accept()
                elif fd in self._conns:
                    conn, pid = self._conns.pop(fd)
                    self._ep.unregister(fd)
                    conn.close()
                    with self._mutex:
                        status = self._ends[pid].status if pid in self._ends else None
                        self._ends[pid] = Ending(self._closed, pid, status)
                        self._closed += 1
                elif fd in self._pidfds:
                    pid = self._pidfds.pop(fd)
                    status = _zombie_status(pid)
                    self._ep.unregister(fd)
                    os.close(fd)
                    with self._mutex:
                        self._status_done.add(pid)
                        if pid in self._ends:
                            self._ends[pid].status = status
                        else:  # its connection closes in the same batch or the next one
                            self._ends[pid] = Ending(-1, pid, status)

    def settle(self, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` s until every process that connected and no
        longer runs has its end (and its status attempt) recorded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._mutex:
                pending = [p for p in self._pids
                           if (p not in self._ends or self._ends[p].order < 0 or p not in self._status_done)
                           and not _alive(p)]
            if not pending:
                return
            time.sleep(0.01)

    def stop(self) -> None:
        """End the thread and close the sockets."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive():
            for conn, _ in self._conns.values():
                conn.close()
            for fd in self._pidfds:
                os.close(fd)
            self._ep.close()
            os.close(self._wake_r)
        os.close(self._wake_w)
        self._listener.close()

    @property
    def ends(self) -> list[Ending]:
        """Ends seen so far, earliest first."""
        with self._mutex:
            return sorted((e for e in self._ends.values() if e.order >= 0), key=lambda e: e.order)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def _rank_list(ranks: list[int]) -> str:
    """'0, 2-5, 7' for sorted ints."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def where_report(records: list[CallRecord], skip_pid: int | None = None) -> list[str]:
    """Lines grouping the processes by where they were: 'ranks 0, 2-7:
    during Buffer.combine, call 12 of that kind'."""
    groups: dict[str, list[CallRecord]] = {}
    for r in sorted(records, key=lambda r: (r.rank < 0, r.rank, r.pid)):
        if r.pid != skip_pid:
            what = r.where() + (" (exited)" if r.state != RUNNING else "")
            groups.setdefault(what, []).append(r)
    lines = []
    for what, recs in groups.items():
        ranks = sorted(r.rank for r in recs if r.rank >= 0)
        who = []
        if ranks:
            who.append(("rank " if len(ranks) == 1 else "ranks ") + _rank_list(ranks))
        who += [f"pid {r.pid}" for r in recs if r.rank < 0]
        lines.append(f"{', '.join(who)}: {what}")
    return lines


def first_end(records: list[CallRecord], ends: list[Ending]):
    """(record, Ending) of the process that most likely ended the job, or None.

    In order: the first to end after an uncaught exception, else the first
    to end through interpreter shutdown (sys.exit, or its program finished
    while others still ran), else the first to end at all (killed, crashed).
    Ranks that a launcher stops once one has died end after it.
    """
    by_pid = {r.pid: r for r in records}
    seen = [(by_pid[e.pid], e) for e in ends if e.pid in by_pid]
    for states in ((EXITED_AFTER_EXCEPTION,), (EXITED,), (RUNNING, EXITED, EXITED_AFTER_EXCEPTION)):
        for rec, end in seen:
            if rec.state in states:
                return rec, end
    return None


def failure_report(directory: str, ends: list[Ending]) -> list[str]:
    """Lines naming the process that ended first and where every process was."""
    records = read_records(directory)
    if not records:
        return []
    first = first_end(records, ends)
    lines = []
    skip = None
    if first is not None:
        rec, end = first
        skip = rec.pid
        status = describe_status(end.status)
        if rec.state == EXITED_AFTER_EXCEPTION:
            how = "raised an uncaught exception" + (f" (then ended: {status})" if status else "")
        else:
            how = ("exited" if rec.state == EXITED else "died") + (f" ({status})" if status else "")
        lines.append(f"{rec.label} (pid {rec.pid}) {how} {rec.where()}")
        rest = where_report(records, skip)
        if rest:
            lines.append("the others then: " + "; ".join(rest))
    else:
        lines.append("where the ranks were: " + "; ".join(where_report(records)))
    return lines
