"""jit.pack writes every kernel argument struct of the package byte for byte
as NumPy's structured assignment does (the reference), nested structs and
padding included; it rejects unknown fields."""
import importlib

import numpy as np
import pytest

from cupyep import jit


MODULES = ["cupyep.errors", "cupyep.normal.layout", "cupyep.normal.expert_major", "cupyep.normal.node_kernels", "cupyep.normal.queue_kernels",
           "cupyep.normal.direct_kernels", "cupyep.normal.internode_kernels", "cupyep.low_latency.kernels", "cupyep.barrier"]


def struct_dtypes():
    seen = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, v in vars(mod).items():
            if isinstance(v, np.dtype) and v.fields and v not in seen.values():
                seen[f"{name}.{attr}"] = v
    return seen


DTYPES = struct_dtypes()


def reference_pack(dtype, values):
    a = np.zeros((), dtype=dtype)
    for k, v in values.items():
        a[k] = v
    return a[()]


def random_values(dtype, rng):
    values = {}
    for name, (ft, _) in dtype.fields.items():
        if ft.fields:
            values[name] = jit.pack(ft, **random_values(ft, rng))
        elif ft.kind == "f":
            values[name] = float(rng.standard_normal())
        elif ft.kind == "b":
            values[name] = bool(rng.integers(2))
        else:
            info = np.iinfo(ft)
            values[name] = int(rng.integers(max(info.min, -2**62), min(info.max, 2**62)))
    return values


def test_there_are_structs_to_check():
    assert len(DTYPES) >= 10


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_pack_matches_structured_assignment(name):
    dtype = DTYPES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    for _ in range(3):
        values = random_values(dtype, rng)
        got = jit.pack(dtype, **values)
        assert got.dtype == dtype and got.tobytes() == reference_pack(dtype, values).tobytes()
        some = dict(list(values.items())[::2])  # unspecified fields are zero
        assert jit.pack(dtype, **some).tobytes() == reference_pack(dtype, some).tobytes()


def test_pack_rejects_an_unknown_field():
    dtype = next(iter(DTYPES.values()))
    with pytest.raises(ValueError, match="no field"):
        jit.pack(dtype, not_a_field=1)


# ------------------------------------------------------------------ ArgTemplate
def test_arg_template_patches_the_words_of_each_source():
    from cupyep.normal.direct_kernels import RECV_LAYOUT_DTYPE

    def pack(a):  # two fields at offsets from "base", one at "x", one constant
        return jit.pack(RECV_LAYOUT_DTYPE, x=a["base"] + 256 if a["base"] else 256, src_idx=a["base"] + 1024,
                        topk_idx=a["x"], rows=7)
    t = jit.ArgTemplate(pack, ("base", "x", "unused"))
    assert t.words == {"base": [0, 4], "x": [2], "unused": []}
    rng = np.random.default_rng(0)
    for _ in range(20):
        addr = [int(v) << 8 for v in rng.integers(1, 1 << 38, size=3)]
        t.check(pack, *addr)
    t.check(pack, 0, 0, 0)


def test_arg_template_refuses_a_pack_that_is_not_an_address_plus_an_offset():
    from cupyep.normal.direct_kernels import RECV_LAYOUT_DTYPE
    with pytest.raises(ValueError, match="source 'x'"):
        jit.ArgTemplate(lambda a: jit.pack(RECV_LAYOUT_DTYPE, x=a["x"] * 2), ("x",))
    with pytest.raises(ValueError, match="whole 8-byte words"):
        jit.ArgTemplate(lambda a: jit.pack(jit.struct_dtype([("a", np.int32)]), a=a["x"]), ("x",))


def _fused_route(R, worst, timeout_s=5.0):
    """A DirectRoute over stand-ins for its node, pools and kernel (what the
    fused dispatch's packing reads of them), for building launch plans."""
    from types import SimpleNamespace

    from cupyep.normal import direct_kernels as D
    from cupyep.normal.direct import DirectRoute
    from cupyep.normal.node import Node
    from cupyep.normal.queue_layout import buffer_layout
    from cupyep.errors import GUARD_DTYPE

    guards = {}

    def guard(kernel, t=None):
        return guards.setdefault(kernel, jit.pack(GUARD_DTYPE, slot=0x7000 + len(guards), timeout_ns=int(timeout_s * 1e9),
                                                  kernel=len(guards), rank=1))
    group = SimpleNamespace(guard=guard, timeout_s=timeout_s)
    node = SimpleNamespace(num_ranks=R, rank=1, group=group, buffer=SimpleNamespace(peer_ptrs=jit.Address((R,), 0x5000)),
                           layout=buffer_layout(R, 1 << 26), host_counts_ptr=0x9000, host_status_index=R * R + 50,
                           sm_budget=132 // R)
    for name in ("notify_shapes", "pack_notify"):
        setattr(node, name, getattr(Node, name).__get__(node))
    pools = SimpleNamespace(num_ranks=R, sync=SimpleNamespace(peer_ptrs=jit.Address((R,), 0x6000)),
                            sync_struct=jit.pack(D.SYNC_DTYPE, dispatch_arrived=64), state=jit.Address((9,), 0x6100))
    route = object.__new__(DirectRoute)
    route.node, route._pools, route._fused = node, pools, {}
    route._budgets, route.measured = {}, False  # what __init__ makes: no measured defaults
    route._kernel = lambda spec, cfg, what, smem=None: SimpleNamespace(kernel=SimpleNamespace(ptr=0x42))
    return route, SimpleNamespace(peer_ptrs=jit.Address((R,), 0x8000))


@pytest.mark.parametrize("R,fp8,weights,worst,em,metrics", [
    (2, False, True, 0, False, False), (8, True, True, 0, False, True), (4, False, False, 4096, False, False),
    (8, False, True, 0, True, False), (2, True, False, 512, True, True)])
def test_fused_dispatch_plan_patches_to_the_full_pack(R, fp8, weights, worst, em, metrics):
    """The fused direct dispatch's launch plan: for any addresses of the
    call's arrays, its patched args equal the packing functions' bytes."""
    from types import SimpleNamespace

    from cupyep.normal import direct_kernels as D
    T, H, k, E = 300, 7168, 8, 64
    route, pool = _fused_route(R, worst)
    x = jit.Address((T, H if fp8 else H), 0x10000)
    call = SimpleNamespace(
        x=SimpleNamespace(shape=(T, H), dtype=np.dtype(np.uint8 if fp8 else np.uint16), data=x),
        x_scales=jit.Address((T, H // 128), 0x20000) if fp8 else None, topk_idx=jit.Address((T, k), 0x30000),
        topk_weights=jit.Address((T, k), 0x40000) if weights else None, num_tokens=T, num_experts=E, num_topk=k,
        hidden=H, fp8=fp8, expert_alignment=4 if em else 1, num_worst_tokens=worst, config=D.DirectConfig().validate().resolved(66),
        kernel_time_ns=jit.Address((2,), 0x50000) if metrics else None,
        notify_time_ns=jit.Address((2,), 0x60000) if metrics else None)
    shape = (H * (1 if fp8 else 2), H // 128 if fp8 else 0, k, True, weights)
    lay = D.recv_layout(R * T, *shape).at(3 << 30)
    plan = route._fused_plan(call, pool, lay, em, (shape, 1, em))
    assert route._fused_plan(call, pool, lay, em, (shape, 1, em)) is plan  # one per call shape
    assert plan.template.sources == D.FUSED_SOURCES
    assert plan.template.words["x"] and plan.template.words["topk_idx"] and len(plan.template.words["base"]) >= 10
    assert bool(plan.template.words["pos"]) == em and bool(plan.template.words["x_scales"]) == fp8
    assert bool(plan.template.words["kernel_time"]) == metrics == bool(plan.template.words["notify_time"])
    rng = np.random.default_rng(R)
    for _ in range(10):
        plan.template.check(plan.pack, *(int(v) << 8 for v in rng.integers(1, 1 << 38, size=len(D.FUSED_SOURCES))))
    assert plan.nbytes >= 4 * T * R and "src_idx" in plan.parts and "in_rank" in plan.parts


def test_arg_template_adds_an_int32_count_into_the_half_of_its_word():
    dt = jit.struct_dtype([("p", np.uint64), ("lo", np.int32), ("hi", np.int32), ("q", np.uint64), ("n", np.int32),
                           ("m", np.int32)])

    def pack(a):
        return jit.pack(dt, p=a["base"] + 64, lo=a["count"], hi=a["other"], q=a["base"], n=7, m=a["count"])
    t = jit.ArgTemplate(pack, ("base", "count", "other"), ints=("count", "other"))
    assert t.words == {"base": [0, 2], "count": [1, 3], "other": [1]}
    rng = np.random.default_rng(1)
    for _ in range(20):
        t.check(pack, int(rng.integers(1, 1 << 38)) << 8, int(rng.integers(0, 2**31)), int(rng.integers(0, 2**31)))
    with pytest.raises(ValueError, match="not sources"):
        jit.ArgTemplate(pack, ("base", "count", "other"), ints=("nope",))


def _queue_route(R):
    """A QueueRoute over stand-ins for its node (what the send's packing reads)."""
    from types import SimpleNamespace

    from cupyep.errors import GUARD_DTYPE
    from cupyep.normal.queue import QueueRoute
    from cupyep.normal.queue_layout import buffer_layout
    guard = jit.pack(GUARD_DTYPE, slot=0x7000, timeout_ns=10**9, kernel=3, rank=1)
    node = SimpleNamespace(num_ranks=R, rank=1, group=SimpleNamespace(guard=lambda kernel: guard),
                           buffer=SimpleNamespace(peer_ptrs=jit.Address((R,), 0x5000)), layout=buffer_layout(R, 1 << 28))
    route = object.__new__(QueueRoute)
    route.node, route._plans = node, {}
    return route


@pytest.mark.parametrize("R,fp8,weights,occupancy,worst", [
    (2, False, True, False, 0), (4, True, True, True, 0), (8, False, False, False, 0), (8, True, False, False, 512)])
def test_queue_send_plan_patches_to_the_full_pack(R, fp8, weights, occupancy, worst):
    """The queue route's launch plan of a notified send: for any addresses
    of the call's arrays and any received count, its patched args equal the
    packing function's bytes, and the notify arrays' offsets are the carve
    plan's."""
    from types import SimpleNamespace

    from cupyep.arrays import Carved, carve_plan
    from cupyep.normal import queue_kernels as K
    from cupyep.normal.config import get_dispatch_config
    from cupyep.normal.layout import LAYOUT_DTYPES
    from cupyep.normal.node import Node
    from cupyep.normal.queue_layout import ring_set
    T, H, k, E = 300, 7168, 8, 64
    route = _queue_route(R)
    cfg = get_dispatch_config(R, 132 // R, fp8)
    C = cfg.num_channels
    parts, nbytes = carve_plan(Node.notify_shapes(route.node, T, E, C, "queue", in_rank=True), dtypes=LAYOUT_DTYPES)
    arrays = Carved(jit.Address((nbytes,), 0x1_0000_0000), parts)
    call = SimpleNamespace(
        x=jit.Address((T, H), 0x10000), x_scales=jit.Address((T, H // 128), 0x20000) if fp8 else None,
        topk_idx=jit.Address((T, k), 0x30000), topk_weights=jit.Address((T, k), 0x40000) if weights else None,
        queue_occupancy=jit.Address((3,), 0x50000) if occupancy else None, num_tokens=T, hidden=H, num_topk=k,
        num_experts=E, fp8=fp8, num_worst_tokens=worst)
    rs = ring_set(route.node.layout, "dispatch", H, k, fp8, cfg)
    plan = route._send_plan(call, cfg, rs, arrays)
    assert route._send_plan(call, cfg, rs, arrays) is plan and plan.num_blocks == 2 * C
    t = plan.template
    assert t.sources == K.SEND_SOURCES and len(t.words["base"]) == 4 and len(t.words["capacity"]) == 1
    assert bool(t.words["x_scales"]) == fp8 and bool(t.words["recv_topk_weights"]) and bool(t.words["queue_occupancy"]) == occupancy
    rng = np.random.default_rng(R)
    for _ in range(10):
        addresses = [int(v) << 8 for v in rng.integers(1, 1 << 38, size=len(K.SEND_SOURCES) - 1)]
        t.check(plan.pack, *addresses, int(rng.integers(0, 2**31)))


@pytest.mark.parametrize("R,layout,worst,timed,transport", [
    (2, True, 0, False, "queue"), (8, True, 512, True, "queue"), (4, False, 0, True, "queue"),
    (8, False, 0, False, "direct"), (4, True, 0, False, "direct")])
def test_notify_plan_patches_to_the_full_pack(monkeypatch, R, layout, worst, timed, transport):
    """A notify pass's launch plan (with the layout in front, or over the
    caller's layout): for any addresses, its patched args equal the packing
    functions' bytes, and it carves what the pass writes."""
    from types import SimpleNamespace

    from cupyep.errors import GUARD_DTYPE
    from cupyep.normal import node as N
    from cupyep.normal.queue_layout import buffer_layout
    monkeypatch.setattr(jit, "kernel", lambda spec: SimpleNamespace(kernel=SimpleNamespace(ptr=0x42), spec=spec))
    guards = {}

    def guard(kernel):
        return guards.setdefault(kernel, jit.pack(GUARD_DTYPE, slot=0x7000 + len(guards), timeout_ns=10**9,
                                                  kernel=len(guards), rank=1))
    node = SimpleNamespace(num_ranks=R, rank=1, group=SimpleNamespace(guard=guard), _notify_plans={},
                           buffer=SimpleNamespace(peer_ptrs=jit.Address((R,), 0x5000)),
                           layout=buffer_layout(R, 1 << 26), host_counts_ptr=0x9000)
    for name in ("notify_shapes", "pack_notify", "_notify_plan"):
        setattr(node, name, getattr(N.Node, name).__get__(node))
    T, k, E, C = 300, 8, 64, 12
    plan = node._notify_plan(T, k, E, layout, C, 4, worst, transport, timed, 0)
    assert node._notify_plan(T, k, E, layout, C, 4, worst, transport, timed, 0) is plan
    t = plan.template
    assert t.sources == (N.NOTIFY_LAYOUT_SOURCES if layout else N.NOTIFY_SOURCES)
    assert ("notify_layout" in plan.fn.spec.name) == layout and ("in_rank" in plan.parts) == layout
    assert len(t.words["base"]) >= 7 + layout and bool(t.words["notify_time"]) == timed
    if layout:
        assert t.words["topk_idx"]
    else:
        assert t.words["per_rank"] and t.words["per_expert"] and t.words["in_rank"]
    rng = np.random.default_rng(R)
    for _ in range(10):
        t.check(plan.pack, *(int(v) << 8 for v in rng.integers(1, 1 << 38, size=len(t.sources))))
