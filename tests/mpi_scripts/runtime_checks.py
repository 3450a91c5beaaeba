"""Helper of the runtime_*.py MPI scripts (tests/test_runtime_mpi.py).

Each rank records named checks; :meth:`Checks.finish` combines them over all
ranks (a check passes only when it passes on every rank), rank 0 prints one
``CHECK <name> PASS|FAIL <details>`` line per check, the ``EXTRA <json>``
payload and ``<MARKER> OK`` or ``<MARKER> FAILED``, and every rank exits 0
only when all checks passed everywhere.
"""
import json
import sys
import traceback

from mpi4py import MPI


class Checks:
    def __init__(self, comm=MPI.COMM_WORLD):
        self.comm = comm
        self.results = {}  # name -> (ok, detail), in order

    def expect(self, name, cond, detail=""):
        assert name not in self.results, f"duplicate check {name}"
        self.results[name] = (bool(cond), "" if cond else str(detail))
        return bool(cond)

    def equal(self, name, got, want):
        return self.expect(name, got == want, f"got {got!r}, want {want!r}")

    def raises(self, name, exc_type, fn, match=None):
        """fn() must raise exactly ``exc_type`` (or a subclass), whose message contains ``match``."""
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - we report what was raised
            if not isinstance(exc, exc_type):
                return self.expect(name, False, f"raised {type(exc).__name__}: {exc} (want {exc_type.__name__})")
            if match is not None and match not in str(exc):
                return self.expect(name, False, f"{exc_type.__name__} message {str(exc)!r} lacks {match!r}")
            return self.expect(name, True)
        return self.expect(name, False, f"returned {value!r} instead of raising {exc_type.__name__}")

    def run(self, name, fn):
        """Record fn()'s truth value; an exception is a failure."""
        try:
            ok = fn()
        except Exception:  # noqa: BLE001
            return self.expect(name, False, traceback.format_exc(limit=3).replace("\n", " | "))
        return self.expect(name, ok, "returned False")

    def finish(self, marker, extra=None):
        comm = self.comm
        mine = list(self.results.items())
        everyone = comm.gather(mine, root=0)
        all_ok = all(ok for ok, _ in self.results.values())
        all_ok = comm.allreduce(all_ok, op=MPI.LAND)
        if comm.rank == 0:
            names = list(dict.fromkeys(n for r in everyone for n, _ in r))
            for name in names:
                fails = []
                for r, res in enumerate(everyone):
                    d = dict(res)
                    if name not in d:
                        fails.append(f"rank {r}: not run")
                    elif not d[name][0]:
                        fails.append(f"rank {r}: {d[name][1]}")
                print(f"CHECK {name} {'FAIL' if fails else 'PASS'} {'; '.join(fails)}", flush=True)
            if extra is not None:
                print("EXTRA " + json.dumps(extra), flush=True)
            print(f"{marker} {'OK' if all_ok else 'FAILED'}", flush=True)
        comm.Barrier()
        sys.exit(0 if all_ok else 1)


def describe(g):
    """The topology fields of a Group, JSON-friendly."""
    return dict(rank=g.rank, world_size=g.world_size, node=g.node, num_nodes=g.num_nodes,
                local_rank=g.local_rank, local_size=g.local_size, node_ranks=g.node_ranks,
                device_id=g.device_id, has_gpu=g.has_gpu, num_devices=g.num_devices,
                ranks_per_gpu=g.ranks_per_gpu, shares_gpu=g.shares_gpu, timeout_s=g.timeout_s)


def check_topology(checks, prefix, g, comm, ranks_per_node, global_rank):
    """Checks of a Group over ``comm`` with nodes of ``ranks_per_node``
    consecutive ranks of ``comm``; ``global_rank`` is the COMM_WORLD rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    node = rank // ranks_per_node
    first = node * ranks_per_node
    checks.expect(f"{prefix}.comm", g.comm == comm, "group.comm is not the communicator passed")
    checks.equal(f"{prefix}.rank", g.rank, rank)
    checks.equal(f"{prefix}.world_size", g.world_size, size)
    checks.equal(f"{prefix}.node", g.node, node)
    checks.equal(f"{prefix}.num_nodes", g.num_nodes, size // ranks_per_node)
    checks.equal(f"{prefix}.local_rank", g.local_rank, rank % ranks_per_node)
    checks.equal(f"{prefix}.local_size", g.local_size, ranks_per_node)
    checks.equal(f"{prefix}.node_ranks", g.node_ranks, list(range(first, first + ranks_per_node)))
    checks.equal(f"{prefix}.node_comm_size", g.node_comm.Get_size(), ranks_per_node)
    checks.equal(f"{prefix}.node_comm_rank", g.node_comm.Get_rank(), g.local_rank)
    # node_comm really spans this node's ranks (collective over node_comm).
    checks.equal(f"{prefix}.node_comm_members", g.node_comm.allgather(rank), g.node_ranks)
    checks.equal(f"{prefix}.node_comm_world_members", g.node_comm.allgather(global_rank),
                 comm.allgather(global_rank)[first:first + ranks_per_node])
