"""Named results of low-latency dispatch and combine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class LowLatencyHandle:
    """What combine needs from a low-latency dispatch.

    Attributes:
        layout_count: [E_local, R] int32 device array: rows of (local expert e,
            source r), which occupy rows [r * capacity, r * capacity + count).
        recv_src: [E_local, R * capacity] int32 device view (strided, into the
            messages): source token of each row.
        recv_slot: [E_local, R * capacity] uint8 device view (strided): top-k slot
            of each row in its token.
        combine_pos: [T, k] int32 device array: the row of (token, slot) in the
            range its expert rank returns to this rank in the combine (-1 for
            empty slots).
        slot_pos: [T, k] int32 device array: the row of (token, slot) within
            its (expert, this rank) region of the expert rank's rows (-1 for
            empty slots); a pulling combine reads the outputs from there.
        rank_pos: [T, k] int32 device array, or None: from a dispatch given
            the weights, the row of (token, slot)'s partial in the range its
            expert rank returns (combine(..., partial=True); -1 for empty slots).
        weights: the [T, k] float32 device array given to that dispatch, or None.
        status: [num_waiters] int32 device array, or None: 1 where a receiving
            block's wait for the sources timed out (the error is reported; that
            block's layout counts are then zeros, and a combine of this handle
            poisons its arrivals, so that the owners time out instead of
            reducing without the rows it could not return), else 0.
        num_tokens: T of this rank's dispatch (combine returns [T, H]).
        max_tokens, capacity: the buffer's tokens per rank and rows per
            (expert, source) region (capacity <= max_tokens).
        set_index: the copy of the dispatch data (0 or 1) the dispatch wrote (layout.CallSchedule).
        call: sequence number of the dispatch on its buffer.
    """
    layout_count: object
    recv_src: object
    recv_slot: object
    combine_pos: object
    slot_pos: object
    num_tokens: int
    num_topk: int
    hidden: int
    num_experts: int
    max_tokens: int
    capacity: int
    set_index: int
    call: int
    buffer_id: int
    rank_pos: object = None
    weights: object = None
    status: object = None

    @property
    def layout_begin(self):
        """[E_local, R] int32 device array: first row of each (expert, source) range."""
        import cupy
        E_local, R = self.layout_count.shape
        return cupy.broadcast_to(cupy.arange(R, dtype=cupy.int32) * self.capacity, (E_local, R))


@dataclass
class LowLatencyDispatchResult:
    """Output of :meth:`LowLatencyBuffer.dispatch`.

    Attributes:
        recv_x: [E_local, R * capacity, H] uint8 (FP8 e4m3 bits) or uint16 (BF16 bits),
            a strided view of the buffer's messages (rows are contiguous; the row
            stride is layout.message_layout(...).nbytes): valid until the next
            dispatch on this buffer (copy it to keep it longer). Rows outside the
            layout ranges are stale.
        recv_x_scales: [E_local, R * capacity, H / 128] float32 (uint8 UE8M0
            exponents with use_ue8m0), a strided view like recv_x; None for BF16.
        recv_count: [E_local] int32 device array: rows per local expert.
        handle: LowLatencyHandle for combine.
        event: EventHandle when async_finish, else None.
        hook: with return_recv_hook, call it to run the receive half
            (recv_count / layout counts are valid after it); else None.
        packed: with ``packed_out``, DeepEP's packed outputs the dispatch
            filled: (x, scales or None, src_info, layout_range) (new arrays
            with ``packed_out=True``, else the caller's); else None.
    """
    recv_x: object
    recv_x_scales: object
    recv_count: object
    handle: LowLatencyHandle
    event: object = None
    hook: Optional[Callable[[], None]] = None
    packed: Optional[tuple] = None


@dataclass
class LowLatencyCombineResult:
    """Output of :meth:`LowLatencyBuffer.combine`.

    Attributes:
        combined_x: [T, H] uint16 (BF16 bits): sum over the top-k slots of
            weight * expert output, accumulated in FP32 (valid after the hook
            when return_recv_hook).
        event, hook: as in LowLatencyDispatchResult.
    """
    combined_x: object
    event: object = None
    hook: Optional[Callable[[], None]] = None
