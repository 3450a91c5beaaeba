"""CPU tests of the expert-major layout: the NumPy reference
(expert_major_order with alignment, expert_major_reduce) and the host logic of
cupyep.normal.expert_major (M_cap sizing, struct mirrors, input checks,
ValueErrors raised by Buffer before any launch). Nothing here needs a GPU."""

import re

import ml_dtypes
import numpy as np
import pytest

import cupyep.reference as ref
from cupyep import errors, jit

from cupyep.normal import expert_major as EM
from cupyep.results import DispatchHandle

from cstructs import assert_mirrors, c_structs

NUM_RANKS, NUM_EXPERTS, NUM_TOPK, HIDDEN = 4, 16, 4, 256
NUM_LOCAL = NUM_EXPERTS // NUM_RANKS
TOKENS = [7, 0, 12, 5]


def _dispatch(seed=9, tokens=TOKENS, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK, alignment=1, duplicates=True,
              weights=True):
    idx = ref.make_routing(seed, tokens, num_experts, num_topk, num_masked=5)
    if duplicates and idx[2].shape[0]:
        idx[2][0] = [5, 5, 6, -1][:num_topk] + [-1] * (num_topk - 4)  # a repeated expert: one pair per slot
    x = [ref.make_tagged_x(r, t, HIDDEN) for r, t in enumerate(tokens)]
    w = ref.make_weights(seed, idx) if weights else None
    return ref.intranode_dispatch(x, idx, num_experts, topk_weights=w, expert_alignment=alignment)


def _brute_force_order(recv_topk_idx, num_local, alignment):
    """Loops: per expert, its (row, slot) pairs in row-then-slot order, then -1 padding."""
    offsets, rows, slots = [0], [], []
    for e in range(num_local):
        pairs = [(r, s) for r in range(recv_topk_idx.shape[0]) for s in range(recv_topk_idx.shape[1])
                 if recv_topk_idx[r, s] == e]
        pad = -len(pairs) % alignment
        rows += [r for r, _ in pairs] + [-1] * pad
        slots += [s for _, s in pairs] + [-1] * pad
        offsets.append(offsets[-1] + len(pairs) + pad)
    return np.array(offsets), np.array(rows, dtype=np.int64), np.array(slots, dtype=np.int64)


# ------------------------------------------------------------- reference ---

@pytest.mark.parametrize("alignment", [1, 2, 3, 8, 128])
def test_expert_major_order_matches_loops(alignment):
    for result in _dispatch(alignment=alignment):
        lay = ref.expert_major_order(result, NUM_LOCAL, expert_alignment=alignment)
        offsets, rows, slots = _brute_force_order(result.recv_topk_idx, NUM_LOCAL, alignment)
        assert lay.expert_offsets.dtype == lay.rows.dtype == lay.slot.dtype == np.int64
        assert np.array_equal(lay.expert_offsets, offsets)
        assert np.array_equal(lay.rows, rows) and np.array_equal(lay.slot, slots)
        assert (lay.expert_offsets % alignment == 0).all()
        # The aligned block sizes are the dispatch's aligned per-expert counts.
        assert np.diff(lay.expert_offsets).tolist() == result.num_recv_tokens_per_expert


def test_expert_major_order_alignment_one_is_the_default():
    for result in _dispatch():
        a, b = ref.expert_major_order(result, NUM_LOCAL), ref.expert_major_order(result, NUM_LOCAL, 1)
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("expert_offsets", "rows", "slot"))
        assert (a.rows >= 0).all() and a.rows.size == (result.recv_topk_idx >= 0).sum()


def test_expert_major_order_alignment_keeps_the_pairs():
    for result in _dispatch(alignment=4):
        plain = ref.expert_major_order(result, NUM_LOCAL)
        padded = ref.expert_major_order(result, NUM_LOCAL, 4)
        keep = padded.rows >= 0
        assert np.array_equal(padded.rows[keep], plain.rows) and np.array_equal(padded.slot[keep], plain.slot)
        assert ((padded.rows < 0) == (padded.slot < 0)).all()
        for e in range(NUM_LOCAL):  # padding only at the end of each block
            block = padded.rows[padded.expert_offsets[e]:padded.expert_offsets[e + 1]]
            n = int((block >= 0).sum())
            assert (block[:n] >= 0).all() and (block[n:] == -1).all() and block.size - n < 4


@pytest.mark.parametrize("alignment", [0, -1, 1.5])
def test_expert_major_order_rejects_bad_alignment(alignment):
    with pytest.raises(ValueError, match="expert_alignment"):
        ref.expert_major_order(_dispatch()[0], NUM_LOCAL, alignment)


@pytest.mark.parametrize("alignment", [1, 4])
def test_pair_rows_inverts_the_layout(alignment):
    for result in _dispatch(alignment=alignment):
        lay = ref.expert_major_order(result, NUM_LOCAL, alignment)
        inv = lay.pair_rows(result.num_recv_tokens, NUM_TOPK)
        assert inv.shape == result.recv_topk_idx.shape and inv.dtype == np.int64
        assert np.array_equal(inv >= 0, result.recv_topk_idx >= 0)
        r, s = np.nonzero(inv >= 0)
        assert np.array_equal(lay.rows[inv[r, s]], r) and np.array_equal(lay.slot[inv[r, s]], s)
        # Each pair sits inside its expert's block.
        e = result.recv_topk_idx[r, s]
        assert ((lay.expert_offsets[e] <= inv[r, s]) & (inv[r, s] < lay.expert_offsets[e + 1])).all()


def _brute_force_reduce(y, lay, num_rows, num_topk, weights):
    inv = lay.pair_rows(num_rows, num_topk)
    out = np.zeros((num_rows, y.shape[1]), dtype=np.float64)
    for r in range(num_rows):
        for j in range(num_topk):
            if inv[r, j] >= 0:
                w = 1.0 if weights is None else float(weights[r, j])
                out[r] += w * y[inv[r, j]].astype(np.float64)
    return out.astype(np.float32)


@pytest.mark.parametrize("alignment", [1, 8])
@pytest.mark.parametrize("use_weights", [False, True])
def test_expert_major_reduce_matches_loops(alignment, use_weights):
    rng = np.random.default_rng(3)
    for result in _dispatch(alignment=alignment):
        lay = ref.expert_major_order(result, NUM_LOCAL, alignment)
        M, N = int(lay.expert_offsets[-1]), result.num_recv_tokens
        y = rng.standard_normal((M + 5, HIDDEN)).astype(np.float32)  # extra rows are ignored
        y[M:] = np.nan
        y[:M][lay.rows < 0] = np.nan  # padding rows are never read
        w = result.recv_topk_weights if use_weights else None
        got = ref.expert_major_reduce(y, lay, N, NUM_TOPK, pair_weights=w)
        assert got.dtype == np.float32 and got.shape == (N, HIDDEN)
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got, _brute_force_reduce(y, lay, N, NUM_TOPK, w))


def test_expert_major_reduce_of_copied_rows_scales_them():
    """Identity experts: reducing the expert-major copy of recv_x gives
    recv_x times the sum of the row's local pair weights."""
    for result in _dispatch(alignment=4):
        lay = ref.expert_major_order(result, NUM_LOCAL, 4)
        y = np.where((lay.rows >= 0)[:, None], result.recv_x[np.maximum(lay.rows, 0)], 0).astype(np.float32)
        w = result.recv_topk_weights
        got = ref.expert_major_reduce(y.astype(ml_dtypes.bfloat16), lay, result.num_recv_tokens, NUM_TOPK, w)
        local_w = np.where(result.recv_topk_idx >= 0, w, 0).astype(np.float64).sum(1)
        expected = (result.recv_x.astype(np.float64) * local_w[:, None]).astype(np.float32)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
        ones = ref.expert_major_reduce(y, lay, result.num_recv_tokens, NUM_TOPK)
        counts = (result.recv_topk_idx >= 0).sum(1)
        np.testing.assert_array_equal(ones, result.recv_x.astype(np.float32) * counts[:, None])


def test_expert_major_reduce_rows_without_local_slots_are_zero():
    lay = ref.ExpertMajorLayout(np.array([0, 1, 1]), np.array([2]), np.array([1]))
    y = np.full((1, 128), 3.0, np.float32)
    out = ref.expert_major_reduce(y, lay, 4, 2, pair_weights=np.full((4, 2), 0.5, np.float32))
    assert (out[[0, 1, 3]] == 0).all() and (out[2] == 1.5).all()


def test_expert_major_reduce_rejects_bad_input():
    result = _dispatch()[0]
    lay = ref.expert_major_order(result, NUM_LOCAL)
    N, M = result.num_recv_tokens, int(lay.expert_offsets[-1])
    with pytest.raises(ValueError, match="y must be"):
        ref.expert_major_reduce(np.zeros((M - 1, HIDDEN), np.float32), lay, N, NUM_TOPK)
    with pytest.raises(ValueError, match="pair_weights"):
        ref.expert_major_reduce(np.zeros((M, HIDDEN), np.float32), lay, N, NUM_TOPK,
                                pair_weights=np.zeros((N, NUM_TOPK + 1), np.float32))
    with pytest.raises(ValueError, match="outside"):
        ref.expert_major_reduce(np.zeros((M, HIDDEN), np.float32), lay, N - 1, NUM_TOPK)


# ------------------------------------------------------------------ sizing ---

def test_worst_expert_rows_formula():
    assert EM.worst_expert_rows(1024, 8, 32, 1) == 1024 * 8
    assert EM.worst_expert_rows(1024, 8, 32, 128) == 1024 * 8 + 32 * 127
    assert EM.worst_expert_rows(100, 8, 4, 1) == 400          # min(k, E_local) = E_local
    assert EM.worst_expert_rows(100, 16, 128, 4) == 1600 + 128 * 3
    assert EM.worst_expert_rows(0, 8, 32, 128) == 32 * 127
    for bad in [(-1, 8, 32, 1), (10, 8, 0, 1), (10, 8, 32, 0), (10.5, 8, 32, 1)]:
        with pytest.raises(ValueError):
            EM.worst_expert_rows(*bad)


def test_expert_rows_capacity_exact_and_bound():
    assert EM.expert_rows_capacity([128, 0, 256], 1000, 8, 3, 128) == 384  # exact: sum of aligned counts
    assert EM.expert_rows_capacity([], 10, 8, 3, 1) == 0
    assert EM.expert_rows_capacity(None, 10, 8, 3, 4) == 10 * 3 + 3 * 3
    with pytest.raises(ValueError, match=">= 0"):
        EM.exact_expert_rows([1, -2])
    with pytest.raises(ValueError, match="int32"):
        EM.expert_rows_capacity(None, 2**29, 16, 32, 1)


@pytest.mark.parametrize("alignment", [1, 4, 128])
@pytest.mark.parametrize("num_topk,num_experts", [(4, 16), (8, 64), (2, 16), (16, 64)])
def test_worst_bound_covers_every_layout(alignment, num_topk, num_experts):
    """Without repeated experts in a row, the worst-token bound (with N = the
    rows received, or any larger num_worst_tokens) holds every layout, and the
    normal-mode M_cap is exactly the layout's size."""
    tokens = [40, 0, 33, 64]
    for seed in range(3):
        results = _dispatch(seed, tokens, num_experts, num_topk, alignment, duplicates=False, weights=False)
        E_local = num_experts // len(tokens)
        for result in results:
            lay = ref.expert_major_order(result, E_local, alignment)
            M = int(lay.expert_offsets[-1])
            assert EM.expert_rows_capacity(result.num_recv_tokens_per_expert, 0, num_topk, E_local, alignment) == M
            assert M <= EM.worst_expert_rows(result.num_recv_tokens, num_topk, E_local, alignment)
            assert M <= EM.worst_expert_rows(sum(tokens), num_topk, E_local, alignment)


# ---------------------------------------------------------- structs, specs ---

MIRRORS = [
    (EM.COUNT_ARGS_DTYPE, "ExpertMajorCountArgs"),
    (EM.MAP_ARGS_DTYPE, "ExpertMajorMapArgs"),
    (EM.COPY_ARGS_DTYPE, "ExpertMajorCopyArgs"),
    (EM.REDUCE_ARGS_DTYPE, "ExpertMajorReduceArgs"),
]


@pytest.mark.parametrize("dtype,cname", MIRRORS, ids=[c for _, c in MIRRORS])
def test_dtype_mirrors_c_struct(dtype, cname):
    assert_mirrors(dtype, cname, c_structs())


def test_permute_structs_are_defined_once():
    text = "\n".join(p.read_text() for p in jit.CUDA_SRC.rglob("*") if p.suffix in (".cu", ".cuh"))
    for _, cname in MIRRORS:
        assert len(re.findall(rf"\bstruct\s+{cname}\s*\{{", text)) == 1, cname


def test_struct_sizes():
    assert EM.COUNT_ARGS_DTYPE.itemsize == 4 * 8 + 3 * 4 + 4
    assert EM.MAP_ARGS_DTYPE.itemsize == 6 * 8 + 5 * 4 + 4 + 24
    assert EM.COPY_ARGS_DTYPE.itemsize == 6 * 8 + 8 + 3 * 4 + 4
    assert EM.REDUCE_ARGS_DTYPE.itemsize == 5 * 8 + 8 + 3 * 4 + 4
    assert EM.MAP_ARGS_DTYPE.fields["guard"][1] % 8 == 0


def test_permute_spec_is_registered_and_names_its_kernels():
    spec = EM.permute_spec()
    assert spec in jit.all_specs()
    assert "cupyep.normal.expert_major" in jit.SPEC_MODULES
    text = (jit.CUDA_SRC / spec.source).read_text()
    for name in spec.kernels:
        assert name.startswith("cupyep::normal::")
        assert re.search(rf"__global__ void __launch_bounds__\(\w+\) {name.split('::')[-1]}\(", text), name
    # Threads per block the host launches with are the kernels' launch bounds.
    consts = dict(re.findall(r"constexpr int (k\w+Threads) = (\d+);", text))
    assert (int(consts["kCountThreads"]), int(consts["kMapThreads"]), int(consts["kCopyThreads"]),
            int(consts["kReduceThreads"])) == (EM.COUNT_THREADS, EM.MAP_THREADS, EM.COPY_THREADS, EM.REDUCE_THREADS)
    assert EM.MAP_THREADS % 32 == 0 and EM.MAP_THREADS <= 1024


def test_capacity_error_has_a_kernel_name():
    kid = errors.kernel_id("expert_major")
    slot = np.zeros(1, errors.ERROR_SLOT_DTYPE)[0]
    slot["flag"], slot["kernel"], slot["rank"], slot["peer"], slot["value"], slot["expected"] = 3, kid, 1, -1, 9, 8
    err = errors.error_from_slot(slot, 1.0)
    assert err.kernel == "expert_major" and "capacity" in err.phase and "(counter 9, expected 8)" in str(err)


# -------------------------------------------------------------- validation ---

def test_check_expert_major_request():
    with pytest.raises(ValueError, match="needs topk_idx"):
        EM.check_expert_major_request(None, 1)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="expert_alignment"):
            EM.check_expert_major_request(np.zeros((2, 2), np.int64), bad)
    EM.check_expert_major_request(np.zeros((2, 2), np.int64), 128)


def test_combine_is_expert_major_auto_and_explicit():
    f = EM.combine_is_expert_major
    # (x rows, N, M_cap, has map, expert_major, pair weights)
    assert f(10, 10, 0, False, None, False) is False            # plain handle
    assert f(30, 10, 30, True, None, False) is True             # M_cap rows: expert-major
    assert f(30, 10, 30, True, None, True) is True
    assert f(10, 10, 30, True, None, False) is False            # N rows: rank-major
    assert f(10, 10, 10, True, None, False) is True             # M_cap == N: expert-major unless told
    assert f(10, 10, 10, True, False, False) is False
    assert f(10, 10, 10, True, True, True) is True
    with pytest.raises(ValueError, match="pair_weights"):
        f(10, 10, 30, True, None, True)                          # weights with rank-major rows
    with pytest.raises(ValueError, match="pair_weights"):
        f(10, 10, 0, False, None, True)
    with pytest.raises(ValueError, match="pair_weights"):
        f(10, 10, 10, True, False, True)
    with pytest.raises(ValueError, match="needs a handle"):
        f(10, 10, 0, False, True, False)
    with pytest.raises(ValueError, match="expert-major x has 11 rows"):
        f(11, 10, 30, True, True, False)
    with pytest.raises(ValueError, match=r"x has 11 rows, the dispatch received 10 \(or 30 expert-major rows\)"):
        f(11, 10, 30, True, None, False)
    with pytest.raises(ValueError, match=r"x has 11 rows, the dispatch received 10$"):
        f(11, 10, 0, False, None, False)


def test_check_pair_weights():
    assert EM.check_pair_weights(None, 3, 2) is None
    w = np.zeros((3, 2), np.float32)
    assert EM.check_pair_weights(w, 3, 2) is w
    with pytest.raises(ValueError, match="dtype float32"):
        EM.check_pair_weights(w.astype(np.float64), 3, 2)
    with pytest.raises(ValueError, match=r"shape \[3, 2\]"):
        EM.check_pair_weights(np.zeros((3, 3), np.float32), 3, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        EM.check_pair_weights(np.zeros((2, 3), np.float32).T, 3, 2)


# ------------------------------------ Buffer raises before any launch (no GPU) ---

class _NoLaunch:
    """Stands in for anything that would touch the GPU."""

    def __getattr__(self, name):
        raise AssertionError(f"reached the GPU path ({name}) instead of raising ValueError")


@pytest.fixture
def fake_buffer(monkeypatch):
    """A Buffer object without a GPU: host arrays pass the input checks, and
    anything that would launch or allocate fails the test."""
    from cupyep import arrays

    from cupyep.normal import buffer as B
    monkeypatch.setattr(B, "as_cupy", lambda a, name: a)
    monkeypatch.setattr(arrays, "as_cupy", lambda a, name: a)  # dispatch_rows' conversion
    from types import SimpleNamespace

    from cupyep.normal.direct import DirectRoute
    from cupyep.normal.queue import QueueRoute
    from cupyep.sizes import DeclaredSizes
    buf = object.__new__(B.Buffer)
    buf.num_ranks, buf.rank, buf.internode = 2, 0, False
    buf.sizes = DeclaredSizes()
    buf.group = buf.comm_stream = buf._calls = _NoLaunch()
    node = SimpleNamespace(num_ranks=2, rank=0, sm_budget=66, num_device_sms=132, buffer_id=id(buf),
                           group=_NoLaunch(), layout=_NoLaunch(), buffer=_NoLaunch())
    queue, direct = object.__new__(QueueRoute), object.__new__(DirectRoute)
    queue.node = direct.node = node
    for route in (queue, direct):  # the caches their __init__ makes
        route._configs, route._kernels = {}, {}
    buf.routes = {"queue": queue, "direct": direct}
    return buf


def _handle(buf, T=4, N=6, k=2, M=9, expert_map=True):
    return DispatchHandle(
        rank_prefix_matrix=None, recv_channel_prefix=None, recv_rank_offset=None, recv_src_idx=None,
        is_token_in_rank=None, send_head=None, send_list=None, send_channel_prefix=None, num_recv_tokens=N,
        num_worst_tokens=0, num_tokens=T, hidden=256, num_experts=8, num_channels=buf.default_dispatch_config().num_channels,
        buffer_id=id(buf), recv_expert_row=np.zeros((N, k), np.int32) if expert_map else None,
        num_expert_rows=M if expert_map else 0)


def test_dispatch_expert_major_without_topk_idx_raises(fake_buffer):
    x = np.zeros((4, 256), np.uint16)
    with pytest.raises(ValueError, match="needs topk_idx"):
        fake_buffer.dispatch(x, handle=_handle(fake_buffer), expert_major=True)
    with pytest.raises(ValueError, match="needs topk_idx"):
        fake_buffer.dispatch(x, num_experts=8, expert_major=True)


def test_combine_pair_weights_with_rank_major_x_raises(fake_buffer):
    h = _handle(fake_buffer)
    w = np.zeros((6, 2), np.float32)
    with pytest.raises(ValueError, match="pair_weights weight expert-major rows"):
        fake_buffer.combine(np.zeros((6, 256), np.uint16), h, pair_weights=w)
    with pytest.raises(ValueError, match="pair_weights"):
        fake_buffer.combine(np.zeros((6, 256), np.uint16), _handle(fake_buffer, expert_map=False), pair_weights=w)
    with pytest.raises(ValueError, match=r"pair_weights must have shape \[6, 2\]"):
        fake_buffer.combine(np.zeros((9, 256), np.uint16), h, pair_weights=np.zeros((9, 2), np.float32))
    with pytest.raises(ValueError, match="rows"):
        fake_buffer.combine(np.zeros((7, 256), np.uint16), h)
    with pytest.raises(ValueError, match="needs a handle"):
        fake_buffer.combine(np.zeros((6, 256), np.uint16), _handle(fake_buffer, expert_map=False), expert_major=True)


@pytest.mark.parametrize("alignment", [0, -4, 2.5])
def test_dispatch_rejects_bad_expert_alignment(fake_buffer, alignment):
    x = np.zeros((4, 256), np.uint16)
    with pytest.raises(ValueError, match="expert_alignment must be an integer >= 1"):
        fake_buffer.dispatch(x, np.zeros((4, 2), np.int64), num_experts=8, expert_alignment=alignment)
    with pytest.raises(ValueError, match="expert_alignment must be an integer >= 1"):
        fake_buffer.dispatch(x, handle=_handle(fake_buffer), expert_alignment=alignment)
