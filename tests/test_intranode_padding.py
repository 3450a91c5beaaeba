"""Host side of normal-mode worst-token padding and of the per-expert counts
a dispatch returns (no GPU): the reference's padded rows, the counts a cached
dispatch aligns from its handle, and the result defaults."""
from dataclasses import replace

import numpy as np
import pytest

import cupyep.reference as ref
from cupyep.results import aligned_expert_counts
from cupyep.results import DispatchHandle, DispatchResult
from cupyep.reference.intranode import worst_token_rows

NUM_EXPERTS, NUM_TOPK = 16, 4
TOKENS = [37, 0, 64, 5]


def _dispatch(alignment=1, with_weights=True):
    idx = ref.make_routing(3, TOKENS, NUM_EXPERTS, NUM_TOPK)
    w = ref.make_weights(3, idx) if with_weights else None
    ids = [np.arange(t, dtype=np.int32)[:, None] for t in TOKENS]
    return ref.intranode_dispatch(ids, idx, NUM_EXPERTS, topk_weights=w, expert_alignment=alignment)


@pytest.mark.parametrize("extra", [0, 1, 50])
def test_worst_token_rows_pad_with_minus_one_and_zero(extra):
    for res in _dispatch():
        n = res.num_recv_tokens
        pad = worst_token_rows(res, n + extra)
        assert pad.recv_topk_idx.shape == (n + extra, NUM_TOPK) and pad.recv_topk_idx.dtype == np.int64
        assert pad.recv_topk_weights.shape == (n + extra, NUM_TOPK) and pad.recv_topk_weights.dtype == np.float32
        assert pad.recv_src_idx.shape == (n + extra,) and pad.recv_src_idx.dtype == np.int32
        assert np.array_equal(pad.recv_topk_idx[:n], res.recv_topk_idx)
        assert np.array_equal(pad.recv_topk_weights[:n], res.recv_topk_weights)
        assert np.array_equal(pad.recv_src_idx[:n], res.recv_src_idx)
        assert (pad.recv_topk_idx[n:] == -1).all() and (pad.recv_src_idx[n:] == -1).all()
        assert (pad.recv_topk_weights[n:] == 0).all() and not np.signbit(pad.recv_topk_weights[n:]).any()


def test_worst_token_rows_padding_holds_no_expert():
    """A grouped GEMM over all N rows sees no pair in the padding: the
    expert-major order of the padded ids is that of the unpadded ones."""
    E_local = NUM_EXPERTS // len(TOKENS)
    for res in _dispatch(alignment=4):
        pad = worst_token_rows(res, res.num_recv_tokens + 9)
        padded = replace(res, recv_topk_idx=pad.recv_topk_idx)
        a, b = ref.expert_major_order(res, E_local, 4), ref.expert_major_order(padded, E_local, 4)
        assert np.array_equal(a.expert_offsets, b.expert_offsets) and np.array_equal(a.rows, b.rows)


def test_worst_token_rows_without_weights():
    res = _dispatch(with_weights=False)[2]
    pad = worst_token_rows(res, res.num_recv_tokens + 3)
    assert pad.recv_topk_weights is None and (pad.recv_topk_idx[-3:] == -1).all()


@pytest.mark.parametrize("bad", [-1, 2.5, None])
def test_worst_token_rows_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="num_worst_tokens"):
        worst_token_rows(_dispatch()[0], bad)


def test_worst_token_rows_rejects_fewer_rows_than_received():
    res = _dispatch()[0]
    assert res.num_recv_tokens > 0
    with pytest.raises(ValueError, match=f"the {res.num_recv_tokens} received rows"):
        worst_token_rows(res, res.num_recv_tokens - 1)


@pytest.mark.parametrize("alignment", [1, 3, 4, 128])
def test_aligned_expert_counts_match_the_reference(alignment):
    """The notify pass hands the host unaligned counts (kept in the handle); aligning
    them gives what a dispatch with that alignment returns."""
    raw = [r.num_recv_tokens_per_expert for r in _dispatch(alignment=1)]
    for counts, res in zip(raw, _dispatch(alignment=alignment)):
        assert aligned_expert_counts(tuple(counts), alignment) == res.num_recv_tokens_per_expert


def test_aligned_expert_counts_unknown_is_none_never_empty():
    assert aligned_expert_counts(None, 4) is None
    assert aligned_expert_counts((0, 0, 0), 128) == [0, 0, 0]
    assert aligned_expert_counts((1, 128, 129), 128) == [128, 128, 256]


def test_result_and_handle_defaults():
    """A result without counts says None (not []); a handle keeps its counts through replace."""
    assert DispatchResult(None, None, None, None).num_recv_tokens_per_expert is None
    h = DispatchHandle(rank_prefix_matrix=None, recv_channel_prefix=None, recv_rank_offset=None, recv_src_idx=None,
                       is_token_in_rank=None, send_head=None, send_list=None, send_channel_prefix=None,
                       num_recv_tokens=5, num_worst_tokens=0, num_tokens=4, hidden=256, num_experts=8,
                       num_channels=2, buffer_id=0)
    assert h.recv_expert_counts is None
    h = replace(h, recv_expert_counts=(3, 2))
    assert replace(h, recv_src_idx=np.zeros(5, np.int32)).recv_expert_counts == (3, 2)
