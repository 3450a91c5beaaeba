"""DeepEP's packed low-latency layout over cupyep's region layout
(cupyep.reference.packed_layout; on the GPU the dispatch and combine kernels of
cuda_src/low_latency), on the CPU.

DeepEP's definition, written out here independently: local expert e's rows
from source r are rows ``[begin, begin + count[e, r])`` of the expert's
``R * T`` packed rows, ``layout_range[e, r] = begin << 32 | count``, the
sources one after another (here in rank order, so ``begin`` is the sum of
the counts of the sources before r), and FP8 scales are the transpose of a
contiguous ``[E_local, S, R * T]`` array. cupyep keeps the same rows at
``[r * C, r * C + count)`` of ``R * C`` region rows.

pack_dispatch (array indexing) is checked against that definition, and so
are a statement-by-statement emulation of the dispatch's own packing
(dispatch.cu pack_received) and of the combine's row of a packed x
(combine.cu x_row); the GPU runs are in tests/gpu/test_low_latency_gpu.py
and tests/gpu/test_deep_ep_gpu.py.
"""
import numpy as np
import pytest

from deep_ep_stubs import stub_tensors

from cupyep import deep_ep, jit
from cupyep.reference import packed_layout as P
from cupyep.low_latency.layout import message_layout


def random_counts(rng, E, R, C, empty_experts=(), empty_sources=0.3):
    counts = rng.integers(0, C + 1, size=(E, R)).astype(np.int32)
    counts[rng.random((E, R)) < empty_sources] = 0
    counts[:, rng.integers(0, R)] = C  # a full region somewhere
    for e in empty_experts:
        counts[e] = 0
    return counts


def deepep_layout(counts, T):
    """DeepEP's packed positions, by walking the sources: for each (e, r) the
    list of packed rows of its q-th row, and layout_range."""
    E, R = counts.shape
    rows, ranges = {}, np.zeros((E, R), np.int64)
    for e in range(E):
        begin = 0
        for r in range(R):
            n = int(counts[e, r])
            rows[(e, r)] = list(range(begin, begin + n))
            ranges[e, r] = (begin << 32) | n
            begin += n
        assert begin <= R * T
    return rows, ranges


CASES = [  # E_local, R, C, T
    (3, 4, 5, 5),
    (2, 8, 3, 7),     # C < T
    (4, 1, 6, 6),     # one rank
    (1, 40, 2, 9),    # more sources than a warp (the kernel's prefix loop)
    (5, 3, 1, 4),     # C = 1
]


@pytest.mark.parametrize("E,R,C,T", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_range_and_row_map_are_deepeps(E, R, C, T, seed):
    rng = np.random.default_rng(seed)
    counts = random_counts(rng, E, R, C, empty_experts=(0,) if E > 1 else ())
    rows, ranges = deepep_layout(counts, T)
    got = P.layout_range(counts)
    assert got.dtype == np.int64 and got.shape == (E, R)
    assert np.array_equal(got, ranges)
    assert np.array_equal(got & 0xFFFFFFFF, counts) and np.array_equal(got >> 32, P.packed_begin(counts))
    e, region, packed = P.row_map(counts, C)
    assert len(e) == counts.sum()
    want = [(ee, r * C + q, rows[(ee, r)][q]) for ee in range(E) for r in range(R) for q in range(counts[ee, r])]
    assert list(zip(e.tolist(), region.tolist(), packed.tolist())) == want
    # every expert's packed rows are exactly [0, recv_count[e])
    for ee in range(E):
        assert sorted(packed[e == ee].tolist()) == list(range(counts[ee].sum()))


def region_dispatch(rng, E, R, C, H, fp8, ue8m0=False):
    """A dispatch result in cupyep's layout: strided views into messages, as
    LowLatencyBuffer.dispatch gives them (stale bytes everywhere)."""
    m = message_layout(H, fp8, ue8m0)
    msgs = rng.integers(0, 256, size=(E, R * C, m.nbytes), dtype=np.uint8)
    recv_x = msgs[:, :, :m.scales].view(np.uint8 if fp8 else np.uint16)
    scales = None
    if fp8:
        n = H // 128
        scales = msgs[:, :, m.scales:m.scales + n * (1 if ue8m0 else 4)]
        scales = scales if ue8m0 else scales.view(np.float32)
    src = msgs[:, :, m.tag:m.tag + 4].view(np.int32)[:, :, 0]
    return msgs, m, recv_x, scales, src


@pytest.mark.parametrize("E,R,C,T", CASES)
@pytest.mark.parametrize("kind", ["bf16", "fp8", "ue8m0"])
def test_pack_gives_deepeps_rows_scales_and_src_info(E, R, C, T, kind):
    rng = np.random.default_rng(E * 100 + R)
    H = 512
    fp8, ue8m0 = kind != "bf16", kind == "ue8m0"
    counts = random_counts(rng, E, R, C, empty_experts=(E - 1,) if E > 1 else ())
    _, _, recv_x, scales, src = region_dispatch(rng, E, R, C, H, fp8, ue8m0)
    out = P.packed_outputs(recv_x, scales, R, T, ue8m0)
    px, ps, pinfo, pranges = out
    assert px.shape == (E, R * T, H) and px.dtype == recv_x.dtype and px.flags.c_contiguous
    if fp8:
        S = H // 512 if ue8m0 else H // 128
        assert ps.shape == (E, R * T, S) and ps.dtype == (np.int32 if ue8m0 else np.float32)
        assert ps.transpose(0, 2, 1).flags.c_contiguous  # column-major in the last two dims, as DeepEP's
    else:
        assert ps is None
    P.pack_dispatch(recv_x, scales, src, counts, C, out)
    rows, ranges = deepep_layout(counts, T)
    assert np.array_equal(pranges, ranges)
    words = None if not fp8 else (np.ascontiguousarray(scales).view(np.int32) if ue8m0 else scales)
    for e in range(E):
        n = int(counts[e].sum())
        # rows [0, recv_count[e]) are the region rows, source after source in rank order
        want = np.concatenate([recv_x[e, r * C:r * C + counts[e, r]] for r in range(R)])
        assert np.array_equal(px[e, :n], want)
        assert np.array_equal(pinfo[e, :n], np.concatenate([src[e, r * C:r * C + counts[e, r]] for r in range(R)]))
        if fp8:
            want_s = np.concatenate([words[e, r * C:r * C + counts[e, r]] for r in range(R)])
            assert np.array_equal(ps[e, :n].view(np.int32), want_s.view(np.int32))
        for r in range(R):
            for q, p in enumerate(rows[(e, r)]):
                assert np.array_equal(px[e, p], recv_x[e, r * C + q])


# --------------------------------------------------- through deep_ep.Buffer, over a stand-in
class _Handle:
    def __init__(self, counts, recv_src, C, T, H, owner):
        self.layout_count, self.recv_src, self.capacity, self.max_tokens = counts, recv_src, C, T
        self.hidden, self.num_experts, self.num_tokens, self.buffer_id = H, counts.shape[0] * counts.shape[1], 3, \
            id(owner)


class _StandIn:
    """cupyep's LowLatencyBuffer in region layout, on NumPy arrays."""

    def __init__(self, rng, E, R, C, T, H):
        self.E, self.R, self.C, self.T, self.H = E, R, C, T, H
        self.num_local_experts, self.num_ranks, self.max_tokens, self.hidden = E, R, T, H
        self.counts = random_counts(rng, E, R, C, empty_experts=(0,))
        self.msgs, _, self.recv_x, self.scales, self.src = region_dispatch(rng, E, R, C, H, True)
        self.combined_from = None

    def dispatch(self, x, topk_idx, **kw):
        """Makes the packed outputs (packed_out=True) and fills them as the dispatch_packed kernel does
        (pack_dispatch is its definition)."""
        from cupyep.low_latency.results import LowLatencyDispatchResult
        h = _Handle(self.counts, self.src, self.C, self.T, self.H, self)
        assert kw["packed_out"] is True
        packed = P.packed_outputs(self.recv_x, self.scales, self.R, self.T, kw["use_ue8m0"])
        P.pack_dispatch(self.recv_x, self.scales, self.src, self.counts, self.C, packed)
        return LowLatencyDispatchResult(self.recv_x, self.scales, self.counts.sum(1).astype(np.int32), h,
                                        packed=packed)

    def combine(self, x, topk_idx, topk_weights, handle, **kw):
        """Records the rows the kernel would read, by region slot (x_row of combine.cu on a packed x)."""
        from cupyep.low_latency.results import LowLatencyCombineResult
        assert kw["x_layout"] == "packed" and x.shape == (self.E, self.R * self.T, self.H)
        self.combined_from = np.zeros((self.E, self.R * self.C, self.H), np.uint16)
        rows = emulate_combine_x_row(self.counts, self.C, self.R * self.T)
        for (e, s, q), row in rows.items():
            self.combined_from[e, s * self.C + q] = x.reshape(-1, self.H)[row]
        return LowLatencyCombineResult(np.zeros((3, self.H), np.uint16))


@pytest.fixture
def ll_buffer(monkeypatch):
    stub_tensors(monkeypatch)
    b = deep_ep.Buffer.__new__(deep_ep.Buffer)
    E, R, C, T, H = 3, 4, 2, 5, 256
    b.validate, b.low_latency_mode, b._ll_staging = False, True, None
    b.low_latency = _StandIn(np.random.default_rng(5), E, R, C, T, H)
    b._ll_sizes = (T, H, E * R)
    return b


def test_buffer_returns_deepeps_packed_layout_and_combines_packed_outputs(ll_buffer):
    b, ll = ll_buffer, ll_buffer.low_latency
    E, R, C, T, H = ll.E, ll.R, ll.C, ll.T, ll.H
    x, idx = np.zeros((3, H), np.uint16), np.zeros((3, 2), np.int64)
    (fp8, scales), count, handle, _, _ = b.low_latency_dispatch(x, idx, T, E * R)
    rows, ranges = deepep_layout(ll.counts, T)
    assert fp8.shape == (E, R * T, H) and scales.shape == (E, R * T, H // 128)
    assert np.array_equal(handle[1], ranges) and handle[0].shape == (E, R * T)
    for e in range(E):
        n = int(count[e])
        assert n == ll.counts[e].sum()
        assert np.array_equal(fp8[e, :n], np.concatenate([ll.recv_x[e, r * C:r * C + ll.counts[e, r]]
                                                          for r in range(R)]))
        assert np.array_equal(handle[0][e, :n], np.concatenate([ll.src[e, r * C:r * C + ll.counts[e, r]]
                                                                for r in range(R)]))
    # combine: the kernel reads each packed row for its region slot
    out = np.random.default_rng(1).integers(0, 1 << 16, size=(E, R * T, H), dtype=np.uint16)
    b.low_latency_combine(out, idx, np.ones((3, 2), np.float32), handle)
    for (e, r), ps in rows.items():
        for q, p in enumerate(ps):
            assert np.array_equal(ll.combined_from[e, r * C + q], out[e, p])
    # zero copy: written into the staging tensor, read in place
    staging = b.get_next_low_latency_combine_buffer(handle)
    assert staging.shape == (E, R * T, H)
    staging[...] = out[::-1]
    b.low_latency_combine(None, idx, np.ones((3, 2), np.float32), handle, zero_copy=True)
    for (e, r), ps in rows.items():
        for q, p in enumerate(ps):
            assert np.array_equal(ll.combined_from[e, r * C + q], out[::-1][e, p])


# --------------------------------------------------- the combine reading packed expert outputs in place
def emulate_combine_x_row(counts, capacity, x_expert_rows):
    """The low-latency combine's row of x for every received row (cuda_src/low_latency/combine.cu: the
    exclusive prefix of the counts over pairs p = e * R + s, pair_of, x_row): {(e, s, q): row of x}."""
    E, R = counts.shape
    P_ = E * R
    count = counts.reshape(-1)
    prefix = np.concatenate([[0], np.cumsum(count)])  # prefix[p], prefix[P] = total
    rows = {}
    for r in range(int(prefix[P_])):
        lo = int(np.searchsorted(prefix, r, side="right") - 1)  # the last p with prefix[p] <= r
        le, s, q = lo // R, lo % R, r - int(prefix[lo])
        slot = le * R * capacity + s * capacity + q
        rows[(le, s, q)] = le * x_expert_rows + (int(prefix[lo]) - int(prefix[le * R])) + q if x_expert_rows \
            else slot
    return rows


@pytest.mark.parametrize("E,R,C,T", CASES)
def test_the_combine_reads_each_packed_row_where_deepeps_layout_puts_it(E, R, C, T):
    """x_layout="packed": every received row (expert e, source s, q-th) is read from row
    e * (R * T) + begin(e, s) + q, begin being DeepEP's (layout_range); the region layout reads its slot."""
    rng = np.random.default_rng(E * 100 + R)
    counts = rng.integers(0, C + 1, size=(E, R)).astype(np.int32)
    deepep_rows, _ = deepep_layout(counts, T)
    packed = emulate_combine_x_row(counts, C, R * T)
    regions = emulate_combine_x_row(counts, C, 0)
    assert set(packed) == {(e, s, q) for (e, s), rs in deepep_rows.items() for q in range(len(rs))}
    for (e, s, q), row in packed.items():
        assert row == e * R * T + deepep_rows[(e, s)][q]
        assert regions[(e, s, q)] == (e * R + s) * C + q
    src = (jit.CUDA_SRC / "low_latency" / "combine.cu").read_text()
    assert ("return a.x_expert_rows ? (int64_t)le * a.x_expert_rows + (prefix[lo] - prefix[le * R]) + q : slot;"
            in src)


# --------------------------------------------------- the dispatch's own packing (dispatch.cu pack_received)
def emulate_pack_received(msgs, m, counts, R, C, packed_rows, H, fp8, ue8m0, dst_x, dst_scales, dst_src, ranges,
                          num_workers=3):
    """pack_received statement by statement: workers (warps) take region rows (le, r, q) grid-strided."""
    El = counts.shape[0]
    row_words = (H if fp8 else 2 * H) // 16
    scale_words = (H // 512 if ue8m0 else H // 128) if fp8 else 0
    flat = msgs.reshape(-1)
    for worker in range(num_workers):
        for item in range(worker, El * R * C, num_workers):
            le, i = item // (R * C), item % (R * C)
            r, q = i // C, i - (i // C) * C
            count = int(counts[le, r])
            if q >= count and q != 0:
                continue
            prefix = int(counts[le, :r].sum())
            if q == 0:
                ranges[le * R + r] = (prefix << 32) | count
            if q >= count:
                continue
            p = le * packed_rows + prefix + q
            msg = ((le * R + r) * C + q) * m.nbytes
            dst_x[p * row_words * 16:(p + 1) * row_words * 16] = flat[msg:msg + row_words * 16]
            if fp8:
                sc = flat[msg + m.scales:msg + m.scales + 4 * scale_words].view(np.uint32)
                for j in range(scale_words):
                    dst_scales[le * scale_words * packed_rows + prefix + q + j * packed_rows] = sc[j]
            dst_src[p] = flat[msg + m.tag:msg + m.tag + 4].view(np.int32)[0]


@pytest.mark.parametrize("E,R,C,T", [(2, 3, 2, 4), (3, 2, 3, 3), (1, 35, 1, 2)])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "ue8m0"])
def test_the_dispatchs_own_packing_is_pack_dispatch(E, R, C, T, kind):
    rng = np.random.default_rng(21 + E + R)
    H = 512
    fp8, ue8m0 = kind != "bf16", kind == "ue8m0"
    counts = random_counts(rng, E, R, C, empty_experts=(0,) if E > 1 else ())
    msgs, m, recv_x, scales, src = region_dispatch(rng, E, R, C, H, fp8, ue8m0)
    want = P.packed_outputs(recv_x, scales, R, T, ue8m0)
    for a in want:
        if a is not None:
            a[...] = 0
    P.pack_dispatch(recv_x, scales, src, counts, C, want)
    row_bytes = H if fp8 else 2 * H
    S = 0 if not fp8 else want[1].shape[2]
    dst_x = np.zeros(E * R * T * row_bytes, np.uint8)
    dst_s = np.zeros(E * S * R * T, np.uint32)
    dst_src, ranges = np.zeros(E * R * T, np.int32), np.zeros(E * R, np.int64)
    emulate_pack_received(msgs, m, counts, R, C, R * T, H, fp8, ue8m0, dst_x, dst_s, dst_src, ranges)
    assert np.array_equal(ranges.reshape(E, R), want[3])
    n = counts.sum(axis=1)
    got_x = dst_x.reshape(E, R * T, row_bytes)
    want_x = want[0].view(np.uint8).reshape(E, R * T, row_bytes)
    assert all(np.array_equal(got_x[e, :n[e]], want_x[e, :n[e]]) for e in range(E))
    assert all(np.array_equal(dst_src.reshape(E, R * T)[e, :n[e]], want[2][e, :n[e]]) for e in range(E))
    if fp8:
        got_s = dst_s.reshape(E, S, R * T)
        want_s = want[1].transpose(0, 2, 1).view(np.uint32)
        assert all(np.array_equal(got_s[e, :, :n[e]], want_s[e, :, :n[e]]) for e in range(E))
    src_cu = (jit.CUDA_SRC / "low_latency" / "dispatch.cu").read_text()
    for line in ("const int r = i / C, q = i - r * C;",
                 "if (q >= count && q != 0) continue;  // warp-uniform",
                 "if (q == 0 && lane == 0) a.packed_range[le * R + r] = ((int64_t)prefix << 32) | (int64_t)(uint32_t)count;",
                 "const int64_t p = (int64_t)le * a.packed_rows + prefix + q;",
                 "const char* msg = recv + ((int64_t)(le * R + r) * C + q) * m.bytes;",
                 "uint32_t* d = a.packed_scales + (int64_t)le * scale_words * a.packed_rows + prefix + q;",
                 "for (int j = lane; j < scale_words; j += 32) d[(int64_t)j * a.packed_rows] = sc[j];",
                 "if (lane == 0) a.packed_src[p] = *reinterpret_cast<const int*>(msg + m.tag);"):
        assert line in src_cu, line
