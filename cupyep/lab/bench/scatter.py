"""Row scatter patterns of the low-latency data movement, and the kernel that
times them on their own (``cuda_src/bench/scatter.cu``).

A pattern lists, for one (virtual) rank, every row it moves in one call:
``src_row`` (a row of its own source array), ``dst_rank`` (whose buffer) and
``dst_row`` (the row there). Rows are ``row_bytes`` wide; all arrays are 1-D
of equal length (int32, int32, int64). The patterns follow one routing
(``topk_idx`` per rank, [T, k] int64, -1 for none) with E experts over R ranks
(El = E / R local experts), M = max tokens per rank:

dispatch side (rows in (token, slot) order; source row = token):
  * ``dispatch_expert_major``: row (le * R + s) * M + pos, the layout of
    ``recv_x [El, R * M]`` (pos: the token's rank among this source's tokens
    for that expert);
  * ``dispatch_source_major``: row (s * El + le) * M + pos;
  * ``dispatch_slot_major``: row (pos * El + le) * R + s;
  * ``dispatch_packed``: rows from each source contiguous at offsets a count
    exchange would give (the one-copy layout);
combine side (rows in (local expert, source, pos) order, sent back to the
token's rank s):
  * ``combine_slot_token``: source row (le * R + s) * M + pos, destination
    row j * M + t (the layout of ``combine_recv [k][M]``);
  * ``combine_expert_token``: destination row e * M + t (one region per
    global expert);
  * ``combine_packed_src``: source rows packed per expert (prefix over
    sources), destination j * M + t.
"""
from __future__ import annotations

import numpy as np

from ... import jit
from ...reference.low_latency import slot_in_region

SCATTER_SPEC = jit.KernelSpec(name="bench_scatter", source="bench/scatter.cu", kernels=("cupyep::scatter_rows",))

PATTERNS = ("dispatch_expert_major", "dispatch_source_major", "dispatch_slot_major", "dispatch_packed",
            "combine_slot_token", "combine_expert_token", "combine_packed_src")


def kernel_specs() -> list[jit.KernelSpec]:
    return [SCATTER_SPEC]


def rows_needed(pattern: str, num_experts: int, num_ranks: int, max_tokens: int, num_topk: int) -> tuple[int, int]:
    """(source rows, destination rows) a rank's arrays must hold for ``pattern``."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; one of {PATTERNS}")
    El = num_experts // num_ranks
    if pattern.startswith("dispatch"):
        return max_tokens, El * num_ranks * max_tokens
    dst = num_experts * max_tokens if pattern == "combine_expert_token" else num_topk * max_tokens
    return El * num_ranks * max_tokens, dst


def pattern_rows(pattern: str, topk_idx: list, rank: int, num_experts: int, max_tokens: int):
    """(src_row int32, dst_rank int32, dst_row int64) of rank ``rank`` for
    ``pattern`` under the routing ``topk_idx`` (a [T, k] int64 array per rank)."""
    R = len(topk_idx)
    rows_needed(pattern, num_experts, R, max_tokens, topk_idx[0].shape[1])
    if num_experts % R:
        raise ValueError(f"{num_experts} experts do not split over {R} ranks")
    El = num_experts // R
    pos = [slot_in_region(np.asarray(i), num_experts) for i in topk_idx]
    src, dst, row = [], [], []
    if pattern.startswith("dispatch"):
        s, idx, p = rank, np.asarray(topk_idx[rank]), pos[rank]
        t, j = np.nonzero(idx >= 0)
        e = idx[t, j]
        d, le, q = e // El, e % El, p[t, j]
        if pattern == "dispatch_expert_major":
            r = (le * R + s) * max_tokens + q
        elif pattern == "dispatch_source_major":
            r = (s * El + le) * max_tokens + q
        elif pattern == "dispatch_slot_major":
            r = (q * El + le) * R + s
        else:  # packed: sources in rank order, each source's rows to d in (token, slot) order
            before = [sum(int(((np.asarray(topk_idx[s2]) // El == dd) & (np.asarray(topk_idx[s2]) >= 0)).sum())
                          for s2 in range(s)) for dd in range(R)]
            r = np.empty(len(t), dtype=np.int64)
            for dd in range(R):
                sel = np.nonzero(d == dd)[0]
                r[sel] = before[dd] + np.arange(len(sel))
        return t.astype(np.int32), d.astype(np.int32), r.astype(np.int64)
    # combine: this rank is the expert side; rows in (local expert, source, pos) order
    counts = np.zeros((El, R), dtype=np.int64)
    for s in range(R):
        idx = np.asarray(topk_idx[s])
        for e in idx[idx >= 0]:
            if e // El == rank:
                counts[e % El, s] += 1
    for le in range(El):
        e = rank * El + le
        for s in range(R):
            idx, p = np.asarray(topk_idx[s]), pos[s]
            t, j = np.nonzero(idx == e)
            order = np.argsort(p[t, j])
            t, j, q = t[order], j[order], p[t, j][order]
            if pattern == "combine_packed_src":
                sr = le * R * max_tokens + counts[le, :s].sum() + q
            else:
                sr = (le * R + s) * max_tokens + q
            dr = e * max_tokens + t if pattern == "combine_expert_token" else j * max_tokens + t
            src.append(sr); dst.append(np.full(len(t), s)); row.append(dr)
    cat = (lambda a, dt: np.concatenate(a).astype(dt) if a else np.zeros(0, dt))
    return cat(src, np.int32), cat(dst, np.int32), cat(row, np.int64)


def scatter(peers_ptr: int, offset: int, src, src_row, dst_peer, dst_row, row_bytes: int, stamp,
            num_blocks: int, group=None, meta_offset: int = 0, meta_rows: int = 0, smem_bytes: int = 0) -> None:
    """Launch the scatter of ``len(src_row)`` rows (cupy int32/int32/int64
    arrays) with ``num_blocks`` blocks of 512 threads; ``stamp`` is int64 [2]
    (min start, max end; initialise to (int64 max, 0)).

    What the low-latency kernels do besides moving rows can be added one
    piece at a time: ``meta_offset`` (> 0) also writes a 4-byte and a 1-byte
    tag per row into a side region of ``meta_rows`` entries (more than any
    destination row) at that offset of the destination buffer (as recv_src /
    recv_slot); ``smem_bytes`` launches
    with that much (unused) dynamic shared memory."""
    if row_bytes % 16:
        raise ValueError(f"row_bytes must be a multiple of 16, got {row_bytes}")
    if meta_offset < 0 or (meta_offset and meta_rows <= 0):
        raise ValueError(f"meta_offset must be >= 0, and with meta_offset meta_rows (> every destination row) "
                         f"must be positive, got {meta_offset} and {meta_rows}")
    if not 0 <= smem_bytes <= 48 * 1024:
        raise ValueError(f"smem_bytes must be in [0, 49152], got {smem_bytes}")
    jit.kernel(SCATTER_SPEC, group)((num_blocks,), (512,), (
        np.uint64(peers_ptr), np.int64(offset), src, src_row, dst_peer, dst_row, np.int32(len(src_row)),
        np.int32(row_bytes // 16), np.int64(meta_offset), np.int64(meta_rows), stamp), shared_mem=smem_bytes)


def pages_touched(rows, row_bytes: int, page_bytes: int = 2 << 20, dst_offset: int = 0) -> tuple[int, int]:
    """(source pages, destination pages) one rank's ``rows`` (src_row, dst_rank,
    dst_row as from :func:`pattern_rows`) touch, counting a row's every page:
    source pages of its own array, destination pages as distinct (rank, page)
    pairs of regions starting ``dst_offset`` bytes into each peer's buffer."""
    src_row, dst_rank, dst_row = (np.asarray(a, dtype=np.int64) for a in rows)
    span = (row_bytes + page_bytes - 1) // page_bytes + 1  # pages one row can straddle

    def pages(start):
        first, last = start // page_bytes, (start + row_bytes - 1) // page_bytes
        return np.unique(np.concatenate([np.minimum(first + i, last) for i in range(span)]))

    src = pages(src_row * row_bytes)
    dst_start = dst_offset + dst_row * row_bytes
    dst = {(int(r), int(p)) for r in np.unique(dst_rank) for p in pages(dst_start[dst_rank == r])}
    return int(src.size), len(dst)
