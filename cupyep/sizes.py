"""The sizes a normal-mode buffer is declared with, and the check every
call makes against them (within and across nodes, on every route).

A buffer is made for at most ``max_tokens`` tokens per rank, rows of at
most ``hidden`` channels and at most ``num_topk`` experts per token; the
pools of the one-copy routes are sized from them when the buffer is made
(or at the first call of a route), never from a call. A call past them is
a ValueError that names the size and the constructor argument, raised
before anything is launched.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 4096
DEFAULT_HIDDEN = 7168
DEFAULT_NUM_TOPK = 8
MAX_EXPERTS = 8192  # experts a layout counts (its shared memory holds one counter each)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class DeclaredSizes:
    """max_tokens: tokens per rank; hidden: channels of a row (a multiple of
    128); num_topk: experts per token."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    hidden: int = DEFAULT_HIDDEN
    num_topk: int = DEFAULT_NUM_TOPK

    def __post_init__(self):
        for name in ("max_tokens", "hidden", "num_topk"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128 (the FP8 scale groups), got {self.hidden}")

    def check(self, call: str, num_tokens: int, hidden: int, num_topk: int | None = None) -> None:
        """ValueError unless a call of ``num_tokens`` tokens, ``hidden``
        channels and ``num_topk`` experts per token (None: no routing in
        the call) fits the declared sizes."""
        for name, got, most in (("max_tokens", num_tokens, self.max_tokens), ("hidden", hidden, self.hidden),
                                ("num_topk", num_topk, self.num_topk)):
            if got is not None and got > most:
                what = {"max_tokens": "tokens", "hidden": "channels per row", "num_topk": "experts per token"}[name]
                raise ValueError(f"{call}: {got} {what}, but the buffer was made with {name}={most}; make the "
                                 f"buffer with {name}>={got}")
