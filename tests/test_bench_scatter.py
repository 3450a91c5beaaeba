"""Host-side checks of the scatter probe's row patterns (cupyep.lab.bench.scatter)."""
import numpy as np
import pytest

from cupyep.lab.bench.scatter import PATTERNS, pattern_rows, rows_needed
from cupyep.testing import global_routing


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("R,E", [(2, 16), (4, 32), (8, 64)])
def test_every_row_lands_once_inside_the_arrays(pattern, R, E):
    T, k, M = 24, 4, 32
    idx, _ = global_routing(3, [T] * R, E, k)
    n_src, n_dst = rows_needed(pattern, E, R, M, k)
    pairs = sum(int((i >= 0).sum()) for i in idx)
    seen = set()
    for v in range(R):
        s, d, r = pattern_rows(pattern, idx, v, E, M)
        assert s.dtype == np.int32 and d.dtype == np.int32 and r.dtype == np.int64
        assert len(s) == len(d) == len(r)
        assert s.min(initial=0) >= 0 and s.max(initial=0) < n_src
        assert d.min(initial=0) >= 0 and d.max(initial=0) < R
        assert r.min(initial=0) >= 0 and r.max(initial=0) < n_dst
        seen.update(zip(d.tolist(), r.tolist()))
    assert len(seen) == pairs  # every (token, expert) pair once, no two on one destination row


def test_dispatch_rows_go_to_the_expert_owner():
    idx, _ = global_routing(5, [16] * 4, 32, 4)
    s, d, r = pattern_rows("dispatch_expert_major", idx, 2, 32, 16)
    t, j = np.nonzero(idx[2] >= 0)
    assert (s == t).all() and (d == idx[2][t, j] // 8).all()
    assert ((r // 16) % 4 == 2).all()  # (le * R + s) * M + pos: the source's column


def test_unknown_pattern_is_rejected():
    with pytest.raises(ValueError, match="unknown pattern"):
        rows_needed("nope", 32, 4, 16, 4)


def test_scatter_rejects_bad_sizes_before_launch():
    from cupyep.lab.bench.scatter import scatter
    with pytest.raises(ValueError, match="multiple of 16"):
        scatter(0, 0, None, None, None, None, 100, None, 1)
    with pytest.raises(ValueError, match="meta_rows"):
        scatter(0, 0, None, None, None, None, 128, None, 1, meta_offset=256, meta_rows=0)
    with pytest.raises(ValueError, match="smem_bytes"):
        scatter(0, 0, None, None, None, None, 128, None, 1, smem_bytes=1 << 20)


def test_pages_touched_counts_every_page_of_every_row():
    from cupyep.lab.bench.scatter import pages_touched
    MB = 1 << 20
    # Two rows of 1.5 MB: the second straddles pages 1 and 2; both on rank 0.
    rows = (np.array([0, 1]), np.array([0, 0]), np.array([0, 1]))
    assert pages_touched(rows, 3 * MB // 2) == (2, 2)
    assert pages_touched(rows, 3 * MB // 2, page_bytes=MB) == (3, 3)
    # The same destination rows on two ranks are distinct pages.
    rows2 = (np.array([0, 0]), np.array([0, 1]), np.array([0, 0]))
    assert pages_touched(rows2, 4096)[1] == 2
    # Packing touches far fewer destination pages than the expert-major layout.
    idx, _ = global_routing(128, [128] * 8, 256, 8)
    em = pages_touched(pattern_rows("dispatch_expert_major", idx, 0, 256, 128), 7168)[1]
    pk = pages_touched(pattern_rows("dispatch_packed", idx, 0, 256, 128), 7168)[1]
    assert pk * 8 < em
