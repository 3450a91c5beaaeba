"""Where everything lives in a normal-mode rank's symmetric buffer.

Fixed for the life of a buffer::

    [barrier][ring counters: 4 x [MAX_CHANNELS][R] int64, COUNTER_STRIDE apart]
    [notify: R rows of notify_row_ints int32][dispatch region][combine region]

Per call, a :class:`RingSet` places ``[C][R][depth]`` slots inside the
dispatch or the combine region. The two regions never overlap, because one
rank may already be combining while a peer still drains its dispatch rings.
The counters stay at fixed offsets so that they survive changes of hidden
size, top-k or config between calls: each ring's tail equals its head
whenever no call is in flight, whichever ring they index.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..barrier import barrier_region_bytes
from .config import COUNTER_STRIDE, MAX_CHANNELS, Config

ALIGN = 128
MAX_LOCAL_EXPERTS = 1024


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dispatch_meta_bytes(num_topk: int, num_scales: int) -> int:
    """Per-slot metadata: src_idx, k expert ids, k weights, scales (int32/float32)."""
    return _align(4 * (1 + 2 * num_topk + num_scales), 16)


def combine_meta_bytes(num_topk: int) -> int:
    """Per-slot metadata: row weight and k top-k weights (float32)."""
    return _align(4 * (1 + num_topk), 16)


@dataclass(frozen=True)
class RingSet:
    """One call's rings (dispatch or combine) in every rank's buffer."""
    offset: int        # byte offset of slot 0
    counter_tail: int  # byte offset of the [MAX_CHANNELS][R] tail counters
    counter_head: int
    x_bytes: int       # payload bytes per row
    slot_bytes: int    # payload + metadata, rounded to whole 128-byte lines
    depth: int
    chunk: int
    num_channels: int
    num_ranks: int

    @property
    def nbytes(self) -> int:
        return self.num_channels * self.num_ranks * self.depth * self.slot_bytes


@dataclass(frozen=True)
class BufferLayout:
    """The fixed regions of a buffer of ``nbytes`` bytes."""
    num_ranks: int
    nbytes: int
    barrier: int
    counters: int
    notify: int
    notify_row_ints: int
    dispatch_region: int
    combine_region: int
    region_bytes: int

    def counter(self, i: int) -> int:
        """Offset of counter array i: 0 dispatch tail, 1 dispatch head, 2 combine tail, 3 combine head."""
        return self.counters + i * MAX_CHANNELS * self.num_ranks * COUNTER_STRIDE


def header_bytes(num_ranks: int) -> int:
    """Bytes before the dispatch region."""
    counters = _align(barrier_region_bytes(num_ranks))
    notify = counters + 4 * MAX_CHANNELS * num_ranks * COUNTER_STRIDE
    return _align(notify + num_ranks * notify_row_ints(num_ranks) * 4)


def notify_row_ints(num_ranks: int) -> int:
    return _align(num_ranks + MAX_LOCAL_EXPERTS + MAX_CHANNELS, 4)


def buffer_layout(num_ranks: int, nbytes: int) -> BufferLayout:
    counters = _align(barrier_region_bytes(num_ranks))
    notify = counters + 4 * MAX_CHANNELS * num_ranks * COUNTER_STRIDE
    head = header_bytes(num_ranks)
    region = (nbytes - head) // 2 // ALIGN * ALIGN
    if region <= 0:
        raise ValueError(f"a {nbytes}-byte buffer is smaller than the {head}-byte header for {num_ranks} ranks")
    return BufferLayout(num_ranks=num_ranks, nbytes=nbytes, barrier=0, counters=counters, notify=notify,
                        notify_row_ints=notify_row_ints(num_ranks), dispatch_region=head,
                        combine_region=head + region, region_bytes=region)


def ring_bytes(num_ranks: int, slot_bytes: int, config: Config) -> int:
    return config.num_channels * num_ranks * config.queue_depth * slot_bytes


def dispatch_slot(hidden: int, num_topk: int, fp8: bool) -> tuple[int, int]:
    """(x_bytes, slot_bytes) of a dispatch slot."""
    x_bytes = hidden if fp8 else 2 * hidden
    return x_bytes, _align(x_bytes + dispatch_meta_bytes(num_topk, hidden // 128 if fp8 else 0))


def combine_slot(hidden: int, num_topk: int) -> tuple[int, int]:
    """(x_bytes, slot_bytes) of a combine slot."""
    return 2 * hidden, _align(2 * hidden + combine_meta_bytes(num_topk))


@functools.lru_cache(maxsize=256)  # every call places its rings; the placement depends on these only
def ring_set(layout: BufferLayout, kind: str, hidden: int, num_topk: int, fp8: bool, config: Config) -> RingSet:
    """Place one call's rings; ValueError when they do not fit the region."""
    if kind == "dispatch":
        x_bytes, slot = dispatch_slot(hidden, num_topk, fp8)
        offset, tail, head = layout.dispatch_region, layout.counter(0), layout.counter(1)
    else:
        x_bytes, slot = combine_slot(hidden, num_topk)
        offset, tail, head = layout.combine_region, layout.counter(2), layout.counter(3)
    need = ring_bytes(layout.num_ranks, slot, config)
    if need > layout.region_bytes:
        raise ValueError(
            f"{kind} rings need {need} bytes ({config.num_channels} channels x {layout.num_ranks} ranks x "
            f"{config.queue_depth} slots x {slot} bytes) but the buffer's {kind} region holds {layout.region_bytes}; "
            f"create the Buffer with num_bytes >= {size_hint(layout.num_ranks, hidden, num_topk, config, config)} "
            "or lower queue_depth / num_sms")
    return RingSet(offset=offset, counter_tail=tail, counter_head=head, x_bytes=x_bytes, slot_bytes=slot,
                   depth=config.queue_depth, chunk=config.chunk_size, num_channels=config.num_channels,
                   num_ranks=layout.num_ranks)


def size_hint(num_ranks: int, hidden: int = 7168, num_topk: int = 16, dispatch_config: Config | None = None,
              combine_config: Config | None = None) -> int:
    """Buffer bytes a rank needs for BF16 and FP8 calls up to these sizes."""
    from .config import get_combine_config, get_dispatch_config
    dc = dispatch_config or get_dispatch_config(num_ranks)
    cc = combine_config or get_combine_config(num_ranks)
    d = max(ring_bytes(num_ranks, dispatch_slot(hidden, num_topk, fp8)[1], dc) for fp8 in (False, True))
    c = ring_bytes(num_ranks, combine_slot(hidden, num_topk)[1], cc)
    return header_bytes(num_ranks) + 2 * _align(max(d, c))


def default_num_bytes(num_ranks: int, sizes, sm_budget: int) -> int:
    """IPC buffer bytes of a Buffer made for ``sizes`` (cupyep.sizes.DeclaredSizes):
    the size_hint of the tuned configs at this SM budget, BF16 and FP8."""
    from .config import get_combine_config, get_dispatch_config
    return max(size_hint(num_ranks, sizes.hidden, sizes.num_topk, get_dispatch_config(num_ranks, sm_budget, fp8),
                         get_combine_config(num_ranks, sm_budget)) for fp8 in (False, True))
