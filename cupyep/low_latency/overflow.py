"""What a low-latency call does when its routing overflows the buffer's regions.

A LowLatencyBuffer built with ``capacity`` C below ``max_tokens`` holds at
most C rows of one source rank in one expert's region (its memory is that of
C, not of the worst case). Whether a routing fits is a matter of counts:
:meth:`LowLatencyBuffer.region_rows` (collective: each rank counts its rows
per expert on the GPU, one host exchange) gives the fullest region over
every rank. When it exceeds C the caller chooses (:func:`run`):

- ``"split"``: each rank cuts its tokens, in order, into micro-batches that
  fit (:func:`split_tokens`: a new micro-batch wherever a token would take one
  of its experts past C), every rank runs as many as the rank that needs the
  most (the others send empty ones), and each is dispatched, computed and
  combined in turn;
- ``"normal"``: the whole call goes through a normal-mode ``cupyep.Buffer``
  (expert-major rows, the same experts and weights).

No token is ever dropped: every token is in exactly one micro-batch, or in the
normal-mode call, and its combined row is the weighted sum over all its
experts. The split is exact against the reference (a token's sum never spans
micro-batches); normal mode rounds its partial sums per rank (cupyep.moe).

The experts are one function for both paths, ``expert_fn(local_expert,
rows) -> outputs``: [n, H] uint16 BF16 rows of one local expert in, [n, H]
uint16 BF16 out (n may be 0).
"""
from __future__ import annotations

import numpy as np

POLICIES = ("split", "normal", "raise")


def split_tokens(topk_idx, capacity: int, num_experts: int) -> list[np.ndarray]:
    """This rank's tokens in micro-batches that each fit the regions.

    Arguments:
        topk_idx: [T, k] int64 expert ids (-1: none), NumPy (or anything
            ``np.asarray`` takes).
        capacity: rows per (expert, source) region, >= 1.
        num_experts: E.

    Returns:
        list of int64 token-index arrays, in token order, whose union is
        range(T): in each, no expert appears in more than ``capacity`` rows.
        A new micro-batch starts wherever a token would take one of its
        experts past ``capacity``; [arange(0)] when T is 0.
    """
    idx = np.asarray(topk_idx)
    if idx.ndim != 2:
        raise ValueError(f"topk_idx must be [T, k], got shape {idx.shape}")
    if int(capacity) < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
        raise ValueError(f"topk_idx holds expert ids outside [-1, {num_experts})")
    counts = np.zeros(num_experts, dtype=np.int64)
    cuts, start = [], 0
    for t, row in enumerate(idx):
        experts = row[row >= 0]
        if (counts[experts] + 1 > capacity).any():
            cuts.append((start, t))
            start, counts[:] = t, 0
        counts[experts] += 1
    cuts.append((start, idx.shape[0]))
    return [np.arange(a, b, dtype=np.int64) for a, b in cuts]


def run(ll, x, topk_idx, topk_weights, expert_fn, on_overflow: str = "split", buffer=None):
    """Collective: one MoE call's dispatch, experts and combine on a
    low-latency buffer, whatever its routing.

    Arguments:
        ll: the LowLatencyBuffer.
        x: [T, H] uint16 BF16 bits (CuPy).
        topk_idx: [T, k] int64 expert ids (CuPy); topk_weights: [T, k] float32.
        expert_fn: (local_expert, rows [n, H] uint16) -> [n, H] uint16.
        on_overflow: what happens when some rank's routing overflows a region
            (the same on every rank): "split" into micro-batches, "normal"
            mode through ``buffer``, or "raise" the ValueError of
            LowLatencyBuffer.check_capacity.
        buffer: a cupyep.Buffer (normal mode) of the same ranks, for "normal".

    Rows travel as BF16 (each micro-batch is an ordinary validated dispatch).

    Returns:
        (combined [T, H] uint16 BF16 bits, how: "low_latency", "split into N"
        or "normal").
    """
    import cupy
    if on_overflow not in POLICIES:
        raise ValueError(f"on_overflow must be one of {POLICIES}, got {on_overflow!r}")
    if on_overflow == "normal" and buffer is None:
        raise ValueError('on_overflow="normal" needs buffer= (a normal-mode cupyep.Buffer)')
    rows = ll.region_rows(topk_idx)
    if rows <= ll.capacity:
        return _low_latency(ll, x, topk_idx, topk_weights, expert_fn), "low_latency"
    if on_overflow == "raise":
        ll.check_capacity(topk_idx)
    if on_overflow == "normal":
        return _normal(buffer, x, topk_idx, topk_weights, expert_fn, ll.num_experts), "normal"
    parts = split_tokens(cupy.asnumpy(topk_idx), ll.capacity, ll.num_experts)
    n = int(ll.group.exchange(np.array([len(parts)], dtype=np.int64), "low-latency split: micro-batches").max())
    parts += [np.arange(0, dtype=np.int64)] * (n - len(parts))
    out = cupy.empty_like(x)
    for part in parts:
        sel = cupy.asarray(part)
        out[sel] = _low_latency(ll, x[sel], topk_idx[sel], topk_weights[sel], expert_fn)
    return out, f"split into {n}"


def _low_latency(ll, x, topk_idx, topk_weights, expert_fn):
    """One low-latency dispatch, the experts over each local expert's rows
    (every source's range of its region), and the combine."""
    import cupy
    d = ll.dispatch(x, topk_idx, use_fp8=False)
    counts = cupy.asnumpy(d.handle.layout_count)  # [E_local, R]
    El, R = counts.shape
    C, H = ll.capacity, ll.hidden
    y = cupy.zeros((El, R * C, H), dtype=np.uint16)
    for le in range(El):
        rows = np.concatenate([np.arange(r * C, r * C + counts[le, r]) for r in range(R)]).astype(np.int64)
        if rows.size:
            sel = cupy.asarray(rows)
            y[le, sel] = expert_fn(le, d.recv_x[le, sel])
    return ll.combine(y, topk_idx, topk_weights, d.handle).combined_x


def _normal(buffer, x, topk_idx, topk_weights, expert_fn, num_experts):
    """The same call through normal mode: expert-major rows, each local
    expert's block through expert_fn, the weighted combine."""
    import cupy

    from ..moe import result_blocks
    out = buffer.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, expert_major=True,
                          expert_alignment=1)
    y = cupy.zeros_like(out.expert_x)
    for le, (first, count) in enumerate(result_blocks(out)):
        if count:
            y[first:first + count] = expert_fn(le, out.expert_x[first:first + count])
    return buffer.combine(y, out.handle, pair_weights=out.recv_topk_weights, expert_major=True).combined_x
