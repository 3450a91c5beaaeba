"""DeepEP's contract on every normal-mode route, in the orders real schedules
use: one buffer serves every call; each dispatch's results and handle stay
valid until dropped (the one-copy routes: until their pool slot goes to a
later dispatch, which then raises StaleResultError); combine and cached
dispatch take any live handle, any number of times, in any order.

Routes: within a node the queue and the direct transport; across (emulated)
nodes the two-hop and the direct route. Every schedule is checked bitwise
against the same calls run one after another, and against the reference
(dispatch exactly, with payloads tagged by source rank and token; combine
within calc_diff 5e-6), in BF16 and FP8.

    python3 -m cupyep.launcher.gpu_tests -k contract                       # 2, 4, 8 ranks
    python3 -m cupyep.launcher.gpu_tests --ranks 4 8 --ranks-per-node 2 -k contract
"""
import numpy as np
import pytest

from cupyep import reference as ref

from cupyep.testing import all_ranks, bf16_to_f32, global_routing, payload_bf16
from graphs import capture, replay

pytestmark = pytest.mark.gpu
E, K_TOPK, H, T_MAX = 64, 8, 2048, 256
GRAD = 100_000  # token tags of the backward's rows: unlike any forward row's


@pytest.fixture(scope="module")
def buf(request, group):
    """One buffer for every test and route, as one buffer serves every layer."""
    import cupyep
    if group.num_nodes > 1:
        request.getfixturevalue("nvshmem_session")
    b = cupyep.Buffer(group, max_tokens=T_MAX, hidden=H, num_topk=K_TOPK, num_in_flight=2)
    yield b
    b.destroy()


@pytest.fixture(params=["default", "direct"])
def transport(request):
    """None: the queue transport within a node, the two-hop route across nodes;
    "direct": the one-copy route of either."""
    return None if request.param == "default" else "direct"


class Batch:
    """One micro-batch (or layer): a seeded routing over every rank, this
    rank's tagged rows (tokens offset by ``tag``) and the reference's
    expected dispatch (one node's dispatch over all ranks: what every route
    delivers) and combine."""

    def __init__(self, group, seed: int, num_tokens: int = T_MAX, tag: int = 0):
        import cupy
        W, me = group.world_size, group.rank
        self.tokens = [num_tokens] * W
        self.idx, self.w = global_routing(seed, self.tokens, E, K_TOPK)
        ids = [np.arange(t, dtype=np.int32)[:, None] for t in self.tokens]
        self.res = ref.intranode_dispatch(ids, self.idx, E, topk_weights=self.w)
        self.me, self.tag = me, tag
        self.x = cupy.asarray(payload_bf16(me, np.arange(num_tokens) + tag, H))
        self.topk_idx, self.topk_weights = cupy.asarray(self.idx[me]), cupy.asarray(self.w[me])

    def rows(self, rank=None, tag=None) -> np.ndarray:
        """[N, H] uint16: the rows ``rank`` (default: this one) receives, rebuilt from the tags."""
        r = self.res[self.me if rank is None else rank]
        tag = self.tag if tag is None else tag
        out = np.empty((r.num_recv_tokens, H), dtype=np.uint16)
        for s in np.unique(r.recv_src_rank):
            sel = r.recv_src_rank == s
            out[sel] = payload_bf16(int(s), r.recv_src_idx[sel] + tag, H)
        return out

    def combined(self, tag=None) -> np.ndarray:
        """[T, H] float32: the reference combine of identity experts over the rows tagged ``tag``."""
        rows = [bf16_to_f32(self.rows(r, tag)) for r in range(len(self.res))]
        return ref.intranode_combine(rows, self.res, self.tokens)[self.me]


def _x(batch, fp8: bool, tag=None):
    """The rows a dispatch sends: BF16, or the FP8 tuple of the same rows."""
    import cupy
    from cupyep.fp8 import per_token_cast_to_fp8
    x = batch.x if tag is None else cupy.asarray(payload_bf16(batch.me, np.arange(batch.tokens[batch.me]) + tag, H))
    return per_token_cast_to_fp8(x) if fp8 else x


def _dispatch_checks(out, batch, fp8: bool, tag=None, with_routing: bool = True) -> dict:
    """The result against the reference, exactly (FP8: the cast of the expected BF16 rows)."""
    import cupy
    from cupyep.fp8 import per_token_cast_to_fp8
    exp = batch.res[batch.me]
    rows = batch.rows(tag=tag)
    checks = {"recv_src_idx": np.array_equal(out.handle.recv_src_idx.get()[:exp.num_recv_tokens], exp.recv_src_idx)}
    if fp8:
        want_x, want_s = per_token_cast_to_fp8(cupy.asarray(rows))
        checks["recv_x"] = np.array_equal(out.recv_x.get(), want_x.get())
        checks["recv_x_scales"] = np.array_equal(out.recv_x_scales.get(), want_s.get())
    else:
        checks["recv_x"] = np.array_equal(out.recv_x.get(), rows)
    if with_routing:
        checks["recv_topk_idx"] = np.array_equal(out.recv_topk_idx.get(), exp.recv_topk_idx)
        checks["recv_topk_weights"] = np.array_equal(out.recv_topk_weights.get(), exp.recv_topk_weights)
    return checks


def _dispatch(buf, batch, transport, fp8=False, **kw):
    return buf.dispatch(_x(batch, fp8), batch.topk_idx, batch.topk_weights, num_experts=E, transport=transport, **kw)


def _combine(buf, batch, handle, tag=None):
    """Combine of identity experts: the BF16 rows the dispatch delivered (tagged ``tag``)."""
    import cupy
    return buf.combine(cupy.asarray(batch.rows(tag=tag)), handle).combined_x.get()


def _close(got, want) -> bool:
    return ref.calc_diff(bf16_to_f32(got), want) < 5e-6


def _check(group, checks: dict, what: str):
    assert all_ranks(group.comm, all(checks.values())), (what, {k: v for k, v in checks.items() if not v})


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_two_micro_batches(group, buf, transport, fp8):
    """Dispatch A, dispatch B, both results checked after both dispatches,
    then combine A and combine B, then B and A again, and A once more: each
    bitwise the serial run of the same calls, and the reference."""
    a, b = Batch(group, 11), Batch(group, 12, tag=5000)
    serial = {}
    for name, batch in (("A", a), ("B", b)):
        out = _dispatch(buf, batch, transport, fp8)
        _check(group, _dispatch_checks(out, batch, fp8), f"serial dispatch {name}")
        serial[name] = _combine(buf, batch, out.handle)
    da = _dispatch(buf, a, transport, fp8)
    db = _dispatch(buf, b, transport, fp8)
    checks = {f"A {k}": v for k, v in _dispatch_checks(da, a, fp8).items()}
    checks.update({f"B {k}": v for k, v in _dispatch_checks(db, b, fp8).items()})
    _check(group, checks, "both micro-batches after both dispatches")
    got = {"A": _combine(buf, a, da.handle), "B": _combine(buf, b, db.handle)}
    got2 = {"B": _combine(buf, b, db.handle), "A": _combine(buf, a, da.handle)}
    again = _combine(buf, a, da.handle)
    checks = {f"{n} bitwise serial": np.array_equal(got[n], serial[n]) for n in "AB"}
    checks.update({f"{n} reversed order": np.array_equal(got2[n], serial[n]) for n in "AB"})
    checks["A a third time"] = np.array_equal(again, serial["A"])
    checks.update({f"{n} reference": _close(got[n], bt.combined()) for n, bt in (("A", a), ("B", b))})
    _check(group, checks, "combines of two micro-batches")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_forward_then_backward(group, buf, transport, fp8):
    """A two-layer forward (dispatch, experts, combine per layer), then the
    backward in reverse layer order: the backward of combine is a cached
    dispatch of the layer's gradient rows on the forward handle (only x),
    the backward of dispatch is a combine on the same handle. Each output
    against the reference, and each combine bitwise the same combine right
    after a fresh dispatch of that routing."""
    layers = [Batch(group, 21), Batch(group, 22, tag=7000)]
    fwd = []
    for i, layer in enumerate(layers):
        out = _dispatch(buf, layer, transport, fp8)
        _check(group, _dispatch_checks(out, layer, fp8), f"forward dispatch {i}")
        fwd.append((out.handle, _combine(buf, layer, out.handle)))
    checks = {}
    for i in reversed(range(len(layers))):
        layer, (handle, y_fwd) = layers[i], fwd[i]
        grad = buf.dispatch(_x(layer, fp8, tag=GRAD + 1000 * i), handle=handle)
        for k, v in _dispatch_checks(grad, layer, fp8, tag=GRAD + 1000 * i, with_routing=False).items():
            checks[f"backward cached dispatch {i} {k}"] = v
        checks[f"backward cached dispatch {i} has no weights"] = grad.recv_topk_weights is None
        g = _combine(buf, layer, handle, tag=GRAD + 1000 * i)
        checks[f"backward combine {i} reference"] = _close(g, layer.combined(tag=GRAD + 1000 * i))
        checks[f"forward combine {i} reference"] = _close(y_fwd, layer.combined())
        serial = _dispatch(buf, layer, transport, fp8)
        checks[f"backward combine {i} bitwise serial"] = np.array_equal(
            g, _combine(buf, layer, serial.handle, tag=GRAD + 1000 * i))
    _check(group, checks, "forward then backward")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_graph_replay_of_two_micro_batches(group, buf, transport, fp8):
    """Worst-token mode (no host read) captured in one CUDA graph: dispatch A,
    dispatch B, combine A, combine B; replayed with new routings written into
    the captured inputs (the combines' inputs too: the expected BF16 rows of
    identity experts, padded with zeros), each replay against the reference."""
    import cupy
    from cupyep.fp8 import per_token_cast_to_fp8
    W = group.world_size
    worst = W * T_MAX
    stream = cupy.cuda.Stream(non_blocking=True)
    ins = [{"x": cupy.empty((T_MAX, H), np.uint16), "idx": cupy.empty((T_MAX, K_TOPK), np.int64),
            "w": cupy.empty((T_MAX, K_TOPK), np.float32), "y": cupy.zeros((worst, H), np.uint16),
            "x8": cupy.empty((T_MAX, H), np.uint8), "s8": cupy.empty((T_MAX, H // 128), np.float32)}
           for _ in range(2)]

    def load(batches):
        for i, bt in zip(ins, batches):
            i["x"].set(bt.x.get())
            i["idx"].set(bt.idx[bt.me])
            i["w"].set(bt.w[bt.me])
            rows = bt.rows()
            i["y"].fill(0)
            i["y"][:len(rows)].set(rows)
            if fp8:
                x8, s8 = per_token_cast_to_fp8(i["x"])
                i["x8"][...], i["s8"][...] = x8, s8

    def step():
        outs = [buf.dispatch((i["x8"], i["s8"]) if fp8 else i["x"], i["idx"], i["w"], num_experts=E,
                             num_worst_tokens=worst, validate=False, transport=transport) for i in ins]
        return outs, [buf.combine(i["y"], o.handle).combined_x for i, o in zip(ins, outs)]

    with stream:
        load([Batch(group, 30), Batch(group, 31, tag=3000)])
        step()  # compiles, and allocates the pools, outside capture
        stream.synchronize()
    graph, (outs, combined) = capture(stream, group, step)
    for it in range(2):
        batches = [Batch(group, 32 + 2 * it), Batch(group, 33 + 2 * it, tag=3000)]
        replay(stream, group, graph, lambda: load(batches))
        checks = {}
        for name, out, comb, bt in zip("AB", outs, combined, batches):
            n = bt.res[bt.me].num_recv_tokens
            if fp8:
                want_x, want_s = per_token_cast_to_fp8(cupy.asarray(bt.rows()))
                checks[f"{name} recv_x"] = np.array_equal(out.recv_x.get()[:n], want_x.get())
                checks[f"{name} recv_x_scales"] = np.array_equal(out.recv_x_scales.get()[:n], want_s.get())
            else:
                checks[f"{name} recv_x"] = np.array_equal(out.recv_x.get()[:n], bt.rows())
            checks[f"{name} recv_topk_idx"] = np.array_equal(out.recv_topk_idx.get()[:n], bt.res[bt.me].recv_topk_idx)
            checks[f"{name} padding ids"] = bool((out.recv_topk_idx.get()[n:] == -1).all())
            checks[f"{name} combine"] = _close(comb.get(), bt.combined())
        _check(group, checks, f"replay {it}")
    group.comm.Barrier()


def test_a_stale_result_raises_and_its_handle_still_combines(group, buf, transport):
    """On a route whose results live in pool slots (the direct route, and
    across nodes both) the third dispatch reuses the first's slot
    (num_in_flight=2): reading the first result raises StaleResultError,
    its handle still combines exactly, and a fresh=True result stays valid.
    On the queue route results are the caller's own and never stale."""
    import cupyep
    a, b, c = Batch(group, 41), Batch(group, 42, tag=1000), Batch(group, 43, tag=2000)
    da = _dispatch(buf, a, transport)
    own = _dispatch(buf, a, transport, fresh=True)
    _dispatch(buf, b, transport)
    _dispatch(buf, c, transport)
    one_copy = transport == "direct" or group.num_nodes > 1  # across nodes both routes write into pool slots
    checks = {"stale flag": da.stale == one_copy, "fresh stays": not own.stale and own.lease is None}
    if one_copy:
        with pytest.raises(cupyep.StaleResultError, match="recv_x"):
            da.recv_x
        if group.num_nodes == 1:  # its zero-copy buffer belongs to the slot too
            with pytest.raises(cupyep.StaleResultError, match="zero-copy"):
                buf.get_combine_buffer(da.handle)
    else:
        checks["queue rows still readable"] = np.array_equal(da.recv_x.get(), a.rows())
    checks.update({f"fresh {k}": v for k, v in _dispatch_checks(own, a, False).items()})
    checks["stale handle combines"] = _close(_combine(buf, a, da.handle), a.combined())
    _check(group, checks, "stale result")


def test_layout_on_every_layout_of_ranks(group, buf):
    """get_dispatch_layout within and across nodes against the reference;
    across nodes it also counts the tokens per node (DeepEP's
    num_tokens_per_rdma_rank), within a node that is None."""
    import cupy
    a = Batch(group, 51)
    lay = buf.get_dispatch_layout(a.topk_idx, E)
    K = group.local_size if group.num_nodes > 1 else None
    want = ref.get_dispatch_layout(a.idx[a.me], E, group.world_size, K)
    checks = {"per rank": np.array_equal(lay.num_tokens_per_rank.get(), want.num_tokens_per_rank),
              "per expert": np.array_equal(lay.num_tokens_per_expert.get(), want.num_tokens_per_expert),
              "in rank": np.array_equal(lay.is_token_in_rank.get(), want.is_token_in_rank)}
    if group.num_nodes > 1:
        checks["per node"] = np.array_equal(cupy.asnumpy(lay.num_tokens_per_rdma_rank), want.num_tokens_per_node)
    else:
        checks["per node"] = lay.num_tokens_per_rdma_rank is None
    _check(group, checks, "layout")


def test_a_call_past_the_declared_sizes_names_the_argument(group, buf, transport):
    """More tokens, channels or experts per token than the buffer was made
    for: ValueError naming the constructor argument, before anything runs."""
    import cupy
    a = Batch(group, 61)
    for kw, name in (({"x": cupy.zeros((T_MAX + 1, H), np.uint16), "idx": cupy.zeros((T_MAX + 1, K_TOPK), np.int64)},
                      "max_tokens"),
                     ({"x": cupy.zeros((4, 2 * H), np.uint16), "idx": a.topk_idx[:4]}, "hidden")):
        with pytest.raises(ValueError, match=name):
            buf.dispatch(kw["x"], kw["idx"], num_experts=E, transport=transport)
    out = _dispatch(buf, a, transport)  # the buffer is unharmed
    _check(group, _dispatch_checks(out, a, False), "after the refused calls")


def test_ranks_that_disagree_on_a_shared_argument_all_raise(group, buf, transport):
    """One rank dispatches FP8 rows while the others send BF16, or without
    weights while the others send them: a ValueError on every rank naming
    the argument (each rank's value in it), before anything is launched;
    the buffer is unharmed."""
    a = Batch(group, 71)
    odd = group.rank == group.world_size - 1
    with pytest.raises(ValueError, match="disagree on fp8"):
        buf.dispatch(_x(a, fp8=odd), a.topk_idx, a.topk_weights, num_experts=E, transport=transport)
    with pytest.raises(ValueError, match="disagree on topk_weights"):
        buf.dispatch(a.x, a.topk_idx, None if odd else a.topk_weights, num_experts=E, transport=transport)
    out = _dispatch(buf, a, transport)
    _check(group, _dispatch_checks(out, a, False), "after the refused calls")
