"""cupyep.ipc_peers (a rank's own arrays read in place by its peers) and the
direct route's choice of an in-place combine, over stand-ins of CUDA IPC and
of the node's communicator (no GPU)."""
from types import SimpleNamespace

import numpy as np
import pytest

from cupyep.ipc_peers import PeerArrays
from cupyep.normal import direct_kernels as D


class _Comm:
    """One rank's view of a node: the exchange returns every rank's record,
    the others' given by the test as (handle, offset), (None, 0) for a rank
    without rows, or None for a rank that cannot export its array."""

    def __init__(self, rank, others):
        self.rank, self.others, self.calls = rank, others, 0

    def exchange(self, mine):
        from cupyep.ipc_peers import _CANNOT, _EMPTY, _EXPORTED, _record
        self.calls += 1
        recs = [_record(_CANNOT) if o is None else _record(_EMPTY) if o[0] is None else
                _record(_EXPORTED, o[0].ljust(64, b"\0"), o[1]) for o in self.others]
        recs.insert(self.rank, mine)
        return np.stack(recs)


def _peers(comm, **kw):
    return PeerArrays(comm.exchange, comm.rank, **kw)


class _Ipc:
    """CUDA IPC stand-in: an allocation is (handle, base); export finds the
    one holding a pointer; open maps a handle at a fresh address."""

    def __init__(self, allocations, symmetric=None):
        self.allocations = allocations  # [(handle bytes, base, size)]
        self.opened, self.closed, self.next = [], [], 0x7000_0000
        self.symmetric_maps = symmetric or {}  # handle -> address of a peer SymmetricBuffer here

    def symmetric(self, handle):
        return self.symmetric_maps.get(handle.rstrip(b"\0"))

    def export(self, ptr):
        for handle, base, size in self.allocations:
            if base <= ptr < base + size:
                return handle.ljust(64, b"\0"), ptr - base
        raise RuntimeError("not in a cudaMalloc allocation")

    def open(self, handle):
        self.next += 0x100_0000
        self.opened.append(handle.rstrip(b"\0"))
        return self.next

    def close(self, base):
        self.closed.append(base)


def test_peers_arrays_are_their_mapped_allocations_plus_offsets_mapped_once():
    ipc = _Ipc([(b"mine", 0x1000, 0x1000)])
    comm = _Comm(1, [(b"h0", 0x40), (b"h2", 0x80)])
    peers = _peers(comm, ipc=ipc)
    got = peers.exchange(0x1010)
    assert got[1] == 0x1010  # this rank's own address, not mapped
    assert got[0] == 0x7100_0000 + 0x40 and got[2] == 0x7200_0000 + 0x80
    assert peers.exchange(0x1020) == got[:1] + [0x1020] + got[2:]  # the same allocations: no new mapping
    assert ipc.opened == [b"h0", b"h2"] and peers.opened == 2 and peers.num_mapped == 2


def test_an_allocation_made_again_at_the_same_address_is_mapped_again():
    """Its handle's bytes differ, so the old mapping is never read for it."""
    ipc = _Ipc([(b"mine", 0x1000, 0x1000)])
    comm = _Comm(0, [(b"first", 0x10)])
    peers = _peers(comm, ipc=ipc)
    a = peers.exchange(0x1000)[1]
    comm.others = [(b"second", 0x10)]
    b = peers.exchange(0x1000)[1]
    assert a != b and ipc.opened == [b"first", b"second"]


def test_the_least_recently_used_mapping_is_closed_after_the_callers_wait():
    ipc, waits = _Ipc([(b"mine", 0x1000, 0x1000)]), []
    comm = _Comm(0, [(b"a", 0)])
    peers = _peers(comm, max_mappings=2, before_close=lambda: waits.append(len(ipc.closed)), ipc=ipc)
    bases = {}
    for h in (b"a", b"b", b"a", b"c"):  # "a" used again, so "b" is the oldest when "c" comes
        comm.others = [(h, 0)]
        bases[h] = peers.exchange(0x1000)[1]
    assert ipc.closed == [bases[b"b"]] and waits == [0] and peers.num_mapped == 2
    peers.close()
    assert sorted(ipc.closed) == sorted([bases[b"b"], bases[b"a"], bases[b"c"]]) and peers.num_mapped == 0
    assert len(waits) == 2  # the wait before the last closes


def test_a_rank_whose_array_cannot_be_exported_makes_every_rank_copy():
    ipc = _Ipc([(b"mine", 0x1000, 0x1000)])
    peers = _peers(_Comm(0, [None]), ipc=ipc)
    assert peers.exchange(0x1000) is None and ipc.opened == []
    peers = _peers(_Comm(0, [(b"h", 0)]), ipc=ipc)
    assert peers.exchange(0x9000) is None  # this rank's memory is not a cudaMalloc allocation
    assert peers.exchange(None) is None  # or the caller could not offer it (not contiguous)
    assert ipc.opened == []


def test_an_array_in_a_peers_cupyep_buffer_is_read_where_that_buffer_is_mapped():
    """A dispatch's received rows (the direct pool, a SymmetricBuffer) are not opened a second time."""
    ipc = _Ipc([(b"mine", 0x1000, 0x1000)], symmetric={b"pool": 0x5000_0000})
    peers = _peers(_Comm(0, [(b"pool", 0x300)]), ipc=ipc)
    assert peers.exchange(0x1000)[1] == 0x5000_0300 and ipc.opened == [] and peers.num_mapped == 0


def test_a_rank_without_rows_takes_part_with_address_zero():
    ipc = _Ipc([(b"mine", 0x1000, 0x1000)])
    peers = _peers(_Comm(0, [(None, 0), (b"h", 0x20)]), ipc=ipc)
    got = peers.exchange(0x1000)
    assert got[0] == 0x1000 and got[1] == 0 and got[2] == 0x7100_0020
    peers = _peers(_Comm(1, [(b"h", 0)]), ipc=ipc)
    assert peers.exchange(0, empty=True)[1] == 0


def test_x_peers_field_is_every_rank_then_zeros():
    raw = np.frombuffer(D.x_peers_bytes([5, 6, 7]), dtype=np.uint64)
    assert raw.tolist() == [5, 6, 7] + [0] * (D.MAX_IN_PLACE_RANKS - 3)
    assert D.x_peers_bytes(None) == bytes(8 * D.MAX_IN_PLACE_RANKS)
    with pytest.raises(ValueError, match="at most"):
        D.x_peers_bytes(list(range(D.MAX_IN_PLACE_RANKS + 1)))
    args = D.COMBINE_ARGS_DTYPE
    assert args.fields["x_peers"][0] == D.X_PEERS_DTYPE and args.fields["in_place"][0] == np.int32


# ---------------------------------------------------------------- the direct route's choice
class _X:
    def __init__(self, rows=4, contiguous=True, ptr=0x1000):
        self.shape, self.flags = (rows, 8), SimpleNamespace(c_contiguous=contiguous)
        self.data = SimpleNamespace(ptr=ptr)


def _route(others, capturing=False, ipc=None):
    from cupyep.normal.direct import DirectRoute
    route = DirectRoute.__new__(DirectRoute)
    stream = SimpleNamespace(is_capturing=lambda: capturing, synchronize=lambda: None)
    comm = _Comm(0, others)
    route.node = SimpleNamespace(comm_stream=stream, group=SimpleNamespace(node_comm=comm))
    route._peer_x = _peers(comm, ipc=ipc or _Ipc([(b"mine", 0x1000, 0x1000)]))
    return route


def _call(in_place=None, zero_copy=False, expert_major=False, x=None):
    return SimpleNamespace(config=D.DirectConfig(combine_in_place=in_place), zero_copy=zero_copy,
                           expert_major=expert_major, x=x or _X())


def test_the_default_combine_reads_in_place_when_every_rank_can_be_mapped():
    route = _route([(b"h", 0)])
    assert route._in_place(_call()) == [0x1000, 0x7100_0000]
    assert route._in_place(_call(x=_X(contiguous=False))) is None  # this rank's x: pushed, on every rank
    route = _route([None])
    assert route._in_place(_call()) is None  # a peer's x cannot be mapped: pushed


def test_the_in_place_choice_is_made_alike_on_every_rank():
    """The exchange is a collective: it runs whenever the config and the call
    (the same on every rank) allow an in-place combine, whatever this rank's x."""
    route = _route([(b"h", 0)])
    comm = route.node.group.node_comm
    route._in_place(_call(x=_X(contiguous=False)))
    route._in_place(_call(x=_X(rows=0, ptr=0)))
    assert comm.calls == 2
    for call in (_call(in_place=False), _call(zero_copy=True), _call(expert_major=True)):
        assert route._in_place(call) is None
    assert comm.calls == 2  # no exchange for a pushed, zero-copy or expert-major combine


def test_in_place_true_refuses_what_cannot_be_read_in_place_and_graph_capture():
    with pytest.raises(ValueError, match="cannot be read in place"):
        _route([None])._in_place(_call(in_place=True))
    route = _route([(b"h", 0)], capturing=True)
    assert route._in_place(_call()) is None  # capturing: pushed (a graph replays no host exchange)
    with pytest.raises(ValueError, match="CUDA graph"):
        route._in_place(_call(in_place=True))
    assert route.node.group.node_comm.calls == 0
