"""DeepEP's ``Config`` and its tuned tables, mapped onto cupyep's queue-route
:class:`cupyep.Config`.

DeepEP's five knobs and what each becomes within a node:

- ``num_sms`` -> ``num_sms`` (blocks; half send, half receive: channels = num_sms / 2);
- ``num_max_nvl_chunked_send_tokens`` -> ``chunk_size`` (rows a sender publishes per step);
- ``num_max_nvl_chunked_recv_tokens`` -> ``queue_depth`` (slots of each (channel, peer) ring);
- ``num_max_rdma_chunked_send_tokens``, ``num_max_rdma_chunked_recv_tokens``: the
  network chunking of DeepEP's internode kernels. Within a node DeepEP does not
  read them either. cupyep's routes across nodes take no chunk config, so a
  dispatch or combine across nodes with an explicit Config raises
  NotImplementedError (cupyep.deep_ep.gaps).

``num_threads`` is 512 (at least 32 per rank), and ``l2_hints`` is taken from
cupyep's tuned table for the rank count: it changes how the copies use L2, never
the results.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

# DeepEP V1's defaults and its assumptions in the buffer-size hints.
NUM_MAX_NVL_PEERS = 8
MAX_TOPK_HINT = 128
MAX_SCALES_HINT = 128
SOURCE_META_BYTES = 8


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Config:
    """DeepEP V1's performance config (same constructor, attributes and hints).

    Arguments:
        num_sms: SMs of the normal-mode kernels (even; 0 is not run by cupyep).
        num_max_nvl_chunked_send_tokens: rows per sender step (< recv tokens).
        num_max_nvl_chunked_recv_tokens: ring slots per (channel, peer).
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens:
            DeepEP's network chunking (recv rounded up to a multiple of send,
            send <= recv / 2), checked as DeepEP does.
    """

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        if num_sms < 0:
            raise ValueError(f"Config: num_sms must be >= 0, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"Config: need 0 < num_max_nvl_chunked_send_tokens ({num_max_nvl_chunked_send_tokens}) "
                             f"< num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})")
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ValueError("Config: the rdma chunk sizes must be > 0")
        rdma_recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if not num_max_rdma_chunked_send_tokens <= rdma_recv // 2:
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens ({num_max_rdma_chunked_send_tokens}) must be "
                             f"<= half of num_max_rdma_chunked_recv_tokens ({rdma_recv})")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def __repr__(self):
        return "Config(" + ", ".join(f"{n}={getattr(self, n)}" for n in self.__slots__) + ")"

    def __eq__(self, other):
        return isinstance(other, Config) and all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self):
        return hash(tuple(getattr(self, n) for n in self.__slots__))

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of cupyep's IPC buffer within a node for rows of ``hidden_bytes``
        (BF16: 2 * hidden) under this config, dispatch and combine, BF16 and
        FP8, top-k up to DeepEP's assumed 128 (cupyep.normal.queue_layout.size_hint)."""
        from ..normal.queue_layout import size_hint
        hidden = _align(max(int(hidden_bytes) // 2, 1), 128)
        nvl_ranks = min(int(num_ranks), NUM_MAX_NVL_PEERS) if num_ranks > NUM_MAX_NVL_PEERS else int(num_ranks)
        cfg = to_cupyep(self, nvl_ranks)
        return size_hint(nvl_ranks, hidden, MAX_TOPK_HINT, cfg, cfg)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's formula for its network buffer (0 within one node of 8).
        cupyep sizes its pools across nodes from the declared sizes
        (cupyep.deep_ep.budget); the hint keeps DeepEP's value so that
        callers size ``num_rdma_bytes`` as they always did."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS or self.num_sms % 2:
            raise ValueError(f"get_rdma_buffer_size_hint: num_ranks={num_ranks} must be a multiple of "
                             f"{NUM_MAX_NVL_PEERS} and num_sms={self.num_sms} even")
        rdma_ranks, channels = num_ranks // NUM_MAX_NVL_PEERS, self.num_sms // 2
        per_token = (int(hidden_bytes) + SOURCE_META_BYTES + MAX_TOPK_HINT * 8 + MAX_TOPK_HINT * 4
                     + MAX_SCALES_HINT * 4 + 16)
        n = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        return _align(n, 128)


def num_threads_for(num_ranks: int) -> int:
    """Threads per block of the queue kernels: 512, or one warp per rank past 16 ranks."""
    return max(512, 32 * int(num_ranks))


def to_cupyep(config: Config, num_ranks: int, combine: bool = False):
    """cupyep's queue-route :class:`cupyep.Config` for DeepEP's ``config`` on
    ``num_ranks`` ranks of a node (module docstring). ValueError for a
    config the kernels cannot run (cupyep's checks). The result is frozen
    and made once per distinct value (every call of a run maps the same few
    configs)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a cupyep.deep_ep.Config, got {type(config).__name__}")
    return _mapped(config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                   num_ranks, bool(combine))


@lru_cache(maxsize=256)
def _mapped(num_sms: int, send_tokens: int, recv_tokens: int, num_ranks: int, combine: bool):
    from ..normal.config import get_combine_config, get_dispatch_config
    tuned = (get_combine_config if combine else get_dispatch_config)(num_ranks)
    return replace(tuned, num_sms=num_sms, chunk_size=send_tokens, queue_depth=recv_tokens,
                   num_threads=num_threads_for(num_ranks))


@lru_cache(maxsize=256)
def default_cupyep_config(num_ranks: int, num_sms: int, combine: bool = False):
    """``to_cupyep(tuned_config(num_ranks, num_sms, combine), num_ranks,
    combine)``, made once per value: the config of a call given none."""
    return to_cupyep(tuned_config(num_ranks, num_sms, combine), num_ranks, combine)


def from_cupyep(cfg, rdma_send: int = 6, rdma_recv: int = 256) -> Config:
    """DeepEP's Config of a cupyep queue-route config."""
    return Config(cfg.num_sms, cfg.chunk_size, max(cfg.queue_depth, cfg.chunk_size + 1), rdma_send, rdma_recv)


def tuned_config(num_ranks: int, num_sms: int, combine: bool = False) -> Config:
    """The config of DeepEP's ``get_dispatch_config`` / ``get_combine_config``:
    cupyep's tuned chunk size and ring depth for ``num_ranks`` (BF16 rows),
    on ``num_sms`` SMs (``Buffer.num_sms``)."""
    from ..normal.config import get_combine_config, get_dispatch_config
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    tuned = (get_combine_config if combine else get_dispatch_config)(num_ranks)
    return Config(num_sms, tuned.chunk_size, max(tuned.queue_depth, tuned.chunk_size + 1), 6, 256)
