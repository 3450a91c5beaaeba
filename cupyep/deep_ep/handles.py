"""DeepEP's handles over cupyep's: indexable like DeepEP's tuples, holding
the cupyep handle that combine and cached dispatch take.

The entries become torch tensors when read (nothing is converted on the
call path). Within a node a normal-mode handle has DeepEP's six entries:

====  ===========================  =============================================
 0    rank_prefix_matrix [R, R]    int32; as DeepEP: [i, j] = rows sources 0..i send rank j
 1    channel_prefix_matrix [R, C]  int32; rows for each destination in channels 0..c (inclusive)
 2    recv_channel_prefix_matrix [R, C]  int32; first row of each (source, channel) within the source's block
 3    recv_src_idx [N]             int32; as DeepEP: source token of each received row
 4    is_token_in_rank [T, R]      bool; as DeepEP
 5    send_head [T, R]             int32; cupyep's position of each token in its (channel, rank) stream, -1 if not sent
====  ===========================  =============================================

C is cupyep's channel count (num_sms / 2). Entries 1, 2 and 5 are cupyep's
own bookkeeping under DeepEP's names: their shapes are DeepEP's, their
values need not be. Across nodes DeepEP's handle has ten entries; cupyep's
routes keep other bookkeeping, so only 0 (is_token_in_rank) and 7 (the
source token of each received row, where DeepEP has its opaque source
metadata) are given, and reading another raises NotImplementedError.

A low-latency handle has DeepEP's five entries, in DeepEP's packed layout
(cupyep.reference.packed_layout): 0 recv_src_info [E_local, R * T] int32 (source
token of each packed row; rows past recv_count[e] unset), 1 layout_range
[E_local, R] int64 (``begin << 32 | count`` of each source's rows, ``begin``
the sum of the counts of the sources before it), then T, hidden and
num_experts. The cupyep handle inside (``native``) keeps cupyep's region
layout, which the combine reads.
"""
from __future__ import annotations

from collections.abc import Sequence

from .tensors import to_torch

INTRANODE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                    "is_token_in_rank", "send_head")
INTERNODE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                    "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
LOW_LATENCY_FIELDS = ("recv_src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")


class DispatchHandle(Sequence):
    """A normal-mode dispatch's handle (module docstring).

    Attributes:
        native: the cupyep.DispatchHandle (combine and cached dispatch take it).
        internode: whether it has DeepEP's ten internode entries.
    """

    __slots__ = ("native", "internode", "_cache")

    def __init__(self, native, internode: bool = False):
        self.native, self.internode, self._cache = native, internode, {}

    def __len__(self) -> int:
        return len(INTERNODE_FIELDS if self.internode else INTRANODE_FIELDS)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"handle index {i} out of range for {n} entries")
        i %= n
        if i not in self._cache:
            self._cache[i] = self._entry(i)
        return self._cache[i]

    def _entry(self, i: int):
        h = self.native
        if self.internode:
            if i == 0:
                return to_torch(h.is_token_in_rank)
            if i == 7:
                return to_torch(h.recv_src_idx)
            raise NotImplementedError(f"cupyep.deep_ep: handle entry {i} ({INTERNODE_FIELDS[i]}) of an internode "
                                      "dispatch has no cupyep counterpart; entries 0 and 7 are given")
        if i == 0:
            return to_torch(h.rank_prefix_matrix)
        if i == 1:
            return to_torch(h.send_channel_prefix[:, 1:])
        if i == 2:
            return to_torch(h.recv_channel_prefix[:, :-1])
        if i == 3:
            return to_torch(h.recv_src_idx)
        if i == 4:
            return to_torch(h.is_token_in_rank)
        return to_torch(h.send_head)

    def __repr__(self):
        return f"DispatchHandle({'internode' if self.internode else 'intranode'}, {self.native.num_tokens} tokens)"


class LowLatencyHandle(Sequence):
    """A low-latency dispatch's handle (module docstring).

    Attributes:
        native: the cupyep LowLatencyHandle (region layout).
        src_info: [E_local, R * T] int32 device array, entry 0.
        layout_range: [E_local, R] int64 device array, entry 1.
    """

    __slots__ = ("native", "src_info", "layout_range", "_cache")

    def __init__(self, native, src_info, layout_range):
        self.native, self.src_info, self.layout_range, self._cache = native, src_info, layout_range, {}

    def __len__(self) -> int:
        return len(LOW_LATENCY_FIELDS)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if not -5 <= i < 5:
            raise IndexError(f"handle index {i} out of range for 5 entries")
        i %= 5
        h = self.native
        if i == 2:
            return h.max_tokens
        if i == 3:
            return h.hidden
        if i == 4:
            return h.num_experts
        if i not in self._cache:
            self._cache[i] = to_torch(self.src_info if i == 0 else self.layout_range)
        return self._cache[i]

    def __repr__(self):
        return f"LowLatencyHandle({self.native.num_tokens} tokens, hidden {self.native.hidden})"


def native_handle(handle, what: str):
    """The cupyep handle inside ``handle`` (or ``handle`` itself when it is one)."""
    if handle is None:
        raise ValueError(f"{what} needs a handle")
    return getattr(handle, "native", handle)
