"""Tuning knobs of normal mode and their defaults.

A :class:`Config` holds the three knobs of the queue transport:

- ``num_sms``: blocks per rank; half send, half receive, so
  ``num_channels = num_sms // 2``. Each channel owns a contiguous slice of the
  tokens.
- ``chunk_size``: rows a sender publishes per step (one tail update).
- ``queue_depth``: slots per (channel, peer) ring.

plus ``num_threads`` per block and ``l2_hints``, how the copies use L2 (0:
plain; 1: receivers discard consumed ring slots so they are never written back
to HBM; 2: as 1, plus evict-first on rows streamed once and evict-last on ring
slots). Dispatch and combine take separate configs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# Rings of one rank: 2 counters per ring, padded to kCounterStride bytes.
COUNTER_STRIDE = 64
MAX_CHANNELS = 64
L2_HINTS = (0, 1, 2)


@dataclass(frozen=True)
class Config:
    """Normal-mode kernel configuration (identical on every rank of a call)."""
    num_sms: int = 24
    chunk_size: int = 8
    queue_depth: int = 32
    num_threads: int = 512
    l2_hints: int = 0

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def validate(self, num_ranks: int, combine: bool = False) -> "Config":
        """Raise ValueError for a configuration the kernels cannot run."""
        if self.num_sms < 2 or self.num_sms % 2 or self.num_sms // 2 > MAX_CHANNELS:
            raise ValueError(f"num_sms must be even and in [2, {2 * MAX_CHANNELS}], got {self.num_sms}")
        if self.num_threads % 32 or not 32 <= self.num_threads <= 1024:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {self.num_threads}")
        warps = self.num_threads // 32
        if warps < num_ranks:
            raise ValueError(f"num_threads={self.num_threads} gives {warps} warps, fewer than the {num_ranks} "
                             "ranks each block serves (one warp group per rank)")
        if warps // num_ranks > 1 and num_ranks > 15:
            raise ValueError(f"{num_ranks} ranks with {warps // num_ranks} warps each need more than the 15 named "
                             "barriers a block has; use num_threads = 32 * num_ranks")
        if self.l2_hints not in L2_HINTS:
            raise ValueError(f"l2_hints must be one of {L2_HINTS}, got {self.l2_hints}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.queue_depth < self.chunk_size:
            raise ValueError(f"queue_depth ({self.queue_depth}) must be >= chunk_size ({self.chunk_size})")
        if combine and self.queue_depth < warps + self.chunk_size:
            # The combine receiver frees slots once per batch of `warps` tokens.
            raise ValueError(f"combine queue_depth ({self.queue_depth}) must be >= warps per block ({warps}) + "
                             f"chunk_size ({self.chunk_size}) = {warps + self.chunk_size}")
        return self


# Tuned on one H200 with the ranks sharing it under MPS (experiments/bench_normal.py
# --sweep, records in results/archive/normal_*sweep*.jsonl); keyed by ranks per node.
# Dispatch publishes small chunks with L2 hints: each slot is read while it is
# still in L2 and then discarded, so ring traffic mostly stays out of HBM.
_DISPATCH = {
    2: Config(num_sms=48, chunk_size=8, queue_depth=32, l2_hints=2),
    4: Config(num_sms=32, chunk_size=2, queue_depth=8, l2_hints=2),
    8: Config(num_sms=16, chunk_size=2, queue_depth=8, l2_hints=2),
}
# FP8 rows (H + H / 128 * 4 bytes) are half as long as BF16 ones: the same
# queue then carries half the bytes per step, and longer chunks in deeper
# rings pay (4 ranks, T = 4096: 504 us, against 833 us with the BF16 table;
# results/normal_sweep_fp8/normal_sweep.jsonl).
_DISPATCH_FP8 = {
    2: Config(num_sms=64, chunk_size=16, queue_depth=64, l2_hints=2),
    4: Config(num_sms=32, chunk_size=8, queue_depth=32, l2_hints=2),
    8: Config(num_sms=16, chunk_size=4, queue_depth=16, l2_hints=2),
}
_COMBINE = {
    2: Config(num_sms=48, chunk_size=4, queue_depth=32, l2_hints=2),
    4: Config(num_sms=32, chunk_size=4, queue_depth=32, l2_hints=2),
    8: Config(num_sms=16, chunk_size=4, queue_depth=32),
}


def _pick(table: dict, num_ranks: int, sm_budget: int | None) -> Config:
    key = min((k for k in table if k >= num_ranks), default=max(table))
    cfg = table[key]
    if sm_budget is not None and cfg.num_sms > sm_budget:
        cfg = replace(cfg, num_sms=max(2, sm_budget // 2 * 2))
    if cfg.num_threads // 32 < num_ranks:
        cfg = replace(cfg, num_threads=32 * num_ranks)
    return cfg


def get_dispatch_config(num_ranks: int, sm_budget: int | None = None, fp8: bool = False) -> Config:
    """Default dispatch config for ``num_ranks`` ranks per node, capped at
    ``sm_budget`` SMs (a GPU's SMs divided by the ranks sharing it), for BF16
    rows or (``fp8``) FP8 rows with their scales."""
    return _pick(_DISPATCH_FP8 if fp8 else _DISPATCH, num_ranks, sm_budget)


def get_combine_config(num_ranks: int, sm_budget: int | None = None) -> Config:
    """Default combine config; see :func:`get_dispatch_config`."""
    cfg = _pick(_COMBINE, num_ranks, sm_budget)
    need = cfg.num_threads // 32 + cfg.chunk_size
    return cfg if cfg.queue_depth >= need else replace(cfg, queue_depth=need)
